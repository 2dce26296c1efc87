"""The wire protocol shared by the client and the three service stages.

Every ZeroMQ message carries one msgpack frame (after the routing-id frame on ROUTER sockets):
``[PROTOCOL_VERSION, type, body]`` where ``type`` names one of the message dataclasses below and
``body`` is a map of its fields. No pickle anywhere: a frame decodes into plain data, then into a
typed message, or raises `ProtocolError` with a sentence saying what was wrong, which the stage
sends back to the sender as data. Token ids travel packed (little-endian uint32 bytes).

Flow (see docs/service.md): client --GenerateReq/AbortReq/Ping--> tokenizer --TokenizedReq/
AbortReq--> engine --StepOutput/EngineStatus--> detokenizer --StreamOutput/EngineStatus/Pong-->
client; detokenizer --AbortReq--> engine.
"""
from __future__ import annotations

import sys
from array import array
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar

import msgpack

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 16 * 1024 * 1024
"""Largest frame a stage accepts from a client (ZMQ_MAXMSGSIZE on client-facing sockets)."""

FINISH_REASONS = ("stop", "length", "abort", "error")
MAX_STOP_STRINGS, MAX_STOP_LEN = 64, 1024
"""Stop strings are matched on every step in the detokenizer: bound what one request can ask."""


class ProtocolError(ValueError):
    """A frame that is not a valid message; the text says what was wrong."""


# ---------------------------------------------------------------- packed token ids

_UINT32 = "I" if array("I").itemsize == 4 else "L"


def pack_token_ids(token_ids: list[int] | array) -> bytes:
    """list of token ids -> little-endian uint32 bytes (one C call, no per-token Python loop)."""
    packed = token_ids if isinstance(token_ids, array) else array(_UINT32, token_ids)
    if sys.byteorder == "big":
        packed = array(_UINT32, packed)
        packed.byteswap()
    return packed.tobytes()


def unpack_token_ids(data: bytes | list[int]) -> list[int]:
    """Inverse of `pack_token_ids`; a plain list of ints is accepted too (hand-written clients)."""
    if isinstance(data, list):
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in data):
            raise ProtocolError("token ids must be non-negative integers below 2**32")
        return data
    if not isinstance(data, (bytes, bytearray)):
        raise ProtocolError(f"token ids must be packed uint32 bytes or a list of ints, got {type(data).__name__}")
    if len(data) % 4:
        raise ProtocolError(f"packed token ids must be a multiple of 4 bytes, got {len(data)}")
    ids = array(_UINT32)
    ids.frombytes(data)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tolist()


# ---------------------------------------------------------------- message registry

_REGISTRY: dict[str, type[Message]] = {}


def _message(type_name: str):
    def register(cls: type[Message]) -> type[Message]:
        cls.TYPE = type_name
        cls._FIELDS = tuple(f.name for f in fields(cls))
        _REGISTRY[type_name] = cls
        return cls

    return register


@dataclass
class Message:
    TYPE: ClassVar[str] = ""
    _FIELDS: ClassVar[tuple[str, ...]] = ()

    def encode(self) -> bytes:
        body = {name: getattr(self, name) for name in self._FIELDS}
        return msgpack.packb([PROTOCOL_VERSION, self.TYPE, body], use_bin_type=True)

    def validate(self) -> None:
        """Check field values of a decoded message; raise `ProtocolError` naming the problem."""


def _required_fields(cls: type[Message]) -> set[str]:
    return {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}


def decode(frame: bytes) -> Message:
    """One frame -> a typed message, or `ProtocolError` naming the problem."""
    try:
        obj = msgpack.unpackb(frame, raw=False, use_list=True)
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise ProtocolError(f"frame is not valid msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(obj, list) or len(obj) != 3:
        raise ProtocolError("a message must be a msgpack array [protocol_version, type, body]")
    version, type_name, body = obj
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r} is not supported; this service speaks version {PROTOCOL_VERSION}")
    cls = _REGISTRY.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {type_name!r}; known types: {', '.join(sorted(_REGISTRY))}")
    if not isinstance(body, dict):
        raise ProtocolError(f"the body of a {type_name!r} message must be a map")
    unknown = set(body) - set(cls._FIELDS)
    if unknown:
        raise ProtocolError(f"unknown field(s) {sorted(map(str, unknown))} in a {type_name!r} message; allowed: {list(cls._FIELDS)}")
    missing = _required_fields(cls) - set(body)
    if missing:
        raise ProtocolError(f"missing field(s) {sorted(missing)} in a {type_name!r} message")
    msg = cls(**body)
    msg.validate()
    return msg


def peek_request_id(frame: bytes) -> str | None:
    """Best-effort request id of a frame that failed to decode, so its error reaches the right stream."""
    try:
        obj = msgpack.unpackb(frame, raw=False)
        rid = obj[2].get("request_id")
        return rid if isinstance(rid, str) else None
    except Exception:
        return None


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ProtocolError(message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ---------------------------------------------------------------- client -> tokenizer

@_message("generate")
@dataclass
class GenerateReq(Message):
    """A new request: exactly one of `prompt` (text), `messages` (chat) or `prompt_token_ids`."""
    request_id: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_token_ids: bytes | list[int] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    """Engine sampling parameters (temperature, max_tokens, ignore_eos, stop_token_ids, ...)."""
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True

    def validate(self) -> None:
        _check(isinstance(self.request_id, str) and 0 < len(self.request_id) <= 256,
               "request_id must be a non-empty string of at most 256 characters")
        given = [name for name in ("prompt", "messages", "prompt_token_ids") if getattr(self, name) is not None]
        _check(len(given) == 1, f"give exactly one of prompt, messages, prompt_token_ids (got {given or 'none'})")
        _check(self.prompt is None or isinstance(self.prompt, str), "prompt must be a string")
        if self.messages is not None:
            _check(isinstance(self.messages, list) and len(self.messages) > 0, "messages must be a non-empty list")
            for m in self.messages:
                _check(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str),
                       "each chat message must be a map with string 'role' and 'content'")
        if self.prompt_token_ids is not None:
            self.prompt_token_ids = unpack_token_ids(self.prompt_token_ids)
        _check(isinstance(self.sampling, dict), "sampling must be a map of sampling parameters")
        _check(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
               "stop must be a list of non-empty strings")
        _check(len(self.stop) <= MAX_STOP_STRINGS and all(len(s) <= MAX_STOP_LEN for s in self.stop),
               f"stop allows at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_LEN} characters")
        _check(isinstance(self.skip_special_tokens, bool), "skip_special_tokens must be true or false")


@_message("abort")
@dataclass
class AbortReq(Message):
    """Cancel a request. Idempotent: aborting an unknown or finished request is a no-op."""
    request_id: str

    def validate(self) -> None:
        _check(isinstance(self.request_id, str) and self.request_id != "", "request_id must be a non-empty string")


@_message("ping")
@dataclass
class Ping(Message):
    """Client heartbeat to the detokenizer (keeps its requests alive) and readiness probe."""


@_message("stats")
@dataclass
class StatsReq(Message):
    """Ask the detokenizer for its own state sizes and the engine's latest stats."""


# ---------------------------------------------------------------- tokenizer -> engine

@_message("tokenized")
@dataclass
class TokenizedReq(Message):
    request_id: str
    """Service-wide id: '<client id hex>:<client request id>'."""
    prompt_token_ids: bytes
    sampling: dict[str, Any]
    meta: dict[str, Any]
    """What the detokenizer needs, passed through the engine untouched: see `RequestMeta`."""

    def validate(self) -> None:
        _check(isinstance(self.request_id, str), "request_id must be a string")


# ---------------------------------------------------------------- engine -> detokenizer

@_message("step")
@dataclass
class StepOutput(Message):
    """Everything one engine step produced, in one message.

    `started`: metas of requests accepted since the last message (always before their outputs).
    `rejected`: [request_id, meta, error text] for requests the engine refused.
    `outputs`: [request_id, packed new token ids, finished, finish_reason, num_prompt_tokens,
    num_output_tokens, num_cached_tokens] per request that produced something.
    """
    started: list[dict[str, Any]] = field(default_factory=list)
    rejected: list[list[Any]] = field(default_factory=list)
    outputs: list[list[Any]] = field(default_factory=list)



@_message("engine_status")
@dataclass
class EngineStatus(Message):
    """Engine heartbeat (engine -> detok, periodic) and its echo to clients when the state changes."""
    alive: bool
    instance_id: str = ""
    reason: str = ""
    stats: dict[str, Any] = field(default_factory=dict)



# ---------------------------------------------------------------- stages -> client

@_message("stream")
@dataclass
class StreamOutput(Message):
    """Deltas for one client's requests. Each delta is a map: request_id, text, token_ids (packed),
    finish_reason (None while streaming; "stop"/"length"/"abort"/"error" on the terminal delta),
    error (text, with finish_reason "error"), usage (on the terminal delta)."""
    deltas: list[dict[str, Any]]



@_message("error")
@dataclass
class ErrorOutput(Message):
    """An error not tied to a live stream (e.g. a frame that could not be decoded at all)."""
    message: str
    request_id: str | None = None



@_message("pong")
@dataclass
class Pong(Message):
    role: str
    instance_id: str
    engine_alive: bool = False



@_message("stats_result")
@dataclass
class StatsOutput(Message):
    stats: dict[str, Any]



def error_delta(request_id: str, message: str) -> dict[str, Any]:
    """The terminal delta of a request that failed."""
    return {"request_id": request_id, "text": "", "token_ids": b"", "finish_reason": "error",
            "error": message, "usage": None}
