"""Log-probabilities of sampled tokens under the raw model distribution (before penalties,
constraints and temperature), with their rank and the most likely alternatives; and of prompt
tokens, each given the ones before it (`prompt_logprobs`)."""
# [ZH-START]
# 【模块定位】采样器的 logprobs 一段：选中 token 在原始分布下的 logprob、
# 排名和前几名候选（TokenLogprobs），Sampler 在惩罚和约束之前算好 log_softmax，抽完 token 后调
# token_logprobs 记下；prompt token 的 logprobs（每个 token 在它前面的 token 之下）由
# prompt_logprobs 从 prefill 位置的 hidden 分片算出，LLMEngine 在采样之后调用。
# [ZH-END]
from __future__ import annotations

from typing import Callable

import torch

from nanovllm_client.protocol import TokenLogprobs  # the engine's entry is the wire's row


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
    return [TokenLogprobs(token_id=t, logprob=lp, rank=r, top_token_ids=ids[:k], top_logprobs=lps[:k])
            for t, lp, r, ids, lps, k in rows]



PROMPT_SLICE_ROWS = 128
"""Prompt positions scored at once: (128, V) logits and their log-softmax, no more, whatever the
chunk's length (a 2048-token chunk of a 150k vocabulary would be 1.2 GB at once)."""


def prompt_logprobs(hidden: torch.Tensor, targets: list[int], num_top: list[int],
                    compute_logits: Callable[[torch.Tensor], torch.Tensor | None]) -> list[TokenLogprobs]:
    """hidden (P, C) of P prompt positions, targets (P,) the prompt token each scores (the one
    after it), num_top (P,) alternatives wanted per row -> each target's logprob, rank and top
    alternatives, `PROMPT_SLICE_ROWS` rows of logits at a time. Every tensor-parallel rank calls
    it (the vocabulary-parallel head gathers across them); only rank 0 gets logits and entries."""
    # [ZH-START]
    # 1. 按 PROMPT_SLICE_ROWS 行一片：compute_logits(hidden 这一片)，一次不多于这么多行，
    #    prompt 再长也不会一下占用 P × V 的内存。张量并行时每个 rank 都要调（lm_head 跨 rank
    #    gather），只有 rank 0 拿到 logits，其他 rank 拿到 None、跳过。
    # 2. float32 → log_softmax；这一片的 targets（每个位置要打分的是它后面那个 prompt token）
    #    和各行要的候选数交给 token_logprobs；各片结果按顺序拼起来。
    # [ZH-END]
    out: list[TokenLogprobs] = []
    for start in range(0, len(targets), PROMPT_SLICE_ROWS):
        logits = compute_logits(hidden[start:start + PROMPT_SLICE_ROWS])
        if logits is None:  # a worker rank: it took part in the gather, rank 0 scores
            continue
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = torch.tensor(targets[start:start + PROMPT_SLICE_ROWS], dtype=torch.long, device=logprobs.device)
        out.extend(token_logprobs(logprobs, chosen, num_top[start:start + PROMPT_SLICE_ROWS]))
    return out
