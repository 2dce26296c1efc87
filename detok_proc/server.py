"""The detokenizer stage: last hop, and the one that talks back to clients.

engine --PUSH--> [PULL] detok [ROUTER] --> client DEALERs;  detok [PUSH] --abort, hello--> [PULL control] engine

Turns each engine step into text deltas (`nanovllm.detokenize`), batches them into one
`StreamOutput` per client per pass over the engine socket (one step when it keeps up; the steps
waiting for it, each request's merged into one delta, when it fell behind) and routes them by
the client's routing id. It is also the
service's failure detector:
- clients ping every second; a client that stops pinging, or whose socket is gone
  (ROUTER_MANDATORY makes that an EHOSTUNREACH instead of a silent drop), has its requests
  aborted in the engine, which frees their KV blocks. If that client turns up again (a tcp
  blip), it is told which of its requests were given up, instead of waiting for them;
- the engine heartbeats every 0.25 s and names itself in every message; if it says it is dying,
  its connection closes (crash, SIGKILL), it goes quiet for `engine_timeout_s` (hung) or a new
  engine instance speaks, every request of the old one ends with an error and every client is
  told, so their new requests fail fast until a heartbeat says it is back.
A client that does not read its socket has its frames held within frame and byte budgets, then
its requests are aborted: memory stays bounded and nothing is dropped silently. A restarted
detokenizer loses no stream (`DetokHello` -> `Resync`, then each client's `Resume`).

This module is the loop and the wiring: the sockets, the poll loop, hello and timeout timing. The
state lives in classes that touch no socket, each in its own module, all run by the loop's one
thread: `RequestStreams` (streams.py: the requests in flight, detokenizing, stop strings),
`Recovery` (recovery.py: resync and resume after a restart), `Delivery` (delivery.py: clients,
the per-pass outbox, frames held within budgets) and `EngineWatch` (engine_watch.py: which engine
is followed, restarts and death).
"""
# [ZH-START]
# 【模块定位】服务的最后一站，也是唯一向客户端发输出的进程。
#   客户端 → 分词进程 → 引擎进程 ─PUSH→【反分词进程 detok_proc】─ROUTER→ 客户端 DEALER
#   反方向只有一条：反分词进程 ─PUSH→ 引擎进程的 control socket
#   （abort：stop 命中 / 客户端消失；DetokHello），引擎再忙也读它
# 把引擎每一步的输出变成文本增量（nanovllm.detokenize）。每读空一次引擎 socket，每个客户端合成一个
# StreamOutput：跟得上时就是一步；落后时是这期间积下的几步，同一请求的几步合并成一个增量。
# 按客户端路由 id 发出。
# 它同时是服务的故障探测器：
#   客户端每秒 ping；停止 ping 或 socket 消失（ROUTER_MANDATORY 下的 EHOSTUNREACH）
#   → 在引擎里 abort 它的请求；
#   引擎每 0.25 秒心跳；它说要死、连接断开、安静超过 engine_timeout_s 或换了实例 → 旧实例的请求全部
#   报错，并通知所有客户端。
# 不读的客户端的帧在帧数和字节预算内排队，超过就 abort 它的请求；重启后不丢流（DetokHello → Resync，
# 再由客户端 Resume）。
# 本模块只是 loop 和接线：socket、poll 循环、hello 和超时的计时；状态都在不碰 socket 的类里，
# 由 loop 的同一个线程运行：
#   RequestStreams（streams.py：在途请求、反分词、stop string）、Recovery（recovery.py：
#   重启后的 resync / resume）、Delivery（delivery.py：客户端、本轮 outbox、预算内的排队帧）、
#   EngineWatch（engine_watch.py：跟随哪个引擎、重启与死亡）。
# [ZH-END]
from __future__ import annotations

import logging
import time
from typing import Any

import zmq

from prometheus_client import CollectorRegistry

from nanovllm.metrics import DetokMetrics
from nanovllm_client import protocol as p
from nanovllm.service.intake import accept, drain
from nanovllm.service.notify import Flush, Notifier
from nanovllm.service.security import ServiceSecurity, claimed_id, show_client
from nanovllm.service.stage import (PeerMonitor, RejectLog, bind, client_router, new_instance_id, pipeline_pull,
                                   pipeline_push, recv_from_client)

from .delivery import NO_ROOM, Delivery
from .engine_watch import EngineEvent, EngineWatch
from .recovery import Recovery
from .streams import Outcome, RequestStreams

log = logging.getLogger("detok_proc")

ENGINE_MESSAGES = (p.EngineStatus, p.StepOutput, p.Resync, p.ResetPrefixCacheOutput)
CLIENT_MESSAGES = (p.Ping, p.StatsReq, p.Resume)
HELLO_INTERVAL_S = 0.5
"""A new detokenizer repeats its DetokHello this often until the engine's Resync arrives."""
CLIENT_HWM = 128
"""Frames zmq holds in its pipe to one client before a send says EAGAIN and the frame is held in
the client's `pending`, where its bytes are counted: one step a frame, so seconds of a client
that is not reading, and little outside the byte budget."""
STALL_S = 1.0
"""A pass of the loop longer than this means the stage itself was not listening (stopped,
swapped out, starved of CPU): the time beyond it counts toward no client's silence."""


class DetokStage:
    # [ZH-START]
    # 【职责】loop 和接线：持有 socket（引擎 PULL、客户端 ROUTER、引擎 control PUSH）和 poll 循环，
    # 把引擎消息交给 EngineWatch / RequestStreams，把它们的结果（增量、abort、EngineEvent）
    # 交给 Delivery 和引擎；回答客户端的 ping / stats / resume；放弃客户端时协调三者；hello 重发、
    # resume 期限、超时检查的计时。
    # 【边界】请求状态、投递队列、引擎存活都不在这里，各在自己的类里（都不碰
    # socket）；只有这个类收发帧。
    # 【协作者】RequestStreams、Recovery、Delivery、EngineWatch；engine_proc（PULL 收输出，
    # PUSH 向它的 control socket 发 abort / DetokHello）；
    # 客户端 DEALER（ROUTER，同一路由 id 两条连接）；PeerMonitor 看引擎连接；
    # DetokMetrics、Notifier。
    # [ZH-END]
    def __init__(self, tokenizer: Any, stream_endpoint: str, detok_endpoint: str, control_endpoint: str,
                 client_timeout_s: float = 5.0, engine_timeout_s: float = 3.0,
                 max_pending_frames: int = 1000, max_pending_bytes: int = 256 << 20, client_hwm: int = CLIENT_HWM,
                 ctx: zmq.Context | None = None,
                 security: ServiceSecurity | None = None, metrics: DetokMetrics | None = None):
        self.instance_id = new_instance_id()
        self.client_timeout_s = client_timeout_s
        self.ctx = ctx or zmq.Context.instance()
        self.metrics = metrics or DetokMetrics(CollectorRegistry())
        self.security = security or ServiceSecurity(self.ctx, None, None)
        self.from_engine = pipeline_pull(self.ctx, detok_endpoint, security=self.security, listen=False)
        self.engine_peers = PeerMonitor(self.from_engine)  # before binding: an earlier handshake is never reported
        bind(self.from_engine, detok_endpoint)
        self.clients_sock = client_router(self.ctx, stream_endpoint, hwm=client_hwm, security=self.security)
        self.to_engine = pipeline_push(self.ctx, control_endpoint, security=self.security)
        """The engine's control socket: it reads aborts and hellos whatever its load."""
        self.streams = RequestStreams(tokenizer, self.metrics)
        self.recovery = Recovery(self.streams, max(2 * client_timeout_s, 10.0))
        self.delivery = Delivery(self._send_now, self.client_gone, self.metrics, max_pending_frames, max_pending_bytes)
        self.engine = EngineWatch(engine_timeout_s, self.metrics)
        self.started_at = time.monotonic()
        self.notifier = Notifier()
        self.flush = Flush(self.notifier, "flushing queued output to clients")
        self._next_hello = 0.0
        self._last_check = time.monotonic()
        self.rejects = RejectLog(log, on_reject=self.metrics.frame_rejected)

    # ------------------------------------------------------------------ loop

    def run(self, stop) -> None:
        # [ZH-START]
        # 1. poller 注册引擎 PULL、客户端 ROUTER 和引擎连接的监视 socket；notifier.ready。
        # 2. 循环，直到 flush.serving 返回 False：
        #    a. stop 被置位后 flush 进入 draining，最多再花 1 秒把已排队的帧发给客户端（流活在引擎
        #       里，新的反分词进程会 resync）；没有待发帧就退出；看门狗 tick、更新指标和 systemd
        #       状态行；有待发帧时 poll 10 ms，否则 100 ms；
        #    b. 引擎有帧 → _drain_engine（逐条 on_engine_frames），之后 delivery.flush_outbox；
        #       客户端有帧 → _drain_clients；
        #    c. 监视 socket 有事件且引擎已不在连接 → EngineWatch.connection_closed（听到过它且未判死
        #       才算死），崩溃毫秒级发现；
        #    d. 有待发帧 → delivery.flush_pending；check_timeouts(now)：客户端 / 引擎超时、
        #       hello 重发、resume 期限、gone 过期。
        # 3. 退出前再 flush_outbox 一次，把最后一轮的增量发出去；关闭所有 socket，
        #    再关 security（CURVE 认证）。
        # [ZH-END]
        poller = zmq.Poller()
        poller.register(self.from_engine, zmq.POLLIN)
        poller.register(self.clients_sock, zmq.POLLIN)
        poller.register(self.engine_peers.socket, zmq.POLLIN)
        log.info("detokenizer stage %s serving", self.instance_id)
        self.notifier.ready(f"detokenizer {self.instance_id} serving")
        # Stopping: the streams live on in the engine (a new detokenizer resyncs them); hand the
        # clients what is already queued for them, for a second at most, then go.
        while self.flush.serving(stop, self.delivery.has_pending()):
            self.notifier.tick()
            self.metrics.set_live_clients(len(self.delivery.clients))
            self.notifier.status(f"{len(self.streams.requests)} stream(s), {len(self.delivery.clients)} client(s), "
                                 f"engine {self.engine.state or 'not heard from'}")
            has_pending = self.delivery.has_pending()
            events = dict(poller.poll(10 if has_pending else 100))
            if self.from_engine in events:
                self._drain_engine()
                self.delivery.flush_outbox()
            if self.clients_sock in events:
                self._drain_clients()
            if self.engine_peers.socket in events and not self.engine_peers.connected:
                self._act(self.engine.connection_closed())  # crashed or killed: no need to wait for the timeout
            if has_pending:
                self.delivery.flush_pending()
            self.check_timeouts(time.monotonic())
        self.delivery.flush_outbox()
        for sock in (self.engine_peers.socket, self.from_engine, self.clients_sock, self.to_engine):
            sock.close(linger=0)
        self.security.close()

    def _drain_engine(self) -> None:
        drain(lambda: self.from_engine.recv_multipart(zmq.NOBLOCK), self.on_engine_frames, self.rejects)

    def _drain_clients(self) -> None:
        drain(lambda: recv_from_client(self.clients_sock, self.security.enabled),
              lambda message: self.on_client_frames(*message), self.rejects)

    def _send_now(self, identity: bytes, frame: bytes) -> str | None:
        """Delivery's way out: None if sent, NO_ROOM if the client's pipe is full, else why its socket is gone."""
        try:
            self.clients_sock.send_multipart([identity, frame], zmq.NOBLOCK)
        except zmq.Again:
            return NO_ROOM
        except zmq.ZMQError as e:  # EHOSTUNREACH (ROUTER_MANDATORY): its socket is gone, or not there yet
            return str(e.strerror)
        return None

    # ------------------------------------------------------------------ engine side

    def on_engine_frames(self, frames: list[bytes]) -> None:
        # [ZH-START]
        # 1. accept：恰好一帧、能解码、是 EngineStatus / StepOutput / Resync /
        #    ResetPrefixCacheOutput 之一；否则已按原因计数，丢弃（引擎没有回复通道）。
        # 2. EngineWatch.heard（心跳超时计时）。
        # 3. EngineStatus → on_engine_status；StepOutput → 只有来自当前跟随的引擎实例
        #    （EngineWatch.outputs）才 on_step；Resync → on_resync；
        #    ResetPrefixCacheOutput → 清掉 client 字段后原样转给它指名的客户端。
        # [ZH-END]
        self.metrics.frame_received()
        msg = accept(frames, ENGINE_MESSAGES, self.rejects, "on the engine socket", "the detokenizer's engine socket")
        if isinstance(msg, p.ErrorOutput):
            return
        self.engine.heard(time.monotonic())
        if isinstance(msg, p.EngineStatus):
            self.on_engine_status(msg)
        elif isinstance(msg, p.StepOutput):
            if self._act(self.engine.outputs(msg.instance_id)):
                self.on_step(msg)
        elif isinstance(msg, p.ResetPrefixCacheOutput):  # a command's answer, for the client that sent it
            client, msg.client = msg.client, b""
            self.delivery.send(client, msg.encode())
        else:
            self.on_resync(msg)

    def on_engine_status(self, msg: p.EngineStatus) -> None:
        self._act(self.engine.status(msg))

    def _act(self, event: EngineEvent) -> bool:
        """Do what news of the engine asks; False if the message came from an engine we do not follow."""
        # [ZH-START]
        # 1. foreign：来自不跟随的引擎实例 → 记 "foreign_engine"，返回 False（调用方丢弃这条消息）。
        # 2. fail：让在途请求（spare 实例的除外）以这个原因报错，增量立即发给各客户端。
        # 3. announce：向所有客户端广播这个 EngineStatus。
        # [ZH-END]
        if event.foreign:
            self.rejects("foreign_engine", event.foreign)
            return False
        if event.fail:
            self._deliver_now(self.streams.fail(event.fail, event.spare))
        if event.announce is not None:
            self.delivery.broadcast(event.announce)
        return True

    def on_step(self, step: p.StepOutput) -> None:
        # [ZH-START]
        # 1. RequestStreams.step：started 行建请求，rejected 行成错误增量，
        #    outputs 行推进成增量；返回 Outcome。
        # 2. 新请求的客户端交给 Delivery 认识（它的静默从现在起计时，发不出去的帧可以排队）。
        # 3. 增量放进 Delivery 的 outbox（stage_delta）：同一轮 drain 里同一请求的多步合并成一个
        #    增量，这一轮处理完后 flush_outbox 给每个客户端发一个 StreamOutput。
        #    原本认识、放入途中被放弃的客户端（它的请求已随之结束），剩下的增量不再放入；
        #    本来就不认识的客户端（例如只有一个被拒请求的）增量照样全部放入。
        # 4. Outcome 里的 abort（stop string 命中、孤儿输出）发给引擎。
        # [ZH-END]
        out = self.streams.step(step)
        self._know(out)
        for client, deltas in out.deltas.items():
            known = client in self.delivery.clients
            for delta in deltas:
                self.delivery.stage_delta(client, delta)
                if known and client not in self.delivery.clients:  # given up on while staging: its requests are gone
                    break
        self._abort_all(out.aborts)

    def _know(self, out: Outcome) -> None:
        for client in out.clients:
            self.delivery.know(client, time.monotonic())

    def _deliver_now(self, out: Outcome) -> None:
        """Send an outcome's deltas at once (after what this pass holds for each client) and its aborts."""
        for client, deltas in out.deltas.items():
            self.delivery.send_deltas(client, deltas)
        self._abort_all(out.aborts)

    def _abort_all(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._abort_in_engine(request_id)

    def _abort_in_engine(self, request_id: str) -> None:
        # [ZH-START]
        # 1. 把 AbortReq(request_id) 用 NOBLOCK 推给引擎的 control socket（引擎再忙也读它，
        #    abort 不排在请求后面）。
        # 2. zmq.Again 说明没有引擎连着：引擎不在，也就没有要 abort 的请求，记一行日志即可，
        #    绝不阻塞反分词进程的主循环。
        # [ZH-END]
        try:
            self.to_engine.send(p.AbortReq(request_id=request_id).encode(), zmq.NOBLOCK)
        except zmq.Again:  # no engine connected: there is nothing left to abort
            log.info("could not abort %s: engine unreachable", request_id)

    # ------------------------------------------------------------------ restart: resync + resume

    def on_resync(self, msg: p.Resync) -> None:
        # [ZH-START]
        # 1. 不是给本实例的回答、已经 resync 过、或不是当前跟随的引擎发来的：忽略。
        # 2. Recovery.resync 重建条目（累积输出、等待 resume）；客户端交给 Delivery 认识；
        #    需要的 abort 发给引擎。
        # 3. 最后一帧：把 resync 完成前先到的 Resume（Recovery.take_early）逐个应用——
        #    客户端还在的才应用。
        # [ZH-END]
        if (msg.detok_instance != self.instance_id or self.streams.resynced
                or not self._act(self.engine.outputs(msg.instance_id))):
            return  # an answer to another detokenizer's hello, a repeat, or not from our engine
        out = self.recovery.resync(msg, time.monotonic())
        self._know(out)
        self._abort_all(out.aborts)
        if msg.last:
            for identity, rows in self.recovery.take_early().items():
                if identity in self.delivery.clients:
                    self._deliver_now(self.recovery.resume(identity, rows))

    def on_resume(self, identity: bytes, msg: p.Resume) -> None:
        """Apply, hold or refuse a client's Resume (`Recovery.on_resume`); each refusal is counted
        as a "resume_flood" and answered with an ErrorOutput."""
        if identity not in self.delivery.clients:  # given up on while told of its lost streams
            return
        out, refused = self.recovery.on_resume(identity, msg.requests, time.monotonic())
        for who, why in refused:
            self._refuse_resume(who, why)
        self._deliver_now(out)

    def _refuse_resume(self, identity: bytes, why: str) -> None:
        self.rejects("resume_flood", f"from {show_client(identity)}: {why}")
        self.delivery.send(identity, p.ErrorOutput(message=p.clip(f"resume refused: {why}")).encode())

    # ------------------------------------------------------------------ client side

    def on_client_frames(self, identity: bytes, frames: list[bytes], key: str | None = None) -> None:
        # [ZH-START]
        # 0. 开了 CURVE 而路由 id 不属于发送者的钥匙（claimed_id）：别的钥匙占了这个 id 的连接，
        #    发给这个 id 的输出都会落到它手里——记 "claimed_id"、回错误，并 client_gone 放弃这个 id
        #    的客户端（它的请求在引擎里 abort）。
        # 1. 计数；Delivery.heard_from 更新（或新建）ClientInfo.last_seen——任何消息都算心跳。
        # 2. _tell_if_given_up：我们放弃过的客户端又出现了，告诉它哪些流已丢。必须在建好 ClientInfo
        #    之后：因不读而被放弃的客户端管道多半还是满的，发不出去的帧要进它的 pending
        #    排队，而不是被丢掉。
        # 3. accept：不是恰好一帧、解不开、或不是 Ping / StatsReq / Resume → 已按原因计数，
        #    把返回的 ErrorOutput 发回（类型不对的还告诉它请求应发到分词进程的端点）。
        # 4. Ping → 回 Pong；本实例第一次听到它且引擎活着：
        #    再发 EngineStatus（EngineWatch.announcement）说出跟随的引擎实例——
        #    客户端若记得另一个实例，就知道引擎重启过（看到旧引擎死掉的反分词进程可能也一起死了）。
        #    StatsReq → StatsOutput；Resume → on_resume。
        # [ZH-END]
        self.metrics.frame_received()
        if claimed_id(identity, key):
            # The connection under this id is another key's (zmq lets a second connection with an
            # id in use take it once the first is gone): whatever is sent to the id would reach it.
            self.rejects("claimed_id", f"{show_client(identity)} from another CURVE key")
            self.client_gone(identity, "its routing id was taken by another CURVE key")
            refused = p.ErrorOutput(message="refused: this routing id belongs to another CURVE key")
            self.delivery.send(identity, refused.encode())
            return
        first = self.delivery.heard_from(identity, time.monotonic())
        # Known again first: what it is told goes through its queue (a client given up for not
        # reading still has a full pipe, and a frame with nowhere to wait was dropped).
        self._tell_if_given_up(identity)
        msg = accept(frames, CLIENT_MESSAGES, self.rejects, f"from {show_client(identity)}", "the detokenizer",
                     "; send requests to the tokenizer endpoint")
        if isinstance(msg, p.ErrorOutput):
            self.delivery.send(identity, msg.encode())
        elif isinstance(msg, p.Ping):
            pong = p.Pong(role="detokenizer", instance_id=self.instance_id, engine_alive=self.engine.alive,
                          state=self.flush.state, uptime_s=time.monotonic() - self.started_at,
                          engine_state=self.engine.state)
            self.delivery.send(identity, pong.encode())
            announcement = self.engine.announcement() if first else None
            if announcement is not None:  # which engine we follow: a client that knew another one knows it restarted
                self.delivery.send(identity, announcement.encode())
        elif isinstance(msg, p.StatsReq):
            self.delivery.send(identity, p.StatsOutput(stats=self.stats()).encode())
        else:
            self.on_resume(identity, msg)

    def _tell_if_given_up(self, identity: bytes) -> None:
        """A client we gave up on is back (a network blip, a long pause): end its lost streams."""
        record = self.delivery.take_gone(identity)
        if record is not None and record[2]:
            why = f"the service gave up on this client ({record[1]}) and aborted its requests"
            self.delivery.send_deltas(identity, [p.error_delta(rid, why) for rid in record[2]])

    def stats(self) -> dict[str, Any]:
        return {"engine_alive": self.engine.alive, "engine_state": self.engine.state,
                "engine_instance": self.engine.instance, "engine_uptime_s": self.engine.uptime_s,
                "engine": self.engine.stats,
                "detok": {"num_requests": len(self.streams.requests), "num_clients": len(self.delivery.clients),
                          "num_pending_frames": self.delivery.num_pending_frames(),
                          "pending_bytes": self.delivery.pending_bytes,
                          "num_awaiting_resume": self.streams.num_awaiting_resume(),
                          "rejected_frames": dict(self.rejects.counts)}}

    def client_gone(self, identity: bytes, why: str) -> None:
        # [ZH-START]
        # 1. Recovery 忘掉它（先到的 Resume、上次 Resume 的时间）；Delivery.forget 移除 ClientInfo、
        #    outbox 和排队帧；不认识的客户端直接返回。
        # 2. RequestStreams.drop_client：它的每个请求丢掉指标、移除状态、记下客户端 rid；
        #    还没结束的在引擎里 abort（释放 KV 块）。
        # 3. Delivery.remember_gone 记 (时间, 原因, 丢掉的 rid 列表)，
        #    最多 4096 个客户端，它回来时好告诉它。
        # [ZH-END]
        self.recovery.forget_client(identity)
        if self.delivery.forget(identity) is None:
            return
        lost, out = self.streams.drop_client(identity)
        if lost:
            log.info("client %s gone (%s): aborting %d request(s)", show_client(identity), why, len(lost))
        self._abort_all(out.aborts)
        self.delivery.remember_gone(identity, time.monotonic(), why, lost)

    def check_timeouts(self, now: float) -> None:
        # [ZH-START]
        # 0. 距上次检查超过 STALL_S（1 秒）：是我们自己没在听（进程被暂停、换出、抢不到 CPU），
        #    多出的时间加到每个客户端、引擎的 last_seen 和 resume 期限上——不算它们静默，
        #    心跳还排在 socket 里没读（可能还在 zmq 的 I/O 线程里，poll 也看不到）。
        # 1. 客户端超过 client_timeout_s（默认 5 秒）没有任何消息 → client_gone。
        # 2. EngineWatch.overdue（听到过引擎、未判死、超过 engine_timeout_s 没有消息），
        #    且 socket 里也没有没读的帧（那是我们忙，不是它静默）→ 判死（引擎挂起）。
        # 3. 还没 resync：每 0.5 秒（HELLO_INTERVAL_S）向引擎发一次 DetokHello，
        #    直到 Resync 到来；没有引擎时跳过。
        # 4. 过了 resume 期限：还在等 resume 的请求一律丢掉（未结束的在引擎里 abort）。
        # 5. gone 里超过 600 秒的记录从最旧的开始删除。
        # [ZH-END]
        stalled = now - self._last_check - STALL_S
        self._last_check = now
        if stalled > 0:  # we were not listening: their heartbeats wait unread, they were not silent
            log.warning("the detokenizer stalled for %.1fs; that time counts toward no client's silence", stalled)
            self.delivery.stalled(stalled)
            self.engine.stalled(stalled)
            self.recovery.stalled(stalled)
        for identity in self.delivery.silent(now, self.client_timeout_s):
            self.client_gone(identity, f"no heartbeat for {self.client_timeout_s}s")
        if self.engine.overdue(now) and not self.from_engine.poll(0):  # frames waiting unread: we were busy
            self._act(self.engine.dead(f"no heartbeat for {self.engine.timeout_s}s"))
        if not self.streams.resynced and now >= self._next_hello:
            self._next_hello = now + HELLO_INTERVAL_S
            try:
                self.to_engine.send(p.DetokHello(instance_id=self.instance_id).encode(), zmq.NOBLOCK)
            except zmq.Again:
                pass  # no engine yet: the next hello goes when it is there
        self._abort_all(self.recovery.expire(now).aborts)
        self.delivery.expire_gone(now)
