"""The wire protocol shared by the client and the three service stages.

Every ZeroMQ message carries one msgpack frame (after the routing-id frame on ROUTER sockets):
``[PROTOCOL_VERSION, type, body]`` where ``type`` names one of the message dataclasses below and
``body`` is a map of its fields. No pickle anywhere: a frame decodes into plain data (with
msgpack's size limits and a nesting limit applied before anything looks at it), then into a
typed message whose every field is checked (`checks.py`), or raises `ProtocolError` with a
sentence saying what was wrong, which the stage sends back to the sender as data. Stage-to-stage
messages are checked as strictly as client ones: over tcp anyone who reaches a port can send them.
Token ids travel packed (little-endian uint32 bytes). Rows inside a message (a step's outputs,
a resync's entries, a stream's deltas, a request's meta, a resume's requests) are NamedTuples:
positional arrays on the wire, named in code, read and checked in one place (`typed_rows`).

Flow (see docs/service.md): client --GenerateReq/AbortReq/Ping--> tokenizer --TokenizedReq-->
engine (input) --StepOutput/EngineStatus/Resync--> detokenizer --StreamOutput/EngineStatus/
Pong--> client; tokenizer --AbortReq--> engine (control); detokenizer --AbortReq/DetokHello-->
engine (control); client --Resume--> detokenizer. Commands (one question, one answer): client
--TokenizeReq/DetokenizeReq--> tokenizer --TokenizeOutput/DetokenizeOutput--> client; client
--ResetPrefixCacheReq--> tokenizer --> engine (control) --ResetPrefixCacheOutput--> detokenizer
--> client.
"""
from __future__ import annotations

import hashlib
import sys
from array import array
from dataclasses import MISSING, dataclass, field, fields
from enum import Enum
from typing import Any, Callable, ClassVar, NamedTuple

import msgpack

from .checks import (ProtocolError, check, check_bool, check_bytes, check_depth, check_fields, check_int,
                     check_list, check_map, check_number, check_opt_str, check_str, is_int, show)
from .sampling import MAX_LOGPROBS, MAX_STOP_STRING_LENGTH, SamplingParams
from .template_kwargs import parse_template_kwargs

__all__ = ["ProtocolError", "PROTOCOL_VERSION", "STAGE_PROTOCOL_VERSION", "FinishReason", "decode", "pack_token_ids",
           "unpack_token_ids", "error_delta"]

PROTOCOL_VERSION = 2
"""The client protocol: the messages a client sends and receives (requests, aborts, pings,
resumes, deltas, pongs, errors, engine status), also used between stages where they are the same.
2: a stream's deltas and a resume's requests are positional rows (`DeltaRow`, `ResumeRow`), where
version 1 sent maps and bare lists."""
STAGE_PROTOCOL_VERSION = 4
"""The messages only stages exchange (`TokenizedReq`, `DetokHello`, `StepOutput`, `Resync`). 3: the
sampling parameters travel as one typed struct (`SamplingParams`), and a request's meta carries
its text-side part instead of copies of those fields; a resync entry is a meta and an output row.
4: an output row carries its tokens' logprobs and the prompt's (`TokenLogprobs`). Versioned apart from the client protocol, so a change between the stages leaves clients working;
each message type has one version, and a frame of another is refused naming both."""
MAX_FRAME_BYTES = 16 * 1024 * 1024
"""Largest frame any stage accepts (ZMQ_MAXMSGSIZE on every receiving socket)."""
MAX_ID_LEN = 256
"""A client's request id."""
MAX_ENGINE_ID_LEN = 2 * 255 + 1 + MAX_ID_LEN
MAX_TENANT_LEN = 128
"""Characters of a `GenerateReq.tenant` (an HTTP front names an API key by a 32-character digest)."""
"""'<routing id hex>:<request id>'; zmq routing ids are at most 255 bytes."""
MAX_INSTANCE_ID_LEN = 64
MAX_ERROR_LEN = 4096
"""Error and reason texts; longer ones are cut by `clip` before they are sent."""
MAX_CHAT_MESSAGES = 4096
MAX_TOOLS_CHARS = 64 * 1024
"""`GenerateReq.tools` travels as JSON text of at most this many characters (as a request's
response_format does, `response_format.MAX_FORMAT_CHARS`): a parameter schema nests as deep as it
likes inside one string, never against the frame's nesting limit."""
MAX_PROMPT_TAIL = 64
"""Prompt tokens a request's meta may carry as left context for detokenization."""
MAX_ROWS = 1 << 16
"""Rows in one step / resync / resume message."""
MAX_PRIORITY = 1 << 31
MAX_TOKEN_TEXT = 1024
"""Characters of one vocabulary token's text in a logprob entry."""
MAX_TOKEN_STRS = 1 << 16
"""Token strings one `tokenize_result` may carry (a list: msgpack's array limit is 262,144)."""


class FinishReason(str, Enum):
    """Why a request ended. The values are the wire's strings and OpenAI's `finish_reason`, and a
    member compares equal to its string, so code that reads "stop" keeps working."""
    STOP = "stop"
    """An EOS or stop token, or a stop string matched."""
    LENGTH = "length"
    """max_tokens, or the model's context, reached."""
    ABORT = "abort"
    """Cancelled: by its client, or by the service (draining, its client gone)."""
    ERROR = "error"
    """It failed alone (its sampling, a refusal, an engine that died twice): the error says why."""

    def __str__(self) -> str:
        return self.value


FINISH_REASONS = tuple(r.value for r in FinishReason)
_FINISH_REASON_OF = {r.value: r for r in FinishReason}
STAGE_STATES = ("loading", "ready", "draining")
"""A stage's life: loading (the engine's model), ready (serving), draining (stopping: in-flight
requests finish, new ones are refused)."""

# msgpack's own limits, enforced while unpacking: no single string, binary, array or map can be
# larger than a frame could legitimately need, and ext types (timestamps, custom) are refused.
_UNPACK_LIMITS = dict(max_str_len=MAX_FRAME_BYTES, max_bin_len=MAX_FRAME_BYTES, max_array_len=1 << 18,
                      max_map_len=1 << 12, max_ext_len=0)


def frames_within(make: Callable[[list], Message], rows: list, limit: int = MAX_FRAME_BYTES) -> list[tuple[list, bytes]]:
    """`make(rows)` as (rows, encoded frame) pairs, each frame at most `limit` bytes: one frame
    when it fits (one encoding, the usual case), else the rows halved until each part fits, in
    order. Rows are independent entries (requests), so a receiver handles the parts as it would
    the whole. A frame over the limit would be dropped by the receiving socket with its
    connection, which a stage takes for its peer's death. A single row over the limit stays one
    frame: the protocol's field limits keep every row far below it."""
    frame = make(rows).encode()
    if len(frame) <= limit or len(rows) < 2:
        return [(rows, frame)]
    half = len(rows) // 2
    return frames_within(make, rows[:half], limit) + frames_within(make, rows[half:], limit)


def clip(text: str, limit: int = MAX_ERROR_LEN) -> str:
    """An error text cut to what the receiving side accepts."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


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
        if not all(is_int(t) and 0 <= t < 2**32 for t in data):
            raise ProtocolError("token ids must be non-negative integers below 2**32")
        return data
    check_packed("token ids", data, MAX_FRAME_BYTES // 4)
    ids = array(_UINT32)
    ids.frombytes(data)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tolist()


def read_sampling(name: str, value: Any) -> SamplingParams:
    """A decoded sampling map -> `SamplingParams`, through its one validator; `ProtocolError`
    with the validator's own words (the same a client or the HTTP front gets for that value)."""
    if isinstance(value, SamplingParams):  # built in this process (a stage checking its own frame)
        return value
    try:
        return SamplingParams.from_dict(value)
    except ValueError as e:
        raise ProtocolError(str(e)) from None


def read_finish_reason(name: str, value: Any) -> FinishReason | None:
    if value is None:
        return None
    reason = _FINISH_REASON_OF.get(value) if isinstance(value, str) else None
    if reason is None:
        raise ProtocolError(f"{name} must be null or one of {FINISH_REASONS}, got {show(value)}")
    return reason


def check_packed(name: str, value: Any, max_tokens: int) -> None:
    if not isinstance(value, (bytes, bytearray)):
        raise ProtocolError(f"{name} must be packed uint32 bytes, got {show(value)}")
    if len(value) % 4:
        raise ProtocolError(f"packed {name} must be a multiple of 4 bytes, got {len(value)}")
    if len(value) > 4 * max_tokens:
        raise ProtocolError(f"{name} may hold at most {max_tokens} tokens, got {len(value) // 4}")


# ---------------------------------------------------------------- message registry

_REGISTRY: dict[str, type[Message]] = {}


def _message(type_name: str, version: int = PROTOCOL_VERSION):
    def register(cls: type[Message]) -> type[Message]:
        cls.TYPE = type_name
        cls.VERSION = version
        cls._NAMES = tuple(f.name for f in fields(cls))
        cls._FIELDS = frozenset(cls._NAMES)
        cls._REQUIRED = frozenset(f.name for f in fields(cls)
                                  if f.default is MISSING and f.default_factory is MISSING)
        _REGISTRY[type_name] = cls
        return cls

    return register


@dataclass
class Message:
    TYPE: ClassVar[str] = ""
    VERSION: ClassVar[int] = PROTOCOL_VERSION
    _NAMES: ClassVar[tuple[str, ...]] = ()
    _FIELDS: ClassVar[frozenset[str]] = frozenset()
    _REQUIRED: ClassVar[frozenset[str]] = frozenset()
    TOLERANT: ClassVar[bool] = False
    """Fields it does not know are dropped instead of refused. True for what the service sends a
    client, so a client keeps working against a newer service that adds a field; everything a
    stage receives from a client or another stage is checked strictly."""

    def encode(self) -> bytes:
        body = {name: getattr(self, name) for name in self._NAMES}
        return msgpack.packb([self.VERSION, self.TYPE, body], use_bin_type=True, default=_wire_value)

    def validate(self) -> None:
        """Check field values of a decoded message; raise `ProtocolError` naming the problem."""


def decode(frame: bytes) -> Message:
    """One frame -> a typed, checked message, or `ProtocolError` naming the problem."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    try:
        obj = msgpack.unpackb(frame, raw=False, use_list=True, **_UNPACK_LIMITS)
    except Exception as e:  # msgpack raises several unrelated types for garbage; the text is its own
        raise ProtocolError(f"frame is not valid msgpack within the limits ({type(e).__name__}: {show(str(e))})") from None
    check(isinstance(obj, list) and len(obj) == 3, "a message must be a msgpack array [protocol_version, type, body]")
    version, type_name, body = obj  # only `show` (bounded) looks at these before the depth check
    if not (is_int(version) and version in _VERSIONS):
        raise ProtocolError(f"protocol version {show(version)} is not supported; this service speaks version "
                            f"{PROTOCOL_VERSION} (clients) and {STAGE_PROTOCOL_VERSION} (between its stages)")
    cls = _REGISTRY.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {show(type_name)}; known types: {', '.join(sorted(_REGISTRY))}")
    if version != cls.VERSION:
        raise ProtocolError(f"protocol version {version} is not supported for {type_name!r} messages; this service "
                            f"speaks version {cls.VERSION} for them (its stages must all run the same release)")
    if not isinstance(body, dict):
        raise ProtocolError(f"the body of a {type_name!r} message must be a map")
    rid = body.get("request_id")
    rid = rid if isinstance(rid, str) and 0 < len(rid) <= MAX_ENGINE_ID_LEN else None
    try:
        check_depth(body)
        if cls.TOLERANT:
            body = {k: v for k, v in body.items() if isinstance(k, str) and k in cls._FIELDS}
        check_fields(f"a {type_name!r} message", body, cls._FIELDS, cls._REQUIRED)
        msg = cls(**body)
        msg.validate()
    except ProtocolError as e:
        raise ProtocolError(str(e), rid) from None
    return msg


_VERSIONS = (PROTOCOL_VERSION, STAGE_PROTOCOL_VERSION)


def _wire_value(value: Any) -> Any:
    """msgpack's hook for the one non-plain value a message holds: the sampling struct, as its map."""
    if isinstance(value, SamplingParams):
        return value.to_dict()
    raise TypeError(f"cannot encode a {type(value).__name__} in a message")


# ---------------------------------------------------------------- client -> tokenizer

@_message("generate")
@dataclass
class GenerateReq(Message):
    """A new request: exactly one of `prompt` (text), `messages` (chat) or `prompt_token_ids`."""
    request_id: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_token_ids: bytes | list[int] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """Every sampling parameter, the text-side ones included; a map of its non-default fields on
    the wire (`SamplingParams.to_dict`), checked by its own validator on decode."""
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    """`stop` and `skip_special_tokens`: where clients before the sampling struct put them. Still
    read (folded into `sampling` on decode: stop strings from both count against one limit, the
    sampling map's skip_special_tokens wins), so those clients keep working; this client sends
    them inside `sampling`."""
    priority: int = 0
    """Higher is admitted first under the engine's "priority" scheduling policy."""
    resend: bool = False
    """A client sends a request again after a tokenizer restart (it may have been lost there);
    the engine ignores a resend whose id it already holds or recently finished."""
    output_token_ids: bytes | None = None
    """Packed output the request already has: a client continuing a stream whose engine died
    sends the tokens it received, and the engine goes on from there (they count as output)."""
    output_chars: int = 0
    """With `output_token_ids`: the characters of text the client received; the stream resumes
    after them (text held back at the break, e.g. a partial stop string, still comes)."""
    tools: str | None = None
    """With `messages`: the tools the chat offers the model (OpenAI's `tools` list as JSON text,
    like response_format, so a parameter schema never meets the frame's nesting limit); the
    tokenizer renders them through the model's chat template."""
    chat_template_kwargs: str | None = None
    """With `messages`: extra variables for the chat template, as JSON text (`template_kwargs`)."""
    tenant: str | None = None
    """Whom the request is for, as the service's HTTP front says (an API key's digest, else the
    peer's address): the client it counts as for fair turns, per-client limits and the per-client
    cache salt. Honoured only from a connection with the service's own key, or without CURVE (the
    service's own user); any other client's request that sets it is refused."""

    def validate(self) -> None:
        check_str("request_id", self.request_id, MAX_ID_LEN)
        given = [name for name in ("prompt", "messages", "prompt_token_ids") if getattr(self, name) is not None]
        check(len(given) == 1, f"give exactly one of prompt, messages, prompt_token_ids (got {given or 'none'})")
        if self.prompt is not None:
            check_str("prompt", self.prompt, MAX_FRAME_BYTES, empty=True)
        if self.messages is not None:
            check_messages(self.messages)
        if self.prompt_token_ids is not None:
            self.prompt_token_ids = unpack_token_ids(self.prompt_token_ids)
        self.sampling = read_sampling("sampling", self._with_own_fields(self.sampling))
        self.stop, self.skip_special_tokens = [], True  # folded into `sampling`: one place to read them
        check_int("priority", self.priority, -MAX_PRIORITY, MAX_PRIORITY)
        check_bool("resend", self.resend)
        if self.output_token_ids is not None:
            check_packed("output_token_ids", self.output_token_ids, MAX_FRAME_BYTES // 4)
        check_int("output_chars", self.output_chars, 0, 2**31)
        if self.tools is not None:
            check(self.messages is not None, "tools are offered only with messages (a chat)")
            check_str("tools", self.tools, MAX_TOOLS_CHARS)
        if self.chat_template_kwargs is not None:
            check(self.messages is not None, "chat_template_kwargs apply only with messages (a chat)")
            parse_template_kwargs(self.chat_template_kwargs)
        if self.tenant is not None:
            check_str("tenant", self.tenant, MAX_TENANT_LEN)

    def _with_own_fields(self, sampling: Any) -> Any:
        """The sampling map with this message's own `stop` and `skip_special_tokens` folded in."""
        if self.stop == [] and self.skip_special_tokens is True:
            return sampling
        if isinstance(sampling, SamplingParams):  # the field's default: no sampling map was sent
            sampling = sampling.to_dict()
        if not isinstance(sampling, dict):
            return sampling  # refused by its reader, naming what it is
        check(isinstance(self.stop, list), "stop must be a list of strings, got {}", self.stop)
        check_bool("skip_special_tokens", self.skip_special_tokens)
        own = sampling.get("stop")
        check(own is None or isinstance(own, (str, list)), "stop must be a string or a list of non-empty strings, "
              "got {}", own)
        own = [own] if isinstance(own, str) else own or []
        return {"skip_special_tokens": self.skip_special_tokens, **sampling, "stop": [*self.stop, *own]}


def check_messages(messages: Any) -> None:
    """A chat's messages as they travel (`GenerateReq`, `TokenizeReq`)."""
    check(isinstance(messages, list) and 0 < len(messages) <= MAX_CHAT_MESSAGES,
          f"messages must be a non-empty list of at most {MAX_CHAT_MESSAGES} chat messages")
    for m in messages:
        check(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
              and all(isinstance(k, str) for k in m),
              "each chat message must be a map with string 'role' and 'content'")


@_message("abort")
@dataclass
class AbortReq(Message):
    """Cancel a request. Idempotent: aborting an unknown or finished request is a no-op."""
    request_id: str

    def validate(self) -> None:
        check_str("request_id", self.request_id, MAX_ENGINE_ID_LEN)


@_message("ping")
@dataclass
class Ping(Message):
    """Client heartbeat to the detokenizer (keeps its requests alive) and to the tokenizer."""


@_message("stats")
@dataclass
class StatsReq(Message):
    """Ask the detokenizer for its own state sizes and the engine's latest stats."""


@_message("resume")
@dataclass
class Resume(Message):
    """Client -> a restarted detokenizer: the requests it still waits for (`ResumeRow`), so their
    streams continue where they broke off."""
    requests: list[ResumeRow]

    def validate(self) -> None:
        self.requests = typed_rows("requests", self.requests, ResumeRow)


class ResumeRow(NamedTuple):
    """A request a client still waits for (`Resume.requests`) and how much of it it has."""
    request_id: str
    num_tokens: int
    num_chars: int

    def check(self) -> None:
        check_str("request_id", self.request_id, MAX_ID_LEN)
        check_int("tokens received", self.num_tokens, 0, 2**31)
        check_int("characters received", self.num_chars, 0, 2**31)


# ---------------------------------------------------------------- request meta (tokenizer -> detok)

class RequestMeta(NamedTuple):
    """What the detokenizer needs of a request, made by the tokenizer and passed through the
    engine untouched (`TokenizedReq.meta`, and the engine's started, rejected and resync rows)."""
    client: bytes
    """The client's routing id: where the request's deltas go."""
    client_request_id: str
    sampling: SamplingParams = SamplingParams()
    """The request's text-side sampling parameters (`SamplingParams.text_params`: stop strings,
    include_stop_str_in_output, skip_special_tokens, min_tokens), the rest at their defaults."""
    prompt_tail: bytes = b""
    """The prompt's last token ids (packed, at most MAX_PROMPT_TAIL): left context for decoding."""
    arrival: float = 0.0
    """When the tokenizer received it (epoch seconds)."""
    have_tokens: int = 0
    have_chars: int = 0
    """A continued stream: the output tokens and characters its client has already. The engine
    reports that output again with its first new token; the detokenizer sends only what follows."""
    reasoning_open: bool = False
    """The chat template ended the prompt inside a reasoning block (`<think>` opened in the
    generation prompt): the output starts as reasoning. Passed on in every delta."""

    def check(self) -> None:
        check_bytes("meta.client", self.client, 255)
        check_str("meta.client_request_id", self.client_request_id, MAX_ID_LEN)
        check_packed("meta.prompt_tail", self.prompt_tail, MAX_PROMPT_TAIL)
        check_number("meta.arrival", self.arrival)
        check_int("meta.have_tokens", self.have_tokens, 0, 2**31)
        check_int("meta.have_chars", self.have_chars, 0, 2**31)
        check_bool("meta.reasoning_open", self.reasoning_open)


def typed_meta(meta: Any) -> RequestMeta:
    """A decoded meta -> `RequestMeta`, checked; `ProtocolError` naming the problem."""
    return typed_row("meta", meta, RequestMeta)


# ---------------------------------------------------------------- tokenizer -> engine

@_message("tokenized", STAGE_PROTOCOL_VERSION)
@dataclass
class TokenizedReq(Message):
    request_id: str
    """Service-wide id: '<client id hex>:<client request id>'."""
    prompt_token_ids: bytes
    sampling: SamplingParams
    """As the client's request had it (`GenerateReq.sampling`), checked again by the same validator."""
    meta: RequestMeta
    priority: int = 0
    resend: bool = False
    output_ids: bytes = b""
    """Packed output the request already has (`GenerateReq.output_token_ids`), continued from."""
    tenant: str = ""
    """The client it counts as for fair turns and per-client limits, as the tokenizer tells
    (`TokenizerStage.tenant_of`); empty: its routing id (`meta.client`)."""

    def validate(self) -> None:
        check_str("request_id", self.request_id, MAX_ENGINE_ID_LEN)
        check_packed("prompt_token_ids", self.prompt_token_ids, MAX_FRAME_BYTES // 4)
        check_packed("output_ids", self.output_ids, MAX_FRAME_BYTES // 4)
        self.sampling = read_sampling("sampling", self.sampling)
        self.meta = typed_meta(self.meta)
        check_int("priority", self.priority, -MAX_PRIORITY, MAX_PRIORITY)
        check_bool("resend", self.resend)
        check_str("tenant", self.tenant, 2 * 255 + 8, empty=True)  # the longest: 'id:' + a 255-byte routing id's hex


# ---------------------------------------------------------------- detokenizer -> engine

@_message("detok_hello", STAGE_PROTOCOL_VERSION)
@dataclass
class DetokHello(Message):
    """A detokenizer that just started asks the engine for every request it holds (a `Resync`)."""
    instance_id: str

    def validate(self) -> None:
        check_str("instance_id", self.instance_id, MAX_INSTANCE_ID_LEN)


# ---------------------------------------------------------------- engine -> detokenizer

class StartedRow(NamedTuple):
    """A request the engine accepted (`StepOutput.started`), before its first output."""
    request_id: str
    meta: RequestMeta

    def check(self) -> None:
        check_str("started request_id", self.request_id, MAX_ENGINE_ID_LEN)


class RejectedRow(NamedTuple):
    """A request the engine refused (`StepOutput.rejected`), and why."""
    request_id: str
    meta: RequestMeta
    error: str

    def check(self) -> None:
        check_str("rejected request_id", self.request_id, MAX_ENGINE_ID_LEN)
        check_str("rejection text", self.error, MAX_ERROR_LEN)


def check_logprob(name: str, value: Any) -> None:
    """A log-probability: a number <= 0 (a hair above for rounding), -inf allowed, NaN not."""
    check((is_int(value) or isinstance(value, float)) and value <= 1e-3, f"{name} must be a number <= 0, got {{}}",
          value)


class TokenLogprobs(NamedTuple):
    """One token's log-probability under the raw model distribution (before penalties,
    constraints and temperature), its rank (1: the most likely) and the most likely alternatives:
    what the engine computes (`SamplingParams.logprobs` / `prompt_logprobs`) and sends the
    detokenizer (`OutputRow`)."""
    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]

    def check(self) -> None:
        check_int("logprob token_id", self.token_id, 0, 2**31)
        check_logprob("logprob", self.logprob)
        check_int("logprob rank", self.rank, 1, 2**31)
        check_list("top_token_ids", self.top_token_ids, MAX_LOGPROBS)
        check(isinstance(self.top_logprobs, list) and len(self.top_logprobs) == len(self.top_token_ids),
              "top_logprobs must be a list as long as top_token_ids")
        for token_id, logprob in zip(self.top_token_ids, self.top_logprobs):
            check_int("top token id", token_id, 0, 2**31)
            check_logprob("top logprob", logprob)


def join_logprobs(first: list | None, first_tokens: int, second: list | None, second_tokens: int) -> list | None:
    """The logprob entries of two consecutive pieces of one output joined (an entry per token, or
    None where a piece with tokens has none, as a resync's rows do: then the joined piece has
    none either, since entries no longer line up with tokens)."""
    if first is None and not first_tokens:
        return second
    if second is None and not second_tokens:
        return first
    return None if first is None or second is None else first + second


class OutputRow(NamedTuple):
    """What one request produced in a step (`StepOutput.outputs`)."""
    request_id: str
    token_ids: bytes
    """New token ids, packed (`pack_token_ids`)."""
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    error: str | None
    logprobs: list[TokenLogprobs] | None = None
    """When the request asked for logprobs: the entries of the row's last tokens, one per token
    the engine sampled since the last row (a continued request's first row also repeats the
    output it continues from, which has none; a resync's row: none at all)."""
    prompt_logprobs: list[TokenLogprobs] | None = None
    """With prompt_logprobs, on the request's first output: one per prompt token (the first given:
    logprob 0, no alternatives)."""

    def check(self) -> None:
        check_str("output request_id", self.request_id, MAX_ENGINE_ID_LEN)
        check_packed("output token ids", self.token_ids, MAX_FRAME_BYTES // 4)
        check_bool("output finished", self.finished)
        for count in (self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens):
            check_int("output token count", count, 0, 2**31)
        check_opt_str("output error", self.error, MAX_ERROR_LEN)
        check(self.logprobs is None or len(self.logprobs) <= len(self.token_ids) // 4,
              "output logprobs must have at most one entry per token")


class ResyncEntry(NamedTuple):
    """A request the engine holds or finished lately (`Resync.entries`): its meta and its whole
    output so far as one `OutputRow` (token_ids: every output token id, packed)."""
    meta: RequestMeta
    output: OutputRow

    @property
    def request_id(self) -> str:
        return self.output.request_id

    def check(self) -> None:
        pass  # both halves are rows, read and checked as such


def typed_row(name: str, row: Any, row_type: type, tolerant: bool = False) -> Any:
    """One decoded row -> a `row_type` (a NamedTuple: positional on the wire, named in code),
    checked, the values in it that have a type of their own (`_READERS`: a meta, a usage, the
    sampling struct, a finish reason) read by their readers; `ProtocolError`
    naming the problem. `tolerant`: a longer row (a newer service's added fields) is cut to the
    known ones, and a row from a service one version older, without the fields this version
    added (`_NEWEST_FIELDS`), takes their defaults. The one place rows are read."""
    width = len(row_type._fields)
    shortest = width - len(_NEWEST_FIELDS.get(row_type, ())) if tolerant else width
    if not (isinstance(row, (list, tuple)) and (shortest <= len(row) <= width or tolerant and len(row) > width)):
        items = f"{shortest} to {width}" if shortest < width else f"{width}"
        raise ProtocolError(f"each {name} row must have {items} items ({', '.join(row_type._fields)})")
    if len(row) > width:
        row = row[:width]
    elif len(row) < width:
        row = (*row, *(row_type._field_defaults[f] for f in row_type._fields[len(row):]))
    readers = _READERS.get(row_type)
    if readers:
        copied = False
        for i, read in readers:
            value = row[i]
            typed_value = read(row_type._fields[i], value)
            if typed_value is not value:  # most rows' readers return what they got (a null reason)
                if not copied:
                    row, copied = list(row), True
                row[i] = typed_value
    typed = tuple.__new__(row_type, row)  # its width checked above; skips NamedTuple's slower __new__
    typed.check()
    return typed


def typed_rows(name: str, rows: Any, row_type: type, tolerant: bool = False) -> list:
    """A decoded list of rows -> checked `row_type` rows (`typed_row`)."""
    check_list(name, rows, MAX_ROWS)
    return [typed_row(name, row, row_type, tolerant) for row in rows]


@_message("step", STAGE_PROTOCOL_VERSION)
@dataclass
class StepOutput(Message):
    """Everything one engine step produced, in one message: the requests accepted since the last
    message (always before their outputs), those refused, and an `OutputRow` per request that
    produced something."""
    instance_id: str
    started: list[StartedRow] = field(default_factory=list)
    rejected: list[RejectedRow] = field(default_factory=list)
    outputs: list[OutputRow] = field(default_factory=list)

    def validate(self) -> None:
        check_str("instance_id", self.instance_id, MAX_INSTANCE_ID_LEN)
        self.started = typed_rows("started", self.started, StartedRow)
        self.rejected = typed_rows("rejected", self.rejected, RejectedRow)
        self.outputs = typed_rows("outputs", self.outputs, OutputRow)


@_message("resync", STAGE_PROTOCOL_VERSION)
@dataclass
class Resync(Message):
    """The engine's answer to `DetokHello`: a `ResyncEntry` for every request it holds and those it
    finished in the last minute; split over frames, `last` on the final one."""
    instance_id: str
    detok_instance: str
    entries: list[ResyncEntry]
    last: bool

    def validate(self) -> None:
        check_str("instance_id", self.instance_id, MAX_INSTANCE_ID_LEN)
        check_str("detok_instance", self.detok_instance, MAX_INSTANCE_ID_LEN)
        self.entries = typed_rows("entries", self.entries, ResyncEntry)
        check_bool("last", self.last)


def _check_stats(stats: Any) -> None:
    check_map("stats", stats, 256)


def _check_state(name: str, state: Any) -> None:
    if state not in STAGE_STATES:
        raise ProtocolError(f"{name} must be one of {STAGE_STATES}, got {show(state)}")


@_message("engine_status")
@dataclass
class EngineStatus(Message):
    """Engine heartbeat (engine -> detok, periodic) and its echo to clients when the state changes."""
    TOLERANT = True
    alive: bool
    instance_id: str = ""
    reason: str = ""
    stats: dict[str, Any] = field(default_factory=dict)
    state: str = "ready"
    """One of STAGE_STATES while alive."""
    uptime_s: float = 0.0

    def validate(self) -> None:
        check_bool("alive", self.alive)
        check_str("instance_id", self.instance_id, MAX_INSTANCE_ID_LEN, empty=True)
        check_str("reason", self.reason, MAX_ERROR_LEN, empty=True)
        _check_stats(self.stats)
        _check_state("state", self.state)
        check_number("uptime_s", self.uptime_s)


# ---------------------------------------------------------------- commands: client -> stage -> client

@_message("tokenize")
@dataclass
class TokenizeReq(Message):
    """Tokenize a text or a chat as a request would be (vLLM's `/tokenize`); the tokenizer stage
    answers with a `TokenizeOutput`, or an `ErrorOutput` naming the problem, under `request_id`."""
    request_id: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    """None: a prompt gets them (True), a chat does not (its template writes them), as vLLM's defaults."""
    add_generation_prompt: bool = True
    """With `messages`: the template's cue for the assistant's turn at the end."""
    continue_final_message: bool = False
    """With `messages`: the last message left open, for the model to continue (not with
    `add_generation_prompt`)."""
    tools: str | None = None
    chat_template_kwargs: str | None = None
    """With `messages`: as on `GenerateReq`."""
    return_token_strs: bool = False
    """Also each token's text (the tokenizer's own token strings)."""

    def validate(self) -> None:
        check_str("request_id", self.request_id, MAX_ID_LEN)
        check((self.prompt is None) != (self.messages is None), "give exactly one of prompt, messages")
        if self.prompt is not None:
            check_str("prompt", self.prompt, MAX_FRAME_BYTES, empty=True)
        if self.messages is not None:
            check_messages(self.messages)
        check(self.add_special_tokens is None or isinstance(self.add_special_tokens, bool),
              "add_special_tokens must be true, false or null")
        for name in ("add_generation_prompt", "continue_final_message", "return_token_strs"):
            check_bool(name, getattr(self, name))
        check(not (self.add_generation_prompt and self.continue_final_message) or self.messages is None,
              "continue_final_message cannot be combined with add_generation_prompt (set it false)")
        if self.tools is not None:
            check(self.messages is not None, "tools are offered only with messages (a chat)")
            check_str("tools", self.tools, MAX_TOOLS_CHARS)
        if self.chat_template_kwargs is not None:
            check(self.messages is not None, "chat_template_kwargs apply only with messages (a chat)")
            parse_template_kwargs(self.chat_template_kwargs)


@_message("detokenize")
@dataclass
class DetokenizeReq(Message):
    """Token ids back to text (vLLM's `/detokenize`); the tokenizer stage answers with a
    `DetokenizeOutput`, or an `ErrorOutput` naming the problem (an id outside the vocabulary)."""
    request_id: str
    token_ids: bytes | list[int]
    """Packed or a plain list, as a prompt's."""

    def validate(self) -> None:
        check_str("request_id", self.request_id, MAX_ID_LEN)
        self.token_ids = unpack_token_ids(self.token_ids)


@_message("tokenize_result")
@dataclass
class TokenizeOutput(Message):
    """The tokenizer stage's answer to a `TokenizeReq`."""
    TOLERANT = True
    request_id: str
    token_ids: bytes
    """Packed."""
    max_model_len: int | None = None
    """The engine's context length as the tokenizer stage knows it."""
    token_strs: list[str] | None = None

    def validate(self) -> None:
        check_str("request_id", self.request_id, MAX_ID_LEN)
        check_packed("token_ids", self.token_ids, MAX_FRAME_BYTES // 4)
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, 1, 2**31)
        if self.token_strs is not None:
            check_list("token_strs", self.token_strs, MAX_TOKEN_STRS)
            check(len(self.token_strs) * 4 == len(self.token_ids) and all(isinstance(t, str) for t in self.token_strs),
                  "token_strs must be one string per token")


@_message("detokenize_result")
@dataclass
class DetokenizeOutput(Message):
    """The tokenizer stage's answer to a `DetokenizeReq`."""
    TOLERANT = True
    request_id: str
    text: str

    def validate(self) -> None:
        check_str("request_id", self.request_id, MAX_ID_LEN)
        check_str("text", self.text, MAX_FRAME_BYTES, empty=True)


@_message("reset_prefix_cache")
@dataclass
class ResetPrefixCacheReq(Message):
    """Forget every cached KV block no running request holds (vLLM's /reset_prefix_cache). A
    client sends it to the tokenizer, which passes it to the engine's control socket with the
    client's routing id in `client`; the engine answers a `ResetPrefixCacheOutput` through the
    detokenizer. Refused while the service drains."""
    request_id: str
    client: bytes = b""
    """Set by the tokenizer (whatever a client put there is replaced): where the answer goes."""

    def validate(self) -> None:
        check_str("request_id", self.request_id, MAX_ID_LEN)
        check_bytes("client", self.client, 255)


@_message("reset_prefix_cache_result")
@dataclass
class ResetPrefixCacheOutput(Message):
    """The engine's answer to a `ResetPrefixCacheReq` (or the tokenizer's refusal), under its
    request id; `client` routes it through the detokenizer, which clears it."""
    TOLERANT = True
    request_id: str
    freed_blocks: int = 0
    """Cached blocks forgotten."""
    error: str | None = None
    draining: bool = False
    """With `error`: refused because the service is draining."""
    client: bytes = b""

    def validate(self) -> None:
        check_str("request_id", self.request_id, MAX_ID_LEN)
        check_int("freed_blocks", self.freed_blocks, 0, 2**31)
        check_opt_str("error", self.error, MAX_ERROR_LEN)
        check_bool("draining", self.draining)
        check_bytes("client", self.client, 255)


# ---------------------------------------------------------------- stages -> client

class Usage(NamedTuple):
    """A finished request's token counts (on its terminal delta)."""
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def check(self) -> None:
        for name, count in zip(self._fields, self):
            check_int(f"usage {name}", count, 0, 2**31)


class TopLogprob(NamedTuple):
    """One of the most likely alternatives at a position (`TokenLogprob.top`)."""
    token_id: int
    token: str
    """The token's text (`bytes` decoded; U+FFFD where it holds part of a character)."""
    bytes: bytes
    """What the token adds to the output, byte for byte."""
    logprob: float

    def check(self) -> None:
        check_int("top token_id", self.token_id, 0, 2**31)
        check_str("top token", self.token, MAX_TOKEN_TEXT, empty=True)
        check_bytes("top bytes", self.bytes, MAX_TOKEN_TEXT * 4)
        check_logprob("top logprob", self.logprob)


class TokenLogprob(NamedTuple):
    """A streamed token's log-probability with its text (`DeltaRow.logprobs`): the detokenizer
    adds the texts to the engine's `TokenLogprobs`."""
    token_id: int
    token: str
    bytes: bytes
    logprob: float
    rank: int
    """1 for the most likely token."""
    top: list[TopLogprob]
    """The most likely alternatives, most likely first (as many as asked for)."""

    def check(self) -> None:
        check_int("logprob token_id", self.token_id, 0, 2**31)
        check_str("logprob token", self.token, MAX_TOKEN_TEXT, empty=True)
        check_bytes("logprob bytes", self.bytes, MAX_TOKEN_TEXT * 4)
        check_logprob("logprob", self.logprob)
        check_int("logprob rank", self.rank, 1, 2**31)


class DeltaRow(NamedTuple):
    """What one request of a client streamed since its last delta (`StreamOutput.deltas`)."""
    request_id: str
    """The client's request id."""
    text: str = ""
    token_ids: bytes = b""
    """Packed (`pack_token_ids`)."""
    finish_reason: FinishReason | None = None
    """None while streaming; why it ended on the terminal delta."""
    error: str | None = None
    """Why, with finish_reason "error" (or an abort that says why)."""
    usage: Usage | None = None
    """On the terminal delta."""
    engine_dead: bool = False
    unsent: bool = False
    """With engine_dead: the tokenizer had no engine to pass the request to, so it reached none
    and may be sent again as it is."""
    reasoning_open: bool = False
    """The request's `RequestMeta.reasoning_open`: its output starts inside a reasoning block."""
    logprobs: list[TokenLogprob] | None = None
    """With logprobs: one per token of `token_ids` (None for tokens the detokenizer rebuilt from a
    resync, whose logprobs died with its predecessor)."""
    prompt_logprobs: list[TokenLogprob] | None = None
    """With prompt_logprobs, on the request's first delta: one per prompt token (the first given:
    logprob 0, no alternatives)."""
    stop_reason: str | None = None
    """On a terminal delta with finish_reason "stop" that a stop string ended: that string (vLLM's
    `stop_reason`); None where EOS, a stop token or a grammar ended it."""

    def check(self) -> None:
        check_str("delta request_id", self.request_id, MAX_ENGINE_ID_LEN)
        check_str("delta text", self.text, MAX_FRAME_BYTES, empty=True)
        check_packed("delta token_ids", self.token_ids, MAX_FRAME_BYTES // 4)
        check_opt_str("delta error", self.error, MAX_ERROR_LEN)
        check_bool("delta engine_dead", self.engine_dead)
        check_bool("delta unsent", self.unsent)
        check_bool("delta reasoning_open", self.reasoning_open)
        check_opt_str("delta stop_reason", self.stop_reason, MAX_STOP_STRING_LENGTH)


@_message("stream")
@dataclass
class StreamOutput(Message):
    """Deltas for one client's requests (`DeltaRow`); longer rows from a newer service are cut to
    the fields this version knows."""
    TOLERANT = True
    deltas: list[DeltaRow]

    def validate(self) -> None:
        self.deltas = typed_rows("deltas", self.deltas, DeltaRow, tolerant=True)


@_message("error")
@dataclass
class ErrorOutput(Message):
    """An error not tied to a live stream (e.g. a frame that could not be decoded at all)."""
    TOLERANT = True
    message: str
    request_id: str | None = None
    frame_digest: str | None = None
    """For a frame read without a request id (not msgpack, over the limits, another protocol
    version): its `frame_digest`, by which the sender knows which request it was."""

    def validate(self) -> None:
        check_str("message", self.message, MAX_ERROR_LEN)
        check_opt_str("request_id", self.request_id, MAX_ENGINE_ID_LEN)
        check_opt_str("frame_digest", self.frame_digest, 32)


def frame_digest(frame: bytes) -> str:
    """A short digest of a frame's bytes: the tokenizer names a frame it could not read by it, and
    the client that sent the frame finds the request it carried."""
    return hashlib.blake2b(frame, digest_size=8).hexdigest()


@_message("pong")
@dataclass
class Pong(Message):
    TOLERANT = True
    role: str
    instance_id: str
    engine_alive: bool | None = None
    """None while the stage has not heard from a ready engine yet (it just started, or the engine
    is loading): not a death."""
    state: str = "ready"
    """This stage's state (one of STAGE_STATES)."""
    uptime_s: float = 0.0
    engine_state: str = ""
    """The engine's state as this stage last heard it ("" if never)."""

    def validate(self) -> None:
        check_str("role", self.role, 32)
        check_str("instance_id", self.instance_id, MAX_INSTANCE_ID_LEN)
        check(self.engine_alive is None or isinstance(self.engine_alive, bool), "engine_alive must be true, false or null")
        _check_state("state", self.state)
        check_number("uptime_s", self.uptime_s)
        check(self.engine_state in ("", *STAGE_STATES), f"engine_state must be one of {STAGE_STATES} or empty")


@_message("stats_result")
@dataclass
class StatsOutput(Message):
    TOLERANT = True
    stats: dict[str, Any]

    def validate(self) -> None:
        _check_stats(self.stats)


def error_delta(request_id: str, message: str, engine_dead: bool = False, unsent: bool = False) -> DeltaRow:
    """The terminal delta of a request that failed."""
    return DeltaRow(request_id=request_id, finish_reason=FinishReason.ERROR, error=clip(message),
                    engine_dead=engine_dead, unsent=unsent)


def _row(row_type: type, optional: bool = False) -> Callable[[str, Any], Any]:
    """The reader of a row nested in a row."""
    def read(name: str, value: Any) -> Any:
        return None if optional and value is None else typed_row(name, value, row_type)
    return read


def _rows(row_type: type) -> Callable[[str, Any], Any]:
    """The reader of an optional list of rows nested in a row."""
    def read(name: str, value: Any) -> Any:
        return None if value is None else typed_rows(name, value, row_type)
    return read


_META = _row(RequestMeta)
_ENGINE_LOGPROBS, _LOGPROBS = _rows(TokenLogprobs), _rows(TokenLogprob)
_READERS: dict[type, tuple[tuple[int, Callable[[str, Any], Any]], ...]] = {
    RequestMeta: ((2, read_sampling),), StartedRow: ((1, _META),), RejectedRow: ((1, _META),),
    OutputRow: ((3, read_finish_reason), (8, _ENGINE_LOGPROBS), (9, _ENGINE_LOGPROBS)),
    ResyncEntry: ((0, _META), (1, _row(OutputRow))),
    DeltaRow: ((3, read_finish_reason), (5, _row(Usage, optional=True)), (9, _LOGPROBS), (10, _LOGPROBS)),
    TokenLogprob: ((5, _rows(TopLogprob)),)}
"""Values inside rows with a type of their own: (position, reader)."""
_NEWEST_FIELDS: dict[type, tuple[str, ...]] = {DeltaRow: ("logprobs", "prompt_logprobs", "stop_reason")}
"""The trailing fields a row gained in this version, each with a default. A client often runs
against an older service: where tolerant, a row without them is read with their defaults, so
adding a field breaks no reader of the one-version-older row. Every other width stays an error."""
