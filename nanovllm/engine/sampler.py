"""Token sampling for a whole batch at once, each row with its own parameters.

The engine hands over the last-position logits (B, V) the model runner computed for every
sequence that samples this step. Per step, in this order:

1. logprobs (if asked) are read from the raw model distribution, before anything below;
2. penalties (repetition over prompt + output, presence / frequency over the output);
3. per-request constraints: logit_bias, EOS / stop tokens masked until `min_tokens`, and the
   request's logits processors (allowed ids, banned words, custom ones);
4. greedy rows take the argmax; the others divide by their temperature, keep their top_k, then
   the top_p nucleus and the tokens at least min_p times as likely as the best one (top_p and
   min_p are both judged on the top_k-renormalized distribution), and draw from what is left.
   The most likely token always survives the filters, and a temperature too small for float32
   acts as greedy.

Everything is tensor work over the batch; the only Python loops are over requests that have a
constraint or a seed. A batch of plain greedy requests is one argmax.

A row that cannot be sampled ends its own request, never the batch: if a logits processor raises,
the row holds NaN or +inf after penalties and constraints (or nothing but -inf), or the id
drawn is outside the vocabulary, the row's token is SAMPLE_FAILED and the reason is kept in its
request's state (`SamplingState.take_error`). The engine finishes that request with
`FinishReason.ERROR`; the other rows are sampled as they would be without it. Finding such rows
costs the greedy fast path a read of B chosen values, and the general path one max over the
(B, V) logits.

Draws are by inverse CDF, one uniform number per row. Unseeded rows share the sampler's
generator; a seeded request takes its number from its own generator, and everything else its
draw depends on is computed row by row (neighbours only pad the candidate width with -inf), so
its tokens do not depend on which other requests share the batch. If a request's constraints
leave no token at all, its row is sampled with its response_format's grammar alone (the grammar
wins over banned words, logit_bias, allowed ids and custom processors), or without any if it has
none (with a warning), rather than from an empty set. Grammar masks are computed while the
forward runs: the engine calls `prepare` with the rows to sample before the forward (see
`nanovllm.structured.prefetch`).

Each request's state between steps lives on the request (`SamplingState`, `Sequence.sampling`):
the sampler is a function over the step's rows and holds only what all rows share (the unseeded
generator, the mask prefetcher, the compiled CPU ops); the engine owns it and calls it after the
forward. This module holds the step's order; the parts: `constraints` (3) beside it, and the
tensor work in `nanovllm/layers/`: `penalties` (2), `sampling_ops` (4: filters and the draw) and
`logprobs` (1).
"""
# [ZH-START]
# 【模块定位】引擎一步的最后一段：把 LM head 的 logits 变成下一个 token。
#   scheduler → step_input → model runner → 解码层 / PagedAttention → compute_logits (B, V)
#     → 【Sampler】→ list[int]（每条序列一个 token id）→ Scheduler.settle
#     → 反分词进程 → 客户端
# 只在 rank 0 运行。每一步的顺序：原始分布的 logprobs → 惩罚项（repetition / presence / frequency）
# → 每请求的约束（logit_bias、min_tokens 前屏蔽 EOS / stop token、logits processors）
# → greedy 取 argmax，其余按温度缩放、top_k / top_p / min_p 过滤，再用逆 CDF 抽样。
# 全是整批张量运算，Python 循环只遍历"有约束或有种子"的请求；全是普通 greedy 的批只是一次 argmax。
# 某一行采样失败只结束该请求（返回 SAMPLE_FAILED = -1，原因记进它自己的 SamplingState），
# 不影响同批其他行。
# 每请求的状态挂在请求身上（Sequence.sampling，见 sequence.py 的 SamplingState），
# 采样器只是"这一步的行"上的函数，自己只保存所有行共享的东西（无种子行共用的 Generator、
# 掩码预取、CPU 编译算子）；引擎持有它，在前向之后调用。
# 本模块管一步的顺序；各段：旁边的 constraints（约束与语法优先），layers/ 里的张量运算
# penalties（惩罚）、sampling_ops（过滤与抽样）、logprobs。
# [ZH-END]
from __future__ import annotations

import logging
import math
import os

import torch

from nanovllm.engine.constraints import (MAX_ERROR_CHARS, apply_constraints, constrain_rows, non_finite,
                                         non_finite_best)
from nanovllm.engine.sequence import SamplingState, Sequence
from nanovllm.layers.cpu_kernels import CpuOps
from nanovllm.layers.host_copy import upload
from nanovllm.layers.logprobs import TokenLogprobs, token_logprobs
from nanovllm.layers.penalties import apply_penalties_, penalty_tensors
from nanovllm.layers.sampling_ops import draw, filter_candidates, has_filters, sample_rows
from nanovllm.structured.prefetch import MaskPrefetcher

__all__ = ["Sampler", "SamplingState", "SAMPLE_FAILED", "MAX_ERROR_CHARS", "TokenLogprobs", "token_logprobs",
           "apply_penalties_", "sample_rows", "filter_candidates", "draw"]
"""The sampler's public names, importable from here wherever they live (`constraints`, `logprobs`,
`penalties`, `sampling_ops`). Settings such as `sampling_ops.PROBE_WIDTH` are
read where they live: set them there."""

SAMPLE_FAILED = -1
"""The token id `Sampler.__call__` returns for a row that could not be sampled (see `take_error`)."""
log = logging.getLogger(__name__)


class Sampler:
    # [ZH-START]
    # 【职责】整批采样，每行用自己请求的参数（seq.params）和状态（seq.sampling）；
    # logprobs 和失败原因记回各行自己的状态，由引擎取走。
    # 【边界】不保存任何每请求的东西（没有按 id 的表）；不算 logits（ModelRunner / LM head）；
    # 不判定请求结束（EOS、max_tokens、SAMPLE_FAILED 都由 Scheduler 处理）；不管 stop string
    # （detokenizer 的事）；不抛异常结束整批，失败只落在单行上。
    # 【协作者】LLMEngine.step 在前向前调 prepare(seqs)、前向后调 __call__(logits, seqs)；状态由
    # SamplingState.build 建（LLMEngine.add_request）；整批算子在旁边的模块：
    # apply_penalties_（penalties）、constrain_rows（constraints）、
    # sample_rows / filter_candidates / draw（sampling_ops）、token_logprobs（logprobs）。
    # [ZH-END]
    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0, mask_threads: int | None = None,
                 cpu_ops: CpuOps | None = None):
        """`mask_threads`: threads that fill a step's grammar masks; by default the engine's CPU
        threads (`torch.get_num_threads()`, which the model runner sets from the config).
        `cpu_ops`: the compiled `CpuOps` on CPU (the model runner loads them)."""
        self.vocab_size = vocab_size
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        """Shared by requests without a seed."""
        threads = mask_threads or min(torch.get_num_threads(), len(os.sched_getaffinity(0)))
        self.masks = MaskPrefetcher(threads=max(1, threads))
        """Grammar masks computed while the forward runs (`prepare`); `masks.enabled = False` turns it off."""
        self.cpu_ops = cpu_ops
        """The compiled `CpuOps` on CPU: its kernels draw unfiltered rows and apply grammar-only
        rows' packed masks."""

    # -- one step ------------------------------------------------------------------------------

    def prepare(self, seqs: list[Sequence]) -> None:
        """Start computing the grammar masks of `seqs`, the rows the coming `__call__` samples;
        the model runner calls it just before the forward, which the computation then overlaps."""
        jobs = [(st.grammar, seq.output_token_ids) for seq in seqs
                if (st := seq.sampling) is not None and st.grammar is not None]
        if jobs:
            self.masks.start(jobs)

    @torch.inference_mode()  # the forward's logits are inference tensors, changed here in place
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits (B, V) float32, one row per sequence -> one token id per sequence.

        A row that could not be sampled gets SAMPLE_FAILED, and its state's `error` says why.
        """
        # [ZH-START]
        # 0. 先 masks.wait()：等 prepare 在前向期间启动的语法掩码算完。
        # 1. 取每行自己的 SamplingState（seq.sampling）；没有状态的行（没经引擎 add_request）
        #    直接 ValueError，不临时造一个。
        # 2. 整批都是 plain_greedy（greedy 且无惩罚、processor、logprobs、bias、
        #    min_tokens）→ _greedy 快路径：不复制、不算 softmax、不取随机数。
        # 3. logits.float()（compute_logits 已是 float32，此处不复制，下面原地修改）。
        # 4. 要 logprobs 的行先算 raw_logprobs = log_softmax，形状 (R, V)——
        #    取的是惩罚和约束之前的原始分布。
        # 5. _penalize：有惩罚的行 apply_penalties_(这些行, prompt+输出 ids, 输出 ids,
        #    各行的三个系数, counts=有没有 presence / frequency)；行号用 upload 上传后 index_select
        #    取子集，算完 index_copy_ 写回（sample_on_device 也用它）。
        # 6. constrain_rows（constraints 模块）：只有语法约束的行整批一次屏蔽（CPU 上由
        #    cpu_ops.mask_bits 直接套打包的掩码），其余逐行
        #    bias、min_tokens 屏蔽、processors；
        #    出错或留下非有限值的行记进 failed {行号: 原因}。
        # 7. 有失败行：tokens 先全填 SAMPLE_FAILED，只把好的行交给 _choose，失败行不参与抽样、
        #    不干扰别人；否则整批 _choose。
        # 8. _check_ids：抽到的 id 不在 [0, vocab_size)（logits 比词表宽时可能发生）的行也算失败。
        # 9. 没失败的行把 logprobs 记进各自的 SamplingState。
        # 10. _report：转成 list，失败行改成 SAMPLE_FAILED 并记下 state.error、打 warning。
        # [ZH-END]
        self.masks.wait()  # the grammar masks `prepare` started, before any row is read
        states = [s.sampling for s in seqs]
        if None in states:  # only the engine makes rows to sample, and it gives each its state
            missing = seqs[states.index(None)].request_id
            raise ValueError(f"request {missing!r} has no sampling state: add requests through LLMEngine.add_request")
        if all(st.plain_greedy for st in states):
            return self._greedy(logits, seqs)  # no copies, no softmax, no random numbers
        logits = logits.float()
        failed: dict[int, str] = {}
        wants_logprobs = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        raw_logprobs = torch.log_softmax(_rows(logits, wants_logprobs), dim=-1) if wants_logprobs else None  # (R, V)
        self._penalize(logits, seqs)
        constrain_rows(logits, seqs, failed, self.cpu_ops)
        if failed:  # sampled without the failed rows, so they cannot disturb the others
            good = [i for i in range(len(states)) if i not in failed]
            tokens = torch.full((len(states),), SAMPLE_FAILED, dtype=torch.long, device=logits.device)  # (B,)
            if good:
                tokens[good] = self._choose(logits[good], [seqs[i] for i in good])
        else:
            tokens = self._choose(logits, seqs)
        self._check_ids(tokens, failed)
        if raw_logprobs is not None:
            self._record_logprobs(raw_logprobs, wants_logprobs, tokens, seqs, failed)
        return self._report(tokens, seqs, failed)

    @torch.inference_mode()
    def sample_on_device(self, logits: torch.Tensor, seqs: list[Sequence],
                         previous: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """logits (B, V) of rows sampled on the device (`SamplingState.on_device`: penalties,
        logit_bias, temperature and filters; no processors, logprobs or min_tokens) -> (B,) token
        ids on the device, SAMPLE_FAILED where a row cannot be sampled (non-finite logits, an id
        outside the vocabulary), and (B,) each row's largest logit after penalties and bias (NaN,
        +inf or -inf where that is what failed it), from which `record_failure` says why once the
        host reads them: the logits need not be kept. `previous`:
        the step before's tokens still on the device, which the penalties' token lists end with
        stand-ins for. Nothing here waits for the device: the overlapped step reads the tokens
        back one step later.

        Each row gets what `__call__` would give it (the same penalties, bias and `_choose`,
        without the top-p probe): the same tokens for greedy and seeded rows, and the same draws
        from the shared generator."""
        # [ZH-START]
        # 重叠调度用的采样：整批都是 on_device 的行（惩罚、logit_bias、温度、
        # top_k / top_p / min_p），全程不从设备读回任何值。
        # 1. 都是 plain_greedy：argmax，取出选中的值 best（argmax 和 amax
        #    一样先取 NaN、再取 +inf）。
        # 2. 否则转 float32：_penalize（token 列表末尾的占位 token 用 previous 在设备上换成真
        #    token）；有 bias 的行 apply_constraints（对这些行只做 index_add_ 加 bias）；
        #    每行最大值 best；_choose(probe=False) 按 __call__ 的分组抽样
        #    （不探测，直接整词表排序），所以 greedy 和有种子的行两条路径结果相同。
        # 3. best 非有限的行和越界 id 用 torch.where 换成 SAMPLE_FAILED；返回设备上的 tokens 和
        #    best，都是 (B,)：best 本身就说明失败原因（NaN / +inf / -inf），logits 不必留着。
        # [ZH-END]
        if all(s.sampling.plain_greedy for s in seqs):
            tokens = logits.argmax(dim=-1)  # (B,); argmax, like amax, takes NaN first, then +inf
            best = logits.gather(1, tokens.unsqueeze(1)).squeeze(1)
        else:
            logits = logits.float()
            self._penalize(logits, seqs, previous)
            for i, seq in enumerate(seqs):
                if seq.sampling.bias_ids is not None:
                    apply_constraints(logits, i, seq)  # the bias alone: such rows have no processors
            best = logits.amax(dim=-1)  # (B,)
            tokens = self._choose(logits, seqs, probe=False)
        bad = ~torch.isfinite(best) | (tokens < 0) | (tokens >= self.vocab_size)
        return torch.where(bad, SAMPLE_FAILED, tokens), best

    def _penalize(self, logits: torch.Tensor, seqs: list[Sequence], previous: torch.Tensor | None = None) -> None:
        """Apply the penalties of the rows that have them, in place (`penalties.apply_penalties_`)."""
        penalized = [i for i, s in enumerate(seqs) if s.params.has_penalties]
        if not penalized:
            return
        params = [seqs[i].params for i in penalized]
        index, rows = _select(logits, penalized)
        rows = apply_penalties_(rows, [seqs[i].token_ids for i in penalized],
                                [seqs[i].output_token_ids for i in penalized], *penalty_tensors(params, logits.device),
                                counts=any(p.presence_penalty or p.frequency_penalty for p in params),
                                previous=previous)
        if index is not None:
            logits.index_copy_(0, index, rows)

    def record_failure(self, seq: Sequence, best: float) -> None:
        """`sample_on_device` gave SAMPLE_FAILED for `seq`, whose row's largest logit is `best`: say
        why in its state (as `__call__` does for the rows it fails)."""
        if not math.isfinite(best):
            error = "the model's " + non_finite_best(best)
        else:
            error = f"the sampled token id is outside the vocabulary [0, {self.vocab_size})"
        _fail(seq, error)

    @staticmethod
    def _record_logprobs(raw_logprobs: torch.Tensor, rows: list[int], tokens: torch.Tensor,
                         seqs: list[Sequence], failed: dict[int, str]) -> None:
        """raw_logprobs (R, V) are the log-softmax of `rows`; each row that did not fail gets its entry."""
        keep = [j for j, i in enumerate(rows) if i not in failed]
        if len(keep) < len(rows):
            raw_logprobs, rows = raw_logprobs[keep], [rows[j] for j in keep]
        if rows:
            for i, lp in zip(rows, token_logprobs(raw_logprobs, tokens[rows], [seqs[i].params.logprobs for i in rows])):
                seqs[i].sampling.logprobs.append(lp)

    def _greedy(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        # [ZH-START]
        # 1. tokens = argmax(logits, dim=-1)，形状 (B,)。
        # 2. chosen = 每行被选中的那个值 (B,)：行里有 NaN 或 +inf 时 argmax 会落在它上面，
        #    全是 -inf 时才落在 -inf 上，所以只检查这 B 个值就能发现坏行，不必扫 (B, V)。
        # 3. 有限且 < vocab_size 的保留，否则换成 SAMPLE_FAILED，tolist()——整步只有这一次设备同步。
        # 4. 没有失败直接返回。
        # 5. 有失败（少见）：对非有限行用 non_finite 写原因，
        #    再 _check_ids 标出越界 id，最后 _report。
        # [ZH-END]
        tokens = logits.argmax(dim=-1)  # (B,)
        # argmax lands on a NaN or +inf when its row has one, and on -inf only when the row holds
        # nothing else: the B chosen values tell whether any row is non-finite.
        chosen = logits.gather(1, tokens.unsqueeze(1)).squeeze(1)  # (B,)
        ids = torch.where(torch.isfinite(chosen) & (tokens < self.vocab_size), tokens, SAMPLE_FAILED).tolist()
        if SAMPLE_FAILED not in ids:  # one device sync, as before the check
            return ids
        failed = {i: "the model's " + non_finite(logits[i]) for i in (~torch.isfinite(chosen)).nonzero().flatten().tolist()}
        self._check_ids(tokens, failed)
        return self._report(tokens, seqs, failed)

    def _check_ids(self, tokens: torch.Tensor, failed: dict[int, str]) -> None:
        """Fail the rows whose token is outside [0, vocab_size) (logits wider than the vocabulary)."""
        outside = (tokens < 0) | (tokens >= self.vocab_size)  # (B,)
        if bool(outside.any()):
            for i in outside.nonzero().flatten().tolist():
                failed.setdefault(i, f"sampled token id {int(tokens[i])} is outside the vocabulary [0, {self.vocab_size})")

    @staticmethod
    def _report(tokens: torch.Tensor, seqs: list[Sequence], failed: dict[int, str]) -> list[int]:
        ids = tokens.tolist()
        for i, error in failed.items():
            ids[i] = SAMPLE_FAILED
            _fail(seqs[i], error)
        return ids

    def _choose(self, logits: torch.Tensor, seqs: list[Sequence], probe: bool = True) -> torch.Tensor:
        """One token per row (B,) by each row's temperature and filters; nothing here waits for
        the device unless `probe` (`filter_candidates`)."""
        # [ZH-START]
        # 1. 按参数把行分三组：greedy（is_greedy）、filtered（0 < top_k < V、
        #    top_p < 1 或 min_p > 0）、plain（只有温度）。
        # 2. 每组由 _select 取出自己的行：就是整批时不复制，直接算出 tokens；否则用上传的行号
        #    index_select 取出、算完 index_copy_ 写回 tokens = empty (B,)（不用 Python 列表做下标：
        #    CUDA 上那是一次要等设备的拷贝）。
        # 3. greedy 组 argmax；plain 和 filtered 各调一次 sample_rows（带各行的 Generator、
        #    共享 Generator、cpu_ops 和 probe）：分开是为了不让只有温度的行陪着做整词表排序；
        #    CPU 上 plain 组由 cpu_ops 的编译抽样（cpu_sample.c）完成。
        # [ZH-END]
        vocab, batch = logits.shape[1], len(seqs)
        # Sampled rows go in two batches, with and without top-k/top-p/min-p, so plain-temperature
        # rows do not force a sort of the whole vocabulary on the filtered ones.
        greedy, plain, filtered = [], [], []
        for i, s in enumerate(seqs):
            (greedy if s.params.is_greedy else filtered if has_filters(s.params, vocab) else plain).append(i)
        tokens = None
        for group in (greedy, plain, filtered):
            if not group:
                continue
            index, rows = _select(logits, group)
            if group is greedy:
                chosen = rows.argmax(dim=-1)
            else:
                chosen = sample_rows(rows, [seqs[i].params for i in group], [seqs[i].sampling.generator for i in group],
                                     self.generator, self.cpu_ops, probe)
            if index is None:
                return chosen
            if tokens is None:
                tokens = torch.empty(batch, dtype=torch.long, device=logits.device)  # (B,)
            tokens.index_copy_(0, index, chosen)
        return tokens


def _fail(seq: Sequence, error: str) -> None:
    """`seq`'s row could not be sampled: why, in its state for the engine to report, and in the log."""
    seq.sampling.error = error
    log.warning("request %s cannot be sampled: %s", seq.request_id, error)


def _select(t: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(index, t's `rows`) for increasing `rows`: t itself and no index when they are all of t (the
    common case), else a copy by an index uploaded without a wait (`index_copy_` puts rows back)."""
    if len(rows) == len(t):
        return None, t
    index = upload(rows, torch.long, t.device)
    return index, t.index_select(0, index)


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t's increasing `rows` (`_select` without the index)."""
    return _select(t, rows)[1]
