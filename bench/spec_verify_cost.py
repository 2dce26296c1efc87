"""What verifying k drafted tokens of ONE request costs: the forward (logits included) of 1, 2,
4, 8 rows of a single sequence at consecutive positions, against the 1-row step.

Two shapes of the same work are timed on one engine, in one process, interleaved:
- "decode": the k+1 tokens as k+1 decode rows (same block table, context lengths pos+1 ...
  pos+k+1), which on CPU with packed weights is the one-call C decode step (at most 8 rows);
- "chunk": the k+1 tokens as one prefill chunk starting at pos (the chunked-prefill path).
Each row's K/V is written before any row attends, in both shapes, so both are exact
verification forwards. The sequence has `--context` tokens of cache behind it.

    python -m bench.spec_verify_cost                      # the default model, 2 threads
    python -m bench.spec_verify_cost --rows 1,2,4,5,8 --repeats 60

Prints one JSON line and a table: median ms per forward, and the ratio to the 1-row decode step.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from nanovllm.config import Config
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.step_input import StepInput
from nanovllm.sampling_params import SamplingParams


def verify_step(seq, rows: int, shape: str) -> StepInput:
    """A StepInput that scores `rows` tokens of `seq` from its first uncomputed position."""
    pos = seq.num_computed_tokens
    tokens = [seq.token_ids[pos]] + [7 + i for i in range(rows - 1)]  # the drafts' values do not change the cost
    if shape == "decode":
        return StepInput(decode_token_ids=tokens, decode_positions=list(range(pos, pos + rows)),
                         decode_block_tables=[seq.block_table] * rows, prefill_token_ids=[], prefill_starts=[],
                         prefill_block_tables=[], sample_rows=list(range(rows)))
    return StepInput(decode_token_ids=[], decode_positions=[], decode_block_tables=[], prefill_token_ids=[tokens],
                     prefill_starts=[pos], prefill_block_tables=[seq.block_table], sample_rows=list(range(rows)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--context", type=int, default=256, help="tokens already in the cache")
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]

    engine = LLMEngine(Config(model=args.model, num_threads=args.threads, max_num_seqs=4))
    rng = random.Random(0)
    prompt = [rng.randrange(100, 10000) for _ in range(args.context)]
    engine.add_request("ctx", prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    engine.step()  # the prompt's prefill; the sequence now decodes at position len(prompt)
    seq = engine.requests["ctx"]
    engine.block_manager.append_slots(seq, max(rows_list))  # room for the widest verification
    runner = engine.runner

    times: dict[tuple[str, int], list[float]] = {(s, r): [] for s in ("decode", "chunk") for r in rows_list}
    with torch.inference_mode():
        for _ in range(3):  # warm-up: oneDNN kernels per row count, the one-call table
            for key in times:
                runner._execute(verify_step(seq, key[1], key[0]))
        for _ in range(args.repeats):
            for key in times:
                step = verify_step(seq, key[1], key[0])
                start = time.perf_counter()
                runner._execute(step)
                times[key].append(time.perf_counter() - start)

    base = statistics.median(times[("decode", 1)])
    result = {"model": args.model, "dtype": str(runner.dtype), "threads": args.threads, "context": args.context,
              "repeats": args.repeats,
              "ms": {f"{s}:{r}": round(statistics.median(t) * 1e3, 3) for (s, r), t in times.items()},
              "vs_1_row": {f"{s}:{r}": round(statistics.median(t) / base, 3) for (s, r), t in times.items()}}
    print(json.dumps(result))
    print(f"\n{'rows':>4} | {'decode ms':>9} | {'x 1 row':>7} | {'chunk ms':>8} | {'x 1 row':>7}")
    for r in rows_list:
        d, c = statistics.median(times[("decode", r)]), statistics.median(times[("chunk", r)])
        print(f"{r:>4} | {d * 1e3:>9.2f} | {d / base:>7.2f} | {c * 1e3:>8.2f} | {c / base:>7.2f}")


if __name__ == "__main__":
    main()
