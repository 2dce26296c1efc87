"""Decode attention on CPU alone: the compiled paged kernel against torch's path, at one step's shape.

One decode step of attention per layer: `--seqs` sequences, each attending to `--context` cached
positions in blocks of `--block-size`, read in place from a paged cache, over `--layers` layers
whose caches are separate (so each call reads its K/V from memory, as a real step does, not from
a cache the previous call warmed). The peer is what the engine runs without a C compiler:
`PagedAttention._decode`, a gather of each sequence's blocks and `scaled_dot_product_attention`.
Each measurement runs in a fresh process; the two block layouts are
- `contiguous`: each sequence's blocks one after another (a cache filled by prefill alone);
- `scattered`: blocks in random order (a cache after many steps of allocation and release).

Reports milliseconds per layer (best of `--repeats`) and the K/V bytes read per second; one JSON
line per measurement, then a table.

`--chunk N` measures a prompt chunk instead: one sequence's N new rows after `--cached` positions
already in the cache (each row attends to the ones before it). `kernel` is the chunk kernel the
engine calls (`CpuAttentionKernel.chunk`: tiles of rows); `rows` is the decode kernel taking the
chunk a row at a time, as the engine did before the chunk kernel; torch's path is causal SDPA
over the chunk's own K/V when nothing is cached, else SDPA over the gathered context with the
offset mask `build_cpu_batch` makes.

    python -m bench.cpu_attention                         # mid's decode shape, bf16 and fp32
    python -m bench.cpu_attention --dtype bfloat16 --layout scattered --repeats 9
    python -m bench.cpu_attention --chunk 2048 --cached 0 --layers 2 --layout contiguous
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from nanovllm.engine.step_input import StepInput, build_cpu_batch
from nanovllm.layers.attention import PagedAttention
from nanovllm.layers.cpu_kernels import CpuAttentionKernel

IMPLS = ("kernel", "rows", "torch")
"""`rows`: a prompt chunk through the decode kernel, a row at a time (chunk mode only)."""
LAYOUTS = ("contiguous", "scattered")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def measure(args: argparse.Namespace, impl: str, layout: str, dtype: torch.dtype) -> dict:
    """Time one (impl, layout, dtype) in this process: a decode step of `--seqs` rows or, with
    `--chunk`, one sequence's prompt chunk. The step metadata (block tables, context lengths, the
    torch path's masks and context slots) is the engine's own, from `build_cpu_batch`."""
    torch.set_num_threads(args.threads)
    chunk, bs = args.chunk, args.block_size
    seqs, context = (1, args.cached + chunk) if chunk else (args.seqs, args.context)
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-context // bs)
    shape = (args.layers * seqs * per_seq, bs, args.kv_heads, args.head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    order = torch.randperm(shape[0], generator=gen) if layout == "scattered" else torch.arange(shape[0])
    q = torch.randn(chunk or seqs, args.heads, args.head_dim, generator=gen).to(dtype)
    layer = PagedAttention(args.heads, args.kv_heads, args.head_dim)
    layer.k_cache, layer.v_cache = k_cache, v_cache
    k_flat, v_flat = (c.view(-1, args.kv_heads, args.head_dim) for c in (k_cache, v_cache))
    inputs = []  # per layer: its step's metadata, and for a chunk its own K/V rows as the model has them
    for tables in order.view(args.layers, seqs, per_seq).tolist():  # one layer's cache each
        step = (StepInput([], [], [], [[1] * chunk], [args.cached], tables, []) if chunk else
                StepInput([1] * seqs, [context - 1] * seqs, tables, [], [], [], []))
        meta = build_cpu_batch(step, bs, torch_attention=True)[2]
        inputs.append((meta, (k_flat[meta.slot_mapping], v_flat[meta.slot_mapping])))
    kernel = CpuAttentionKernel.load() if impl != "torch" else None
    if impl != "torch" and kernel is None:
        raise SystemExit("the CPU kernels could not be built here")

    def run(item):
        meta, (k_new, v_new) = item
        if not chunk:
            return (kernel(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_rows, meta.decode_context_lens,
                           layer.scale) if kernel else layer._decode(q, meta))
        span = meta.prefills[0]
        if impl == "kernel":
            return kernel.chunk(q, k_cache, v_cache, span.block_table, span.num_cached, layer.scale)
        if impl == "rows":  # row i sees num_cached + i + 1 positions
            return kernel(q, k_cache, v_cache, span.block_table.view(1, -1), torch.zeros(chunk, dtype=torch.long),
                          torch.arange(span.num_cached + 1, span.num_cached + chunk + 1), layer.scale)
        if span.num_cached == 0:
            return layer._attend(q, k_new, v_new, mask=None)
        return layer._attend(q, k_flat[span.context_slots], v_flat[span.context_slots], span.mask)

    positions = chunk * (args.cached + (chunk + 1) / 2) if chunk else seqs * context  # K/V rows read per layer
    kv_bytes = 2 * positions * args.kv_heads * args.head_dim * k_cache.element_size()
    extent = dict(chunk=chunk, cached=args.cached) if chunk else dict(seqs=seqs, context=context)
    return timed(args, run, inputs, kv_bytes, impl=impl, layout=layout, dtype=str(dtype).removeprefix("torch."),
                 **extent)


def timed(args: argparse.Namespace, step, inputs: list, kv_bytes: float, **shape) -> dict:
    """Best time per layer of `step` over `inputs` (one per layer); `kv_bytes`: K/V read per layer."""
    for item in inputs[:2]:  # warm-up (and the kernel's first call)
        step(item)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for item in inputs:
            out = step(item)
        times.append((time.perf_counter() - start) / len(inputs))
    best = min(times)
    return {"bench": "cpu_attention", **shape, "heads": args.heads, "kv_heads": args.kv_heads,
            "head_dim": args.head_dim, "block_size": args.block_size, "threads": args.threads,
            "ms_per_layer": round(best * 1e3, 3), "all_ms": [round(t * 1e3, 3) for t in times],
            "kv_gb_per_s": round(kv_bytes / best / 1e9, 2), "checksum": round(out.float().sum().item(), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=360)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=0, help="prompt-chunk mode: new rows of one sequence")
    parser.add_argument("--cached", type=int, default=0, help="prompt-chunk mode: positions already cached")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=[*DTYPES, "both"], default="both")
    parser.add_argument("--layout", choices=[*LAYOUTS, "both"], default="both")
    parser.add_argument("--impl", choices=[*IMPLS, "both"], default="both")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: measure, print JSON
    parser.add_argument("--json", help="also write the results here (a JSON list)")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args, args.impl, args.layout, DTYPES[args.dtype])))
        return
    pick = lambda value, every: every if value == "both" else (value,)
    results = []
    for dtype in pick(args.dtype, tuple(DTYPES)):
        for layout in pick(args.layout, LAYOUTS):
            for impl in pick(args.impl, IMPLS if args.chunk else ("kernel", "torch")):
                cmd = [sys.executable, "-m", "bench.cpu_attention", "--one", "--impl", impl, "--layout", layout,
                       "--dtype", dtype] + [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in (
                           "seqs", "context", "heads", "kv_heads", "head_dim", "block_size", "layers", "threads",
                           "repeats", "chunk", "cached")]
                line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
                print(line, flush=True)
                results.append(json.loads(line))
    print(f"\n{'dtype':<10} {'layout':<11} {'impl':<7} {'ms/layer':>9} {'K/V GB/s':>9}")
    for r in results:
        print(f"{r['dtype']:<10} {r['layout']:<11} {r['impl']:<7} {r['ms_per_layer']:>9.3f} {r['kv_gb_per_s']:>9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
