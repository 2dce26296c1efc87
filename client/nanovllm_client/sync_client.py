"""Blocking client: one object carries many concurrent streams from many threads.

ZeroMQ sockets are not thread-safe, so one background I/O thread owns both sockets (DEALER to
the tokenizer for requests/aborts, DEALER to the detokenizer for outputs) and the protocol state
(`ClientState`: requests in flight, stage health, resends and resumes across stage restarts).
User threads hand it commands through a lock-guarded inproc PUSH and read their deltas from a
per-stream queue.
"""
# [ZH-START]
# 【模块定位】阻塞式客户端库，位于整条流水线的两端：
#   应用 →【Client：DEALER】─请求→ 分词进程 → 引擎进程 → 反分词进程 ─增量→【DEALER：Client】
#        → Stream 迭代器 → 应用
# 一个 Client 对象可被多个线程同时使用、承载多条并发流。ZeroMQ socket 不是线程安全的，
# 所以由一个后台 I/O 线程独占两个 DEALER（发往分词进程的请求 / abort，来自反分词进程的输出）
# 和协议状态 ClientState（在途请求、各 stage 的健康、stage 重启后的重发与续传）；
# 用户线程通过加锁的 inproc PUSH 给它发命令，从每条流自己的队列里读增量。
# 只依赖 pyzmq + msgpack，不装 torch。
# [ZH-END]
from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from typing import Any

import zmq

from . import commands
from . import protocol as p
from .client_state import ClientBase, Delta, Result, build_request, merge
from .security import CurveKeys
from .throttle import ThrottledWarnings
from .errors import EngineDeadError, RequestError, RequestTimeoutError, ServiceUnavailableError

log = logging.getLogger("nanovllm_client")

_GENERATE, _ABORT, _TO_STREAM, _TO_TOKENIZER, _STOP = b"g", b"a", b"s", b"t", b"x"
READ_BATCH = 256
"""Most frames the I/O thread reads from one socket before it turns to its heartbeat and commands."""
_instances = itertools.count()


def _send_now(sock: zmq.Socket, frame: bytes) -> bool:
    """Send `frame` if the socket takes it at once; False if not. A look at POLLOUT first is no
    promise: a connection whose handshake fails (a CURVE server, no key) drops its pipe between the
    look and the send, which then raises."""
    try:
        sock.send(frame, zmq.NOBLOCK)
        return True
    except zmq.Again:
        return False


class Stream:
    """Iterator over one request's deltas. Breaking out, `cancel()` or garbage collection aborts it."""
    # [ZH-START]
    # 【职责】一个请求的增量迭代器：按截止时间等待下一个 Delta，看到终止增量就结束并释放请求 id，
    # 出错时（raise_on_error）抛 EngineDeadError / RequestError；中途 break、
    # cancel() 或被回收都会 abort 该请求。
    # 【边界】不碰 socket（一切经 Client 的 I/O 线程）；不拼接文本（Client.generate 用 merge 拼）。
    # 【协作者】Client.stream 创建它；它读的 Queue 由 I/O 线程的 _route 填充；
    # cancel 经 Client._send 发 abort。
    # [ZH-END]

    def __init__(self, client: Client, request_id: str, wire_id: str, deltas: queue.Queue, deadline: float,
                 raise_on_error: bool):
        self.request_id = request_id
        self._wire_id = wire_id
        self._client, self._deltas, self._deadline = client, deltas, deadline
        self._raise_on_error = raise_on_error
        self._done = False

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Delta:
        # [ZH-START]
        # 1. 已结束 → StopIteration。
        # 2. 从本流的队列取一个增量，最多等到 deadline；超时 → cancel()（在服务端 abort）
        #    并抛 RequestTimeoutError。
        # 3. 把增量的 request_id 换回调用方给的 id（线上用的是 wire id "<id>#<n>"）。
        # 4. 终止增量：标记结束，_end_stream 释放 id（之后可立即复用）；
        #    finish_reason 为 error 且 raise_on_error → engine_dead 时抛 EngineDeadError，
        #    否则抛 RequestError。
        # 5. 返回增量。
        # [ZH-END]
        if self._done:
            raise StopIteration
        try:
            delta = self._deltas.get(timeout=max(0.0, self._deadline - time.monotonic()))
        except queue.Empty:
            self.cancel()
            raise RequestTimeoutError(f"request {self.request_id} did not finish within its timeout") from None
        delta.request_id = self.request_id
        if delta.finished:
            self._done = True
            self._client._end_stream(self.request_id, self._wire_id)
            if delta.finish_reason is p.FinishReason.ERROR and self._raise_on_error:
                error = EngineDeadError if delta.engine_dead else RequestError
                raise error(delta.error or "request failed", self.request_id)
        return delta

    def cancel(self) -> None:
        """Abort the request in the engine (idempotent); the iterator ends."""
        # [ZH-START]
        # 1. 已结束则什么都不做（幂等）。
        # 2. 标记结束，_end_stream 注销本流（之后到达的输出被丢弃）。
        # 3. 向 I/O 线程发 _ABORT 命令（wire id + AbortReq 帧）；
        #    它经分词进程到达引擎的 control socket（引擎再忙也读），释放 KV 块；
        #    比请求先到时引擎记住它，请求一到就结束。
        # [ZH-END]
        if not self._done:
            self._done = True
            self._client._end_stream(self.request_id, self._wire_id)
            self._client._send(_ABORT, self._wire_id.encode(), p.AbortReq(request_id=self._wire_id).encode())

    def __del__(self) -> None:
        try:
            self.cancel()
        except Exception:
            pass


class Client(ClientBase):
    """`Client("ipc:///run/nanovllm")` or `Client("tcp://127.0.0.1:5550")`; a context manager."""
    # [ZH-START]
    # 【职责】同步客户端：对外提供 stream / generate / abort / server_stats / wait_engine / close，
    # 以及命令 tokenize / detokenize / reset_prefix_cache（commands.py，一问一答）；
    # 对内一个后台 I/O 线程持有两个 DEALER 和 ClientState，定时 ping 两个 stage，
    # 把收到的帧变成增量分发到各流。
    # 【边界】协议逻辑（分词进程重启后重发、反分词进程重启后 Resume、引擎死亡判定）
    # 在 client_state.ClientState，与 AsyncClient 共用，这里只做 I/O 和线程间传递；
    # 不重试失败的请求（引擎死不算失败：ClientState 在新引擎实例起来后把在途请求连同已收到的输出
    # 重发，由新引擎续写）；两个 DEALER 用同一个随机路由 id，以便反分词进程把输出路由回来。
    # 【协作者】tokenizer_proc（GenerateReq / AbortReq / Ping / 命令）；
    # detok_proc（Ping / StatsReq / Resume，收 StreamOutput / Pong / EngineStatus / StatsOutput）；
    # Stream；ClientBase 提供地址、id 分配和超时；commands 建命令、读回答。
    # [ZH-END]

    def __init__(self, url: str | None = None, *, timeout: float | None = 600.0,
                 connect_timeout: float = 30.0, heartbeat_interval: float = 1.0, hwm: int = 10_000,
                 stage_timeout: float = 30.0, curve: tuple[CurveKeys, bytes] | None = None,
                 engine_restart_wait_s: float = 60.0, insecure_tcp: bool = False):
        # [ZH-START]
        # 1. ClientBase 初始化：服务 URL 解析成五个端点（tokenizer、stream、engine、detok、
        #    control）；CURVE 密钥取自参数、环境变量指定的密钥文件，或 loopback tcp
        #    服务的实例密钥（insecure_tcp 时不用）；随机路由 id（开了 CURVE 时以密钥标签开头）；
        #    超时与 ClientState。
        # 2. _ready 事件：反分词进程回了 pong（它已认识我们的路由 id）之后才置位。
        # 3. _streams：wire id → 该流的 Queue；_stats：server_stats 的回复队列。
        # 4. 新建 zmq.Context，绑定一个本实例唯一的 inproc 命令端点，PUSH 端由 _cmd_lock 保护；
        #    _warnings 给 I/O 线程限频告警（ThrottledWarnings），坏帧再多也不会每帧一行。
        # 5. 启动守护线程 _io_loop。
        # [ZH-END]
        super().__init__(url, timeout, connect_timeout, heartbeat_interval, hwm, stage_timeout, curve,
                         engine_restart_wait_s, insecure_tcp)
        self._ready = threading.Event()
        self._streams: dict[str, queue.Queue] = {}
        self._stats: queue.Queue = queue.Queue()
        self._ctx = zmq.Context()
        self._cmd_endpoint = f"inproc://nanovllm-client-{next(_instances)}"
        self._cmd_lock = threading.Lock()
        self._cmd = self._ctx.socket(zmq.PUSH)
        self._cmd.bind(self._cmd_endpoint)
        self._closed = False
        self._warnings = ThrottledWarnings(log)
        """For the I/O thread's warnings, which a flood would otherwise repeat once a frame."""
        self._io = threading.Thread(target=self._io_loop, name="nanovllm-client-io", daemon=True)
        self._io.start()

    # ------------------------------------------------------------------ public API

    def stream(self, prompt: Any = None, *, timeout: float | None = None, raise_on_error: bool = True,
               **kwargs: Any) -> Stream:
        """Start a request; iterate the result for `Delta`s. See `build_request` for arguments."""
        # [ZH-START]
        # 1. build_request：检查参数，建 GenerateReq。
        # 2. _wait_ready：等反分词进程应答 ping，最多 connect_timeout；
        #    不然抛 ServiceUnavailableError——在它认识我们的路由 id 之前发请求，
        #    输出可能被 ROUTER 丢掉。
        # 3. _refuse_if_unavailable：服务在 draining → ServiceDrainingError；
        #    已知引擎死亡且不等新引擎（engine_restart_wait_s 为 0）→ EngineDeadError，
        #    否则请求留着等下一个引擎。
        # 4. _claim：分配 wire id "<id>#<序号 hex>"，得到请求帧和 resend 帧；
        #    同一 id 仍在途 → ValueError。
        # 5. 先建队列登记到 _streams，再发送，保证第一个增量到达时一定有人接。
        # 6. 向 I/O 线程发 _GENERATE（wire id、帧、resend 帧）。
        # 7. 返回 Stream（deadline = 该请求的 timeout，否则客户端默认值）。
        # [ZH-END]
        req = build_request(prompt, **kwargs)
        self._wait_ready()
        self._refuse_if_unavailable(req.request_id)
        wire_id, frame, resend_frame = self._claim(req)
        # Not a SimpleQueue: its get(timeout) blocks for good once a signal handler runs past the deadline.
        deltas: queue.Queue = queue.Queue()
        self._streams[wire_id] = deltas
        self._send(_GENERATE, wire_id.encode(), frame, resend_frame)
        return Stream(self, req.request_id, wire_id, deltas, self._deadline(timeout), raise_on_error)

    def generate(self, prompt: Any = None, **kwargs: Any) -> Result:
        """Run a request to completion and return the whole answer."""
        s = self.stream(prompt, **kwargs)
        return merge(list(s), s.request_id)

    def abort(self, request_id: str) -> None:
        """Abort the stream of `request_id` (idempotent: unknown or finished ids are ignored)."""
        # [ZH-START]
        # 1. 按调用方 id 查在途的 wire id；不存在（未知或已结束）就忽略——abort 是幂等的。
        # 2. _end_stream 注销该流，再向 I/O 线程发 _ABORT 命令（AbortReq 帧经分词进程发往引擎）。
        # [ZH-END]
        wire_id = self._wire_ids.get(request_id)
        if wire_id is not None:
            self._end_stream(request_id, wire_id)
            self._send(_ABORT, wire_id.encode(), p.AbortReq(request_id=wire_id).encode())

    def server_stats(self, timeout: float = 10.0) -> dict[str, Any]:
        """The detokenizer's state sizes and the engine's latest stats (from its heartbeat)."""
        self._wait_ready()
        self._send(_TO_STREAM, p.StatsReq().encode())
        try:
            return self._stats.get(timeout=timeout)
        except queue.Empty:
            raise ServiceUnavailableError(f"no stats reply within {timeout}s") from None

    def tokenize(self, prompt: str | list[dict[str, Any]], *, timeout: float = 10.0,
                 **options: Any) -> commands.Tokenized:
        """`prompt` (a text, or a chat's messages) as the service tokenizes it; `options`:
        `commands.tokenize_request`'s. RequestError with the service's words if it refuses."""
        return self._command(commands.tokenize_request(prompt, **options), timeout)

    def detokenize(self, token_ids: list[int], *, timeout: float = 10.0) -> str:
        """Token ids back to text (special tokens kept); RequestError for an id outside the vocabulary."""
        return self._command(commands.detokenize_request(token_ids), timeout)

    def reset_prefix_cache(self, *, timeout: float = 10.0) -> int:
        """Forget every cached KV block no running request holds; returns how many.
        ServiceDrainingError while the service drains."""
        return self._command(commands.reset_prefix_cache_request(), timeout)

    def wait_engine(self, timeout: float = 60.0) -> None:
        """Block until the engine is up (e.g. right after starting the service)."""
        deadline = time.monotonic() + timeout
        self._wait_ready()
        while self._state.engine_alive is not True:
            if time.monotonic() > deadline:
                raise EngineDeadError(f"engine not available after {timeout}s")
            time.sleep(0.05)

    def close(self, linger: float = 1.0) -> None:
        """Abort every request in flight, flush, and stop the I/O thread."""
        # [ZH-START]
        # 1. 已关闭则返回。
        # 2. abort 所有在途请求，再发 _STOP 让 I/O 线程退出；最多等 linger + 5 秒。
        #    I/O 线程已不在（_send 抛 ServiceUnavailableError）就跳过这一步，照样清理。
        # 3. 标记关闭，关闭命令 socket；I/O 线程已退出才 terminate context（它的 socket 没关时
        #    term() 会永远等）。
        # [ZH-END]
        if self._closed:
            return
        try:
            for app_id in list(self._wire_ids):
                self.abort(app_id)
            self._send(_STOP)
        except ServiceUnavailableError:
            pass  # the I/O thread is gone (it logged why): nothing to flush, still release what is left
        self._io.join(timeout=linger + 5)
        self._closed = True
        self._cmd.close(linger=0)
        if self._io.is_alive():  # term() would wait for its sockets forever
            log.warning("the client's I/O thread did not stop within %.0f s: its sockets are left open", linger + 5)
        else:
            self._ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _wait_ready(self) -> None:
        if not self._ready.wait(self.connect_timeout):
            if not self._io.is_alive():
                raise ServiceUnavailableError("the client's I/O thread has stopped")
            raise ServiceUnavailableError(
                f"no answer from the service's detokenizer at {self.endpoints.stream} within {self.connect_timeout}s")

    def _end_stream(self, app_id: str, wire_id: str) -> None:
        self._streams.pop(wire_id, None)
        self._release(app_id, wire_id)

    def _command(self, msg: p.Message, timeout: float) -> Any:
        """Send a command to the tokenizer and wait for its answer (`commands.answer`)."""
        self._wait_ready()
        replies: queue.Queue = queue.Queue()
        self._replies[msg.request_id] = replies
        try:
            self._send(_TO_TOKENIZER, msg.encode())
            try:
                reply = replies.get(timeout=timeout)
            except queue.Empty:
                raise ServiceUnavailableError(f"no answer to the {msg.TYPE} command within {timeout}s") from None
        finally:
            self._replies.pop(msg.request_id, None)
        return commands.answer(reply)

    def _send(self, *command: bytes) -> None:
        # [ZH-START]
        # 1. 已关闭 → RuntimeError。
        # 2. 在 _cmd_lock 内把命令（多帧）NOBLOCK 发到 inproc PUSH：多个用户线程共用一个
        #    socket，锁保证不交错。
        # 3. zmq.Again：I/O 线程已不在（没有读的一方，阻塞发送会永远等下去）→
        #    ServiceUnavailableError；否则是管道满，等 100 ms 可写再试。
        # [ZH-END]
        if self._closed:
            raise RuntimeError("client is closed")
        with self._cmd_lock:
            while True:  # not a blocking send: with the I/O thread gone there is no reader, and it would block for good
                try:
                    self._cmd.send_multipart(list(command), zmq.NOBLOCK)
                    return
                except zmq.Again:
                    if not self._io.is_alive():
                        raise ServiceUnavailableError("the client's I/O thread has stopped") from None
                    self._cmd.poll(100, zmq.POLLOUT)

    def _io_loop(self) -> None:
        # [ZH-START]
        # 1. 在 I/O 线程里创建全部 socket：发往分词进程的 DEALER、发往反分词进程的 DEALER（同一路由
        #    id）、接收命令的 PULL；backlog 为两个 DEALER 各暂存一队对方暂时收不下的帧（I/O
        #    线程从不阻塞在发送上，否则一个不再读的 stage 会卡住所有流和心跳）。
        # 2. 循环：
        #    a. 到了 ping 时间：
        #       - 先把下次 ping 定在 0.1 秒后，这一段即使出错，循环也不会空转；
        #       - ClientState.check_detok()：反分词进程沉默太久就让在途的流失败，结果分发给各流；
        #         未就绪就清掉 _ready；
        #       - 给两个进程各发一个 NOBLOCK 的 Ping，发不出就说明对方不在，跳过。
        #         这里不先查 POLLOUT：握手失败的连接可能在"查"和"发"之间丢掉管道，
        #         send 照样会抛 Again；
        #       - 已就绪时，下次 ping 定在单调时钟上 heartbeat_interval（默认 1 秒）
        #         的下一个整数倍（_ping_wait），同一台机器上的客户端会同时 ping，
        #         进程醒一次就能处理完；未就绪则仍是 0.1 秒后，尽快完成握手；
        #    b. 哪个 DEALER 有积压，才关心它的可写事件；
        #    c. poll 到下次 ping 为止；
        #    d. 有命令 → _drain_commands；收到 _STOP 就跳出循环；
        #    e. 各 DEALER 可写时按序发出积压帧（背压时保持顺序，abort 不会越过请求）；
        #    f. 两个 DEALER 有帧 → _drain_incoming；
        #    g. 一轮里的任何异常只记（限频的）警告，循环继续：所有流都在等这个线程，
        #       它死了连 close() 的 _STOP 也无人接收。
        # 3. 退出时：把积压帧（close() 排下的 abort）NOBLOCK 交给 zmq（linger 1 秒），
        #    然后关闭已建好的 socket（建到一半失败也关，否则 close() 里的 term() 会一直等）。
        # [ZH-END]
        socks: list[zmq.Socket] = []  # closed on the way out, however far the setup got
        backlog: dict[zmq.Socket, collections.deque[bytes]] = {}
        try:
            tok = self._dealer(self._ctx, self.endpoints.tokenizer)
            socks.append(tok)
            out = self._dealer(self._ctx, self.endpoints.stream)
            socks.append(out)
            cmd = self._ctx.socket(zmq.PULL)
            socks.append(cmd)
            cmd.connect(self._cmd_endpoint)
            # Frames held while a stage pushes back, sent in order once it has room: the I/O thread never
            # blocks on a send, or a stage that stops reading would stall every stream and the heartbeat.
            backlog = {tok: collections.deque(), out: collections.deque()}
            poller = zmq.Poller()
            for sock in (tok, out, cmd):
                poller.register(sock, zmq.POLLIN)
            next_ping = 0.0
            while True:
                try:
                    now = time.monotonic()
                    if now >= next_ping:
                        next_ping = now + self._ping_wait(False)  # first: a pass that fails cannot spin
                        self._route(self._state.check_detok())
                        if not self._state.ready:
                            self._ready.clear()
                        for sock in (out, tok):  # a full pipe means that stage is gone: no ping
                            _send_now(sock, p.Ping().encode())
                        if self._ready.is_set():
                            next_ping = time.monotonic() + self._ping_wait(True)
                    for sock, held in backlog.items():
                        poller.modify(sock, zmq.POLLIN | (zmq.POLLOUT if held else 0))
                    events = dict(poller.poll(max(1, int((next_ping - time.monotonic()) * 1000))))
                    if cmd in events and self._drain_commands(cmd, tok, out, backlog):
                        break
                    for held_sock, held in backlog.items():
                        while held and _send_now(held_sock, held[0]):
                            held.popleft()
                    for sock in (tok, out):
                        if sock in events:
                            self._drain_incoming(sock, tok, out, backlog)
                except Exception:  # every stream waits on this thread: it must outlive any one failure
                    self._warnings.warn("io", "the client's I/O loop failed (it goes on)", exc_info=True)
        finally:
            for sock, held in backlog.items():  # aborts queued by close(): hand them to zmq, which lingers 1 s
                while held and _send_now(sock, held[0]):
                    held.popleft()
            for sock in socks:
                sock.close()

    def _drain_commands(self, cmd: zmq.Socket, tok: zmq.Socket, out: zmq.Socket,
                        backlog: dict[zmq.Socket, collections.deque]) -> bool:
        # [ZH-START]
        # 1. NOBLOCK 取完所有命令。
        # 2. _STOP → 返回 True，让 I/O 循环退出。
        # 3. _GENERATE：ClientState.sent(wire id, resend 帧, 请求帧) 登记在途（供重发 / 续传），
        #    请求帧进分词进程的积压队列；
        #    已知引擎死亡时 sent 返回 False：请求先留着，等新引擎起来由 _unpark
        #    发出（在它自己的超时之内）。
        # 4. _ABORT：ClientState.forget(wire id)，abort 帧进同一队列（与请求同一队列，顺序不乱）。
        # 5. _TO_STREAM（StatsReq）：反分词进程有空位就 NOBLOCK 发出；没有（有积压或管道满）
        #    就丢弃并记警告，server_stats() 等不到回复会报超时。
        # 6. _TO_TOKENIZER（命令帧，如 TokenizeReq）：进分词进程的积压队列，与请求同序发出。
        # [ZH-END]
        while True:
            try:
                command = cmd.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return False
            kind = command[0]
            if kind == _STOP:
                return True
            if kind == _GENERATE:
                if self._state.sent(command[1].decode(), command[3], command[2]):  # else kept until an engine is up
                    backlog[tok].append(command[2])
            elif kind == _ABORT:
                self._state.forget(command[1].decode())
                backlog[tok].append(command[2])
            elif kind == _TO_TOKENIZER:
                backlog[tok].append(command[1])
            elif backlog[out] or not _send_now(out, command[1]):  # a stats request the detokenizer has no room for
                self._warnings.warn("stats", "the detokenizer takes no frames: a stats request was dropped")

    def _drain_incoming(self, sock: zmq.Socket, tok: zmq.Socket, out: zmq.Socket,
                        backlog: dict[zmq.Socket, collections.deque]) -> None:
        # [ZH-START]
        # 1. NOBLOCK 收该 socket 的帧，最多 READ_BATCH（256）帧就回到 I/O 循环（心跳和命令不能被一股
        #    帧流饿死；剩下的帧下一轮 poll 还会报告），逐帧交给 _take_frame（ClientState.handle；
        #    就绪 → 置位 _ready；stats 回复进 _stats 队列；处理出错只记日志跳过这一帧，
        #    I/O 线程不能死——所有流都在等它）。
        # 2. 需要重发给分词进程的请求（分词进程换了实例）和发给反分词进程的 Resume
        #    进各自的积压队列，由 I/O 循环按序发出。
        # 3. _route 把增量分发到各流。
        # [ZH-END]
        for _ in range(READ_BATCH):  # then back to the loop: a stream of frames must not starve the heartbeat
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            reaction = self._take_frame(frame)
            if reaction is None:
                continue
            backlog[tok].extend(reaction.to_tokenizer)
            backlog[out].extend(reaction.to_detok)
            self._route(reaction.deltas)
