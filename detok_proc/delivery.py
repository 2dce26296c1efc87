"""The detokenizer's delivery to clients: what each client is sent, in order, within budgets.

Deltas from the engine frames of one pass over the engine socket wait in an outbox, merged per
request, and leave as one `StreamOutput` per client. A client whose socket has no room gets its
frames held here in order, up to `max_pending_frames`; the frames held for all clients together
are bounded by bytes too (`max_pending_bytes`), and over it the client holding the most is given
up first. Clients given up on are remembered for a while, so that one coming back is told which
of its streams were lost.

No sockets: frames go out through a `send` callable the loop gives it (a ROUTER in the stage,
a fake in the tests), and the decision to give up a client is reported through a `give_up`
callable, since the whole stage acts on it (its requests are aborted in the engine). Callables
rather than returned frames because a budget is crossed at the moment a frame is held, at any
depth of a handler, and the next frame to that client must already find it gone.
"""
# [ZH-START]
# 【模块定位】反分词进程向客户端投递的部分：每个客户端按顺序收到什么，内存有界。
#   本轮 drain 引擎 socket 得到的增量先进 outbox，同一请求的多步合并成一个增量，每个客户端发一个
#   StreamOutput；客户端 socket 放不下时帧按序排队在这里：每个客户端最多 max_pending_frames 帧，
#   全体合计最多 max_pending_bytes 字节，超过字节预算先放弃排队最多的客户端；
#   放弃过的客户端记一段时间，它回来时好告诉它哪些流丢了。
# 不碰 socket：帧经由 loop 给的 send 可调用对象发出（stage 里是 ROUTER，测试里是假的）；
#   决定放弃客户端时调用 give_up，由 stage 去做整体的事（在引擎里 abort 它的请求）。
# [ZH-END]
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Callable

from nanovllm.metrics import DetokMetrics
from nanovllm_client import protocol as p

NO_ROOM = "no room"
"""What `send` returns when the client's pipe is full (the frame is held); None means sent, and
any other string says why the client's socket is gone."""
MAX_GONE_CLIENTS = 4096
GONE_CLIENT_MEMORY_S = 600.0
"""How long the stage remembers a client it gave up on, to tell it if it comes back."""

Send = Callable[[bytes, bytes], "str | None"]


@dataclass
class ClientInfo:
    # [ZH-START]
    # 【职责】一个客户端的投递信息：最近一次收到它消息的时间、是否听到过它、
    # socket 暂时放不下而按序排队的帧及其字节数。
    # 【边界】不保存请求（在途请求由 RequestStreams 按客户端索引）；
    # 队列长度受 max_pending_frames 限制。
    # 【协作者】Delivery 创建和清理；stage 的 on_client_frames 通过
    # Delivery.heard_from 更新 last_seen。
    # [ZH-END]
    last_seen: float
    heard: bool = False
    """Whether it has sent this detokenizer anything. One that has not (its requests came in the
    engine's steps or resync first, right after a restart) may still be reconnecting: a send that
    finds no socket for it is held, not taken for its departure."""
    pending: collections.deque = field(default_factory=collections.deque)
    """Frames the client's socket had no room for yet, in order."""
    pending_bytes: int = 0


class Delivery:
    # [ZH-START]
    # 【职责】客户端表（ClientInfo）、本轮 outbox、排队帧及两个预算、放弃过的客户端（gone）。
    # 【边界】不碰 socket、不认识请求状态：发送经由 send，放弃客户端经由 give_up 交给 stage 处理。
    # 【协作者】DetokStage（给出 send / give_up，调用 stage_delta / send / flush_*）；
    # DetokMetrics（排队字节）。
    # [ZH-END]
    def __init__(self, send: Send, give_up: Callable[[bytes, str], None], metrics: DetokMetrics,
                 max_pending_frames: int = 1000, max_pending_bytes: int = 256 << 20):
        self._send, self._give_up, self.metrics = send, give_up, metrics
        self.max_pending_frames, self.max_pending_bytes = max_pending_frames, max_pending_bytes
        self.clients: dict[bytes, ClientInfo] = {}
        self.pending_bytes = 0
        """Bytes of the frames held in every client's `pending`."""
        self.gone: collections.OrderedDict[bytes, tuple[float, str, list[str]]] = collections.OrderedDict()
        """Clients given up on: when, why, and the request ids they were told nothing about yet."""
        self._outbox: dict[bytes, dict[str, p.DeltaRow]] = {}
        """Deltas from the engine frames of the current pass, per client and client request id,
        sent by `flush_outbox` as one frame per client: when the stage is behind, k steps waiting
        for it cost a client one frame with k tokens, not k frames."""

    # ------------------------------------------------------------------ clients known

    def know(self, identity: bytes, now: float) -> ClientInfo:
        """The client's entry, made when its first request or message arrives."""
        info = self.clients.get(identity)
        if info is None:
            info = self.clients[identity] = ClientInfo(now)
        return info

    def heard_from(self, identity: bytes, now: float) -> bool:
        """A message from the client (any counts as a heartbeat); True if it is the first."""
        info = self.know(identity, now)
        first = not info.heard
        info.last_seen, info.heard = now, True
        return first

    def forget(self, identity: bytes) -> ClientInfo | None:
        """Drop everything held for the client; its entry, or None if it was not known."""
        self._outbox.pop(identity, None)
        info = self.clients.pop(identity, None)
        if info is not None:
            self._held(info, -info.pending_bytes)
        return info

    def remember_gone(self, identity: bytes, now: float, why: str, lost: list[str]) -> None:
        self.gone[identity] = (now, why, lost)
        while len(self.gone) > MAX_GONE_CLIENTS:
            self.gone.popitem(last=False)

    def take_gone(self, identity: bytes) -> tuple[float, str, list[str]] | None:
        return self.gone.pop(identity, None)

    def silent(self, now: float, timeout_s: float) -> list[bytes]:
        """Clients not heard from for longer than `timeout_s`."""
        return [identity for identity, info in self.clients.items() if now - info.last_seen > timeout_s]

    def stalled(self, seconds: float) -> None:
        """The stage was not listening for `seconds`: that time counts toward no client's silence."""
        for info in self.clients.values():
            info.last_seen += seconds

    def expire_gone(self, now: float) -> None:
        while self.gone and now - next(iter(self.gone.values()))[0] > GONE_CLIENT_MEMORY_S:
            self.gone.popitem(last=False)

    # ------------------------------------------------------------------ sending

    def stage_delta(self, client: bytes, delta: p.DeltaRow) -> None:
        """Hold `delta` for this pass's frame to `client`, merged into the request's earlier one."""
        # [ZH-START]
        # 1. 该客户端这一轮还没有这个请求的增量：直接记下。
        # 2. 已有且那个已是终止增量（客户端刚好复用了同一个 rid）：先把该客户端的积累发出，再记下。
        # 3. 否则合并（DeltaRow 不可变，用 _replace 换成新行）：文本、
        #    打包的 token 直接拼接（顺序不变），终止字段（finish_reason、usage、error）取新的，
        #    engine_dead 任一为真即真；logprobs 由 join_logprobs 拼接（有一段带 token 却没有
        #    logprobs 就都不要，免得对不上），prompt_logprobs 取有的那个。
        # 4. 一个客户端积累超过 MAX_ROWS 个增量就立即发出，帧永远合法。
        # [ZH-END]
        box = self._outbox.setdefault(client, {})
        prior = box.get(delta.request_id)
        if prior is not None and prior.finish_reason is not None:
            self.flush_client(client)
            box = self._outbox.setdefault(client, {})
            prior = None
        if prior is None:
            box[delta.request_id] = delta
        else:  # a prior delta of a pass is never terminal (flushed above): the later one's ending fields win
            logprobs = p.join_logprobs(prior.logprobs, len(prior.token_ids) // 4, delta.logprobs, len(delta.token_ids) // 4)
            box[delta.request_id] = delta._replace(text=prior.text + delta.text, token_ids=prior.token_ids + delta.token_ids,
                                                   engine_dead=prior.engine_dead or delta.engine_dead, logprobs=logprobs,
                                                   prompt_logprobs=prior.prompt_logprobs or delta.prompt_logprobs)
        if len(box) >= p.MAX_ROWS:
            self.flush_client(client)

    def flush_client(self, client: bytes) -> None:
        box = self._outbox.pop(client, None)
        if box:
            for _, frame in p.frames_within(p.StreamOutput, list(box.values())):
                self._send_frame(client, frame)

    def flush_outbox(self) -> None:
        for client in list(self._outbox):
            self.flush_client(client)

    def send(self, identity: bytes, frame: bytes) -> None:
        # [ZH-START]
        # 1. outbox 里有该客户端本轮积累的增量：先发出（flush_client），顺序不乱。
        # 2. _send_frame：该客户端已有排队帧 → 追加到队尾，保证顺序；否则经 send 发送。
        # 3. 管道满（NO_ROOM）：排队（_queue）。
        # 4. socket 不存在（ROUTER_MANDATORY 下的 EHOSTUNREACH）：本实例从没收到过它的消息（刚重启，
        #    它的请求先随引擎的 step / resync 到了，它还在重连）→ 也排队，来不来由客户端超时决定；
        #    收到过它的消息 → give_up。
        # [ZH-END]
        if identity in self._outbox:  # what this pass already holds for it goes first
            self.flush_client(identity)
        self._send_frame(identity, frame)

    def send_deltas(self, identity: bytes, deltas: list[p.DeltaRow]) -> None:
        """Deltas to one client, as few StreamOutput frames as the frame limit allows, in order."""
        for _, frame in p.frames_within(p.StreamOutput, deltas):
            self.send(identity, frame)

    def broadcast(self, msg: p.Message) -> None:
        frame = msg.encode()
        for identity in list(self.clients):
            self.send(identity, frame)

    def _send_frame(self, identity: bytes, frame: bytes) -> None:
        info = self.clients.get(identity)
        if info is not None and info.pending:
            self._queue(identity, info, frame)
            return
        failed = self._send(identity, frame)
        if failed is None:
            return
        if failed == NO_ROOM:  # its pipe is full: hold the frame, in order
            if info is not None:
                self._queue(identity, info, frame)
        elif info is not None and not info.heard:  # its socket is not there yet
            self._queue(identity, info, frame)  # the client timeout decides if it never comes
        else:
            self._give_up(identity, f"its socket is gone ({failed})")

    def _queue(self, identity: bytes, info: ClientInfo, frame: bytes) -> None:
        # [ZH-START]
        # 1. 帧追加到客户端的 pending，字节数记进它的 pending_bytes 和全体合计 pending_bytes。
        # 2. 超过 max_pending_frames（默认 1000）：认为客户端卡住了 → give_up，内存保持有界。
        # 3. 全体合计超过 max_pending_bytes（默认 256 MiB）：放弃排队字节最多的客户端（通常就是最慢
        #    的那个），直到合计回到预算内——一个不读的客户端不能让反分词进程的内存无限增长，
        #    也不会挤掉只积压了一点的客户端。
        # [ZH-END]
        info.pending.append(frame)
        self._held(info, len(frame))
        if len(info.pending) > self.max_pending_frames:
            self._give_up(identity, f"it left {self.max_pending_frames} output messages unread")
        while self.pending_bytes > self.max_pending_bytes and self.clients:
            slowest, most = max(((i, c) for i, c in self.clients.items()), key=lambda ic: ic[1].pending_bytes)
            self._give_up(slowest, f"it left {most.pending_bytes / (1 << 20):.1f} MiB of output unread, the most of any "
                                   f"client, while the output held for slow clients passed {self.max_pending_bytes / (1 << 20):g} MiB")

    def _held(self, info: ClientInfo, nbytes: int) -> None:
        """Count `nbytes` more (or fewer) held in `info.pending`."""
        info.pending_bytes += nbytes
        self.pending_bytes += nbytes
        self.metrics.set_output_held(self.pending_bytes)

    def has_pending(self) -> bool:
        return any(c.pending for c in self.clients.values())

    def num_pending_frames(self) -> int:
        return sum(len(c.pending) for c in self.clients.values())

    def flush_pending(self) -> None:
        # [ZH-START]
        # 1. 对每个有积压的客户端，按序发队头，成功才出队。
        # 2. NO_ROOM：这个客户端还是满的，换下一个；socket 不存在 → 听到过它才 give_up（否则它可能
        #    还在重连，继续等）。
        # [ZH-END]
        for identity, info in list(self.clients.items()):
            while info.pending:
                failed = self._send(identity, info.pending[0])
                if failed == NO_ROOM:
                    break
                if failed is not None:
                    if info.heard:
                        self._give_up(identity, "its socket is gone")
                    break
                self._held(info, -len(info.pending.popleft()))
