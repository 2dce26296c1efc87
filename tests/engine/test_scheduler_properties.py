"""Random add / abort / step sequences through the real engine under a small KV budget.

After every step the block accounting must be exact (no leak, no over-commit) and so must the
queue counts (the scheduler keeps them as counters); at the end every request has ended exactly
once (finished or aborted) and every block is free again.
"""
from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanovllm.config import Config
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.sampling_params import SamplingParams
from tests.engine.conftest import finish_all

NUM_BLOCKS = 24
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(Config(model=tiny_model_dir, block_size=BLOCK_SIZE, num_kvcache_blocks=NUM_BLOCKS,
                            max_num_batched_tokens=32, max_num_seqs=6))


def check_block_accounting(engine: LLMEngine) -> None:
    bm = engine.block_manager
    live = [s for s in engine.requests.values() if s.block_table]
    refs = Counter(b for s in live for b in s.block_table)
    for block in bm.blocks:
        assert block.ref_count == refs.get(block.block_id, 0), f"block {block.block_id} refcount drifted"
        assert (block.block_id in bm.free_block_ids) == (block.ref_count == 0)
    assert bm.num_free_blocks + len(refs) == NUM_BLOCKS
    for s in live:
        assert len(s.block_table) == len(set(s.block_table)), "a sequence holds one block twice"
        assert len(s.block_table) * BLOCK_SIZE >= s.num_computed_tokens


def check_queue_counts(engine: LLMEngine) -> None:
    sched = engine.scheduler
    live_waiting = sum(1 for _, _, s in sched.waiting if not s.is_finished)
    assert sched.num_waiting == live_waiting
    assert sched.num_running == sum(1 for s in sched.running if not s.is_finished)
    assert len(sched.waiting) <= 2 * live_waiting, "dead heap entries outnumber live ones"


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 12), st.integers(0, 3)),
        st.tuples(st.just("abort"), st.integers(0, 40)),
        st.tuples(st.just("step"), st.integers(1, 4)),
    ),
    min_size=1, max_size=30,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops, data=st.data())
def test_random_traffic_never_leaks_or_overcommits(engine, ops, data):
    ids: list[str] = []
    terminal: Counter = Counter()
    base = engine._arrivals

    def step():
        for out in engine.step():
            if out.finished:
                terminal[out.request_id] += 1
        check_block_accounting(engine)
        check_queue_counts(engine)

    for op in ops:
        if op[0] == "add":
            _, prompt_len, max_tokens, prefix = op
            # Shared prefixes (prefix ids 0-3) exercise the prefix cache and its refcounts.
            prompt = [5 + prefix] * 8 + data.draw(st.lists(st.integers(3, 2000), min_size=prompt_len, max_size=prompt_len))
            rid = f"p{base}-{len(ids)}"
            engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
            ids.append(rid)
        elif op[0] == "abort" and ids:
            engine.abort(ids[op[1] % len(ids)])
            check_block_accounting(engine)
            check_queue_counts(engine)
        else:
            for _ in range(op[1]):
                step()
    finish_all(engine, step, ids, terminal)
    assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0
