"""The soak (`pytest -m soak`, not in the default run): `nanovllm serve --http-port` on the tiny
model under mixed traffic for NANOVLLM_SOAK_S seconds (300 by default; 3600 for the hour) --
ZeroMQ clients that read whole streams, abort them, or vanish with streams in flight; HTTP
clients streaming chat and completions, dropping connections mid-stream, asking for tool calls
and structured output -- while the tokenizer, the detokenizer, the engine and the front are each
SIGKILLed in turn. Every 5 s it samples each process's RSS and open file descriptors and the
per-request state the stages report. After the first fifth (warm-up) nothing may grow past the
bounds below, and once the load stops every per-request count returns to zero.

    NANOVLLM_SOAK_S=300 NANOVLLM_SOAK_OUT=/tmp/soak python -m pytest -m soak -s tests/service/test_soak.py

NANOVLLM_SOAK_OUT: a folder for the samples (`soak.json`) and the table (`soak.md`)."""
from __future__ import annotations

import http.client
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest

pytest.importorskip("uvicorn")

from nanovllm_client import Client  # noqa: E402
from tests.service.conftest import START_TIMEOUT, TINY_ENGINE_ARGS  # noqa: E402
from tests.service.harness import REPO, engine_idle, short_tmpdir, wait_for  # noqa: E402
from tests.service.test_http_serve import _free_port, _get  # noqa: E402
from tests.service.test_supervisor import read_pids  # noqa: E402

pytestmark = pytest.mark.soak

SAMPLE_S = 5.0
RSS_GROWTH = 1.25
RSS_SLACK_MIB = 16.0
"""After warm-up a process (any instance of its role) may reach at most 1.25x its role's warm-up
peak plus 16 MiB: allocator arenas settle in steps; a leak of a few KB a request does not."""
FD_SLACK = 16
"""...and at most 16 file descriptors over its warm-up peak (sockets of reconnecting peers)."""
PROMPTS = ["def f():", "import os", "class A:", "hello world", "for i in range(3):"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"],
          "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}
STATE = [("engine", "num_live"), ("engine", "num_queued"), ("engine", "num_clients"), ("detok", "num_requests"),
         ("detok", "num_clients"), ("detok", "num_pending_frames"), ("detok", "num_awaiting_resume")]
ROLES = ["tokenizer_proc", "engine_proc", "detok_proc", "http"]


class Load:
    """What the clients did, by outcome, and the flag that stops them."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.counts: Counter[str] = Counter()
        self.examples: dict[str, str] = {}
        """The first error text of each kind of outcome that had one."""
        self._lock = threading.Lock()

    def count(self, what: str, example: str | None = None) -> None:
        with self._lock:
            self.counts[what] += 1
            if example is not None:
                self.examples.setdefault(what, example[:300])


def zmq_worker(url: str, seed: int, load: Load) -> None:
    rng = random.Random(seed)
    with Client(url, timeout=120, connect_timeout=120) as client:
        while not load.stop.is_set():
            action = rng.choice(["whole", "whole", "abort", "vanish", "structured"])
            kwargs = dict(max_tokens=rng.randint(4, 48), temperature=rng.choice([0.0, 0.8]), ignore_eos=True)
            if action == "structured":
                kwargs["response_format"] = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
            try:
                if action == "vanish":  # a client process gone with streams in flight
                    with Client(url, timeout=60, connect_timeout=60) as gone:
                        streams = [gone.stream(rng.choice(PROMPTS), **kwargs) for _ in range(3)]
                        next(streams[0])
                        gone.close(linger=0)
                else:
                    stream = client.stream(rng.choice(PROMPTS), **kwargs)
                    if action == "abort":
                        next(stream)
                        stream.cancel()
                    else:
                        list(stream)
                load.count(f"zmq {action}")
            except Exception as e:  # noqa: BLE001 -- a fault's mark on one request: counted, the load goes on
                load.count(f"zmq {action}: {type(e).__name__}", str(e))
                time.sleep(0.2)


def http_worker(port: int, model: str, seed: int, load: Load) -> None:
    rng = random.Random(seed)
    while not load.stop.is_set():
        action = rng.choice(["chat", "completions", "drop", "tools", "structured"])
        body: dict = {"model": model, "max_tokens": rng.randint(4, 48), "temperature": rng.choice([0.0, 0.8]),
                      "ignore_eos": True}
        route = "/v1/chat/completions"
        if action == "completions" or action == "structured":
            route, body["prompt"] = "/v1/completions", rng.choice(PROMPTS)
        else:
            body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
        if action == "structured":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
        elif action == "tools":
            body.update(tools=[TOOL], tool_choice="required")
        else:
            body["stream"] = True
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            conn.request("POST", route, body=json.dumps(body), headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                load.count(f"http {action}: {response.status}", response.read().decode(errors="replace"))
                conn.close()
                continue
            if action == "drop":  # the HTTP client goes away mid-stream
                response.readline()
                conn.close()
            else:
                while (line := response.readline()) and line.strip() != b"data: [DONE]":
                    pass
                conn.close()
            load.count(f"http {action}")
        except (OSError, http.client.HTTPException) as e:
            load.count(f"http {action}: {type(e).__name__}", str(e))
            time.sleep(0.2)


def faults(runtime_dir: str, every_s: float, until: float, load: Load) -> None:
    """SIGKILL each role in turn, every `every_s` seconds."""
    turn = 0
    while not load.stop.wait(every_s) and time.monotonic() < until:
        role = ROLES[turn % len(ROLES)]
        pids = read_pids(runtime_dir) or {}
        if isinstance(pids.get(role), int):
            os.kill(pids[role], signal.SIGKILL)
            load.count(f"killed {role}")
        turn += 1


def proc_figures(pid: int) -> tuple[float, int] | None:
    """(RSS MiB, open file descriptors) of a live process, or None."""
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return None


def sample(t: float, runtime_dir: str, stats_client: Client) -> dict:
    row: dict = {"t": round(t, 1)}
    for role, pid in (read_pids(runtime_dir) or {}).items():
        if role in ROLES and isinstance(pid, int) and (figures := proc_figures(pid)) is not None:
            row[role] = {"rss_mib": round(figures[0], 1), "fds": figures[1]}
    try:
        stats = stats_client.server_stats(timeout=2.0)
        row["state"] = {f"{part}.{name}": (stats.get(part) or {}).get(name) for part, name in STATE}
    except Exception:  # noqa: BLE001 -- a stage restarting: no counts this time
        row["state"] = {}
    return row


def table(samples: list[dict], warm_until: float) -> list[str]:
    lines = ["| process | RSS MiB, warm-up peak | RSS MiB, peak after | RSS MiB, end | fds, warm-up peak | "
             "fds, peak after | fds, end |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for role in ROLES:
        warm = [s[role] for s in samples if role in s and s["t"] <= warm_until]
        after = [s[role] for s in samples if role in s and s["t"] > warm_until]
        if not warm or not after:
            continue
        lines.append(f"| {role} | {max(w['rss_mib'] for w in warm):.0f} | {max(a['rss_mib'] for a in after):.0f} | "
                     f"{after[-1]['rss_mib']:.0f} | {max(w['fds'] for w in warm)} | {max(a['fds'] for a in after)} | "
                     f"{after[-1]['fds']} |")
    lines += ["", "| per-request state | peak during the run | at the end |", "| --- | ---: | ---: |"]
    for part, name in STATE:
        values = [s["state"].get(f"{part}.{name}") for s in samples if s.get("state")]
        values = [v for v in values if isinstance(v, int)]
        if values:
            lines.append(f"| {part} {name} | {max(values)} | {values[-1]} |")
    return lines


def test_soak_mixed_traffic_with_restarts_grows_nothing(tiny_model_dir):
    seconds = float(os.environ.get("NANOVLLM_SOAK_S", "300"))
    warm_until = seconds / 5
    runtime_dir, port = short_tmpdir(), _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "client")]))
    log = open(os.path.join(runtime_dir, "serve.log"), "wb")
    proc = subprocess.Popen([sys.executable, "-m", "nanovllm.supervisor", "--model", tiny_model_dir, "--runtime-dir",
                             runtime_dir, "--http-port", str(port), *TINY_ENGINE_ARGS], cwd=REPO, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    load, samples = Load(), []
    try:
        url = f"ipc://{runtime_dir}"
        with Client(url, timeout=120, connect_timeout=START_TIMEOUT) as stats_client:
            stats_client.wait_engine(timeout=START_TIMEOUT)
            wait_for(lambda: _get(port, "/health")[0] == 200, timeout=START_TIMEOUT, what="the HTTP front")
            started = time.monotonic()
            workers = [threading.Thread(target=zmq_worker, args=(url, k, load)) for k in range(2)]
            workers += [threading.Thread(target=http_worker, args=(port, tiny_model_dir, 10 + k, load)) for k in range(2)]
            workers.append(threading.Thread(target=faults, args=(runtime_dir, warm_until, started + seconds - 20, load)))
            for w in workers:
                w.start()
            while (t := time.monotonic() - started) < seconds:
                samples.append(sample(t, runtime_dir, stats_client))
                time.sleep(SAMPLE_S)
            load.stop.set()
            for w in workers:
                w.join(180)
                assert not w.is_alive(), "a load thread hangs"
            wait_for(lambda: engine_idle(stats_client), timeout=120, interval=0.5, what="the service to settle")
            # Frames held for a vanished client go when the detokenizer gives it up (its client timeout, 5 s).
            wait_for(lambda: (s := stats_client.server_stats())["engine"].get("num_clients") == 0
                     and s["detok"]["num_pending_frames"] == s["detok"]["num_awaiting_resume"] == 0, timeout=60,
                     what="no client counted by the engine, no frame or resume held by the detokenizer")
            samples.append(sample(time.monotonic() - started, runtime_dir, stats_client))
    finally:
        load.stop.set()
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    lines = table(samples, warm_until)
    summary = {"seconds": seconds, "warm_up_s": warm_until, "outcomes": dict(sorted(load.counts.items())),
               "examples": load.examples, "samples": samples}
    print("\n".join(lines), "\n", json.dumps({k: summary[k] for k in ("outcomes", "examples")}, indent=1))
    out = os.environ.get("NANOVLLM_SOAK_OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "soak.json"), "w") as f:
            json.dump(summary, f)
        with open(os.path.join(out, "soak.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
    final = samples[-1]["state"]
    assert final["engine.num_live"] == final["engine.num_queued"] == final["detok.num_requests"] == 0, final
    assert final["detok.num_awaiting_resume"] == 0 and final["detok.num_pending_frames"] == 0, final
    for role in ROLES:
        warm = [s[role] for s in samples if role in s and s["t"] <= warm_until]
        after = [s[role] for s in samples if role in s and s["t"] > warm_until]
        rss_bound = RSS_GROWTH * max(w["rss_mib"] for w in warm) + RSS_SLACK_MIB
        fd_bound = max(w["fds"] for w in warm) + FD_SLACK
        assert max(a["rss_mib"] for a in after) <= rss_bound, f"{role} RSS grew past {rss_bound:.0f} MiB"
        assert max(a["fds"] for a in after) <= fd_bound, f"{role} open fds grew past {fd_bound}"
    assert sum(n for k, n in load.counts.items() if ":" not in k and not k.startswith("killed")) > 100
