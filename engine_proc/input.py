"""The engine stage's input thread: it reads the input socket (requests from the tokenizer) and
the control socket (aborts and detokenizer hellos), checks each frame (a request's sampling
struct by its own validator, as it decodes), compiles a request's response_format off the step
loop, and hands everything to the step loop through `inbox`, in arrival order. It stops reading
requests while `max_queued` of them, or `max_queued_bytes`, wait for admission (the socket then
fills and the tokenizer holds its clients back); the control socket it reads whatever the load,
so an abort never waits behind the requests that fill the queue.
"""
# [ZH-START]
# 【模块定位】引擎 stage 的输入线程：读 input socket（分词进程推来的请求）
# 和 control socket（abort、DetokHello），检查每一帧（采样参数在解帧时由 SamplingParams 自己的
# 校验器检查），在这里（不占主线程）编译 response_format（引擎自己的编译钩子），
# 按到达顺序经 inbox 交给主线程。排队未准入的达到
# max_queued 个或 max_queued_bytes 字节就停止读请求（socket 填满，分词进程挡住客户端）；
# control 一直读，abort 不会排在请求后面。
# [ZH-END]
from __future__ import annotations

import queue
import threading
from typing import Any, Callable

import zmq

from nanovllm.metrics import EngineMetrics
from nanovllm.service.intake import accept, drain
from nanovllm.service.stage import RejectLog
from nanovllm_client import protocol as p

from .admission import Queued, refusal
from .ledger import request_bytes

MAX_CONTROL_BACKLOG = 65_536
"""Control messages read and not yet applied by the step loop: over this the control socket is
left unread for a moment (a flood of aborts during a long step cannot grow the inbox without end)."""


class Input:
    # [ZH-START]
    # 【职责】输入线程的全部状态：两个 PULL socket 和它们的 poller、inbox（本线程放、主线程取）、
    # 排队计数（num_queued / queued_bytes：在 inbox 或 backlog 里、未准入的请求；num_control：
    # inbox 里未取的控制消息），计数在锁里改。
    # 【边界】不碰引擎、不做准入：请求何时离开排队由 Admission 经 dequeued 回调告诉它；
    # 主线程取走控制消息时调 took_control。
    # 【协作者】EngineStage（建它、起线程、停机时置 stopping 并关 socket）；Admission（dequeued）；
    # intake.accept / drain。
    # [ZH-END]

    def __init__(self, in_sock: zmq.Socket, control_sock: zmq.Socket, max_queued: int,
                 max_queued_bytes: int, rejects: RejectLog, metrics: EngineMetrics,
                 check_format: Callable[[dict], Any] | None = None):
        self.in_sock, self.control_sock = in_sock, control_sock
        self.check_format = check_format
        """Compiles a request's response_format (ValueError if it does not compile), here, off the step loop."""
        self.num_formats_refused = 0
        """Requests refused here because their response_format does not compile."""
        self.max_queued, self.max_queued_bytes = max_queued, max_queued_bytes
        self.rejects, self.metrics = rejects, metrics
        # Not a SimpleQueue: the main loop waits on this with a timeout, and CPython's
        # SimpleQueue.get(timeout) blocks for good once a signal handler (the stop request) runs
        # past the deadline during the wait; an idle engine then never saw its SIGTERM.
        self.inbox: queue.Queue = queue.Queue()
        self.num_queued = self.queued_bytes = 0
        """Requests put in `inbox` or the backlog and not yet admitted, rejected or aborted, and their bytes."""
        self.num_control = 0
        """Control messages put in `inbox` and not yet taken by the step loop."""
        self._lock = threading.Lock()
        self.stopping = threading.Event()
        self._poller = zmq.Poller()
        self._poller.register(in_sock, zmq.POLLIN)
        self._poller.register(control_sock, zmq.POLLIN)

    def took_control(self) -> None:
        """The step loop took a control message out of `inbox`."""
        with self._lock:
            self.num_control -= 1

    def loop(self) -> None:
        # [ZH-START]
        # 1. 直到 stopping：反复 _receive()。
        # 2. 任何异常只记为 "internal" 拒绝帧：出了 bug 也只损失这一帧，
        #    输入线程（连带整个引擎）不会因此挂掉。
        # [ZH-END]
        while not self.stopping.is_set():
            try:
                self._receive()
            except Exception:  # a bug must cost one frame, never the thread (and with it the engine)
                self.rejects("internal", "unexpected error while receiving a frame", exc_info=True)

    def _receive(self) -> None:
        # [ZH-START]
        # 1. 已排队未准入的请求 >= max_queued 个，或其字节额度 >= max_queued_bytes：这一轮不读 input
        #    socket，让它填满（这条管道的 HWM 只有 64 帧），分词进程就会停下来挡住客户端；
        #    poll 只等 10 ms 就重看额度。
        # 2. control socket 一直读（abort、DetokHello、清前缀缓存的命令都很小），除非 inbox 里还有
        #    MAX_CONTROL_BACKLOG 条没被主线程取走。
        # 3. poll：control 可读 → _receive_control（一次最多 256 帧）；
        #    input 可读 → _receive_request（一帧）。
        # [ZH-END]
        full = self.num_queued >= self.max_queued or self.queued_bytes >= self.max_queued_bytes
        self._poller.modify(self.in_sock, 0 if full else zmq.POLLIN)
        self._poller.modify(self.control_sock, zmq.POLLIN if self.num_control < MAX_CONTROL_BACKLOG else 0)
        events = dict(self._poller.poll(10 if full else 100))
        if self.control_sock in events:
            self._receive_control()
        if self.in_sock in events:
            self._receive_request()

    def _receive_control(self) -> None:
        """Aborts, detokenizer hellos and cache resets: tiny, and read whatever the load."""
        drain(lambda: self.control_sock.recv_multipart(zmq.NOBLOCK), self._on_control, self.rejects)

    def _on_control(self, frames: list[bytes]) -> None:
        msg = self._accept(frames, (p.AbortReq, p.DetokHello, p.ResetPrefixCacheReq), "control")
        if msg is not None:
            self.put_control(msg)

    def _receive_request(self) -> None:
        # [ZH-START]
        # 1. 收一条，经 _accept（intake.accept）只接受 TokenizedReq（abort 和 DetokHello 走 control
        #    socket），否则按原因计数后丢弃（对面只有 stage，没有回复通道）。
        # 2. _queued：采样参数解帧时已是校验过的 SamplingParams（allowed_token_ids 存成 4 字节
        #    一个的 array）；有 response_format 就在这里（不占主线程）经 check_format 编译
        #    （按文本缓存；编译不过即拒绝，原因随 RejectedRow 回给客户端）；prompt 保持打包；
        #    额度 = 帧长 + 每个 prompt token（和续写的输出 token）40 字节。
        #    在锁内把 num_queued 加一、queued_bytes 加上额度。
        # 3. 放进 inbox，保持到达顺序。
        # [ZH-END]
        try:
            frames = self.in_sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        msg = self._accept(frames, (p.TokenizedReq,), "input")
        if msg is None:
            return
        queued = self._queued(msg, len(frames[0]))
        with self._lock:
            self.num_queued += 1
            self.queued_bytes += queued.nbytes
        self.inbox.put(queued)

    def _accept(self, frames: list[bytes], accepted: tuple, socket_name: str) -> p.Message | None:
        """The message if it is one of `accepted`; otherwise None, the frame counted as rejected
        (only stages talk to us, and they have no reply path)."""
        self.metrics.frame_received()
        msg = accept(frames, accepted, self.rejects, f"on the {socket_name} socket", f"the engine's {socket_name} socket")
        return None if isinstance(msg, p.ErrorOutput) else msg

    def _queued(self, req: p.TokenizedReq, frame_bytes: int) -> Queued:
        """Compile the request's response_format here, off the step loop (the one compile: adding
        the request later copies the result); a format that does not compile is the request's
        refusal."""
        error = None
        fmt = req.sampling.response_format
        if fmt is not None and self.check_format is not None:
            try:
                self.check_format(fmt)
            except Exception as e:
                self.num_formats_refused += isinstance(e, ValueError)
                error = refusal(e, req.request_id)
        num_tokens = (len(req.prompt_token_ids) + len(req.output_ids)) // 4  # the output to continue from too
        return Queued(req=req, error=error, nbytes=request_bytes(frame_bytes, num_tokens))

    def put_control(self, msg: p.Message) -> None:
        with self._lock:
            self.num_control += 1
        self.inbox.put(msg)

    def dequeued(self, queued: Queued) -> None:
        with self._lock:
            self.num_queued -= 1
            self.queued_bytes -= queued.nbytes
