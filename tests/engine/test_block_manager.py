"""Block manager: O(1) allocation, reference counts and the prefix-cache rules."""
from __future__ import annotations

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

BS = 4


def seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, tokens, SamplingParams(), arrival=0)


def admit(bm: BlockManager, s: Sequence) -> list[int]:
    """Admit the whole prompt as one chunk; return the prefix-cache hits used."""
    hits = bm.match_prefix(s)
    n = s.num_tokens - len(hits) * BS
    assert bm.can_allocate(n, hits)
    bm.allocate(s, n, hits)
    return hits


def finish_step(bm: BlockManager, s: Sequence) -> None:
    """What the scheduler does after the model wrote the chunk's K/V."""
    s.num_computed_tokens = s.num_tokens
    bm.commit(s)


def test_allocate_and_free_return_every_block():
    bm = BlockManager(8, BS)
    s = seq(list(range(10)))
    admit(bm, s)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    bm.free(s)
    assert bm.num_free_blocks == 8 and all(b.ref_count == 0 for b in bm.blocks)


def test_hash_registered_only_after_kv_written():
    bm = BlockManager(16, BS)
    a = seq(list(range(9)), "a")
    admit(bm, a)
    b = seq(list(range(9)), "b")
    assert bm.match_prefix(b) == []  # a's blocks are allocated but not computed yet
    finish_step(bm, a)
    assert bm.match_prefix(b) == a.block_table[:2]


def test_last_prompt_block_is_never_a_hit():
    bm = BlockManager(16, BS)
    a = seq(list(range(8)), "a")  # exactly two full blocks
    admit(bm, a)
    finish_step(bm, a)
    b = seq(list(range(8)), "b")
    hits = admit(bm, b)
    assert hits == a.block_table[:1]  # block 2 holds b's last token: it must be computed
    assert b.num_computed_tokens == 4 and b.num_tokens - b.num_computed_tokens == 4


def test_hit_requires_equal_tokens_and_chained_prefix():
    bm = BlockManager(16, BS)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    admit(bm, a)
    finish_step(bm, a)
    # Same second block, different first block: the chained hash must not match block 2.
    b = seq([9, 9, 9, 9, 5, 6, 7, 8, 9], "b")
    assert bm.match_prefix(b) == []


def test_shared_blocks_are_refcounted():
    bm = BlockManager(16, BS)
    a = seq(list(range(9)), "a")
    admit(bm, a)
    finish_step(bm, a)
    b = seq(list(range(9)), "b")
    admit(bm, b)
    shared = a.block_table[0]
    assert bm.blocks[shared].ref_count == 2
    bm.free(a)
    assert bm.blocks[shared].ref_count == 1 and shared not in bm.free_block_ids
    bm.free(b)
    assert bm.num_free_blocks == 16


def test_freed_blocks_stay_cached_until_reused():
    bm = BlockManager(4, BS)
    a = seq(list(range(9)), "a")
    admit(bm, a)
    finish_step(bm, a)
    first = a.block_table[0]
    bm.free(a)
    b = seq(list(range(9)), "b")
    assert bm.match_prefix(b)[0] == first  # lazy eviction: still a hit after free
    # Filling the cache with other tokens evicts it.
    c = seq([100 + i for i in range(16)], "c")
    admit(bm, c)
    finish_step(bm, c)
    assert bm.match_prefix(b) == []


def test_identical_prefixes_in_one_step_leave_no_duplicate():
    bm = BlockManager(16, BS)
    a, b = seq(list(range(9)), "a"), seq(list(range(9)), "b")
    admit(bm, a)
    admit(bm, b)  # same step: no hit possible yet, both compute the prefix
    assert bm.num_free_blocks == 16 - 6
    finish_step(bm, a)
    finish_step(bm, b)
    assert b.block_table[:2] == a.block_table[:2]
    assert bm.num_free_blocks == 16 - 4  # b's two duplicate blocks went back at once
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 16


def test_hit_on_a_free_block_takes_it_out_of_the_free_list():
    bm = BlockManager(1000, BS)
    a = seq(list(range(9)), "a")
    admit(bm, a)
    finish_step(bm, a)
    bm.free(a)
    b = seq(list(range(9)), "b")
    admit(bm, b)
    assert a.block_table == [] and b.block_table[0] not in bm.free_block_ids
    assert bm.num_free_blocks == 1000 - 3


def test_reset_prefix_cache_forgets_free_cached_blocks_and_keeps_held_ones():
    bm = BlockManager(16, BS)
    done, running = seq(list(range(9)), "done"), seq(list(range(100, 109)), "running")
    for s in (done, running):
        admit(bm, s)
        finish_step(bm, s)
    bm.free(done)  # its two full blocks stay cached while free
    free_before = bm.num_free_blocks
    assert len(bm.match_prefix(seq(list(range(9)), "again"))) == 2
    assert bm.reset_prefix_cache() == 2
    assert bm.num_free_blocks == free_before  # the same free blocks, now blank
    assert bm.match_prefix(seq(list(range(9)), "again")) == []
    # The running sequence's blocks keep their hashes: a prompt sharing them still finds them.
    assert bm.match_prefix(seq(list(range(100, 109)), "shares")) == running.block_table[:2]
    assert bm.reset_prefix_cache() == 0  # nothing left to forget
    bm.free(running)
    assert bm.reset_prefix_cache() == 2 and bm.num_free_blocks == 16
    assert not bm.hash_to_block_id and all(b.hash is None for b in bm.blocks)
