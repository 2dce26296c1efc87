"""Kernel-level timeline of decode-only steps: which kernels a step runs, how many, for how long.

`record_timeline` feeds B greedy requests to a built engine, lets them reach pure decode, then
runs `steps` decode-only steps under torch.profiler (CUDA activities on a GPU; kernels inside a
replayed CUDA graph are reported one by one). From the kernel events it derives, per step: the
number of kernels, the GPU time summed over kernels, the GPU busy time (the union of kernel
intervals, so overlap counts once) and the wall time of the step on the host; the kernels per
decoder layer (`kernels_per_layer`, which bench/kernel_count.py predicts on CPU); and per kernel
name and per kernel class (GEMM, attention, norm, elementwise, ...) the count and time per step.
On CPU there are no kernels: the same figures are taken over the profiler's CPU ops (nested ops
count inside their parents as well), which only checks the plumbing.

    python -m bench.decode_latency --shape qwen3-0.6b --modes graph --batch-sizes 1,64 --timeline $OUT/tl
"""
from __future__ import annotations

import json
import os
import random
import re
import time

import torch
from torch.profiler import ProfilerActivity, profile

from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.sampling_params import SamplingParams

# First match wins; names are lower-cased. Triton kernels keep their Python names.
_KERNEL_CLASSES = [
    ("attention", r"_decode_kernel|_decode_reduce|_prefill_kernel|flash|attn"),
    ("kv_store", r"store_kvcache"),
    ("fused_norm", r"_rms_norm_kernel"),
    ("fused_qk_rope_store", r"_qk_norm_rope_store"),
    ("fused_silu_mul", r"_silu_mul_kernel"),
    ("gemm", r"gemm|gemv|cutlass|cublas|nvjet|sm\d\d_xmma|matmul|splitk|linear"),
    ("reduce", r"reduce_kernel|reduction"),
    ("index_copy", r"index|gather|scatter|cat|copy"),
    ("elementwise", r"elementwise|vectorized|unrolled"),
    ("memory", r"memcpy|memset"),
]


def kernel_class(name: str) -> str:
    lowered = name.lower()
    for cls, pattern in _KERNEL_CLASSES:
        if re.search(pattern, lowered):
            return cls
    return "other"


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals (microseconds)."""
    total, end_so_far = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= end_so_far:
            continue
        total += end - max(start, end_so_far)
        end_so_far = end
    return total


def summarize(events: list[tuple[str, float, float]], steps: int, wall_s: float, activity: str,
              layers: int | None = None) -> dict:
    """Per-step figures from (name, start_us, end_us) events of `steps` profiled steps; with the
    model's `layers`, also `kernels_per_layer`: per kernel name, its launches per step floor-divided
    by the layers (a kernel of every layer runs `layers` times a step, while the embedding, final
    norm, LM head and sampling add fewer than `layers` launches to a name), summed over names."""
    by_name: dict[str, list[float]] = {}
    for name, start, end in events:
        by_name.setdefault(name, [0, 0.0])
        by_name[name][0] += 1
        by_name[name][1] += end - start
    kernels = sorted(({"name": name, "class": kernel_class(name), "per_step": round(count / steps, 2),
                       "us_per_step": round(us / steps, 2)} for name, (count, us) in by_name.items()),
                     key=lambda k: -k["us_per_step"])
    classes: dict[str, dict] = {}
    for k in kernels:
        c = classes.setdefault(k["class"], {"class": k["class"], "per_step": 0.0, "us_per_step": 0.0})
        c["per_step"] = round(c["per_step"] + k["per_step"], 2)
        c["us_per_step"] = round(c["us_per_step"] + k["us_per_step"], 2)
    summed = sum(end - start for _, start, end in events)
    per_layer = {} if not layers else {
        "kernels_per_layer": sum(round(count / steps) // layers for count, _ in by_name.values())}
    return {"activity": activity, "steps": steps,
            "kernels_per_step": round(len(events) / steps, 1), **per_layer,
            "kernel_us_per_step": round(summed / steps, 1),
            "busy_us_per_step": round(_union_us([(s, e) for _, s, e in events]) / steps, 1),
            "wall_ms_per_step": round(1e3 * wall_s / steps, 3),
            "classes": sorted(classes.values(), key=lambda c: -c["us_per_step"]),
            "kernels": kernels}


def _profiled_events(prof, activity: str) -> list[tuple[str, float, float]]:
    wanted = torch.autograd.DeviceType.CUDA if activity == "cuda" else torch.autograd.DeviceType.CPU
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == wanted]


def record_timeline(engine: LLMEngine, batch: int, steps: int, prompt_len: int, vocab: int) -> dict:
    """Profile `steps` decode-only steps of `batch` sequences; the requests then run to the end."""
    rng = random.Random(batch)
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"t{time.perf_counter_ns()}-{i}", [rng.randrange(2, vocab) for _ in range(prompt_len)],
                           params)

    def decode_only() -> bool:
        return engine.last_step.num_prefill_tokens == 0 and engine.last_step.num_decode_tokens == batch

    while engine.has_unfinished_requests():  # prefill, then one decode step to warm every path
        engine.step()
        if decode_only():
            break
    activity = "cuda" if engine.runner.device.type == "cuda" else "cpu"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if activity == "cuda" else [])
    profiled = 0
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        while profiled < steps and engine.has_unfinished_requests():
            engine.step()
            profiled += decode_only()
        if activity == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    if profiled == 0:
        raise RuntimeError(f"no decode-only step of batch {batch} was profiled")
    return summarize(_profiled_events(prof, activity), profiled, wall, activity,
                     layers=engine.runner.model_config.num_layers)


def write_timeline(prefix: str, mode: str, batch: int, timeline: dict, top: int = 25) -> str:
    """`{prefix}.{mode}.b{batch}.json` and a readable `.txt` table beside it; returns the JSON path."""
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    path = f"{prefix}.{mode}.b{batch}"
    with open(path + ".json", "w") as f:
        json.dump({"mode": mode, "batch": batch, **timeline}, f, indent=1)
    lines = [f"{mode} batch {batch}: {timeline['steps']} steps ({timeline['activity']} events); per step: "
             f"{timeline['kernels_per_step']} kernels ({timeline.get('kernels_per_layer', '?')} per layer), "
             f"{timeline['kernel_us_per_step']} us summed, "
             f"{timeline['busy_us_per_step']} us busy, {timeline['wall_ms_per_step']} ms wall", "",
             f"{'class':<22}{'per step':>10}{'us/step':>10}"]
    lines += [f"{c['class']:<22}{c['per_step']:>10}{c['us_per_step']:>10}" for c in timeline["classes"]]
    lines += ["", f"{'kernel (top %d by time)' % top:<80}{'per step':>10}{'us/step':>10}"]
    lines += [f"{k['name'][:78]:<80}{k['per_step']:>10}{k['us_per_step']:>10}" for k in timeline["kernels"][:top]]
    with open(path + ".txt", "w") as f:
        f.write("\n".join(lines) + "\n")
    return path + ".json"
