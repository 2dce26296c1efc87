"""Paged KV-cache blocks: O(1) allocate/free, reference counts and prefix caching.

A full block is identified by a chained hash (xxh64 of the previous block's hash and its token
ids) plus a token-equality check on a hit. A block is registered in the cache only once the
step that writes its K/V has run, or on CUDA been queued (`commit`, called after each step's
launch: a step that reads it is queued after), and the block holding a prompt's last
token is never a hit, so every admitted sequence computes at least one token. Freed blocks keep
their hash until they are handed out again (lazy eviction, least recently freed first). Two
sequences with the same prefix scheduled in one step both compute it; `commit` then keeps one
copy and returns the other block at once, so no duplicate stays resident. A request's
`cache_salt` seeds its first block's hash, so it shares blocks only with requests of that salt.
"""
# [ZH-START]
# 【模块定位】分页 KV cache 的块分配器：只管块号（block id）和元数据，不碰任何 K/V 张量。
# 在引擎一步之内的位置：
#   LLMEngine.step
#     ├─ Scheduler.schedule ─能否分配 / 追加？→ BlockManager → 写好 seq.block_table
#     ├─ ModelRunner.run：按 block_table 把本步 K/V 写进 kv_cache[block_id]，并读出来做 attention
#     └─ Scheduler.advance → BlockManager.commit：把刚写满的块登记进前缀缓存
# 整个服务：客户端 → 分词进程 → 引擎进程（本模块在这里）→ 反分词进程 → 客户端。
# 三个核心结构：
#   - blocks[i]：第 i 个物理块的元数据（ref_count、hash、token_ids）；
#   - free_block_ids：OrderedDict 当 O(1) 的 LRU 用，最早释放的块最先被拿走；
#   - hash_to_block_id：链式 xxh64 哈希 → 块号，也就是前缀缓存的索引。
# 一块装 block_size 个 token，n 个 token 需要 blocks_for(n) = ceil(n / block_size) 块。
# 块表 → 物理块 → 槽位（block_size = 8，20 个 token 的序列；块号为举例）：
#   seq.block_table  逻辑块 0    逻辑块 1    逻辑块 2
#                       │           │           │
#                       ▼           ▼           ▼
#   物理块号            3           5           6         （kv_cache[layer][block_id] 的下标）
#   token 位置 p       0–7         8–15        16–19
#   槽位 slot         24–31       40–47       48–51      slot = block_table[p // 8] × 8 + p % 8
# 槽位是 KV 写入的位置（step_input 生成 slot_mapping）；注意力按块表找回同一批槽位来读。
# [ZH-END]
from __future__ import annotations

from array import array
from collections import OrderedDict

import xxhash

from nanovllm.engine.sequence import Sequence


class Block:
    # [ZH-START]
    # 一个物理 KV 块的元数据；K/V 数据本身在 ModelRunner 的 kv_cache 张量里，以 block_id 为下标。
    # ref_count：有几个序列的 block_table 引用它；为 0 时它的块号在 free_block_ids 里。
    # hash / token_ids：块写满、commit 之后才有；释放后仍保留（惰性淘汰），
    # 直到 _take_free_block 把它交给新主人时才清掉，这期间还能被前缀命中"复活"。
    # [ZH-END]
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None


class BlockManager:
    # [ZH-START]
    # 职责：块的分配、引用计数和释放，外加前缀缓存（查询 match_prefix，登记 commit）。
    # 不做的事：不决定谁先跑、谁被抢占（Scheduler 决定）；不读写 K/V 张量（ModelRunner 做）；
    # 不算内存能放几块（num_blocks 由 ModelRunner 按内存预算算好传进来）。
    # 和谁打交道：调度时被 Scheduler 调用；LLMEngine 用 blocks_for / num_total_blocks
    # 拒绝永远放不下的请求，并读 num_free_blocks、prefix_cache_queries / prefix_cache_hits 出指标。
    # 它直接修改 Sequence 的 block_table、num_computed_tokens、num_cached_tokens、
    # num_registered_blocks、block_hashes 这几个字段。
    # [ZH-END]
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
        # [ZH-START]
        # 1. 没开前缀缓存（enable_prefix_caching=False）→ 直接返回 []。
        # 2. 只查前 (num_tokens - 1) // block_size 个满块：最后一个 token 所在的块永远不算命中，
        #    保证被接纳的序列至少还要算 1 个 token，才能采样下一个 token。
        #    例：block_size=8、16 个 token → 只查第 0 块（第 1 块含最后一个 token）。
        # 3. 第 i 块：_block_hash 给出链式哈希，查 hash_to_block_id；
        #    查不到，或查到的块 token_ids 与本块 token 不等（哈希碰撞）→ break。
        # 4. 命中就把块号追加到 hits；前缀必须连续，所以第一次不命中就停。
        # 5. 返回 hits。这里只查不占：引用计数要到 allocate 才加。
        # [ZH-END]
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
        # [ZH-START]
        # 1. fresh = blocks_for(命中块数 × block_size + num_new_tokens) - 命中块数：
        #    要从空闲表新拿的块。
        # 2. revived = 命中块里 ref_count == 0 的个数：命中了，但此刻还躺在空闲表里，
        #    allocate 会把它们从空闲表摘走，同样占空闲名额。
        # 3. fresh + revived + keep_free <= num_free_blocks 才能分配（keep_free：
        #    调度器要求分配后仍空着的块数，即 kv_watermark；默认 0）。
        # [ZH-END]
        fresh = self.blocks_for(len(hits) * self.block_size + num_new_tokens) - len(hits)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)  # hits that sit in the free list
        return fresh + revived + keep_free <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int]) -> None:
        """Give a waiting sequence its cached prefix blocks plus room for `num_new_tokens`."""
        # [ZH-START]
        # 调用方先用 can_allocate 确认空闲块够，这里不再检查。
        # 1. 每个命中块 _ref：ref_count += 1；原来是 0 的先从 free_block_ids 摘掉（O(1)）。
        # 2. seq.block_table = hits 的副本；num_computed_tokens = num_cached_tokens =
        #    命中块数 × block_size（这些 token 的 K/V 已在缓存里，不用再算）。
        # 3. num_registered_blocks = 命中块数：它们本来就在前缀缓存里，commit 不必再登记。
        # 4. 指标：prefix_cache_queries += seq.num_tokens，prefix_cache_hits += 命中的 token 数。
        # 5. append_slots(seq, num_new_tokens)：为本步要算的新 token 补足新块。
        # [ZH-END]
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
        # [ZH-START]
        # 1. blocks_short：装下 num_computed_tokens + num_new_tokens 个 token
        #    要的块数 - len(block_table)，最少为 0（decode 时通常是 0，跨过块边界那一步是 1）。
        # 2. 差几块就调几次 _take_free_block，从空闲表头（最早释放的）取块，
        #    追加到 block_table 末尾。
        # 调用方（Scheduler）事先用 can_append / can_allocate 确认过块够。
        # [ZH-END]
        for _ in range(self.blocks_short(seq, num_new_tokens)):
            seq.block_table.append(self._take_free_block())

    def commit(self, seq: Sequence) -> None:
        """Offer the blocks whose K/V are now written to the prefix cache (after a step)."""
        # [ZH-START]
        # 在 Scheduler.advance 里、num_computed_tokens 已加上本步 token 之后调用（本步已发射）。
        # 为什么等到这一步发射后才登记：登记前 K/V 还没排进要写的队列，别的序列命中就会读到垃圾；
        # 发射之后，命中它的序列最早在下一步才读，排在写它的这一步后面（CPU 上这一步已跑完）。
        # 1. 没开前缀缓存 → 返回。
        # 2. num_full = num_computed_tokens // block_size：K/V 已写满的块数。
        # 3. 对还没登记的块 i ∈ [num_registered_blocks, num_full)：
        #    a. 算链式哈希 block_hash 和块内 token（tuple）；
        #    b. hash_to_block_id 里已有另一块 existing 且 token 完全相同（同一步两个序列算了同样的
        #       前缀）：_ref(existing)，block_table[i] 改指向它，_unref 自己那块（没人引用就立刻回
        #       空闲表）——只多算一步，不留重复块；
        #    c. 否则把 hash、token_ids 记到自己那块上，hash_to_block_id[block_hash] = 自己的块号。
        # 4. num_registered_blocks = max(原值, num_full)。
        # [ZH-END]
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

    def trim(self, seq: Sequence) -> None:
        """Return the blocks past those that hold `seq`'s computed tokens: after a verification
        they held only rejected drafted tokens. They were taken this step and never registered,
        so they go to the front of the free list (reused first, sparing cached blocks)."""
        # [ZH-START]
        # 1. keep = blocks_for(num_computed_tokens)：装下已计算 token 所需的块数（和一次普通
        #    decode 之后一样多）。
        # 2. block_table 超出 keep 的尾块逐个弹出、_unref：它们是本步 append_slots 刚拿的私有块
        #    （ref_count 1，没有哈希：commit 只登记 num_computed_tokens 以内的满块），回到空闲表；
        #    再 move_to_end(last=False) 放到表头，下次先用它们，前缀缓存里的旧块多留一会儿。
        # 被拒草稿写在保留块里的 K/V 不用清：它们在 num_computed_tokens 之后，注意力读不到，
        # 之后会被真 token 覆盖，块写满（才会登记）之前早已覆盖完。
        # [ZH-END]
        keep = self.blocks_for(seq.num_computed_tokens)
        while len(seq.block_table) > keep:
            block_id = seq.block_table.pop()
            self._unref(block_id)
            if self.blocks[block_id].ref_count == 0:
                self.free_block_ids.move_to_end(block_id, last=False)

    def free(self, seq: Sequence) -> None:
        # [ZH-START]
        # 1. 倒序遍历 block_table 逐块 _unref：ref_count 降到 0 的块追加到 free_block_ids 末尾。
        #    倒序 → 私有的尾部块先进空闲表、先被复用；更可能被共享的前缀块在前缀缓存里留得更久。
        # 2. 块的 hash 不清（惰性淘汰），之后还能被 match_prefix 命中。
        # 3. block_table 清空，num_computed_tokens、num_registered_blocks 归 0：
        #    被抢占的序列重新接纳时，从头匹配前缀、重新计算。
        # [ZH-END]
        # Tail blocks first, so they are reused before the (more shareable) prefix blocks.
        for block_id in reversed(seq.block_table):
            self._unref(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no sequence holds (they stay free, now as blank blocks);
        returns how many. Blocks of running sequences keep their hashes: they are in use, and a
        prompt that shares them still finds them. Paged KV has no external fragmentation, so this
        is the whole of the pool's manual clean-up."""
        # [ZH-START]
        # 1. 只看空闲表里的块（ref_count == 0）：带着哈希的就是"已释放但仍可命中"的缓存块。
        # 2. 哈希表仍指向它 → 删掉这条映射；清空它的 hash、token_ids；计数。
        #    它本来就在空闲表里，位置不变：KV 占用率不变，只是不再能被前缀命中。
        # 3. 正在运行的序列持有的块（ref_count > 0）不动：它们的哈希照样有效，共享前缀的新请求
        #    仍能命中。
        # 4. 返回清掉的块数。分页 KV 没有外部碎片（任何空闲块都能给任何序列），无需搬移整理，
        #    "碎片整理"在这里只剩把缓存池交还。
        # [ZH-END]
        freed = 0
        for block_id in self.free_block_ids:
            block = self.blocks[block_id]
            if block.hash is None:
                continue
            if self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]
            block.hash = block.token_ids = None
            freed += 1
        return freed

    # -- internals ---------------------------------------------------------------------------

    def blocks_short(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` must take to hold `num_new_tokens` more tokens."""
        return max(0, self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def _block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])

    def _block_hash(self, seq: Sequence, i: int) -> int:
        # [ZH-START]
        # 1. seq.block_hashes 缓存已算好的哈希；长度不到 i + 1 就从 j = len(block_hashes) 往后补算。
        # 2. 第 j 块：h = xxh64(第 j-1 块哈希的 8 字节小端表示，j == 0 时为空)，
        #    再 update 本块 token 的 int64 字节（array("q")）。
        #    第 0 块的种子是请求的 cache_salt（没有则为空）：
        #    加盐的链从第一块起就与别的盐、与不加盐的链分开。
        # 3. 链式的好处：哈希相同意味着整段前缀都相同（碰撞由调用方比较 token_ids 兜底）。
        # 4. 返回 block_hashes[i]。每块在序列生命周期里只算一次（token 只追加，不修改）。
        # [ZH-END]
        while len(seq.block_hashes) <= i:
            j = len(seq.block_hashes)
            h = xxhash.xxh64(seq.block_hashes[j - 1].to_bytes(8, "little") if j else _salt_seed(seq.params.cache_salt))
            h.update(array("q", seq.token_ids[j * self.block_size:(j + 1) * self.block_size]).tobytes())
            seq.block_hashes.append(h.intdigest())
        return seq.block_hashes[i]

    def _take_free_block(self) -> int:
        # [ZH-START]
        # 1. popitem(last=False)：取出空闲表里最早释放的块（LRU），O(1)。
        # 2. 它还带着哈希、且 hash_to_block_id 仍指向它 → 删掉这条映射（真正的淘汰：
        #    内容马上要被覆盖）；若映射已指向别的块（同样的内容后来登记在另一块上），不能删。
        # 3. hash、token_ids 清空，ref_count = 1（归调用方的序列），返回块号。
        # [ZH-END]
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


def _salt_seed(salt: str | None) -> bytes:
    """The first block's hash seed: nothing without a salt (the hash of token ids alone, whose
    int64 bytes never spell this prefix); with one, the salt, so a salted prefix meets only
    prefixes of the same salt."""
    return b"" if salt is None else b"cache_salt\0" + salt.encode("utf-8", "surrogatepass")
