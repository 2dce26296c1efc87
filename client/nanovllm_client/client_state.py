"""The client's protocol logic without any I/O, shared by the sync `Client` and `AsyncClient`.

It builds request frames and turns incoming frames into per-request `Delta`s. It also follows
the service's health: an engine-dead notice or a restarted detokenizer fails every request in
flight at once (their outputs can no longer arrive), so no stream waits for its timeout.
"""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import zmq

from . import protocol as p
from .endpoints import default_url, service_endpoints

log = logging.getLogger("nanovllm_client")

ENGINE_DEAD = "engine is not available (dead or not started yet)"


@dataclass
class Delta:
    """One piece of a streamed answer."""
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    """None while streaming; "stop", "length", "abort" or "error" on the last delta."""
    usage: dict[str, int] | None = None
    """On the last delta: prompt_tokens, completion_tokens, cached_tokens."""
    error: str | None = None
    engine_dead: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Result:
    """A whole answer (`generate`)."""
    request_id: str
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, int] | None = None


def build_request(prompt: Any = None, *, messages: list[dict] | None = None,
                  prompt_token_ids: list[int] | None = None, max_tokens: int | None = None,
                  temperature: float | None = None, ignore_eos: bool | None = None,
                  stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
                  skip_special_tokens: bool = True, request_id: str | None = None,
                  **sampling: Any) -> p.GenerateReq:
    """The GenerateReq for one call. `prompt` may be text, a chat message list or token ids."""
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        messages, prompt = prompt, None
    elif isinstance(prompt, list):
        prompt_token_ids, prompt = prompt, None
    for name, value in (("max_tokens", max_tokens), ("temperature", temperature),
                        ("ignore_eos", ignore_eos), ("stop_token_ids", stop_token_ids)):
        if value is not None:
            sampling[name] = value
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    ids = p.pack_token_ids(prompt_token_ids) if prompt_token_ids is not None else None
    return p.GenerateReq(request_id=request_id or uuid.uuid4().hex, prompt=prompt, messages=messages,
                         prompt_token_ids=ids, sampling=sampling, stop=stops,
                         skip_special_tokens=skip_special_tokens)


class ClientState:
    """Health of the service as this client sees it, and frame -> deltas decoding."""

    def __init__(self, detok_timeout: float = 3.0) -> None:
        self.engine_alive: bool | None = None
        self.detok_instance: str | None = None
        self.detok_timeout = detok_timeout
        self.detok_responsive = False
        self.last_pong = time.monotonic()

    @property
    def ready(self) -> bool:
        """The detokenizer answers our pings: it knows our routing id, outputs can reach us."""
        return self.detok_instance is not None and self.detok_responsive

    def handle(self, frame: bytes, live_ids: list[str]) -> tuple[list[Delta], Any]:
        """Decode one incoming frame. Returns (deltas to route, a stats reply or None)."""
        try:
            msg = p.decode(frame)
        except p.ProtocolError as e:
            log.warning("dropping an undecodable frame from the service: %s", e)
            return [], None
        if isinstance(msg, p.StreamOutput):
            return [self._delta(d) for d in msg.deltas], None
        if isinstance(msg, p.ErrorOutput):
            if msg.request_id is not None:
                return [Delta(msg.request_id, "", [], "error", error=msg.message)], None
            log.warning("service error: %s", msg.message)
            return [], None
        if isinstance(msg, p.Pong):
            self.last_pong, self.detok_responsive = time.monotonic(), True
            restarted = self.detok_instance is not None and msg.instance_id != self.detok_instance
            self.detok_instance = msg.instance_id
            return self._set_engine_alive(msg.engine_alive, live_ids, restarted), None
        if isinstance(msg, p.EngineStatus):
            return self._set_engine_alive(msg.alive, live_ids, False, msg.reason), None
        if isinstance(msg, p.StatsOutput):
            return [], msg.stats
        log.warning("unexpected %r message from the service", msg.TYPE)
        return [], None

    def check_detok(self, live_ids: list[str]) -> list[Delta]:
        """Fail the requests in flight if the detokenizer stopped answering pings (their
        outputs cannot reach us); called once per heartbeat."""
        if not self.ready or time.monotonic() - self.last_pong < self.detok_timeout:
            return []
        self.detok_responsive, self.engine_alive = False, None  # new requests wait until it is back
        why = f"the detokenizer has not answered for {self.detok_timeout}s; outputs were lost"
        return [Delta(rid, "", [], "error", error=why) for rid in live_ids]

    def _set_engine_alive(self, alive: bool, live_ids: list[str], detok_restarted: bool,
                          reason: str = "") -> list[Delta]:
        was_alive, self.engine_alive = self.engine_alive, alive
        if detok_restarted:
            why = "the detokenizer restarted; outputs of requests in flight were lost"
            return [Delta(rid, "", [], "error", error=why) for rid in live_ids]
        if was_alive and not alive:
            why = f"engine died: {reason}" if reason else "engine died"
            return [Delta(rid, "", [], "error", error=why, engine_dead=True) for rid in live_ids]
        return []

    @staticmethod
    def _delta(d: dict[str, Any]) -> Delta:
        return Delta(d["request_id"], d.get("text", ""), p.unpack_token_ids(d.get("token_ids", b"")),
                     d.get("finish_reason"), d.get("usage"), d.get("error"),
                     bool(d.get("engine_dead", False)))


def merge(deltas: list[Delta], request_id: str) -> Result:
    result = Result(request_id, "".join(d.text for d in deltas))
    for d in deltas:
        result.token_ids.extend(d.token_ids)
        if d.finished:
            result.finish_reason, result.usage = d.finish_reason, d.usage
    return result


class ClientBase:
    """What the sync `Client` and the `AsyncClient` share: the service address, the limits, the
    client's identity on both sockets, and the protocol state."""

    def __init__(self, url: str | None, timeout: float | None, connect_timeout: float,
                 heartbeat_interval: float, hwm: int):
        self.url = url or default_url()
        self.endpoints = service_endpoints(self.url)
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self._heartbeat_interval, self._hwm = heartbeat_interval, hwm
        self._identity = uuid.uuid4().bytes
        self._state = ClientState()

    @property
    def engine_alive(self) -> bool | None:
        return self._state.engine_alive

    def _deadline(self, timeout: float | None) -> float:
        """The monotonic time a request started now must end by (its own timeout, else the client's)."""
        limit = timeout if timeout is not None else self.timeout
        return time.monotonic() + (limit if limit is not None else 1e9)

    def _dealer(self, ctx: zmq.Context, endpoint: str) -> zmq.Socket:
        """A DEALER to one stage; both carry this client's identity so the stages can route to it."""
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, self._identity)
        sock.setsockopt(zmq.SNDHWM, self._hwm)
        sock.setsockopt(zmq.RCVHWM, self._hwm)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(endpoint)
        return sock
