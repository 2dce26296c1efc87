"""The engine stage's output thread: what the step loop hands it (`StepMessages`, status
messages, resyncs) goes to the detokenizer in order, encoded here, off the step loop; between
steps a heartbeat every `heartbeat_s`. `StreamHold` (--stream-interval) holds a request's tokens
so that, past its first, it streams several per row.
"""
# [ZH-START]
# 【模块定位】引擎 stage 的输出线程：主线程交来的 StepMessages、状态消息、resync 按顺序编码、
# 推给反分词进程；编码在这里做，不占主线程；两步之间每 heartbeat_s 发一次心跳。
# StreamHold（--stream-interval）按请求攒 token，第一个之后每行发几个。
# [ZH-END]
from __future__ import annotations

import dataclasses
import queue
import time
from array import array
from dataclasses import dataclass, field
from typing import Callable

import zmq

from nanovllm.engine.llm_engine import RequestOutput
from nanovllm_client import protocol as p


def output_row(out: RequestOutput, token_ids: list[int] | array | None = None) -> p.OutputRow:
    """The wire's row for an engine output (its new tokens, or `token_ids`: a resync's whole
    output), the error cut to what the wire carries: the one place one is made."""
    ids = out.new_token_ids if token_ids is None else token_ids
    return p.OutputRow(request_id=out.request_id, token_ids=p.pack_token_ids(ids), finished=out.finished,
                       finish_reason=out.finish_reason, num_prompt_tokens=out.num_prompt_tokens,
                       num_output_tokens=out.num_output_tokens, num_cached_tokens=out.num_cached_tokens,
                       error=p.clip(out.error) if out.error else None,
                       logprobs=out.logprobs if token_ids is None else None,
                       prompt_logprobs=out.prompt_logprobs if token_ids is None else None)


@dataclass
class StepMessages:
    """What one pass of the step loop sends the detokenizer: the requests it admitted and refused
    (their meta goes before their first output) and the outputs, from the engine's step or made
    here (a request aborted before admission ends at once). The admission code adds to it; the
    output thread turns it into `StepOutput` frames."""
    # [ZH-START]
    # 【职责】主线程一轮要告诉反分词进程的全部：准入的请求（StartedRow，
    # meta 总在它的第一个输出之前）、被拒的（RejectedRow，带原因）、输出（引擎这一步的，
    # 加上未准入就被 abort、当场结束的）。
    # 【边界】只是容器：不编码、不发送；输出线程把它变成一个或几个 StepOutput 帧。
    # 【协作者】EngineStage.run_once 创建；Admission 的 queue / admit / abort 往里加；Output.loop 里
    # StreamHold 与 encode_step 取用。
    # [ZH-END]
    started: list[p.StartedRow] = field(default_factory=list)
    rejected: list[p.RejectedRow] = field(default_factory=list)
    outputs: list[RequestOutput] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.started or self.rejected or self.outputs)


STOP = object()
"""Put last in the outbox: send what is held, then end the thread."""
OUTBOX_SIZE = 64
"""Items the step loop may be ahead of the output thread: a slow detokenizer slows the engine, never loses."""


class StreamHold:
    """Output tokens held in the output thread so that, past its first, a request streams
    `interval` tokens per row instead of one per step.

    Each row costs the detokenizer and the client a wake-up, a frame and a delta whatever it
    carries; on a machine where those share the engine's cores that CPU comes out of the model
    step. A request's first output goes at once (time to first token is unchanged), its last
    one too (with whatever is held), and everything held goes before any other message the
    output thread sends: the heartbeat (every `heartbeat_s`, so nothing is held longer), a
    resync, a status. Interval 1 holds nothing.
    """
    # [ZH-START]
    # 【职责】输出线程里按请求攒 token：第一个输出立即发（TTFT 不变），之后每攒够 interval 个 token
    # 才发一行，结束的输出连同攒着的一起立即发；输出线程发任何别的消息（心跳、resync、状态）
    # 之前先把攒着的全部发出，所以顺序不变，且攒着的 token 最多等一个心跳周期（heartbeat_s）。
    # interval = 1 时什么都不攒。
    # 【边界】只在输出线程里用（不加锁）；不改 token、不改计数——合并后的行用最后一个输出的计数，
    # token 按顺序拼接；不管 started / rejected 行（它们总是立即发）。
    # 【协作者】Output.loop：每个 StepMessages 调 take，发心跳 / Message / 退出前调 flush；
    # 行由 Output.encode_step 编码。
    # [ZH-END]

    def __init__(self, interval: int = 1):
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise ValueError(f"stream interval must be an integer >= 1, got {interval!r}")
        self.interval = interval
        self._held: dict[str, RequestOutput] = {}
        """request id -> its outputs not yet sent, merged into one."""
        self._streaming: set[str] = set()
        """Requests whose first output has gone and whose last has not."""

    def take(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """This step's outputs -> the ones to send now, each carrying what was held before it."""
        # [ZH-START]
        # 1. interval == 1：原样返回。
        # 2. 逐个输出：与这个请求攒着的输出合并（token 按顺序拼接，计数取本步的）。
        # 3. 结束了、或是这个请求的第一个输出、或攒够 interval 个 token → 放进返回列表；
        #    结束的从 _streaming 去掉，否则加入 _streaming。
        # 4. 否则记进 _held，本步不发。
        # [ZH-END]
        if self.interval == 1:
            return outputs
        due = []
        for out in outputs:
            held = self._held.pop(out.request_id, None)
            if held is not None:
                out = _merged(held, out)
            if out.finished or out.request_id not in self._streaming or len(out.new_token_ids) >= self.interval:
                due.append(out)
                if out.finished:
                    self._streaming.discard(out.request_id)
                else:
                    self._streaming.add(out.request_id)
            else:
                self._held[out.request_id] = out
        return due

    def flush(self) -> list[RequestOutput]:
        """Everything held, to send now (in the order the requests were held)."""
        held, self._held = self._held, {}
        return list(held.values())


def _merged(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One output for two consecutive ones of a request: the tokens (and logprobs) of both, the
    counts and ending of the later."""
    # Entries cover each output's last tokens (`OutputRow.logprobs`): joined, they cover the last of both.
    logprobs = (earlier.logprobs + later.logprobs
                if earlier.logprobs is not None and later.logprobs is not None else later.logprobs)
    return dataclasses.replace(later, new_token_ids=earlier.new_token_ids + later.new_token_ids, logprobs=logprobs,
                               prompt_logprobs=earlier.prompt_logprobs or later.prompt_logprobs)


class Output:
    # [ZH-START]
    # 【职责】输出线程的全部状态：outbox（主线程放、本线程取）、StreamHold、推送 socket、心跳节奏、
    # 放弃时间 give_up_at。
    # 【边界】只在输出线程里跑（give_up_at 由主线程在停机时设置）；不碰引擎、不做准入；
    # 编码与打包都在这里。
    # 【协作者】EngineStage（_emit 往 outbox 放，_shutdown 放 STOP 并设 give_up_at）；StreamHold；
    # detok_proc 收它推出的帧。
    # [ZH-END]

    def __init__(self, sock: zmq.Socket, instance_id: str, heartbeat: Callable[[], p.EngineStatus],
                 heartbeat_s: float, stream_interval: int = 1):
        self.sock = sock
        self.instance_id = instance_id
        self.heartbeat = heartbeat
        """The stage's current status (alive), sent as the heartbeat."""
        self.heartbeat_s = heartbeat_s
        self.hold = StreamHold(stream_interval)
        self.outbox: queue.Queue = queue.Queue(maxsize=OUTBOX_SIZE)
        self.give_up_at = float("inf")
        """Past this a frame the detokenizer does not take is dropped (set when the stage stops)."""

    def loop(self) -> None:
        # [ZH-START]
        # 1. next_heartbeat = 现在 + heartbeat_s（默认 0.25 秒）。
        # 2. 从 outbox 取一项，最多等到下次心跳；超时就生成一个 EngineStatus(alive=True) 作为心跳。
        # 3. 取到 STOP → 先发出 StreamHold 攒着的输出，退出线程。
        # 4. Message（心跳、状态、resync）：先发出攒着的输出（顺序不变），是 EngineStatus
        #    就重置心跳计时，再 encode 发送。
        # 5. StepMessages：输出先过 StreamHold.take（--stream-interval 攒 token），
        #    再交给 encode_step（打包在这个线程做，不占主线程）；什么都不用发就不发帧。
        #    过了放弃时间的帧发不出去就丢，但队列照样清空。
        # 6. 引擎很忙、一直有 step 时，到点也额外发一次心跳（之前同样先发攒着的），
        #    反分词进程才能持续拿到统计并确认存活；攒着的 token 因此最多等一个心跳周期。
        # [ZH-END]
        next_heartbeat = time.monotonic() + self.heartbeat_s
        while True:
            try:
                item = self.outbox.get(timeout=max(0.0, next_heartbeat - time.monotonic()))
            except queue.Empty:
                item = self.heartbeat()
            if item is STOP:
                self._send_held()
                return
            # Past the give-up time a frame nobody reads is dropped; the loop still empties the queue.
            if isinstance(item, p.Message):
                if isinstance(item, p.EngineStatus):
                    next_heartbeat = time.monotonic() + self.heartbeat_s
                self._send_message(item)
            else:
                step = StepMessages(started=item.started, rejected=item.rejected,
                                    outputs=self.hold.take(item.outputs))
                if step:
                    for frame in self.encode_step(step):
                        self._send(frame)
            if time.monotonic() >= next_heartbeat:  # busy engines still report their stats
                self._send_message(self.heartbeat())
                next_heartbeat = time.monotonic() + self.heartbeat_s

    def _send_message(self, msg: p.Message) -> None:
        self._send_held()  # whatever is held goes first: the order of everything is kept
        self._send(msg.encode())

    def _send_held(self) -> None:
        held = self.hold.flush()
        if held:
            for frame in self.encode_step(StepMessages(outputs=held)):
                self._send(frame)

    def _send(self, frame: bytes) -> bool:
        """Push one frame, waiting at the HWM (backpressure from a slow detokenizer); while
        stopping, give up after `SHUTDOWN_SEND_S` so a vanished detokenizer cannot hold us."""
        # [ZH-START]
        # 1. NOBLOCK 推一帧，成功返回 True。
        # 2. zmq.Again（到达 HWM，反分词进程慢）：超过 _give_up_at 返回 False；
        #    否则 poll POLLOUT 100 ms 再试。
        # [ZH-END]
        while True:
            try:
                self.sock.send(frame, zmq.NOBLOCK)
                return True
            except zmq.Again:
                if time.monotonic() > self.give_up_at:
                    return False
                self.sock.poll(100, zmq.POLLOUT)

    def encode_step(self, step: StepMessages) -> list[bytes]:
        """The step as StepOutput frames; token ids packed (one C call per request, no per-token
        loop). One frame, unless it would exceed the frame limit (a step that starts many requests
        whose meta carries long stop strings): then several, in order, started rows first."""
        # [ZH-START]
        # 1. 每个输出经 output_row 变成一个 OutputRow（按关键字建：id、打包的新 token、finished、
        #    结束原因、prompt / output / cached 数、error），token 打包是每请求一次 C 调用，
        #    没有逐 token 的 Python 循环。
        # 2. 连同引擎实例 id、started、rejected 组成 StepOutput 帧：通常一帧；超过帧大小上限
        #    （一步开始了很多带长 stop string 的请求）就用 frames_within
        #    按顺序拆成几帧，started 仍在前。
        # [ZH-END]
        rows = [output_row(o) for o in step.outputs]
        tagged = [(0, r) for r in step.started] + [(1, r) for r in step.rejected] + [(2, r) for r in rows]

        def make(part: list) -> p.StepOutput:
            started, rejected, outputs = ([r for kind, r in part if kind == k] for k in range(3))
            return p.StepOutput(instance_id=self.instance_id, started=started, rejected=rejected, outputs=outputs)
        return [frame for _, frame in p.frames_within(make, tagged)]
