"""The whole service's memory: PSS of every process `nanovllm serve` runs, after one chat request.

Each tree named with `--tree LABEL=PATH` (default: this checkout) runs its own
`python -m nanovllm.supervisor --http-port` (PATH/.venv/bin/python where it exists), one after the
other in the same run, on the same model and engine arguments; one chat completion is asked of
its HTTP front, then every process under the supervisor is read from `/proc/PID/smaps_rollup`.
PSS (proportional set size) splits pages shared between processes among them, so the per-process
figures add up to what the service holds. Prints one JSON line per tree, then a table.

    python -m bench.service_memory --tree before=/work/wt-base --tree after=.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from bench.gguf_peer import cpu_model
from bench.http import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE_ARGS = ["--num-kvcache-blocks", "1024"]
"""1,024 blocks of 16 tokens: a 16k-token KV cache, as the figures in docs/benchmarks.md."""
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def smaps_rollup_mb(pid: int) -> dict[str, float]:
    """Rss, Pss and Swap of a process in MB (from its smaps_rollup)."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss", "Swap"):
                fields[key.lower()] = int(rest.split()[0]) / 1024
    return fields


def process_tree(root: int) -> list[int]:
    """`root` and all its descendants."""
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as f:
                    todo.extend(int(child) for child in f.read().split())
            except FileNotFoundError:
                pass
    return pids


def process_name(pid: int) -> str:
    """The module a Python process runs (`-m NAME`), else its script's or program's name."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1]
    script = next((a for a in argv[1:] if not a.startswith("-")), argv[0])
    return os.path.basename(script)


def _post_chat(base: str, deadline: float) -> dict:
    """One greedy chat completion, retried until the service answers (it is still starting)."""
    body = json.dumps({"model": "default", "messages": QUESTION, "max_tokens": 16, "temperature": 0}).encode()
    while True:
        try:
            request = urllib.request.Request(f"{base}/v1/chat/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as response:
                return json.load(response)
        except (urllib.error.URLError, ConnectionError) as exc:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no answer from {base} before the start limit: {exc}") from exc
            time.sleep(0.5)


def measure(label: str, tree: str, model: str, engine_args: list[str], start_timeout: float) -> dict:
    """The PSS of each process of `tree`'s service after one chat request."""
    tree = os.path.abspath(tree)
    venv_python = os.path.join(tree, ".venv", "bin", "python")
    python = venv_python if os.path.exists(venv_python) else sys.executable
    runtime_dir, port = tempfile.mkdtemp(prefix="nvm-"), free_port()
    argv = [python, "-m", "nanovllm.supervisor", "--model", model, "--runtime-dir", runtime_dir,
            "--http-port", str(port), "--log-level", "WARNING", *engine_args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, os.path.join(tree, "client")]))
    proc = subprocess.Popen(argv, cwd=tree, env=env, start_new_session=True)
    try:
        answer = _post_chat(f"http://127.0.0.1:{port}", time.monotonic() + start_timeout)
        processes = [{"name": process_name(pid), "pid": pid, **smaps_rollup_mb(pid)} for pid in process_tree(proc.pid)]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(runtime_dir, ignore_errors=True)
    return {"label": label, "tree": tree, "model": model, "engine_args": engine_args,
            "answer": answer["choices"][0]["message"]["content"], "processes": processes,
            "total_pss_mb": round(sum(p["pss"] for p in processes), 1)}


def table(results: list[dict]) -> str:
    names = list(dict.fromkeys(p["name"] for r in results for p in r["processes"]))
    lines = ["| process | " + " | ".join(f"{r['label']} PSS MB" for r in results) + " |",
             "| --- |" + " --- |" * len(results)]
    for name in names:
        cells = [sum(p["pss"] for p in r["processes"] if p["name"] == name) for r in results]
        lines.append(f"| {name} | " + " | ".join(f"{c:,.0f}" for c in cells) + " |")
    lines.append("| **total** | " + " | ".join(f"**{r['total_pss_mb']:,.0f}**" for r in results) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", metavar="LABEL=PATH",
                        help="a checkout to run (repeatable; default: this one, as 'this')")
    parser.add_argument("--model", default="default")
    parser.add_argument("--engine-args", default=" ".join(ENGINE_ARGS), help="passed to every supervisor")
    parser.add_argument("--start-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    trees = [t.split("=", 1) for t in (args.tree or [f"this={REPO}"])]
    if any(len(t) != 2 for t in trees):
        parser.error("--tree takes LABEL=PATH")
    print(f"# {cpu_model()}", flush=True)
    results = []
    for label, path in trees:
        results.append(measure(label, path, args.model, args.engine_args.split(), args.start_timeout))
        print(json.dumps(results[-1]), flush=True)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
