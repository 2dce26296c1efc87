"""bench/decode_timeline.py: per-step kernel figures from profiler events, and a real run on CPU."""
from __future__ import annotations

import json

import pytest

from bench.decode_timeline import kernel_class, record_timeline, summarize, write_timeline
from nanovllm.config import Config
from nanovllm.engine.llm_engine import LLMEngine


def test_summarize_counts_per_step_and_counts_overlap_once():
    # Two steps; the two GEMMs of step 1 overlap for 5 us.
    events = [("ampere_bf16_gemm_128x64", 0.0, 10.0), ("_rms_norm_kernel", 10.0, 12.0),
              ("ampere_bf16_gemm_128x64", 5.0, 15.0), ("_decode_kernel", 100.0, 104.0),
              ("void at::native::vectorized_elementwise_kernel<4>", 104.0, 105.0)]
    got = summarize(events, steps=2, wall_s=0.001, activity="cuda")
    assert got["kernels_per_step"] == 2.5
    assert got["kernel_us_per_step"] == pytest.approx((10 + 2 + 10 + 4 + 1) / 2)
    assert got["busy_us_per_step"] == pytest.approx((15 + 4 + 1) / 2)  # [0, 15) once, then 4 and 1
    assert got["wall_ms_per_step"] == 0.5
    classes = {c["class"]: c for c in got["classes"]}
    assert classes["gemm"] == {"class": "gemm", "per_step": 1.0, "us_per_step": 10.0}
    assert {"fused_norm", "attention", "elementwise"} <= set(classes)
    assert got["kernels"][0]["name"] == "ampere_bf16_gemm_128x64"  # the most time first


def test_kernels_per_layer_leave_out_the_launches_outside_the_layers():
    # Two steps of a 3-layer model: per layer a GEMM twice and a norm once; per step one more GEMM
    # (the LM head) and one more norm (the final one), and an embedding lookup.
    layer = [("gemm", 0.0, 1.0)] * 2 + [("_rms_norm_kernel", 0.0, 1.0)]
    step = layer * 3 + [("gemm", 0.0, 1.0), ("_rms_norm_kernel", 0.0, 1.0), ("embedding", 0.0, 1.0)]
    got = summarize(step * 2, steps=2, wall_s=0.001, activity="cuda", layers=3)
    assert got["kernels_per_step"] == 12 and got["kernels_per_layer"] == 3
    assert "kernels_per_layer" not in summarize(step, steps=1, wall_s=0.001, activity="cuda")


def test_kernel_classes_follow_the_names():
    assert kernel_class("_qk_norm_rope_store_kernel") == "fused_qk_rope_store"
    assert kernel_class("_store_kvcache_kernel") == "kv_store"
    assert kernel_class("_decode_reduce_kernel") == "attention"
    assert kernel_class("nvjet_tst_64x8_64x16_4x1_v_bz_TNT") == "gemm"
    assert kernel_class("void at::native::reduce_kernel<512, 1>") == "reduce"
    assert kernel_class("something_new") == "other"


def test_a_cpu_run_profiles_the_decode_steps_and_writes_both_files(tiny_model_dir, tmp_path):
    engine = LLMEngine(Config(model=tiny_model_dir, device="cpu", num_kvcache_blocks=64, max_num_seqs=4))
    try:
        timeline = record_timeline(engine, batch=3, steps=2, prompt_len=5, vocab=2048)
    finally:
        engine.runner.close()
    assert not engine.has_unfinished_requests()  # the requests ran to their end
    assert timeline["activity"] == "cpu" and timeline["steps"] == 2
    assert timeline["kernels_per_step"] > 0 and timeline["wall_ms_per_step"] > 0
    assert timeline["kernels_per_layer"] > 0
    path = write_timeline(str(tmp_path / "tl"), "eager", 3, timeline)
    saved = json.loads(open(path).read())
    assert saved["batch"] == 3 and saved["kernels"] == timeline["kernels"]
    assert "eager batch 3: 2 steps" in (tmp_path / "tl.eager.b3.txt").read_text()
