"""The tokenizer stage: first hop of the pipeline.

client --DEALER--> [ROUTER] tokenizer [PUSH] --> engine

Validates each request (an error naming the problem goes straight back to its sender, and the
stage carries on), applies the chat template, tokenizes, and forwards a `TokenizedReq` to the
engine. Aborts travel the same PUSH, so they always arrive after their request. Holds no
per-request state: a restarted tokenizer loses nothing that is already past it.

Backpressure: while the engine pipe is full, the stage stops reading clients, so their sockets
fill up and their sends wait. With no engine connected at all, requests are refused at once.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Any

import zmq

from prometheus_client import CollectorRegistry

from nanovllm.detokenize import PROMPT_CONTEXT_TOKENS
from nanovllm.metrics import TokenizerMetrics
from nanovllm_client import protocol as p
from nanovllm_client.checks import ProtocolError, check_strings, show
from nanovllm_client.security import ServiceSecurity
from nanovllm_client.stage import Notifier, PeerMonitor, RejectLog, client_router, new_instance_id, pipeline_push

log = logging.getLogger("tokenizer_proc")

DRAINING = "the tokenizer is draining (shutting down): it takes no new requests; retry on another instance or later"
NO_ENGINE = "engine is not available (dead, restarting or not started yet); retry later"
ENGINE_STALL_S = 10.0
"""A request waiting this long for room in the engine pipe is failed instead of held."""
ENGINE_RECONNECT_GRACE_S = 1.0
"""With no engine connected, a request waits this long (a restarted engine's reconnect) before
it is refused."""


MAX_CHARS_PER_TOKEN = 64
"""Generous bound on characters per token (real text averages about 4), used to refuse text too
long for the model before spending time tokenizing it."""


class RequestRejected(ValueError):
    """A request the stage refuses; the text goes back to the client."""


class TokenizerStage:
    def __init__(self, tokenizer: Any, sampling_fields: set[str], make_sampling, frontend: str,
                 engine: str, ctx: zmq.Context | None = None, max_prompt_tokens: int | None = None,
                 security: ServiceSecurity | None = None, metrics: TokenizerMetrics | None = None):
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        """The model's context length: no longer prompt can ever be served, so none is tokenized."""
        self.sampling_fields = sampling_fields
        self.make_sampling = make_sampling
        self.instance_id = new_instance_id()
        self.ctx = ctx or zmq.Context.instance()
        self.metrics = metrics or TokenizerMetrics(CollectorRegistry())
        self.security = security or ServiceSecurity(self.ctx, None, None)
        self.frontend = client_router(self.ctx, frontend, security=self.security)
        self.to_engine = pipeline_push(self.ctx, engine, security=self.security)
        self.engine_peers = PeerMonitor(self.to_engine)
        self.pending: collections.deque[tuple[float, bytes, str, bytes]] = collections.deque()
        """(time, client identity, client request id or "", frame) waiting for room in the engine pipe."""
        self.rejects = RejectLog(log, on_reject=self.metrics.frame_rejected)
        self._clients_seen: dict[bytes, float] = {}
        """Client identity -> when it last sent anything (the live-clients gauge)."""
        self._next_prune = 0.0
        self.state = "ready"
        self.started_at = time.monotonic()
        self.notifier = Notifier()

    # ------------------------------------------------------------------ loop

    def run(self, stop) -> None:
        poller = zmq.Poller()
        poller.register(self.frontend, zmq.POLLIN)
        poller.register(self.to_engine, 0)
        log.info("tokenizer stage %s serving", self.instance_id)
        self.notifier.ready(f"tokenizer {self.instance_id} serving")
        flush_until = float("inf")
        while time.monotonic() < flush_until:
            if stop.is_set() and self.state != "draining":
                # Stopping: new requests get a "draining" error; what was accepted goes on to the
                # engine for a second at most (the tokenizer holds nothing else).
                self.state, flush_until = "draining", time.monotonic() + 1.0
                self.notifier.stopping("passing accepted requests on to the engine")
            if self.state == "draining" and not self.pending:
                break
            self.notifier.tick()
            self._count_clients()
            poller.modify(self.frontend, 0 if self.pending else zmq.POLLIN)
            poller.modify(self.to_engine, zmq.POLLOUT if self.pending else 0)
            events = dict(poller.poll(100))
            self._flush_pending()
            if self.frontend in events:
                self._drain_frontend()
        self.close()

    def _count_clients(self, window_s: float = 10.0) -> None:
        """Clients heard from in the last `window_s` (the tokenizer keeps no other client state)."""
        now = time.monotonic()
        if now >= self._next_prune:
            self._next_prune = now + 1.0
            self._clients_seen = {c: t for c, t in self._clients_seen.items() if now - t < window_s}
            self.metrics.set_live_clients(len(self._clients_seen))

    def close(self) -> None:
        self.engine_peers.socket.close(linger=0)
        self.frontend.close(linger=0)
        self.to_engine.close(linger=500)
        self.security.close()

    def _drain_frontend(self, budget: int = 256) -> None:
        for _ in range(budget):
            if self.pending:
                return
            try:
                parts = self.frontend.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.handle(parts[0], parts[1:])

    # ------------------------------------------------------------------ messages

    def handle(self, identity: bytes, frames: list[bytes]) -> None:
        """One client message. Whatever it holds, the stage answers and carries on: a bug while
        handling one frame costs that frame an error reply, never the stage."""
        try:
            self._handle(identity, frames)
        except Exception as e:
            self.rejects("internal", f"{type(e).__name__} while handling a frame from {identity.hex()}", exc_info=True)
            self._reply(identity, p.ErrorOutput(p.clip(f"internal error while handling this frame: "
                                                       f"{type(e).__name__}: {e}")))

    def _handle(self, identity: bytes, frames: list[bytes]) -> None:
        self.metrics.frame_received()
        self._clients_seen[identity] = time.monotonic()
        if len(frames) != 1:
            self.rejects("multipart", f"{len(frames)} frames from {identity.hex()}")
            self._reply(identity, p.ErrorOutput(f"expected exactly one frame per message, got {len(frames)}"))
            return
        try:
            msg = p.decode(frames[0])
        except ProtocolError as e:
            self.rejects("bad_frame", f"from {identity.hex()}: {e}")
            self._reply(identity, p.ErrorOutput(p.clip(str(e)), e.request_id))
            return
        if isinstance(msg, p.GenerateReq):
            self._on_generate(identity, msg)
        elif isinstance(msg, p.AbortReq):
            self._forward(identity, "", p.AbortReq(engine_request_id(identity, msg.request_id)).encode())
        elif isinstance(msg, p.Ping):
            self._reply(identity, p.Pong("tokenizer", self.instance_id, self.engine_peers.connected, self.state,
                                         time.monotonic() - self.started_at))
        else:
            self.rejects("wrong_type", f"{msg.TYPE!r} from {identity.hex()}")
            self._reply(identity, p.ErrorOutput(f"the tokenizer does not accept {msg.TYPE!r} messages; "
                                                "send 'generate', 'abort' or 'ping'"))

    def _on_generate(self, identity: bytes, req: p.GenerateReq) -> None:
        if self.state == "draining":
            self.metrics.request_rejected()
            self._reply(identity, p.StreamOutput([p.error_delta(req.request_id, DRAINING)]))
            return
        started = time.perf_counter()
        try:
            tokenized = self.tokenize(identity, req)
        except RequestRejected as e:
            self.metrics.request_rejected()
            self._reply(identity, p.StreamOutput([p.error_delta(req.request_id, str(e))]))
            return
        except Exception as e:  # the tokenizer or template failed in a way no check foresaw
            self.rejects("internal", f"{type(e).__name__} while tokenizing {req.request_id!r}", exc_info=True)
            self._reply(identity, p.StreamOutput([p.error_delta(req.request_id, f"could not tokenize the request: "
                                                                                f"{type(e).__name__}: {e}")]))
            return
        self.metrics.tokenize_seconds(time.perf_counter() - started)
        self.metrics.request_forwarded()
        self._forward(identity, req.request_id, tokenized.encode())

    def tokenize(self, identity: bytes, req: p.GenerateReq) -> p.TokenizedReq:
        """Validate and tokenize; `RequestRejected` says what was wrong."""
        unknown = set(req.sampling) - self.sampling_fields
        if unknown:
            raise RequestRejected(f"unknown sampling parameter(s) {show(sorted(unknown))}; "
                                  f"allowed: {sorted(self.sampling_fields - set(NOT_SERVED))}")
        not_served = sorted(set(req.sampling) & set(NOT_SERVED))
        if not_served:
            raise RequestRejected("; ".join(f"sampling parameter {name!r} is not supported by the service: "
                                            f"{NOT_SERVED[name]}" for name in not_served))
        sampling = dict(req.sampling)
        # Text-side fields are the detokenizer's job; accept them in `sampling` too, as the
        # offline API does (one string or a list), under the same limits as `GenerateReq.stop`.
        stop = req.stop + _as_stop_list(sampling.pop("stop", None))
        try:
            check_strings("stop", stop, p.MAX_STOP_STRINGS, p.MAX_STOP_LEN)
        except ProtocolError as e:
            raise RequestRejected(f"{e} (stop strings in 'stop' and 'sampling.stop' count together)") from None
        skip = sampling.pop("skip_special_tokens", req.skip_special_tokens)
        include_stop = sampling.pop("include_stop_str_in_output", False)
        try:
            self.make_sampling(**sampling, stop=stop, skip_special_tokens=skip, include_stop_str_in_output=include_stop)
        except (ValueError, TypeError) as e:
            raise RequestRejected(f"invalid sampling parameters: {e}") from None
        ids = self._prompt_ids(req)
        meta = {"client": identity, "rid": req.request_id, "stop": stop, "skip": skip,
                "include_stop": include_stop, "min_tokens": sampling.get("min_tokens", 0),
                "tail": p.pack_token_ids(ids[-PROMPT_CONTEXT_TOKENS:]), "t": time.time()}
        return p.TokenizedReq(engine_request_id(identity, req.request_id), p.pack_token_ids(ids), sampling, meta,
                              priority=req.priority, resend=req.resend)

    def _prompt_ids(self, req: p.GenerateReq) -> list[int]:
        if req.prompt_token_ids is not None:
            ids = req.prompt_token_ids
        elif req.messages is not None:
            try:
                text = self.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=False)
            except Exception as e:  # template errors come in many types
                raise RequestRejected(f"cannot apply the model's chat template: {e}") from None
            ids = self.tokenizer.encode(self._bounded(text), add_special_tokens=False)
        else:
            ids = self.tokenizer.encode(self._bounded(req.prompt))
        if not ids:
            raise RequestRejected("prompt is empty: at least one token is needed")
        if self.max_prompt_tokens is not None and len(ids) >= self.max_prompt_tokens:
            raise RequestRejected(f"prompt has {len(ids)} tokens but the model's context length is "
                                  f"{self.max_prompt_tokens} (prompt plus at least one output token must fit)")
        return ids

    def _bounded(self, text: str) -> str:
        """Refuse, before tokenizing, text far longer than any prompt the model could take: a
        megabyte of text costs the stage seconds and hundreds of MB to turn into tokens."""
        if self.max_prompt_tokens is not None and len(text) > MAX_CHARS_PER_TOKEN * self.max_prompt_tokens:
            raise RequestRejected(f"prompt has {len(text)} characters, more than the model's context length of "
                                  f"{self.max_prompt_tokens} tokens could hold (at most {MAX_CHARS_PER_TOKEN} "
                                  "characters per token are allowed for)")
        return text

    def _forward(self, identity: bytes, request_id: str, frame: bytes) -> None:
        self.pending.append((time.monotonic(), identity, request_id, frame))
        self._flush_pending()

    def _flush_pending(self) -> None:
        while self.pending:
            queued_at, identity, request_id, frame = self.pending[0]
            try:
                self.to_engine.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                waited = time.monotonic() - queued_at
                limit = ENGINE_STALL_S if self.engine_peers.connected else ENGINE_RECONNECT_GRACE_S
                if waited < limit:
                    return  # engine busy (backpressure) or reconnecting: hold, stop reading clients
                self.pending.popleft()
                if request_id:  # aborts for a dead engine need no answer
                    delta = dict(p.error_delta(request_id, NO_ENGINE), engine_dead=True)
                    self._reply(identity, p.StreamOutput([delta]))
                continue
            self.pending.popleft()

    def _reply(self, identity: bytes, msg: p.Message) -> None:
        try:
            self.frontend.send_multipart([identity, msg.encode()], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # EHOSTUNREACH: client gone; EAGAIN: it is not reading
            log.info("could not reply to client %s: %s", identity.hex(), e)


def _as_stop_list(value: Any) -> list[str]:
    """`sampling.stop` as the offline API takes it: absent, one string, or a list of strings."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return value
    raise RequestRejected(f"sampling.stop must be a string or a list of strings, got {show(value)}")


def engine_request_id(identity: bytes, request_id: str) -> str:
    """Client request ids are only unique per client; the engine sees '<client>:<request>'."""
    return f"{identity.hex()}:{request_id}"


# SamplingParams fields the offline API has but the service does not carry yet.
NOT_SERVED = {
    "logprobs": "log-probabilities are not streamed yet",
    "logits_processors": "custom processors are Python objects, available in-process only",
}


def sampling_fields(params_cls) -> set[str]:
    return {f.name for f in dataclasses.fields(params_cls)}
