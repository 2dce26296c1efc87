"""Continuous batching: which sequences run in the next step, and with how many tokens.

Each step has a token budget (`max_num_batched_tokens`). Running sequences go first (one token
each when decoding, or the next chunk of an unfinished prompt); the rest of the budget admits
waiting sequences, whose prompts may be split across steps (chunked prefill). When the KV cache
runs out, a running sequence is preempted: its blocks are freed and it is recomputed later (the
prefix cache usually makes that cheap). Which sequence is admitted first and which is preempted
first is the `SchedulerPolicy`'s call (policy.py): FCFS by default, or by priority. Two knobs
(docs/tuning.md) damp preemption: `kv_watermark` keeps a share of blocks free at admission, and
`preempt_ratio` makes one preemption free a share of blocks at once.

An abort is O(1) amortized and counts are O(1): a sequence aborted while waiting stays in the
heap as a dead entry (skipped when it reaches the top), and the heap is rebuilt without them
whenever they outnumber the live ones, so it never holds more than twice the live sequences.
Finished sequences leave `running` on the next `schedule()`.

After a step, `advance` counts its tokens as computed and ends each sampled sequence with a
stand-in for its new token; `settle` writes the tokens once they are on the host and finishes the
sequences that stop. A synchronous step calls the two back to back; the overlapped step
(`LLMEngine`) schedules and launches the next step between them, so stop conditions and aborts
take effect one step late, and a sequence at its length limit is not scheduled again meanwhile.
"""
# [ZH-START]
# 【模块定位】连续批处理（continuous batching）的调度器：每一步决定哪些序列参与、各算几个 token。
# 在引擎一步之内的位置：
#   LLMEngine.step
#     ├─ Scheduler.schedule()       → list[ScheduledSeq]（本模块；向 BlockManager 要块、必要时抢占）
#     ├─ ModelRunner.run(scheduled) → logits；引擎的 Sampler 为每个到达序列末尾的项采样 1 个 token
#     ├─ Scheduler.advance()        → 推进进度、commit 前缀缓存、采样的序列末尾放占位（本模块）
#     └─ Scheduler.settle()         → 占位换成读回的 token、判断结束（本模块；重叠调度时晚一步）
# 整个服务：客户端 → 分词进程 → 引擎进程（本模块在这里）→ 反分词进程 → 客户端。
# 每步一个 token 预算 max_num_batched_tokens：先给 running（decode 各 1 个 token，或未算完的 prompt
# 的下一块），剩下的再接纳 waiting（prompt 可跨步做 prefill 分块），所以 prefill 和
# decode 混在同一个批里。
# 块不够时按 policy 抢占排在最后的 running 序列：块全还回去，以后重算（前缀缓存通常让重算很便宜）。
# [ZH-END]
from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import dataclass, field

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.policy import FCFSPolicy, SchedulerPolicy
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.engine.speculative import Speculator
from nanovllm.layers.pending import is_pending, pending_token
from nanovllm.engine.sampler import SAMPLE_FAILED
from nanovllm_client.protocol import FinishReason


@dataclass(slots=True)
class ScheduledSeq:
    # [ZH-START]
    # 调度结果里的一项：序列 + 本步要为它算的新 token 数 num_new_tokens（decode
    # 为 1，prefill 为一块）。
    # prompt_logprob_span：请求要 prompt logprobs 时，块内哪几个位置的 logits 给还没算的
    # prompt token 打分（块内偏移、个数）；位置 p 的 logits 给 prompt 第 p+1 个 token 打分。
    # samples 为真：这一块算到了序列末尾（num_computed_tokens + num_new_tokens - len(draft)
    # == num_tokens），本步要为它采样；prompt 中间的分块不采样。
    # draft：投机解码的草稿 token（算在 num_new_tokens 里），每个草稿各占一个采样行，
    # 所以 num_samples = 1 + len(draft)。调度时算定一次：之后 settle 可能改动
    # 序列（失败时去掉占位 token），这一项是否采样不能跟着变。ModelRunner / StepInput 只读它，不改。
    # [ZH-END]
    seq: Sequence
    num_new_tokens: int
    draft: list[int] = field(default_factory=list)
    """Drafted tokens verified after the sequence's last token (speculative decoding): they
    are among `num_new_tokens`, and each gets a sampled row of its own."""
    samples: bool = field(init=False)
    """Whether this chunk reaches the end of the sequence, so a token is sampled after it; fixed
    when scheduled."""
    prompt_logprob_span: tuple[int, int] | None = field(init=False)
    """(offset in the chunk, count): the chunk's positions whose logits score a prompt token the
    request still wants the logprob of (`SamplingParams.prompt_logprobs`), or None."""

    def __post_init__(self) -> None:
        seq, first = self.seq, self.seq.num_computed_tokens
        self.samples = first + self.num_new_tokens - len(self.draft) == seq.num_tokens
        self.prompt_logprob_span = None
        start = seq.prompt_logprob_start
        if start is not None:
            lo, hi = max(first, start), min(first + self.num_new_tokens, seq.num_prompt_tokens - 1)
            if lo < hi:
                self.prompt_logprob_span = (lo - first, hi - lo)

    @property
    def num_samples(self) -> int:
        """Rows sampled for this item: one per drafted token plus one, when it samples."""
        return 1 + len(self.draft) if self.samples else 0


class Scheduler:
    # [ZH-START]
    # 职责：维护两个队列——waiting（按 policy 键的最小堆）和 running（列表）；每步分 token 预算、
    # 向 BlockManager 要块、块不够时抢占；步后推进序列进度，按 eos / stop_token_ids / min_tokens /
    # max_tokens / max_model_len 判断结束。
    # 不做的事：不跑模型、不采样（ModelRunner、Sampler 的事）；不匹配 stop string（在
    # detokenize.py）；不持有请求表（那是 LLMEngine.requests）。
    # 和谁打交道：被 LLMEngine 调用（add / finish / schedule / advance / settle / must_preempt）；
    # 调用 BlockManager（match_prefix / can_allocate / allocate / can_append / blocks_short /
    # append_slots / commit / free）和 policy.key。
    # num_waiting / num_running 在每次搬动时精确维护，从不现数（指标每步都要读）。
    # [ZH-END]
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: tuple[int, ...], policy: SchedulerPolicy | None = None,
                 kv_watermark: float = 0.0, preempt_ratio: float = 0.0, speculator: Speculator | None = None,
                 max_draft_rows: int = 8):
        self.block_manager = block_manager
        self.speculator = speculator
        """Proposes drafted tokens (speculative decoding), or None when it is off."""
        self.max_draft_rows = max_draft_rows
        """Most rows a decode-only step may reach with drafts (the one-call CPU decode step's range)."""
        self.preempt_blocks = _share_of(preempt_ratio, block_manager.num_total_blocks)
        """Blocks a step that preempts leaves free (Config.preempt_ratio)."""
        self.watermark_blocks = max(_share_of(kv_watermark, block_manager.num_total_blocks), self.preempt_blocks)
        """Blocks an admission leaves free while anything runs: Config.kv_watermark, raised to
        `preempt_blocks`, or the room a preemption made would be refilled on the next step."""
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.policy = policy or FCFSPolicy()
        self.waiting: list[tuple[tuple, int, Sequence]] = []
        """A heap of (policy key, insertion count, sequence): the policy's first sequence on top."""
        self._insertions = itertools.count()
        self.running: list[Sequence] = []
        """In policy order on each step, so preemption takes the policy's last one."""
        self.num_preemptions = 0
        self.num_waiting = 0
        """Live (unfinished) sequences in `waiting`; kept exact on every move, never counted."""
        self.num_running = 0
        """Live sequences in `running`."""
        self._num_dead_waiting = 0
        """Finished sequences still in the `waiting` heap."""
        self.queue_times: list[float] = []
        """Seconds each sequence admitted for the first time by the last `schedule()` had waited
        since it was added; re-admissions after a preemption are not in it."""

    def add(self, seq: Sequence) -> None:
        heapq.heappush(self.waiting, (self.policy.key(seq), next(self._insertions), seq))
        self.num_waiting += 1

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence (stop, length, abort or error) and free its blocks at once; idempotent."""
        # [ZH-START]
        # 1. 已经 FINISHED → 直接返回（幂等：abort 可能和正常结束撞在同一步）。
        # 2. 还在 WAITING（排队时被 abort）：num_waiting -= 1，_num_dead_waiting += 1——
        #    不从堆里 O(n) 删除，留作"死条目"，到堆顶时再丢；RUNNING 的：num_running -= 1，
        #    也不从 running 列表删，下一次 schedule() 开头统一过滤。
        # 3. block_manager.free(seq)：KV 块立刻归还；末尾若还是占位 token（重叠的一步里，
        #    结果还没读回就被 abort），去掉它——这个 token 不会上报。
        # 4. status = FINISHED，记下 finish_reason。
        # 5. _drop_dead_if_most()：死条目多过活条目时重建堆。
        # [ZH-END]
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.WAITING:
            self.num_waiting -= 1
            self._num_dead_waiting += 1
        else:
            self.num_running -= 1
        self.block_manager.free(seq)
        if seq.token_ids and is_pending(seq.token_ids[-1]):  # ended before its last token was read back
            seq.token_ids.pop()
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._drop_dead_if_most()

    def _drop_dead_if_most(self) -> None:
        """Rebuild the heap without finished sequences once they outnumber the live ones.

        A rebuild costs O(heap), under twice the dead entries it removes, and each of those came
        from one abort: O(1) per abort, amortized.
        """
        # [ZH-START]
        # 1. 条件：_num_dead_waiting > num_waiting（堆里死条目比活条目多）。
        # 2. 列表推导过滤掉 is_finished 的条目，heapify 重建，代价 O(堆大小)。
        # 3. _num_dead_waiting 清零。这样堆大小始终不超过活序列数的约 2 倍。
        # [ZH-END]
        if self._num_dead_waiting > self.num_waiting:
            self.waiting = [entry for entry in self.waiting if not entry[2].is_finished]
            heapq.heapify(self.waiting)
            self._num_dead_waiting = 0

    def schedule(self) -> list[ScheduledSeq]:
        # [ZH-START]
        # 1. running 去掉已结束的序列（finish 时没删，这里惰性清理），再按 policy.key 排序
        #    （FCFS 下本来就有序，sort 只是一次线性检查）。
        # 2. budget = max_num_batched_tokens，清空 queue_times。
        # 3. preempt_blocks > 0（设了 preempt_ratio）时先 _make_room：块不够就一次抢占到留出这一份。
        #    然后 _schedule_running：按顺序给 running 序列分 token 和块，块不够就抢占。
        # 4. budget 减去已分出去的 token 数。
        # 5. 本步没发生抢占才 _schedule_waiting 接纳新序列：刚因为块不够踢了人，
        #    再接纳只会互相抢占、来回抖动。
        # 6. 开了投机解码（speculator 不为空）：_add_drafts 在剩下的 token 预算内给 plain greedy 的
        #    decode 项加上草稿 token。
        # 7. 返回 scheduled：前面是 running 的，后面是新接纳的。
        # [ZH-END]
        self._drop_finished_running()
        self.running.sort(key=self.policy.key)  # already sorted under FCFS: a linear check
        budget = self.max_num_batched_tokens
        self.queue_times = []
        scheduled: list[ScheduledSeq] = []
        preempted = self.preempt_blocks > 0 and self._make_room(budget)
        preempted = self._schedule_running(scheduled, budget) or preempted
        budget -= sum(s.num_new_tokens for s in scheduled)
        if not preempted:
            self._schedule_waiting(scheduled, budget)
        if self.speculator is not None:
            self._add_drafts(scheduled, self.max_num_batched_tokens - sum(s.num_new_tokens for s in scheduled))
        return scheduled

    def _add_drafts(self, scheduled: list[ScheduledSeq], budget: int) -> None:
        """Give plain greedy sequences of a decode-only step drafted tokens to verify, while the
        step stays within `max_draft_rows` rows and the token budget, and only where the blocks
        for them are free now: drafting never preempts."""
        # [ZH-START]
        # 1. 本步有 prefill 分块（任一项 num_new_tokens != 1 或不采样）→ 不草稿：这样的一步已经
        #    走分块 / GEMM 路径，多几行不再便宜。
        # 2. rows_left = max_draft_rows - 本步 decode 行数（默认 8：CPU 一次调用的解码步最多
        #    8 行）；批大时 rows_left <= 0，直接不草稿——这就是"批大不草稿"的规则。
        # 3. 逐项：只有 plain greedy（无采样、惩罚、bias、logprobs、min_tokens、processors、
        #    语法）且没关投机（params.speculative）的序列才问 Speculator；上限 limit =
        #    min(rows_left, budget, max_tokens 还剩的输出数 - 1, max_model_len - num_tokens - 1)：
        #    这一步最多产出 k+1 个 token，不超过长度上限。第一次问时建 seq.spec。
        # 4. 拿到草稿且 can_append(seq, 1 + k)（块现在就够，不为草稿抢占任何人）→
        #    append_slots 补块，把这一项换成 ScheduledSeq(seq, 1 + k, draft)；
        #    rows_left、budget 各减 k。
        # [ZH-END]
        if any(item.num_new_tokens != 1 or not item.samples for item in scheduled):
            return  # a step with prefill chunks takes the chunk / GEMM path, where rows are not cheap
        rows_left = self.max_draft_rows - len(scheduled)
        for i, item in enumerate(scheduled):
            if rows_left <= 0 or budget <= 0:
                break
            seq = item.seq
            if seq.sampling is None or not seq.sampling.plain_greedy or not seq.params.speculative:
                continue
            limit = min(rows_left, budget, seq.params.max_tokens - seq.num_output_tokens - 1,
                        self.max_model_len - seq.num_tokens - 1)
            if seq.spec is None:
                seq.spec = self.speculator.new_state()
            draft = self.speculator.draft(seq.spec, seq.token_ids, limit)
            if not draft or not self.block_manager.can_append(seq, 1 + len(draft)):
                continue
            self.block_manager.append_slots(seq, 1 + len(draft))
            scheduled[i] = ScheduledSeq(seq, 1 + len(draft), draft)
            rows_left -= len(draft)
            budget -= len(draft)

    def _schedule_running(self, scheduled: list[ScheduledSeq], budget: int) -> bool:
        """Schedule running sequences in policy order; returns whether any was preempted."""
        # [ZH-START]
        # 1. 按顺序遍历 running[i]，直到走完或 budget 用完（预算外的 running
        #    序列本步不跑，块照样占着）。_wants_step 为假的跳过：重叠调度时，输出已到长度上限、
        #    只差还在设备上的那个 token 的序列，读回时就结束，不必再算。
        # 2. num_new = min(num_tokens - num_computed_tokens, budget)：decode 时是 1；
        #    prompt 没算完时是下一块。
        # 3. 只要 block_manager.can_append(seq, num_new) 为假（空闲块不够）：
        #    a. 从 running 末尾 pop 一个受害者（policy 排最后的；已调度的都在 i 之前，
        #       不会被选中），_preempt 它；
        #    b. 受害者就是 seq 自己（它已经排最后）→ 返回 True，本步不再调度后面的序列。
        # 4. append_slots(seq, num_new) 补块，追加 ScheduledSeq，budget -= num_new，i += 1。
        # 5. 返回是否发生过抢占。
        # [ZH-END]
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if not self._wants_step(seq):
                i += 1
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.can_append(seq, num_new):
                victim = self.running.pop()  # the policy's last; never one already scheduled
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    return True
            self.block_manager.append_slots(seq, num_new)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
            i += 1
        return preempted

    def _make_room(self, budget: int) -> bool:
        """If the running sequences cannot all grow this step, preempt (the policy's last first)
        until they can with `preempt_blocks` to spare or only the policy's first is left (it is
        never preempted for the margin, so the margin is not guaranteed): one preemption frees a
        share of the cache at once, instead of one sequence per step while the cache stays full.
        Returns whether it preempted; `_schedule_running` then finds room for every sequence left
        (a lone sequence always fits). O(running)."""
        # [ZH-START]
        # 1. _growth：按 _schedule_running 的顺序、预算和跳过规则，算出每个 running 序列本步要补的
        #    块数 needs，求和 short。
        # 2. short <= 空闲块数 → 不用抢占，返回 False。
        # 3. 否则从 running 末尾（policy 排最后的）逐个 _preempt，直到 short + preempt_blocks <=
        #    空闲块数；被抢占的序列若在 needs 里，short 减去它那份。
        #    policy 排第一的序列不为留余量而被抢占。
        # 4. 返回 True：剩下的序列本步都装得下。通常步后还空着 preempt_blocks 块（滞回，
        #    不会每步抢一个）；但只剩一个序列时循环就停了，这份余量不保证。
        # [ZH-END]
        needs = self._growth(budget)
        short = sum(needs)
        if short <= self.block_manager.num_free_blocks:
            return False
        # The policy's first sequence stays: alone it always fits, and evicting it would throw
        # away the most work for the sake of a margin.
        while len(self.running) > 1 and short + self.preempt_blocks > self.block_manager.num_free_blocks:
            if len(needs) == len(self.running):
                short -= needs.pop()
            self._preempt(self.running.pop())
        return True

    def _growth(self, budget: int) -> list[int]:
        """The blocks each running sequence `_schedule_running` would take this step is short of,
        in its order (sequences with no step to run take none and are left out)."""
        needs = []
        for seq in self.running:
            if budget <= 0:
                break
            if self._wants_step(seq):
                num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
                needs.append(self.block_manager.blocks_short(seq, num_new))
                budget -= num_new
        return needs

    def must_preempt(self) -> bool:
        """Whether the next `schedule()` would preempt (the running sequences cannot all grow).
        The overlapped step asks first: a sequence whose last token is still on the device
        cannot be preempted (recomputing it needs the token), so the engine reads it back before."""
        self._drop_finished_running()
        self.running.sort(key=self.policy.key)  # schedule()'s order: which sequences the budget reaches
        return sum(self._growth(self.max_num_batched_tokens)) > self.block_manager.num_free_blocks

    def _wants_step(self, seq: Sequence) -> bool:
        """Whether a running sequence has a token to compute: not one whose output is already at
        its length limit, counting a token sampled on the device and not yet read back (it ends
        when that token is read; computing the next one would be wasted)."""
        return seq.num_output_tokens < seq.params.max_tokens and seq.num_tokens < self.max_model_len

    def _schedule_waiting(self, scheduled: list[ScheduledSeq], budget: int) -> None:
        # [ZH-START]
        # 循环条件：waiting 非空、budget > 0、len(running) < max_num_seqs。
        # 1. 看堆顶 seq；已 FINISHED（排队时被 abort 的死条目）→ 弹出，
        #    _num_dead_waiting -= 1，继续。
        # 2. hits = block_manager.match_prefix(seq)：前缀缓存命中的块；还要算 prompt logprobs 的
        #    请求不用缓存（整段 prompt 都要算出 logits），hits 为空。
        # 3. num_new = min(num_tokens - 命中块数 × block_size, budget)：剩下的 token 本步算多少，
        #    超出预算的部分以后作为 running 分块继续算（prefill 分块）。
        # 4. can_allocate(num_new, hits, keep_free) 不满足 → break：严格按 policy 顺序接纳，
        #    不跳过堆顶去接纳后面的小请求。keep_free = watermark_blocks（kv_watermark 与
        #    preempt_ratio 取大）：有序列在跑时接纳后至少留这么多空闲块；引擎空闲时为 0，
        #    装得下的请求总能跑起来。
        # 5. 弹出堆顶，allocate(seq, num_new, hits)，status = RUNNING，告诉 policy.admitted；
        #    第一次被调度时记 first_scheduled_time，并把排队时间追加到 queue_times
        #    （抢占后重新接纳不算）。
        # 6. num_waiting -= 1，num_running += 1，追加到 running 和 scheduled，budget -= num_new。
        # 7. 循环后 _drop_dead_if_most()：接纳让活条目变少，死条目可能过半。
        # [ZH-END]
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0][2]
            if seq.is_finished:  # aborted while waiting
                heapq.heappop(self.waiting)
                self._num_dead_waiting -= 1
                continue
            # A prompt whose logprobs are wanted is computed whole, its cached blocks unused.
            hits = self.block_manager.match_prefix(seq) if seq.prompt_logprob_start is None else []
            num_new = min(seq.num_tokens - len(hits) * self.block_manager.block_size, budget)
            # An idle engine admits whatever fits, so no request waits forever on the watermark.
            keep_free = self.watermark_blocks if self.num_running else 0
            if not self.block_manager.can_allocate(num_new, hits, keep_free):
                break
            heapq.heappop(self.waiting)
            self.block_manager.allocate(seq, num_new, hits)
            seq.status = SequenceStatus.RUNNING
            self.policy.admitted(seq)
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
                self.queue_times.append(seq.first_scheduled_time - seq.arrival_time)
            self.num_waiting -= 1
            self.num_running += 1
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        self._drop_dead_if_most()  # admissions shrink the live count too

    def _preempt(self, seq: Sequence) -> None:
        # [ZH-START]
        # 重算式抢占（recompute），不把 KV 换出到别处：
        # 1. block_manager.free(seq)：块全部还回去，num_computed_tokens 归 0；已生成的 token
        #    仍留在 token_ids 里。
        # 2. status = WAITING，num_running -= 1。
        # 3. add(seq) 重新入堆，num_waiting += 1：键没变，FCFS 下它比后到的请求先被重新接纳。
        # 4. num_preemptions += 1（指标）。
        # 重新接纳时 prompt + 已生成的 token 一起重新 prefill，通常大部分能从前缀缓存命中。
        # [ZH-END]
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.num_running -= 1
        self.add(seq)
        self.num_preemptions += 1

    def advance(self, scheduled: list[ScheduledSeq]) -> None:
        """After a step's forward and sampling were launched: its tokens count as computed (the
        blocks they fill go to the prefix cache now: their K/V are written by the step in flight,
        before any later step can read them), and each sequence it samples for ends with a
        stand-in (`pending_token(row)`, row among the step's samples) until `settle` writes the
        token. Sequences that ended meanwhile are left alone."""
        # [ZH-START]
        # 同步的一步里 advance 之后紧接着 settle；重叠的一步里，settle 要等下一步发射之后才做，
        # 中间这段时间序列末尾是占位 token，下一步的输入在设备上把它换成真
        # token（layers/pending.py 的 resolve_pending）。
        # 1. 对每一项：它的采样行从 row 开始，共 num_samples 行（与 Sampler 的行序一致，
        #    已结束的序列也占行；有草稿的项占 1 + len(draft) 行）。
        # 2. 已结束的序列（abort，或重叠时上一步刚读到它的 stop）跳过：这一步替它算的结果会被丢弃。
        # 3. 否则 num_computed_tokens += num_new_tokens - len(draft)（草稿要等 settle 接受了才算
        #    已计算，被拒的草稿绝不能进登记到前缀缓存的块），
        #    block_manager.commit(seq) 登记刚写满的块
        #    （此刻除了马上要放的占位 token，序列里全是真 token：上一步已经 settle 过；块里的 K/V
        #    由在飞的这一步写，命中它的序列最早下一步才读，同一条流上排在后面）；
        #    采样的项在 token_ids 末尾追加 pending_token(row)。
        # [ZH-END]
        row = 0
        for item in scheduled:
            seq = item.seq
            first_row = row
            row += item.num_samples
            if seq.is_finished:
                continue
            # Drafted tokens count as computed only once `settle` accepts them: a rejected one
            # must never reach a block offered to the prefix cache.
            seq.num_computed_tokens += item.num_new_tokens - len(item.draft)
            self.block_manager.commit(seq)  # every token but the stand-in below is real by now
            if item.samples:
                seq.token_ids.append(pending_token(first_row))

    def settle(self, scheduled: list[ScheduledSeq], sampled: list[int]) -> int:
        """After a step's tokens reached the host (`advance` ran for it): write each token in
        place of its stand-in and finish the sequences that stop. A SAMPLE_FAILED sample ends its
        sequence with `FinishReason.ERROR` (the why is in its `seq.sampling.error`). Sequences that
        ended meanwhile are skipped: their token is dropped. Returns the number of tokens written
        (failed samples are not)."""
        # [ZH-START]
        # sampled 只含"本步采样了的"项的 token，按 scheduled 顺序排列，所以用迭代器按需取。
        # 对 scheduled 里的每一项：
        # 0. 有草稿的项取出它的 1 + len(draft) 个 token，交给 _settle_draft（接受最长相同前缀、
        #    退回被拒草稿的块），下一项。
        # 1. samples 为真就先取出它的 token（已结束的序列也要取，行序才对得上）；
        #    序列有投机状态时 Speculator.observe 拿它对照上一步没草稿的提议。
        # 2. 序列已结束（这一步在飞时被 abort，或重叠时上一步就停了）→ 丢弃，跳过。
        # 3. 不采样（prompt 中间的分块）→ 下一项（块已在 advance 里登记）。
        # 4. token 等于 SAMPLE_FAILED → finish(seq, FinishReason.ERROR)（finish 会去掉占位 token；
        #    失败原因在 seq.sampling.error 里）。
        # 5. 否则把末尾的占位 token 换成它，num_appended += 1；_finish_reason 给出原因就
        #    finish(seq, 原因)。
        # 6. 本步有序列结束：当场从 running 里去掉——空闲的引擎不会再调 schedule()，
        #    否则最后一批结束的序列（连同它们的采样状态）会一直留在 running 里。
        # 7. 返回写入的 token 数（失败的不算）。
        # [ZH-END]
        num_appended = 0
        any_finished = False
        samples = iter(sampled)
        for item in scheduled:
            if item.draft:
                tokens = [next(samples) for _ in range(item.num_samples)]
                if not item.seq.is_finished:
                    num_appended += self._settle_draft(item.seq, item.draft, tokens)
                    any_finished = any_finished or item.seq.is_finished
                continue
            token = next(samples) if item.samples else None
            seq = item.seq
            if seq.is_finished or token is None:
                continue  # ended meanwhile, or a prompt chunk that does not reach the end yet
            if seq.spec is not None and self.speculator is not None:
                self.speculator.observe(seq.spec, token)
            if token == SAMPLE_FAILED:
                self.finish(seq, FinishReason.ERROR)
                any_finished = True
                continue
            seq.token_ids[-1] = token  # the stand-in `advance` put there
            num_appended += 1
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self.finish(seq, reason)
                any_finished = True
        if any_finished:  # now, not at the next schedule(): an idle engine would hold them (and their state)
            self._drop_finished_running()
        return num_appended

    def _settle_draft(self, seq: Sequence, draft: list[int], tokens: list[int]) -> int:
        """Land a verification: `tokens[i]` is what greedy sampling picked after the last token
        and `draft[:i]`. The drafts that equal those picks are kept, plus the pick after them
        (the model's own token), each checked for a stop as if decoded one by one; the blocks
        that held only rejected drafts go back, and blocks now full of accepted tokens go to the
        prefix cache. Returns the tokens written."""
        # [ZH-START]
        # 进来时：num_computed_tokens 已含最后一个 token（advance 只加了 1），token_ids 末尾是
        # 占位；本步 K/V 已写到 最后位置 .. 最后位置 + k。
        # 1. accepted = 最长的 i，使 draft[:i] == tokens[:i]（greedy 在每个位置选的正是草稿）。
        # 2. 依次写 tokens[0..accepted]：第 0 个替换占位，之后的追加；每写第 i >= 1 个，
        #    说明草稿 i-1 被接受、它的 K/V 有效 → num_computed_tokens += 1。
        #    每个 token 都按 _finish_reason 判停（EOS / stop id / max_tokens / max_model_len），
        #    停了就 finish（块全部释放），后面的 token 不要——与逐个 decode 完全一样。
        #    SAMPLE_FAILED → finish(ERROR)。
        # 3. 没结束：block_manager.trim 退回只装着被拒草稿的块（它们没登记过哈希），
        #    再 commit：刚被接受的 token 写满的块登记进前缀缓存。
        # 4. Speculator.record(seq.spec, k, accepted)，返回写入的 token 数。
        # [ZH-END]
        accepted = 0
        while accepted < len(draft) and tokens[accepted] == draft[accepted]:
            accepted += 1
        self.speculator.record(seq.spec, len(draft), accepted)
        written = 0
        for i, token in enumerate(tokens[:accepted + 1]):
            if token == SAMPLE_FAILED:
                self.finish(seq, FinishReason.ERROR)
                return written
            if i == 0:
                seq.token_ids[-1] = token  # the stand-in `advance` put there
            else:
                seq.num_computed_tokens += 1  # draft i-1 was accepted: its K/V hold the real token
                seq.token_ids.append(token)
            written += 1
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self.finish(seq, reason)
                return written
        self.block_manager.trim(seq)
        self.block_manager.commit(seq)
        return written

    def _drop_finished_running(self) -> None:
        """`running` without the sequences `finish` left in it (it never removes one: O(1) per finish)."""
        self.running = [s for s in self.running if not s.is_finished]

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        # [ZH-START]
        # 1. stopping = (token 在 eos_token_ids 里且没设 ignore_eos) 或 token 在
        #    params.stop_token_ids 里。
        # 2. stopping 且 num_output_tokens >= min_tokens → STOP（token 已追加，
        #    它是输出的最后一个）。
        #    Sampler 在 min_tokens 之前已把这些 token 屏蔽，这里的 min_tokens 判断只是兜底。
        # 3. num_output_tokens >= max_tokens，或 num_tokens >= max_model_len → LENGTH。
        # 4. 都不满足 → None，继续生成。
        # [ZH-END]
        params = seq.params
        stopping = (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids
        if stopping and seq.num_output_tokens >= params.min_tokens:
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None


def _share_of(share: float, num_blocks: int) -> int:
    """`share` of `num_blocks`, rounded up (less a hair, so 0.3 of 10 is 3, not 4)."""
    return max(0, math.ceil(share * num_blocks - 1e-9))
