"""How every stage takes frames in: a budgeted, non-blocking drain of a socket, and the one
check a received message goes through before any handler sees it.

Both are the same on every socket of every stage, so they are written once: a socket is read
until it is empty, but never for more than `budget` messages or `max_s` seconds (one busy peer
cannot starve the loop's other sockets and timeouts), and a bug while handling one message costs
that message, counted as an "internal" rejection, never the stage. A message is one frame that
decodes (`protocol.decode`: version, type, fields, sizes and nesting) into one of the types the
socket takes; anything else is counted by reason and answered, where the sender has a reply
path, with an `ErrorOutput` naming the problem.
"""
# [ZH-START]
# 【模块定位】三个 stage 收帧的公共部分，只写一次：
#   drain：NOBLOCK 读一个 socket 直到读空，但每轮最多 budget 条、max_s 秒——
#          一个忙碌的对端不能饿死循环里别的 socket 和超时检查；
#          处理某一条时出了 bug，也只是这一条被记为 "internal" 拒绝，进程照常运行。
#   accept：一条消息必须恰好一帧、能解码（版本、类型、字段、大小、嵌套都在 protocol.decode 里查）、
#          且是这个 socket 接受的类型；
#          否则按原因计数（multipart / bad_frame / wrong_type），并返回一个说明问题的 ErrorOutput，
#          有回复通道的 stage 把它发回去。
# [ZH-END]
from __future__ import annotations

import time
from typing import Any, Callable

import zmq

from nanovllm_client import protocol as p
from nanovllm_client.checks import ProtocolError

from .stage import RejectLog

DRAIN_BUDGET = 256
"""Most messages handled in one pass over a socket."""
DRAIN_PASS_S = 0.05
"""Longest a pass over one socket runs before the loop turns to its other sockets and timeouts."""


def drain(recv: Callable[[], Any], handle: Callable[[Any], None], rejects: RejectLog,
          budget: int = DRAIN_BUDGET, max_s: float = DRAIN_PASS_S) -> None:
    """Handle what `recv()` (a NOBLOCK receive) returns until it raises zmq.Again, within the budget."""
    # [ZH-START]
    # 1. 每轮最多 budget 条、最多 max_s 秒，NOBLOCK 收取，收空（zmq.Again）就返回。
    # 2. 每条都包在 try 里：处理时出的任何 bug 都只让这一帧记为 "internal" 拒绝（带
    #    traceback），不影响后面的帧。
    # [ZH-END]
    until = time.monotonic() + max_s
    for _ in range(budget):
        if time.monotonic() > until:
            return
        try:
            message = recv()
        except zmq.Again:
            return
        try:
            handle(message)
        except Exception as e:  # a bug must cost one frame, never the stage
            rejects("internal", f"{type(e).__name__} while handling a frame", exc_info=True)


def accept(frames: list[bytes], accepted: tuple[type[p.Message], ...], rejects: RejectLog, source: str,
           receiver: str, hint: str = "") -> p.Message | p.ErrorOutput:
    """The message in `frames` if it is exactly one frame that decodes to one of `accepted`;
    otherwise the frame is counted as rejected and the `ErrorOutput` that answers it is returned
    (`source` says where it came from, for the log; `receiver` names this socket, and `hint`
    where the message should have gone, for the sender)."""
    # [ZH-START]
    # 1. 不是恰好一帧 → 记 "multipart"，返回说明的 ErrorOutput。
    # 2. protocol.decode 失败 → 记 "bad_frame"，ErrorOutput 带上错误文本和能认出的 request_id。
    # 3. 类型不在 accepted 里 → 记 "wrong_type"，ErrorOutput 列出这个 socket 接受的类型（和
    #    hint：该发到哪里）。
    # 4. 否则返回解出的消息。
    # [ZH-END]
    if len(frames) != 1:
        rejects("multipart", f"{len(frames)} frames {source}")
        return p.ErrorOutput(message=f"expected exactly one frame per message, got {len(frames)}")
    try:
        msg = p.decode(frames[0])
    except ProtocolError as e:
        rejects("bad_frame", f"{source}: {e}")
        return p.ErrorOutput(message=p.clip(str(e)), request_id=e.request_id)
    if not isinstance(msg, accepted):
        rejects("wrong_type", f"{msg.TYPE!r} {source}")
        names = ", ".join(repr(t.TYPE) for t in accepted)
        return p.ErrorOutput(message=p.clip(f"{receiver} accepts only {names} messages, got {msg.TYPE!r}{hint}"))
    return msg
