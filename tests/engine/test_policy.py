"""Scheduling policies: admission order and preemption order, through the engine's step API."""
from __future__ import annotations

import pytest

from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.policy import SchedulerPolicy
from nanovllm.engine.sequence import SequenceStatus
from nanovllm.sampling_params import SamplingParams
from tests.engine.conftest import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def finish_order(engine: LLMEngine) -> list[str]:
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    return order


@pytest.mark.parametrize("policy,expected", [("priority", ["high", "mid", "low1", "low2"]),
                                             ("fcfs", ["low1", "low2", "high", "mid"])])
def test_priority_admits_high_priority_before_earlier_low_priority(tiny_model_dir, policy, expected):
    engine = LLMEngine(model=tiny_model_dir, num_kvcache_blocks=64, block_size=8, max_num_seqs=1, scheduler_policy=policy)
    prompts = random_prompts([6, 6, 6, 6], vocab=2048, seed=1)
    for (rid, priority), prompt in zip([("low1", 0), ("low2", 0), ("high", 5), ("mid", 2)], prompts):
        engine.add_request(rid, prompt, GREEDY, priority=priority)
    order = [o.request_id for o in engine.step() if o.finished]
    running = [rid for rid, seq in engine.requests.items() if seq.status is SequenceStatus.RUNNING]
    assert running == [expected[0]]  # admitted first, ahead of requests that arrived earlier
    assert order + finish_order(engine) == expected


def test_fair_policy_lets_clients_take_turns(tiny_model_dir):
    engine = LLMEngine(model=tiny_model_dir, num_kvcache_blocks=64, block_size=8, max_num_seqs=1, scheduler_policy="fair")
    prompts = random_prompts([6] * 6, vocab=2048, seed=1)
    for rid, prompt in zip(["a0", "a1", "a2", "a3"], prompts):
        engine.add_request(rid, prompt, GREEDY, client="a")
    finished = [o.request_id for o in engine.step() if o.finished]  # a0 runs
    engine.add_request("b0", prompts[4], GREEDY, client="b")  # came last, goes next: a has had its turn
    engine.add_request("b1", prompts[5], GREEDY, client="b")
    assert finished + finish_order(engine) == ["a0", "b0", "a1", "b1", "a2", "a3"]


def test_fair_policy_forgets_clients_that_are_idle(tiny_model_dir):
    """Hundreds of clients come and go (a soak found the first to pass 64 refused): the policy
    keeps only the clients whose next turn is still ahead of the virtual time."""
    engine = LLMEngine(model=tiny_model_dir, num_kvcache_blocks=64, block_size=8, max_num_seqs=4, scheduler_policy="fair")
    (prompt,) = random_prompts([6], vocab=2048, seed=4)
    for i in range(300):
        engine.add_request(f"r{i}", prompt, GREEDY, client=f"c{i}")
        finish_order(engine)
    policy = engine.scheduler.policy
    assert len(policy._next) <= 130, len(policy._next)  # pruned when it doubles past 64


def test_fair_policy_orders_one_client_as_fcfs(tiny_model_dir):
    orders = []
    for policy in ("fair", "fcfs"):
        engine = LLMEngine(model=tiny_model_dir, num_kvcache_blocks=64, block_size=8, max_num_seqs=1,
                           scheduler_policy=policy)
        for i, prompt in enumerate(random_prompts([6] * 4, vocab=2048, seed=3)):
            engine.add_request(f"r{i}", prompt, GREEDY, priority=i)
        orders.append(finish_order(engine))
    assert orders[0] == orders[1] == ["r0", "r1", "r2", "r3"]
    assert first_preempted("fair", tiny_model_dir) == "high"  # one client: the latest arrival, as FCFS


def first_preempted(policy: str, model_dir: str) -> str:
    # Room for both prompts but not both outputs: the scheduler must preempt one of them.
    engine = LLMEngine(model=model_dir, num_kvcache_blocks=8, block_size=4, scheduler_policy=policy)
    prompts = random_prompts([8, 8], vocab=2048, seed=2)
    engine.add_request("low", prompts[0], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), priority=0)
    engine.add_request("high", prompts[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), priority=1)
    while engine.has_unfinished_requests():
        engine.step()
        preempted = [rid for rid, s in engine.requests.items() if s.status is SequenceStatus.WAITING and s.num_output_tokens]
        if preempted:
            (victim,) = preempted
            assert engine.scheduler.num_preemptions == 1
            return victim
    raise AssertionError("no preemption happened")


def test_priority_preempts_lower_priority_first(tiny_model_dir):
    assert first_preempted("priority", tiny_model_dir) == "low"
    assert first_preempted("fcfs", tiny_model_dir) == "high"  # FCFS preempts the latest arrival


def test_custom_policy_orders_admission(tiny_model_dir):
    class ShortestPromptFirst(SchedulerPolicy):
        def key(self, seq):
            return (seq.num_prompt_tokens, seq.arrival)

    engine = LLMEngine(model=tiny_model_dir, num_kvcache_blocks=64, block_size=8, max_num_seqs=1,
                       scheduler_policy=ShortestPromptFirst())
    for rid, n in [("long", 30), ("short", 3), ("medium", 12)]:
        engine.add_request(rid, random_prompts([n], vocab=2048)[0], GREEDY)
    assert finish_order(engine) == ["short", "medium", "long"]


def test_bad_policy_and_priority_are_rejected(tiny_model_dir):
    with pytest.raises(ValueError, match="scheduler_policy must be one of"):
        LLMEngine(model=tiny_model_dir, num_kvcache_blocks=8, scheduler_policy="lifo")
    engine = LLMEngine(model=tiny_model_dir, num_kvcache_blocks=8)
    with pytest.raises(ValueError, match="priority must be an integer"):
        engine.add_request("r", [1, 2], GREEDY, priority=1.5)
