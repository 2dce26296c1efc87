"""The engine stage: the scheduler loop around `LLMEngine.step()`.

tokenizer/detok --PUSH--> [PULL] engine [PUSH] --> detokenizer

Three threads, so socket I/O and msgpack work overlap the model step (torch releases the GIL
while it computes):
- input thread: receive, decode and check frames -> `inbox`, in arrival order. It stops reading
  the socket only while `max_queued` requests wait to be admitted (then the socket fills and the
  tokenizer holds its clients back); below that, aborts are read at once whatever the load.
- main thread: apply requests and aborts, run one step, hand the raw outputs to `outbox`.
  Requests wait in `backlog` while the engine holds `max_live`; an abort takes one out of the
  backlog at once (aborts never wait behind the admission gate).
- output thread: encode one `StepOutput` per step and push it; between steps, an
  `EngineStatus` heartbeat every `heartbeat_s`, which is how the detokenizer (and through it
  every client) knows the engine is alive. On a crash or shutdown it sends alive=False last.

Every request the engine accepted is kept (meta + output tokens so far) until it finishes, and
for a minute after (`FinishedRing`), so a detokenizer that restarts can ask for all of it
(`DetokHello` -> `Resync`) and its clients' streams continue instead of failing.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
import traceback
from typing import Any

import zmq

from prometheus_client import CollectorRegistry

from nanovllm.engine.llm_engine import RequestOutput
from nanovllm.metrics import EngineMetrics
from nanovllm_client import protocol as p
from nanovllm_client.checks import ProtocolError
from nanovllm_client.security import ServiceSecurity
from nanovllm_client.stage import DEFAULT_HWM, Notifier, RejectLog, new_instance_id, pipeline_pull, pipeline_push

from .ledger import FinishedRing, LiveRequest

log = logging.getLogger("engine_proc")

_STOP = object()
RESYNC_CHUNK = 256
"""Requests per `Resync` frame, so one frame stays far below the frame size limit."""
DRAINING = "the engine is draining (shutting down): it takes no new requests; retry on another instance or later"
RESYNC_INTERVAL_S = 1.0
SHUTDOWN_SEND_S = 2.0
"""How long a stopping engine keeps trying to push its last messages to a detokenizer that is
not reading (or gone) before it gives up and exits."""


class EngineStage:
    def __init__(self, engine: Any | None, make_sampling, input_endpoint: str, output_endpoint: str,
                 heartbeat_s: float = 0.25, max_live: int = 4096, max_queued: int = 4096,
                 drain_timeout_s: float = 30.0, out_hwm: int = DEFAULT_HWM, ctx: zmq.Context | None = None,
                 security: ServiceSecurity | None = None, metrics: EngineMetrics | None = None):
        self.engine = engine
        """None until `run` loads it: meanwhile the stage answers, and says it is loading."""
        self.state = "ready" if engine is not None else "loading"
        self.started_at = time.monotonic()
        self.drain_timeout_s = drain_timeout_s
        self.notifier = Notifier()
        self.make_sampling = make_sampling
        self.instance_id = new_instance_id()
        self.heartbeat_s = heartbeat_s
        self.max_live, self.max_queued = max_live, max_queued
        self.ctx = ctx or zmq.Context.instance()
        self.metrics = metrics or EngineMetrics(CollectorRegistry())
        """Fed by the engine's own post-step hook (added once the engine exists) and by this stage."""
        self.metrics.set_state(self.state)
        self._last_hello = ""
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._num_queued = 0
        """Requests put in `inbox` or `backlog` and not yet admitted, rejected or aborted."""
        self._queued_lock = threading.Lock()
        self.outbox: queue.Queue = queue.Queue(maxsize=64)  # a slow detokenizer slows the engine, never loses
        self.backlog: collections.OrderedDict[str, p.TokenizedReq] = collections.OrderedDict()
        self.live: dict[str, LiveRequest] = {}
        """request id -> its meta and output so far, for every request added and not yet finished."""
        self.finished = FinishedRing()
        self._hello: str | None = None
        """The latest detokenizer that asked for a resync and has not got one yet."""
        self._next_resync_at = 0.0
        self.rejects = RejectLog(log, on_reject=self.metrics.frame_rejected)
        self.latest_stats: dict[str, Any] = engine.stats() if engine is not None else {}
        self._abort_notes: dict[str, str] = {}
        self._refused: list[list] = []
        """Why the stage (not the client) aborted a request: sent with its last output."""
        self.num_steps = 0
        self._stopping = threading.Event()
        self._give_up_at = float("inf")
        self._stop = threading.Event()
        self._drain_deadline: float | None = None
        # Bind/connect here, in the main thread, before the threads start using the sockets.
        self.security = security or ServiceSecurity(self.ctx, None, None)
        self._in_sock = pipeline_pull(self.ctx, input_endpoint, security=self.security)
        # Not IMMEDIATE: outputs queue (up to the HWM) while the detokenizer restarts.
        self._out_sock = pipeline_push(self.ctx, output_endpoint, hwm=out_hwm, immediate=False,
                                       security=self.security)
        self._threads = [threading.Thread(target=self._input_loop, name="engine-input", daemon=True),
                         threading.Thread(target=self._output_loop, name="engine-output", daemon=True)]

    # ------------------------------------------------------------------ main loop

    def run(self, stop: threading.Event, load_engine=None) -> int:
        """Serve until `stop` is set, then drain; `load_engine()` builds the engine first if the
        stage was made without one (heartbeats say "loading" meanwhile). Returns the exit code."""
        self._stop = stop
        for t in self._threads:
            t.start()
        if self.engine is None:
            try:
                self.engine = load_engine()
            except Exception as e:  # no such model, bad config: say so to everyone, exit non-zero
                log.error("the engine cannot start: %s", e)
                self._shutdown(f"cannot start: {type(e).__name__}: {e}")
                return 1
            self.latest_stats = self.engine.stats()
        self.engine.add_post_step_hook(self.metrics)
        self._set_state("ready")
        self._emit(self._status(True, "started"))
        log.info("engine stage %s serving", self.instance_id)
        self.notifier.ready(f"engine {self.instance_id} serving")
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
        self._set_state("draining")
        deadline = self._start_drain_clock()
        log.info("draining %d request(s) for up to %.0fs", len(self.live) + len(self.backlog), self.drain_timeout_s)
        self.notifier.stopping(f"draining {len(self.live) + len(self.backlog)} request(s)")
        self._emit(self._status(True, "draining"))
        while (self.live or self.backlog) and time.monotonic() < deadline:
            self.run_once()
        left = list(self.live) + list(self.backlog)
        if not left:
            return "engine shut down after draining"
        why = f"the engine is shutting down: draining ended after {self.drain_timeout_s:.0f}s and this request was aborted"
        log.warning("drain timed out: aborting %d request(s)", len(left))
        for request_id in left:
            self._abort_notes[request_id] = why
            self.inbox.put(p.AbortReq(request_id))
        for _ in range(3):  # the aborts' final outputs come from the next step
            self.run_once()
        return f"engine shut down; {len(left)} request(s) aborted after the drain"

    def run_once(self) -> None:
        if not all(t.is_alive() for t in self._threads):
            raise RuntimeError("an engine I/O thread died; the engine can no longer receive or send")
        self.notifier.tick()  # from the step loop itself: a hung step stops the watchdog
        started: list[list] = []
        rejected: list[list] = []
        extra_outputs: list[Any] = []
        idle = not self.engine.has_unfinished_requests() and not self.backlog
        self._take_inbox(idle, started, rejected, extra_outputs)
        self._admit(started, rejected)
        outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
        for out in outputs:
            self._record(out)
        outputs = extra_outputs + outputs
        self.num_steps += bool(outputs)
        stats = self.latest_stats = dict(self.engine.stats(), num_live=len(self.live), num_queued=len(self.backlog),
                                         num_steps=self.num_steps, rejected_frames=sum(self.rejects.counts.values()))
        used = 1 - stats["num_free_blocks"] / stats["num_total_blocks"]
        self.metrics.set_live(len(self.live))
        self.metrics.set_queued(len(self.backlog))
        self.notifier.status(f"{self.state}: {stats['num_running']} running, {stats['num_waiting']} waiting, "
                             f"{len(self.backlog)} queued, KV cache {used:.0%} used")
        if started or rejected or outputs:
            self._emit(("step", started, rejected, outputs))
        if self._hello is not None and time.monotonic() >= self._next_resync_at:
            self._send_resync(self._hello)

    def _take_inbox(self, block: bool, started: list, rejected: list, extra_outputs: list) -> None:
        timeout = 0.05 if block else 0.0
        while True:
            try:
                msg = self.inbox.get(timeout=timeout) if timeout else self.inbox.get_nowait()
            except queue.Empty:
                return
            timeout = 0.0
            if isinstance(msg, p.TokenizedReq):
                self._queue_request(msg)
                rejected.extend(self._refused)
                self._refused.clear()
            elif isinstance(msg, p.AbortReq):
                self._abort(msg.request_id, started, extra_outputs)
            elif isinstance(msg, p.DetokHello):
                if msg.instance_id != self._hello and self._last_hello and msg.instance_id != self._last_hello:
                    self.metrics.stage_restart_seen("detokenizer")
                self._hello = msg.instance_id

    def _queue_request(self, req: p.TokenizedReq) -> None:
        rid = req.request_id
        if self.state == "draining" and rid not in self.live and rid not in self.backlog:
            self._dequeued()
            self._refused.append([rid, req.meta, DRAINING])
            return
        # A resend (the client's tokenizer restarted) of a request that got through after all,
        # or a client reusing an id that is still live: the first one stands.
        if rid in self.live or rid in self.backlog or (req.resend and rid in self.finished):
            if not req.resend:
                self.rejects("duplicate", f"request id {rid!r} is already live; the new request is ignored")
            self._dequeued()
            return
        self.backlog[rid] = req

    def _admit(self, started: list, rejected: list) -> None:
        while self.backlog and len(self.live) < self.max_live:
            _, req = self.backlog.popitem(last=False)
            self._dequeued()
            self._add(req, started, rejected)

    def _add(self, req: p.TokenizedReq, started: list, rejected: list) -> None:
        try:
            params = self.make_sampling(**req.sampling)
            self.engine.add_request(req.request_id, req.prompt_token_ids, params, priority=req.priority)
        except Exception as e:  # refused (ValueError/TypeError) or failed: either way this request's own
            if not isinstance(e, (ValueError, TypeError)):
                log.exception("adding request %r failed", req.request_id)
            error = p.clip(str(e) if isinstance(e, (ValueError, TypeError)) else f"{type(e).__name__}: {e}")
            rejected.append([req.request_id, req.meta, error])
            n = len(req.prompt_token_ids)
            self.finished.add(req.request_id, [req.request_id, req.meta, b"", True, "error", n, 0, 0, error])
            return
        self.live[req.request_id] = LiveRequest(req.meta)
        started.append([req.request_id, req.meta])

    def _abort(self, request_id: str, started: list, extra_outputs: list) -> None:
        req = self.backlog.pop(request_id, None)
        if req is None:
            self.engine.abort(request_id)  # idempotent; its final output comes from the next step
            return
        # Never admitted: it starts and ends in this message, so its client still gets a terminal delta.
        self._dequeued()
        self.live[request_id] = LiveRequest(req.meta)
        started.append([request_id, req.meta])
        out = RequestOutput(request_id, [], True, "abort", len(req.prompt_token_ids), 0, 0)
        extra_outputs.append(out)
        self._record(out)

    def _record(self, out: Any) -> None:
        """Keep what a resync needs: the output so far, and the whole request once it ends."""
        live = self.live.get(out.request_id)
        if live is None:
            return
        if out.finished and out.request_id in self._abort_notes:
            out.error = self._abort_notes.pop(out.request_id)
        live.tokens.extend(out.new_token_ids)
        live.counts = (out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)
        if out.finished:
            del self.live[out.request_id]
            self.finished.add(out.request_id, [out.request_id, live.meta, p.pack_token_ids(live.tokens), True,
                                               out.finish_reason, *live.counts, _error(out)])

    def _dequeued(self) -> None:
        with self._queued_lock:
            self._num_queued -= 1

    def _send_resync(self, detok_instance: str) -> None:
        """Everything a new detokenizer needs. At most one per `RESYNC_INTERVAL_S`, for the latest
        hello only: a resync can be thousands of entries, and a hello is a few bytes anyone who
        reaches the engine's port could repeat (a real detokenizer repeats its hello until answered)."""
        self._hello, self._next_resync_at = None, time.monotonic() + RESYNC_INTERVAL_S
        self._last_hello = detok_instance
        entries = [[rid, r.meta, p.pack_token_ids(r.tokens), False, None, *r.counts, None]
                   for rid, r in self.live.items()] + self.finished.values()
        log.info("resync for detokenizer %s: %d request(s)", detok_instance, len(entries))
        chunks = [entries[i:i + RESYNC_CHUNK] for i in range(0, len(entries), RESYNC_CHUNK)] or [[]]
        for i, chunk in enumerate(chunks):
            self._emit(p.Resync(self.instance_id, detok_instance, chunk, i == len(chunks) - 1))

    def _start_drain_clock(self) -> float:
        """The drain's deadline, fixed the first time anyone asks after the stop request (a step
        may be waiting on a full output queue when it comes)."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + self.drain_timeout_s
            self._give_up_at = self._drain_deadline + SHUTDOWN_SEND_S  # then nobody is reading: stop waiting
        return self._drain_deadline

    def _emit(self, item: Any, timeout: float | None = None) -> None:
        """Hand an item to the output thread, waiting while its queue is full (backpressure from
        a slow detokenizer). Without a timeout the wait ends once the drain's time is up (the item
        is dropped: nobody is reading); with one, `queue.Full` says it could not be queued."""
        while True:
            try:
                self.outbox.put(item, timeout=timeout if timeout is not None else 0.1)
                return
            except queue.Full:
                if timeout is not None:
                    raise
                if self._stop.is_set():
                    self._start_drain_clock()
                if time.monotonic() > self._give_up_at:
                    return

    def _shutdown(self, reason: str) -> None:
        self._give_up_at = time.monotonic() + SHUTDOWN_SEND_S
        self._stopping.set()
        try:
            self._emit(self._status(False, p.clip(reason)), timeout=SHUTDOWN_SEND_S)
            self._emit(_STOP, timeout=SHUTDOWN_SEND_S)
        except queue.Full:
            log.warning("could not queue the last messages: the detokenizer is not reading")
        for t in self._threads:
            t.join(timeout=SHUTDOWN_SEND_S + 1)
        self._in_sock.close(linger=0)
        self._out_sock.close(linger=0)
        self.security.close()

    # ------------------------------------------------------------------ I/O threads

    def _input_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self._receive()
            except Exception:  # a bug must cost one frame, never the thread (and with it the engine)
                self.rejects("internal", "unexpected error while receiving a frame", exc_info=True)

    def _receive(self) -> None:
        if self._num_queued >= self.max_queued:  # admission backlog full: let the socket fill
            time.sleep(0.01)
            return
        if not self._in_sock.poll(100):
            return
        frame = self._in_sock.recv()
        self.metrics.frame_received()
        try:
            msg = p.decode(frame)
            if isinstance(msg, p.TokenizedReq):
                msg.prompt_token_ids = p.unpack_token_ids(msg.prompt_token_ids)
            elif not isinstance(msg, (p.AbortReq, p.DetokHello)):
                raise ProtocolError(f"the engine does not accept {msg.TYPE!r} messages")
        except ProtocolError as e:  # only stages talk to us, and they have no reply path
            self.rejects("bad_frame", str(e))
            return
        if isinstance(msg, p.TokenizedReq):
            with self._queued_lock:
                self._num_queued += 1
        self.inbox.put(msg)

    def _output_loop(self) -> None:
        next_heartbeat = time.monotonic() + self.heartbeat_s
        while True:
            try:
                item = self.outbox.get(timeout=max(0.0, next_heartbeat - time.monotonic()))
            except queue.Empty:
                item = self._status(True)
            if item is _STOP:
                return
            if isinstance(item, p.EngineStatus):
                next_heartbeat = time.monotonic() + self.heartbeat_s
            # Past the give-up time a frame nobody reads is dropped; the loop still empties the queue.
            self._send(item.encode() if isinstance(item, p.Message) else self._encode_step(*item[1:]))
            if time.monotonic() >= next_heartbeat:  # busy engines still report their stats
                self._send(self._status(True).encode())
                next_heartbeat = time.monotonic() + self.heartbeat_s

    def _set_state(self, state: str) -> None:
        self.state = state
        self.metrics.set_state(state)

    def _status(self, alive: bool, reason: str = "") -> p.EngineStatus:
        return p.EngineStatus(alive, self.instance_id, reason, self.latest_stats, self.state,
                              time.monotonic() - self.started_at)

    def _send(self, frame: bytes) -> bool:
        """Push one frame, waiting at the HWM (backpressure from a slow detokenizer); while
        stopping, give up after `SHUTDOWN_SEND_S` so a vanished detokenizer cannot hold us."""
        while True:
            try:
                self._out_sock.send(frame, zmq.NOBLOCK)
                return True
            except zmq.Again:
                if time.monotonic() > self._give_up_at:
                    return False
                self._out_sock.poll(100, zmq.POLLOUT)

    def _encode_step(self, started: list[list], rejected: list[list], outputs: list[Any]) -> bytes:
        """One StepOutput frame; token ids packed (one C call per request, no per-token loop)."""
        rows = [[o.request_id, p.pack_token_ids(o.new_token_ids), o.finished, o.finish_reason,
                 o.num_prompt_tokens, o.num_output_tokens, o.num_cached_tokens, _error(o)] for o in outputs]
        return p.StepOutput(self.instance_id, started, rejected, rows).encode()


def _error(out: RequestOutput) -> str | None:
    return p.clip(out.error) if out.error else None
