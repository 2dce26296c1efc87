"""`bench/serve.py --sweep` end to end at tiny scale, on the null model through the real service."""
from __future__ import annotations

import importlib.util
import json
import math
import os

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
        # No interval at all (nan) where each request's 24 null-model tokens, made in well under a
        # millisecond a step, reached its client in one delta, as on a loaded machine they may.
        assert row["ttft_p50_ms"] > 0 and (math.isnan(row["itl_p50_ms"]) or row["itl_p50_ms"] >= 0)
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


def test_side_load_burns_its_share_of_a_core():
    import time

    from bench.serve import SideLoad

    with SideLoad(0.01, 0.04) as load:  # a quarter of a core
        time.sleep(1.5)
    # At most its share (0.375 CPU-s of the 1.5 s, and start-up); on a loaded machine it gets less.
    assert 0 < load.cpu_s < 0.6, load.cpu_s
    assert load.proc.returncode is not None  # stopped with the block


def test_a_single_run_with_side_load_reports_all_three_sides(tiny_model_dir, capsys):
    threads = torch.get_num_threads()
    try:
        code = main(["--model", tiny_model_dir, "--num-requests", "4", "--output-len", "8", "--repeats", "1",
                     "--side-load"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["service"]["output_tokens"] == result["offline"]["output_tokens"] == 32
    side = result["offline_side_load"]
    assert side["output_tokens"] == 32 and side["steps"] >= 8
    # The load it ran beside is what the service's streaming took: every process but the engine stage.
    cpu = result["service"]["cpu_s"]
    assert side["streaming_cpu_s"] == round(sum(v for k, v in cpu.items() if k != "engine_proc"), 2) > 0
    assert result["service_over_side_load"] > 0 and len(result["all_service_over_side_load"]) == 1
    # One repeat after the unmeasured warm-up: its pair is the one ratio, and the median.
    paired = result["service"]["output_tok_s"] / result["offline"]["output_tok_s"]
    assert result["all_service_over_offline"] == [round(paired, 3)] == [result["median_service_over_offline"]]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to give the streaming one")
def test_streaming_cores_pin_every_stage_and_the_clients(tiny_model_dir, capsys):
    own = os.sched_getaffinity(0)
    streaming = max(own)
    engine = sorted(own - {streaming})
    threads = torch.get_num_threads()
    try:
        code = main(["--model", tiny_model_dir, "--num-requests", "4", "--output-len", "8", "--repeats", "1",
                     "--streaming-cores", str(streaming)])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["service"]["output_tokens"] == result["offline"]["output_tokens"] == 32
    assert result["config"]["num_threads"] == len(engine)
    # Read back from the kernel after the run, every thread of each process included.
    assert result["service"]["cpus"] == {"supervisor": [streaming], "tokenizer_proc": [streaming],
                                         "engine_proc": engine, "detok_proc": [streaming], "clients": [streaming]}
    assert os.sched_getaffinity(0) == own  # this process is given its CPUs back


def test_streaming_cores_must_leave_the_engine_a_cpu():
    from bench.serve import Cores

    own = os.sched_getaffinity(0)
    with pytest.raises(SystemExit, match="proper subset"):
        Cores.parse(",".join(map(str, sorted(own))))
    if len(own) > 1:
        cores = Cores.parse(str(min(own)))
        assert cores.streaming == {min(own)} and cores.engine == own - {min(own)}
