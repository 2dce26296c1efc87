"""Benchmark the three-process service against in-process `LLM.generate` on the same workload.

    python bench/serve.py                         # tiny random Qwen3 (hidden 512, 4 layers)
    python bench/serve.py --model default --num-requests 16 --output-len 64
    python bench/serve.py --sweep                 # concurrency 1, 4, 16, 64; KV pressure; null model
    python bench/serve.py --sweep --null-model    # the null-model sweep alone

A single run:
1. starts `nanovllm serve` (the supervisor) on ipc:// in a temp dir, warms it up, then sends
   `--num-requests` requests (random prompt token ids, `--output-len` tokens each, EOS ignored,
   greedy) from `--clients` concurrent AsyncClients, all in flight at once; records TTFT (submit
   -> first token) and ITL (gap between consecutive deltas, per token);
2. runs the same prompts through `LLM.generate` in this process (the service idle meanwhile),
   alternating the two `--repeats` times so other load on the machine hits both alike; every
   repeat draws fresh prompts (the same for both sides), so no run hits the prefix cache; before
   them, `--warmup-runs` (default 1) unmeasured runs of both sides on prompts of their own;
3. prints a table and one JSON line: best output tok/s of both, their ratio, TTFT/ITL p50/p99,
   and CPU seconds (engine stage vs. in-process, plus tokenizer and detokenizer stages); and the
   ratio of each repeat (service over in-process on the same prompts, run one after the other)
   with its median, the figure least moved by one disturbed run on either side.

`--stream-interval N` starts the service with that many output tokens per streamed delta (after
a request's first; `docs/tuning.md`).

`--side-load` adds a third side to each repeat: `LLM.generate` again, beside a process that burns
the CPU the service's streaming used in that repeat (tokenizer, detokenizer and clients), in one
burst per engine step. If the service matches that side, the stages cost nothing beyond the CPU
their work needs; what it loses against the plain in-process run is that CPU, taken from cores
the engine would otherwise use.

`--streaming-cores CPUS` (e.g. `1`) asks what the service costs when its streaming has cores of
its own, as where the clients run elsewhere: the engine of both sides runs on the other CPUs
(`num_threads` = their number), the tokenizer, detokenizer, supervisor and the clients on CPUS.
Every thread of each process is pinned (`sched_setaffinity`); this process moves between the two
sets as it runs one side, then the other.

`--idle S` measures the fixed cost of open connections instead: `--clients` (default 64)
AsyncClients connect, wait until ready, then send nothing for S seconds, heartbeats aside
(`--client-heartbeat`, default the client's 1 s); it prints the CPU seconds each stage and the
client process spent meanwhile, twice (so a first pass's settling shows).

`--sweep` (bench/serve_sweep.py) runs the same measurement at each `--concurrency` level
(`max(level, --min-requests)` requests, at most `level` in flight, one client connection per
stream), adds engine steps/s, preemptions and KV-cache use from the server's stats, and also runs
a KV cache too small for the top level (`--pressure-kv-blocks`, knobs from `--engine-arg`) and
the same levels on the null model (`Config.null_model`: fixed logits, no model work). It writes
JSON and a PNG (matplotlib: `pip install -e '.[bench]'`).
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import glob
import json
import os
import pstats
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE_PATH = [REPO, os.path.join(REPO, "client")]
"""This checkout's packages (the client package too), first for this process and the service."""
sys.path[:0] = SOURCE_PATH
PROFILE_HOOK_DIR = os.path.join(REPO, "bench", "stage_profile")
"""Holds the sitecustomize.py that profiles each stage under `--profile`."""
STATS_PERIOD_S = 0.1
"""How often the KV-cache use is sampled from the server's stats (the engine reports every 0.25 s)."""


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


def make_prompts(n: int, vocab: int, lo: int, hi: int, seed: int | str) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# ---------------------------------------------------------------- service side

async def one_request(client, prompt: list[int], output_len: int, record: list, slots: asyncio.Semaphore) -> None:
    async with slots:
        sent = time.perf_counter()
        arrivals: list[tuple[float, int]] = []
        stream = await client.stream(prompt_token_ids=prompt, max_tokens=output_len, ignore_eos=True, temperature=0)
        async for delta in stream:
            if delta.token_ids:
                arrivals.append((time.perf_counter(), len(delta.token_ids)))
        record.append((sent, arrivals))


async def engine_stats(client) -> dict:
    """The engine's latest reported stats (from its heartbeat, relayed by the detokenizer)."""
    return (await client.server_stats())["engine"]


async def watch_kv_usage(client, used: list[int], stop: asyncio.Event) -> None:
    """Sample the KV blocks in use every STATS_PERIOD_S until `stop` is set."""
    while not stop.is_set():
        stats = await engine_stats(client)
        used.append(stats["num_total_blocks"] - stats["num_free_blocks"])
        try:
            await asyncio.wait_for(stop.wait(), STATS_PERIOD_S)
        except asyncio.TimeoutError:
            pass


async def settled_stats(client) -> dict:
    """Stats from a heartbeat sent after everything before this call happened."""
    await asyncio.sleep(0.35)
    return await engine_stats(client)


async def run_clients(url: str, prompts: list[list[int]], output_len: int, num_clients: int,
                      concurrency: int | None = None) -> dict:
    """Send all `prompts` over `num_clients` connections, at most `concurrency` in flight."""
    from nanovllm_client import AsyncClient

    clients = [AsyncClient(url, timeout=3600) for _ in range(num_clients)]
    for c in clients:
        await c.start()
    await asyncio.gather(*(c.generate(prompt_token_ids=prompts[0][:8], max_tokens=4) for c in clients))  # warm-up
    before = await settled_stats(clients[0])
    record: list = []
    slots = asyncio.Semaphore(concurrency or len(prompts))
    kv_used: list[int] = []
    stop_watch = asyncio.Event()
    watch = asyncio.create_task(watch_kv_usage(clients[0], kv_used, stop_watch))
    start = time.perf_counter()
    await asyncio.gather(*(one_request(clients[i % num_clients], p, output_len, record, slots)
                           for i, p in enumerate(prompts)))
    elapsed = time.perf_counter() - start
    stop_watch.set()
    await watch
    after = await settled_stats(clients[0])
    for c in clients:
        await c.close()
    ttft = [arr[0][0] - sent for sent, arr in record if arr]
    itl = [(b[0] - a[0]) / b[1] for _, arr in record for a, b in zip(arr, arr[1:])]
    tokens = sum(n for _, arr in record for _, n in arr)
    steps = after["num_steps"] - before["num_steps"]
    total_blocks = after["num_total_blocks"]
    return {"concurrency": concurrency or len(prompts), "num_requests": len(prompts), "clients": num_clients,
            "elapsed_s": elapsed, "output_tokens": tokens, "output_tok_s": tokens / elapsed,
            "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
            "itl_p50_ms": 1e3 * percentile(itl, 50), "itl_p99_ms": 1e3 * percentile(itl, 99),
            "steps": steps, "steps_per_s": steps / elapsed,
            "preemptions": after["num_preemptions"] - before["num_preemptions"],
            "kv_blocks": total_blocks, "kv_blocks_peak": max(kv_used, default=0),
            "kv_usage_peak": max(kv_used, default=0) / total_blocks,
            "kv_usage_mean": sum(kv_used) / len(kv_used) / total_blocks if kv_used else 0.0}


def cpu_seconds(pid: int) -> float:
    """user+system CPU seconds of process `pid` so far (from /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def per_thread(pid: int, call) -> list:
    """`call(tid)` for every thread of process `pid`, skipping threads that end meanwhile."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out.append(call(int(tid)))
        except (ProcessLookupError, FileNotFoundError):
            pass
    return out


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` onto `cpus` (threads it starts later inherit it)."""
    per_thread(pid, lambda tid: os.sched_setaffinity(tid, cpus))


def cpus_of(pid: int) -> list[int]:
    """The CPUs any thread of process `pid` may run on."""
    return sorted(set().union(*per_thread(pid, os.sched_getaffinity)))


@dataclass
class Cores:
    """`--streaming-cores`: the engine (either side) on `engine`, everything else on `streaming`."""
    engine: set[int]
    streaming: set[int]

    @classmethod
    def parse(cls, spec: str) -> Cores:
        available = os.sched_getaffinity(0)
        streaming = {int(c) for c in spec.split(",")}
        if not streaming < available:
            raise SystemExit(f"--streaming-cores {spec}: needs a proper subset of this process's CPUs {sorted(available)}")
        return cls(available - streaming, streaming)


class Service:
    """`nanovllm serve` in a temp runtime dir and its own process group, for a `with` block.

    With `profile_dir`, every stage runs under cProfile (bench/stage_profile/sitecustomize.py)
    and writes one .prof file per thread there when it exits.
    """

    def __init__(self, model: str, engine_args: list[str], profile_dir: str | None = None,
                 cores: Cores | None = None):
        self.cores = cores
        self.runtime_dir = tempfile.mkdtemp(prefix="nvb-")  # $TMPDIR, else /tmp: short, for ipc paths
        self.url = f"ipc://{self.runtime_dir}"
        self.argv = [sys.executable, "-m", "nanovllm.supervisor", "--model", model, "--runtime-dir", self.runtime_dir,
                     "--log-level", "WARNING", *engine_args]
        path = ([PROFILE_HOOK_DIR] if profile_dir else []) + SOURCE_PATH
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
        self.profile_dir = profile_dir
        if profile_dir:
            os.makedirs(profile_dir, exist_ok=True)
            self.env["NANOVLLM_PROFILE_DIR"] = os.path.abspath(profile_dir)

    def __enter__(self) -> Service:
        from nanovllm_client import Client

        self.proc = subprocess.Popen(self.argv, cwd=REPO, env=self.env, start_new_session=True)
        try:
            with Client(self.url, connect_timeout=300) as c:
                c.wait_engine(timeout=300)
            with open(os.path.join(self.runtime_dir, "stages.json")) as f:
                self.pids = {k: v for k, v in json.load(f).items() if k != "url"}
            if self.cores:
                for name, pid in self.processes():
                    pin(pid, self.cores.engine if name == "engine_proc" else self.cores.streaming)
        except BaseException:
            self.__exit__()
            raise
        return self

    def processes(self) -> list[tuple[str, int]]:
        """(name, pid) of the supervisor and each stage."""
        return [("supervisor", self.proc.pid), *self.pids.items()]

    def cpu_seconds(self) -> dict[str, float]:
        """user+system CPU seconds of each stage so far."""
        return {name: cpu_seconds(pid) for name, pid in self.pids.items()}

    def run(self, prompts, output_len: int, num_clients: int, concurrency: int | None = None) -> dict:
        try:
            import uvloop
            runner = uvloop.run
        except ImportError:
            runner = asyncio.run
        if self.cores:  # the clients stream on the streaming cores
            pin(os.getpid(), self.cores.streaming)
        profile = cProfile.Profile() if self.profile_dir else None
        before, own = self.cpu_seconds(), time.process_time()
        if profile:
            profile.enable()
        result = runner(run_clients(self.url, prompts, output_len, num_clients, concurrency))
        if profile:
            profile.disable()
            profile.dump_stats(os.path.join(self.profile_dir, f"clients-{os.getpid()}-{time.monotonic_ns()}.prof"))
        after, own = self.cpu_seconds(), time.process_time() - own
        result["cpu_s"] = {**{k: round(after[k] - before[k], 2) for k in after}, "clients": round(own, 2)}
        if self.cores:  # read back after the run: threads started meanwhile included
            result["cpus"] = {name: cpus_of(pid) for name, pid in [*self.processes(), ("clients", os.getpid())]}
        return result

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the stages too: they are in its group
            self.proc.wait()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)


async def idle_clients(url: str, num_clients: int, seconds: float, heartbeat_s: float) -> float:
    """Open `num_clients` connections, let them idle `seconds`; the CPU this process spent meanwhile."""
    from nanovllm_client import AsyncClient

    clients = [AsyncClient(url, timeout=3600, heartbeat_interval=heartbeat_s) for _ in range(num_clients)]
    for c in clients:
        await c.start()
    await asyncio.gather(*(c.wait_engine() for c in clients))
    await asyncio.sleep(1.0)  # the handshakes' replies land before the clock starts
    own = time.process_time()
    await asyncio.sleep(seconds)
    own = time.process_time() - own
    for c in clients:
        await c.close()
    return own


def run_idle(args: argparse.Namespace, model: str) -> int:
    """`--idle`: what open, quiet connections cost the stages and the client process."""
    clients = args.clients or 64
    runs = []
    with Service(model, engine_flags(engine_config(args, False))) as service:
        for _ in range(2):
            before = service.cpu_seconds()
            own = asyncio.run(idle_clients(service.url, clients, args.idle, args.client_heartbeat))
            after = service.cpu_seconds()
            cpu = {k: round(after[k] - before[k], 2) for k in after}
            cpu["clients"] = round(own, 2)
            runs.append(cpu)
    print(f"\n{clients} connections idle for {args.idle:.0f} s (client heartbeat {args.client_heartbeat} s): CPU s")
    print("".join(f"{k:>16}" for k in runs[0]))
    for cpu in runs:
        print("".join(f"{v:16.2f}" for v in cpu.values()))
    print(json.dumps({"idle_s": args.idle, "clients": clients, "client_heartbeat_s": args.client_heartbeat,
                      "cpu_s": runs}))
    return 0


def print_profiles(profile_dir: str, top: int = 12) -> None:
    """The hottest functions (own time) of each stage thread that the profile hook recorded."""
    for path in sorted(glob.glob(os.path.join(profile_dir, "*.prof"))):
        stats = pstats.Stats(path)
        print(f"\n=== {os.path.basename(path)}: {stats.total_tt:.2f} s profiled")
        stats.sort_stats("tottime").print_stats(top)


# ---------------------------------------------------------------- in-process side

class Offline:
    """The same workload through `LLM.generate` in this process."""

    def __init__(self, model: str, config: dict, cores: Cores | None = None):
        from nanovllm import LLM, SamplingParams

        self.cores = cores
        self.llm, self.params_cls = LLM(model, **config), SamplingParams
        self.llm.generate([[11, 12, 13]] * 4, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up

    def run(self, prompts, output_len: int) -> dict:
        if self.cores:  # the engine cores only, as the service's engine stage
            pin(os.getpid(), self.cores.engine)
        params = self.params_cls(temperature=0, max_tokens=output_len, ignore_eos=True)
        start, cpu, steps = time.perf_counter(), time.process_time(), self.llm.engine.num_steps
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        tokens = sum(len(o["token_ids"]) for o in outputs)
        return {"elapsed_s": elapsed, "output_tokens": tokens, "output_tok_s": tokens / elapsed, "cpu_s": round(cpu, 2),
                "steps": self.llm.engine.num_steps - steps}


SIDE_LOAD = """
import sys, time
burst_s, period_s = float(sys.argv[1]), float(sys.argv[2])
while True:
    end = time.perf_counter() + burst_s
    while time.perf_counter() < end:
        pass
    time.sleep(max(0.0, period_s - burst_s))
"""


class SideLoad:
    """A process burning `burst_s` of CPU every `period_s` (a busy loop, then a sleep), for a
    `with` block; `cpu_s` is what it burned."""

    def __init__(self, burst_s: float, period_s: float):
        self.argv = [sys.executable, "-c", SIDE_LOAD, str(burst_s), str(period_s)]

    def __enter__(self) -> SideLoad:
        self.proc = subprocess.Popen(self.argv)
        self.start = cpu_seconds(self.proc.pid)
        return self

    def __exit__(self, *exc) -> None:
        self.cpu_s = cpu_seconds(self.proc.pid) - self.start
        self.proc.kill()
        self.proc.wait()


def side_loaded(offline: Offline, prompts, output_len: int, service_run: dict, offline_run: dict) -> dict:
    """`offline.run` beside a `SideLoad` of the CPU `service_run`'s streaming took (every process
    but the engine stage), one burst per step at the pace of `offline_run`."""
    cpu = service_run["cpu_s"]
    streaming_s = sum(v for k, v in cpu.items() if k != "engine_proc")
    steps = max(1, offline_run["steps"])
    # The same lengths, other tokens: the engine has just seen `prompts` (its prefix cache would hit).
    rng = random.Random(f"side-load-{len(prompts)}-{sum(map(len, prompts))}")
    vocab = max(t for prompt in prompts for t in prompt) + 1
    fresh = [[rng.randrange(10, vocab) for _ in prompt] for prompt in prompts]
    with SideLoad(streaming_s / steps, offline_run["elapsed_s"] / steps) as load:
        run = offline.run(fresh, output_len)
    run["side_load_cpu_s"] = round(load.cpu_s, 2)
    run["streaming_cpu_s"] = round(streaming_s, 2)
    return run


def engine_flags(config: dict) -> list[str]:
    """`nanovllm serve` flags for engine Config fields (booleans as --flag / --no-flag)."""
    flags = []
    for key, value in config.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


def engine_config(args: argparse.Namespace, null_model: bool) -> dict:
    """The engine settings both sides share. The null model runs one torch thread: with no model
    work, a second OpenMP thread only makes each small tensor op wait for it to wake."""
    config = {"max_num_seqs": args.max_num_seqs, "dtype": args.dtype}
    if null_model:
        config.update(null_model=True, num_threads=1)
    return config


def alternate(service: Service, offline: Offline | None, prompt_sets: list[list[list[int]]], output_len: int,
              num_clients: int, concurrency: int | None = None,
              loaded: list[dict] | None = None) -> tuple[list[dict], list[dict]]:
    """Service and in-process runs in turn, one prompt set each per repeat, so load from other
    work on the machine hits both alike; fresh prompts per repeat keep the prefix cache cold.
    With a `loaded` list (and `offline`), each repeat also runs `side_loaded` into it."""
    services, offlines = [], []
    for prompts in prompt_sets:
        services.append(service.run(prompts, output_len, num_clients, concurrency))
        if offline:
            offlines.append(offline.run(prompts, output_len))
            if loaded is not None:
                loaded.append(side_loaded(offline, prompts, output_len, services[-1], offlines[-1]))
    return services, offlines


def best(runs: list[dict]) -> dict | None:
    return max(runs, key=lambda r: r["output_tok_s"]) if runs else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="'tiny' (built on the fly), 'default', or a model path")
    parser.add_argument("--num-requests", type=int, default=64, help="single run: requests, all in flight at once")
    parser.add_argument("--clients", type=int, default=None,
                        help="client connections (default: 4 for a single run; one per stream in a sweep)")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[71, 255], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="the service's --stream-interval: output tokens per streamed delta after the first")
    parser.add_argument("--repeats", type=int, default=2, help="alternating service/in-process runs; best is reported")
    parser.add_argument("--warmup-runs", type=int, default=1,
                        help="single run: unmeasured full-size runs of both sides first (fresh prompts)")
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--side-load", action="store_true",
                        help="single run: also run LLM.generate beside a process burning the CPU the service's "
                             "streaming used (is the loss that CPU, or the stages themselves?)")
    parser.add_argument("--streaming-cores", metavar="CPUS", default=None,
                        help="single run: give the streaming (tokenizer, detokenizer, clients) these CPUs, e.g. 1, "
                             "and the engine of both sides the others, as many torch threads as it has CPUs")
    parser.add_argument("--null-model", action="store_true",
                        help="only the null model (fixed logits, no model work): what the scheduler, sampler and "
                             "the three stages sustain alone")
    parser.add_argument("--profile", metavar="DIR", default=None,
                        help="run every stage under cProfile, write .prof files to DIR and print their top entries")
    parser.add_argument("--idle", type=float, default=None, metavar="S",
                        help="measure S seconds of open, quiet connections instead (see above)")
    parser.add_argument("--client-heartbeat", type=float, default=1.0, help="--idle: the clients' heartbeat_interval")
    sweep = parser.add_argument_group("sweep (--sweep)")
    sweep.add_argument("--sweep", action="store_true", help="the concurrency sweep, KV pressure and null-model runs")
    sweep.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    sweep.add_argument("--min-requests", type=int, default=8, help="requests per level: max(level, this)")
    sweep.add_argument("--pressure-kv-blocks", type=int, default=None,
                       help="KV blocks for the pressure run at the top level (default: half what its requests need "
                            "at full length; 0 skips it)")
    sweep.add_argument("--engine-arg", action="append", default=[], metavar="KEY=V1[,V2...]",
                       help="engine Config field for the pressure run (repeatable); several values: one run each")
    sweep.add_argument("--null-output-len", type=int, default=1024, help="output tokens per null-model request")
    sweep.add_argument("--null-min-requests", type=int, default=8, help="null-model requests per level: max(level, this)")
    sweep.add_argument("--skip-null", action="store_true", help="leave the null-model sweep out")
    sweep.add_argument("--json", default=os.path.join(REPO, "docs", "results", "serve_sweep.json"),
                       help="where the sweep's JSON goes")
    sweep.add_argument("--png", default=os.path.join(REPO, "docs", "img", "serve_sweep.png"),
                       help="where the sweep's plot goes ('' for none)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model = args.model
    if model == "tiny":
        model = build_tiny_model(os.path.join(tempfile.gettempdir(), "nanovllm-bench-tiny"))
    from nanovllm.models.tokenizer import load_tokenizer

    vocab = len(load_tokenizer(model))
    if args.idle is not None:
        return run_idle(args, model)
    if args.sweep:
        from bench.serve_sweep import run_sweep

        return run_sweep(args, model, vocab)
    return run_single(args, model, vocab)


def run_single(args: argparse.Namespace, model: str, vocab: int) -> int:
    output_len = args.null_output_len if args.null_model else args.output_len
    prompt_sets = [make_prompts(args.num_requests, vocab, *args.prompt_len, f"{args.seed}-{r}")
                   for r in range(args.repeats)]
    config = engine_config(args, args.null_model)
    cores = Cores.parse(args.streaming_cores) if args.streaming_cores else None
    if cores:  # a torch thread per engine CPU, both sides
        config["num_threads"] = len(cores.engine)
    clients = args.clients or 4
    loaded: list[dict] | None = [] if args.side_load and not args.skip_offline else None
    service_flags = engine_flags(config) + ["--stream-interval", str(args.stream_interval)]
    own_cpus = os.sched_getaffinity(0)
    try:
        with Service(model, service_flags, args.profile, cores) as service:
            offline = None if args.skip_offline else Offline(model, config, cores)
            if args.warmup_runs:  # unmeasured: both sides' first full-size runs were 5-15% slower than later ones
                warmup = [make_prompts(args.num_requests, vocab, *args.prompt_len, f"{args.seed}-warmup-{r}")
                          for r in range(args.warmup_runs)]
                alternate(service, offline, warmup, output_len, clients)
            services, offlines = alternate(service, offline, prompt_sets, output_len, clients, loaded=loaded)
    finally:
        if cores:
            pin(os.getpid(), own_cpus)
    service, offline, side = best(services), best(offlines), best(loaded or [])
    result = {"model": args.model, "null_model": args.null_model, "num_requests": args.num_requests, "clients": clients,
              "prompt_tokens": [sum(map(len, s)) for s in prompt_sets], "output_len": output_len,
              "repeats": args.repeats, "config": config, "stream_interval": args.stream_interval, "streaming_cores": args.streaming_cores,
              "service": service, "offline": offline,
              "service_over_offline": service["output_tok_s"] / offline["output_tok_s"] if offline else None,
              "all_service_tok_s": [round(r["output_tok_s"], 1) for r in services],
              "all_offline_tok_s": [round(r["output_tok_s"], 1) for r in offlines]}
    if offline:
        paired = [round(a["output_tok_s"] / b["output_tok_s"], 3) for a, b in zip(services, offlines)]
        result.update(all_service_over_offline=paired, median_service_over_offline=round(statistics.median(paired), 3))
    if side:
        result.update(offline_side_load=side, service_over_side_load=service["output_tok_s"] / side["output_tok_s"],
                      all_side_load_tok_s=[round(r["output_tok_s"], 1) for r in loaded],
                      all_service_over_side_load=[round(a["output_tok_s"] / b["output_tok_s"], 3)
                                                  for a, b in zip(services, loaded)])

    print(f"\n{'':24}{'service':>12}{'in-process':>12}")
    print(f"{'output tok/s':24}{service['output_tok_s']:12.1f}{(offline or {}).get('output_tok_s', float('nan')):12.1f}")
    print(f"{'elapsed s':24}{service['elapsed_s']:12.2f}{(offline or {}).get('elapsed_s', float('nan')):12.2f}")
    for key in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "steps_per_s"):
        print(f"{key:24}{service[key]:12.1f}{'-':>12}")
    print(f"{'engine steps':24}{service['steps']:12d}{(offline or {}).get('steps', '-'):>12}")
    engine_cpu = service["cpu_s"]["engine_proc"]
    print(f"{'engine CPU s':24}{engine_cpu:12.2f}{(offline or {}).get('cpu_s', float('nan')):12.2f}")
    print(f"{'tokenizer+detok CPU s':24}{service['cpu_s']['tokenizer_proc'] + service['cpu_s']['detok_proc']:12.2f}")
    if offline:
        print(f"{'service / in-process':24}{result['service_over_offline']:12.3f}   (best of each side)")
        print(f"{'  same prompts, median':24}{result['median_service_over_offline']:12.3f}   "
              f"(per repeat: {', '.join(f'{r:.3f}' for r in result['all_service_over_offline'])})")
    if side:
        print(f"\nin-process beside a side load of the streaming's CPU ({side['streaming_cpu_s']:.2f} s; "
              f"burned {side['side_load_cpu_s']:.2f} s): {side['output_tok_s']:.1f} tok/s, "
              f"{side['elapsed_s']:.2f} s, engine CPU {side['cpu_s']:.2f} s")
        print(f"{'service / side-loaded':24}{result['service_over_side_load']:12.3f}")
        print(f"per repeat: service / side-loaded {result['all_service_over_side_load']}")
    if args.profile:
        print_profiles(args.profile)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
