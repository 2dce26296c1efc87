"""The tokenizer stage: first hop of the pipeline.

client --DEALER--> [ROUTER] tokenizer [PUSH] --> engine input
                                     [PUSH] --> engine control (aborts)

Validates each request (an error naming the problem goes straight back to its sender, and the
stage carries on), applies the chat template, tokenizes, and forwards a `TokenizedReq` to the
engine. Aborts go to the engine's control socket, which it reads whatever its load, so they
never wait behind requests (one that overtakes its request is kept by the engine until the
request arrives). Holds no per-request state: a restarted tokenizer loses nothing that is
already past it.

Backpressure: while the engine pipe is full, requests wait here in `pending`, up to
`PENDING_MAX_FRAMES` requests or `PENDING_MAX_BYTES`, and go on to the engine with the clients
taking turns (`FairQueue`). Past those bounds a new request is held in place of the newest
request of the client holding the most, which is refused as overloaded; a request of that client
itself is refused at once. The stage never stops reading its clients, so pings are answered and aborts passed
on whatever the load. With no engine connected at all, requests are refused after a short grace.
"""
# [ZH-START]
# 【模块定位】服务的第一站：客户端请求的"前门"。
#   客户端 DEALER →【分词进程 tokenizer_proc：校验、套 chat 模板、分词】─PUSH→ 引擎进程
#     → 反分词进程 → 客户端
# 每个请求在这里被检查（出错直接回给发送者，进程继续服务别人）、转成 TokenizedReq 推给引擎的 input
# socket；abort 推给引擎的 control socket：引擎再忙也读它，abort 不会排在请求后面（比请求先到的
# abort 由引擎记住，请求一到就结束它）。
# 本进程不保存任何请求状态：重启只会丢掉还没推给引擎的请求，而客户端发现分词进程实例换了会重发它们。
# 背压：引擎管道满时请求在 pending 里等，最多 PENDING_MAX_FRAMES 个或 PENDING_MAX_BYTES 字节，
# 按客户端轮流推给引擎（FairQueue）；满了以后，新请求顶替占得最多的客户端的最新一个请求
# （被顶替的以 HOLDING_FULL（"overloaded"）拒绝）；新请求本身就来自占得最多的客户端则立即拒绝。
# 本进程从不停止读客户端：负载再高，ping 照样回答（健康探针不会超时），abort 照样转发；
# 完全没有引擎连接时，请求在 1 秒宽限后被拒绝。
# [ZH-END]
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

import zmq

from prometheus_client import CollectorRegistry

from nanovllm.metrics import TokenizerMetrics
from nanovllm_client import protocol as p
from nanovllm.service.fair_queue import FairQueue
from nanovllm.service.intake import accept, drain
from nanovllm.service.notify import Flush, Notifier
from nanovllm.service.security import ServiceSecurity, claimed_id, show_client
from nanovllm.service.stage import (REQUEST_PIPE_HWM, PeerMonitor, RejectLog, client_router, new_instance_id,
                                   pipeline_push, recv_from_client)

from .rate_limit import RateLimit
from .requests import RequestBuilder, RequestRejected, engine_request_id, tenant_of
from .tokens import TokenAnswers

log = logging.getLogger("tokenizer_proc")

DRAINING = "the tokenizer is draining (shutting down): it takes no new requests; retry on another instance or later"
CLIENT_MESSAGES = (p.GenerateReq, p.AbortReq, p.Ping, p.TokenizeReq, p.DetokenizeReq, p.ResetPrefixCacheReq)
NO_ENGINE = "engine is not available (dead, restarting or not started yet); retry later"
ENGINE_STALL_S = 10.0
"""A request waiting this long for room in the engine pipe is failed instead of held."""
ENGINE_BUSY = (f"the engine took no new request for {ENGINE_STALL_S:.0f}s: it is overloaded (its queue is full); "
               "retry later or on another instance")
ENGINE_RECONNECT_GRACE_S = 1.0
"""With no engine connected, a request waits this long (a restarted engine's reconnect) before
it is refused."""
PENDING_MAX_FRAMES = 1024
PENDING_MAX_BYTES = 64 << 20
"""Requests held for room in the engine pipe, at most; past either bound the client holding the
most has its newest refused (`HOLDING_FULL`), while pings and aborts are still read and answered."""
DISPLACED = ("overloaded: the tokenizer holds {n} requests ({mib:.1f} MiB) that the engine has no room for, this "
             "client's the most; its newest was refused to make room for another client's request; retry later")
"""What the client holding the most hears for the request it loses to another client's."""
DEFAULT_MAX_PENDING_PER_CLIENT = 256
"""A quarter of `PENDING_MAX_FRAMES`: one client that floods leaves the rest to the others."""
HOLDING_FULL = ("the tokenizer already holds {n} requests ({mib:.1f} MiB) that the engine has no room for: "
                "the service is overloaded; retry later or on another instance")
CLIENT_HOLDING_FULL = ("overloaded: the tokenizer holds {n} requests of this client for the engine, its limit "
                       "(--max-pending-per-client {limit}); retry later")
"""One client's part of what the tokenizer holds, when `--max-pending-per-client` sets one."""
CLAIMED_ID = ("refused: this routing id belongs to another CURVE key (a client's routing id starts with its key's "
              "tag); connect with a routing id of your own")

@dataclass(slots=True)
class Held:
    """A tokenized request waiting for room in the engine pipe."""
    # [ZH-START]
    # 【职责】pending 里等引擎管道空位的一个已分词请求：入队时间、客户端身份、客户端的 request_id、
    # 编码好的 TokenizedReq 帧。
    # 【边界】只是数据；轮流、顶替、超时都由 TokenizerStage 决定。
    # 【协作者】TokenizerStage._forward 创建；_flush_pending、_displace 读它。
    # [ZH-END]
    queued_at: float
    identity: bytes
    request_id: str
    frame: bytes


class TokenizerStage:
    # [ZH-START]
    # 【职责】从客户端 ROUTER 收消息（intake.accept 检查帧），过载与每客户端限额（pending 份额、
    # 请求速率）先挡，再交 RequestBuilder 校验、分词，把 TokenizedReq 推给引擎的 input、
    # abort 推给引擎的 control；回答 ping（带上引擎是否已连接）；直接回答只分词 / 只反分词的命令
    # （TokenAnswers，不经过引擎）。
    # 【边界】不保存请求状态（只有等待管道空位的 pending 帧队列，以及供存活客户端计数用的最近活动
    # 时间）；不发送输出（那是 detok_proc）；不判断 prompt 能否放进 KV cache（引擎
    # add_request 判断）。
    # 【协作者】客户端的 DEALER；engine_proc 的两个 PULL（input、control，经 pipeline_push）；
    # PeerMonitor 看引擎是否连着；
    # RequestBuilder；RateLimit；Notifier 向 systemd 报 READY / 看门狗；TokenizerMetrics 记指标。
    # [ZH-END]
    def __init__(self, tokenizer: Any, frontend: str, engine: str, control: str, ctx: zmq.Context | None = None,
                 max_prompt_tokens: int | None = None,
                 security: ServiceSecurity | None = None, metrics: TokenizerMetrics | None = None,
                 cache_salt_per_client: bool = False, max_pending_per_client: int = 0,
                 max_priority: int | None = None, max_request_rate_per_client: float = 0.0):
        self.rate_limit = RateLimit(max_request_rate_per_client)
        """Each client's request rate (0: no limit)."""
        if not isinstance(max_pending_per_client, int) or isinstance(max_pending_per_client, bool) \
                or max_pending_per_client < 0:
            raise ValueError(f"max_pending_per_client must be an integer >= 0 (0: no limit), got {max_pending_per_client!r}")
        self.max_pending_per_client = max_pending_per_client
        """Most requests of one client held in `pending` (0: only the stage's own bounds)."""
        self.instance_id = new_instance_id()
        self.ctx = ctx or zmq.Context.instance()
        self.metrics = metrics or TokenizerMetrics(CollectorRegistry())
        self.security = security or ServiceSecurity(self.ctx, None, None)
        self.requests = RequestBuilder(tokenizer, max_prompt_tokens=max_prompt_tokens,
                                       cache_salt_per_client=cache_salt_per_client, max_priority=max_priority,
                                       key_max_priority=self.security.max_priority_of)
        """Checks and tokenizes each request (no I/O)."""
        self.tokens = TokenAnswers(tokenizer, max_model_len=max_prompt_tokens)
        """Answers tokenize and detokenize commands (no I/O)."""
        # Few request frames wait in zmq's pipes: while the engine holds us back, a client's
        # further requests wait on its side, not here (each frame may be 16 MiB).
        self.frontend = client_router(self.ctx, frontend, security=self.security, rcv_hwm=REQUEST_PIPE_HWM)
        self.to_engine = pipeline_push(self.ctx, engine, hwm=REQUEST_PIPE_HWM, security=self.security, connect=False)
        self.engine_peers = PeerMonitor(self.to_engine)  # before connecting: an earlier handshake is never reported
        self.to_engine.connect(engine)
        self.to_control = pipeline_push(self.ctx, control, security=self.security)
        self.pending: FairQueue[Held] = FairQueue()
        """Requests waiting for room in the engine pipe, by client identity: the clients take turns."""
        self._held_ids = itertools.count()
        self._pending_bytes = 0
        self._last_taken = float("-inf")
        """When the engine pipe last took a request: a request held behind others has waited for
        the engine only since then."""
        self.rejects = RejectLog(log, on_reject=self.metrics.frame_rejected)
        self._clients_seen: dict[bytes, float] = {}
        """Client identity -> when it last sent anything (the live-clients gauge)."""
        self._next_prune = 0.0
        self.started_at = time.monotonic()
        self.notifier = Notifier()
        self.flush = Flush(self.notifier, "passing accepted requests on to the engine")

    # ------------------------------------------------------------------ loop

    def run(self, stop) -> None:
        # [ZH-START]
        # 1. poller 注册客户端 ROUTER（POLLIN）和引擎 PUSH（先不关心事件）；
        #    notifier.ready 报告已在服务。
        # 2. 循环，直到 flush.serving 返回 False：
        #    a. stop 被置位后 flush 进入 draining（新请求回 DRAINING 错误，
        #       已接收的继续推给引擎，最多一秒）；
        #    b. draining 且 pending 已空，或一秒已过：退出；
        #    c. notifier.tick（看门狗）、每秒刷新一次存活客户端数；
        #    d. pending 非空时等引擎 PUSH 可写；客户端 ROUTER 始终可读（ping、abort 从不被挡住；
        #       pending 满时新请求被拒绝）；
        #    e. poll 100 ms → _flush_pending() 尽量把积压推给引擎 → 客户端可读就 _drain_frontend()。
        # 3. 关闭所有 socket。
        # [ZH-END]
        poller = zmq.Poller()
        poller.register(self.frontend, zmq.POLLIN)
        poller.register(self.to_engine, 0)
        log.info("tokenizer stage %s serving", self.instance_id)
        self.notifier.ready(f"tokenizer {self.instance_id} serving")
        # Stopping: new requests get a "draining" error; what was accepted goes on to the engine
        # for a second at most (the tokenizer holds nothing else).
        while self.flush.serving(stop, bool(self.pending)):
            self.notifier.tick()
            self._count_clients()
            poller.modify(self.to_engine, zmq.POLLOUT if self.pending else 0)
            events = dict(poller.poll(100))
            self._flush_pending()
            if self.frontend in events:
                self._drain_frontend()
        self.close()

    def _count_clients(self, window_s: float = 10.0) -> None:
        """Clients heard from in the last `window_s` (the tokenizer keeps no other client state)."""
        now = time.monotonic()
        if now >= self._next_prune:
            self._next_prune = now + 1.0
            self._clients_seen = {c: t for c, t in self._clients_seen.items() if now - t < window_s}
            self.rate_limit.forget_idle(now)
            self.metrics.set_live_clients(len(self._clients_seen))

    def close(self) -> None:
        self.engine_peers.socket.close(linger=0)
        self.frontend.close(linger=0)
        self.to_engine.close(linger=500)
        self.to_control.close(linger=500)
        self.security.close()

    def _drain_frontend(self) -> None:
        # [ZH-START]
        # 1. intake.drain：每轮最多 256 条、50 毫秒，免得一个繁忙客户端饿死循环里的其他工作。
        # 2. NOBLOCK 收一条（recv_from_client）：ROUTER 加上的客户端路由 id、各帧，
        #    开了 CURVE 时还有 ZAP 认证的公钥（User-Id），交给 _on_client_message。
        #    pending 满了也照样读（满时新请求在 _on_generate 被拒绝），所以 ping 和 abort
        #    永远不被忙碌的引擎挡住。
        # [ZH-END]
        keyed = self.security.enabled  # CURVE: each message carries its sender's key (ZAP's User-Id)
        drain(lambda: recv_from_client(self.frontend, keyed), lambda message: self._on_client_message(*message),
              self.rejects)

    def _on_client_message(self, identity: bytes, frames: list[bytes], key: str | None) -> None:
        """Routing id `identity` claimed by another CURVE key: refused; else `handle`, under the
        key that counts for limits (`ServiceSecurity.tenant_key`)."""
        if claimed_id(identity, key):  # another key's id: its requests are not this sender's to touch
            self.rejects("claimed_id", f"{show_client(identity)} from another CURVE key")
            self._reply(identity, p.ErrorOutput(message=CLAIMED_ID))
            return
        self.handle(identity, frames, self.security.tenant_key(key))

    # ------------------------------------------------------------------ messages

    def handle(self, identity: bytes, frames: list[bytes], key: str | None = None) -> None:
        """One client message (`key`: its sender's CURVE key where CURVE is on, unless that is the
        service's own: `ServiceSecurity.tenant_key`). Whatever
        it holds, the stage answers and carries on: a bug while handling one frame costs that
        frame an error reply, never the stage."""
        # [ZH-START]
        # 1. 调 _handle 处理一条客户端消息。
        # 2. 任何未预料的异常：记为 "internal" 拒绝（带 traceback），给这个客户端回一个
        #    ErrorOutput；进程照常运行：处理某一帧时出的 bug，代价只是这一帧得到一个错误回复。
        # [ZH-END]
        try:
            self._handle(identity, frames, key)
        except Exception as e:
            self.rejects("internal", f"{type(e).__name__} while handling a frame from {show_client(identity)}", exc_info=True)
            self._reply(identity, p.ErrorOutput(message=p.clip(f"internal error while handling this frame: "
                                                       f"{type(e).__name__}: {e}")))

    def _handle(self, identity: bytes, frames: list[bytes], key: str | None) -> None:
        # [ZH-START]
        # 1. 计数，记下该客户端最近活动时间。
        # 2. intake.accept：不是恰好一帧（"multipart"）、解不开（"bad_frame"：协议版本、类型、字段、
        #    大小与嵌套都在 decode 里查）、或不是 generate / abort / ping / tokenize / detokenize /
        #    reset_prefix_cache（"wrong_type"）→ 已计数，
        #    把返回的 ErrorOutput 回给客户端（能认出 request_id 就带上；认不出时带上这一帧的
        #    frame_digest，客户端据此找到是哪个请求）。
        # 3. 按类型分发：
        #    GenerateReq → _on_generate；
        #    AbortReq → 换成引擎侧 id "<客户端身份 hex>:<request_id>"，
        #               _send_abort 直接推给引擎的 control socket（不排在 pending 后面）；
        #    Ping → 回 Pong("tokenizer", 实例 id, 引擎是否已连接, 状态, 运行时长)；
        #    TokenizeReq / DetokenizeReq → TokenAnswers.answer 的回答直接回给这个客户端；
        #    ResetPrefixCacheReq → _pass_reset：填上客户端身份，推给引擎的 control socket
        #    （draining 或没有引擎时直接回拒绝）。
        # [ZH-END]
        self.metrics.frame_received()
        self._clients_seen[identity] = time.monotonic()
        msg = accept(frames, CLIENT_MESSAGES, self.rejects, f"from {show_client(identity)}", "the tokenizer")
        if isinstance(msg, p.ErrorOutput):
            if msg.request_id is None and len(frames) == 1:  # unreadable: named by its digest, for its sender
                msg.frame_digest = p.frame_digest(frames[0])
            self._reply(identity, msg)
        elif isinstance(msg, p.GenerateReq):
            self._on_generate(identity, msg, key)
        elif isinstance(msg, p.AbortReq):
            self._send_abort(engine_request_id(identity, msg.request_id))
        elif isinstance(msg, (p.TokenizeReq, p.DetokenizeReq)):
            self._reply(identity, self.tokens.answer(msg))
        elif isinstance(msg, p.ResetPrefixCacheReq):
            self._pass_reset(identity, msg)
        else:
            self._reply(identity, p.Pong(role="tokenizer", instance_id=self.instance_id,
                                         engine_alive=self.engine_peers.connected, state=self.flush.state,
                                         uptime_s=time.monotonic() - self.started_at))

    def _on_generate(self, identity: bytes, req: p.GenerateReq, key: str | None = None) -> None:
        # [ZH-START]
        # 1. draining 中：回 DRAINING 错误增量；tenant_of 定下它算哪个客户端（前端说的 API key /
        #    地址、CURVE 钥匙或路由 id；不该说 tenant 的客户端说了 → 拒绝）；以下“客户端”都指它。
        #    pending 已满（_holding_full）且这个客户端不能顶替
        #    别人（_may_displace：占得最多的客户端比它加上这个请求还多）：
        #    回 HOLDING_FULL（overloaded）错误增量，不分词——过载时不花 CPU 在注定放不下的请求上；
        #    这个客户端在 pending 里已有 --max-pending-per-client 个：回 CLIENT_HOLDING_FULL，
        #    别的客户端不受影响；这个客户端超过 --max-request-rate-per-client
        #    （RateLimit 令牌桶）：回限速错误，说出还要等多久。
        # 2. requests.build()（RequestBuilder）：RequestRejected → 回它的文本；
        #    其他异常（分词器或模板意外失败）
        #    → 记 "internal"，回 "could not tokenize"。
        # 3. 记录分词耗时，_forward 把 TokenizedReq 帧排进 pending（超出上限时顶替占得最多的客户端
        #    的最新请求），推给引擎。
        # [ZH-END]
        if self.flush.state == "draining":
            self._refuse(identity, req, DRAINING)
            return
        try:
            tenant = tenant_of(identity, req, key)
        except RequestRejected as e:
            self._refuse(identity, req, str(e))
            return
        if self._holding_full() and not self._may_displace(tenant):  # refused before tokenizing
            self._refuse(identity, req, HOLDING_FULL.format(n=len(self.pending), mib=self._pending_bytes / (1 << 20)))
            return
        held = self.pending.count(tenant)
        if self.max_pending_per_client and held >= self.max_pending_per_client:  # one client may not fill it
            self._refuse(identity, req, CLIENT_HOLDING_FULL.format(n=held, limit=self.max_pending_per_client))
            return
        too_fast = self.rate_limit.refusal(tenant.encode(), time.monotonic())
        if too_fast:
            self._refuse(identity, req, too_fast)
            return
        started = time.perf_counter()
        try:
            frame = self.requests.build(identity, req, key, tenant)
        except RequestRejected as e:
            self._refuse(identity, req, str(e))
            return
        except Exception as e:  # the tokenizer or template failed in a way no check foresaw
            self.rejects("internal", f"{type(e).__name__} while tokenizing {req.request_id!r}", exc_info=True)
            why = f"could not tokenize the request: {type(e).__name__}: {e}"
            self._reply(identity, p.StreamOutput(deltas=[p.error_delta(req.request_id, why)]))
            return
        self.metrics.tokenize_seconds(time.perf_counter() - started)
        self.metrics.request_forwarded()
        self._forward(identity, tenant, req.request_id, frame)

    def _pass_reset(self, identity: bytes, req: p.ResetPrefixCacheReq) -> None:
        """A cache reset to the engine's control socket, with where its answer goes (the engine
        answers through the detokenizer); refused here while draining or with no engine."""
        refusal = None
        if self.flush.state == "draining":
            refusal = p.ResetPrefixCacheOutput(request_id=req.request_id, error=DRAINING, draining=True)
        else:
            try:
                self.to_control.send(p.ResetPrefixCacheReq(request_id=req.request_id, client=identity).encode(),
                                     zmq.NOBLOCK)
            except zmq.Again:  # no engine connected (or its control pipe full)
                refusal = p.ResetPrefixCacheOutput(request_id=req.request_id, error=NO_ENGINE)
        if refusal is not None:
            self._reply(identity, refusal)

    def _refuse(self, identity: bytes, req: p.GenerateReq, why: str) -> None:
        """Refuse a request: its client gets `why` as the request's error."""
        self.metrics.request_rejected()
        self._reply(identity, p.StreamOutput(deltas=[p.error_delta(req.request_id, why)]))

    def _forward(self, identity: bytes, tenant: str, request_id: str, frame: bytes) -> None:
        self.pending.push(tenant, next(self._held_ids), Held(time.monotonic(), identity, request_id, frame))
        self._pending_bytes += len(frame)
        self._displace(tenant)
        self._flush_pending()
        self.metrics.set_held(len(self.pending), self._pending_bytes)

    def _holding_full(self) -> bool:
        return len(self.pending) >= PENDING_MAX_FRAMES or self._pending_bytes >= PENDING_MAX_BYTES

    def _may_displace(self, tenant: str) -> bool:
        """Whether a request of `tenant` may take the place of another client's in a full
        `pending`: the client holding the most would still hold more than it."""
        largest = self.pending.largest()
        return largest is not None and largest[1] > self.pending.count(tenant) + 1

    def _displace(self, newcomer: str) -> None:
        """Over the bounds, refuse the newest requests of the client holding the most (never the
        newcomer's: `_may_displace` let it in only below that client)."""
        while len(self.pending) > PENDING_MAX_FRAMES or self._pending_bytes > PENDING_MAX_BYTES:
            client, _ = self.pending.largest()
            if client == newcomer:
                return
            held = self._remove_pending(self.pending.newest(client), take=False)
            self.metrics.request_rejected()
            why = DISPLACED.format(n=len(self.pending), mib=self._pending_bytes / (1 << 20))
            self._reply(held.identity, p.StreamOutput(deltas=[p.error_delta(held.request_id, why)]))

    def _send_abort(self, engine_id: str) -> None:
        """Straight to the engine's control socket, never behind the requests held in `pending`."""
        try:
            self.to_control.send(p.AbortReq(request_id=engine_id).encode(), zmq.NOBLOCK)
        except zmq.Again:  # no engine connected (or its control pipe full): nothing there to abort
            log.info("could not pass on the abort of %s: engine unreachable", engine_id)

    def _flush_pending(self) -> None:
        # [ZH-START]
        # 1. pending.peek 按客户端轮流给出下一个 Held(入队时间, 客户端身份, request_id, 帧)，
        #    NOBLOCK 推给引擎；成功就出队（它的客户端排到轮转队尾），继续下一个。
        # 2. zmq.Again（管道满或没有引擎）：已等时间 < 上限就返回，继续持有；
        #    已等时间从"入队"和"引擎上次收下一帧" 两者中较晚的算起——排在长队后面的请求不因前面的等待
        #    被算作引擎停滞；上限 = 引擎连着时 10 秒（ENGINE_STALL_S），
        #    没连着时 1 秒（ENGINE_RECONNECT_GRACE_S，给重启的引擎重连）。
        # 3. 超过上限：丢弃它，回错误增量：引擎连着（只是忙、队列满）→ ENGINE_BUSY，
        #    不标 engine_dead（客户端不能因此认为引擎死了）；没连着 → NO_ENGINE 并标 engine_dead 和
        #    unsent（请求没到过任何引擎，客户端可以原样再发）。
        # [ZH-END]
        while self.pending:
            key, held = self.pending.peek()
            identity, request_id = held.identity, held.request_id
            try:
                self.to_engine.send(held.frame, zmq.NOBLOCK)
            except zmq.Again:
                waited = time.monotonic() - max(held.queued_at, self._last_taken)
                connected = self.engine_peers.connected
                if waited < (ENGINE_STALL_S if connected else ENGINE_RECONNECT_GRACE_S):
                    return  # engine busy (backpressure) or reconnecting: hold
                self._remove_pending(key)
                # A connected engine that reads nothing is busy, not dead: the client must not
                # take it for dead (it would refuse every request until a new engine appears).
                delta = (p.error_delta(request_id, ENGINE_BUSY) if connected
                         else p.error_delta(request_id, NO_ENGINE, engine_dead=True, unsent=True))
                log.info("request %s refused after %.1fs: %s", request_id,
                         waited, "the engine took nothing (busy)" if connected else "no engine connected")
                self._reply(identity, p.StreamOutput(deltas=[delta]))
                continue
            self._remove_pending(key)
            self._last_taken = time.monotonic()

    def _remove_pending(self, key: int, take: bool = True) -> Held:
        """Out of `pending`: by its turn (`take`: its client goes to the back), or out of turn."""
        held = self.pending.take(key) if take else self.pending.remove(key)
        self._pending_bytes -= len(held.frame)
        self.metrics.set_held(len(self.pending), self._pending_bytes)
        return held

    def _reply(self, identity: bytes, msg: p.Message) -> None:
        # [ZH-START]
        # 1. NOBLOCK 发 [客户端身份, 消息] 到 ROUTER。
        # 2. 失败（EHOSTUNREACH：客户端已走；EAGAIN：它不读）只记日志，不重试也不阻塞前门。
        # [ZH-END]
        try:
            self.frontend.send_multipart([identity, msg.encode()], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # EHOSTUNREACH: client gone; EAGAIN: it is not reading
            log.info("could not reply to client %s: %s", show_client(identity), e)
