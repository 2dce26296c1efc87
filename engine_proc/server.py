"""The engine stage: the scheduler loop around `LLMEngine.step()`.

tokenizer --PUSH--> [PULL input] engine [PUSH] --> detokenizer
tokenizer/detok --PUSH--> [PULL control]

Three threads, so socket I/O and msgpack work overlap the model step (torch releases the GIL
while it computes):
- input thread: receive, decode and check frames, build each request's sampling parameters and
  compile its response_format (the engine's own check, cached by text) -> `inbox`, in arrival order. It stops reading the input socket (requests) while `max_queued`
  requests, or `max_queued_bytes` of them, wait to be admitted (then the socket fills and the
  tokenizer holds its clients back); the control socket (aborts, detokenizer hellos) it reads
  whatever the load, so an abort never waits behind the requests that fill the queue. An abort
  may therefore overtake its request: one for an id the engine has not seen is remembered for
  `EARLY_ABORT_S` and ends that request the moment it arrives.
- main thread: apply requests and aborts, run one step, hand the raw outputs to `outbox`.
  Requests wait in `backlog` while the engine holds `max_live` of them or `max_live_bytes`; an
  abort takes one out of the backlog at once (aborts never wait behind the admission gate).
- output thread: encode one `StepOutput` per step and push it; between steps, an
  `EngineStatus` heartbeat every `heartbeat_s`, which is how the detokenizer (and through it
  every client) knows the engine is alive. On a crash or shutdown it sends alive=False last.

Every request the engine accepted is kept (meta + output tokens so far) until it finishes, and
for a minute after (`FinishedRing`), so a detokenizer that restarts can ask for all of it
(`DetokHello` -> `Resync`) and its clients' streams continue instead of failing.

Memory is bounded by bytes as well as counts: each request is charged its frame plus its prompt
as the engine will hold it (`ledger.request_bytes`), so a client at the protocol's limits
(262,144 allowed token ids, 64 stop strings of 1,024 characters) cannot make the held requests
outgrow the budgets; a prompt stays packed (4 bytes a token) until its request is admitted.
"""
# [ZH-START]
# 【模块定位】服务的中间站：把 LLMEngine.step() 包成一个独立进程。
#   客户端 → tokenizer_proc ─PUSH→【engine_proc：准入、调度循环、模型一步】
#     ─PUSH→ detok_proc → 客户端
#   两个 PULL：input 只收 tokenizer_proc 的请求；control 收 tokenizer_proc 与 detok_proc 推来的
#   abort 和 DetokHello
# 整个服务的 socket（→ 数据方向；⇒ abort / 控制路径，引擎再忙也读）：
#   客户端 DEALER(请求) ─GenerateReq / AbortReq→ ROUTER 分词进程
#   分词进程 PUSH ─TokenizedReq→ PULL input   引擎进程
#   分词进程 PUSH ═AbortReq⇒ PULL control 引擎进程（客户端的取消）
#   引擎进程 PUSH ─StepOutput / EngineStatus 心跳→ PULL 反分词进程
#   反分词进程 PUSH ═AbortReq（stop string 命中、客户端消失）/ DetokHello⇒ PULL control 引擎进程
#   反分词进程 ROUTER ─StreamOutput→ DEALER(流) 客户端；客户端 ping 也走这条连接反方向
# 三个线程，让 socket I/O 与 msgpack 编解码和模型计算重叠（torch 计算时释放 GIL）：
#   输入线程：收帧、解码、检查、建采样参数 → inbox（保持到达顺序）；未准入的请求
#     （inbox 与 backlog 里的合计）满 max_queued 个或 max_queued_bytes 字节时停止读 input socket，
#     但 control 一直读：abort 不会排在塞满队列的请求后面。
#     代价是 abort 可能比它的请求先到，所以引擎没见过的 id 的 abort 记 EARLY_ABORT_S 秒，
#     请求一到就立即结束它；
#   主线程：应用请求与 abort，跑一步，把原始输出交给 outbox；
#   输出线程：每步编码一个 StepOutput 推出去；空闲时每 heartbeat_s 发 EngineStatus 心跳，
#   退出前最后发 alive=False。
# 每个已接受的请求都记账（meta + 已输出 token），结束后再保留一分钟（FinishedRing），
# 重启的反分词进程发 DetokHello 就能拿回全部（Resync），客户端的流得以继续。
# 内存按字节也有上限：每个请求记一笔额度 = 帧长 + 每个 token 40 字节（ledger.request_bytes）；
# token 数是 prompt 加上 output_ids——续传的请求（Resume）带着已输出的 token，这部分也计入，
# 排队的不超过 max_queued_bytes、准入的不超过 max_live_bytes；
# prompt 在准入前一直保持打包（4 字节一个）。
# [ZH-END]
from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from typing import Any

import zmq

from prometheus_client import CollectorRegistry

from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.metrics import EngineMetrics
from nanovllm_client import protocol as p
from nanovllm.service.notify import Notifier
from nanovllm.service.security import ServiceSecurity
from nanovllm.service.stage import (DEFAULT_HWM, REQUEST_PIPE_HWM, RejectLog, new_instance_id, pipeline_pull,
                                   pipeline_push)

from .admission import Admission, Queued
from .client_shares import ClientShares
from .input import Input
from .output import STOP, Output, StepMessages

log = logging.getLogger("engine_proc")

RESYNC_CHUNK = 256
"""Requests per `Resync` frame, so one frame stays far below the frame size limit."""
RESYNC_INTERVAL_S = 1.0
SHUTDOWN_SEND_S = 2.0
"""How long a stopping engine keeps trying to push its last messages to a detokenizer that is
not reading (or gone) before it gives up and exits."""


class EngineStage:
    # [ZH-START]
    # 【职责】引擎进程的外壳：sockets 与三个线程的接线——输入线程收帧、建采样参数进 inbox（inbox 与
    # backlog 里未准入的请求满 max_queued 个或 max_queued_bytes 字节就停止读输入）；主线程把 inbox
    # 交给 Admission（准入、abort、记账），跑一步，把 StepMessages 交给输出线程（Output）；
    # DetokHello 的 resync 节奏；心跳里的统计；draining 与关停。
    # 【边界】请求记账在 Admission、编码与发送在 Output，这里只接线；不分词也不反分词；
    # 不直接回复客户端（没有回复通道，拒绝理由作为 RejectedRow 随 step 发给反分词进程）；
    # 只有主线程碰 engine 对象，唯一例外是输入线程经 _compile_format 调线程安全的
    # engine.compile_response_format（编译钩子）。
    # 【协作者】tokenizer_proc（请求推到 input PULL，abort 推到 control PULL）与 detok_proc（abort、
    # DetokHello 推到 control）；Admission、Output、LLMEngine；EngineMetrics、Notifier（systemd）。
    # [ZH-END]
    def __init__(self, engine: LLMEngine | None, input_endpoint: str, output_endpoint: str,
                 control_endpoint: str, heartbeat_s: float = 0.25, max_live: int = 4096, max_queued: int = 4096,
                 max_live_bytes: int = 2 << 30, max_queued_bytes: int = 512 << 20, drain_timeout_s: float = 30.0,
                 out_hwm: int = DEFAULT_HWM, ctx: zmq.Context | None = None,
                 security: ServiceSecurity | None = None, metrics: EngineMetrics | None = None,
                 stream_interval: int = 1, max_live_per_client: int = 0, max_queued_per_client: int = 0):
        self.state = "ready" if engine is not None else "loading"
        self.started_at = time.monotonic()
        self.drain_timeout_s = drain_timeout_s
        self.notifier = Notifier()
        self.instance_id = new_instance_id()
        self.heartbeat_s = heartbeat_s
        self.ctx = ctx or zmq.Context.instance()
        self.metrics = metrics or EngineMetrics(CollectorRegistry())
        """Fed by the engine's own post-step hook (added once the engine exists) and by this stage."""
        self.metrics.set_state(self.state)
        self._last_hello = ""
        self._hello: str | None = None
        """The latest detokenizer that asked for a resync and has not got one yet."""
        self._next_resync_at = 0.0
        self.rejects = RejectLog(log, on_reject=self.metrics.frame_rejected)
        self.admission = Admission(max_live, max_live_bytes, ClientShares(max_live_per_client, max_queued_per_client),
                                   self.rejects, lambda queued: self.input.dequeued(queued))
        """The requests: queued, live, lately finished, and the engine that runs them (used by the
        step loop alone)."""
        self.admission.engine = engine
        self.latest_stats: dict[str, Any] = engine.stats() if engine is not None else {}
        self.num_steps = 0
        self._stop = threading.Event()
        self._drain_deadline: float | None = None
        # Bind/connect here, in the main thread, before the threads start using the sockets.
        self.security = security or ServiceSecurity(self.ctx, None, None)
        # Few frames in zmq's pipe: what waits there is outside the byte budget.
        self._in_sock = pipeline_pull(self.ctx, input_endpoint, hwm=REQUEST_PIPE_HWM, security=self.security)
        self._control_sock = pipeline_pull(self.ctx, control_endpoint, security=self.security)
        self.input = Input(self._in_sock, self._control_sock, max_queued, max_queued_bytes,
                           self.rejects, self.metrics, check_format=self._compile_format)
        """The input thread's state; it hands the step loop requests and control messages through `inbox`."""
        self.inbox = self.input.inbox
        # Not IMMEDIATE: outputs queue (up to the HWM) while the detokenizer restarts.
        self._out_sock = pipeline_push(self.ctx, output_endpoint, hwm=out_hwm, immediate=False,
                                       security=self.security)
        self.output = Output(self._out_sock, self.instance_id, lambda: self._status(True), heartbeat_s, stream_interval)
        """The output thread's state; the step loop hands it items through `outbox`."""
        self.outbox = self.output.outbox
        self._threads = [threading.Thread(target=self.input.loop, name="engine-input", daemon=True),
                         threading.Thread(target=self.output.loop, name="engine-output", daemon=True)]

    # ------------------------------------------------------------------ main loop

    @property
    def engine(self) -> LLMEngine | None:
        """The LLMEngine, held by `Admission`; None until `run` loads it: meanwhile the stage
        answers, and says it is loading."""
        return self.admission.engine

    def run(self, stop: threading.Event, load_engine=None) -> int:
        """Serve until `stop` is set, then drain; `load_engine()` builds the engine first if the
        stage was made without one (heartbeats say "loading" meanwhile). Returns the exit code."""
        # [ZH-START]
        # 1. 启动输入、输出线程（此时已能收帧和发 "loading" 心跳）。
        # 2. 还没有引擎就调 load_engine() 加载；失败（模型不存在、
        #    配置错误）→ _shutdown("cannot start ...") 告诉所有人，返回 1。
        # 3. 挂上指标的 post-step 钩子，状态设为 ready；
        #    先 notifier.ready（监管者先知道），再发一次存活状态。
        # 4. stop 未置位就不断 run_once()；置位后 drain() 得到关停原因。
        # 5. 循环里任何异常 = 引擎坏了：记 traceback，退出码 1，
        #    原因 "engine crashed: ..."（supervisor 会重启本进程）。
        # 6. _shutdown(reason) 最后发 alive=False，返回退出码。
        # [ZH-END]
        self._stop = stop
        for t in self._threads:
            t.start()
        if self.engine is None:
            try:
                self.admission.engine = load_engine()
            except Exception as e:  # no such model, bad config: say so to everyone, exit non-zero
                log.error("the engine cannot start: %s", e)
                self._shutdown(f"cannot start: {type(e).__name__}: {e}")
                return 1
        self.latest_stats = self._stage_stats()  # the same keys as every heartbeat's, from the first
        self.engine.add_post_step_hook(self.metrics)
        self._set_state("ready")
        # READY=1 first: whoever learns from a client that the engine serves may count on its
        # supervisor (systemd, `nanovllm serve`) knowing it too, and watching it (a test that
        # stopped the engine at once found a supervisor that never heard it was ready).
        self.notifier.ready(f"engine {self.instance_id} serving")
        self._emit(self._status(True, "started"))
        log.info("engine stage %s serving", self.instance_id)
        code, reason = 0, "engine shut down"
        try:
            while not stop.is_set():
                self.run_once()
            reason = self.drain()
        except Exception as e:  # the engine is broken: tell everyone, then die (the supervisor restarts us)
            log.error("engine loop failed:\n%s", traceback.format_exc())
            code, reason = 1, f"engine crashed: {type(e).__name__}: {e}"
        self._shutdown(reason)
        return code

    def drain(self) -> str:
        """Stop taking requests; let those in flight finish for up to `drain_timeout_s`, then
        abort the rest, saying why. Returns the shutdown reason."""
        # [ZH-START]
        # 1. 状态设为 draining；deadline = _start_drain_clock()（默认 30 秒，只在第一次确定）。
        # 2. 发一次 draining 状态：客户端看到后不再发新请求；
        #    新到的请求在 Admission.queue 里回 DRAINING。
        # 3. 只要还有 live 或 backlog 且未到期限，就继续 run_once()，让在途请求正常跑完。
        # 4. 全部结束 → 返回 "engine shut down after draining"。
        # 5. 到期仍有剩余：为每个请求在 Admission.abort_notes 记下原因，经 input.put_control 放入
        #    AbortReq；再 run_once() 3 次，让这些 abort 的最终输出（带原因）发出去。
        # [ZH-END]
        self._set_state("draining")
        deadline = self._start_drain_clock()
        book = self.admission
        held = len(book.live) + len(book.backlog)
        log.info("draining %d request(s) for up to %.0fs", held, self.drain_timeout_s)
        self.notifier.stopping(f"draining {held} request(s)")
        self._emit(self._status(True, "draining"))
        while (book.live or book.backlog) and time.monotonic() < deadline:  # no list built per step
            self.run_once()
        left = book.in_flight()
        if not left:
            return "engine shut down after draining"
        why = f"the engine is shutting down: draining ended after {self.drain_timeout_s:.0f}s and this request was aborted"
        log.warning("drain timed out: aborting %d request(s)", len(left))
        for request_id in left:
            book.abort_notes[request_id] = why
            self.input.put_control(p.AbortReq(request_id=request_id))
        for _ in range(3):  # the aborts' final outputs come from the next step
            self.run_once()
        return f"engine shut down; {len(left)} request(s) aborted after the drain"

    def run_once(self) -> None:
        # [ZH-START]
        # 1. 任一 I/O 线程已死 → RuntimeError（无法再收发，按引擎崩溃处理）。
        # 2. notifier.tick() 放在主循环里：一步卡死时看门狗就停了，systemd 能发现。
        # 3. idle = 引擎没有未完成请求且 backlog 为空：此时 _take_inbox 最多阻塞
        #    50 ms 等消息，否则不等。
        # 4. _take_inbox：按到达顺序应用请求（进 backlog）、abort、DetokHello。
        # 5. Admission.admit：backlog 中最早的请求依次加入引擎，直到 live 达到 max_live 个或
        #    max_live_bytes 字节（没有 live 时总放一个）；客户端已有 --max-live-per-client
        #    个在引擎里的，它的请求先跳过，后面别的客户端的照常准入。
        # 6. 引擎有未完成请求就 step()，每个输出由 Admission.record 记账。
        # 7. 本步输出追加到 sent.outputs（其中已有未准入就被 abort
        #    的请求的终止输出）；有输出才计一步。
        # 8. 汇总 stats（引擎统计 + live / queued / 步数 / 拒绝帧数）
        #    存进 latest_stats（心跳会带上），更新指标和 systemd 状态行（含 KV cache 占用率）。
        # 9. sent（StepMessages：started / rejected / outputs）非空就交给输出线程（编码在那边做）。
        # 10. 有待答的 hello 且距上次 resync 已满 1 秒 → _send_resync。
        # [ZH-END]
        if not all(t.is_alive() for t in self._threads):
            raise RuntimeError("an engine I/O thread died; the engine can no longer receive or send")
        self.notifier.tick()  # from the step loop itself: a hung step stops the watchdog
        sent = StepMessages()
        book = self.admission
        idle = not self.engine.has_unfinished_requests() and not book.backlog
        self._take_inbox(idle, sent)
        book.admit(sent)
        outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
        for out in outputs:
            book.record(out)
        sent.outputs += outputs
        self.num_steps += bool(sent.outputs)
        stats = self.latest_stats = self._stage_stats()
        used = 1 - stats["num_free_blocks"] / stats["num_total_blocks"]
        self.metrics.set_live(len(book.live), book.live_bytes)
        self.metrics.set_queued(len(book.backlog), self.input.queued_bytes)
        self.notifier.status(f"{self.state}: {stats['num_running']} running, {stats['num_waiting']} waiting, "
                             f"{len(book.backlog)} queued, KV cache {used:.0%} used")
        if sent:
            self._emit(sent)
        if self._hello is not None and time.monotonic() >= self._next_resync_at:
            self._send_resync(self._hello)

    def _take_inbox(self, block: bool, sent: StepMessages) -> None:
        # [ZH-START]
        # 1. block 时第一条消息最多等 0.05 秒，否则不等；取到一条后改为不等，
        #    把 inbox 里现有的一次取完。
        # 2. Queued（输入线程包好的请求）→ Admission.queue（被拒的直接记进 sent.rejected）。
        # 3. AbortReq → Admission.abort（abort 来自 control socket，可能比它的请求先到：
        #    那时它记下这个 id，请求到了再结束）。
        # 4. DetokHello → 记下最新的反分词进程实例 id；
        #    与上次服务过的实例不同就计一次反分词进程重启。
        # 5. ResetPrefixCacheReq → _reset_prefix_cache：在两步之间清掉没人持有的缓存块，
        #    回答经输出线程、反分词进程送回发命令的客户端。
        # [ZH-END]
        timeout = 0.05 if block else 0.0
        while True:
            try:
                msg = self.inbox.get(timeout=timeout) if timeout else self.inbox.get_nowait()
            except queue.Empty:
                return
            timeout = 0.0
            if isinstance(msg, Queued):
                self.admission.queue(msg, sent, self.state == "draining")
                continue
            self.input.took_control()
            if isinstance(msg, p.AbortReq):
                self.admission.abort(msg.request_id, sent)
            elif isinstance(msg, p.DetokHello):
                if msg.instance_id != self._hello and self._last_hello and msg.instance_id != self._last_hello:
                    self.metrics.stage_restart_seen("detokenizer")
                self._hello = msg.instance_id
            elif isinstance(msg, p.ResetPrefixCacheReq):
                self._reset_prefix_cache(msg)

    def _reset_prefix_cache(self, req: p.ResetPrefixCacheReq) -> None:
        """Forget the cached blocks no running request holds, and answer the client that asked
        (through the detokenizer, which routes by `client`); refused while draining."""
        if not req.client:  # a frame not passed on by the tokenizer: nobody to answer
            self.rejects("bad_frame", f"reset_prefix_cache {req.request_id!r} without a client")
            return
        answer = p.ResetPrefixCacheOutput(request_id=req.request_id, client=req.client)
        if self.state == "draining":
            answer.error, answer.draining = "the engine is draining (shutting down): its cache is left as it is", True
        else:
            answer.freed_blocks = self.engine.reset_prefix_cache()
            log.info("prefix cache reset: %d cached block(s) forgotten", answer.freed_blocks)
        self._emit(answer)

    def _send_resync(self, detok_instance: str) -> None:
        """Everything a new detokenizer needs. At most one per `RESYNC_INTERVAL_S`, for the latest
        hello only: a resync can be thousands of entries, and a hello is a few bytes anyone who
        reaches the engine's port could repeat (a real detokenizer repeats its hello until answered)."""
        # [ZH-START]
        # 1. 清掉待答 hello，下次最早 1 秒后（RESYNC_INTERVAL_S）：hello 只有几个字节，
        #    谁都能重复发，resync 可能有几千条。
        # 2. 条目 = 每个 live 请求的 ResyncEntry(meta, output = 已输出 token 和最新计数的
        #    OutputRow，未结束) + FinishedRing 里最近结束的。
        # 3. 每 256 条（RESYNC_CHUNK）一帧，超过帧大小上限（meta 里的长 stop string）
        #    的再用 frames_within 对半拆，最后一帧 last=True；没有条目也发一个空的最后帧。
        # 4. 经 _emit 进 outbox，与 step 同一管道，所以 resync 与后续 step 的顺序有保证。
        # [ZH-END]
        self._hello, self._next_resync_at = None, time.monotonic() + RESYNC_INTERVAL_S
        self._last_hello = detok_instance
        entries = self.admission.resync_entries()
        log.info("resync for detokenizer %s: %d request(s)", detok_instance, len(entries))
        chunks = [entries[i:i + RESYNC_CHUNK] for i in range(0, len(entries), RESYNC_CHUNK)] or [[]]
        parts = [part for chunk in chunks for part, _ in p.frames_within(
            lambda rows: p.Resync(instance_id=self.instance_id, detok_instance=detok_instance, entries=rows,
                                  last=False), chunk)]
        for i, part in enumerate(parts):
            self._emit(p.Resync(instance_id=self.instance_id, detok_instance=detok_instance, entries=part,
                                last=i == len(parts) - 1))

    def _start_drain_clock(self) -> float:
        """The drain's deadline, fixed the first time anyone asks after the stop request (a step
        may be waiting on a full output queue when it comes)."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + self.drain_timeout_s
            self.output.give_up_at = self._drain_deadline + SHUTDOWN_SEND_S  # then nobody is reading: stop waiting
        return self._drain_deadline

    def _emit(self, item: Any, timeout: float | None = None) -> None:
        """Hand an item to the output thread, waiting while its queue is full (backpressure from
        a slow detokenizer). Without a timeout the wait ends once the drain's time is up (the item
        is dropped: nobody is reading); with one, `queue.Full` says it could not be queued."""
        # [ZH-START]
        # 1. 往 outbox（最多 64 项）放；默认每次最多等 0.1 秒，然后重试——反分词进程慢，
        #    引擎就跟着等，但不丢。
        # 2. 给了 timeout 时 queue.Full 直接抛给调用方。
        # 3. 没给 timeout：stop 已置位就启动 drain 计时（同时定下放弃时间）；超过 output.give_up_at
        #    说明没人在读，丢弃这一项返回。
        # [ZH-END]
        while True:
            try:
                self.outbox.put(item, timeout=timeout if timeout is not None else 0.1)
                return
            except queue.Full:
                if timeout is not None:
                    raise
                if self._stop.is_set():
                    self._start_drain_clock()
                if time.monotonic() > self.output.give_up_at:
                    return

    def _shutdown(self, reason: str) -> None:
        # [ZH-START]
        # 1. 放弃时间 = 现在 + 2 秒（SHUTDOWN_SEND_S），置 input.stopping 让输入线程退出。
        # 2. 依次放入 EngineStatus(alive=False, 原因) 和 STOP，各最多等 2 秒；放不进只记警告。
        # 3. join 两个线程（各最多 3 秒），关闭 socket，释放安全设置。
        # [ZH-END]
        self.output.give_up_at = time.monotonic() + SHUTDOWN_SEND_S
        self.input.stopping.set()
        try:
            self._emit(self._status(False, p.clip(reason)), timeout=SHUTDOWN_SEND_S)
            self._emit(STOP, timeout=SHUTDOWN_SEND_S)
        except queue.Full:
            log.warning("could not queue the last messages: the detokenizer is not reading")
        for t in self._threads:
            t.join(timeout=SHUTDOWN_SEND_S + 1)
        self._in_sock.close(linger=0)
        self._control_sock.close(linger=0)
        self._out_sock.close(linger=0)
        self.security.close()

    def _compile_format(self, fmt: dict) -> None:
        """The input thread's compile of a response_format (ValueError if it does not compile):
        the one engine call made off the step loop, thread-safe by design. While the engine loads,
        nothing: its `add_request` compiles those on the step loop, bounded by llguidance's limits."""
        engine = self.engine
        if engine is not None and hasattr(engine, "compile_response_format"):
            engine.compile_response_format(fmt)

    def _set_state(self, state: str) -> None:
        self.state = state
        self.metrics.set_state(state)

    def _stage_stats(self) -> dict[str, Any]:
        """The engine's stats and the stage's own counts, as every status message carries them."""
        book = self.admission
        return dict(self.engine.stats(), num_live=len(book.live), num_queued=len(book.backlog),
                    num_clients=book.shares.num_clients,
                    live_bytes=book.live_bytes, queued_bytes=self.input.queued_bytes, num_steps=self.num_steps,
                    rejected_frames=sum(self.rejects.counts.values()),
                    formats_refused_at_intake=self.input.num_formats_refused)

    def _status(self, alive: bool, reason: str = "") -> p.EngineStatus:
        return p.EngineStatus(alive=alive, instance_id=self.instance_id, reason=reason, stats=self.latest_stats,
                              state=self.state, uptime_s=time.monotonic() - self.started_at)
