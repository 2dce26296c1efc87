"""scripts/gpu_check.sh on CPU (GPU_CHECK_SMOKE=1): every step that runs without a GPU runs for
real on the tiny shape, and summary.json carries every field the GPU run must fill, with the
CPU-measurable ones filled (nano-vllm's and the peer's speeds, greedy equality, kernel timelines).
The GPU-only figures (graphed steps, busy fractions of graphed steps) stay null here."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
REQUIRED = ("device", "commit", "decode_ms_batch1_graph", "peer_decode_ms_batch1", "offline_output_tok_s",
            "hf_offline_output_tok_s", "kernels_per_layer", "busy_fraction_batch1", "busy_fraction_batch64",
            "greedy_equal", "goals", "exit_status")


@pytest.mark.skipif(not (ROOT / "scripts" / "gpu_check.sh").exists(), reason="no script")
def test_gpu_check_runs_on_cpu_as_far_as_it_goes(tmp_path):
    env = {**os.environ, "GPU_CHECK_SMOKE": "1", "OUT": str(tmp_path / "out"), "PYTHON": sys.executable,
           "TMPDIR": str(tmp_path)}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert set(REQUIRED) <= set(summary)
    assert summary["device"] == "cpu" and summary["commit"]
    assert set(summary["exit_status"]) == {"env", "model", "offline", "decode_latency", "timeline_torch_ops",
                                           "hf_peer", "greedy_check"}
    assert all(rc == 0 for rc in summary["exit_status"].values())
    assert summary["offline_output_tok_s"] > 0 and summary["hf_offline_output_tok_s"] > 0
    assert summary["decode_ms_batch1_eager"] > 0 and summary["peer_decode_ms_batch1"] > 0
    assert summary["greedy_equal"] is True and summary["greedy_exact"] is True  # fp32 on CPU: token for token
    assert summary["decode_ms_batch1_graph"] is None and summary["goals"]["decode_ms_batch1_at_most_1"] is None
    assert summary["goals"]["greedy_equal"] is True
    timelines = summary["decode_timelines"]
    assert {"fused.eager.b1", "fused.eager.b4", "torch.eager.b1"} <= set(timelines)
    assert all(t["kernels_per_step"] > 0 for t in timelines.values())
    assert (tmp_path / "out" / "timeline.tar.gz").stat().st_size > 0
    assert not list(tmp_path.glob("nanovllm-gpu-check.*")), "the script's scratch folder is left behind"
