"""The detokenizer stage: last hop, and the one that talks back to clients.

engine --PUSH--> [PULL] detok [ROUTER] --> client DEALERs;  detok [PUSH] --abort--> engine

Turns each engine step into text deltas (see `incremental.py`), batches them into one
`StreamOutput` per client per step and routes them by the client's routing id. It is also the
service's failure detector:
- clients ping every second; a client that stops pinging, or whose socket is gone
  (ROUTER_MANDATORY makes that an EHOSTUNREACH instead of a silent drop), has its requests
  aborted in the engine, which frees their KV blocks;
- the engine heartbeats every 0.25 s; if it says it is dying, its connection closes (crash,
  SIGKILL) or it goes quiet for `engine_timeout_s` (hung), every request in flight ends with an error and every client is told the
  engine is dead, so their new requests fail fast until a heartbeat says it is back.
A client that does not read its socket gets its frames queued here up to `max_pending_frames`,
then its requests are aborted: memory stays bounded and nothing is dropped silently.
"""
from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from nanovllm_client import protocol as p
from nanovllm_client.stage import PeerMonitor, client_router, new_instance_id, pipeline_pull, pipeline_push

from nanovllm.detokenize import IncrementalDetokenizer

log = logging.getLogger("detok_proc")


@dataclass
class RequestState:
    client: bytes
    client_request_id: str
    detok: IncrementalDetokenizer


@dataclass
class ClientInfo:
    last_seen: float
    request_ids: set[str] = field(default_factory=set)
    """Engine request ids of this client's requests in flight."""
    pending: collections.deque = field(default_factory=collections.deque)
    """Frames the client's socket had no room for yet, in order."""


class DetokStage:
    def __init__(self, tokenizer: Any, stream_endpoint: str, detok_endpoint: str, engine_endpoint: str,
                 client_timeout_s: float = 5.0, engine_timeout_s: float = 3.0,
                 max_pending_frames: int = 1000, client_hwm: int = 10_000, ctx: zmq.Context | None = None):
        self.tokenizer = tokenizer
        self.instance_id = new_instance_id()
        self.client_timeout_s, self.engine_timeout_s = client_timeout_s, engine_timeout_s
        self.max_pending_frames = max_pending_frames
        self.ctx = ctx or zmq.Context.instance()
        self.from_engine = pipeline_pull(self.ctx, detok_endpoint)
        self.engine_peers = PeerMonitor(self.from_engine)
        self.clients_sock = client_router(self.ctx, stream_endpoint, hwm=client_hwm)
        self.to_engine = pipeline_push(self.ctx, engine_endpoint)
        self.requests: dict[str, RequestState] = {}
        self.clients: dict[bytes, ClientInfo] = {}
        self.engine_alive = False
        self.engine_instance = ""
        self.engine_last_seen = 0.0
        self.engine_stats: dict[str, Any] = {}

    # ------------------------------------------------------------------ loop

    def run(self, stop) -> None:
        poller = zmq.Poller()
        poller.register(self.from_engine, zmq.POLLIN)
        poller.register(self.clients_sock, zmq.POLLIN)
        poller.register(self.engine_peers.socket, zmq.POLLIN)
        log.info("detokenizer stage %s serving", self.instance_id)
        while not stop.is_set():
            has_pending = any(c.pending for c in self.clients.values())
            events = dict(poller.poll(10 if has_pending else 100))
            if self.from_engine in events:
                self._drain(self.from_engine, lambda parts: self.on_engine_frame(parts[0]))
            if self.clients_sock in events:
                self._drain(self.clients_sock, lambda parts: self.on_client_frames(parts[0], parts[1:]))
            if self.engine_peers.socket in events and not self.engine_peers.connected and self.engine_alive:
                self._engine_dead("its connection closed")  # crashed or killed: no need to wait for the timeout
            if has_pending:
                self._flush_all_pending()
            self.check_timeouts(time.monotonic())
        for sock in (self.engine_peers.socket, self.from_engine, self.clients_sock, self.to_engine):
            sock.close(linger=0)

    @staticmethod
    def _drain(sock: zmq.Socket, handle, budget: int = 256) -> None:
        for _ in range(budget):
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            handle(parts)

    # ------------------------------------------------------------------ engine side

    def on_engine_frame(self, frame: bytes) -> None:
        try:
            msg = p.decode(frame)
        except p.ProtocolError as e:
            log.warning("dropping a bad frame from the engine: %s", e)
            return
        self.engine_last_seen = time.monotonic()
        if isinstance(msg, p.EngineStatus):
            self.on_engine_status(msg)
        elif isinstance(msg, p.StepOutput):
            if not self.engine_alive:  # outputs mean it is alive, even if its hello was lost
                self._set_engine_alive(True, self.engine_instance)
            self.on_step(msg)

    def on_engine_status(self, msg: p.EngineStatus) -> None:
        self.engine_stats = msg.stats
        if not msg.alive:
            self._engine_dead(msg.reason or "engine shut down")
        elif msg.instance_id != self.engine_instance:
            if self.requests:
                self._engine_dead("engine restarted")
            self._set_engine_alive(True, msg.instance_id)

    def on_step(self, step: p.StepOutput) -> None:
        by_client: dict[bytes, list[dict]] = collections.defaultdict(list)
        for meta in step.started:
            self._start(meta)
        for _request_id, meta, error in step.rejected:
            by_client[meta["client"]].append(p.error_delta(meta["rid"], error))
        for row in step.outputs:
            delta = self._advance(*row)
            if delta is not None:
                by_client[delta.pop("client")].append(delta)
        for client, deltas in by_client.items():
            self.send_to_client(client, p.StreamOutput(deltas).encode())

    def _start(self, meta: dict[str, Any]) -> None:
        detok = IncrementalDetokenizer(
            self.tokenizer, prompt_tail=p.unpack_token_ids(meta.get("tail", b"")),
            skip_special_tokens=bool(meta.get("skip", True)), stop=meta.get("stop") or [],
            include_stop_str_in_output=bool(meta.get("include_stop", False)), min_tokens=int(meta.get("min_tokens", 0)))
        client = meta["client"]
        self.requests[meta["request_id"]] = RequestState(client, meta["rid"], detok)
        self.clients.setdefault(client, ClientInfo(time.monotonic())).request_ids.add(meta["request_id"])

    def _advance(self, request_id: str, packed_ids: bytes, finished: bool, finish_reason: str | None,
                 num_prompt: int, num_output: int, num_cached: int) -> dict[str, Any] | None:
        state = self.requests.get(request_id)
        if state is None:  # we never saw it start (restarted detokenizer) or already ended it
            if not finished:
                self._abort_in_engine(request_id)
            return None
        token_ids = p.unpack_token_ids(packed_ids)
        text = state.detok.add(token_ids, finished)
        if state.detok.stopped:
            self._abort_in_engine(request_id)
            finished, finish_reason = True, "stop"
        delta = {"client": state.client, "request_id": state.client_request_id, "text": text,
                 "token_ids": packed_ids, "finish_reason": finish_reason if finished else None}
        if finished:
            delta["usage"] = {"prompt_tokens": num_prompt, "completion_tokens": num_output,
                              "cached_tokens": num_cached}
            self._forget(request_id)
        return delta

    def _forget(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None and state.client in self.clients:
            self.clients[state.client].request_ids.discard(request_id)

    def _abort_in_engine(self, request_id: str) -> None:
        try:
            self.to_engine.send(p.AbortReq(request_id).encode(), zmq.NOBLOCK)
        except zmq.Again:  # no engine connected: there is nothing left to abort
            log.info("could not abort %s: engine unreachable", request_id)

    def _set_engine_alive(self, alive: bool, instance_id: str) -> None:
        changed = alive != self.engine_alive
        self.engine_alive, self.engine_instance = alive, instance_id
        if changed:
            log.info("engine %s is %s", instance_id, "alive" if alive else "dead")
            self._broadcast(p.EngineStatus(alive, instance_id))

    def _engine_dead(self, reason: str) -> None:
        """Fail every request in flight; tell every client (they fail the rest and refuse new ones)."""
        by_client: dict[bytes, list[dict]] = collections.defaultdict(list)
        for state in self.requests.values():
            delta = p.error_delta(state.client_request_id, f"engine died: {reason}")
            delta["engine_dead"] = True
            by_client[state.client].append(delta)
        self.requests.clear()
        for info in self.clients.values():
            info.request_ids.clear()
        for client, deltas in by_client.items():
            self.send_to_client(client, p.StreamOutput(deltas).encode())
        if self.engine_alive:
            log.warning("engine %s dead: %s", self.engine_instance, reason)
            self.engine_alive = False
            self._broadcast(p.EngineStatus(False, self.engine_instance, reason))

    # ------------------------------------------------------------------ client side

    def on_client_frames(self, identity: bytes, frames: list[bytes]) -> None:
        info = self.clients.setdefault(identity, ClientInfo(time.monotonic()))
        info.last_seen = time.monotonic()
        if len(frames) != 1:
            self.send_to_client(identity, p.ErrorOutput(f"expected exactly one frame per message, got {len(frames)}").encode())
            return
        try:
            msg = p.decode(frames[0])
        except p.ProtocolError as e:
            self.send_to_client(identity, p.ErrorOutput(str(e)).encode())
            return
        if isinstance(msg, p.Ping):
            self.send_to_client(identity, p.Pong("detokenizer", self.instance_id, self.engine_alive).encode())
        elif isinstance(msg, p.StatsReq):
            self.send_to_client(identity, p.StatsOutput(self.stats()).encode())
        else:
            self.send_to_client(identity, p.ErrorOutput(
                f"the detokenizer accepts only 'ping' and 'stats' messages, got {msg.TYPE!r}; "
                "send requests to the tokenizer endpoint").encode())

    def stats(self) -> dict[str, Any]:
        return {"engine_alive": self.engine_alive, "engine": self.engine_stats,
                "detok": {"num_requests": len(self.requests), "num_clients": len(self.clients),
                          "num_pending_frames": sum(len(c.pending) for c in self.clients.values())}}

    def send_to_client(self, identity: bytes, frame: bytes) -> None:
        info = self.clients.get(identity)
        if info is not None and info.pending:
            self._queue(identity, info, frame)
            return
        try:
            self.clients_sock.send_multipart([identity, frame], zmq.NOBLOCK)
        except zmq.Again:  # its pipe is full: hold the frame, in order
            if info is not None:
                self._queue(identity, info, frame)
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self.client_gone(identity, "its socket is gone")

    def _queue(self, identity: bytes, info: ClientInfo, frame: bytes) -> None:
        info.pending.append(frame)
        if len(info.pending) > self.max_pending_frames:
            self.client_gone(identity, f"it left {self.max_pending_frames} output messages unread")

    def _flush_all_pending(self) -> None:
        for identity, info in list(self.clients.items()):
            while info.pending:
                try:
                    self.clients_sock.send_multipart([identity, info.pending[0]], zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError:
                    self.client_gone(identity, "its socket is gone")
                    break
                info.pending.popleft()

    def client_gone(self, identity: bytes, why: str) -> None:
        info = self.clients.pop(identity, None)
        if info is None:
            return
        if info.request_ids:
            log.info("client %s gone (%s): aborting %d request(s)", identity.hex(), why, len(info.request_ids))
        for request_id in info.request_ids:
            self.requests.pop(request_id, None)
            self._abort_in_engine(request_id)

    def _broadcast(self, msg: p.Message) -> None:
        frame = msg.encode()
        for identity in list(self.clients):
            self.send_to_client(identity, frame)

    def check_timeouts(self, now: float) -> None:
        for identity, info in list(self.clients.items()):
            if now - info.last_seen > self.client_timeout_s:
                self.client_gone(identity, f"no heartbeat for {self.client_timeout_s}s")
        if self.engine_alive and now - self.engine_last_seen > self.engine_timeout_s:
            self._engine_dead(f"no heartbeat for {self.engine_timeout_s}s")
