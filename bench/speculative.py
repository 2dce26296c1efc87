"""Speculative decoding on an input-grounded workload and a free-text control: this engine without
and with `speculative="ngram"`, each run in a fresh process, alternating, greedy, one stream.

Workloads (offline, reproducible; the chat template of the default model):
- "edit": "repeat this function with one change" over functions of Python's own standard library
  (`textwrap`, `shlex`, `string`, `json/encoder`, `fnmatch`, `glob` source files), 15-40 lines each;
- "free": open-ended stories (drafts mostly rejected: the control).
Each child process loads the engine, warms it up on one short request, then runs the prompts one
after another (one stream) and reports wall time, output tokens and the greedy token ids. The
parent checks that the ids are identical with and without speculation and prints a JSON line and
a table: output tokens/s (median of the repeats), speedup (ngram / off; also per alternating pair,
and by process CPU seconds, which the machine's other load disturbs less), and the acceptance.

    python -m bench.speculative                       # default model, 2 threads, 2 repeats
    python -m bench.speculative --workloads edit --repeats 3 --max-tokens 256
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import subprocess
import sys
import time

MODULES = ("textwrap", "shlex", "string", "json.encoder", "fnmatch", "glob")
STORIES = ("a lighthouse keeper who finds a message in a bottle", "a robot learning to paint",
           "two friends lost in a desert city", "a baker whose bread can talk",
           "an astronaut's first day on Mars", "a cat that runs a small library")


def stdlib_functions(count: int, min_lines: int = 15, max_lines: int = 40) -> list[tuple[str, str]]:
    """(name, source) of the first `count` top-level or method functions of MODULES, in file order,
    whose source has min_lines..max_lines lines."""
    import importlib
    found = []
    for module in MODULES:
        path = importlib.import_module(module).__file__
        with open(path, encoding="utf-8") as f:
            text = f.read()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and min_lines <= node.end_lineno - node.lineno + 1 <= max_lines:
                source = "\n".join(line[node.col_offset:] for line in lines[node.lineno - 1:node.end_lineno])
                found.append((node.name, source))
    found.sort(key=lambda f: (len(f[1]), f[0]))  # a fixed order whatever ast.walk's
    step = max(1, len(found) // count)
    return found[::step][:count]


def workload(name: str, count: int) -> list[str]:
    """The user messages of a workload."""
    if name == "edit":
        return [f"Repeat this Python function exactly, with one change: rename it from `{fn}` to `{fn}_v2`. "
                f"Output only the code.\n\n```python\n{src}\n```" for fn, src in stdlib_functions(count)]
    return [f"Write a short story about {topic}." for topic in STORIES[:count]]


def child(args: argparse.Namespace) -> None:
    from nanovllm import LLM, SamplingParams
    llm = LLM(args.model, num_threads=args.threads, speculative=args.mode, max_num_seqs=8)
    tok = llm.tokenizer
    prompts = []
    for message in workload(args.workload, args.count):
        ids = tok.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True)
        prompts.append(ids if isinstance(ids, list) else ids["input_ids"])
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    llm.generate([prompts[0][:32]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    steps = {"steps": 0, "rows": 0}  # decode steps and the rows they computed: what load does not change

    def count(m) -> None:
        if m.num_decode_tokens and not m.num_prefill_tokens:
            steps["steps"] += 1
            steps["rows"] += m.num_decode_tokens
    llm.engine.add_post_step_hook(count)
    outputs, start, cpu_start = [], time.perf_counter(), time.process_time()
    for prompt in prompts:  # one stream: one request at a time
        outputs.append(llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"])
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    stats = llm.engine.stats()
    print(json.dumps({"wall_s": wall, "cpu_s": cpu, "output_tokens": sum(map(len, outputs)), "token_ids": outputs,
                      "prompt_tokens": sum(map(len, prompts)), "decode_steps": steps["steps"],
                      "decode_rows": steps["rows"],
                      "drafted": stats.get("spec_decode_num_draft_tokens", 0),
                      "accepted": stats.get("spec_decode_num_accepted_tokens", 0)}))


def run_child(args: argparse.Namespace, mode: str, name: str) -> dict:
    cmd = [sys.executable, "-m", "bench.speculative", "--child", "--mode", mode, "--workload", name,
           "--model", args.model, "--threads", str(args.threads), "--count", str(args.count),
           "--max-tokens", str(args.max_tokens)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=dict(os.environ, TQDM_DISABLE="1"))
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workloads", default="edit,free")
    parser.add_argument("--count", type=int, default=6, help="prompts per workload")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="off", help=argparse.SUPPRESS)
    parser.add_argument("--workload", default="edit", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    result = {"model": args.model, "threads": args.threads, "count": args.count, "max_tokens": args.max_tokens,
              "repeats": args.repeats, "workloads": {}}
    for name in args.workloads.split(","):
        runs: dict[str, list[dict]] = {"off": [], "ngram": []}
        for _ in range(args.repeats):
            for mode in ("off", "ngram"):  # alternating, each in a fresh process
                runs[mode].append(run_child(args, mode, name))
        tps = {m: statistics.median(r["output_tokens"] / r["wall_s"] for r in rs) for m, rs in runs.items()}
        cpu = {m: statistics.median(r["cpu_s"] for r in rs) for m, rs in runs.items()}
        pairs = [off["wall_s"] / on["wall_s"] for off, on in zip(runs["off"], runs["ngram"])]
        ids = {m: rs[0]["token_ids"] for m, rs in runs.items()}
        last = runs["ngram"][-1]
        result["workloads"][name] = {
            "off_tok_s": round(tps["off"], 1), "ngram_tok_s": round(tps["ngram"], 1),
            "speedup": round(tps["ngram"] / tps["off"], 3),
            "speedup_per_pair": [round(p, 3) for p in pairs],
            "cpu_speedup": round(cpu["off"] / cpu["ngram"], 3),
            "identical": all(r["token_ids"] == ids["off"] for rs in runs.values() for r in rs),
            "output_tokens": runs["off"][0]["output_tokens"], "prompt_tokens": runs["off"][0]["prompt_tokens"],
            "drafted": last["drafted"], "accepted": last["accepted"],
            "decode_steps": {m: rs[0]["decode_steps"] for m, rs in runs.items()},
            "decode_rows": {m: rs[0]["decode_rows"] for m, rs in runs.items()},
            "acceptance": round(last["accepted"] / last["drafted"], 3) if last["drafted"] else None,
            "off_runs_tok_s": [round(r["output_tokens"] / r["wall_s"], 1) for r in runs["off"]],
            "ngram_runs_tok_s": [round(r["output_tokens"] / r["wall_s"], 1) for r in runs["ngram"]],
        }
    print(json.dumps(result))
    print(f"\n{'workload':<8} | {'off tok/s':>9} | {'ngram tok/s':>11} | {'speedup':>7} | {'CPU-s speedup':>13} | "
          f"{'identical':>9} | {'drafted':>7} | {'accepted':>8}")
    for name, w in result["workloads"].items():
        print(f"{name:<8} | {w['off_tok_s']:>9} | {w['ngram_tok_s']:>11} | {w['speedup']:>7} | {w['cpu_speedup']:>13} | "
              f"{str(w['identical']):>9} | {w['drafted']:>7} | {w['accepted']:>8}")


if __name__ == "__main__":
    main()
