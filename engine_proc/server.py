"""The engine stage: the scheduler loop around `LLMEngine.step()`.

tokenizer/detok --PUSH--> [PULL] engine [PUSH] --> detokenizer

Three threads, so socket I/O and msgpack work overlap the model step (torch releases the GIL
while it computes):
- input thread: receive + decode frames -> `inbox` (bounded: when the engine has `max_live`
  requests the main loop stops taking new ones, the inbox fills, the socket fills, and the
  tokenizer holds its clients back);
- main thread: apply requests and aborts, run one step, hand the raw outputs to `outbox`;
- output thread: encode one `StepOutput` per step and push it; between steps, an
  `EngineStatus` heartbeat every `heartbeat_s`, which is how the detokenizer (and through it
  every client) knows the engine is alive. On a crash or shutdown it sends alive=False last.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from typing import Any

import zmq

from nanovllm_client import protocol as p
from nanovllm_client.stage import new_instance_id, pipeline_pull, pipeline_push

log = logging.getLogger("engine_proc")

_STOP = object()


class EngineStage:
    def __init__(self, engine: Any, make_sampling, input_endpoint: str, output_endpoint: str,
                 heartbeat_s: float = 0.25, max_live: int = 4096, ctx: zmq.Context | None = None):
        self.engine = engine
        self.make_sampling = make_sampling
        self.instance_id = new_instance_id()
        self.heartbeat_s = heartbeat_s
        self.max_live = max_live
        self.ctx = ctx or zmq.Context.instance()
        self.inbox: queue.Queue = queue.Queue(maxsize=1024)
        self.outbox: queue.Queue = queue.Queue(maxsize=64)  # a slow detokenizer slows the engine, never loses
        self.live: dict[str, dict] = {}
        """request id -> meta, for every request added and not yet finished."""
        self.latest_stats: dict[str, Any] = engine.stats()
        self.num_steps = 0
        self._stopping = threading.Event()
        # Bind/connect here, in the main thread, before the threads start using the sockets.
        self._in_sock = pipeline_pull(self.ctx, input_endpoint)
        # Not IMMEDIATE: outputs queue (up to the HWM) while the detokenizer restarts.
        self._out_sock = pipeline_push(self.ctx, output_endpoint, immediate=False)
        self._threads = [threading.Thread(target=self._input_loop, name="engine-input", daemon=True),
                         threading.Thread(target=self._output_loop, name="engine-output", daemon=True)]

    # ------------------------------------------------------------------ main loop

    def run(self, stop: threading.Event) -> int:
        for t in self._threads:
            t.start()
        self._emit(p.EngineStatus(True, self.instance_id, "started", self.latest_stats))
        log.info("engine stage %s serving", self.instance_id)
        code, reason = 0, "engine shut down"
        try:
            while not stop.is_set():
                self.run_once()
        except Exception as e:  # the engine is broken: tell everyone, then die (the supervisor restarts us)
            log.error("engine loop failed:\n%s", traceback.format_exc())
            code, reason = 1, f"engine crashed: {type(e).__name__}: {e}"
        self._shutdown(reason)
        return code

    def run_once(self) -> None:
        started, rejected = self._take_inbox(block=not self.engine.has_unfinished_requests())
        outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
        for out in outputs:
            if out.finished:
                self.live.pop(out.request_id, None)
        self.num_steps += bool(outputs)
        self.latest_stats = dict(self.engine.stats(), num_live=len(self.live), num_steps=self.num_steps)
        if started or rejected or outputs:
            self._emit((started, rejected, outputs))

    def _take_inbox(self, block: bool) -> tuple[list[dict], list[list]]:
        started: list[dict] = []
        rejected: list[list] = []
        timeout = 0.05 if block else 0.0
        while len(self.live) < self.max_live:
            try:
                msg = self.inbox.get(timeout=timeout) if timeout else self.inbox.get_nowait()
            except queue.Empty:
                break
            timeout = 0.0
            if isinstance(msg, p.TokenizedReq):
                self._add(msg, started, rejected)
            elif isinstance(msg, p.AbortReq):
                self.engine.abort(msg.request_id)  # idempotent; its final output comes from the next step
        return started, rejected

    def _add(self, req: p.TokenizedReq, started: list[dict], rejected: list[list]) -> None:
        try:
            params = self.make_sampling(**req.sampling)
            self.engine.add_request(req.request_id, req.prompt_token_ids, params)
        except (ValueError, TypeError) as e:
            rejected.append([req.request_id, req.meta, str(e)])
            return
        self.live[req.request_id] = req.meta
        started.append(dict(req.meta, request_id=req.request_id))

    def _emit(self, item: Any) -> None:
        self.outbox.put(item)

    def _shutdown(self, reason: str) -> None:
        self._emit(p.EngineStatus(False, self.instance_id, reason, self.latest_stats))
        self._emit(_STOP)
        self._stopping.set()
        for t in self._threads:
            t.join(timeout=3)
        self._in_sock.close(linger=0)
        self._out_sock.close(linger=1000)

    # ------------------------------------------------------------------ I/O threads

    def _input_loop(self) -> None:
        sock = self._in_sock
        while not self._stopping.is_set():
            if not sock.poll(100):
                continue
            frame = sock.recv()
            try:
                msg = p.decode(frame)
                if isinstance(msg, p.TokenizedReq):
                    msg.prompt_token_ids = p.unpack_token_ids(msg.prompt_token_ids)
                elif not isinstance(msg, p.AbortReq):
                    raise p.ProtocolError(f"the engine does not accept {msg.TYPE!r} messages")
            except p.ProtocolError as e:  # only stages talk to us, and they have no reply path
                log.warning("dropping a bad frame: %s", e)
                continue
            self.inbox.put(msg)

    def _output_loop(self) -> None:
        sock = self._out_sock
        next_heartbeat = time.monotonic() + self.heartbeat_s
        while True:
            try:
                item = self.outbox.get(timeout=max(0.0, next_heartbeat - time.monotonic()))
            except queue.Empty:
                item = p.EngineStatus(True, self.instance_id, "", self.latest_stats)
            if item is _STOP:
                return
            if isinstance(item, p.EngineStatus):
                next_heartbeat = time.monotonic() + self.heartbeat_s
                frame = item.encode()
            else:
                frame = encode_step(*item)
            sock.send(frame)  # blocks at the HWM: backpressure from a slow detokenizer
            if time.monotonic() >= next_heartbeat:  # busy engines still report their stats
                sock.send(p.EngineStatus(True, self.instance_id, "", self.latest_stats).encode())
                next_heartbeat = time.monotonic() + self.heartbeat_s


def encode_step(started: list[dict], rejected: list[list], outputs: list[Any]) -> bytes:
    """One StepOutput frame; token ids packed (one C call per request, no per-token loop)."""
    rows = [[o.request_id, p.pack_token_ids(o.new_token_ids), o.finished, o.finish_reason,
             o.num_prompt_tokens, o.num_output_tokens, o.num_cached_tokens] for o in outputs]
    return p.StepOutput(started, rejected, rows).encode()
