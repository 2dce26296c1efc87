"""Benchmark the three-process service against in-process `LLM.generate` on the same workload.

    python bench/serve.py                         # tiny random Qwen3 (hidden 512, 4 layers)
    python bench/serve.py --model default --num-requests 16 --output-len 64

1. starts `nanovllm serve` (the supervisor) on ipc:// in a temp dir, warms it up, then sends
   `--num-requests` requests (random prompt token ids, `--output-len` tokens each, EOS ignored,
   greedy) from `--clients` concurrent AsyncClients, all in flight at once; records TTFT (submit
   -> first token) and ITL (gap between consecutive deltas, per token);
2. runs the same prompts through `LLM.generate` in this process (the service idle meanwhile),
   alternating the two `--repeats` times so other load on the machine hits both alike;
3. prints a table and one JSON line: best output tok/s of both, their ratio, TTFT/ITL p50/p99,
   and CPU seconds (engine stage vs. in-process, plus tokenizer and detokenizer stages).
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


class Service:
    """`nanovllm serve` in a temp runtime dir, for the duration of a `with` block."""

    def __init__(self, model: str, engine_args: list[str]):
        self.runtime_dir = tempfile.mkdtemp(prefix="nvb-", dir="/tmp")
        self.url = f"ipc://{self.runtime_dir}"
        self.argv = [sys.executable, "-m", "nanovllm.supervisor", "--model", model, "--runtime-dir", self.runtime_dir,
                     "--log-level", "WARNING", *engine_args]

    def __enter__(self) -> Service:
        from nanovllm_client import Client

        self.proc = subprocess.Popen(self.argv, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
        with Client(self.url, connect_timeout=300) as c:
            c.wait_engine(timeout=300)
        with open(os.path.join(self.runtime_dir, "stages.json")) as f:
            self.pids = {k: v for k, v in json.load(f).items() if k != "url"}
        return self

    def cpu_seconds(self) -> dict[str, float]:
        """user+system CPU seconds of each stage so far (from /proc)."""
        ticks = os.sysconf("SC_CLK_TCK")
        out = {}
        for name, pid in self.pids.items():
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[name] = (int(fields[11]) + int(fields[12])) / ticks
        return out

    def run(self, prompts, output_len: int, num_clients: int) -> dict:
        try:
            import uvloop
            runner = uvloop.run
        except ImportError:
            runner = asyncio.run
        before = self.cpu_seconds()
        result = runner(run_clients(self.url, prompts, output_len, num_clients))
        after = self.cpu_seconds()
        result["cpu_s"] = {k: round(after[k] - before[k], 2) for k in after}
        return result

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)


# ---------------------------------------------------------------- in-process side

class Offline:
    """The same workload through `LLM.generate` in this process."""

    def __init__(self, model: str, config: dict):
        from nanovllm import LLM, SamplingParams

        self.llm, self.params_cls = LLM(model, **config), SamplingParams
        self.llm.generate([[11, 12, 13]] * 4, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up

    def run(self, prompts, output_len: int) -> dict:
        params = self.params_cls(temperature=0, max_tokens=output_len, ignore_eos=True)
        start, cpu = time.perf_counter(), time.process_time()
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        tokens = sum(len(o["token_ids"]) for o in outputs)
        return {"elapsed_s": elapsed, "output_tokens": tokens, "output_tok_s": tokens / elapsed, "cpu_s": round(cpu, 2)}


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
    parser.add_argument("--repeats", type=int, default=2, help="alternating service/in-process runs; best is reported")
    parser.add_argument("--skip-offline", action="store_true")
    args = parser.parse_args(argv)

    model = args.model
    if model == "tiny":
        model = build_tiny_model(os.path.join(tempfile.gettempdir(), "nanovllm-bench-tiny"))
    from nanovllm.models.tokenizer import load_tokenizer

    vocab = len(load_tokenizer(model))
    prompts = make_prompts(args.num_requests, vocab, *args.prompt_len, args.seed)
    config = {"max_num_seqs": args.max_num_seqs}

    # Alternate the two so load from other work on the machine hits both alike; report the best.
    services, offlines = [], []
    with Service(model, engine_flags(config)) as service:
        offline = None if args.skip_offline else Offline(model, config)
        for _ in range(args.repeats):
            services.append(service.run(prompts, args.output_len, args.clients))
            if offline:
                offlines.append(offline.run(prompts, args.output_len))
    service = max(services, key=lambda r: r["output_tok_s"])
    offline = max(offlines, key=lambda r: r["output_tok_s"]) if offlines else None
    result = {"model": args.model, "num_requests": args.num_requests, "clients": args.clients,
              "prompt_tokens": sum(map(len, prompts)), "output_len": args.output_len, "repeats": args.repeats,
              "service": service, "offline": offline,
              "service_over_offline": service["output_tok_s"] / offline["output_tok_s"] if offline else None,
              "all_service_tok_s": [round(r["output_tok_s"], 1) for r in services],
              "all_offline_tok_s": [round(r["output_tok_s"], 1) for r in offlines]}

    print(f"\n{'':24}{'service':>12}{'in-process':>12}")
    print(f"{'output tok/s':24}{service['output_tok_s']:12.1f}{(offline or {}).get('output_tok_s', float('nan')):12.1f}")
    print(f"{'elapsed s':24}{service['elapsed_s']:12.2f}{(offline or {}).get('elapsed_s', float('nan')):12.2f}")
    for key in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"):
        print(f"{key:24}{service[key]:12.1f}{'-':>12}")
    engine_cpu = service["cpu_s"]["engine_proc"]
    print(f"{'engine CPU s':24}{engine_cpu:12.2f}{(offline or {}).get('cpu_s', float('nan')):12.2f}")
    print(f"{'tokenizer+detok CPU s':24}{service['cpu_s']['tokenizer_proc'] + service['cpu_s']['detok_proc']:12.2f}")
    if offline:
        print(f"{'service / in-process':24}{result['service_over_offline']:12.3f}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
