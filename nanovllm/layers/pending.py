"""Tokens sampled on the device and not yet read back (the overlapped step): their stand-ins.

While step t's tokens are still on the device, the host already schedules step t+1: each
sequence sampled at step t ends with a stand-in id `pending_token(row)` (row among step t's
samples), and wherever the next step needs those tokens on the device (its input ids, the
penalties' token lists) `resolve_pending` swaps the stand-ins for the tokens with a gather, so
nothing is read back. Stand-ins are <= -2: apart from every real id and from SAMPLE_FAILED (-1).
"""
# [ZH-START]
# 【模块定位】重叠调度里"还在设备上、没读回 host 的 token"的占位方案，各处共用一份：
#   Scheduler.advance 在序列末尾放 pending_token(row) = -2 - row（row 是它在上一步采样结果里的行号）
#   → 下一步要用到这些 token 的地方（step_input 组的 input_ids、penalties 的 token 列表）
#     在设备上 resolve_pending：按行号从上一步的 token 张量里取出真 token 换进去，不读回 host
#   → Scheduler.settle 读回后把占位换成真 token。
# 占位都 <= -2，与真 token（>= 0）和 SAMPLE_FAILED（-1）都不冲突。
# [ZH-END]
from __future__ import annotations

import torch


def pending_token(row: int) -> int:
    """The stand-in id for row `row` of a step's samples still on the device."""
    return -2 - row


def is_pending(token: int) -> bool:
    """Whether `token` is a `pending_token` stand-in."""
    return token <= -2


def resolve_pending(token_ids: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """`token_ids` (any shape) with each stand-in `pending_token(r)` replaced by row r of
    `previous`, the tokens the step before sampled on the device: no value goes to the host. A
    row that failed there (SAMPLE_FAILED) gives token 0; its request ends when the host reads it."""
    rows = (-2 - token_ids).clamp_(0, previous.shape[0] - 1)
    return torch.where(token_ids <= -2, previous[rows].clamp(min=0), token_ids)
