"""asyncio client (works under uvloop): many concurrent streams from many tasks on one object.

All socket work happens on the event loop (zmq.asyncio), so no thread is needed: one reader task
per socket routes deltas into per-stream asyncio queues, one task sends heartbeats to both
stages. The protocol state (`ClientState`) is the sync client's, so both behave the same across
stage restarts.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import zmq
import zmq.asyncio

from . import protocol as p
from .client_state import ClientBase, Delta, Result, build_request, merge
from .security import CurveKeys
from .errors import EngineDeadError, RequestError, RequestTimeoutError, ServiceUnavailableError

log = logging.getLogger("nanovllm_client")


class AsyncStream:
    """Async iterator over one request's deltas; `cancel()` (or dropping it unfinished) aborts it."""

    def __init__(self, client: AsyncClient, request_id: str, wire_id: str, deltas: asyncio.Queue, deadline: float,
                 raise_on_error: bool):
        self.request_id = request_id
        self._wire_id = wire_id
        self._client, self._deltas, self._deadline = client, deltas, deadline
        self._raise_on_error = raise_on_error
        self._done = False

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Delta:
        if self._done:
            raise StopAsyncIteration
        try:
            delta = await asyncio.wait_for(self._deltas.get(), max(0.0, self._deadline - time.monotonic()))
        except asyncio.TimeoutError:
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
            self._client._abort_wire_nowait(self.request_id, self._wire_id)

    def __del__(self) -> None:
        try:
            self.cancel()
        except Exception:  # loop already closed at interpreter exit
            pass


class AsyncClient(ClientBase):
    """`async with AsyncClient(url) as c: async for d in await c.stream("hi"): ...`"""

    def __init__(self, url: str | None = None, *, timeout: float | None = 600.0,
                 connect_timeout: float = 30.0, heartbeat_interval: float = 1.0, hwm: int = 10_000,
                 stage_timeout: float = 30.0, curve: tuple[CurveKeys, bytes] | None = None):
        super().__init__(url, timeout, connect_timeout, heartbeat_interval, hwm, stage_timeout, curve)
        self._streams: dict[str, asyncio.Queue] = {}
        self._stats: asyncio.Queue | None = None
        self._ready: asyncio.Event | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        if self._ctx is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._ctx = zmq.asyncio.Context()
        self._ready, self._stats = asyncio.Event(), asyncio.Queue()
        self._tok = self._dealer(self._ctx, self.endpoints.tokenizer)
        self._out = self._dealer(self._ctx, self.endpoints.stream)
        self._tasks = [asyncio.ensure_future(self._read(self._tok)), asyncio.ensure_future(self._read(self._out)),
                       asyncio.ensure_future(self._heartbeat())]

    async def stream(self, prompt: Any = None, *, timeout: float | None = None, raise_on_error: bool = True,
                     **kwargs: Any) -> AsyncStream:
        """Start a request; `async for` over the result. See `build_request` for arguments."""
        req = build_request(prompt, **kwargs)
        await self._wait_ready()
        self._refuse_if_unavailable(req.request_id)
        wire_id, frame, resend_frame = self._claim(req)
        deltas: asyncio.Queue = asyncio.Queue()
        self._streams[wire_id] = deltas
        self._state.sent(wire_id, resend_frame)
        await self._tok.send(frame)  # waits (backpressure) while the tokenizer's pipe is full
        return AsyncStream(self, req.request_id, wire_id, deltas, self._deadline(timeout), raise_on_error)

    async def generate(self, prompt: Any = None, **kwargs: Any) -> Result:
        s = await self.stream(prompt, **kwargs)
        return merge([d async for d in s], s.request_id)

    async def abort(self, request_id: str) -> None:
        """Abort the stream of `request_id` (idempotent: unknown or finished ids are ignored)."""
        wire_id = self._wire_ids.get(request_id)
        if wire_id is not None:
            self._end_stream(request_id, wire_id)
            await self._tok.send(p.AbortReq(wire_id).encode())

    def abort_nowait(self, request_id: str) -> None:
        """Abort from synchronous code (a finalizer, another thread)."""
        wire_id = self._wire_ids.get(request_id)
        if wire_id is not None:
            self._abort_wire_nowait(request_id, wire_id)

    def _abort_wire_nowait(self, app_id: str, wire_id: str) -> None:
        self._end_stream(app_id, wire_id)
        if self._loop is not None and not self._loop.is_closed() and self._ctx is not None:
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._safe_abort(wire_id)))

    def _end_stream(self, app_id: str, wire_id: str) -> None:
        self._streams.pop(wire_id, None)
        self._state.forget(wire_id)
        self._release(app_id, wire_id)

    async def server_stats(self, timeout: float = 10.0) -> dict[str, Any]:
        await self._wait_ready()
        await self._out.send(p.StatsReq().encode())
        try:
            return await asyncio.wait_for(self._stats.get(), timeout)
        except asyncio.TimeoutError:
            raise ServiceUnavailableError(f"no stats reply within {timeout}s") from None

    async def wait_engine(self, timeout: float = 60.0) -> None:
        """Wait until the engine is up (e.g. right after starting the service)."""
        deadline = time.monotonic() + timeout
        await self._wait_ready()
        while self._state.engine_alive is not True:
            if time.monotonic() > deadline:
                raise EngineDeadError(f"engine not available after {timeout}s")
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        if self._ctx is None:
            return
        for app_id in list(self._wire_ids):
            await self.abort(app_id)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tok.close(linger=1000)
        self._out.close(linger=1000)
        self._ctx.term()
        self._ctx = None

    async def __aenter__(self) -> AsyncClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # ------------------------------------------------------------------ internals

    async def _safe_abort(self, wire_id: str) -> None:
        if self._ctx is not None:
            await self._tok.send(p.AbortReq(wire_id).encode())

    async def _wait_ready(self) -> None:
        await self.start()
        try:
            await asyncio.wait_for(self._ready.wait(), self.connect_timeout)
        except asyncio.TimeoutError:
            raise ServiceUnavailableError(
                f"no answer from the service's detokenizer at {self.endpoints.stream} "
                f"within {self.connect_timeout}s") from None

    async def _heartbeat(self) -> None:
        while True:
            self._route(self._state.check_detok())
            if not self._state.ready:
                self._ready.clear()
            await self._out.send(p.Ping().encode())
            if self._tok.getsockopt(zmq.EVENTS) & zmq.POLLOUT:  # a tokenizer pushing back answers later
                await self._tok.send(p.Ping().encode())
            await asyncio.sleep(self._heartbeat_interval if self._ready.is_set() else 0.1)

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            try:  # a frame already waiting costs ~2 us this way, ~15 us through the poller
                frame = await sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                frame = await sock.recv()
            try:
                reaction = self._state.handle(frame)
            except Exception:  # a bug must cost one frame, never the reader every stream waits on
                log.exception("could not handle a frame from the service")
                continue
            if self._state.ready:
                self._ready.set()
            if reaction.stats is not None:
                self._stats.put_nowait(reaction.stats)
            for resend in reaction.to_tokenizer:
                await self._tok.send(resend)
            for resume in reaction.to_detok:
                await self._out.send(resume)
            self._route(reaction.deltas)
            # A recv that finds a frame waiting returns without yielding to the loop: without this,
            # a backlog of frames would starve the heartbeat (the service gives up on a client after
            # 5 s without a ping) and the streams' own consumers until the whole backlog is decoded.
            await asyncio.sleep(0)

    def _route(self, deltas: list[Delta]) -> None:
        for delta in deltas:
            target = self._streams.get(delta.request_id)
            if target is not None:
                target.put_nowait(delta)
