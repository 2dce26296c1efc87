"""The GPU check's one summary: every headline figure of `scripts/gpu_check.sh`'s run, and its goals.

Reads what the script's steps wrote into its output folder (env.json, offline.json,
decode_latency.json, hf_peer.json, greedy_check.json, and the kernel timelines
`<timeline_dir>/{fused,torch}.<mode>.b<batch>.json`) and writes `summary.json` with:

- `device` (the GPU's name as CUDA reports it; `env.nvidia_smi` has nvidia-smi's line; "cpu" in
  the CPU smoke run), `commit`, `exit_status`
  (each step's exit status) and `elapsed_s`;
- `decode_ms_batch1_graph` / `_graph_sync` / `_eager`: a batch-1 decode step of nano-vllm (CUDA
  graphs, overlapped; graphs with the host waiting every step; eager), and
  `peer_decode_ms_batch1`: HF transformers' as fast as it goes (static cache, torch.compile);
- `offline_output_tok_s` (nano-vllm, the 256-request workload) and `hf_offline_output_tok_s`
  (HF `generate` on the same requests' kind, counting the tokens they asked for);
- `kernels_per_layer` (fused ops, from the timeline) and `kernels_per_layer_torch_ops`;
- `busy_fraction_batch1` / `_batch64`: GPU busy time over wall time of a graphed decode step,
  overlapped (after), and `..._sync` with the host waiting every step (before);
- `greedy_equal`: nano-vllm's greedy tokens equal HF's on the GPU, up to near-ties shown by
  logits (greedy_check.json); the CPU-path equality is in the GPU tests (`exit_status.tests`);
- `goals`: each goal of the GPU step, true / false, or null where its figures are missing.

    python -m bench.gpu_summary OUT_DIR TIMELINE_DIR --status '{"tests": 0, ...}' --elapsed 300
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess

GOALS = {
    "decode_ms_batch1_at_most_1": ("decode_ms_batch1_graph", lambda s: s["decode_ms_batch1_graph"] <= 1.0),
    "decode_at_most_half_the_peer": ("decode_vs_peer", lambda s: s["decode_vs_peer"] <= 0.5),
    "offline_at_least_25000_tok_s": ("offline_output_tok_s", lambda s: s["offline_output_tok_s"] >= 25000),
    "offline_at_least_5x_hf": ("offline_vs_hf", lambda s: s["offline_vs_hf"] >= 5),
    "kernels_per_layer_at_most_10": ("kernels_per_layer", lambda s: s["kernels_per_layer"] <= 10),
    "busy_at_least_90_percent": ("busy_fraction_batch64",
                                 lambda s: min(s["busy_fraction_batch1"], s["busy_fraction_batch64"]) >= 0.9),
    "greedy_equal": ("greedy_equal", lambda s: s["greedy_equal"]),
}


def load(path: str) -> dict | None:
    """A JSON file's object, or None when the step that writes it did not (missing or empty)."""
    try:
        with open(path) as f:
            return json.loads(f.read() or "null")
    except (OSError, ValueError):
        return None


def commit() -> str | None:
    """The commit the check ran on: NANOVLLM_COMMIT, else git's HEAD of this checkout."""
    if os.environ.get("NANOVLLM_COMMIT"):
        return os.environ["NANOVLLM_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def ratio(a: float | None, b: float | None, digits: int = 3) -> float | None:
    return round(a / b, digits) if a is not None and b else None


def busy_fraction(timeline: dict | None) -> float | None:
    if not timeline or not timeline.get("wall_ms_per_step"):
        return None
    return round(timeline["busy_us_per_step"] / (1e3 * timeline["wall_ms_per_step"]), 3)


def summarize(out: str, timeline_dir: str, status: dict, elapsed_s: float | None = None) -> dict:
    env, offline = load(os.path.join(out, "env.json")) or {}, load(os.path.join(out, "offline.json")) or {}
    decode, peer = load(os.path.join(out, "decode_latency.json")) or {}, load(os.path.join(out, "hf_peer.json")) or {}
    greedy = load(os.path.join(out, "greedy_check.json")) or {}
    rows = {(r["mode"], r["batch"]): r for r in decode.get("rows", [])}

    def step_ms(mode: str, batch: int = 1) -> float | None:
        return rows[(mode, batch)]["median_step_ms"] if (mode, batch) in rows else None

    def timeline(variant: str, mode: str, batch: int) -> dict | None:
        return load(os.path.join(timeline_dir, f"{variant}.{mode}.b{batch}.json"))

    device = env.get("gpu") or ("cpu" if env and not env.get("cuda_available") else None)
    s = {"device": device, "commit": commit(), "exit_status": status, "elapsed_s": elapsed_s,
         "env": env,
         "decode_ms_batch1_graph": step_ms("graph"), "decode_ms_batch1_graph_sync": step_ms("graph-sync"),
         "decode_ms_batch1_eager": step_ms("eager"), "peer_decode_ms_batch1": peer.get("decode_ms_batch1"),
         "peer_compiled": peer.get("compiled"),
         "decode_rows": decode.get("rows"), "overlap_speedup": decode.get("overlap_speedup"),
         "offline_output_tok_s": offline.get("nanovllm_out_tok_s"), "offline_output_tokens": offline.get("output_tokens"),
         "offline_s": offline.get("nanovllm_s"), "hf_offline_output_tok_s": peer.get("offline_output_tok_s"),
         "hf_offline": {k: peer.get(k) for k in ("num_seqs", "batch_size", "offline_requested_tokens",
                                                  "offline_generated_tokens", "offline_s")},
         "kernels_per_layer": (timeline("fused", "graph", 1) or {}).get("kernels_per_layer"),
         "kernels_per_layer_torch_ops": (timeline("torch", "graph", 1) or {}).get("kernels_per_layer"),
         "busy_fraction_batch1": busy_fraction(timeline("fused", "graph", 1)),
         "busy_fraction_batch64": busy_fraction(timeline("fused", "graph", 64)),
         "busy_fraction_batch1_sync": busy_fraction(timeline("fused", "graph-sync", 1)),
         "busy_fraction_batch64_sync": busy_fraction(timeline("fused", "graph-sync", 64)),
         "greedy_equal": greedy.get("equal"), "greedy_exact": greedy.get("exact")}
    s["decode_vs_peer"] = ratio(s["decode_ms_batch1_graph"], s["peer_decode_ms_batch1"])
    s["offline_vs_hf"] = ratio(s["offline_output_tok_s"], s["hf_offline_output_tok_s"], 2)
    timelines = {}
    for name in sorted(os.listdir(timeline_dir)) if os.path.isdir(timeline_dir) else []:
        if name.endswith(".json"):
            t = load(os.path.join(timeline_dir, name)) or {}
            timelines[name[:-5]] = {k: t.get(k) for k in ("kernels_per_step", "kernels_per_layer", "kernel_us_per_step",
                                                           "busy_us_per_step", "wall_ms_per_step")}
    s["decode_timelines"] = timelines
    s["goals"] = {goal: (None if s.get(needs) is None or (goal == "busy_at_least_90_percent"
                                                          and s["busy_fraction_batch1"] is None)
                         else bool(test(s)))
                  for goal, (needs, test) in GOALS.items()}
    return s


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the check's output folder; summary.json goes there")
    ap.add_argument("timeline_dir")
    ap.add_argument("--status", default="{}", help="JSON object: each step's exit status")
    ap.add_argument("--elapsed", type=float, help="seconds the whole check took")
    args = ap.parse_args(argv)
    summary = summarize(args.out, args.timeline_dir, json.loads(args.status), args.elapsed)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("env", "decode_rows", "decode_timelines")}, indent=1))
    return summary


if __name__ == "__main__":
    main()
