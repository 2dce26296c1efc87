"""Per-shape timing of the large-batch packed linear: the panel path (quant_dequant + F.linear),
the fused `quant_gemm_bf16` kernel and the float weights prepacked for oneDNN, on the default
model's shapes, 4-bit (Q4_1 layout) and 8-bit (Q8_0 layout) weights, bf16 x.

Then, per number of rows, a decode step's linear layers as the default model runs them (30
layers of 4-bit qkv, o, gate_up and down, and the 8-bit LM head, each shape by the fastest of
the three): their ms, the GFLOP/s that makes, and the tokens/s a step could reach if nothing
but these products took time, the ceiling of a decode step with that many streams on this CPU.

    python -m bench.quant_gemm_probe [--threads 2] [--rows 16 64 128 512]

`--matvec`: instead, the batch-1 products of a decode step as the weights come from memory: 30
layers of separate 4-bit matrices and the 8-bit LM head (96 MB, three times the L3 of the CPUs
here), one call each through `quant_matmul` (so the layers' figure includes 120 calls' Python),
the median ms and GB/s of each part.

    python -m bench.quant_gemm_probe --matvec
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from nanovllm.layers import cpu_gemm
from nanovllm.layers.cpu_kernels import CpuOps
from nanovllm.layers.quant import QuantizedWeight, _panel_matmul

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def random_weight(bits: int, n: int, k: int, gen: torch.Generator) -> QuantizedWeight:
    scales = (torch.rand(n, k // 32, generator=gen) * 0.01 + 0.001).half()
    if bits == 4:  # Q4_1: codes 0..15, a min per group
        codes = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
        return QuantizedWeight(4, 32, codes, scales, (-8 * scales.float()).half())
    codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)  # Q8_0: no mins
    return QuantizedWeight(8, 32, codes, scales, None)


def median_ms(fns, seconds: float = 0.8) -> list[float]:
    """Median ms of each of `fns`, run in turn (A, B, C, A, B, C, ...) so load drift hits all alike."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    spent = 0.0
    while spent < seconds or len(times[0]) < 7:
        for fn, own in zip(fns, times):
            start = time.perf_counter()
            fn()
            own.append(time.perf_counter() - start)
            spent += own[-1]
    return [statistics.median(own) * 1e3 for own in times]


LAYERS = 30  # the default model's (SmolLM2-135M): Q4_1 layers, a Q8_0 tied LM head


def step_ceilings(results: list[dict]) -> list[dict]:
    """Per number of rows: a decode step's linears at the fastest path per shape, and what that caps."""
    steps = []
    for rows in sorted({r["rows"] for r in results}):
        ms = flops = 0.0
        for r in results:
            if r["rows"] != rows or r["bits"] != (8 if r["shape"] == "lm_head" else 4):
                continue
            times = LAYERS if r["shape"] != "lm_head" else 1
            ms += times * min(r["panel_ms"], r["fused_ms"], r["onednn_ms"])
            flops += times * 2.0 * rows * r["n"] * r["k"]
        steps.append({"rows": rows, "linear_ms": round(ms, 3), "gflops": round(flops / ms / 1e6, 1),
                      "tok_s_ceiling": round(rows / ms * 1e3, 1)})
    return steps


def matvec_step(ops: CpuOps, gen: torch.Generator, rounds: int = 20) -> dict:
    """Median ms of the layers' and the LM head's batch-1 products, the weights out of cache."""
    layer_shapes = [SHAPES[name] for name in ("qkv", "o", "gate_up", "down")]
    layers = [[random_weight(4, n, k, gen) for n, k in layer_shapes] for _ in range(LAYERS)]
    head = random_weight(8, *SHAPES["lm_head"], gen)
    xs = {k: torch.randn(1, k, generator=gen).bfloat16() for k in (576, 1536)}
    times: dict[str, list[float]] = {"layers": [], "lm_head": []}
    for _ in range(rounds):
        start = time.perf_counter()
        for weights in layers:
            for weight, (_, k) in zip(weights, layer_shapes):
                ops.quant_matmul(weight, xs[k])
        middle = time.perf_counter()
        ops.quant_matmul(head, xs[576])
        times["layers"].append(middle - start)
        times["lm_head"].append(time.perf_counter() - middle)
    sizes = {"layers": sum(w.nbytes for weights in layers for w in weights), "lm_head": head.nbytes}
    return {part: {"ms": round(statistics.median(ts) * 1e3, 3), "mb": round(sizes[part] / 1e6, 1),
                   "gb_s": round(sizes[part] / statistics.median(ts) / 1e9, 1)} for part, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128, 512])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--matvec", action="store_true", help="the batch-1 products of a step, from memory")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = CpuOps.load()
    gen = torch.Generator().manual_seed(0)
    if args.matvec:
        parts = matvec_step(ops, gen)
        for part, figures in parts.items():
            print(f"{part:8} {figures['ms']:7.3f} ms  {figures['mb']:6.1f} MB  {figures['gb_s']:5.1f} GB/s")
        print(json.dumps({"bench": "quant_gemm_probe", "mode": "matvec", "threads": args.threads, **parts}))
        return
    load_before, results = os.getloadavg(), []
    print(f"{'shape':8} {'bits':>4} {'rows':>4} {'panel':>8} {'fused':>8} {'oneDNN':>8}  fused/panel  fused/oneDNN")
    for name in args.shapes:
        n, k = SHAPES[name]
        for bits in (4, 8):
            weight = random_weight(bits, n, k, gen)
            dense = weight.dequantize(torch.bfloat16)
            packed = torch.ops.mkldnn._reorder_linear_weight(dense, 64)
            for rows in args.rows:
                x = torch.randn(rows, k, generator=gen).bfloat16()
                panel, fused, onednn = median_ms([lambda: _panel_matmul(x, weight, ops),
                                                  lambda: ops.quant_gemm_bf16(weight, x),
                                                  lambda: cpu_gemm.linear(x, dense, None, packed)])
                print(f"{name:8} {bits:4} {rows:4} {panel:8.3f} {fused:8.3f} {onednn:8.3f}  {fused / panel:11.2f}  "
                      f"{fused / onednn:12.2f}", flush=True)
                results.append({"shape": name, "n": n, "k": k, "bits": bits, "rows": rows, "panel_ms": round(panel, 3),
                                "fused_ms": round(fused, 3), "onednn_ms": round(onednn, 3)})
    steps = step_ceilings(results) if set(SHAPES) <= set(args.shapes) else []
    for step in steps:
        print(f"decode step, {step['rows']} rows: linears {step['linear_ms']:.2f} ms, {step['gflops']:.0f} GFLOP/s, "
              f"at most {step['tok_s_ceiling']:.0f} tok/s", flush=True)
    print(json.dumps({"bench": "quant_gemm_probe", "threads": args.threads, "rows": results, "steps": steps,
                      "loadavg_before": load_before, "loadavg_after": os.getloadavg()}))


if __name__ == "__main__":
    main()
