"""`python bench/serve.py --sweep`: the service across concurrency levels, under KV-cache
pressure, and on the null model; writes JSON and a PNG (bench/serve_report.py).

Each configuration gets its own `nanovllm serve` (bench/serve.py's `Service`), started fresh:
1. the model at every `--concurrency` level: `max(level, --min-requests)` requests of
   `--output-len` tokens, at most `level` in flight, one client connection per stream unless
   `--clients`; at the top level the same prompts also go through `LLM.generate` in-process,
   alternating with the service (the service / in-process ratio);
2. KV-cache pressure: the top level again on a cache of `--pressure-kv-blocks` blocks (default:
   half of what its requests need at full length), once per combination of `--engine-arg` values;
3. the null model (`Config.null_model`: fixed logits, no model work) at every level with
   `--null-output-len` tokens per request: engine steps/s and tokens/s through the three stages,
   and the same engine in-process at the top level.
Every run draws fresh prompts, so none hits the prefix cache; each level reports the best of
`--repeats` runs and lists them all.
"""
from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import platform
import time

from bench.serve import Offline, Service, alternate, best, engine_config, engine_flags, make_prompts, print_profiles
from nanovllm.config import Config


def sweep_levels(service: Service, offline: Offline | None, args: argparse.Namespace, vocab: int, tag: str,
                 output_len: int, min_requests: int) -> list[dict]:
    """One row per concurrency level; the in-process comparison at the top level only."""
    top = max(args.concurrency)
    rows = []
    for level in args.concurrency:
        prompt_sets = [make_prompts(max(level, min_requests), vocab, *args.prompt_len, f"{args.seed}-{tag}-{level}-{r}")
                       for r in range(args.repeats)]
        services, offlines = alternate(service, offline if level == top else None, prompt_sets, output_len,
                                       args.clients or level, level)
        row = dict(best(services), all_tok_s=[round(r["output_tok_s"], 1) for r in services])
        if offlines:
            row.update(offline=best(offlines), all_offline_tok_s=[round(r["output_tok_s"], 1) for r in offlines],
                       service_over_offline=row["output_tok_s"] / best(offlines)["output_tok_s"])
        rows.append(row)
        print(f"[{tag}] concurrency {level}: {row['output_tok_s']:.1f} out tok/s (runs {row['all_tok_s']}), "
              f"{row['steps_per_s']:.1f} steps/s, TTFT p50 {row['ttft_p50_ms']:.0f} ms, ITL p50 {row['itl_p50_ms']:.1f} ms"
              + (f"; in-process {row['offline']['output_tok_s']:.1f}, ratio {row['service_over_offline']:.3f}"
                 if offlines else ""), flush=True)
    return rows


def knob_grid(specs: list[str]) -> list[dict[str, str]]:
    """`["a=1,2", "b=x"]` -> `[{a: 1, b: x}, {a: 2, b: x}]`: one pressure run per combination."""
    axes = []
    for spec in specs:
        key, sep, values = spec.partition("=")
        if not sep or not key or not values:
            raise SystemExit(f"--engine-arg takes KEY=VALUE[,VALUE...] (an engine Config field), got {spec!r}")
        axes.append([(key.replace("-", "_"), v) for v in values.split(",")])
    return [dict(combo) for combo in itertools.product(*axes)]


def pressure_blocks(prompts: list[list[int]], output_len: int, block_size: int) -> int:
    """Half the KV blocks all `prompts` hold at once at their full length, but at least what the
    longest one needs alone (the engine refuses a request that could never fit)."""
    need = [-(-(len(p) + output_len) // block_size) for p in prompts]
    return max(sum(need) // 2, max(need))


def pressure_runs(args: argparse.Namespace, model: str, vocab: int) -> list[dict]:
    level = max(args.concurrency)
    prompt_sets = [make_prompts(max(level, args.min_requests), vocab, *args.prompt_len, f"{args.seed}-pressure-{r}")
                   for r in range(args.repeats)]
    blocks = args.pressure_kv_blocks or pressure_blocks(prompt_sets[0], args.output_len, Config.block_size)
    rows = []
    for knobs in knob_grid(args.engine_arg):
        config = {**engine_config(args, null_model=False), "num_kvcache_blocks": blocks}
        with Service(model, engine_flags(config) + engine_flags(knobs), args.profile) as service:
            services, _ = alternate(service, None, prompt_sets, args.output_len, args.clients or level, level)
        row = dict(best(services), num_kvcache_blocks=blocks, knobs=knobs,
                   all_tok_s=[round(r["output_tok_s"], 1) for r in services])
        rows.append(row)
        print(f"[pressure] {blocks} KV blocks {knobs or ''}: {row['output_tok_s']:.1f} out tok/s, "
              f"{row['preemptions']} preemptions, KV peak {row['kv_usage_peak']:.0%}", flush=True)
    return rows


def run_config(args: argparse.Namespace, model: str, vocab: int, null_model: bool) -> list[dict]:
    config = engine_config(args, null_model)
    tag = "null" if null_model else "model"
    output_len = args.null_output_len if null_model else args.output_len
    min_requests = args.null_min_requests if null_model else args.min_requests
    with Service(model, engine_flags(config), args.profile) as service:
        offline = None if args.skip_offline else Offline(model, config)
        rows = sweep_levels(service, offline, args, vocab, tag, output_len, min_requests)
    if offline:  # what dtype="auto" resolved to, as the service's engine resolves it on this machine
        rows[-1]["offline"]["dtype"] = str(offline.llm.engine.runner.dtype).removeprefix("torch.")
    del offline
    gc.collect()  # the in-process engine's KV cache, before the next service starts
    return rows


def run_sweep(args: argparse.Namespace, model: str, vocab: int) -> int:
    from bench.serve_report import markdown_tables, plot

    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu_model": cpu_model() or platform.machine(), "cores": len(os.sched_getaffinity(0)), "load_before": os.getloadavg(),
              "model": args.model, "concurrency": args.concurrency, "prompt_len": args.prompt_len,
              "output_len": args.output_len, "null_output_len": args.null_output_len, "repeats": args.repeats,
              "config": engine_config(args, null_model=False)}
    if not args.null_model:
        result["levels"] = run_config(args, model, vocab, null_model=False)
        if args.pressure_kv_blocks != 0:
            result["pressure"] = pressure_runs(args, model, vocab)
    if args.null_model or not args.skip_null:
        result["null"] = run_config(args, model, vocab, null_model=True)
    result["load_after"] = os.getloadavg()

    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    if args.png:
        try:
            plot(result, args.png)
            print(f"wrote {args.png}")
        except ImportError:
            print("no PNG: matplotlib is missing (pip install -e '.[bench]')")
    print(markdown_tables(result))
    if args.profile:
        print_profiles(args.profile)
    return 0


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""
