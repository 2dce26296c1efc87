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
A client that does not read its socket gets its frames queued here up to `max_pending_frames`,
then its requests are aborted: memory stays bounded and nothing is dropped silently. The frames
held for all slow clients together are bounded by bytes too (`max_pending_bytes`): over it, the
client holding the most is given up first. zmq's own pipe to each client holds at most
`client_hwm` frames (zmq counts frames, not bytes, so it is kept short).

A restarted detokenizer loses no stream: it asks the engine for every request it holds
(`DetokHello` -> `Resync`, which carries each request's output so far) and each client tells
it how much of each stream it already received (`Resume`); the stream continues from there.
"""
# [ZH-START]
# 【模块定位】服务的最后一站，也是唯一向客户端发输出的进程。
#   客户端 → tokenizer_proc → engine_proc ─PUSH→【detok_proc】─ROUTER→ 客户端 DEALER
#   反方向只有一条：detok_proc ─PUSH→ engine_proc 的 control socket（abort：stop 命中 / 客户端消失；DetokHello），引擎再忙也读它
# 每个引擎 step 变成文本增量（nanovllm.detokenize），每步每个客户端合成一个 StreamOutput，按客户端路由 id 发出。
# 它同时是服务的故障探测器：
#   客户端每秒 ping；停止 ping 或 socket 消失（ROUTER_MANDATORY → EHOSTUNREACH）→ 在引擎里 abort 它的请求；
#   引擎每 0.25 秒心跳；它说要死、连接断开、安静超过 engine_timeout_s 或换了实例 → 旧实例的请求全部报错，并通知所有客户端。
# 重启后不丢流：向引擎要回全部在途请求（DetokHello → Resync），客户端告知已收到多少（Resume），从那里继续。
# [ZH-END]
from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from prometheus_client import CollectorRegistry

from nanovllm.detokenize import IncrementalDetokenizer
from nanovllm.metrics import DetokMetrics
from nanovllm_client import protocol as p
from nanovllm.service.intake import accept, drain
from nanovllm.service.security import ServiceSecurity, claimed_id, show_client
from nanovllm.service.stage import (Notifier, PeerMonitor, RejectLog, bind, client_router, new_instance_id, pipeline_pull,
                                   pipeline_push, recv_from_client)

log = logging.getLogger("detok_proc")

ENGINE_MESSAGES = (p.EngineStatus, p.StepOutput, p.Resync)
CLIENT_MESSAGES = (p.Ping, p.StatsReq, p.Resume)
HELLO_INTERVAL_S = 0.5
"""A new detokenizer repeats its DetokHello this often until the engine's Resync arrives."""
CLIENT_HWM = 128
"""Frames zmq holds in its pipe to one client before a send says EAGAIN and the frame is held in
the client's `pending`, where its bytes are counted: one step a frame, so seconds of a client
that is not reading, and little outside the byte budget."""
RESUME_INTERVAL_S = 1.0
"""A client sends one Resume per detokenizer it meets; one listing 65,536 streams costs ~0.1-0.3 s
to apply, so more than one a second from the same client is refused as a flood."""
MAX_GONE_CLIENTS = 4096
STALL_S = 1.0
"""A pass of the loop longer than this means the stage itself was not listening (stopped,
swapped out, starved of CPU): the time beyond it counts toward no client's silence."""
GONE_CLIENT_MEMORY_S = 600.0
"""How long the stage remembers a client it gave up on, to tell it if it comes back."""
MAX_EARLY_RESUME_ROWS = p.MAX_ROWS
"""Streams held from Resume frames that arrive before the engine's resync, all clients together: one
Resume may list up to MAX_ROWS, far more than an engine holds (its live and queued requests are
bounded by a few thousand), so anything beyond this is a flood, not clients resuming. Over it the
largest held Resumes go first: a client resuming a few streams is never crowded out by a bigger one."""


def _terminal(reason: str, num_prompt: int, num_output: int, num_cached: int) -> dict[str, Any]:
    """A terminal delta's fields: why the request ended, and its usage."""
    return {"finish_reason": reason,
            "usage": {"prompt_tokens": num_prompt, "completion_tokens": num_output, "cached_tokens": num_cached}}


@dataclass
class RequestState:
    # [ZH-START]
    # 【职责】本进程为一个在途请求保存的状态：所属客户端、客户端侧的请求 id（流的 wire id）、
    # IncrementalDetokenizer、持有它的引擎实例；resync 重建后等待 Resume 期间累积的全部 token / 文本 / 终止字段；最近的 token 计数。
    # 【边界】不保存 prompt 或采样参数（这些在引擎里）；不直接发送任何东西。
    # 【协作者】DetokStage._start 创建，_advance 每步推进，_apply_resume 在客户端报到后放出累积内容。
    # [ZH-END]
    client: bytes
    client_request_id: str
    detok: IncrementalDetokenizer
    engine: str
    """The engine instance that holds it."""
    awaiting_resume: bool = False
    """Rebuilt from a resync: nothing is sent until the client says what it already has."""
    all_ids: list[int] = field(default_factory=list)
    all_text: str = ""
    """While awaiting resume: every output token and every character released so far."""
    final: dict[str, Any] | None = None
    """While awaiting resume: the terminal fields, once the engine finished it."""
    num_prompt: int = 0
    num_output: int = 0
    """Token counts from its latest output (for the metrics of a request that ends here)."""
    stopped: dict[str, Any] | None = None
    """Its stop string matched here: the terminal fields ("stop", usage at the match), held until
    the engine's final row says it dropped the request. Only then does the client hear the end,
    so an id reused after the terminal delta never meets the old request in the engine."""
    abort_sent_at: float = 0.0
    skip_tokens: int = 0
    skip_chars: int = 0
    """Output the client has but the engine will report (again): a stream continued after an
    engine restart, whose engine reports the output it continues from with its first new token.
    Cut from what follows, not sent twice. From the request's meta (`have`), or from a resume
    that says the client has more than the engine had reported."""


@dataclass
class ClientInfo:
    # [ZH-START]
    # 【职责】一个客户端的连接信息：最近一次收到它消息的时间、它的在途请求（引擎侧 id）、
    # socket 暂时放不下而按序排队的帧。
    # 【边界】不保存请求内容；队列长度受 max_pending_frames 限制，超过就放弃该客户端；
    #   所有客户端的排队字节合计受 max_pending_bytes 限制，超过就先放弃排队字节最多的那个。
    # 【协作者】on_client_frames 更新 last_seen；send_to_client / _flush_all_pending 用 pending；client_gone / check_timeouts 清理。
    # [ZH-END]
    last_seen: float
    last_resume: float = float("-inf")
    heard: bool = False
    """Whether it has sent this detokenizer anything. One that has not (its requests came in the
    engine's steps or resync first, right after a restart) may still be reconnecting: a send that
    finds no socket for it is held, not taken for its departure."""
    request_ids: set[str] = field(default_factory=set)
    """Engine request ids of this client's requests in flight."""
    pending: collections.deque = field(default_factory=collections.deque)
    """Frames the client's socket had no room for yet, in order."""
    pending_bytes: int = 0


class DetokStage:
    # [ZH-START]
    # 【职责】接收引擎的 StepOutput / Resync / EngineStatus，逐请求反分词并处理 stop string，把增量路由给客户端；
    # 回答客户端的 ping / stats / resume；探测客户端和引擎的死亡；重启后与引擎 resync、与客户端 resume。
    # 【边界】不接收请求（那是 tokenizer 的入口）；不调度、不采样；只跟随一个引擎实例，
    # 别的实例发来的输出直接丢弃；客户端太慢时排队有上限，不无限占内存。
    # 【协作者】engine_proc（PULL 收输出，PUSH 向它的 control socket 发 abort / DetokHello）；客户端 DEALER（ROUTER，同一路由 id 两条连接）；
    # IncrementalDetokenizer；PeerMonitor 看引擎连接；DetokMetrics、Notifier。
    # [ZH-END]
    def __init__(self, tokenizer: Any, stream_endpoint: str, detok_endpoint: str, control_endpoint: str,
                 client_timeout_s: float = 5.0, engine_timeout_s: float = 3.0,
                 max_pending_frames: int = 1000, max_pending_bytes: int = 256 << 20, client_hwm: int = CLIENT_HWM,
                 ctx: zmq.Context | None = None,
                 security: ServiceSecurity | None = None, metrics: DetokMetrics | None = None):
        self.tokenizer = tokenizer
        self.instance_id = new_instance_id()
        self.client_timeout_s, self.engine_timeout_s = client_timeout_s, engine_timeout_s
        self.max_pending_frames, self.max_pending_bytes = max_pending_frames, max_pending_bytes
        self._pending_bytes = 0
        """Bytes of the frames held in every client's `pending`."""
        self.ctx = ctx or zmq.Context.instance()
        self.metrics = metrics or DetokMetrics(CollectorRegistry())
        self.security = security or ServiceSecurity(self.ctx, None, None)
        self.from_engine = pipeline_pull(self.ctx, detok_endpoint, security=self.security, listen=False)
        self.engine_peers = PeerMonitor(self.from_engine)  # before binding: an earlier handshake is never reported
        bind(self.from_engine, detok_endpoint)
        self.clients_sock = client_router(self.ctx, stream_endpoint, hwm=client_hwm, security=self.security)
        self.to_engine = pipeline_push(self.ctx, control_endpoint, security=self.security)
        """The engine's control socket: it reads aborts and hellos whatever its load."""
        self.requests: dict[str, RequestState] = {}
        self.clients: dict[bytes, ClientInfo] = {}
        self.gone: collections.OrderedDict[bytes, tuple[float, str, list[str]]] = collections.OrderedDict()
        """Clients given up on: when, why, and the request ids they were told nothing about yet."""
        self.engine_alive: bool | None = None
        """None until a ready engine is heard from (a stage that just started knows nothing yet;
        a loading engine is not dead)."""
        self.engine_state = ""
        """The engine's state from its last message: "", loading, ready or draining."""
        self.engine_uptime_s = 0.0
        self.state = "ready"
        self.started_at = time.monotonic()
        self.notifier = Notifier()
        self.engine_instance = ""
        self.engine_last_seen = 0.0
        self.engine_stats: dict[str, Any] = {}
        self.resynced = False
        self._next_hello = 0.0
        self._resume_deadline = float("inf")
        self._last_check = time.monotonic()
        self._early_resumes: dict[bytes, list[list]] = {}
        self._aborted_orphans: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.rejects = RejectLog(log, on_reject=self.metrics.frame_rejected)
        self._outbox: dict[bytes, dict[str, dict[str, Any]]] = {}
        """Deltas from the engine frames of the current pass, per client and client request id,
        sent by `_flush_outbox` as one frame per client: when the stage is behind, k steps waiting
        for it cost a client one frame with k tokens, not k frames."""

    # ------------------------------------------------------------------ loop

    def run(self, stop) -> None:
        # [ZH-START]
        # 1. poller 注册引擎 PULL、客户端 ROUTER 和引擎连接的监视 socket；notifier.ready。
        # 2. 循环直到 flush_until：
        #    a. stop 被置位：进入 draining，最多再花 1 秒把已排队的帧发给客户端（流本身活在引擎里，新的 detokenizer 会 resync）；
        #    b. draining 且没有待发帧：退出；
        #    c. 看门狗 tick、更新指标和 systemd 状态行；
        #    d. 有待发帧时 poll 10 ms，否则 100 ms；
        #    e. 引擎有帧 → _drain_engine（intake.drain 逐条交给 on_engine_frames），之后 _flush_outbox；客户端有帧 → _drain_clients（on_client_frames）；
        #    f. 监视 socket 有事件、引擎已不在连接、之前听到过它且未被判死 → _engine_dead("its connection closed")，崩溃毫秒级发现；
        #    g. 有待发帧 → _flush_all_pending；
        #    h. check_timeouts(now)：客户端 / 引擎超时、hello 重发、resume 期限、gone 过期。
        # 3. 关闭所有 socket。
        # [ZH-END]
        poller = zmq.Poller()
        poller.register(self.from_engine, zmq.POLLIN)
        poller.register(self.clients_sock, zmq.POLLIN)
        poller.register(self.engine_peers.socket, zmq.POLLIN)
        log.info("detokenizer stage %s serving", self.instance_id)
        self.notifier.ready(f"detokenizer {self.instance_id} serving")
        flush_until = float("inf")
        while time.monotonic() < flush_until:
            if stop.is_set() and self.state != "draining":
                # Stopping: the streams live on in the engine (a new detokenizer resyncs them); hand
                # the clients what is already queued for them, for a second at most, then go.
                self.state, flush_until = "draining", time.monotonic() + 1.0
                self.notifier.stopping("flushing queued output to clients")
            if self.state == "draining" and not any(c.pending for c in self.clients.values()):
                break
            self.notifier.tick()
            self.metrics.set_live_clients(len(self.clients))
            self.notifier.status(f"{len(self.requests)} stream(s), {len(self.clients)} client(s), "
                                 f"engine {self.engine_state or 'not heard from'}")
            has_pending = any(c.pending for c in self.clients.values())
            events = dict(poller.poll(10 if has_pending else 100))
            if self.from_engine in events:
                self._drain_engine()
                self._flush_outbox()
            if self.clients_sock in events:
                self._drain_clients()
            if (self.engine_peers.socket in events and not self.engine_peers.connected and self.engine_state
                    and self.engine_alive is not False):
                self._engine_dead("its connection closed")  # crashed or killed: no need to wait for the timeout
            if has_pending:
                self._flush_all_pending()
            self.check_timeouts(time.monotonic())
        self._flush_outbox()
        for sock in (self.engine_peers.socket, self.from_engine, self.clients_sock, self.to_engine):
            sock.close(linger=0)
        self.security.close()

    def _drain_engine(self) -> None:
        drain(lambda: self.from_engine.recv_multipart(zmq.NOBLOCK), self.on_engine_frames, self.rejects)

    def _drain_clients(self) -> None:
        drain(lambda: recv_from_client(self.clients_sock, self.security.enabled),
              lambda message: self.on_client_frames(*message), self.rejects)

    # ------------------------------------------------------------------ engine side

    def on_engine_frames(self, frames: list[bytes]) -> None:
        # [ZH-START]
        # 1. accept：恰好一帧、能解码、是 EngineStatus / StepOutput / Resync 之一；否则已按原因计数，丢弃（引擎没有回复通道）。
        # 2. 更新 engine_last_seen（心跳超时计时）。
        # 3. EngineStatus → on_engine_status；StepOutput → 只有来自当前跟随的引擎实例才 on_step；Resync → on_resync。
        # [ZH-END]
        self.metrics.frame_received()
        msg = accept(frames, ENGINE_MESSAGES, self.rejects, "on the engine socket", "the detokenizer's engine socket")
        if isinstance(msg, p.ErrorOutput):
            return
        self.engine_last_seen = time.monotonic()
        if isinstance(msg, p.EngineStatus):
            self.on_engine_status(msg)
        elif isinstance(msg, p.StepOutput):
            if self._from_current_engine(msg.instance_id):
                self.on_step(msg)
        else:
            self.on_resync(msg)

    def on_engine_status(self, msg: p.EngineStatus) -> None:
        # [ZH-START]
        # 1. 记下引擎统计和运行时长（stats 请求会返回它们）。
        # 2. alive=True → _engine_speaks(实例 id, 状态)。
        # 3. alive=False 且来自我们跟随的实例（或还没跟随任何实例）→ _engine_dead(原因)；
        #    别的实例的、或不带实例 id 的死亡通知（伪造）→ 记 "foreign_engine"，不予理会。
        # [ZH-END]
        self.engine_stats, self.engine_uptime_s = msg.stats, msg.uptime_s
        if msg.alive:
            self._engine_speaks(msg.instance_id, msg.state)
        elif msg.instance_id and (not self.engine_instance or msg.instance_id == self.engine_instance):
            self._engine_dead(msg.reason or "engine shut down")
        else:  # another instance's death is no news of ours; one that names none is a forgery
            self.rejects("foreign_engine", f"a death notice from engine {msg.instance_id!r}, following "
                                           f"{self.engine_instance or 'none yet'}")

    def _from_current_engine(self, instance_id: str) -> bool:
        """Outputs count only from the engine instance we follow (a stage that just started follows
        the first one it hears). Another instance's outputs are a dead engine's leftovers or a
        forgery: dropped, not taken as a restart; a new engine announces itself in its heartbeats."""
        if self.engine_instance and instance_id != self.engine_instance:
            self.rejects("foreign_engine", f"outputs from engine {instance_id}, following {self.engine_instance}")
            return False
        self._engine_speaks(instance_id)
        return True

    def _engine_speaks(self, instance_id: str, state: str | None = None) -> None:
        """A live message from engine `instance_id` (`state` from its heartbeat; outputs mean it is
        at least ready): a new instance means the old one died."""
        # [ZH-START]
        # 1. 实例 id 与跟随的不同：若之前跟随过别的实例，记一次引擎重启，并让旧实例的所有请求以 "engine restarted" 报错；改为跟随新实例。
        # 2. 没带状态（来自输出）时，有输出说明至少是 ready：沿用 ready / draining，否则设为 ready。
        # 3. alive = loading 时为 None（加载中不算死），否则 True；(alive, state) 有变化就记日志并向所有客户端广播 EngineStatus。
        # [ZH-END]
        if instance_id != self.engine_instance:
            if self.engine_instance:
                self.metrics.stage_restart_seen("engine")
                self._fail_requests(f"engine restarted (instance {instance_id} replaced {self.engine_instance})",
                                    lambda s: s.engine != instance_id)
            self.engine_instance = instance_id
        if state is None:
            state = self.engine_state if self.engine_state in ("ready", "draining") else "ready"
        alive = None if state == "loading" else True
        if (alive, state) != (self.engine_alive, self.engine_state):
            self.engine_alive, self.engine_state = alive, state
            log.info("engine %s is %s", instance_id, state)
            self._broadcast(p.EngineStatus(True, instance_id, state=state))

    def on_step(self, step: p.StepOutput) -> None:
        # [ZH-START]
        # 1. started 行：为每个新请求 _start，建好反分词器（meta 比它的第一个 token 先到，同一条有序管道）。
        # 2. rejected 行：按 meta 里的 client / rid 生成错误增量（引擎拒绝的请求从这里告诉客户端）。
        # 3. outputs 行：逐行 _advance，得到的增量按客户端分组；整步的反分词耗时记一次指标。
        # 4. 增量放进 _outbox（_stage）：同一轮 drain 里同一请求的多步合并成一个增量，
        #    这一轮处理完后 _flush_outbox 给每个客户端发一个 StreamOutput。
        # [ZH-END]
        for row in step.started:
            self._start(row.request_id, row.meta, step.instance_id)
        for row in step.rejected:
            self._stage(row.meta["client"], p.error_delta(row.meta["rid"], row.error))
        started = time.perf_counter()
        for row in step.outputs:
            state, delta = self._advance(row)
            if delta is not None:
                self._stage(state.client, delta)
        if step.outputs:
            self.metrics.detokenize_seconds(time.perf_counter() - started)

    def _stage(self, client: bytes, delta: dict[str, Any]) -> None:
        """Hold `delta` for this pass's frame to `client`, merged into the request's earlier one."""
        # [ZH-START]
        # 1. 该客户端这一轮还没有这个请求的增量：直接记下。
        # 2. 已有且那个已是终止增量（客户端刚好复用了同一个 rid）：先把该客户端的积累发出，再记下。
        # 3. 否则合并：文本、打包的 token 直接拼接（顺序不变），终止字段（finish_reason、usage、error、engine_dead）取新的。
        # 4. 一个客户端积累超过 MAX_ROWS 个增量就立即发出，帧永远合法。
        # [ZH-END]
        box = self._outbox.setdefault(client, {})
        prior = box.get(delta["request_id"])
        if prior is not None and prior.get("finish_reason") is not None:
            self._flush_client(client)
            box = self._outbox.setdefault(client, {})
            prior = None
        if prior is None:
            box[delta["request_id"]] = delta
        else:
            prior["text"] = prior.get("text", "") + delta.get("text", "")
            prior["token_ids"] = prior.get("token_ids", b"") + delta.get("token_ids", b"")
            for key in ("finish_reason", "usage", "error", "engine_dead"):
                if key in delta:
                    prior[key] = delta[key]
        if len(box) >= p.MAX_ROWS:
            self._flush_client(client)

    def _flush_client(self, client: bytes) -> None:
        box = self._outbox.pop(client, None)
        if box:
            for _, frame in p.frames_within(p.StreamOutput, list(box.values())):
                self._send_frame(client, frame)

    def _flush_outbox(self) -> None:
        for client in list(self._outbox):
            self._flush_client(client)

    def _start(self, request_id: str, meta: dict[str, Any], engine: str, resumed: bool = False) -> RequestState:
        # [ZH-START]
        # 1. 用 meta 建 IncrementalDetokenizer：tail（prompt 最后几个 token）、skip、stop、include_stop、min_tokens。
        # 2. 建 RequestState(客户端身份, 客户端 rid, 反分词器, 引擎实例) 记进 requests；续写的流（meta.have = [token 数, 字符数]，
        #    客户端已有的输出）记为 skip_tokens / skip_chars：引擎会随第一个新 token 把它们再报告一次，_advance 截掉。
        # 3. 指标记录开始时间（resync 重建的额外记下恢复时间）；把请求加到该客户端的 ClientInfo.request_ids（没有就新建）。
        # [ZH-END]
        detok = IncrementalDetokenizer(
            self.tokenizer, prompt_tail=p.unpack_token_ids(meta.get("tail", b"")),
            skip_special_tokens=meta.get("skip", True), stop=meta.get("stop", []),
            include_stop_str_in_output=meta.get("include_stop", False), min_tokens=meta.get("min_tokens", 0))
        client = meta["client"]
        state = self.requests[request_id] = RequestState(client, meta["rid"], detok, engine)
        state.skip_tokens, state.skip_chars = meta.get("have", (0, 0))
        self.metrics.request_started(request_id, meta.get("t", time.time()), resumed_at=time.time() if resumed else None)
        self.clients.setdefault(client, ClientInfo(time.monotonic())).request_ids.add(request_id)
        return state

    def _advance(self, row: p.OutputRow) -> tuple[RequestState | None, dict[str, Any] | None]:
        """The delta `row` makes for its client, with the request's state (None, None: nothing to
        send; it is held, or it is not ours)."""
        # [ZH-START]
        # 1. 一行 OutputRow：id、打包的 token、finished、reason、prompt / output / cached 数、error。
        # 2. 本地不认识这个请求（已结束、客户端已走、或比 resync 还早）：若引擎仍在生成且已 resync，就 _abort_orphan 一次；返回 (None, None)。
        # 3. 解包 token，text = detok.add(token, finished)。
        # 4. 反分词器命中 stop string：把终止字段（"stop"、此刻的 usage）存进 state.stopped（命中在引擎最后一行上、
        #    或重启后 resync 里引擎已因旧 abort 结束的请求，也照 "stop" 结束）；引擎还没结束就向引擎发 abort，
        #    这一行的文本照常发出，但终止增量要等引擎的最后一行（它确认已丢掉这个请求）到了才发——
        #    这样客户端收到终止增量后复用同一个 id，引擎里一定已经没有旧请求。
        #    已 stopped 的请求：引擎之后的非最后行不发送（超过 1 秒就再发一次 abort，防止上次没送到）；最后一行到了才结束。
        # 5. 已结束：final = state.stopped，或 {finish_reason, usage{prompt_tokens, completion_tokens, cached_tokens}}，
        #    有错误（或 reason 为 error）加 error。
        # 6. awaiting_resume（resync 重建、客户端还没报到）：token、文本、final 都累积起来，不发送，返回 (state, None)。
        # 7. 有 skip_tokens / skip_chars（resume 时客户端已有、引擎将再报告的续写前缀）：先从 token 和文本开头截掉，
        #    截完什么都不剩且没结束就返回 (state, None)。
        # 8. 否则组装增量 {request_id, text, token_ids（原样打包）, finish_reason: None}，合入 final；
        #    已结束就 _finished（计指标、遗忘该请求）；返回 (state, 增量)，调用方按 state.client 路由。
        # [ZH-END]
        request_id, packed_ids, finished, finish_reason, num_prompt, num_output, num_cached, error = row
        state = self.requests.get(request_id)
        if state is None:  # already ended here, orphaned (client gone), or older than our resync
            if not finished and self.resynced:
                self._abort_orphan(request_id)
            return None, None
        if state.stopped is not None:  # ended by its stop string; what the engine made since is not sent
            if not finished:
                if time.monotonic() - state.abort_sent_at > 1.0:  # the abort may have found no room: again
                    self._abort_stopped(request_id, state)
                return state, None
            token_ids, packed_ids, text = [], b"", ""
        else:
            token_ids = p.unpack_token_ids(packed_ids)
            text = state.detok.add(token_ids, finished)
            state.num_prompt, state.num_output = num_prompt, num_output
            if state.detok.stopped:  # its stop string ends it, on whichever row it completes
                state.stopped = _terminal("stop", num_prompt, num_output, num_cached)
                if not finished:  # the end, once the engine confirms it dropped it
                    self._abort_stopped(request_id, state)
        final = None
        if finished and state.stopped is not None:
            final = state.stopped
        elif finished:
            final = _terminal(finish_reason, num_prompt, num_output, num_cached)
            if error or finish_reason == "error":  # an abort may say why too (a drain that ran out)
                final["error"] = error or "the request failed in the engine"
        if state.awaiting_resume:  # hold everything until the client says what it has
            state.all_ids.extend(token_ids)
            state.all_text += text
            state.final = final
            return state, None
        if state.skip_tokens or state.skip_chars:  # what the client has already (see `skip_tokens`)
            n, m = min(state.skip_tokens, len(token_ids)), min(state.skip_chars, len(text))
            state.skip_tokens, state.skip_chars = state.skip_tokens - n, state.skip_chars - m
            token_ids, text = token_ids[n:], text[m:]
            packed_ids = p.pack_token_ids(token_ids)
            if not (token_ids or text or final):
                return state, None
        delta = {"request_id": state.client_request_id, "text": text, "token_ids": packed_ids, "finish_reason": None}
        if token_ids:
            self.metrics.tokens_streamed(request_id, len(token_ids), time.time())
        if final is not None:
            delta.update(final)
            self._finished(request_id, state, final["finish_reason"])
        return state, delta

    def _abort_stopped(self, request_id: str, state: RequestState) -> None:
        state.abort_sent_at = time.monotonic()
        self._abort_in_engine(request_id)

    def _finished(self, request_id: str, state: RequestState, reason: str) -> None:
        """A terminal delta went (or is going) to the client: count it, forget the request."""
        self.metrics.request_finished(request_id, reason, state.num_prompt, state.num_output, time.time())
        self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self.metrics.request_dropped(request_id)  # nothing left to free if it was counted as finished
        state = self.requests.pop(request_id, None)
        if state is not None and state.client in self.clients:
            self.clients[state.client].request_ids.discard(request_id)

    def _abort_in_engine(self, request_id: str) -> None:
        # [ZH-START]
        # 1. 把 AbortReq(request_id) 用 NOBLOCK 推给引擎的 control socket（引擎再忙也读它，abort 不排在请求后面）。
        # 2. zmq.Again 说明没有引擎连着：引擎不在，也就没有要 abort 的请求，记一行日志即可，
        #    绝不阻塞 detokenizer 的主循环。
        # [ZH-END]
        try:
            self.to_engine.send(p.AbortReq(request_id).encode(), zmq.NOBLOCK)
        except zmq.Again:  # no engine connected: there is nothing left to abort
            log.info("could not abort %s: engine unreachable", request_id)

    def _abort_orphan(self, request_id: str) -> None:
        """Abort, once, a request whose outputs have no owner here."""
        # [ZH-START]
        # 1. 已经为这个 id 发过 abort 就返回：每个孤儿只 abort 一次。
        # 2. 记进 _aborted_orphans（有序字典，超过 65536 个淘汰最旧的），再 _abort_in_engine。
        # [ZH-END]
        if request_id in self._aborted_orphans:
            return
        self._aborted_orphans[request_id] = None
        if len(self._aborted_orphans) > 65536:
            self._aborted_orphans.popitem(last=False)
        self._abort_in_engine(request_id)

    def _engine_dead(self, reason: str) -> None:
        """Fail every request in flight; tell every client (they fail the rest and refuse new ones)."""
        # [ZH-START]
        # 1. 所有在途请求以 "engine died: 原因" 报错（标 engine_dead）。
        # 2. 若还没判过死：记警告，engine_alive = False，向所有客户端广播 EngineStatus(alive=False)；
        #    客户端据此让剩下的请求失败，并在新的心跳到来前拒绝新请求。
        # [ZH-END]
        self._fail_requests(f"engine died: {reason}", lambda s: True)
        if self.engine_alive is not False:
            log.warning("engine %s dead: %s", self.engine_instance, reason)
            self.engine_alive = False
            self._broadcast(p.EngineStatus(False, self.engine_instance, p.clip(reason)))

    def _fail_requests(self, why: str, which) -> None:
        # [ZH-START]
        # 1. 遍历所有请求，which(state) 为真的生成错误增量（engine_dead=True），按客户端分组，并 _finished(..., "error")；
        #    已被 stop string 结束、只差引擎确认的请求例外：文本已完整，照 "stop" 结束。
        # 2. 每个客户端发 StreamOutput（_send_deltas，超过帧大小上限就拆成几帧）。
        # [ZH-END]
        by_client: dict[bytes, list[dict]] = collections.defaultdict(list)
        for request_id, state in list(self.requests.items()):
            if not which(state):
                continue
            if state.stopped is not None and not state.awaiting_resume:  # its text is complete: it ended by its stop
                by_client[state.client].append({"request_id": state.client_request_id, "text": "", "token_ids": b"",
                                                **state.stopped})
                self._finished(request_id, state, "stop")
            else:
                by_client[state.client].append(p.error_delta(state.client_request_id, why, engine_dead=True))
                self._finished(request_id, state, "error")
        for client, deltas in by_client.items():
            self._send_deltas(client, deltas)

    # ------------------------------------------------------------------ restart: resync + resume

    def on_resync(self, msg: p.Resync) -> None:
        # [ZH-START]
        # 1. 不是给本实例的回答、已经 resync 过、或不是当前跟随的引擎发来的：忽略。
        # 2. 每个条目：已经在正常流式输出的（我们起来之后才开始的）跳过；否则 _start(resumed=True)，
        #    标 awaiting_resume，把它至今的全部输出一次喂进 _advance（一次解码完，结果累积不发）。
        # 3. 最后一帧：resynced = True，resume 期限 = 现在 + max(2 × client_timeout_s, 10 秒)；
        #    把 resync 完成前先到的 Resume（_early_resumes）逐个应用。
        # [ZH-END]
        if msg.detok_instance != self.instance_id or self.resynced or not self._from_current_engine(msg.instance_id):
            return  # an answer to another detokenizer's hello, a repeat, or not from our engine
        for entry in msg.entries:
            if entry.request_id in self.requests:
                continue  # started after we came up: already streaming normally
            state = self._start(entry.request_id, entry.meta, msg.instance_id, resumed=True)
            state.awaiting_resume = True
            self._advance(entry.output())
        if msg.last:
            self.resynced = True
            self._resume_deadline = time.monotonic() + max(2 * self.client_timeout_s, 10.0)
            log.info("resynced with engine %s: %d request(s) await their clients", msg.instance_id,
                     sum(s.awaiting_resume for s in self.requests.values()))
            # Detached first: applying one may find its client gone, which drops its entry.
            early, self._early_resumes = self._early_resumes, {}
            for identity, rows in early.items():
                if identity in self.clients:
                    self._apply_resume(identity, rows)

    def on_resume(self, identity: bytes, msg: p.Resume) -> None:
        # [ZH-START]
        # 1. 同一客户端 1 秒内（RESUME_INTERVAL_S）第二个 Resume：记 "resume_flood"，回 ErrorOutput 说明，丢弃
        #    （正常客户端每遇到一个新的 detokenizer 只发一次；一个 65,536 行的 Resume 要花 0.1–0.3 秒处理）。
        # 2. 已 resync：立刻 _apply_resume。
        # 3. 还没 resync：先存进 _early_resumes（每个客户端保留最新一份），等 resync 的最后一帧再应用；
        #    所有客户端合计最多 MAX_EARLY_RESUME_ROWS 行：放不下时先丢掉比它大的、最大的那几份（回 ErrorOutput 告诉它们的客户端），
        #    它自己最大就丢它自己——几行的正常 Resume 不会被一个巨大的挤掉；客户端断开时它那份也删掉。
        # [ZH-END]
        info = self.clients[identity]
        now = time.monotonic()
        if now - info.last_resume < RESUME_INTERVAL_S:
            self._refuse_resume(identity, f"a second resume within {RESUME_INTERVAL_S:.0f}s")
            return
        info.last_resume = now
        if self.resynced:
            self._apply_resume(identity, msg.requests)
            return
        self._early_resumes.pop(identity, None)
        held = sum(map(len, self._early_resumes.values()))
        while held + len(msg.requests) > MAX_EARLY_RESUME_ROWS:
            largest = max(self._early_resumes, key=lambda k: len(self._early_resumes[k]), default=None)
            if largest is None or len(self._early_resumes[largest]) <= len(msg.requests):
                self._refuse_resume(identity, f"a resume of {len(msg.requests)} stream(s) while {held} wait for the "
                                              f"engine's resync: over the limit of {MAX_EARLY_RESUME_ROWS}")
                return
            held -= len(self._early_resumes.pop(largest))
            self._refuse_resume(largest, f"a resume of {len(msg.requests)} stream(s) came while {held} waited for the "
                                         f"engine's resync: the largest held resume was dropped")
        self._early_resumes[identity] = msg.requests

    def _refuse_resume(self, identity: bytes, why: str) -> None:
        self.rejects("resume_flood", f"from {show_client(identity)}: {why}")
        self.send_to_client(identity, p.ErrorOutput(p.clip(f"resume refused: {why}")).encode())

    def _apply_resume(self, identity: bytes, rows: list[list]) -> None:
        """Continue each listed stream from what the client has; abort what it no longer wants."""
        # [ZH-START]
        # 1. mine = 该客户端的全部请求（按客户端 rid 索引），waiting = 其中等待 resume 的。
        # 2. 对客户端报上的每一行 [rid, 已收 token 数, 已收字符数]（同一 rid 重复列出只处理第一次）：
        #    a. 不在 waiting 里：若客户端已收到过 token 而我们根本没有这个请求 → 回错误增量（引擎已不持有它，标 engine_dead）；跳过；
        #    b. 在 waiting 里：清除等待标记，增量 = all_text[已收字符数:] 和 all_ids[已收 token 数:]，已结束则带上 final；
        #       客户端报的比引擎至今报告的还多（引擎重启后续写的流：新引擎会把续写起点之前的输出随第一个新 token 再报告一次），
        #       多出的部分记为 skip_tokens / skip_chars，_advance 以后从输出里截掉，不重复发送；
        #       释放累积缓冲；已结束就 _finished。
        # 3. 等待中但客户端没提到的请求：客户端已不要了 → _drop_unclaimed（未结束就在引擎里 abort）。
        # 4. 有增量就作为 StreamOutput 发给该客户端（frames_within：超过帧大小上限就按顺序拆成几帧）。
        # [ZH-END]
        mine = {s.client_request_id: (rid, s) for rid, s in self.requests.items() if s.client == identity}
        waiting = {client_rid: rid for client_rid, (rid, s) in mine.items() if s.awaiting_resume}
        deltas, seen = [], set()
        for client_rid, num_tokens, num_chars in rows:
            if client_rid in seen:  # listed twice: answered once
                continue
            seen.add(client_rid)
            request_id = waiting.pop(client_rid, None)
            if request_id is None:
                if num_tokens and client_rid not in mine:
                    deltas.append(p.error_delta(client_rid, "the engine no longer holds this request (it restarted, "
                                                            "or the request ended too long ago)", engine_dead=True))
                continue
            state = self.requests[request_id]
            state.awaiting_resume = False
            # More than the engine has reported: a continued stream, whose engine reports the output
            # it continues from again with its first new token. Cut that then.
            state.skip_tokens = max(0, num_tokens - len(state.all_ids))
            state.skip_chars = max(0, num_chars - len(state.all_text))
            deltas.append({"request_id": client_rid, "text": state.all_text[num_chars:],
                           "token_ids": p.pack_token_ids(state.all_ids[num_tokens:]), "finish_reason": None,
                           **(state.final or {})})
            state.all_ids, state.all_text = [], ""
            if state.final is not None:
                self._finished(request_id, state, state.final["finish_reason"])
        for request_id in waiting.values():  # the client no longer waits for these
            self._drop_unclaimed(request_id)
        if deltas:
            self._send_deltas(identity, deltas)

    def _drop_unclaimed(self, request_id: str) -> None:
        # [ZH-START]
        # 1. 请求还没结束（final 为 None）：在引擎里 abort，释放它的 KV 块。
        # 2. _forget：从 requests 和客户端的 request_ids 里删掉。
        # [ZH-END]
        state = self.requests.get(request_id)
        if state is not None and state.final is None:
            self._abort_in_engine(request_id)
        self._forget(request_id)

    # ------------------------------------------------------------------ client side

    def on_client_frames(self, identity: bytes, frames: list[bytes], key: str | None = None) -> None:
        # [ZH-START]
        # 0. 开了 CURVE 而路由 id 不属于发送者的钥匙（claimed_id）：别的钥匙占了这个 id 的连接，发给这个 id 的输出
        #    都会落到它手里——记 "claimed_id"、回错误，并 client_gone 放弃这个 id 的客户端（它的请求在引擎里 abort）。
        # 1. 计数；更新（或新建）ClientInfo.last_seen——任何消息都算心跳。
        # 2. _tell_if_given_up：我们放弃过的客户端又出现了，告诉它哪些流已丢。必须在建好 ClientInfo 之后：
        #    因不读而被放弃的客户端管道多半还是满的，发不出去的帧要进它的 pending 排队，而不是被丢掉。
        # 3. accept：不是恰好一帧、解不开、或不是 Ping / StatsReq / Resume → 已按原因计数，把返回的 ErrorOutput 发回
        #    （类型不对的还告诉它请求应发到 tokenizer 端点）。
        # 4. Ping → 回 Pong("detokenizer", 实例 id, engine_alive, 状态, 运行时长, 引擎状态)；
        #    这是本实例第一次听到这个客户端且引擎活着：再发一个 EngineStatus，说出我们跟随的引擎实例——
        #    客户端若记得的是另一个实例，就知道引擎重启过（看到旧引擎死掉的 detokenizer 可能也一起死了）；
        #    StatsReq → 回 StatsOutput；Resume → on_resume。
        # [ZH-END]
        self.metrics.frame_received()
        if claimed_id(identity, key):
            # The connection under this id is another key's (zmq lets a second connection with an
            # id in use take it once the first is gone): whatever is sent to the id would reach it.
            self.rejects("claimed_id", f"{show_client(identity)} from another CURVE key")
            self.client_gone(identity, "its routing id was taken by another CURVE key")
            self.send_to_client(identity, p.ErrorOutput("refused: this routing id belongs to another CURVE key").encode())
            return
        info = self.clients.setdefault(identity, ClientInfo(time.monotonic()))
        first = not info.heard
        info.last_seen, info.heard = time.monotonic(), True
        # Known again first: what it is told goes through its queue (a client given up for not
        # reading still has a full pipe, and a frame with nowhere to wait was dropped).
        self._tell_if_given_up(identity)
        msg = accept(frames, CLIENT_MESSAGES, self.rejects, f"from {show_client(identity)}", "the detokenizer",
                     "; send requests to the tokenizer endpoint")
        if isinstance(msg, p.ErrorOutput):
            self.send_to_client(identity, msg.encode())
        elif isinstance(msg, p.Ping):
            self.send_to_client(identity, p.Pong("detokenizer", self.instance_id, self.engine_alive, self.state,
                                                 time.monotonic() - self.started_at, self.engine_state).encode())
            if first and self.engine_alive:  # which engine we follow: a client that knew another one
                self.send_to_client(identity, p.EngineStatus(True, self.engine_instance,  # knows it restarted
                                                             state=self.engine_state).encode())
        elif isinstance(msg, p.StatsReq):
            self.send_to_client(identity, p.StatsOutput(self.stats()).encode())
        else:
            self.on_resume(identity, msg)

    def _tell_if_given_up(self, identity: bytes) -> None:
        """A client we gave up on is back (a network blip, a long pause): end its lost streams."""
        # [ZH-START]
        # 1. 从 gone 里取出这个客户端的记录（取出即删除）。
        # 2. 有当时丢掉的流：每个 rid 回一个错误增量，说明服务因何放弃了它、请求已被 abort；客户端不必一直等下去。
        # [ZH-END]
        record = self.gone.pop(identity, None)
        if record is not None and record[2]:
            why = f"the service gave up on this client ({record[1]}) and aborted its requests"
            self._send_deltas(identity, [p.error_delta(rid, why) for rid in record[2]])

    def stats(self) -> dict[str, Any]:
        return {"engine_alive": self.engine_alive, "engine_state": self.engine_state,
                "engine_instance": self.engine_instance, "engine_uptime_s": self.engine_uptime_s,
                "engine": self.engine_stats,
                "detok": {"num_requests": len(self.requests), "num_clients": len(self.clients),
                          "num_pending_frames": sum(len(c.pending) for c in self.clients.values()),
                          "pending_bytes": self._pending_bytes,
                          "num_awaiting_resume": sum(s.awaiting_resume for s in self.requests.values()),
                          "rejected_frames": dict(self.rejects.counts)}}

    def send_to_client(self, identity: bytes, frame: bytes) -> None:
        # [ZH-START]
        # 1. _outbox 里有该客户端本轮积累的增量：先发出（_flush_client），顺序不乱。
        # 2. _send_frame：该客户端已有排队帧 → 追加到队尾，保证顺序；否则 NOBLOCK 发送。
        # 3. zmq.Again（客户端管道满）：排队（_queue）。
        # 4. 其他 ZMQError（ROUTER_MANDATORY 下的 EHOSTUNREACH：客户端 socket 不存在）：
        #    本实例从没收到过它的消息（刚重启，它的请求先随引擎的 step / resync 到了，它还在重连）→ 也排队，
        #    来不来由客户端超时决定；收到过它的消息 → client_gone。
        # [ZH-END]
        if identity in self._outbox:  # what this pass already holds for it goes first
            self._flush_client(identity)
        self._send_frame(identity, frame)

    def _send_deltas(self, identity: bytes, deltas: list[dict]) -> None:
        """Deltas to one client, as few StreamOutput frames as the frame limit allows, in order."""
        for _, frame in p.frames_within(p.StreamOutput, deltas):
            self.send_to_client(identity, frame)

    def _send_frame(self, identity: bytes, frame: bytes) -> None:
        info = self.clients.get(identity)
        if info is not None and info.pending:
            self._queue(identity, info, frame)
            return
        try:
            self.clients_sock.send_multipart([identity, frame], zmq.NOBLOCK)
        except zmq.Again:  # its pipe is full: hold the frame, in order
            if info is not None:
                self._queue(identity, info, frame)
        except zmq.ZMQError as e:  # EHOSTUNREACH: its socket is gone, or not there yet
            if info is not None and not info.heard:
                self._queue(identity, info, frame)  # the client timeout decides if it never comes
            else:
                self.client_gone(identity, f"its socket is gone ({e.strerror})")

    def _queue(self, identity: bytes, info: ClientInfo, frame: bytes) -> None:
        # [ZH-START]
        # 1. 帧追加到客户端的 pending，字节数记进它的 pending_bytes 和全体合计 _pending_bytes。
        # 2. 超过 max_pending_frames（默认 1000）：认为客户端卡住了 → client_gone，内存保持有界。
        # 3. 全体合计超过 max_pending_bytes（默认 256 MiB）：放弃排队字节最多的客户端（通常就是最慢的那个），
        #    直到合计回到预算内——一个不读的客户端不能让 detokenizer 的内存无限增长，也不会挤掉只积压了一点的客户端。
        # [ZH-END]
        info.pending.append(frame)
        self._held(info, len(frame))
        if len(info.pending) > self.max_pending_frames:
            self.client_gone(identity, f"it left {self.max_pending_frames} output messages unread")
        while self._pending_bytes > self.max_pending_bytes and self.clients:
            slowest, most = max(((i, c) for i, c in self.clients.items()), key=lambda ic: ic[1].pending_bytes)
            self.client_gone(slowest, f"it left {most.pending_bytes / (1 << 20):.1f} MiB of output unread, the most of any "
                                      f"client, while the output held for slow clients passed {self.max_pending_bytes / (1 << 20):g} MiB")

    def _held(self, info: ClientInfo, nbytes: int) -> None:
        """Count `nbytes` more (or fewer) held in `info.pending`."""
        info.pending_bytes += nbytes
        self._pending_bytes += nbytes
        self.metrics.set_output_held(self._pending_bytes)

    def _flush_all_pending(self) -> None:
        # [ZH-START]
        # 1. 对每个有积压的客户端，按序 NOBLOCK 发队头，成功才出队。
        # 2. zmq.Again：这个客户端还是满的，换下一个；其他 ZMQError → 听到过它才 client_gone（否则它可能还在重连，继续等）。
        # [ZH-END]
        for identity, info in list(self.clients.items()):
            while info.pending:
                try:
                    self.clients_sock.send_multipart([identity, info.pending[0]], zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError:
                    if info.heard:
                        self.client_gone(identity, "its socket is gone")
                    break
                self._held(info, -len(info.pending.popleft()))

    def client_gone(self, identity: bytes, why: str) -> None:
        # [ZH-START]
        # 1. 移除 ClientInfo；不认识的客户端直接返回。
        # 2. 对它的每个请求：丢掉指标、移除状态、记下客户端 rid；还没结束的在引擎里 abort（释放 KV 块）。
        # 3. 在 gone 里记 (时间, 原因, 丢掉的 rid 列表)，最多 4096 个客户端，它回来时好告诉它。
        # [ZH-END]
        self._outbox.pop(identity, None)
        self._early_resumes.pop(identity, None)
        info = self.clients.pop(identity, None)
        if info is None:
            return
        self._held(info, -info.pending_bytes)
        if info.request_ids:
            log.info("client %s gone (%s): aborting %d request(s)", show_client(identity), why, len(info.request_ids))
        lost = []
        for request_id in info.request_ids:
            self.metrics.request_dropped(request_id)
            state = self.requests.pop(request_id, None)
            if state is not None:
                lost.append(state.client_request_id)
                if state.final is None:
                    self._abort_in_engine(request_id)
        self.gone[identity] = (time.monotonic(), why, lost)
        while len(self.gone) > MAX_GONE_CLIENTS:
            self.gone.popitem(last=False)

    def _broadcast(self, msg: p.Message) -> None:
        frame = msg.encode()
        for identity in list(self.clients):
            self.send_to_client(identity, frame)

    def check_timeouts(self, now: float) -> None:
        # [ZH-START]
        # 0. 距上次检查超过 STALL_S（1 秒）：是我们自己没在听（进程被暂停、换出、抢不到 CPU），
        #    多出的时间加到每个客户端的 last_seen、引擎的 engine_last_seen 和 resume 期限上——这段时间
        #    不算客户端或引擎静默，它们的心跳还排在 socket 里没读（刚恢复时可能还在 zmq 的 I/O 线程里，
        #    poll 也看不到）。
        # 1. 客户端超过 client_timeout_s（默认 5 秒）没有任何消息 → client_gone。
        # 2. 听到过引擎、未判死、超过 engine_timeout_s（默认 3 秒）没有消息，且 socket 里也没有没读的帧（那是我们忙，不是它静默）
        #    → _engine_dead（引擎挂起）。
        # 3. 还没 resync：每 0.5 秒（HELLO_INTERVAL_S）向引擎发一次 DetokHello，直到 Resync 到来；没有引擎时跳过。
        # 4. 过了 resume 期限：还在等 resume 的请求一律 _drop_unclaimed。
        # 5. gone 里超过 600 秒（GONE_CLIENT_MEMORY_S）的记录从最旧的开始删除。
        # [ZH-END]
        stalled = now - self._last_check - STALL_S
        self._last_check = now
        if stalled > 0:  # we were not listening: their heartbeats wait unread, they were not silent
            log.warning("the detokenizer stalled for %.1fs; that time counts toward no client's silence", stalled)
            for info in self.clients.values():
                info.last_seen += stalled
            self.engine_last_seen += stalled  # its heartbeats wait too, maybe still in zmq's I/O thread
            self._resume_deadline += stalled
        for identity, info in list(self.clients.items()):
            if now - info.last_seen > self.client_timeout_s:
                self.client_gone(identity, f"no heartbeat for {self.client_timeout_s}s")
        if (self.engine_state and self.engine_alive is not False and now - self.engine_last_seen > self.engine_timeout_s
                and not self.from_engine.poll(0)):  # frames waiting unread are no silence: we were busy
            self._engine_dead(f"no heartbeat for {self.engine_timeout_s}s")
        if not self.resynced and now >= self._next_hello:
            self._next_hello = now + HELLO_INTERVAL_S
            try:
                self.to_engine.send(p.DetokHello(self.instance_id).encode(), zmq.NOBLOCK)
            except zmq.Again:
                pass  # no engine yet: the next hello goes when it is there
        if now > self._resume_deadline:
            self._resume_deadline = float("inf")
            for request_id in [r for r, s in self.requests.items() if s.awaiting_resume]:
                self._drop_unclaimed(request_id)
        while self.gone and now - next(iter(self.gone.values()))[0] > GONE_CLIENT_MEMORY_S:
            self.gone.popitem(last=False)
