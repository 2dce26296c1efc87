"""`bench/serve.py --sweep` end to end at tiny scale, on the null model through the real service."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from bench.serve import main
from bench.serve_sweep import knob_grid, pressure_blocks


def test_null_model_sweep_writes_json_and_plot(tiny_model_dir, tmp_path):
    out_json, out_png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    threads = torch.get_num_threads()  # the in-process null engine sets this process's torch threads to 1
    try:
        code = main(["--model", tiny_model_dir, "--sweep", "--null-model", "--concurrency", "1", "3",
                     "--null-min-requests", "3", "--null-output-len", "24", "--repeats", "1",
                     "--json", str(out_json), "--png", str(out_png) if has_matplotlib else ""])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    result = json.loads(out_json.read_text())
    assert "levels" not in result and "pressure" not in result  # --null-model: the null sweep alone
    rows = result["null"]
    assert [(r["concurrency"], r["num_requests"], r["clients"]) for r in rows] == [(1, 3, 1), (3, 3, 3)]
    for row in rows:
        assert row["output_tokens"] == row["num_requests"] * 24  # every token reached its client
        assert row["steps"] >= 24 and row["preemptions"] == 0
        assert row["ttft_p50_ms"] > 0 and row["itl_p50_ms"] >= 0
    assert rows[-1]["offline"]["output_tokens"] == 3 * 24 and rows[-1]["service_over_offline"] > 0
    assert out_png.exists() == has_matplotlib


def test_knob_grid_gives_one_pressure_run_per_combination():
    assert knob_grid([]) == [{}]
    assert knob_grid(["kv-watermark=0.01,0.05", "preempt_ratio=0.5"]) == [
        {"kv_watermark": "0.01", "preempt_ratio": "0.5"}, {"kv_watermark": "0.05", "preempt_ratio": "0.5"}]
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        knob_grid(["kv_watermark"])


def test_pressure_cache_is_half_the_need_but_fits_the_longest_request():
    prompts = [[1] * 30, [1] * 60, [1] * 100]  # with 28 output tokens: 4 + 6 + 8 blocks of 16
    assert pressure_blocks(prompts, 28, 16) == 9
    assert pressure_blocks(prompts[2:], 28, 16) == 8
