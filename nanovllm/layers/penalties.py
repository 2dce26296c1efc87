"""Repetition, presence and frequency penalties on a batch of logits rows, in place.

`Sampler.__call__` applies them to the rows whose requests ask for them, after the raw logprobs
are read and before the per-request constraints. Work is proportional to the tokens each row
has seen, not to the vocabulary.
"""
# [ZH-START]
# 【模块定位】采样器的"惩罚"一段：repetition（prompt + 输出里出现过的 token）
# 与 presence / frequency（只看输出），原地作用在要惩罚的行上；在原始 logprobs 之后、
# 每请求约束之前由 Sampler.__call__ 调用（重叠调度时由 Sampler.sample_on_device 调用：
# token 列表里还有上一步的占位 token，给了 previous 就在设备上换成真 token，全程不读回 host）。
# 代价与 token 数成正比，与词表无关。
# [ZH-END]
from __future__ import annotations

import torch

from nanovllm.layers.host_copy import upload
from nanovllm.layers.pending import resolve_pending
from nanovllm.sampling_params import SamplingParams


def penalty_tensors(params: list[SamplingParams], device: torch.device) -> tuple[torch.Tensor, ...]:
    """(repetition, presence, frequency), each (R,) float32: the penalties of each row's request."""
    def col(name: str) -> torch.Tensor:
        return upload([getattr(p, name) for p in params], torch.float32, device)
    return col("repetition_penalty"), col("presence_penalty"), col("frequency_penalty")


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(map(len, rows)))
    return upload([r + [pad] * (width - len(r)) for r in rows], torch.long, device)


def apply_penalties_(logits: torch.Tensor, token_ids: list[list[int]], output_ids: list[list[int]],
                     repetition: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor, *,
                     counts: bool = True, previous: torch.Tensor | None = None) -> torch.Tensor:
    """Penalize logits (R, V) in place; `token_ids` are each row's prompt + output tokens.

    repetition (HF / vLLM): a token seen in the prompt or output has a positive logit divided by
    the penalty and a negative one multiplied by it. presence / frequency (OpenAI): a token that
    occurs c > 0 times in the output loses `presence + c * frequency`. Work is proportional to
    the tokens seen, not to the vocabulary.

    `counts`: whether any row has a presence or frequency penalty (the caller knows from the
    requests; False skips that part). `previous`: the step before's tokens still on the device,
    for the stand-ins (`pending_token`) at the end of the lists (the overlapped step). Nothing
    here reads a value back from the device.
    """
    # [ZH-START]
    # 1. seen (R, L)：每行 prompt + 输出的 id，长度不足用本行第一个 id
    #    补齐（同一值重复写入无影响）。
    # 2. repetition：取出这些位置的值，正的除以惩罚、负的乘以惩罚，scatter_ 回去；
    #    每个出现过的 token 只被惩罚一次，代价与 token 数成正比，与词表大小无关。
    #    给了 previous 时，seen 和下面的 out 先 resolve_pending：占位 token 在设备上换成真 token。
    # 3. 没有输出 token，或调用方说没有行有 presence / frequency（counts 为假），到此返回。
    # 4. out (R, Lo)：输出 ids 用 V 补齐后排序（补齐值排在最后）；real = out < V；
    #    first = 每组相同 id 中的第一个。
    # 5. weight = -(frequency × real + presence × first)：出现 c 次的 token 共减
    #    presence + c × frequency，补齐位为 0。
    # 6. scatter_add_ 到 out.clamp(max=V - 1)（补齐位加 0，无影响），原地返回 logits。
    # [ZH-END]
    dev = logits.device
    # Pad with each row's own first token: writing its penalized value twice changes nothing.
    width = max(map(len, token_ids))
    seen = upload([ids + ids[:1] * (width - len(ids)) for ids in token_ids], torch.long, dev)  # (R, L)
    if previous is not None:
        seen = resolve_pending(seen, previous)
    values = logits.gather(1, seen)
    rep = repetition.unsqueeze(1)
    logits.scatter_(1, seen, torch.where(values > 0, values / rep, values * rep))
    if not any(output_ids) or not counts:
        return logits
    vocab = logits.shape[1]
    out = _padded(output_ids, vocab, dev)
    if previous is not None:
        out = resolve_pending(out, previous)
    out = out.sort(dim=-1).values  # (R, Lo); pads (= vocab) sort last
    real = out < vocab
    first = real & torch.cat([torch.ones_like(real[:, :1]), out[:, 1:] != out[:, :-1]], dim=1)  # first of equal ids
    weight = -(frequency.unsqueeze(1) * real + presence.unsqueeze(1) * first)  # 0 on pads
    return logits.scatter_add_(1, out.clamp(max=vocab - 1), weight)
