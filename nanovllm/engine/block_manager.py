"""Paged KV-cache blocks: O(1) allocate/free, reference counts and prefix caching.

A full block is identified by a chained hash (xxh64 of the previous block's hash and its token
ids) plus a token-equality check on a hit. A block is registered in the cache only after its
K/V have been written (`commit`, called after each step), and the block holding a prompt's last
token is never a hit, so every admitted sequence computes at least one token. Freed blocks keep
their hash until they are handed out again (lazy eviction, least recently freed first). Two
sequences with the same prefix scheduled in one step both compute it; `commit` then keeps one
copy and returns the other block at once, so no duplicate stays resident.
"""
from __future__ import annotations

from array import array
from collections import OrderedDict

import xxhash

from nanovllm.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion-ordered: popitem(last=False) hands out the least recently freed block, and
        # a prefix hit on a free block removes it from the middle in O(1).
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        self.prefix_cache_queries = 0
        """Prompt tokens looked up in the prefix cache (at admission)."""
        self.prefix_cache_hits = 0
        """Of those, tokens served from cached blocks."""

    @property
    def num_total_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- admission ---------------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks that hold `seq`'s leading full blocks, never the last token's block."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            block_id = self.hash_to_block_id.get(self._block_hash(seq, i))
            if block_id is None or self.blocks[block_id].token_ids != self._block_tokens(seq, i):
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, num_new_tokens: int, hits: list[int], keep_free: int = 0) -> bool:
        fresh = self.blocks_for(len(hits) * self.block_size + num_new_tokens) - len(hits)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)  # hits that sit in the free list
        return fresh + revived + keep_free <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int]) -> None:
        """Give a waiting sequence its cached prefix blocks plus room for `num_new_tokens`."""
        for block_id in hits:
            self._ref(block_id)
        seq.block_table = list(hits)
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_registered_blocks = len(hits)
        self.prefix_cache_queries += seq.num_tokens
        self.prefix_cache_hits += seq.num_cached_tokens
        self.append_slots(seq, num_new_tokens)

    # -- growth ------------------------------------------------------------------------------

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_short(seq, num_new_tokens) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        for _ in range(self.blocks_short(seq, num_new_tokens)):
            seq.block_table.append(self._take_free_block())

    def commit(self, seq: Sequence) -> None:
        """Offer the blocks whose K/V are now written to the prefix cache (after a step)."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        for i in range(seq.num_registered_blocks, num_full):
            block_hash, tokens = self._block_hash(seq, i), self._block_tokens(seq, i)
            own = seq.block_table[i]
            existing = self.hash_to_block_id.get(block_hash)
            if existing is not None and existing != own and self.blocks[existing].token_ids == tokens:
                # The same block was computed twice in one step: share the registered copy.
                self._ref(existing)
                seq.block_table[i] = existing
                self._unref(own)
            else:
                block = self.blocks[own]
                block.hash, block.token_ids = block_hash, tokens
                self.hash_to_block_id[block_hash] = own
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    def free(self, seq: Sequence) -> None:
        # Tail blocks first, so they are reused before the (more shareable) prefix blocks.
        for block_id in reversed(seq.block_table):
            self._unref(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    # -- internals ---------------------------------------------------------------------------

    def blocks_short(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` must take to hold `num_new_tokens` more tokens."""
        return max(0, self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def _block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])

    def _block_hash(self, seq: Sequence, i: int) -> int:
        while len(seq.block_hashes) <= i:
            j = len(seq.block_hashes)
            h = xxhash.xxh64(seq.block_hashes[j - 1].to_bytes(8, "little") if j else b"")
            h.update(array("q", seq.token_ids[j * self.block_size:(j + 1) * self.block_size]).tobytes())
            seq.block_hashes.append(h.intdigest())
        return seq.block_hashes[i]

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]  # evict: its contents are about to change
        block.hash = block.token_ids = None
        block.ref_count = 1
        return block_id

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_block_ids[block_id]
        block.ref_count += 1

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_block_ids[block_id] = None
