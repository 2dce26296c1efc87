"""This engine against llama.cpp on one GGUF file: prefill and decode tok/s at 1, 8 and 64 streams.

Each measurement runs in a fresh process, the two engines alternating (engine, llama.cpp, engine,
...), with the same file, thread count, prompt and output lengths: S streams of `--prompt-len`
random prompt tokens each, `--gen-len` generated tokens each, EOS ignored. llama.cpp runs as its
`llama-batched-bench` (`-npp P -ntg G -npl S`, its prefill and decode rates); this engine runs
through `LLMEngine.step()`, prefill rate = prompt tokens / time of the steps that prefilled, decode
rate = tokens / time of the steps that only decoded. Beside them, the physical limit at one
stream: the weight bytes a decode step reads (every matrix once, as stored in memory) over the
memory read bandwidth measured in this run (a multi-threaded sum over 512 MB). `--dequantized`
adds this engine with the weights dequantized to float at load (`gguf_weights="float"`, the path
before packed weights);
`--per-op` adds it with the one-call decode path off (NANOVLLM_CPU_DECODE=0: every layer's ops
called one by one from Python, the path before layers/cpu_decode.py), alternating with the rest.
`--hf-shape tiny|mid` makes the same table for a random HF checkpoint of that bench shape
(bench/models.py) with `quantization="int8"` against bf16 and fp32 weights, no llama.cpp.
`--isa avx2,avx512,avx512_vnni` adds this engine with its kernels built for each level
(NANOVLLM_CPU_ISA: the AVX2 path, AVX-512 without VNNI, AVX-512 VNNI), so the paths of other CPUs
are timed side by side on this one; `--baseline TREE` adds the engine of another source tree (an
earlier commit unpacked there), for a before/after in one run on a machine whose load drifts.

llama.cpp is a peer, never a dependency: build it with `bash ../shared/peers/build_llamacpp.sh`
(or pass `--llama-bin DIR`); without it only this engine runs. Prints one JSON line, then a table.

    python -m bench.gguf_peer                          # the default model, 2 threads, streams 1,8,64
    python -m bench.gguf_peer --streams 1 --repeats 3 --gen-len 64
    python -m bench.gguf_peer --streams 1 --threads 1 --per-op    # the one-call decode path on and off
    python -m bench.gguf_peer --streams 1 --isa avx2,avx512       # the kernels of other CPUs, here
    python -m bench.gguf_peer --hf-shape mid                      # HF int8 against bf16 and fp32
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

DEFAULT_LLAMA_BIN = os.path.expanduser("~/.cache/nanovllm-peers/llama.cpp/build/bin")


def memory_bandwidth_gbs(threads: int) -> float:
    """Best of five multi-threaded sums over 512 MB of float32: read bandwidth in GB/s."""
    import torch

    torch.set_num_threads(threads)
    data = torch.ones(128 << 20)
    data.sum()
    best = min(_timed(data.sum) for _ in range(5))
    return data.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def decode_weight_bytes(model: str) -> int:
    """Bytes of every matrix a decode step reads (the embedding's one row aside), as loaded."""
    from nanovllm.models.gguf_loader import iter_gguf_weights
    from nanovllm.models.loader import resolve_model_path

    total = 0
    for name, weight in iter_gguf_weights(resolve_model_path(model), packed=True):
        tied_head = name == "model.embed_tokens.weight"  # the LM head reads it whole (tied or not, once)
        if getattr(weight, "bits", None) is not None:
            total += weight.nbytes
        elif weight.dim() == 2 or tied_head:
            total += weight.numel() * weight.element_size()
    return total


def engine_worker(args: argparse.Namespace) -> dict:
    """One measurement of this engine (run in a fresh process by `main`)."""
    import random

    import torch

    from nanovllm.config import Config
    from nanovllm.engine.llm_engine import LLMEngine
    from nanovllm.sampling_params import SamplingParams

    streams = args.streams[0]
    model = args.model
    if args.hf_shape is not None:
        from bench.models import make_bench_model

        model = make_bench_model(args.hf_shape, args.model_dir)
    blocks = streams * (-(-(args.prompt_len + args.gen_len) // 16) + 1) + 16
    engine = LLMEngine(Config(model=model, num_threads=args.threads, dtype=args.dtype, num_kvcache_blocks=blocks,
                              max_num_seqs=max(streams, 1), quantization=args.quantization,
                              gguf_weights="float" if args.dequantized else "packed"))
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)

    def run(n: int, prompt_len: int, gen_len: int) -> tuple[float, int, float, int]:
        params = SamplingParams(temperature=0, max_tokens=gen_len, ignore_eos=True)
        for i in range(n):
            engine.add_request(f"{time.perf_counter_ns()}-{i}", [rng.randrange(2, vocab) for _ in range(prompt_len)], params)
        prefill_s = decode_s = 0.0
        prefill_tokens = decode_tokens = 0
        while engine.has_unfinished_requests():
            elapsed = _timed(engine.step)
            last = engine.last_step
            if last.num_prefill_tokens:
                prefill_s, prefill_tokens = prefill_s + elapsed, prefill_tokens + last.num_prefill_tokens
            else:
                decode_s, decode_tokens = decode_s + elapsed, decode_tokens + last.num_decode_tokens
        return prefill_s, prefill_tokens, decode_s, decode_tokens

    run(min(streams, 2), 16, 4)  # warm-up: kernels built, buffers sized
    prefill_s, prefill_tokens, decode_s, decode_tokens = run(streams, args.prompt_len, args.gen_len)
    weight_bytes = loaded_weight_bytes(engine.runner.model)
    engine.runner.close()
    label = "float" if args.dequantized else "per-op" if os.environ.get("NANOVLLM_CPU_DECODE") == "0" else "nanovllm"
    return {"engine": label, "streams": streams, "prefill_tok_s": prefill_tokens / prefill_s,
            "decode_tok_s": decode_tokens / decode_s, "dtype": str(engine.runner.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "load": os.getloadavg()[0], "weight_bytes": weight_bytes}


def loaded_weight_bytes(model) -> int:
    """Bytes a decode step reads of the matrices as the engine holds them (packed or float): every
    linear layer and the LM head once, the input embedding aside (a row a token) unless tied."""
    embedding = model.model.embed_tokens
    tied = model.lm_head.weight is embedding.weight
    seen, total = set(), 0
    for module in model.modules():
        if not hasattr(module, "keep_packed") or (module is embedding and not tied):
            continue
        held = module.quant if module.quant is not None else module.weight
        if id(held) in seen:
            continue
        seen.add(id(held))
        total += held.nbytes if module.quant is not None else held.numel() * held.element_size()
    return total


def llama_cpp_run(args: argparse.Namespace, model_path: str, streams: int) -> dict | None:
    ctx = streams * (args.prompt_len + args.gen_len) + 64
    cmd = [os.path.join(args.llama_bin, "llama-batched-bench"), "-m", model_path, "-c", str(ctx), "-b", "2048",
           "-ub", "512", "-npp", str(args.prompt_len), "-ntg", str(args.gen_len), "-npl", str(streams),
           "-t", str(args.threads), "--output-format", "jsonl"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode < 0 and streams == 1:  # killed by a signal (SIGILL, SIGSEGV seen here)
        return llama_bench_decode(args, model_path)
    engine = "llama.cpp"
    if done.returncode < 0:
        # On an AMX Xeon its weight-repacking path dies at several streams (SIGILL or SIGSEGV);
        # without repacking (-nr) it runs: that row is labelled so.
        died = -done.returncode
        done = subprocess.run(cmd + ["-nr"], capture_output=True, text=True)
        engine = "llama.cpp -nr"
        if done.returncode < 0:
            print(f"llama-batched-bench died at {streams} streams (signal {died}, and {-done.returncode} with -nr): "
                  "no llama.cpp row", file=sys.stderr)
            return None
    done.check_returncode()
    row = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    return {"engine": engine, "streams": streams, "prefill_tok_s": row["speed_pp"], "decode_tok_s": row["speed_tg"],
            "load": os.getloadavg()[0]}


def llama_bench_decode(args: argparse.Namespace, model_path: str) -> dict:
    """One stream's decode rate from `llama-bench`, after a context of the prompt's length fed one
    token at a time (`-ub 1`): where llama.cpp's batched prompt kernels die on an instruction the
    VM advertises but does not run (SIGILL or SIGSEGV, seen with AMX), its one-row decode still runs."""
    cmd = [os.path.join(args.llama_bin, "llama-bench"), "-m", model_path, "-p", "0", "-n", str(args.gen_len),
           "-d", str(args.prompt_len), "-ub", "1", "-r", "1", "-t", str(args.threads), "-o", "jsonl"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    row = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    return {"engine": "llama.cpp", "streams": 1, "prefill_tok_s": float("nan"), "decode_tok_s": row["avg_ts"],
            "load": os.getloadavg()[0]}


def engine_run(args: argparse.Namespace, streams: int, dequantized: bool = False, per_op: bool = False,
               isa: str | None = None, tree: str | None = None, hf: tuple[str, str, str | None] | None = None) -> dict:
    """One worker process. `isa`: the kernels built for that level (NANOVLLM_CPU_ISA); `tree`: the
    engine of another source tree (an earlier commit's files), labelled "baseline"; `hf`: (label,
    dtype, quantization) of an HF-shape run."""
    dtype = hf[1] if hf is not None else args.dtype
    cmd = [sys.executable, "-m", "bench.gguf_peer", "--worker", "--model", args.model, "--streams", str(streams),
           "--threads", str(args.threads), "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len),
           "--dtype", dtype] + (["--dequantized"] if dequantized else [])
    if hf is not None:
        cmd += ["--hf-shape", args.hf_shape, "--model-dir", args.model_dir] + (["--quantization", hf[2]] if hf[2] else [])
    env = dict(os.environ, NANOVLLM_CPU_DECODE="0" if per_op else "1")
    if isa is not None:
        env["NANOVLLM_CPU_ISA"] = isa
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([tree, os.path.join(tree, "client"), env.get("PYTHONPATH", "")])
    cwd = tree or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env, cwd=cwd).stdout
    row = json.loads(out.strip().splitlines()[-1])
    if hf is not None:
        row["engine"] = hf[0]
    elif tree is not None:
        row["engine"] = "baseline" + ("" if row["engine"] == "nanovllm" else f" {row['engine']}")
    elif isa is not None:
        row["engine"] = f"{row['engine']} {isa}"
    return row


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return platform.processor()
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8") if f in flags]
    return f"{name} ({', '.join(isa)})"


def summarize(rows: list[dict]) -> list[dict]:
    """Median per (engine, streams) over the repeats."""
    order = {"nanovllm": 0, "per-op": 1, "float": 2, "llama.cpp": 3}
    keys = sorted({(r["engine"], r["streams"]) for r in rows},
                  key=lambda k: (k[1], order.get(k[0].split(" ")[0], 2.5), k[0]))
    table = []
    for engine, streams in keys:
        runs = [r for r in rows if (r["engine"], r["streams"]) == (engine, streams)]
        decode = statistics.median(r["decode_tok_s"] for r in runs)
        table.append({"engine": engine, "streams": streams, "runs": len(runs),
                      "prefill_tok_s": round(statistics.median(r["prefill_tok_s"] for r in runs), 1),
                      "decode_tok_s": round(decode, 1),
                      "decode_ms_per_token": round(1e3 / decode, 2) if streams == 1 else None,
                      "decode_tok_s_all": [round(r["decode_tok_s"], 1) for r in runs],
                      "load_after": [round(r["load"], 1) for r in runs]})
    return table


HF_CONFIGS = [("int8", None, "int8"), ("bf16", "bfloat16", None), ("fp32", "float32", None)]
"""(label, dtype, quantization) of the `--hf-shape` table: weight-only int8 (activations in
`--dtype`) against the float checkpoint in bf16 and in fp32."""


def hf_table(args: argparse.Namespace) -> dict:
    """The `--hf-shape` table: each config at each stream count in a fresh process, alternating."""
    from bench.models import make_bench_model

    make_bench_model(args.hf_shape, args.model_dir)  # built once here, not in racing workers
    bandwidth = memory_bandwidth_gbs(args.threads)
    rows = []
    for _ in range(args.repeats):
        for streams in args.streams:
            for label, dtype, quantization in HF_CONFIGS:
                rows.append(engine_run(args, streams, hf=(label, dtype or args.dtype, quantization)))
    table = summarize(rows)
    weights = {r["engine"]: r["weight_bytes"] for r in rows}
    result = {"bench": "gguf_peer", "hf_shape": args.hf_shape, "cpu": cpu_model(), "threads": args.threads,
              "load_average": os.getloadavg()[0], "prompt_len": args.prompt_len, "gen_len": args.gen_len,
              "memory_read_gb_s": round(bandwidth, 1), "decode_weight_mb": {k: round(v / 1e6, 1) for k, v in weights.items()},
              "one_stream_limit_tok_s": {k: round(bandwidth * 1e9 / v, 1) for k, v in weights.items()}, "rows": table}
    print(json.dumps(result))
    print(f"\nHF shape {args.hf_shape}, {result['cpu']}, {args.threads} threads; memory read {bandwidth:.1f} GB/s; "
          "a decode step reads " + ", ".join(f"{k} {v / 1e6:.1f} MB (at most {bandwidth * 1e9 / v:.0f} tok/s)"
                                             for k, v in weights.items()))
    print_table(table)
    return result


def print_table(table: list[dict]) -> None:
    width = max(10, *(len(r["engine"]) + 2 for r in table))
    print(f"{'engine':<{width}}{'streams':>8}{'prefill tok/s':>15}{'decode tok/s':>14}{'ms/token':>10}  decode runs")
    for r in table:
        ms = f"{r['decode_ms_per_token']:.2f}" if r["decode_ms_per_token"] else "-"
        print(f"{r['engine']:<{width}}{r['streams']:>8}{r['prefill_tok_s']:>15.1f}{r['decode_tok_s']:>14.1f}{ms:>10}  "
              f"{r['decode_tok_s_all']}")


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="'default' or a .gguf file")
    ap.add_argument("--streams", default=[1, 8, 64], type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--llama-bin", default=DEFAULT_LLAMA_BIN, help="folder with llama-batched-bench")
    ap.add_argument("--dequantized", action="store_true", help="also run this engine on float weights, as before")
    ap.add_argument("--per-op", action="store_true", help="also run this engine with the one-call decode path off")
    ap.add_argument("--isa", default=[], type=lambda s: [x for x in s.split(",") if x],
                    help="also run this engine with its kernels built for each of these levels (comma-separated: "
                         "avx2, avx512, avx512_vnni; NANOVLLM_CPU_ISA), capped by what the CPU has")
    ap.add_argument("--baseline", metavar="TREE", help="also run the engine of this source tree (e.g. an earlier "
                    "commit: git archive <commit> | tar -x -C TREE), alternating with the rest")
    ap.add_argument("--hf-shape", choices=["tiny", "mid"], help="instead of a GGUF file and llama.cpp: a random "
                    "HF checkpoint of this bench shape (bench/models.py), quantization='int8' against bf16 and fp32")
    ap.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "nanovllm-bench-models"),
                    help="where --hf-shape checkpoints are built (once)")
    ap.add_argument("--quantization", choices=["int8"], help=argparse.SUPPRESS)  # a worker's engine option
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from nanovllm.layers.cpu_kernels import ISA_LEVELS

    unknown = [x for x in args.isa if x not in ISA_LEVELS]
    if unknown:
        ap.error(f"--isa takes {', '.join(ISA_LEVELS)}; got {', '.join(unknown)}")
    if args.baseline is not None and not os.path.isfile(os.path.join(args.baseline, "bench", "gguf_peer.py")):
        ap.error(f"--baseline {args.baseline}: no bench/gguf_peer.py there")
    if args.worker:
        print(json.dumps(engine_worker(args)))
        return None

    if args.hf_shape is not None:
        return hf_table(args)

    from nanovllm.models.loader import resolve_model_path

    model_path = resolve_model_path(args.model)
    have_llama = os.path.isfile(os.path.join(args.llama_bin, "llama-batched-bench"))
    if not have_llama:
        print(f"llama-batched-bench not in {args.llama_bin}: measuring this engine only "
              "(bash ../shared/peers/build_llamacpp.sh builds it)", file=sys.stderr)
    bandwidth = memory_bandwidth_gbs(args.threads)
    weight_bytes = decode_weight_bytes(args.model)
    rows = []
    for _ in range(args.repeats):
        for streams in args.streams:
            rows.append(engine_run(args, streams))
            for isa in args.isa:
                rows.append(engine_run(args, streams, isa=isa))
            if args.baseline is not None:
                rows.append(engine_run(args, streams, tree=args.baseline))
                if args.per_op:
                    rows.append(engine_run(args, streams, per_op=True, tree=args.baseline))
            if args.per_op:
                rows.append(engine_run(args, streams, per_op=True))
            if args.dequantized:
                rows.append(engine_run(args, streams, dequantized=True))
            if have_llama and (row := llama_cpp_run(args, model_path, streams)) is not None:
                rows.append(row)
    table = summarize(rows)
    limit = bandwidth * 1e9 / weight_bytes
    result = {"bench": "gguf_peer", "model": os.path.basename(model_path), "cpu": cpu_model(), "threads": args.threads,
              "load_average": os.getloadavg()[0],  # other work on the machine skews both engines
              "prompt_len": args.prompt_len, "gen_len": args.gen_len, "memory_read_gb_s": round(bandwidth, 1),
              "decode_weight_mb": round(weight_bytes / 1e6, 1), "one_stream_limit_tok_s": round(limit, 1),
              "rows": table}
    print(json.dumps(result))
    print(f"\n{result['cpu']}, {args.threads} threads; memory read {bandwidth:.1f} GB/s; a decode step reads "
          f"{weight_bytes / 1e6:.1f} MB of weights -> at most {limit:.0f} tok/s ({1e3 / limit:.2f} ms) at one stream")
    print_table(table)
    return result


if __name__ == "__main__":
    main()
