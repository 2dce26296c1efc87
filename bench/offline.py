"""Offline throughput: nanovllm's engine, HF transformers `generate` and optionally vLLM's CPU
backend, same weights, same run.

Workload (nano-vllm's shape, scaled for a CPU): N requests of random token ids with random
prompt lengths, a fixed number of output tokens each with EOS ignored, all submitted at once.
Prints a JSON line and a table; `ratio` is nanovllm / HF output tokens per second, `vllm_ratio`
nanovllm / vLLM.

    python -m bench.offline --shape tiny            # the 2x-HF target
    python -m bench.offline --shape mid --skip-hf
    # vLLM's CPU backend side by side, from its own virtualenv (docs/benchmarks.md has the recipe):
    python -m bench.offline --shape tiny --skip-hf --dtype float32 --vllm-python /work/vllm-venv/bin/python
    # a KV cache a third of what the batch needs, with the tuning knobs (docs/tuning.md):
    python -m bench.offline --shape tiny --skip-hf --num-kvcache-blocks 400 --kv-watermark 0.1 --preempt-ratio 0.2
    # nano-vllm's published GPU workload (random output lengths too):
    python -m bench.offline --shape qwen3-0.6b --skip-hf --num-seqs 256 --min-input 100 --max-input 1024 \
        --min-output 100 --max-output 1024 --max-model-len 4096
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import torch

from bench.models import add_model_flags, make_bench_model
from nanovllm.config import Config
from nanovllm.engine.hooks import StepMetrics
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.sampling_params import SamplingParams


def make_workload(num_seqs: int, min_input: int, max_input: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(min_input, max_input))] for _ in range(num_seqs)]


def run_nanovllm(engine: LLMEngine, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams]) -> tuple[float, int, float]:
    """(wall seconds, output tokens, process CPU seconds)."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params_list)):
        engine.add_request(f"b{time.perf_counter_ns()}-{i}", prompt, p)
    produced = 0
    start, cpu = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    return time.perf_counter() - start, produced, time.process_time() - cpu


def run_hf(path: str, prompts: list[list[int]], output_len: int, sampling: dict | None) -> tuple[float, int, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    longest = max(map(len, prompts))
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    kwargs = dict(do_sample=True, **sampling) if sampling else dict(do_sample=False)
    start, cpu = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                             pad_token_id=0, **kwargs)
    return time.perf_counter() - start, (out.shape[1] - longest) * len(prompts), time.process_time() - cpu


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(ap, shape="tiny")
    ap.add_argument("--num-seqs", type=int, default=64)
    ap.add_argument("--min-input", type=int, default=64)
    ap.add_argument("--max-input", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--min-output", type=int, default=None,
                    help="with --max-output: output lengths uniform in [min, max] per request (nanovllm only)")
    ap.add_argument("--max-output", type=int, default=None)
    ap.add_argument("--sampling", action="store_true", help="temperature 0.8, top_p 0.95, top_k 50 instead of greedy")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=1, help="timed runs of each engine; the best is reported")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--vllm-python", default=None, metavar="PATH",
                    help="python of a virtualenv with vLLM's CPU backend: run it side by side (off by default)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: Config's")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: Config's")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--block-size", type=int, default=None, help="default: Config's")
    ap.add_argument("--num-kvcache-blocks", type=int, default=None,
                    help="an exact KV cache size instead of the memory budget (to put the cache under pressure)")
    ap.add_argument("--kv-watermark", type=float, default=None, help="default: Config's (docs/tuning.md)")
    ap.add_argument("--preempt-ratio", type=float, default=None, help="default: Config's (docs/tuning.md)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    args = ap.parse_args(argv)

    path = make_bench_model(args.shape, args.model_dir)
    vocab = json.load(open(os.path.join(path, "config.json")))["vocab_size"]
    prompts = make_workload(args.num_seqs, args.min_input, args.max_input, vocab, seed=0)
    sampling = dict(temperature=0.8, top_p=0.95, top_k=50) if args.sampling else None
    params = SamplingParams(temperature=0.8, max_tokens=args.output_len, ignore_eos=True, **_extra(sampling)) if sampling \
        else SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    if args.skip_hf and (args.min_output is not None or args.max_output is not None):
        params = _random_output_lengths(params, args.min_output or 1, args.max_output or args.output_len, len(prompts))
    elif args.min_output is not None or args.max_output is not None:
        ap.error("--min-output/--max-output need --skip-hf (HF generate runs one output length)")
    if args.vllm_python and args.device == "cuda":
        ap.error("--vllm-python runs vLLM's CPU backend; it needs --device cpu or auto")

    # Fresh prompts for every repeat: resubmitting the same ones would hit the prefix cache and
    # skip nearly all prefill work, which this random-prompt workload must not get for free.
    prompt_sets = [prompts] + [make_workload(args.num_seqs, args.min_input, args.max_input, vocab, seed=r)
                               for r in range(1, args.repeats)]
    # Warm-ups run on prompts of their own: timed ones would leave their blocks in the prefix cache
    # and hand the first timed run part of its prefill for free.
    warm_up = make_workload(8, args.min_input, args.max_input, vocab, seed=-1)
    # Each engine runs in a fresh interpreter, one after the other: measured here, HF generate
    # ran ~13% slower in the process where nanovllm's engine had just run than in a new one.
    hf_runs = None if args.skip_hf else in_fresh_process(hf_timed_runs, path, prompt_sets, args.output_len,
                                                         sampling, args.threads)
    if args.vllm_python:
        our_runs, engine_info, vllm_runs = alternate_with_vllm(args, path, warm_up, prompt_sets, params, sampling)
    else:
        our_runs, engine_info = in_fresh_process(nanovllm_timed_runs, args, path, warm_up, prompt_sets, params)
        vllm_runs = None
    ours = min(our_runs, key=lambda r: r[0])
    result = {
        "bench": "offline", "shape": args.shape, "num_seqs": args.num_seqs,
        "prompt_tokens": sum(map(len, prompts)), "output_len": args.output_len,
        "mode": "sampling" if sampling else "greedy", "threads": engine_info.pop("threads"),
        "nanovllm_s": round(ours[0], 3), "nanovllm_out_tok_s": round(ours[1] / ours[0], 1),
        "nanovllm_cpu_s": round(ours[2], 2), "nanovllm_all_s": [round(r[0], 2) for r in our_runs],
    }
    if isinstance(params, list):
        result.update(min_output=args.min_output, max_output=args.max_output,
                      output_tokens=sum(p.max_tokens for p in params))
    result.update(engine_info)
    if hf_runs is not None:
        hf = min(hf_runs, key=lambda r: r[0])
        result.update(hf_s=round(hf[0], 3), hf_out_tok_s=round(hf[1] / hf[0], 1), hf_cpu_s=round(hf[2], 2),
                      hf_all_s=[round(r[0], 2) for r in hf_runs],
                      ratio=round((ours[1] / ours[0]) / (hf[1] / hf[0]), 2),
                      cpu_ratio=round((hf[2] / hf[1]) / (ours[2] / ours[1]), 2))
    if vllm_runs is not None:
        peer = min(vllm_runs, key=lambda r: r[0])
        result.update(vllm_s=round(peer[0], 3), vllm_out_tok_s=round(peer[1] / peer[0], 1),
                      vllm_cpu_s=round(peer[2], 2), vllm_all_s=[round(r[0], 2) for r in vllm_runs],
                      vllm_ratio=round((ours[1] / ours[0]) / (peer[1] / peer[0]), 2))
    print(json.dumps(result))
    print_table(result)
    return result


def in_fresh_process(fn, *args):
    """fn(*args) in a new interpreter, so nothing another engine left behind (thread pools,
    allocator state, caches) touches its timing."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def nanovllm_timed_runs(args: argparse.Namespace, path: str, warm_up: list[list[int]],
                        prompt_sets: list[list[list[int]]], params: SamplingParams | list[SamplingParams]
                        ) -> tuple[list[tuple[float, int, float]], dict]:
    """A warm-up, then one timed run per prompt set; with a little about the engine."""
    if args.threads:
        torch.set_num_threads(args.threads)
    knobs = dict(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, block_size=args.block_size,
                 num_kvcache_blocks=args.num_kvcache_blocks, kv_watermark=args.kv_watermark,
                 preempt_ratio=args.preempt_ratio)
    engine_config = {k: v for k, v in knobs.items() if v is not None}
    engine = LLMEngine(Config(model=path, max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_gib=2.0,
                              num_threads=args.threads, device=args.device, dtype=args.dtype,
                              enforce_eager=args.enforce_eager, tensor_parallel_size=args.tensor_parallel_size,
                              **engine_config))
    run_nanovllm(engine, warm_up, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    pressure = PreemptionCount(engine.scheduler.num_preemptions)
    engine.add_post_step_hook(pressure)
    runs = [run_nanovllm(engine, ps, params) for ps in prompt_sets]
    info = {"threads": torch.get_num_threads(), "dtype": str(engine.runner.dtype).removeprefix("torch."),
            "num_kv_blocks": engine.runner.num_blocks, "steps": pressure.steps, "preemptions": pressure.preemptions,
            "preempting_steps": pressure.preempting_steps, "prefill_tokens": pressure.prefill_tokens}
    if engine.runner.device.type == "cuda":
        info.update(device=torch.cuda.get_device_name(engine.runner.device), cuda_graphs=engine.runner.graphs is not None)
    engine.close()
    return runs, info


class PreemptionCount:
    """A post-step hook: steps, sequences preempted, steps that preempted and prompt tokens
    computed (recomputation after preemption included, prefix-cache hits not) over the timed runs."""

    def __init__(self, preemptions_so_far: int):
        self.steps = self.preemptions = self.preempting_steps = self.prefill_tokens = 0
        self._last = preemptions_so_far

    def __call__(self, m: StepMetrics) -> None:
        if m.num_preemptions > self._last:
            self.preemptions += m.num_preemptions - self._last
            self.preempting_steps += 1
        self._last = m.num_preemptions
        self.steps += 1
        self.prefill_tokens += m.num_prefill_tokens


def alternate_with_vllm(args: argparse.Namespace, path: str, warm_up: list[list[int]],
                        prompt_sets: list[list[list[int]]], params: SamplingParams | list[SamplingParams],
                        sampling: dict | None
                        ) -> tuple[list[tuple[float, int, float]], dict, list[tuple[float, int, float]]]:
    """nanovllm, vLLM, nanovllm, vLLM ...: one prompt set per turn, each in a fresh process, so
    the load drifting on a shared machine falls on both engines alike."""
    our_runs, vllm_runs = [], []
    output_lens = [p.max_tokens for p in params] if isinstance(params, list) else [params.max_tokens] * args.num_seqs
    for prompts in prompt_sets:
        runs, engine_info = in_fresh_process(nanovllm_timed_runs, args, path, warm_up, [prompts], params)
        our_runs += runs
        # "auto" gives vLLM what nanovllm resolved it to, so both compute in the same dtype.
        job = dict(model=path, dtype=engine_info["dtype"], warm_up=warm_up, prompt_sets=[prompts],
                   output_lens=output_lens, sampling=sampling, max_num_batched_tokens=args.max_num_batched_tokens,
                   max_num_seqs=args.max_num_seqs or Config.max_num_seqs, max_model_len=args.max_model_len)
        vllm_runs += run_vllm_peer(args.vllm_python, job, engine_info["threads"])
    return our_runs, engine_info, vllm_runs


def run_vllm_peer(python: str, job: dict, threads: int) -> list[tuple[float, int, float]]:
    """bench/vllm_peer.py under vLLM's own interpreter; its timed runs."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_peer.py")
    # -I keeps bench/ off sys.path: its models.py or serve.py could shadow a module vLLM imports.
    proc = subprocess.run([python, "-I", script], input=json.dumps(job), env=vllm_env(python, threads),
                          capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"runs"')]
    if proc.returncode != 0 or not lines:  # vLLM logs to stdout too: the result is the marked line
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise RuntimeError(f"vLLM peer failed (exit {proc.returncode}); its output is above")
    return [tuple(run) for run in json.loads(lines[-1])["runs"]]


def vllm_env(python: str, threads: int) -> dict[str, str]:
    """What made vLLM's CPU backend fast here (../shared/ENVIRONMENT.md): OpenMP threads bound to
    every core (by default it computes on one), tcmalloc and its bundled libiomp5 preloaded."""
    preload = ["/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", bundled_libiomp5(python)]
    missing = [lib for lib in preload if not lib or not os.path.isfile(lib)]
    if missing:
        raise RuntimeError(f"vLLM peer needs tcmalloc (apt-get install libtcmalloc-minimal4) and the venv's "
                           f"libiomp5.so; missing: {missing}")
    scratch = os.path.join(tempfile.gettempdir(), "nanovllm-bench-vllm-cache")  # its compile cache
    return {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "LD_PRELOAD": ":".join(preload),
            "HF_HUB_OFFLINE": "1", "VLLM_CACHE_ROOT": scratch, "VLLM_CPU_KVCACHE_SPACE": "2"}


def bundled_libiomp5(python: str) -> str | None:
    venv = os.path.dirname(os.path.dirname(python))
    for root, _, files in os.walk(os.path.join(venv, "lib")):
        if "libiomp5.so" in files:
            return os.path.join(root, "libiomp5.so")
    return None


def hf_timed_runs(path: str, prompt_sets: list[list[list[int]]], output_len: int, sampling: dict | None,
                  threads: int | None) -> list[tuple[float, int, float]]:
    if threads:
        torch.set_num_threads(threads)
    run_hf(path, prompt_sets[0][:4], 8, sampling)  # warm-up
    return [run_hf(path, ps, output_len, sampling) for ps in prompt_sets]


def random_output_lengths(low: int, high: int, n: int) -> list[int]:
    """n output lengths uniform in [low, high], the same on every call (bench/hf_peer.py asks
    HF for the lengths this bench asks nanovllm for)."""
    rng = random.Random(1)
    return [rng.randint(low, high) for _ in range(n)]


def _random_output_lengths(params: SamplingParams, low: int, high: int, n: int) -> list[SamplingParams]:
    """One copy of `params` per request with max_tokens from `random_output_lengths`."""
    return [dataclasses.replace(params, max_tokens=m) for m in random_output_lengths(low, high, n)]


def _extra(sampling: dict | None) -> dict:
    """Sampling knobs beyond temperature, where this engine's SamplingParams has them."""
    fields = SamplingParams.__dataclass_fields__
    return {k: v for k, v in (sampling or {}).items() if k in fields and k != "temperature"}


def print_table(r: dict) -> None:
    print(f"\n{'engine':<16}{'seconds':>10}{'out tok/s':>12}{'cpu seconds':>14}")
    print(f"{'nanovllm':<16}{r['nanovllm_s']:>10.2f}{r['nanovllm_out_tok_s']:>12.1f}{r['nanovllm_cpu_s']:>14.2f}")
    if "hf_s" in r:
        print(f"{'hf transformers':<16}{r['hf_s']:>10.2f}{r['hf_out_tok_s']:>12.1f}{r['hf_cpu_s']:>14.2f}")
        print(f"ratio nanovllm / hf: {r['ratio']:.2f}x wall, {r['cpu_ratio']:.2f}x in CPU time per token")
    if "vllm_s" in r:
        print(f"{'vllm cpu':<16}{r['vllm_s']:>10.2f}{r['vllm_out_tok_s']:>12.1f}{r['vllm_cpu_s']:>14.2f}")
        print(f"ratio nanovllm / vllm: {r['vllm_ratio']:.2f}x wall ({r['dtype']})")


if __name__ == "__main__":
    main()
