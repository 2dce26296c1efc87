"""Structured output's cost: tokens/s with a JSON schema against unconstrained, on the default model.

    python -m bench.structured [--streams 1 64] [--max-tokens 64] [--rounds 3] [--mask-threads N]
    python -m bench.structured --fill 64 [--threads 2 4]
    python -m bench.structured --sampler 64 [--threads 1 2]

Each round runs, per stream count, one `LLM.generate` of that many copies of a chat prompt,
unconstrained (`ignore_eos`), with a JSON schema (an array of 200 small integers, so no output
ends before `--max-tokens`) and its masks computed while the forward runs (the default), and
with the same schema and the masks computed in the sampler after the forward
(`sampler.masks.enabled = False`): all generate exactly streams x max_tokens tokens. Rounds
alternate the three; the median round of each counts (the machine may be shared), and beside it
the paired change: the median over rounds of each round's schema / unconstrained ratio, which a
drift of the machine's speed across rounds does not move.
`--mask-threads` sets the threads of the parallel mask fill (default: the engine's CPU threads;
1 fills row by row). Prints a
table, then one JSON line with the load average before and after.

`--fill ROWS` measures the mask fill alone instead (no model): one step's masks for ROWS
requests of a JSON schema at different points of their output, filled one row at a time and by
one parallel llguidance call on each `--threads` count, interleaved; the median of 30 fills each.

`--sampler ROWS` measures the sampler alone (no model, no fill): one step of ROWS rows of random
logits over the default model's vocabulary at temperature 0.7, with no constraint, with half
the rows and with all rows under the JSON schema (their masks computed beforehand, as the
overlap leaves them); the median of 30 calls each, interleaved, and the differences: what the
masks add to a step;
once per `--threads` count (torch threads).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 200}


def run(llm, prompt: str, streams: int, max_tokens: int, constrained: bool) -> float:
    from nanovllm import SamplingParams

    fmt = {"type": "json_schema", "json_schema": {"name": "numbers", "schema": SCHEMA}} if constrained else None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=0, ignore_eos=not constrained,
                            response_format=fmt)
    start = time.perf_counter()
    outs = llm.generate([prompt] * streams, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o["token_ids"]) for o in outs)
    assert tokens == streams * max_tokens, (tokens, [o["finish_reason"] for o in outs])
    return tokens / elapsed


FILL_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "age": {"type": "integer", "minimum": 18, "maximum": 99},
                                     "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}}},
    "required": ["name", "age", "tags"]}}}


def fill(rows: int, threads: list[int], reps: int = 30) -> None:
    import llguidance

    from nanovllm.models.tokenizer import load_tokenizer
    from nanovllm.structured import StructuredOutput, compile_format, ll_tokenizer, prepare_masks

    tok = load_tokenizer("default")
    lltok = ll_tokenizer(tok, len(tok))
    grammar = compile_format(FILL_SCHEMA, lltok)
    prefix = lltok.tokenize_str('{"name":"Alice","age":42,"tags":["red"')

    def once(executor) -> float:
        jobs = [(StructuredOutput(grammar, lltok), prefix[: i % (len(prefix) + 1)]) for i in range(rows)]
        for g, output in jobs:
            g._follow(output)  # the tokens consumed before the clock starts: the fill alone
        start = time.perf_counter()
        prepare_masks(jobs, executor)
        return time.perf_counter() - start

    load_before = os.getloadavg()
    modes = {"serial_ms": None, **{f"parallel_{n}_threads_ms": llguidance.LLExecutor(n) for n in threads}}
    times: dict[str, list[float]] = {name: [] for name in modes}
    for rep in range(reps + 2):  # the modes interleaved, so a burst of load falls on all of them
        for name, executor in modes.items():
            t = once(executor)
            if rep >= 2:
                times[name].append(t)
    result = {name: round(statistics.median(v) * 1e3, 2) for name, v in times.items()}
    for name, ms in result.items():
        print(f"{rows} rows, {name}: {ms}")
    print(json.dumps({"bench": "structured_fill", "rows": rows, **result, "cpus": len(os.sched_getaffinity(0)),
                      "loadavg_before": load_before, "loadavg_after": os.getloadavg()}))


def sampler(rows: int, threads: list[int], reps: int = 30) -> None:
    import torch

    from nanovllm import SamplingParams
    from nanovllm.engine.sequence import Sequence
    from nanovllm.engine.sampler import Sampler
    from nanovllm.engine.sequence import SamplingState
    from nanovllm.layers.cpu_kernels import CpuOps
    from nanovllm.models.tokenizer import load_tokenizer
    from nanovllm.structured import StructuredOutput, compile_format, ll_tokenizer

    tok = load_tokenizer("default")
    vocab = len(tok)
    lltok = ll_tokenizer(tok, vocab)
    fmt = {"type": "json_schema", "json_schema": {"name": "numbers", "schema": SCHEMA}}
    grammar = compile_format(fmt, lltok)
    prefix = lltok.tokenize_str("[1,22,333,4")  # rows at different points of the array
    logits = torch.randn(rows, vocab) * 3  # (rows, V)

    def batch(every: int) -> tuple[Sampler, list[Sequence]]:
        """Every `every`-th row under the schema (0: none)."""
        s = Sampler(vocab, torch.device("cpu"), cpu_ops=CpuOps.load())  # as the engine makes it on CPU
        seqs = []
        for i in range(rows):
            params = SamplingParams(temperature=0.7, seed=i, max_tokens=64)
            procs = [StructuredOutput(grammar, lltok)] if every and i % every == 0 else []
            state = SamplingState.build(params, procs, (), vocab, torch.device("cpu"))
            seq = Sequence(request_id=f"r{i}", prompt_token_ids=[1, 2, 3], params=params, arrival=i, sampling=state)
            seq.token_ids += prefix[: i % (len(prefix) + 1)]
            seqs.append(seq)
        s.prepare(seqs)  # the masks filled as in a step (in parallel), ready before the clock starts
        return s, seqs

    modes = {"unconstrained_ms": batch(0), "half_schema_ms": batch(2), "all_schema_ms": batch(1)}
    for n in threads:
        torch.set_num_threads(n)
        times: dict[str, list[float]] = {name: [] for name in modes}
        load_before = os.getloadavg()
        for rep in range(reps + 3):  # interleaved, so a burst of load falls on all
            for name, (s, seqs) in modes.items():
                x = logits.clone()
                start = time.perf_counter()
                s(x, seqs)
                if rep >= 3:
                    times[name].append(time.perf_counter() - start)
        result = {name: round(statistics.median(v) * 1e3, 2) for name, v in times.items()}
        result["half_cost_ms"] = round(result["half_schema_ms"] - result["unconstrained_ms"], 2)
        result["all_cost_ms"] = round(result["all_schema_ms"] - result["unconstrained_ms"], 2)
        print(json.dumps({"bench": "structured_sampler", "rows": rows, "vocab": vocab, **result, "threads": n,
                          "loadavg_before": load_before, "loadavg_after": os.getloadavg()}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mask-threads", type=int, help="threads of the parallel mask fill (1: row by row)")
    ap.add_argument("--fill", type=int, metavar="ROWS", help="measure the mask fill alone for ROWS requests")
    ap.add_argument("--threads", type=int, nargs="+", default=[2], help="parallel fill threads (with --fill); torch threads (with --sampler)")
    ap.add_argument("--sampler", type=int, metavar="ROWS", help="measure the sampler alone on ROWS rows")
    args = ap.parse_args()
    if args.sampler:
        return sampler(args.sampler, args.threads)
    if args.fill:
        return fill(args.fill, args.threads)
    from nanovllm import LLM

    llm = LLM("default")
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "List some numbers as JSON."}],
                                               add_generation_prompt=True, tokenize=False)
    run(llm, prompt, 2, 8, True)  # warm-up: the grammar's first compile, the kernels
    masks = llm.engine.sampler.masks
    if args.mask_threads:
        masks.threads = args.mask_threads
    load_before = os.getloadavg()
    rows = []
    for streams in args.streams:
        runs: dict[str, list[float]] = {"none": [], "overlap": [], "after": []}
        for _ in range(args.rounds):
            for mode in runs:
                masks.enabled = mode != "after"
                runs[mode].append(run(llm, prompt, streams, args.max_tokens, mode != "none"))
        masks.enabled = True
        med = {mode: statistics.median(v) for mode, v in runs.items()}
        rows.append({"streams": streams, "unconstrained_tok_s": round(med["none"], 1),
                     "schema_overlap_tok_s": round(med["overlap"], 1), "schema_after_tok_s": round(med["after"], 1),
                     "overlap_change_pct": round(100 * (med["overlap"] / med["none"] - 1), 1),
                     "after_change_pct": round(100 * (med["after"] / med["none"] - 1), 1),
                     **{f"{mode}_change_paired_pct": _paired(runs[mode], runs["none"]) for mode in ("overlap", "after")},
                     "overlap_change_by_round_pct": [round(100 * (o / n - 1), 1) for o, n in zip(runs["overlap"],
                                                                                                 runs["none"])]})
    print(f"{'streams':>8} {'unconstrained':>14} {'schema, overlap':>16} {'schema, after':>14} {'overlap':>8} {'after':>8}"
          f" {'overlap, paired':>16} {'after, paired':>14}")
    for r in rows:
        print(f"{r['streams']:>8} {r['unconstrained_tok_s']:>14} {r['schema_overlap_tok_s']:>16} "
              f"{r['schema_after_tok_s']:>14} {r['overlap_change_pct']:>7}% {r['after_change_pct']:>7}%"
              f" {r['overlap_change_paired_pct']:>15}% {r['after_change_paired_pct']:>13}%")
    print(json.dumps({"bench": "structured", "max_tokens": args.max_tokens, "rounds": args.rounds,
                      "mask_threads": masks.threads, "rows": rows,
                      "loadavg_before": load_before, "loadavg_after": os.getloadavg()}))


def _paired(schema: list[float], none: list[float]) -> float:
    """The median over rounds of each round's schema / unconstrained change, in %: the two run
    back to back within a round, so a drift of the machine's speed across rounds cancels."""
    return round(100 * statistics.median(s / n - 1 for s, n in zip(schema, none)), 1)


if __name__ == "__main__":
    main()
