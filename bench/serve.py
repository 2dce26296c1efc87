"""Benchmark the three-process service against in-process `LLM.generate` on the same workload.

    python bench/serve.py                         # tiny random Qwen3 (hidden 512, 4 layers)
    python bench/serve.py --model default --num-requests 16 --output-len 64

1. starts `nanovllm serve` (the supervisor) on ipc:// in a temp dir, warms it up, then sends
   `--num-requests` requests (random prompt token ids, `--output-len` tokens each, EOS ignored,
   greedy) from `--clients` concurrent AsyncClients, all in flight at once; records TTFT (submit
   -> first token) and ITL (gap between consecutive deltas, per token);
2. stops the service, then runs the same prompts through `LLM.generate` in this process;
3. prints a table and one JSON line: output tok/s of both, their ratio, TTFT/ITL p50/p99.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def build_tiny_model(path: str) -> str:
    """ENVIRONMENT.md's "tiny" shape (20M params), random weights, offline tokenizer."""
    from tests.helpers.tiny_models import make_tiny_model

    if not os.path.exists(os.path.join(path, "config.json")):
        make_tiny_model(path, "qwen3", hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=4, intermediate_size=1408, max_position_embeddings=2048)
    return path


def make_prompts(n: int, vocab: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# ---------------------------------------------------------------- service side

async def one_request(client, prompt: list[int], output_len: int, record: list) -> None:
    sent = time.perf_counter()
    arrivals: list[tuple[float, int]] = []
    stream = await client.stream(prompt_token_ids=prompt, max_tokens=output_len, ignore_eos=True, temperature=0)
    async for delta in stream:
        if delta.token_ids:
            arrivals.append((time.perf_counter(), len(delta.token_ids)))
    record.append((sent, arrivals))


async def run_clients(url: str, prompts: list[list[int]], output_len: int, num_clients: int) -> dict:
    from nanovllm_client import AsyncClient

    clients = [AsyncClient(url, timeout=3600) for _ in range(num_clients)]
    for c in clients:
        await c.start()
    await asyncio.gather(*(c.generate(prompt_token_ids=prompts[0][:8], max_tokens=4) for c in clients))  # warm-up
    record: list = []
    start = time.perf_counter()
    await asyncio.gather(*(one_request(clients[i % num_clients], p, output_len, record) for i, p in enumerate(prompts)))
    elapsed = time.perf_counter() - start
    for c in clients:
        await c.close()
    ttft = [arr[0][0] - sent for sent, arr in record if arr]
    itl = [(b[0] - a[0]) / b[1] for _, arr in record for a, b in zip(arr, arr[1:])]
    tokens = sum(n for _, arr in record for _, n in arr)
    return {"elapsed_s": elapsed, "output_tokens": tokens, "output_tok_s": tokens / elapsed,
            "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
            "itl_p50_ms": 1e3 * percentile(itl, 50), "itl_p99_ms": 1e3 * percentile(itl, 99)}


def bench_service(model: str, engine_args: list[str], prompts, output_len: int, num_clients: int) -> dict:
    from nanovllm_client import Client

    runtime_dir = tempfile.mkdtemp(prefix="nvb-", dir="/tmp")
    url = f"ipc://{runtime_dir}"
    sup = subprocess.Popen([sys.executable, "-m", "nanovllm.supervisor", "--model", model, "--runtime-dir", runtime_dir,
                            "--log-level", "WARNING", *engine_args], cwd=REPO,
                           env=dict(os.environ, PYTHONPATH=REPO))
    try:
        with Client(url, connect_timeout=300) as c:
            c.wait_engine(timeout=300)
        try:
            import uvloop
            run = uvloop.run
        except ImportError:
            run = asyncio.run
        return run(run_clients(url, prompts, output_len, num_clients))
    finally:
        sup.send_signal(signal.SIGTERM)
        try:
            sup.wait(timeout=30)
        except subprocess.TimeoutExpired:
            sup.kill()
        shutil.rmtree(runtime_dir, ignore_errors=True)


# ---------------------------------------------------------------- in-process side

def bench_offline(model: str, config: dict, prompts, output_len: int) -> dict:
    from nanovllm import LLM, SamplingParams

    llm = LLM(model, **config)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([p[:8] for p in prompts[:4]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o["token_ids"]) for o in outputs)
    return {"elapsed_s": elapsed, "output_tokens": tokens, "output_tok_s": tokens / elapsed}


def engine_flags(config: dict) -> list[str]:
    return [x for k, v in config.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="'tiny' (built on the fly), 'default', or a model path")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--clients", type=int, default=4, help="concurrent client objects (connections)")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[71, 255], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-offline", action="store_true")
    args = parser.parse_args(argv)

    model = args.model
    if model == "tiny":
        model = build_tiny_model(os.path.join(tempfile.gettempdir(), "nanovllm-bench-tiny"))
    from nanovllm.models.tokenizer import load_tokenizer

    vocab = len(load_tokenizer(model))
    prompts = make_prompts(args.num_requests, vocab, *args.prompt_len, args.seed)
    config = {"max_num_seqs": args.max_num_seqs}

    service = bench_service(model, engine_flags(config), prompts, args.output_len, args.clients)
    offline = None if args.skip_offline else bench_offline(model, config, prompts, args.output_len)
    result = {"model": args.model, "num_requests": args.num_requests, "clients": args.clients,
              "prompt_tokens": sum(map(len, prompts)), "output_len": args.output_len,
              "service": service, "offline": offline,
              "service_over_offline": service["output_tok_s"] / offline["output_tok_s"] if offline else None}

    print(f"\n{'':24}{'service':>12}{'in-process':>12}")
    print(f"{'output tok/s':24}{service['output_tok_s']:12.1f}{(offline or {}).get('output_tok_s', float('nan')):12.1f}")
    print(f"{'elapsed s':24}{service['elapsed_s']:12.2f}{(offline or {}).get('elapsed_s', float('nan')):12.2f}")
    for key in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"):
        print(f"{key:24}{service[key]:12.1f}{'-':>12}")
    if offline:
        print(f"{'service / in-process':24}{result['service_over_offline']:12.3f}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
