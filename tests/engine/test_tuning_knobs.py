"""The KV tuning knobs do what docs/tuning.md says, through the engine's public API.

- `kv_watermark`: while anything runs, admissions leave that share of the KV blocks free.
- `preempt_ratio`: a step that has to preempt leaves that share free, so preemption comes in
  fewer, larger bursts.
Neither changes what is generated; bad values are refused with an error naming the knob.
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_proc.__main__ import add_config_flags
from nanovllm.config import Config
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.sampling_params import SamplingParams
from tests.engine.conftest import finish_all, random_prompts

NUM_BLOCKS = 48
BLOCK_SIZE = 4
PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def burst() -> list[list[int]]:
    # Twelve requests of up to 52 tokens (13 blocks) each, 156 blocks in all, on a 48-block
    # cache: admissions fill it and growth then has to preempt.
    return random_prompts([12] * 12, vocab=2048, seed=14)


def run(model: str, **knobs) -> tuple[list[list[int]], list[dict], LLMEngine]:
    """Greedy outputs of the burst, the engine's stats after every step, and the engine."""
    engine = LLMEngine(Config(model=model, block_size=BLOCK_SIZE, num_kvcache_blocks=NUM_BLOCKS, dtype="float32",
                              **{"enable_prefix_caching": False, **knobs}))
    prompts = burst()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, PARAMS)
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    history = [engine.stats()]
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
        history.append(engine.stats())
    return [outputs[str(i)] for i in range(len(prompts))], history, engine


def admitting_steps(history: list[dict]) -> list[dict]:
    """Stats after each step that admitted a sequence (no request is added meanwhile, and a step
    that preempts admits nothing, so the waiting count falls only when a step admits)."""
    return [after for before, after in zip(history, history[1:]) if after["num_waiting"] < before["num_waiting"]]


def preempting_steps(history: list[dict]) -> list[dict]:
    return [after for before, after in zip(history, history[1:])
            if after["num_preemptions"] > before["num_preemptions"]]


@pytest.fixture(scope="module")
def baseline(tiny_model_dir):
    return run(tiny_model_dir)


def test_defaults_leave_the_scheduler_as_it_was(baseline):
    _, history, engine = baseline
    assert engine.config.kv_watermark == 0 and engine.config.preempt_ratio == 0
    # The scheduler before the knobs existed ran this burst in 101 steps with 14 preemptions in
    # 11 of them (lengths alone decide it: EOS is ignored). Admissions fill the cache to the last
    # block, and the cache then thrashes.
    assert (len(history) - 1, history[-1]["num_preemptions"], len(preempting_steps(history))) == (101, 14, 11)
    assert min(s["num_free_blocks"] for s in admitting_steps(history)) <= 1


def test_watermark_keeps_its_share_free_through_a_burst_of_admissions(tiny_model_dir, baseline):
    outputs, history, engine = run(tiny_model_dir, kv_watermark=0.25)
    reserve = math.ceil(0.25 * NUM_BLOCKS)
    assert history[0]["kv_watermark_blocks"] == reserve and history[0]["preempt_blocks"] == 0
    admitted = admitting_steps(history)
    assert len(admitted) >= 3  # the burst is admitted over several steps, not all at once
    assert all(s["num_free_blocks"] >= reserve for s in admitted), [s["num_free_blocks"] for s in admitted]
    # Running sequences grow into the reserve instead of preempting one another.
    assert history[-1]["num_preemptions"] < baseline[1][-1]["num_preemptions"]
    assert outputs == baseline[0]
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS


def test_preempt_ratio_frees_its_share_at_once_and_preempts_less_often(tiny_model_dir, baseline):
    outputs, history, engine = run(tiny_model_dir, preempt_ratio=0.25)
    share = math.ceil(0.25 * NUM_BLOCKS)
    assert history[0]["preempt_blocks"] == history[0]["kv_watermark_blocks"] == share
    preempting = preempting_steps(history)
    assert preempting, "the workload must preempt for this test to mean anything"
    # After every step that preempted, the share is free (unless a single sequence is left).
    assert all(s["num_free_blocks"] >= share or s["num_running"] <= 1 for s in preempting), \
        [(s["num_free_blocks"], s["num_running"]) for s in preempting]
    assert any(s["num_free_blocks"] < share for s in preempting_steps(baseline[1]))  # not so without it
    assert len(preempting) < len(preempting_steps(baseline[1])) / 2
    # Admissions keep the share free too, or the preempted sequences would refill it at once.
    assert all(s["num_free_blocks"] >= share for s in admitting_steps(history))
    assert outputs == baseline[0]
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS


def test_both_knobs_with_prefix_caching_keep_greedy_output(tiny_model_dir, baseline):
    outputs, history, engine = run(tiny_model_dir, kv_watermark=0.1, preempt_ratio=0.2, enable_prefix_caching=True)
    assert history[-1]["num_preemptions"] > 0
    assert outputs == baseline[0]
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS


def test_a_request_that_needs_more_than_the_watermark_allows_still_runs(tiny_model_dir):
    # 40 blocks hold 160 tokens; a watermark of 0.9 would never let a 100-token prompt in beside
    # another request, but an idle engine admits it.
    engine = LLMEngine(Config(model=tiny_model_dir, block_size=BLOCK_SIZE, num_kvcache_blocks=40,
                              kv_watermark=0.9, dtype="float32"))
    small, big = random_prompts([6, 100], vocab=2048, seed=15)
    engine.add_request("small", small, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.add_request("big", big, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    finished = {}
    for _ in range(100):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.finish_reason
        if not engine.has_unfinished_requests():
            break
    assert finished == {"small": "length", "big": "length"}


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 12)),
        st.tuples(st.just("abort"), st.integers(0, 40)),
        st.tuples(st.just("step"), st.integers(1, 4)),
    ),
    min_size=1, max_size=25,
)


_examples = itertools.count()
"""Request ids never repeat across examples: hypothesis may abandon one mid-draw, its requests still live."""


@pytest.fixture(scope="module")
def tight_engine(tiny_model_dir):
    return LLMEngine(Config(model=tiny_model_dir, block_size=BLOCK_SIZE, num_kvcache_blocks=24,
                            max_num_batched_tokens=32, max_num_seqs=6, kv_watermark=0.2, preempt_ratio=0.3))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops, data=st.data())
def test_with_both_knobs_random_traffic_loses_and_leaks_nothing(tight_engine, ops, data):
    engine = tight_engine
    ids: list[str] = []
    terminal: Counter = Counter()
    example = next(_examples)

    def step():
        for out in engine.step():
            terminal[out.request_id] += out.finished
        bm = engine.block_manager
        held = {b for s in engine.requests.values() for b in s.block_table}
        assert bm.num_free_blocks + len(held) == bm.num_total_blocks

    for op in ops:
        if op[0] == "add":
            prompt = [7] * 8 + data.draw(st.lists(st.integers(3, 2000), min_size=op[1], max_size=op[1]))
            rid = f"k{example}-{len(ids)}"
            engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=op[2], ignore_eos=True))
            ids.append(rid)
        elif op[0] == "abort" and ids:
            engine.abort(ids[op[1] % len(ids)])
        else:
            for _ in range(op[1]):
                step()
    finish_all(engine, step, ids, terminal)


@pytest.mark.parametrize("knob, value, allowed", [
    ("kv_watermark", 1.0, "[0, 1)"), ("kv_watermark", -0.1, "[0, 1)"), ("kv_watermark", float("nan"), "[0, 1)"),
    ("kv_watermark", "0.1", "[0, 1)"), ("kv_watermark", True, "[0, 1)"),
    ("preempt_ratio", 1.5, "[0, 1]"), ("preempt_ratio", -0.2, "[0, 1]"), ("preempt_ratio", None, "[0, 1]"),
])
def test_bad_values_are_refused_naming_the_knob_and_its_range(knob, value, allowed):
    with pytest.raises(ValueError) as e:
        Config(**{knob: value})
    assert knob in str(e.value) and allowed in str(e.value)


def test_edges_of_the_ranges_are_accepted():
    Config(kv_watermark=0, preempt_ratio=0)
    Config(kv_watermark=0.99, preempt_ratio=1)


def test_the_engine_stage_takes_them_as_flags_and_variables(monkeypatch):
    parser = argparse.ArgumentParser()
    add_config_flags(parser, Config)
    assert "--kv-watermark" in parser.format_help() and "--preempt-ratio" in parser.format_help()
    args = parser.parse_args(["--kv-watermark", "0.1", "--preempt-ratio", "0.2"])
    assert (args.kv_watermark, args.preempt_ratio) == (0.1, 0.2)
    monkeypatch.setenv("NANOVLLM_PREEMPT_RATIO", "0.3")
    parser = argparse.ArgumentParser()
    add_config_flags(parser, Config)
    assert parser.parse_args([]).preempt_ratio == 0.3


def test_the_engine_stage_refuses_a_bad_value_at_start(tmp_path):
    out = subprocess.run([sys.executable, "-m", "engine_proc", "--kv-watermark", "0.9", "--preempt-ratio", "2",
                          "--url", f"ipc://{tmp_path}/s"], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=REPO))
    assert out.returncode == 1
    assert "preempt_ratio must be a number in [0, 1]" in out.stderr
