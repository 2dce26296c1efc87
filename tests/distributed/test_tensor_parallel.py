"""Tensor parallelism over gloo on CPU: TP=2 gives TP=1's greedy tokens; workers never outlive the engine.

Each TP=2 engine starts one worker process (~4 s here) and rendezvouses on a free port, so
these tests can run beside another engine on the same host.
"""
from __future__ import annotations

import gc
import os
import re
import signal
import socket
import sys
import time

import pytest

from nanovllm import LLM, SamplingParams
from tests.engine.conftest import random_prompts
from tests.helpers.tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tp_llm(path: str, size: int, **config) -> LLM:
    return LLM(path, tensor_parallel_size=size, dist_init_method=f"tcp://127.0.0.1:{free_port()}", **config)


def is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(map(is_running, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(map(is_running, pids))


@pytest.fixture(scope="module")
def sharded_models(tmp_path_factory, tokenizer_dir) -> dict[str, str]:
    """Models that stress the sharding: qkv biases (qwen2); tied embeddings with a vocabulary
    that does not split evenly, so the last rank's shard is padded (llama)."""
    root = tmp_path_factory.mktemp("tp-models")
    return {
        "qwen2-bias": make_tiny_model(str(root / "qwen2"), "qwen2", tokenizer_dir=tokenizer_dir, seed=3),
        "llama-tied-odd-vocab": make_tiny_model(str(root / "llama"), "llama", tokenizer_dir=tokenizer_dir, seed=4,
                                                tie_word_embeddings=True, vocab_size=2051),
    }


def test_tp2_matches_tp1_with_chunked_prefill_and_prefix_cache_then_stops_workers(tiny_model_dir):
    # A shared 24-token prefix makes later prompts hit the prefix cache; a 20-token step budget
    # splits prompts into chunks that continue after cached blocks and mix with decode rows.
    shared = random_prompts([24], vocab=2048, seed=1)[0]
    prompts = [shared + p for p in random_prompts([5, 17, 2], vocab=2048, seed=2)] + random_prompts([40, 1, 9], 2048, 3)
    # float32: in bf16 each rank's partial sums are rounded before the all-reduce, so TP=2 rounds differently.
    config = dict(dtype="float32", block_size=4, num_kvcache_blocks=200, max_num_batched_tokens=20)
    expected = LLM(tiny_model_dir, **config).generate(prompts, GREEDY, use_tqdm=False)
    llm = tp_llm(tiny_model_dir, 2, **config)
    got = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in expected]
    assert llm.engine.block_manager.prefix_cache_hits > 0

    runner = llm.engine.runner
    pids = runner.workers.pids
    assert len(pids) == 1 and is_running(pids[0])
    runner.close()
    assert wait_gone(pids)
    runner.close()  # idempotent


@pytest.mark.parametrize("name", ["qwen2-bias", "llama-tied-odd-vocab"])
def test_tp2_matches_tp1_on_sharding_corner_cases(sharded_models, name):
    path = sharded_models[name]
    prompts = random_prompts([7, 30, 3], vocab=2048, seed=5)
    expected = LLM(path, dtype="float32", num_kvcache_blocks=64).generate(prompts, GREEDY, use_tqdm=False)
    llm = tp_llm(path, 2, dtype="float32", num_kvcache_blocks=64)
    try:
        got = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        llm.engine.runner.close()
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in expected]


def test_dropping_the_engine_stops_its_workers(tiny_model_dir):
    llm = tp_llm(tiny_model_dir, 2, num_kvcache_blocks=32)
    pids = llm.engine.runner.workers.pids
    assert all(map(is_running, pids))
    del llm
    gc.collect()  # the runner's weakref.finalize says goodbye to its workers
    assert wait_gone(pids)


@pytest.mark.parametrize("size, named", [(3, "num_attention_heads (4)"), (4, "num_key_value_heads (2)")])
def test_sizes_that_do_not_split_the_heads_are_rejected_before_any_worker_starts(tiny_model_dir, size, named):
    before = live_children()
    with pytest.raises(ValueError, match=re.escape(f"tensor_parallel_size={size} must divide")) as err:
        tp_llm(tiny_model_dir, size, num_kvcache_blocks=32)
    assert named in str(err.value)
    assert live_children() <= before


def live_children() -> set[int]:
    """Running processes whose parent is this one."""
    children = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid() and fields[0] != "Z":
                children.add(int(entry))
    return children


def test_a_worker_that_dies_while_starting_is_reported_at_once(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(sys, "executable", "/bin/false")  # the worker interpreter exits 1 at once
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="worker rank 1 exited with code 1 while starting"):
        tp_llm(tiny_model_dir, 2, num_kvcache_blocks=32)
    assert time.monotonic() - start < 60  # not the rendezvous timeout (300 s)


def test_a_dead_worker_fails_the_next_step_and_close_still_returns(tiny_model_dir):
    llm = tp_llm(tiny_model_dir, 2, num_kvcache_blocks=32)
    runner = llm.engine.runner
    os.kill(runner.workers.pids[0], signal.SIGKILL)
    assert wait_gone(runner.workers.pids)
    with pytest.raises(RuntimeError):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    start = time.monotonic()
    runner.close()
    assert time.monotonic() - start < 60  # the goodbye's own limits are 5 s and 10 s; a hang never ends
