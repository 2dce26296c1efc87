"""Blocking client: one object carries many concurrent streams from many threads.

ZeroMQ sockets are not thread-safe, so one background I/O thread owns both sockets (DEALER to
the tokenizer for requests/aborts, DEALER to the detokenizer for outputs) and the protocol state
(`ClientState`: requests in flight, stage health, resends and resumes across stage restarts).
User threads hand it commands through a lock-guarded inproc PUSH and read their deltas from a
per-stream queue.
"""
from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from typing import Any

import zmq

from . import protocol as p
from .client_state import ClientBase, Delta, Result, build_request, merge
from .security import CurveKeys
from .errors import EngineDeadError, RequestError, RequestTimeoutError, ServiceUnavailableError

log = logging.getLogger("nanovllm_client")

_GENERATE, _ABORT, _TO_STREAM, _STOP = b"g", b"a", b"s", b"x"
_instances = itertools.count()


class Stream:
    """Iterator over one request's deltas. Breaking out, `cancel()` or garbage collection aborts it."""

    def __init__(self, client: Client, request_id: str, wire_id: str, deltas: queue.SimpleQueue, deadline: float,
                 raise_on_error: bool):
        self.request_id = request_id
        self._wire_id = wire_id
        self._client, self._deltas, self._deadline = client, deltas, deadline
        self._raise_on_error = raise_on_error
        self._done = False

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Delta:
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
            if delta.finish_reason == "error" and self._raise_on_error:
                error = EngineDeadError if delta.engine_dead else RequestError
                raise error(delta.error or "request failed", self.request_id)
        return delta

    def cancel(self) -> None:
        """Abort the request in the engine (idempotent); the iterator ends."""
        if not self._done:
            self._done = True
            self._client._end_stream(self.request_id, self._wire_id)
            self._client._send(_ABORT, self._wire_id.encode(), p.AbortReq(self._wire_id).encode())

    def __del__(self) -> None:
        try:
            self.cancel()
        except Exception:
            pass


class Client(ClientBase):
    """`Client("ipc:///run/nanovllm")` or `Client("tcp://127.0.0.1:5550")`; a context manager."""

    def __init__(self, url: str | None = None, *, timeout: float | None = 600.0,
                 connect_timeout: float = 30.0, heartbeat_interval: float = 1.0, hwm: int = 10_000,
                 stage_timeout: float = 30.0, curve: tuple[CurveKeys, bytes] | None = None):
        super().__init__(url, timeout, connect_timeout, heartbeat_interval, hwm, stage_timeout, curve)
        self._ready = threading.Event()
        self._streams: dict[str, queue.SimpleQueue] = {}
        self._stats: queue.SimpleQueue = queue.SimpleQueue()
        self._ctx = zmq.Context()
        self._cmd_endpoint = f"inproc://nanovllm-client-{next(_instances)}"
        self._cmd_lock = threading.Lock()
        self._cmd = self._ctx.socket(zmq.PUSH)
        self._cmd.bind(self._cmd_endpoint)
        self._closed = False
        self._io = threading.Thread(target=self._io_loop, name="nanovllm-client-io", daemon=True)
        self._io.start()

    # ------------------------------------------------------------------ public API

    def stream(self, prompt: Any = None, *, timeout: float | None = None, raise_on_error: bool = True,
               **kwargs: Any) -> Stream:
        """Start a request; iterate the result for `Delta`s. See `build_request` for arguments."""
        req = build_request(prompt, **kwargs)
        self._wait_ready()
        self._refuse_if_unavailable(req.request_id)
        wire_id, frame, resend_frame = self._claim(req)
        deltas: queue.SimpleQueue = queue.SimpleQueue()
        self._streams[wire_id] = deltas
        self._send(_GENERATE, wire_id.encode(), frame, resend_frame)
        return Stream(self, req.request_id, wire_id, deltas, self._deadline(timeout), raise_on_error)

    def generate(self, prompt: Any = None, **kwargs: Any) -> Result:
        """Run a request to completion and return the whole answer."""
        s = self.stream(prompt, **kwargs)
        return merge(list(s), s.request_id)

    def abort(self, request_id: str) -> None:
        """Abort the stream of `request_id` (idempotent: unknown or finished ids are ignored)."""
        wire_id = self._wire_ids.get(request_id)
        if wire_id is not None:
            self._end_stream(request_id, wire_id)
            self._send(_ABORT, wire_id.encode(), p.AbortReq(wire_id).encode())

    def server_stats(self, timeout: float = 10.0) -> dict[str, Any]:
        """The detokenizer's state sizes and the engine's latest stats (from its heartbeat)."""
        self._wait_ready()
        self._send(_TO_STREAM, p.StatsReq().encode())
        try:
            return self._stats.get(timeout=timeout)
        except queue.Empty:
            raise ServiceUnavailableError(f"no stats reply within {timeout}s") from None

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
        if self._closed:
            return
        for app_id in list(self._wire_ids):
            self.abort(app_id)
        self._send(_STOP)
        self._io.join(timeout=linger + 5)
        self._closed = True
        self._cmd.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _wait_ready(self) -> None:
        if not self._ready.wait(self.connect_timeout):
            raise ServiceUnavailableError(
                f"no answer from the service's detokenizer at {self.endpoints.stream} within {self.connect_timeout}s")

    def _end_stream(self, app_id: str, wire_id: str) -> None:
        self._streams.pop(wire_id, None)
        self._release(app_id, wire_id)

    def _send(self, *command: bytes) -> None:
        if self._closed:
            raise RuntimeError("client is closed")
        with self._cmd_lock:
            self._cmd.send_multipart(list(command))

    def _io_loop(self) -> None:
        tok = self._dealer(self._ctx, self.endpoints.tokenizer)
        out = self._dealer(self._ctx, self.endpoints.stream)
        cmd = self._ctx.socket(zmq.PULL)
        cmd.connect(self._cmd_endpoint)
        pending_tok: collections.deque[bytes] = collections.deque()  # held while the tokenizer pushes back
        poller = zmq.Poller()
        for sock in (tok, out, cmd):
            poller.register(sock, zmq.POLLIN)
        next_ping = 0.0
        try:
            while True:
                now = time.monotonic()
                if now >= next_ping:
                    self._route(self._state.check_detok())
                    if not self._state.ready:
                        self._ready.clear()
                    for sock in (out, tok):  # a full pipe means that stage is gone: skip the ping
                        if sock.poll(0, zmq.POLLOUT):
                            sock.send(p.Ping().encode(), zmq.NOBLOCK)
                    next_ping = now + (self._heartbeat_interval if self._ready.is_set() else 0.1)
                poller.modify(tok, zmq.POLLIN | (zmq.POLLOUT if pending_tok else 0))
                events = dict(poller.poll(max(1, int((next_ping - time.monotonic()) * 1000))))
                if cmd in events and self._drain_commands(cmd, out, pending_tok):
                    break
                while pending_tok and tok.poll(0, zmq.POLLOUT):
                    tok.send(pending_tok.popleft(), zmq.NOBLOCK)
                for sock in (tok, out):
                    if sock in events:
                        self._drain_incoming(sock, out, pending_tok)
        finally:
            for frame in pending_tok:  # aborts queued by close(): hand them to zmq, which lingers 1 s
                try:
                    tok.send(frame, zmq.NOBLOCK)
                except zmq.Again:
                    break
            for sock in (tok, out, cmd):
                sock.close()

    def _drain_commands(self, cmd: zmq.Socket, out: zmq.Socket, pending_tok: collections.deque) -> bool:
        while True:
            try:
                command = cmd.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return False
            kind = command[0]
            if kind == _STOP:
                return True
            if kind == _GENERATE:
                self._state.sent(command[1].decode(), command[3])
                pending_tok.append(command[2])
            elif kind == _ABORT:
                self._state.forget(command[1].decode())
                pending_tok.append(command[2])
            else:
                out.send(command[1])

    def _drain_incoming(self, sock: zmq.Socket, out: zmq.Socket, pending_tok: collections.deque) -> None:
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reaction = self._state.handle(frame)
            except Exception:  # a bug must cost one frame, never the I/O thread every stream waits on
                log.exception("could not handle a frame from the service")
                continue
            if self._state.ready:
                self._ready.set()
            if reaction.stats is not None:
                self._stats.put(reaction.stats)
            pending_tok.extend(reaction.to_tokenizer)
            for resume in reaction.to_detok:
                out.send(resume)
            self._route(reaction.deltas)

    def _route(self, deltas: list[Delta]) -> None:
        for delta in deltas:
            target = self._streams.get(delta.request_id)
            if target is not None:
                target.put(delta)
