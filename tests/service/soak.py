"""A longer chaos run than the test's: `nanovllm serve` on a tiny random model, three client
processes streaming greedy requests (tests/service/chaos_client.py) for minutes, while a plan of
faults runs: SIGKILL of one or more stages at once, or SIGSTOP for a while (then SIGCONT).

    python -m tests.service.soak [--seconds 180] [--plan JSON] [--work DIR]

The plan is a list of [seconds into the run, "kill" | "stop", [stage, ...], stop seconds]. At the
end every finished answer must equal a fault-free run's, no request may end in an error or be
lost by a stage's death, and the service must settle holding nothing. Prints a summary and
exits 1 if anything was lost. Not collected by pytest: it runs for minutes.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from nanovllm_client import Client
from tests.service.conftest import EXACT_ARGS, TINY_ENGINE_ARGS
from tests.service.harness import REPO, wait_for
from tests.service.test_chaos import env, reference_answers
from tests.service.test_supervisor import pid_alive, read_pids

ENGINE_DEAD_WINDOW_S = 90.0
"""A request refused as engine-dead must have started this close after an engine kill (a new
request refused while the engine was down), never before it (one that was in flight: lost)."""

DEFAULT_PLAN = [
    [3, "kill", ["tokenizer_proc"]], [12, "kill", ["detok_proc"]], [22, "kill", ["engine_proc"]],
    [45, "kill", ["engine_proc", "detok_proc"]], [70, "stop", ["detok_proc"], 12],
    [90, "kill", ["tokenizer_proc", "engine_proc"]], [115, "stop", ["tokenizer_proc"], 12],
    [135, "kill", ["engine_proc"]], [155, "kill", ["tokenizer_proc", "engine_proc", "detok_proc"]],
]
"""Faults far enough apart that each engine restart completes before the next kill: a request in
flight at two engine deaths fails by design (it may be what kills the engine). An engine stopped
for longer than the detokenizer's engine timeout (3 s) is declared dead, and its requests fail
when it speaks again: that limit is documented, so the default plan does not stop the engine."""


def run_plan(plan: list, runtime_dir: str, started: float) -> list[tuple[float, str, list[str]]]:
    done = []
    for step in plan:
        at, action, stages = step[0], step[1], step[2]
        time.sleep(max(0.0, at - (time.monotonic() - started)))
        pids = read_pids(runtime_dir)
        done.append((time.time(), action, stages))
        if action == "kill":
            for stage in stages:
                os.kill(pids[stage], signal.SIGKILL)
            print(f"{at:6.1f}s killed {stages}", flush=True)
            for stage in stages:
                wait_for(lambda s=stage: (p := read_pids(runtime_dir)) and p[s] not in (None, pids[s]), timeout=120,
                         what=f"{stage} to be restarted")
        else:
            for stage in stages:
                os.kill(pids[stage], signal.SIGSTOP)
            print(f"{at:6.1f}s stopped {stages} for {step[3]}s", flush=True)
            time.sleep(step[3])
            for stage in stages:
                os.kill(pids[stage], signal.SIGCONT)
    return done


def judge(outcomes: list[dict], reference: dict, faults: list) -> list[str]:
    """What was lost: one line per request that failed, was cut short or answered wrongly."""
    engine_kills = [t for t, action, stages in faults if action == "kill" and "engine_proc" in stages]
    lost = []
    for o in outcomes:
        if o["kind"] == "done":
            text, ids = reference[(o["prompt"], o["max_tokens"])]
            if (o["token_ids"], o["text"], o["terminals"]) != (ids, text, 1):
                lost.append(f"request {o['index']}: an answer unlike the fault-free run's")
        elif o["kind"] == "error":
            lost.append(f"request {o['index']}: {o['error'][:200]}")
        elif o["kind"] == "engine_dead":
            refused_new = any(o["started"] >= t - 1 and o["ended"] <= t + ENGINE_DEAD_WINDOW_S for t in engine_kills)
            if not refused_new:
                lost.append(f"request {o['index']} (engine dead): {o['error'][:200]}")
    return lost


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.service.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=180.0, help="how long the clients send requests")
    parser.add_argument("--plan", type=json.loads, default=DEFAULT_PLAN, help="the faults, as JSON (see above)")
    parser.add_argument("--work", default=None, help="directory for the model, logs and outcomes (default: a new one)")
    args = parser.parse_args(argv)
    work = args.work or tempfile.mkdtemp(prefix="nanovllm-soak-")
    from tests.helpers.tiny_models import make_tiny_model

    model = make_tiny_model(os.path.join(work, "model"), "qwen3")
    runtime_dir = tempfile.mkdtemp(prefix="nvs-")  # short: ipc:// paths
    log = open(os.path.join(work, "serve.log"), "wb")
    serve = subprocess.Popen([sys.executable, "-m", "nanovllm.supervisor", "--model", model, "--runtime-dir", runtime_dir,
                              *TINY_ENGINE_ARGS, *EXACT_ARGS], cwd=REPO, env=env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"ipc://{runtime_dir}"
        with Client(url, connect_timeout=300) as client:
            client.wait_engine(timeout=300)
        reference = reference_answers(url)
        outputs = [os.path.join(work, f"client{k}.json") for k in range(3)]
        clients = [subprocess.Popen([sys.executable, "-m", "tests.service.chaos_client", url, out, str(args.seconds),
                                     str(k)], cwd=REPO, env=env()) for k, out in enumerate(outputs)]
        faults = run_plan([step for step in args.plan if step[0] < args.seconds], runtime_dir, time.monotonic())
        codes = [c.wait(timeout=args.seconds + 300) for c in clients]
        outcomes = [o for out in outputs for o in json.load(open(out))]
        kinds = {kind: sum(o["kind"] == kind for o in outcomes) for kind in ("done", "cancelled", "engine_dead", "error")}
        lost = judge(outcomes, reference, faults)
        with Client(url, timeout=60) as client:
            def settled() -> bool:
                stats = client.server_stats()
                engine = stats["engine"]
                return (engine["num_running"] == engine["num_waiting"] == engine["num_live"] == engine["num_queued"] == 0
                        and engine["num_free_blocks"] == engine["num_total_blocks"] and stats["detok"]["num_requests"] == 0)
            try:
                wait_for(settled, timeout=30, interval=0.5, what="the service to settle")
            except AssertionError as e:
                lost.append(str(e))
        print(json.dumps({"requests": len(outcomes), **kinds, "client_exit_codes": codes, "lost": len(lost),
                          "work": work}))
        for line in lost[:50]:
            print("LOST", line)
        return 1 if lost or any(codes) else 0
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(timeout=60)
        except subprocess.TimeoutExpired:
            print("nanovllm serve did not stop within 60 s", flush=True)
            serve.kill()
        log.close()
        for pid in (read_pids(runtime_dir) or {}).values():
            if isinstance(pid, int) and pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
