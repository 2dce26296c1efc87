"""Log-probabilities of sampled tokens under the raw model distribution (before penalties,
constraints and temperature), with their rank and the most likely alternatives."""
# [ZH-START]
# 【模块定位】采样器的 logprobs 一段：选中 token 在原始分布下的 logprob、
# 排名和前几名候选（TokenLogprobs），Sampler 在惩罚和约束之前算好 log_softmax，抽完 token 后调
# token_logprobs 记下。
# [ZH-END]
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities of one generated token under the raw model distribution."""
    # [ZH-START]
    # 【职责】一个已生成 token 在原始模型分布（惩罚、约束、温度之前）
    # 下的 logprob、排名和前几名候选。
    # 【边界】纯数据，不参与采样决策。
    # 【协作者】token_logprobs() 生成，存进请求的 SamplingState.logprobs，LLMEngine 经 take_logprobs
    # 取走放进 RequestOutput。
    # [ZH-END]
    token_id: int
    logprob: float
    rank: int
    """1 for the most likely token."""
    top_token_ids: list[int]
    top_logprobs: list[float]


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
