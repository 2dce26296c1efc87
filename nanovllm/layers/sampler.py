"""Token sampling for a whole batch at once, each row with its own parameters.

The model runner hands over the last-position logits (B, V) of every sequence that samples this
step. Per step, in this order:

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
drawn is outside the vocabulary, the row's token is SAMPLE_FAILED and the reason is kept for
`take_error`. The engine finishes that request with reason "error"; the other rows are sampled
as they would be without it. Finding such rows costs the greedy fast path a read of B chosen
values, and the general path one max over the (B, V) logits.

Draws are by inverse CDF, one uniform number per row. Unseeded rows share the sampler's
generator; a seeded request takes its number from its own generator, and everything else its
draw depends on is computed row by row (neighbours only pad the candidate width with -inf), so
its tokens do not depend on which other requests share the batch. If a request's constraints
leave no token at all, its row is sampled with its response_format's grammar alone (the grammar
wins over banned words, logit_bias, allowed ids and custom processors), or without any if it has
none (with a warning), rather than from an empty set. Grammar masks are computed while the
forward runs: the model runner calls `prepare` with the rows to sample before it (see
`nanovllm.structured.prefetch`).
"""
# [ZH-START]
# 【模块定位】引擎一步的最后一段：把 LM head 的 logits 变成下一个 token。
#   scheduler → step_input → model runner → 解码层 / PagedAttention → compute_logits (B, V)
#     →【Sampler】→ list[int]（每条序列一个 token id）→ Scheduler.postprocess → 反分词进程
#     → 客户端
# 只在 rank 0 运行。每一步的顺序：原始分布的 logprobs → 惩罚项（repetition / presence / frequency）
# → 每请求的约束（logit_bias、min_tokens 前屏蔽 EOS / stop token、logits processors）
# → greedy 取 argmax，其余按温度缩放、top_k / top_p / min_p 过滤，再用逆 CDF 抽样。
# 全是整批张量运算，Python 循环只遍历"有约束或有种子"的请求；全是普通 greedy 的批只是一次 argmax。
# 某一行采样失败只结束该请求（返回 SAMPLE_FAILED = -1，原因留给 take_error），不影响同批其他行。
# [ZH-END]
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence as Seq

import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.layers.logits_processors import LogitsProcessor
from nanovllm.sampling_params import SamplingParams
from nanovllm.structured import StructuredOutput
from nanovllm.structured.prefetch import MaskPrefetcher

_NEG_INF = float("-inf")
SAMPLE_FAILED = -1
"""The token id `Sampler.__call__` returns for a row that could not be sampled (see `take_error`)."""
MAX_ERROR_CHARS = 500
"""Longest error text kept for a request: a processor's exception message may be anything."""
log = logging.getLogger(__name__)


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities of one generated token under the raw model distribution."""
    # [ZH-START]
    # 【职责】一个已生成 token 在原始模型分布（惩罚、约束、温度之前）
    # 下的 logprob、排名和前几名候选。
    # 【边界】纯数据，不参与采样决策。
    # 【协作者】token_logprobs() 生成，存进 RequestState.logprobs，LLMEngine 经 take_logprobs
    # 取走放进 RequestOutput。
    # [ZH-END]
    token_id: int
    logprob: float
    rank: int
    """1 for the most likely token."""
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class RequestState:
    """What the sampler keeps per request between steps."""
    # [ZH-START]
    # 【职责】采样器为每个请求跨步保存的东西：SamplingParams、logits processors、预先建好的张量
    # （min_tokens 期间要屏蔽的 id、logit_bias 的 id 与值）、有种子时自己的 Generator、
    # 尚未上报的 logprobs、以及采样失败的原因。
    # 【边界】不保存 token 序列（在 Sequence 里），不管请求何时开始结束（LLMEngine
    # 调 add / remove）。
    # 【协作者】Sampler._new_state 创建；plain_greedy 决定整批能否走 greedy 快路径。
    # [ZH-END]
    params: SamplingParams
    processors: list[LogitsProcessor]
    min_tokens_blocked: torch.Tensor | None
    """EOS (unless ignore_eos) and stop token ids, masked while the output is shorter than min_tokens."""
    bias_ids: torch.Tensor | None
    bias_values: torch.Tensor | None
    generator: torch.Generator | None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    """Computed but not yet reported by the engine."""
    error: str | None = None
    """Why the request's row could not be sampled, once it could not."""
    grammar: StructuredOutput | None = None
    """The request's response_format (one of `processors`): it wins where constraints conflict."""

    @property
    def plain_greedy(self) -> bool:
        p = self.params
        return p.is_greedy and not (p.has_penalties or self.processors or p.logprobs is not None
                                    or self.bias_ids is not None or p.min_tokens)


class Sampler:
    # [ZH-START]
    # 【职责】整批采样，每行用自己请求的参数；管理每请求状态（add_request / remove_request），
    # 暂存 logprobs 和失败原因供引擎取走（take_logprobs / take_error）。
    # 【边界】不算 logits（ModelRunner / LM head）；不判定请求结束（EOS、max_tokens、
    # SAMPLE_FAILED 都由 Scheduler 处理）；不管 stop string（反分词进程的事）；
    # 不抛异常结束整批，失败只落在单行上。
    # 【协作者】ModelRunner.run 调 __call__(logits, seqs)；LLMEngine.add_request 传入由
    # build_logits_processors 建好的 processors；
    # sample_rows / apply_penalties_ / filter_candidates / draw 是它的整批算子。
    # [ZH-END]
    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0):
        self.vocab_size = vocab_size
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        """Shared by requests without a seed."""
        self.states: dict[str, RequestState] = {}
        self.masks = MaskPrefetcher()
        """Grammar masks computed while the forward runs (`prepare`); `masks.enabled = False` turns it off."""
        self.num_grammars = 0
        """Requests with a response_format: with none, `prepare` costs one comparison."""

    # -- per-request state ---------------------------------------------------------------------

    def add_request(self, request_id: str, params: SamplingParams, processors: list[LogitsProcessor] | None = None,
                    eos_token_ids: Seq[int] = (), num_output_tokens: int = 0) -> None:
        """`num_output_tokens`: output the request already has (continued after an engine died).
        A seeded request's generator is advanced past the numbers those tokens drew (one each,
        see `sample_rows`), so it draws the numbers it would have drawn."""
        state = self.states[request_id] = self._new_state(params, processors or [], eos_token_ids)
        self.num_grammars += state.grammar is not None
        if state.generator is not None:
            for _ in range(num_output_tokens):
                torch.rand(1, dtype=torch.float64, device=self.device, generator=state.generator)

    def remove_request(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is not None and state.grammar is not None:
            self.num_grammars -= 1

    def take_logprobs(self, request_id: str) -> list[TokenLogprobs] | None:
        """Logprobs computed since the last call, or None if the request did not ask for them."""
        state = self.states.get(request_id)
        if state is None or state.params.logprobs is None:
            return None
        out, state.logprobs = state.logprobs, []
        return out

    def take_error(self, request_id: str) -> str | None:
        """Why the request's last row came back as SAMPLE_FAILED, or None if it did not."""
        state = self.states.get(request_id)
        if state is None:
            return None
        out, state.error = state.error, None
        return out

    def _new_state(self, params: SamplingParams, processors: list[LogitsProcessor], eos_token_ids: Seq[int]) -> RequestState:
        # [ZH-START]
        # 1. blocked = stop_token_ids + （除非 ignore_eos）模型的 EOS id 列表。
        # 2. logit_bias 里有 id >= vocab_size 就抛 ValueError（add_request 时就拒绝，不等到采样）。
        # 3. 非 greedy 且给了 seed：建一个只属于这个请求的 Generator(seed)。
        # 4. 组装 RequestState：只有 min_tokens > 0 时才建 min_tokens_blocked 张量；
        #    有 bias 才建 bias_ids / bias_values，都放在采样器的设备上，
        #    之后每步直接 index_fill_ / index_add_；processors 里的 StructuredOutput 另记为
        #    grammar（约束冲突时语法优先）。
        # [ZH-END]
        dev = self.device
        blocked = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))
        bias = [(t, b) for t, b in params.logit_bias.items() if t < self.vocab_size]
        if len(bias) < len(params.logit_bias):
            raise ValueError(f"logit_bias has a token id outside the vocabulary [0, {self.vocab_size})")
        generator = None
        if params.seed is not None and not params.is_greedy:
            generator = torch.Generator(device=dev).manual_seed(params.seed)
        return RequestState(
            params, processors,
            torch.tensor([t for t in blocked if t < self.vocab_size], dtype=torch.long, device=dev) if params.min_tokens else None,
            torch.tensor([t for t, _ in bias], dtype=torch.long, device=dev) if bias else None,
            torch.tensor([b for _, b in bias], dtype=torch.float32, device=dev) if bias else None,
            generator, grammar=next((p for p in processors if isinstance(p, StructuredOutput)), None),
        )

    def _state(self, seq: Sequence) -> RequestState:
        state = self.states.get(seq.request_id)
        if state is None:  # not added through the engine (a direct runner call): its params alone
            state = self.states[seq.request_id] = self._new_state(seq.params, [], ())
        return state

    # -- one step ------------------------------------------------------------------------------

    def prepare(self, seqs: list[Sequence]) -> None:
        """Start computing the grammar masks of `seqs`, the rows the coming `__call__` samples;
        the model runner calls it just before the forward, which the computation then overlaps."""
        if not self.num_grammars:
            return
        jobs = [(st.grammar, seq.output_token_ids) for seq in seqs
                if (st := self.states.get(seq.request_id)) is not None and st.grammar is not None]
        self.masks.start(jobs)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits (B, V) float32, one row per sequence -> one token id per sequence.

        A row that could not be sampled gets SAMPLE_FAILED, and `take_error` says why.
        """
        # [ZH-START]
        # 0. 先 masks.wait()：等 prepare 在前向期间启动的语法掩码算完。
        # 1. 为每条序列取 RequestState（直接调用 runner、没经引擎 add 的序列用它自己的
        #    params 临时建一份）。
        # 2. 整批都是 plain_greedy（greedy 且无惩罚、processor、logprobs、bias、
        #    min_tokens）→ _greedy 快路径：不复制、不算 softmax、不取随机数。
        # 3. logits.float()（compute_logits 已是 float32，此处不复制，下面原地修改）。
        # 4. 要 logprobs 的行先算 raw_logprobs = log_softmax，形状 (R, V)——
        #    取的是惩罚和约束之前的原始分布。
        # 5. 有惩罚的行：apply_penalties_(这些行, prompt+输出 ids, 输出 ids, 各行的三个系数)；
        #    若取的是子集副本就写回 logits。
        # 6. _constrain：bias、min_tokens 屏蔽、processors；出错或留下非有限值的行记进
        #    failed {行号: 原因}。
        # 7. 有失败行：tokens 先全填 SAMPLE_FAILED，只把好的行交给 _choose，失败行不参与抽样、
        #    不干扰别人；否则整批 _choose。
        # 8. _check_ids：抽到的 id 不在 [0, vocab_size)（logits 比词表宽时可能发生）的行也算失败。
        # 9. 没失败的行把 logprobs 记进各自的 state。
        # 10. _report：转成 list，失败行改成 SAMPLE_FAILED 并记下 state.error、打 warning。
        # [ZH-END]
        self.masks.wait()  # the grammar masks `prepare` started, before any row is read
        states = [self._state(s) for s in seqs]
        if all(st.plain_greedy for st in states):
            return self._greedy(logits, seqs, states)  # no copies, no softmax, no random numbers
        logits = logits.float()
        failed: dict[int, str] = {}
        wants_logprobs = [i for i, st in enumerate(states) if st.params.logprobs is not None]
        raw_logprobs = torch.log_softmax(_rows(logits, wants_logprobs), dim=-1) if wants_logprobs else None  # (R, V)
        penalized = [i for i, st in enumerate(states) if st.params.has_penalties]
        if penalized:
            rows = apply_penalties_(_rows(logits, penalized), [seqs[i].token_ids for i in penalized],
                                    [seqs[i].output_token_ids for i in penalized],
                                    *_penalty_tensors([states[i].params for i in penalized], logits.device))
            if rows is not logits:
                logits[penalized] = rows
        self._constrain(logits, seqs, states, failed)
        if failed:  # sampled without the failed rows, so they cannot disturb the others
            good = [i for i in range(len(states)) if i not in failed]
            tokens = torch.full((len(states),), SAMPLE_FAILED, dtype=torch.long, device=logits.device)  # (B,)
            if good:
                tokens[good] = self._choose(logits[good], [states[i] for i in good])
        else:
            tokens = self._choose(logits, states)
        self._check_ids(tokens, failed)
        if raw_logprobs is not None:
            self._record_logprobs(raw_logprobs, wants_logprobs, tokens, states, failed)
        return self._report(tokens, seqs, states, failed)

    @staticmethod
    def _record_logprobs(raw_logprobs: torch.Tensor, rows: list[int], tokens: torch.Tensor, states: list[RequestState],
                         failed: dict[int, str]) -> None:
        """raw_logprobs (R, V) are the log-softmax of `rows`; each row that did not fail gets its entry."""
        keep = [j for j, i in enumerate(rows) if i not in failed]
        if len(keep) < len(rows):
            raw_logprobs, rows = raw_logprobs[keep], [rows[j] for j in keep]
        if rows:
            for i, lp in zip(rows, token_logprobs(raw_logprobs, tokens[rows], [states[i].params.logprobs for i in rows])):
                states[i].logprobs.append(lp)

    def _greedy(self, logits: torch.Tensor, seqs: list[Sequence], states: list[RequestState]) -> list[int]:
        # [ZH-START]
        # 1. tokens = argmax(logits, dim=-1)，形状 (B,)。
        # 2. chosen = 每行被选中的那个值 (B,)：行里有 NaN 或 +inf 时 argmax 会落在它上面，
        #    全是 -inf 时才落在 -inf 上，所以只检查这 B 个值就能发现坏行，不必扫 (B, V)。
        # 3. 有限且 < vocab_size 的保留，否则换成 SAMPLE_FAILED，tolist()——整步只有这一次设备同步。
        # 4. 没有失败直接返回。
        # 5. 有失败（少见）：对非有限行用 _non_finite 写原因，
        #    再 _check_ids 标出越界 id，最后 _report。
        # [ZH-END]
        tokens = logits.argmax(dim=-1)  # (B,)
        # argmax lands on a NaN or +inf when its row has one, and on -inf only when the row holds
        # nothing else: the B chosen values tell whether any row is non-finite.
        chosen = logits.gather(1, tokens.unsqueeze(1)).squeeze(1)  # (B,)
        ids = torch.where(torch.isfinite(chosen) & (tokens < self.vocab_size), tokens, SAMPLE_FAILED).tolist()
        if SAMPLE_FAILED not in ids:  # one device sync, as before the check
            return ids
        failed = {i: "the model's " + _non_finite(logits[i]) for i in (~torch.isfinite(chosen)).nonzero().flatten().tolist()}
        self._check_ids(tokens, failed)
        return self._report(tokens, seqs, states, failed)

    def _check_ids(self, tokens: torch.Tensor, failed: dict[int, str]) -> None:
        """Fail the rows whose token is outside [0, vocab_size) (logits wider than the vocabulary)."""
        outside = (tokens < 0) | (tokens >= self.vocab_size)  # (B,)
        if bool(outside.any()):
            for i in outside.nonzero().flatten().tolist():
                failed.setdefault(i, f"sampled token id {int(tokens[i])} is outside the vocabulary [0, {self.vocab_size})")

    @staticmethod
    def _report(tokens: torch.Tensor, seqs: list[Sequence], states: list[RequestState], failed: dict[int, str]) -> list[int]:
        ids = tokens.tolist()
        for i, error in failed.items():
            ids[i] = SAMPLE_FAILED
            states[i].error = error
            log.warning("request %s cannot be sampled: %s", seqs[i].request_id, error)
        return ids

    def _constrain(self, logits: torch.Tensor, seqs: list[Sequence], states: list[RequestState],
                   failed: dict[int, str]) -> None:
        """Apply each row's constraints; rows that fail them, or are left non-finite, go into `failed`."""
        # [ZH-START]
        # 1. maskable = 有 processors，或 min_tokens 仍生效（输出数 < min_tokens）的行：
        #    只有它们可能把整行屏蔽光。
        # 2. 先复制这些行 before (C, V)，以便撤销"什么都不剩"的屏蔽。
        # 3. 逐行 _apply_constraints；返回错误文本的行记进 failed。
        # 4. best = 每行 amax (B,)：NaN 表示有 NaN，+inf 表示有 +inf，-inf 表示一个 token 都不剩。
        # 5. maskable 中未失败、best 为 -inf 的行：打 warning，从 before 恢复原行；
        #    有 response_format 的行再只套语法掩码（语法优先：输出必须能解析），
        #    其余这一步不带约束采样；重算 best。
        # 6. best 仍非有限的行记为失败（setdefault：processor 的报错优先），
        #    原因加上 "after penalties and constraints"。
        # [ZH-END]
        maskable = [i for i, (seq, st) in enumerate(zip(seqs, states))
                    if st.processors or (st.min_tokens_blocked is not None and seq.num_output_tokens < st.params.min_tokens)]
        before = logits[maskable] if maskable else None  # (C, V) copy, to undo masks that leave nothing
        for i, (seq, st) in enumerate(zip(seqs, states)):
            error = self._apply_constraints(logits, i, seq, st)
            if error is not None:
                failed[i] = error
        best = logits.amax(dim=-1)  # (B,): NaN if the row has one, +inf if it has one, -inf if nothing is left
        if maskable:
            empty = [j for j in (best[maskable] == _NEG_INF).nonzero().flatten().tolist() if maskable[j] not in failed]
            if empty:
                rows = [maskable[j] for j in empty]
                log.warning("constraints of %s allow no token; sampling those rows with their response_format "
                            "alone, or unconstrained", [seqs[i].request_id for i in rows])
                logits[rows] = before[empty]
                for i in rows:  # the grammar wins: the output must stay parseable
                    if states[i].grammar is not None:
                        states[i].grammar(seqs[i].output_token_ids, logits[i])
                best[rows] = logits[rows].amax(dim=-1)
        bad = ~torch.isfinite(best)
        if bool(bad.any()):
            for i in bad.nonzero().flatten().tolist():
                failed.setdefault(i, _non_finite(logits[i]) + " after penalties and constraints")

    @staticmethod
    def _apply_constraints(logits: torch.Tensor, i: int, seq: Sequence, st: RequestState) -> str | None:
        """Constrain row i in place; the error text if one of the request's processors failed."""
        # [ZH-START]
        # 1. 有 bias：logits[i].index_add_(bias_ids, bias_values)。
        # 2. 输出数 < min_tokens：把 min_tokens_blocked（stop token 和 EOS）填成 -inf。
        # 3. 依次调用 processors(output_token_ids, row)，row 是 logits[i] 的视图；
        #    返回了别的张量就 copy_ 回 row。
        # 4. processor 抛异常 → 返回 "logits processor <类名> raised <异常>"（最长 500 字符），
        #    由调用方把该行记为失败。
        # 5. 一切正常返回 None。
        # [ZH-END]
        if st.bias_ids is not None:
            logits[i].index_add_(0, st.bias_ids, st.bias_values)
        if st.min_tokens_blocked is not None and seq.num_output_tokens < st.params.min_tokens:
            logits[i].index_fill_(0, st.min_tokens_blocked, _NEG_INF)
        if st.processors:
            output = seq.output_token_ids
            row = logits[i]
            for processor in st.processors:
                try:
                    result = processor(output, row)
                    if result is not None and result is not row:
                        row.copy_(result)
                except Exception as e:  # custom processors run in-process: theirs is the request's failure
                    return f"logits processor {type(processor).__name__} raised {_exception_text(e)}"
        return None

    def _choose(self, logits: torch.Tensor, states: list[RequestState]) -> torch.Tensor:
        # [ZH-START]
        # 1. tokens = empty (B,)。
        # 2. 按参数把行分三组：greedy（is_greedy）、filtered（0 < top_k < V、
        #    top_p < 1 或 min_p > 0）、plain（只有温度）。
        # 3. greedy 组直接 argmax。
        # 4. plain 和 filtered 各调一次 sample_rows（带各行的 Generator 和共享 Generator）：
        #    分开是为了不让只有温度的行陪着做整词表排序。
        # [ZH-END]
        tokens = torch.empty(len(states), dtype=torch.long, device=logits.device)  # (B,)
        vocab = logits.shape[1]
        # Sampled rows go in two batches, with and without top-k/top-p/min-p, so plain-temperature
        # rows do not force a sort of the whole vocabulary on the filtered ones.
        greedy, plain, filtered = [], [], []
        for i, st in enumerate(states):
            (greedy if st.params.is_greedy else filtered if _filters(st.params, vocab) else plain).append(i)
        if greedy:
            tokens[greedy] = _rows(logits, greedy).argmax(dim=-1)
        for rows in (plain, filtered):
            if rows:
                tokens[rows] = sample_rows(_rows(logits, rows), [states[i].params for i in rows],
                                           [states[i].generator for i in rows], self.generator)
        return tokens


def _non_finite(row: torch.Tensor) -> str:
    """What is wrong with a row whose best value is not finite (rare: only failed rows get here)."""
    if bool(row.isnan().any()):
        return "logits hold NaN"
    if bool((row == float("inf")).any()):
        return "logits hold +inf"
    return "logits allow no token (all are -inf)"


def _exception_text(e: Exception) -> str:
    try:
        text = f"{type(e).__name__}: {e}"
    except Exception:  # its __str__ failed too
        text = type(e).__name__
    return text[:MAX_ERROR_CHARS]


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows], without the copy when rows are all of t in order (the common case)."""
    return t if len(rows) == len(t) and rows[-1] == len(t) - 1 else t[rows]


def _filters(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab or p.top_p < 1 or p.min_p > 0


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                shared: torch.Generator) -> torch.Tensor:
    """Draw one token per row of logits (R, V) with each row's temperature and filters -> (R,).

    Each row takes one uniform number: from its own generator if it has one, else from `shared`.
    """
    # [ZH-START]
    # 1. 温度先转 float64，clamp 到 dtype 的 [tiny, max]，再转回 logits 的 dtype：
    #    1e-40 这种会变成 0 的温度不会除出 inf / NaN。
    # 2. scaled = (logits - 行最大值) / 温度，形状 (R, V)：最优 token 变成 0，极小温度把其余推向
    #    -inf，等价于 greedy。
    # 3. 任何一行有过滤：top_k 为 0 或 >= V 的行按 V 处理，filter_candidates 得到候选 (R, W) 和对应
    #    token id；否则候选就是 scaled，ids 为 None。
    # 4. uniform (R,) float64 从共享 Generator 取；有种子的行再用自己的 Generator 取一个数覆盖，
    #    所以它的结果不受同批其他请求影响。
    # 5. choice = draw(candidates, uniform)；有过滤时经 ids.gather 映射回真实 token id，返回 (R,)。
    # [ZH-END]
    vocab = logits.shape[1]
    finfo = torch.finfo(logits.dtype)
    # Clamped to the dtype's normal range: a temperature that rounds to 0 (1e-40 in float32) or
    # to inf would divide into inf or NaN. Each row's best logit is moved to 0 first, so a tiny
    # temperature sends it to 0 and every other token towards -inf: greedy, never NaN.
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float64, device=logits.device)
    temperature = temperature.clamp_(finfo.tiny, finfo.max).to(logits.dtype)
    scaled = (logits - logits.amax(dim=-1, keepdim=True)).div_(temperature.unsqueeze(1))  # (R, V)
    if any(_filters(p, vocab) for p in params):
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        candidates, ids = filter_candidates(scaled, top_k, [p.top_p for p in params], [p.min_p for p in params])
    else:
        candidates, ids = scaled, None
    uniform = torch.rand(len(params), dtype=torch.float64, device=logits.device, generator=shared)  # (R,)
    for j, g in enumerate(generators):
        if g is not None:
            uniform[j] = torch.rand(1, dtype=torch.float64, device=logits.device, generator=g)
    choice = draw(candidates, uniform)
    return choice if ids is None else ids.gather(1, choice.unsqueeze(1)).squeeze(1)


def _penalty_tensors(params: list[SamplingParams], device: torch.device) -> tuple[torch.Tensor, ...]:
    def col(name: str) -> torch.Tensor:
        return torch.tensor([getattr(p, name) for p in params], dtype=torch.float32, device=device)
    return col("repetition_penalty"), col("presence_penalty"), col("frequency_penalty")


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(map(len, rows)))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


def apply_penalties_(logits: torch.Tensor, token_ids: list[list[int]], output_ids: list[list[int]],
                     repetition: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """Penalize logits (R, V) in place; `token_ids` are each row's prompt + output tokens.

    repetition (HF / vLLM): a token seen in the prompt or output has a positive logit divided by
    the penalty and a negative one multiplied by it. presence / frequency (OpenAI): a token that
    occurs c > 0 times in the output loses `presence + c * frequency`. Work is proportional to
    the tokens seen, not to the vocabulary.
    """
    # [ZH-START]
    # 1. seen (R, L)：每行 prompt + 输出的 id，长度不足用本行第一个 id
    #    补齐（同一值重复写入无影响）。
    # 2. repetition：取出这些位置的值，正的除以惩罚、负的乘以惩罚，scatter_ 回去；
    #    每个出现过的 token 只被惩罚一次，代价与 token 数成正比，与词表大小无关。
    # 3. 没有输出 token，或所有行 presence 和 frequency 都为 0，到此返回。
    # 4. out (R, Lo)：输出 ids 用 V 补齐后排序（补齐值排在最后）；real = out < V；
    #    first = 每组相同 id 中的第一个。
    # 5. weight = -(frequency × real + presence × first)：出现 c 次的 token 共减
    #    presence + c × frequency，补齐位为 0。
    # 6. scatter_add_ 到 out.clamp(max=V - 1)（补齐位加 0，无影响），原地返回 logits。
    # [ZH-END]
    dev = logits.device
    # Pad with each row's own first token: writing its penalized value twice changes nothing.
    seen = torch.tensor([ids + ids[:1] * (max(map(len, token_ids)) - len(ids)) for ids in token_ids], device=dev)  # (R, L)
    values = logits.gather(1, seen)
    rep = repetition.unsqueeze(1)
    logits.scatter_(1, seen, torch.where(values > 0, values / rep, values * rep))
    if not any(output_ids) or not bool(((presence != 0) | (frequency != 0)).any()):
        return logits
    vocab = logits.shape[1]
    out = _padded(output_ids, vocab, dev).sort(dim=-1).values  # (R, Lo); pads (= vocab) sort last
    real = out < vocab
    first = real & torch.cat([torch.ones_like(real[:, :1]), out[:, 1:] != out[:, :-1]], dim=1)  # first of equal ids
    weight = -(frequency.unsqueeze(1) * real + presence.unsqueeze(1) * first)  # 0 on pads
    return logits.scatter_add_(1, out.clamp(max=vocab - 1), weight)


PROBE_WIDTH = 256
"""Tokens tried before a full sort when a row has top_p / min_p but no top_k (a cost choice only)."""


def filter_candidates(logits: torch.Tensor, top_k: list[int], top_p: list[float],
                      min_p: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature-scaled logits (R, V) -> candidate logits and their token ids, both (R, W).

    Candidates are sorted most likely first and W is the largest top_k of the rows. Entries
    outside a row's top_k / top_p / min_p set are -inf. Rows without a top_k first try the
    PROBE_WIDTH most likely tokens: when every such row's set ends inside them, the full sort of
    the vocabulary is skipped (the result is the same; only the cost differs).
    """
    # [ZH-START]
    # 1. W = 各行 top_k 的最大值（没有 top_k 的行记为 V）。
    # 2. 探测：若 W == V、V > 256，且每行的 k 要么 <= 256 要么是 V（没有 top_k），
    #    先只取 topk(256) 调 _filter；每个无 top_k 行的保留集合都在这 256 个内结束，
    #    就直接返回，省掉整词表排序。
    # 3. 否则 W < V 时 topk(W)，W == V 时整词表降序 sort，再 _filter。
    # 4. 返回候选 logits 与 token id，都是 (R, W)，降序排列，被过滤的位置为 -inf。
    # [ZH-END]
    vocab = logits.shape[1]
    width = max(top_k)
    if width == vocab and vocab > PROBE_WIDTH and all(k <= PROBE_WIDTH or k == vocab for k in top_k):
        probed = _filter(logits, *logits.topk(PROBE_WIDTH, dim=-1), top_k, top_p, min_p)
        if probed is not None:
            return probed
    values, ids = logits.topk(width, dim=-1) if width < vocab else logits.sort(dim=-1, descending=True)
    return _filter(logits, values, ids, top_k, top_p, min_p)


def _filter(logits: torch.Tensor, values: torch.Tensor, ids: torch.Tensor, top_k: list[int], top_p: list[float],
            min_p: list[float]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Mask sorted candidates (R, W); None if a row's set may extend past the W candidates."""
    # [ZH-START]
    # 1. 每行第 k 个之后的候选置 -inf（top_k）。
    # 2. norm = 候选的 logsumexp (R, 1)；没有 top_k 的行改用整词表的 logsumexp（候选可能
    #    只是探测的 256 个）。
    #    即 top_p / min_p 都在 top_k 重新归一化后的分布上判断。
    # 3. probs = exp(values - norm)，(R, W)。
    # 4. top_p：某 token 之前的累计概率已 >= top_p 就丢掉；top_p == 1 的行不做此判断（舍入后的
    #    cumsum 可能提前到 1）。
    # 5. min_p：概率 < min_p × 最优 token 概率的丢掉。
    # 6. 第 0 列（最可能的 token）永远保留，哪怕 top_p 小到 1e-50。
    # 7. W < V 时，若某个无 top_k 的行连最后一个候选都保留着，它的集合可能延续到 W 之外 → 返回 None
    #    让调用方整词表排序。
    # 8. 返回 (丢弃位置填 -inf 的 values, ids)。
    # [ZH-END]
    dev, vocab, width = logits.device, logits.shape[1], values.shape[1]
    k = torch.tensor(top_k, device=dev).unsqueeze(1)
    values = values.masked_fill(torch.arange(width, device=dev).unsqueeze(0) >= k, _NEG_INF)
    p = torch.tensor(top_p, device=dev).unsqueeze(1)
    m = torch.tensor(min_p, device=dev).unsqueeze(1)
    # top_p is judged on the top_k-renormalized distribution: normalize over the row's top_k
    # candidates, or over the whole vocabulary when the row has no top_k.
    norm = values.logsumexp(dim=-1, keepdim=True)  # (R, 1)
    if max(top_k) == vocab:
        norm = torch.where(k < vocab, norm, logits.logsumexp(dim=-1, keepdim=True))
    probs = (values - norm).exp()  # (R, W)
    # Keep a token while the mass before it is short of top_p; rows with top_p == 1 skip the
    # test, since a rounded cumsum can reach 1 before the tail. min_p compares with the best.
    drop = ((probs.cumsum(dim=-1) - probs) >= p) & (p < 1)
    drop |= probs < m * probs[:, :1]
    drop[:, 0] = False  # the most likely token always stays, however small top_p (1e-50 rounds to 0)
    if width < vocab and not bool((drop[:, -1] | (k.squeeze(1) < vocab)).all()):
        return None  # a row without top_k keeps the last candidate: its set may go on past W
    return values.masked_fill(drop, _NEG_INF), ids


def draw(logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One index per row of logits (R, W), with probability softmax(row), by inverse CDF -> (R,).

    `uniform` (R,) holds one number in [0, 1) per row: cheaper than noise per token, and a seeded
    generator advances by exactly one number per token whatever the row's width.
    """
    # [ZH-START]
    # 1. weights = exp(logits - 行最大值)，(R, W)，被屏蔽的 -inf 变成 0。
    # 2. cdf = float64 的 cumsum（15 万词表也足够精确）。
    # 3. u = (1 - uniform) × 总和，落在 (0, 总和] 内。
    # 4. searchsorted(cdf, u)：第一个 cdf >= u 的下标，它的权重一定为正；返回 (R,)。
    # 每行只消耗一个随机数：有种子的 Generator 每个 token 恰好前进一步，与候选宽度无关。
    # [ZH-END]
    weights = (logits - logits.max(dim=-1, keepdim=True).values).exp_()  # (R, W); masked -> 0
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)  # float64: exact enough over 150k tokens
    u = (1 - uniform).unsqueeze(1) * cdf[:, -1:]
    # u is in (0, total]: the first index whose cdf reaches u has a positive weight.
    return torch.searchsorted(cdf, u).squeeze(1)


def token_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """logprobs (R, V), chosen (R,) -> per row the chosen token's logprob, rank and top alternatives."""
    # [ZH-START]
    # 1. chosen_lp = 选中 token 的 logprob，(R, 1)。
    # 2. rank = 严格大于它的个数 + 1（1 表示最可能）。
    # 3. n = 各行要的 top 数的最大值；n > 0 时 topk(n)，否则用空张量。
    # 4. 每行组装 TokenLogprobs(token, logprob, rank, 前 k 个 id, 前 k 个 logprob)，
    #    k 是该行自己要的个数。
    # [ZH-END]
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1))  # (R, 1)
    ranks = (logprobs > chosen_lp).sum(dim=-1) + 1
    n = max(num_top)
    top_lp, top_ids = logprobs.topk(n, dim=-1) if n else (logprobs[:, :0], chosen.new_empty(len(chosen), 0))
    rows = zip(chosen.tolist(), chosen_lp.squeeze(1).tolist(), ranks.tolist(), top_ids.tolist(), top_lp.tolist(), num_top)
    return [TokenLogprobs(t, lp, r, ids[:k], lps[:k]) for t, lp, r, ids, lps, k in rows]
