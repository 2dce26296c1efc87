"""Repetition, presence and frequency penalties on a batch of logits rows, in place.

`Sampler.__call__` applies them to the rows whose requests ask for them, after the raw logprobs
are read and before the per-request constraints. Work is proportional to the tokens each row
has seen, not to the vocabulary.
"""
# [ZH-START]
# 【模块定位】采样器的"惩罚"一段：repetition（prompt + 输出里出现过的 token）
# 与 presence / frequency（只看输出），原地作用在要惩罚的行上；在原始 logprobs 之后、
# 每请求约束之前由 Sampler.__call__ 调用。
# 代价与 token 数成正比，与词表无关。
# [ZH-END]
from __future__ import annotations

import torch

from nanovllm.sampling_params import SamplingParams


def penalty_tensors(params: list[SamplingParams], device: torch.device) -> tuple[torch.Tensor, ...]:
    """(repetition, presence, frequency), each (R,) float32: the penalties of each row's request."""
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
