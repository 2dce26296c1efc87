"""Sampling overhead: the sampler alone per parameter mix, and greedy vs sampling end to end.

The sampler micro-benchmark isolates what sampling adds to an engine step (milliseconds per
call on a batch of random logits). `--engine-pairs N` runs bench/offline.py's workload (tiny
shape, 64 requests) greedy and with its sampling knobs alternately in one process, N times, so
each pair sees the same machine load; shared machines make separate runs minutes apart
incomparable. Prints one JSON line per measurement.

    python -m bench.sampler --batch 64 --vocab 8192 49152
    python -m bench.sampler --mix greedy --vocab 8192 --engine-pairs 3
"""
from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.engine.sampler import Sampler
from nanovllm.engine.sequence import SamplingState
from nanovllm.sampling_params import SamplingParams

MIXES = {
    "greedy": dict(temperature=0),
    "bench_sampling": dict(temperature=0.8, top_p=0.95, top_k=50),
    "top_p_only": dict(temperature=0.8, top_p=0.95),
    "temperature_only": dict(temperature=0.8),
    "seeded_penalties_logprobs": dict(temperature=0.8, top_p=0.95, top_k=50, repetition_penalty=1.1,
                                      frequency_penalty=0.2, logprobs=5),
}


def time_mix(name: str, batch: int, vocab: int, calls: int, prompt_len: int, output_len: int) -> dict:
    rng = random.Random(0)
    sampler = Sampler(vocab, torch.device("cpu"))
    seqs = []
    for i in range(batch):
        # Seeds make the mix per-request; they are only set where the mix says "seeded".
        params = SamplingParams(**MIXES[name], seed=i if name.startswith("seeded") else None)
        state = SamplingState.build(params, [], (), vocab, torch.device("cpu"))
        seq = Sequence(request_id=f"r{i}", prompt_token_ids=[rng.randrange(vocab) for _ in range(prompt_len)],
                       params=params, arrival=i, sampling=state)
        seq.token_ids += [rng.randrange(vocab) for _ in range(output_len)]
        seqs.append(seq)
    logits = torch.randn(batch, vocab) * 3
    for _ in range(5):
        sampler(logits.clone(), seqs)
    start = time.perf_counter()
    for _ in range(calls):
        sampler(logits.clone(), seqs)  # a fresh copy: the sampler may change its input in place
        for s in seqs:
            s.sampling.take_logprobs()
    total = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(calls):
        logits.clone()
    ms = (total - (time.perf_counter() - start)) / calls * 1e3  # the copies' time taken out
    return {"bench": "sampler", "mix": name, "batch": batch, "vocab": vocab, "ms_per_call": round(ms, 3),
            "threads": torch.get_num_threads()}


def engine_pairs(pairs: int, shape: str, model_dir: str, threads: int | None) -> None:
    from bench.models import make_bench_model
    from bench.offline import make_workload, run_nanovllm
    from nanovllm.config import Config
    from nanovllm.engine.llm_engine import LLMEngine

    path = make_bench_model(shape, model_dir)
    vocab = json.load(open(os.path.join(path, "config.json")))["vocab_size"]
    prompts = make_workload(64, 64, 256, vocab, seed=0)
    # No prefix cache: every run recomputes its prompts, so the first run is no slower than the rest.
    engine = LLMEngine(Config(model=path, kv_cache_memory_gib=2.0, num_threads=threads, enable_prefix_caching=False))
    modes = {"greedy": SamplingParams(temperature=0, max_tokens=128, ignore_eos=True),
             "sampling": SamplingParams(**MIXES["bench_sampling"], max_tokens=128, ignore_eos=True)}
    run_nanovllm(engine, prompts[:8], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))  # warm-up
    for i in range(pairs):
        for mode, params in modes.items():
            wall, produced, cpu = run_nanovllm(engine, prompts, params)
            print(json.dumps({"bench": "sampling_pair", "pair": i, "mode": mode, "shape": shape, "num_seqs": 64,
                              "threads": torch.get_num_threads(), "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
                              "out_tok_s": round(produced / wall, 1)}),
                  flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, nargs="+", default=[8192, 49152])
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--prompt-len", type=int, default=160)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--mix", nargs="+", default=list(MIXES), choices=list(MIXES))
    ap.add_argument("--engine-pairs", type=int, default=0, help="also run N greedy/sampling pairs end to end")
    ap.add_argument("--shape", default="tiny", help="bench model shape for --engine-pairs")
    ap.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "nanovllm-bench-models"))
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    for vocab in args.vocab:
        for name in args.mix:
            print(json.dumps(time_mix(name, args.batch, vocab, args.calls, args.prompt_len, args.output_len)), flush=True)
    if args.engine_pairs:
        engine_pairs(args.engine_pairs, args.shape, args.model_dir, args.threads)


if __name__ == "__main__":
    main()
