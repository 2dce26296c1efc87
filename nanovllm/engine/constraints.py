"""Per-request constraints on a step's logits rows, applied in place before a token is chosen.

Each row in turn gets its request's logit_bias, its EOS / stop tokens masked while the output is
shorter than `min_tokens`, and its logits processors (allowed ids, banned words, the
response_format's grammar, custom ones). Rows whose only constraint is their grammar (the
common structured-output row) are masked together instead, with no copy kept to undo it (the
grammar alone is what an undo would re-apply): on CPU one compiled call applies the grammars'
packed bits as llguidance fills them (`CpuOps.mask_bits`: 64 rows x 49152 under a JSON schema,
one thread, 0.64 ms against 3.5 ms to unpack them into a (G, V) bool tensor and `masked_fill_`
it, which other devices still do).
A row its constraints leave without any token is
sampled with its grammar alone (the grammar wins: the output must stay parseable), or without
any constraint if it has none; a row whose processor raised, or that holds NaN or +inf, is
reported as failed, never raised: `Sampler` ends that request alone.
"""
# [ZH-START]
# 【模块定位】采样器的"约束"一段：Sampler.__call__ 在惩罚之后、选 token 之前调 constrain_rows，
# 逐行原地套上 logit_bias、min_tokens 前屏蔽 EOS / stop token、logits processors
# （允许的 id、禁用词、response_format 的语法、自定义）。
# 只有语法约束的行（结构化输出的常见情形）不逐行处理，也不留撤销用的副本：CPU 上
# mask_grammar_rows 把它们打包的 bits（llguidance 填的原样）交给 CpuOps.mask_bits 一次屏蔽；
# 其他设备解包成 (G, V) 的 blocked，一次 masked_fill_。
# 约束冲突到一个 token 都不剩：有语法的行只留语法掩码（语法优先），没有的这一步不带约束采样；
# processor 抛异常或留下 NaN / +inf 的行记进 failed，由 Sampler 只结束那个请求。
# [ZH-END]
from __future__ import annotations

import logging
import math

import numpy as np
import torch

from nanovllm.engine.sequence import SamplingState, Sequence
from nanovllm.layers.cpu_kernels import CpuOps

_NEG_INF = float("-inf")
MAX_ERROR_CHARS = 500
"""Longest error text kept for a request: a processor's exception message may be anything."""
log = logging.getLogger(__name__)


def constrain_rows(logits: torch.Tensor, seqs: list[Sequence], failed: dict[int, str],
                   cpu_ops: CpuOps | None = None) -> None:
    """Apply each row's constraints; rows that fail them, or are left non-finite, go into `failed`.
    `cpu_ops` (the compiled `CpuOps`, on CPU) applies grammar-only rows' packed masks."""
    # [ZH-START]
    # 1. together = 只有语法的行（processors 只有 grammar，无 bias，min_tokens 不生效）；
    #    maskable = 其余有 processors，或 min_tokens 仍生效（输出数 < min_tokens）的行：
    #    只有它们可能把整行屏蔽光。
    # 2. 先复制 maskable 行 before (C, V)，以便撤销"什么都不剩"的屏蔽；together 行不复制——
    #    撤销后要重套的正是它们唯一的语法掩码，结果不变。
    # 3. together 行由 mask_grammar_rows 一次屏蔽（CPU 上 cpu_ops 直接套打包的 bits）；
    #    其余行逐行 apply_constraints；
    #    返回错误文本的行记进 failed。
    # 4. best = 每行 amax (B,)：NaN 表示有 NaN，+inf 表示有 +inf，-inf 表示一个 token 都不剩。
    # 5. maskable 中未失败、best 为 -inf 的行：打 warning，从 before 恢复原行；有 response_format
    #    的行再只套语法掩码（语法优先：输出必须能解析），其余这一步不带约束采样；重算 best。
    # 6. best 仍非有限的行记为失败（setdefault：processor 的报错优先），
    #    原因加上 "after penalties and constraints"。
    # [ZH-END]
    together, maskable, others = [], [], []
    for i, seq in enumerate(seqs):
        st = seq.sampling
        min_tokens_on = st.min_tokens_blocked is not None and seq.num_output_tokens < seq.params.min_tokens
        if st.grammar is not None and len(st.processors) == 1 and st.bias_ids is None and not min_tokens_on:
            together.append(i)
        else:
            others.append(i)
            if st.processors or min_tokens_on:
                maskable.append(i)
    # Grammar-only rows keep no undo copy: undoing a mask that leaves nothing would re-apply
    # the same grammar alone, so such a row fails below as it would after the undo.
    before = logits[maskable] if maskable else None  # (C, V) copy, to undo masks that leave nothing
    if together:
        mask_grammar_rows(logits, together, seqs, failed, cpu_ops)
    for i in others:
        error = apply_constraints(logits, i, seqs[i])
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
                if seqs[i].sampling.grammar is not None:
                    seqs[i].sampling.grammar(seqs[i].output_token_ids, logits[i])
            best[rows] = logits[rows].amax(dim=-1)
    bad = ~torch.isfinite(best)
    if bool(bad.any()):
        for i in bad.nonzero().flatten().tolist():
            failed.setdefault(i, non_finite(logits[i]) + " after penalties and constraints")

def mask_grammar_rows(logits: torch.Tensor, rows: list[int], seqs: list[Sequence], failed: dict[int, str],
                      cpu_ops: CpuOps | None = None) -> None:
    """Mask the rows whose only constraint is their grammar, all in one op (their masks are
    usually ready: `MaskPrefetcher` filled them while the forward ran). On CPU with the compiled
    ops (`cpu_ops`) the grammars' packed bits are applied as they are (`CpuOps.mask_bits`);
    elsewhere they are unpacked into a (G, V) bool tensor for one `masked_fill_`. A row whose
    grammar raised (its output does not fit) goes into `failed`, as from `apply_constraints`."""
    # One vocabulary for all the rows (always, within one engine): one packed width to apply.
    packed = (cpu_ops is not None and cpu_ops.supports_draw(logits)
              and len({seqs[i].sampling.grammar.n_vocab for i in rows}) == 1)
    masks, ok = [], []
    for i in rows:
        grammar = seqs[i].sampling.grammar
        output = seqs[i].output_token_ids
        try:
            masks.append(grammar.bits(output) if packed else grammar.blocked(output))
            ok.append(i)
        except Exception as e:  # reported for this request alone, as a processor's failure is
            failed[i] = processor_failure(grammar, e)
    if not ok:
        return
    if packed:
        cpu_ops.mask_bits(logits, ok, _stack_bits(masks), seqs[ok[0]].sampling.grammar.n_vocab)
        return
    blocked = _stack_rows(masks, logits.shape[1]).to(logits.device, non_blocking=True)  # (G, V) bool
    if len(ok) == len(logits):  # every row (every stream constrained): in place, no gather
        logits.masked_fill_(blocked, _NEG_INF)
    else:  # (index_select measured up to 100x slower than this gather on two busy cores)
        idx = torch.tensor(ok, device=logits.device)
        logits[idx] = logits[idx].masked_fill_(blocked, _NEG_INF)


def _stack_bits(rows: list[np.ndarray]) -> np.ndarray:
    """Packed mask rows (W,) int32 -> (G, W): the rows of one parallel fill, all of it in order,
    are that fill's array as it is; other rows are copied together (G x 6 KB here)."""
    base = rows[0].base
    if (isinstance(base, np.ndarray) and base.ndim == 2 and base.shape[0] == len(rows)
            and all(r.base is base and r.ctypes.data == base.ctypes.data + j * base.strides[0]
                    for j, r in enumerate(rows))):
        return base
    return np.stack(rows)


def _stack_rows(masks: list[torch.Tensor], width: int) -> torch.Tensor:
    """Row masks (n_vocab,) -> (G, width) bool; token ids past a grammar's vocabulary (logits
    padded wider than it) are blocked."""
    if len({m.shape[0] for m in masks}) > 1:  # grammars over different vocabularies (not in one engine)
        return torch.stack([_stack_rows([m], width)[0] for m in masks])
    stacked = torch.stack(masks)  # (G, n_vocab)
    n_vocab = stacked.shape[1]
    if n_vocab >= width:
        return stacked[:, :width]
    pad = torch.ones(len(masks), width - n_vocab, dtype=torch.bool)  # (G, width - n_vocab)
    return torch.cat([stacked, pad], dim=1)


def apply_constraints(logits: torch.Tensor, i: int, seq: Sequence) -> str | None:
    """Constrain row i (`seq`'s) in place; the error text if one of the request's processors failed."""
    # [ZH-START]
    # 1. 有 bias：logits[i].index_add_(bias_ids, bias_values)。
    # 2. 输出数 < min_tokens：把 min_tokens_blocked（stop token 和 EOS）填成 -inf。
    # 3. 依次调用 processors(output_token_ids, row)，row 是 logits[i] 的视图；
    #    返回了别的张量就 copy_ 回 row。
    # 4. processor 抛异常 → 返回 processor_failure 写的 "logits processor <类名> raised <异常>"
    #    （最长 500 字符；语法整批屏蔽那条路径用同一函数），由调用方把该行记为失败。
    # 5. 一切正常返回 None。
    # [ZH-END]
    st: SamplingState = seq.sampling
    if st.bias_ids is not None:
        logits[i].index_add_(0, st.bias_ids, st.bias_values)
    if st.min_tokens_blocked is not None and seq.num_output_tokens < seq.params.min_tokens:
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
                return processor_failure(processor, e)
    return None


def non_finite(row: torch.Tensor) -> str:
    """What is wrong with a row whose best value is not finite (rare: only failed rows get here)."""
    return non_finite_best(float(row.amax()))


def non_finite_best(best: float) -> str:
    """What is wrong with a row whose largest value (`amax`, which NaN wins) is `best`, not finite."""
    if math.isnan(best):
        return "logits hold NaN"
    if best == float("inf"):
        return "logits hold +inf"
    return "logits allow no token (all are -inf)"


def processor_failure(processor: object, e: Exception) -> str:
    """The request's error when one of its logits processors raised."""
    return f"logits processor {type(processor).__name__} raised {exception_text(e)}"


def exception_text(e: Exception) -> str:
    try:
        text = f"{type(e).__name__}: {e}"
    except Exception:  # its __str__ failed too
        text = type(e).__name__
    return text[:MAX_ERROR_CHARS]
