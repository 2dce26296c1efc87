"""Structured output's cost: tokens/s with a JSON schema against unconstrained, on the default model.

    python -m bench.structured [--streams 1 64] [--max-tokens 64] [--rounds 2]

Each round runs, per stream count, one `LLM.generate` of that many copies of a chat prompt,
unconstrained (`ignore_eos`) and with a JSON schema (an array of 200 small integers, so no
output ends before `--max-tokens`): both generate exactly streams x max_tokens tokens. Rounds
alternate the two; the best round of each counts. Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from nanovllm import LLM

    llm = LLM("default")
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "List some numbers as JSON."}],
                                               add_generation_prompt=True, tokenize=False)
    run(llm, prompt, 2, 8, True)  # warm-up: the grammar's first compile, the kernels
    rows = []
    for streams in args.streams:
        best = {False: 0.0, True: 0.0}
        for _ in range(args.rounds):
            for constrained in (False, True):
                best[constrained] = max(best[constrained], run(llm, prompt, streams, args.max_tokens, constrained))
        rows.append({"streams": streams, "unconstrained_tok_s": round(best[False], 1),
                     "json_schema_tok_s": round(best[True], 1),
                     "change_pct": round(100 * (best[True] / best[False] - 1), 1)})
    print(f"{'streams':>8} {'unconstrained tok/s':>20} {'json_schema tok/s':>18} {'change':>8}")
    for r in rows:
        print(f"{r['streams']:>8} {r['unconstrained_tok_s']:>20} {r['json_schema_tok_s']:>18} {r['change_pct']:>7}%")
    print(json.dumps({"bench": "structured", "max_tokens": args.max_tokens, "rounds": args.rounds, "rows": rows}))


if __name__ == "__main__":
    main()
