"""The engine's own work per step, without the model: two source trees side by side.

`LLMEngine.step()` on the null model (`Config.null_model`: fixed logits, no weights read) is
everything a step costs the host besides the forward: scheduling, the block manager, building
the step's input, sampling, appending tokens, the outputs. A change to those shows here at a
resolution the end-to-end decode rate (a few ms a step, and a machine whose memory bandwidth
drifts) cannot give. Each tree runs in a fresh process with itself first on PYTHONPATH,
alternating which goes first; B greedy requests of `--output` tokens each, EOS ignored, every
step timed; the median step per tree and batch size, and their ratio.

    git worktree add /tmp/before HEAD~3
    python -m bench.step_overhead --before /tmp/before --rounds 3 --batch-sizes 1,64
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ONE_TREE = r"""
import json, os, statistics, sys, tempfile, time
from bench.models import make_bench_model
from nanovllm import SamplingParams
from nanovllm.config import Config
from nanovllm.engine.llm_engine import LLMEngine

batch, output = int(sys.argv[1]), int(sys.argv[2])
model = make_bench_model("tiny", os.path.join(tempfile.gettempdir(), "nanovllm-bench-tiny-model"))
engine = LLMEngine(Config(model=model, null_model=True, num_threads=1, max_num_seqs=max(batch, 1),
                          num_kvcache_blocks=8192))
times = []
for rnd in range(3):
    for i in range(batch):
        engine.add_request(f"r{rnd}-{i}", [1 + i % 100, 2, 3, 4, 5] * 8,
                           SamplingParams(temperature=0, max_tokens=output, ignore_eos=True))
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
print(json.dumps({"median_us": statistics.median(times) * 1e6, "steps": len(times)}))
"""


def run_tree(tree: str, batch: int, output: int) -> float:
    """The median step of one fresh process of `tree`, in microseconds."""
    tree = os.path.abspath(tree)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, os.path.join(tree, "client")]))
    out = subprocess.run([sys.executable, "-c", ONE_TREE, str(batch), str(output)], env=env, cwd=tree, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["median_us"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="source tree of the code before the change")
    parser.add_argument("--after", default=os.path.dirname(HERE), help="source tree of the change (default: this one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--output", type=int, default=512, help="output tokens per request")
    args = parser.parse_args()
    results = {}
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        runs = {"before": [], "after": []}
        for r in range(args.rounds):
            for side in (("before", "after") if r % 2 == 0 else ("after", "before")):
                runs[side].append(run_tree(getattr(args, side), batch, args.output))
        results[batch] = {side: {"median_us": statistics.median(v), "runs_us": [round(x, 1) for x in v]}
                          for side, v in runs.items()}
        results[batch]["after_over_before"] = results[batch]["after"]["median_us"] / results[batch]["before"]["median_us"]
    print(json.dumps({"bench": "step_overhead", "before": args.before, "after": args.after, "output": args.output,
                      "results": results}))
    print("\n| batch | before us/step (runs) | after us/step (runs) | after / before |\n| --- | --- | --- | --- |")
    for batch, r in results.items():
        print(f"| {batch} | {r['before']['median_us']:.1f} ({', '.join(map(str, r['before']['runs_us']))}) | "
              f"{r['after']['median_us']:.1f} ({', '.join(map(str, r['after']['runs_us']))}) | "
              f"{r['after_over_before']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
