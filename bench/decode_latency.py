"""Decode speed: batch-1 inter-token latency and decode-only step time, CUDA graphs vs eager.

Modes: "graph" (CUDA graphs, steps overlapped as the engine runs them by default on CUDA),
"graph-sync" (CUDA graphs, `overlap_scheduling=False`: the host waits for every step) and "eager"
(no graphs, the engine's default overlap). For each mode one engine is built, warmed up, and fed B greedy requests of random
token ids with EOS ignored, for each batch size B. Only steps that decode all B sequences and
prefill nothing are timed (wall clock around `LLMEngine.step()`, so scheduling and sampling are
in; overlapped, a step's wall time covers launching it and reading back the one before): at B = 1
that is the inter-token latency a single user sees. Prints a JSON line and a table;
`graph_speedup` is eager step time / graph step time, `overlap_speedup` graph-sync / graph. On
CPU only "eager" exists.

    python -m bench.decode_latency --shape qwen3-0.6b             # on a GPU
    python -m bench.decode_latency --shape tiny --modes eager --batch-sizes 1,8

`--timeline PREFIX` also records, per mode and batch size, a kernel-level timeline of decode-only
steps under torch.profiler (bench/decode_timeline.py) into PREFIX.<mode>.b<batch>.{json,txt}.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import time

import torch

from bench.decode_timeline import record_timeline, write_timeline
from bench.models import add_model_flags, make_bench_model
from nanovllm.config import Config
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.sampling_params import SamplingParams


def time_decode_steps(engine: LLMEngine, batch: int, prompt_len: int, output_len: int, vocab: int) -> list[float]:
    """Seconds of every step that decoded exactly `batch` sequences and prefilled nothing."""
    rng = random.Random(batch)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{time.perf_counter_ns()}-{i}", [rng.randrange(2, vocab) for _ in range(prompt_len)], params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if engine.last_step.num_prefill_tokens == 0 and engine.last_step.num_decode_tokens == batch:
            times.append(elapsed)
    return times


def profile_steps(engine: LLMEngine, mode: str, args: argparse.Namespace, vocab: int) -> None:
    """The steps of one run at the first batch size under cProfile: where a step's host time goes
    (`{args.profile}.{mode}.txt`: the top functions by own time and by cumulative time)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    time_decode_steps(engine, args.batch_sizes[0], args.prompt_len, args.output_len, vocab)
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumtime").print_stats(30)
    with open(f"{args.profile}.{mode}.txt", "w") as f:
        f.write(out.getvalue())


MODES = ("graph", "graph-sync", "eager")


def run_mode(path: str, mode: str, args: argparse.Namespace, vocab: int) -> list[dict]:
    if mode not in MODES:
        raise SystemExit(f"unknown mode {mode!r}: one of {', '.join(MODES)}")
    engine = LLMEngine(Config(model=path, device=args.device, dtype=args.dtype, enforce_eager=mode == "eager",
                              overlap_scheduling=False if mode == "graph-sync" else None,
                              max_num_seqs=max(args.batch_sizes), num_kvcache_blocks=args.num_kv_blocks))
    if mode.startswith("graph") and engine.runner.graphs is None:
        raise SystemExit("mode 'graph' needs CUDA (graphs are captured only there)")
    time_decode_steps(engine, 2, 16, 8, vocab)  # warm-up
    if args.profile:
        profile_steps(engine, mode, args, vocab)
    if args.timeline:
        for batch in args.timeline_batch_sizes or args.batch_sizes:
            timeline = record_timeline(engine, batch, args.timeline_steps, args.prompt_len, vocab)
            print(json.dumps({"timeline": write_timeline(args.timeline, mode, batch, timeline),
                              **{k: v for k, v in timeline.items() if k not in ("kernels", "classes")}}))
    rows = []
    for batch in args.batch_sizes:
        times = time_decode_steps(engine, batch, args.prompt_len, args.output_len, vocab)
        median = statistics.median(times)
        rows.append({"mode": mode, "batch": batch, "steps": len(times), "median_step_ms": round(1e3 * median, 3),
                     "mean_step_ms": round(1e3 * statistics.fmean(times), 3),
                     "decode_tok_s": round(batch / median, 1)})
    engine.runner.close()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(ap)
    ap.add_argument("--modes", default="graph,eager", help=f"comma-separated: {', '.join(MODES)}")
    ap.add_argument("--batch-sizes", default="1,8,32,128", type=lambda s: [int(b) for b in s.split(",")])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-kv-blocks", type=int, default=4096, help="fixed, so both modes get the same cache")
    ap.add_argument("--profile", metavar="PREFIX", help="also profile one run at the first batch size per mode "
                    "(cProfile, steps only) into PREFIX.<mode>.txt")
    ap.add_argument("--timeline", metavar="PREFIX", help="also record a kernel timeline of decode-only steps "
                    "per mode and batch size (torch.profiler) into PREFIX.<mode>.b<batch>.{json,txt}")
    ap.add_argument("--timeline-steps", type=int, default=50, help="decode-only steps per timeline")
    ap.add_argument("--timeline-batch-sizes", type=lambda s: [int(b) for b in s.split(",")],
                    help="batch sizes of the timelines (default: --batch-sizes)")
    args = ap.parse_args(argv)

    path = make_bench_model(args.shape, args.model_dir)
    vocab = json.load(open(os.path.join(path, "config.json")))["vocab_size"]
    rows = [row for mode in args.modes.split(",") for row in run_mode(path, mode.strip(), args, vocab)]
    by_key = {(r["mode"], r["batch"]): r for r in rows}
    speedup = {str(b): round(by_key[("eager", b)]["median_step_ms"] / by_key[("graph", b)]["median_step_ms"], 2)
               for b in args.batch_sizes if ("eager", b) in by_key and ("graph", b) in by_key}
    overlap = {str(b): round(by_key[("graph-sync", b)]["median_step_ms"] / by_key[("graph", b)]["median_step_ms"], 2)
               for b in args.batch_sizes if ("graph-sync", b) in by_key and ("graph", b) in by_key}
    result = {"bench": "decode_latency", "shape": args.shape, "prompt_len": args.prompt_len,
              "output_len": args.output_len, "rows": rows, "graph_speedup": speedup, "overlap_speedup": overlap}
    if torch.cuda.is_available() and args.device != "cpu":
        result["device"] = torch.cuda.get_device_name()
    print(json.dumps(result))
    print(f"\n{'mode':<12}{'batch':>6}{'median ms/step':>16}{'decode tok/s':>14}")
    for r in rows:
        print(f"{r['mode']:<12}{r['batch']:>6}{r['median_step_ms']:>16.2f}{r['decode_tok_s']:>14.1f}")
    if speedup:
        print("graph speedup over eager (step time): " + ", ".join(f"batch {b}: {s}x" for b, s in speedup.items()))
    if overlap:
        print("overlap speedup (graph-sync / graph): " + ", ".join(f"batch {b}: {s}x" for b, s in overlap.items()))
    return result


if __name__ == "__main__":
    main()
