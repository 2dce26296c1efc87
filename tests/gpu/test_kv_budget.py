"""The GPU KV-cache budget arithmetic, with made-up memory numbers (runs on CPU)."""
from __future__ import annotations

import pytest

from nanovllm.engine.kv_budget import gpu_kv_cache_bytes, num_blocks_for

GIB = 1 << 30


def budget(**overrides) -> int:
    # An 80 GiB card, alone: 79 GiB free at start, 2 GiB of weights loaded, 3 GiB activation peak.
    numbers = dict(total=80 * GIB, free_at_start=79 * GIB, free_now=77 * GIB, peak_allocated=5 * GIB,
                   allocated_now=2 * GIB, utilization=0.9)
    return gpu_kv_cache_bytes(**(numbers | overrides))


def test_a_dedicated_card_gives_its_share_minus_weights_and_activations():
    assert budget() == int(80 * GIB * 0.9) - 2 * GIB - 3 * GIB


def test_memory_other_processes_hold_is_not_counted_as_ours():
    # Another process took 5 GiB before we started: our share is unchanged (free memory allows it).
    assert budget(free_at_start=74 * GIB, free_now=72 * GIB) == budget()


def test_a_busy_shared_card_caps_the_budget_at_free_memory():
    # 60 GiB used by others: 0.9 x 80 would not fit; the cache gets what is free minus activations.
    assert budget(free_at_start=19 * GIB, free_now=17 * GIB) == 17 * GIB - 3 * GIB


def test_a_full_card_gives_zero_never_negative_and_then_a_clear_error():
    assert budget(free_at_start=3 * GIB, free_now=1 * GIB) == 0
    with pytest.raises(ValueError, match="no KV-cache block fits"):
        num_blocks_for(0, 1 << 20, "raise gpu_memory_utilization")


def test_a_small_utilization_below_what_we_already_use_gives_zero():
    assert budget(utilization=0.05) == 0  # 4 GiB allowed, 5 GiB already ours


def test_blocks_are_whole():
    assert num_blocks_for(10 * (1 << 20) + 5, 1 << 20, "") == 10
