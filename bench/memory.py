"""What loading a GGUF model costs in resident memory, this engine beside llama.cpp.

This engine, each configuration in a fresh process: RSS after the imports (`import torch`,
`from nanovllm import LLM`), then `LLM(model, num_kvcache_blocks=64)` and one greedy request;
the figure is the difference ("added"), beside the process's peak (VmHWM) and what the engine
holds in tensors: the model's weights (every parameter and buffer, each storage counted once)
and the KV cache. `--dequantized` adds the engine with the weights dequantized to float at load
(the path before packed weights). llama.cpp: the peak RSS of its whole process
(`/usr/bin/time -v llama-bench -p 16 -n 16`) on the same file and thread count; its imports
are a C binary's, so it has no "after the imports" to subtract.

    python -m bench.memory                      # the default model
    python -m bench.memory --dequantized --repeats 2
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

from bench.gguf_peer import DEFAULT_LLAMA_BIN, cpu_model


def _status_mb(field: str) -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def _held_bytes(model, seen: set[int]):
    """The bytes of every tensor storage the model's modules hold, once: parameters, buffers and the packed
    weights the loader keeps as plain attributes (`QuantizedWeight`'s codes, scales and mins)."""
    import dataclasses

    import torch

    def visit(value, depth: int = 0):
        if isinstance(value, torch.Tensor):
            try:
                storage = value.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
            except NotImplementedError:  # oneDNN's prepacked copy (an opaque tensor): its elements
                key, nbytes = id(value), value.numel() * value.element_size()
            if key not in seen:
                seen.add(key)
                yield nbytes
        elif depth < 3 and isinstance(value, dict):
            for item in value.values():
                yield from visit(item, depth + 1)
        elif depth < 3 and isinstance(value, (list, tuple)):
            for item in value:
                yield from visit(item, depth + 1)
        elif depth < 3 and dataclasses.is_dataclass(value) and not isinstance(value, type):
            for field in dataclasses.fields(value):
                yield from visit(getattr(value, field.name), depth + 1)

    for module in model.modules():
        yield from visit({k: v for k, v in vars(module).items() if k != "_modules"})


def engine_worker(args: argparse.Namespace) -> dict:
    """One measurement (run in a fresh process by `main`)."""
    import torch

    from nanovllm import LLM, SamplingParams

    before = _status_mb("VmRSS")
    llm = LLM(args.model, num_kvcache_blocks=64, num_threads=args.threads, dtype=args.dtype,
              gguf_weights="float" if args.dequantized else "packed")
    llm.generate(["What is the capital of France?"], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    after = _status_mb("VmRSS")
    runner = llm.engine.runner
    kv_cache = getattr(runner, "kv_cache", None)
    kv = kv_cache.untyped_storage() if kv_cache is not None else None
    seen = {kv.data_ptr()} if kv is not None else set()
    weights = sum(_held_bytes(runner.model, seen))
    kv_bytes = kv.nbytes() if kv is not None else 0
    return {"engine": "float" if args.dequantized else "nanovllm", "dtype": str(runner.dtype).removeprefix("torch."),
            "rss_after_imports_mb": round(before, 1), "rss_mb": round(after, 1), "added_mb": round(after - before, 1),
            "peak_mb": round(_status_mb("VmHWM"), 1), "weights_mb": round(weights / 2**20, 1),
            "kv_cache_mb": round(kv_bytes / 2**20, 1), "threads": torch.get_num_threads()}


def engine_run(args: argparse.Namespace, dequantized: bool) -> dict:
    cmd = [sys.executable, "-m", "bench.memory", "--worker", "--model", args.model, "--threads", str(args.threads),
           "--dtype", args.dtype] + (["--dequantized"] if dequantized else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout
    return json.loads(out.strip().splitlines()[-1])


def llama_cpp_run(args: argparse.Namespace, model_path: str) -> dict:
    cmd = ["/usr/bin/time", "-v", os.path.join(args.llama_bin, "llama-bench"), "-m", model_path, "-p", "16",
           "-n", "16", "-r", "1", "-t", str(args.threads)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    if peak is None:
        raise RuntimeError(f"llama-bench under /usr/bin/time gave no peak RSS (exit {done.returncode})")
    return {"engine": "llama.cpp", "peak_mb": round(int(peak.group(1)) / 1024, 1), "exit": done.returncode}


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="'default' or a .gguf file")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dequantized", action="store_true", help="also measure float weights, as before packing")
    ap.add_argument("--llama-bin", default=DEFAULT_LLAMA_BIN, help="folder with llama-bench")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(engine_worker(args)))
        return None

    from nanovllm.models.loader import resolve_model_path

    model_path = resolve_model_path(args.model)
    have_llama = os.path.isfile(os.path.join(args.llama_bin, "llama-bench")) and os.path.isfile("/usr/bin/time")
    rows = []
    for _ in range(args.repeats):
        rows.append(engine_run(args, dequantized=False))
        if args.dequantized:
            rows.append(engine_run(args, dequantized=True))
        if have_llama:
            rows.append(llama_cpp_run(args, model_path))
    file_mb = os.path.getsize(model_path) / 2**20
    result = {"bench": "memory", "model": os.path.basename(model_path), "file_mb": round(file_mb, 1),
              "cpu": cpu_model(), "threads": args.threads, "rows": rows}
    print(json.dumps(result))
    print(f"\n{result['cpu']}; {result['model']}: {file_mb:.1f} MiB on disk (goal: added <= {1.3 * file_mb:.0f} MiB)")
    print(f"{'engine':<10}{'dtype':>10}{'added MiB':>11}{'peak MiB':>10}{'weights':>9}{'KV cache':>10}")
    for r in rows:
        dash = "-"
        print(f"{r['engine']:<10}{r.get('dtype', dash):>10}{r.get('added_mb', dash):>11}{r['peak_mb']:>10}"
              f"{r.get('weights_mb', dash):>9}{r.get('kv_cache_mb', dash):>10}")
    return result


if __name__ == "__main__":
    main()
