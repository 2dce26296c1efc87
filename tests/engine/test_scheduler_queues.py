"""Queue bookkeeping: counts cost O(1), and aborted waiting requests leave the queue promptly."""
from __future__ import annotations

import pytest

from nanovllm.config import Config
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.sampling_params import SamplingParams


class NoWalk(list):
    """A queue that fails the test if anything iterates it."""

    def __iter__(self):
        raise AssertionError("a count walked the queue")


@pytest.fixture()
def engine(tiny_model_dir):
    return LLMEngine(Config(model=tiny_model_dir, block_size=8, num_kvcache_blocks=64, max_num_seqs=4))


def counts_without_walking(engine: LLMEngine) -> dict:
    sched = engine.scheduler
    waiting, running = sched.waiting, sched.running
    sched.waiting, sched.running = NoWalk(waiting), NoWalk(running)
    try:
        return engine.stats()
    finally:
        sched.waiting, sched.running = waiting, running


def test_aborting_10000_waiting_requests_of_a_stalled_engine(engine):
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for i in range(10_100):
        engine.add_request(f"r{i}", [5 + i % 50, 6, 7], params)
    assert counts_without_walking(engine)["num_waiting"] == 10_100
    live = [f"r{i}" for i in range(0, 10_100, 101)]
    for i in range(10_100):
        if i % 101:
            assert engine.abort(f"r{i}")
    stats = counts_without_walking(engine)
    assert stats["num_waiting"] == len(live) == 100 and stats["num_running"] == 0
    assert len(engine.scheduler.waiting) <= 2 * len(live)  # dead entries never outnumber live ones
    finished = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished.add(out.request_id)
        stats = counts_without_walking(engine)
        sched = engine.scheduler
        assert stats["num_waiting"] == sum(1 for _, _, s in sched.waiting if not s.is_finished)
        assert stats["num_running"] == sum(1 for s in sched.running if not s.is_finished)
    assert set(live) <= finished and len(engine.scheduler.waiting) == 0


def test_counts_stay_exact_through_admission_preemption_and_aborts(tiny_model_dir):
    # A cache too small for everyone: sequences are admitted, preempted back to waiting, aborted
    # while running and while waiting.
    engine = LLMEngine(Config(model=tiny_model_dir, block_size=4, num_kvcache_blocks=24, max_num_seqs=6))
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i in range(12):
        engine.add_request(f"q{i}", [7 + i] * 20, params)
    step = 0
    while engine.has_unfinished_requests():
        engine.step()
        step += 1
        if step in (3, 6, 9):
            running = [s.request_id for s in engine.scheduler.running if not s.is_finished]
            waiting = [s.request_id for _, _, s in engine.scheduler.waiting if not s.is_finished]
            for rid in running[:1] + waiting[:2]:
                engine.abort(rid)
        sched = engine.scheduler
        stats = counts_without_walking(engine)
        assert stats["num_waiting"] == sum(1 for _, _, s in sched.waiting if not s.is_finished)
        assert stats["num_running"] == sum(1 for s in sched.running if not s.is_finished)
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.num_waiting == engine.scheduler.num_running == 0
