"""Time to first token of one long prompt, in-process: the prefill of a single request alone.

For each `--prompt-len`, a fresh prompt of random token ids, one output token, prefix caching off
(so no run reuses another's blocks), best of `--repeats`; a short warm-up first. Prints one JSON
line per length and a table.

    python -m bench.ttft --shape mid --dtype bfloat16 --prompt-len 1024 2048 4000
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

from bench.models import SHAPES, make_bench_model
from nanovllm import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(SHAPES), default="mid")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompt-len", type=int, nargs="+", default=[1024, 2048, 4000])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model-root", default=tempfile.gettempdir())
    args = parser.parse_args()
    llm = LLM(make_bench_model(args.shape, args.model_root), dtype=args.dtype, enable_prefix_caching=False)
    vocab = SHAPES[args.shape]["vocab_size"]
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([[rng.randrange(2, vocab) for _ in range(64)]], params, use_tqdm=False)
    rows = []
    for length in args.prompt_len:
        times = []
        for _ in range(args.repeats):
            prompt = [rng.randrange(2, vocab) for _ in range(length)]
            start = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            times.append(time.perf_counter() - start)
        row = {"bench": "ttft", "shape": args.shape, "dtype": str(llm.engine.runner.dtype).removeprefix("torch."),
               "prompt_len": length, "ttft_s": round(min(times), 3), "all_s": [round(t, 3) for t in times]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(f"\n{'prompt':>7} {'TTFT s':>8}")
    for row in rows:
        print(f"{row['prompt_len']:>7} {row['ttft_s']:>8.3f}")


if __name__ == "__main__":
    main()
