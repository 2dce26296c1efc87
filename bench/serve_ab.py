"""Two checkouts of the service side by side on one serving workload: is a change to the stages
slower than the code before it?

    python bench/serve_ab.py --before /tmp/before --after . --rounds 3
    python bench/serve_ab.py --before /tmp/before --after . -- --concurrency 16 64   # more bench/serve.py flags

Each round runs `bench/serve.py --sweep --null-model` (by default at concurrency 64, one repeat,
no in-process side) once from each checkout, each in a fresh process with that checkout first on
PYTHONPATH (its stages, client and engine), alternating which goes first, so load on the machine
hits both alike. The null model keeps the model step near zero, so what is measured is the
stages' own work. Prints each round's output tok/s at every level, the medians and their ratio
(after / before); then each stage's CPU time per 1,000 output tokens (medians over the rounds,
from the best run of each side): on a shared machine wall-clock throughput swings with the
neighbours' load, while the CPU a stage burns per token barely moves, so that table is the one
to read when the machine is not quiet. One JSON line last.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def run_side(checkout: str, extra: list[str]) -> dict[int, dict]:
    """One null-model sweep from `checkout`: per concurrency level, output tok/s and each process's
    CPU ms per 1,000 output tokens."""
    checkout = os.path.abspath(checkout)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "sweep.json")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([checkout, os.path.join(checkout, "client")]))
        # As a module from the checkout's root: run as a file, bench/ would come first on the path
        # and its http.py would hide the standard library's.
        subprocess.run([sys.executable, "-m", "bench.serve", "--sweep", "--null-model",
                        "--skip-offline", "--json", out, *extra], check=True, env=env, cwd=checkout,
                       stdout=subprocess.DEVNULL)
        with open(out) as f:
            rows = json.load(f)["null"]
    return {row["concurrency"]: {"tok_s": row["output_tok_s"],
                                 "cpu_ms_per_1k": {k: 1e6 * v / row["output_tokens"] for k, v in row["cpu_s"].items()}}
            for row in rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="checkout of the code before the change")
    parser.add_argument("--after", default=os.path.dirname(HERE), help="checkout of the change (default: this one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("extra", nargs="*", help="more bench/serve.py flags, after --")
    args = parser.parse_args()
    extra = args.extra or ["--concurrency", "64", "--repeats", "1"]
    runs: dict[str, list[dict[int, dict]]] = {"before": [], "after": []}
    for r in range(args.rounds):
        order = ("before", "after") if r % 2 == 0 else ("after", "before")
        for side in order:
            runs[side].append(run_side(getattr(args, side), extra))
            print(f"round {r + 1} {side}: " + ", ".join(f"{c}: {t['tok_s']:,.1f}" for c, t in runs[side][-1].items()),
                  flush=True)
    levels = sorted(runs["before"][0])
    tok_s = {side: [{c: run[c]["tok_s"] for c in levels} for run in runs[side]] for side in runs}
    medians = {side: {c: statistics.median(run[c] for run in tok_s[side]) for c in levels} for side in runs}
    print("\n| concurrency | before out tok/s (runs) | after out tok/s (runs) | after / before (medians) |")
    print("| --- | --- | --- | --- |")
    for c in levels:
        cells = [f"{medians[s][c]:,.1f} ({', '.join(f'{run[c]:,.1f}' for run in tok_s[s])})" for s in ("before", "after")]
        print(f"| {c} | {cells[0]} | {cells[1]} | {medians['after'][c] / medians['before'][c]:.3f} |")
    cpu = {side: {c: {k: statistics.median(run[c]["cpu_ms_per_1k"][k] for run in runs[side])
                      for k in runs[side][0][c]["cpu_ms_per_1k"]} for c in levels} for side in runs}
    print("\n| concurrency | process | before CPU ms / 1k out tokens | after | after / before |")
    print("| --- | --- | --- | --- | --- |")
    for c in levels:
        for k, b in cpu["before"][c].items():
            a = cpu["after"][c].get(k, float("nan"))
            print(f"| {c} | {k} | {b:.1f} | {a:.1f} | {a / b if b else float('nan'):.3f} |")
    print(json.dumps({"bench": "serve_ab", "before": os.path.abspath(args.before), "after": os.path.abspath(args.after),
                      "runs": runs, "ratio": {c: round(medians["after"][c] / medians["before"][c], 3) for c in levels},
                      "cpu_ms_per_1k": cpu}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
