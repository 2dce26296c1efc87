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
"""
from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import dataclass

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.policy import FCFSPolicy, SchedulerPolicy
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.layers.sampler import SAMPLE_FAILED


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so a token is sampled after it."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: tuple[int, ...], policy: SchedulerPolicy | None = None,
                 kv_watermark: float = 0.0, preempt_ratio: float = 0.0):
        self.block_manager = block_manager
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

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence (stop, length, abort or error) and free its blocks at once; idempotent."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.WAITING:
            self.num_waiting -= 1
            self._num_dead_waiting += 1
        else:
            self.num_running -= 1
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._drop_dead_if_most()

    def _drop_dead_if_most(self) -> None:
        """Rebuild the heap without finished sequences once they outnumber the live ones.

        A rebuild costs O(heap), under twice the dead entries it removes, and each of those came
        from one abort: O(1) per abort, amortized.
        """
        if self._num_dead_waiting > self.num_waiting:
            self.waiting = [entry for entry in self.waiting if not entry[2].is_finished]
            heapq.heapify(self.waiting)
            self._num_dead_waiting = 0

    def schedule(self) -> list[ScheduledSeq]:
        self.running = [s for s in self.running if not s.is_finished]
        self.running.sort(key=self.policy.key)  # already sorted under FCFS: a linear check
        budget = self.max_num_batched_tokens
        self.queue_times = []
        scheduled: list[ScheduledSeq] = []
        preempted = self.preempt_blocks > 0 and self._make_room(budget)
        preempted = self._schedule_running(scheduled, budget) or preempted
        budget -= sum(s.num_new_tokens for s in scheduled)
        if not preempted:
            self._schedule_waiting(scheduled, budget)
        return scheduled

    def _schedule_running(self, scheduled: list[ScheduledSeq], budget: int) -> bool:
        """Schedule running sequences in policy order; returns whether any was preempted."""
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
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
        until they can with `preempt_blocks` to spare: one preemption frees a share of the cache
        at once, instead of one sequence per step while the cache stays full. Returns whether it
        preempted; `_schedule_running` then finds room for every sequence left. O(running)."""
        needs = []
        for seq in self.running:  # what `_schedule_running` will take, in the same order
            if budget <= 0:
                break
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            needs.append(self.block_manager.blocks_short(seq, num_new))
            budget -= num_new
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

    def _schedule_waiting(self, scheduled: list[ScheduledSeq], budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0][2]
            if seq.is_finished:  # aborted while waiting
                heapq.heappop(self.waiting)
                self._num_dead_waiting -= 1
                continue
            hits = self.block_manager.match_prefix(seq)
            num_new = min(seq.num_tokens - len(hits) * self.block_manager.block_size, budget)
            # An idle engine admits whatever fits, so no request waits forever on the watermark.
            keep_free = self.watermark_blocks if self.num_running else 0
            if not self.block_manager.can_allocate(num_new, hits, keep_free):
                break
            heapq.heappop(self.waiting)
            self.block_manager.allocate(seq, num_new, hits)
            seq.status = SequenceStatus.RUNNING
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
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.num_running -= 1
        self.add(seq)
        self.num_preemptions += 1

    def postprocess(self, scheduled: list[ScheduledSeq], sampled: list[int]) -> int:
        """Advance sequences past the step: record computed tokens, append samples, finish.

        A SAMPLE_FAILED sample ends its sequence with reason "error" (the sampler keeps the why).
        Returns the number of tokens appended (failed samples are not).
        """
        num_appended = 0
        samples = iter(sampled)
        for item in scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.commit(seq)
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prompt chunk that does not reach the end yet
            token = next(samples)
            if token == SAMPLE_FAILED:
                self.finish(seq, "error")
                continue
            seq.token_ids.append(token)
            num_appended += 1
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self.finish(seq, reason)
        return num_appended

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        stopping = (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids
        if stopping and seq.num_output_tokens >= params.min_tokens:
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None


def _share_of(share: float, num_blocks: int) -> int:
    """`share` of `num_blocks`, rounded up (less a hair, so 0.3 of 10 is 3, not 4)."""
    return max(0, math.ceil(share * num_blocks - 1e-9))
