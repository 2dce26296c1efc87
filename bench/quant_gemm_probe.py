"""Per-shape timing of the large-batch packed linear: the panel path (quant_dequant + F.linear),
the fused `quant_gemm_bf16` kernel and the float weights prepacked for oneDNN, on the default
model's shapes, 4-bit (Q4_1 layout) and 8-bit (Q8_0 layout) weights, bf16 x.

    python -m bench.quant_gemm_probe [--threads 2] [--rows 16 64 128 512]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128, 512])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = CpuOps.load()
    gen = torch.Generator().manual_seed(0)
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
    print(json.dumps({"bench": "quant_gemm_probe", "threads": args.threads, "rows": results,
                      "loadavg_before": load_before, "loadavg_after": os.getloadavg()}))


if __name__ == "__main__":
    main()
