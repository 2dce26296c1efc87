"""One request's sampling parameters: one frozen struct, one set of limits, one validator.

Every door builds this struct, so every request meets the same checks with the same words: the
offline `LLM` and the engine's step API, the ZeroMQ clients (`Client.stream(..., temperature=0)`),
the HTTP front (OpenAI's and vLLM's names mapped onto these fields, nothing more), and the
tokenizer stage and the engine, which decode it from their frames (`from_dict`). A value out of
range raises `SamplingError` naming the field. Torch-free: the client and the HTTP front use it.

Text-side fields (`stop`, `include_stop_str_in_output`, `skip_special_tokens`, and `min_tokens`
for stop strings) act where the output is detokenized (the offline `LLM`, the detokenizer stage:
it gets `text_params()` in each request's meta); everything else acts in the engine's sampler.
Lists a client sends are bounded (the MAX_* constants), since each entry costs work on every
step or on admission.
"""
from __future__ import annotations

import json
import math
from array import array
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from .checks import is_int, show
from .response_format import check_response_format

__all__ = ["SamplingParams", "SamplingError", "WIRE_FIELDS", "TEXT_FIELDS", "MAX_COUNT", "TOKEN_ID_LIMIT", "SEED_MIN",
           "SEED_MAX", "MIN_REPETITION_PENALTY", "MAX_REPETITION_PENALTY", "MAX_PENALTY", "MAX_LOGIT_BIAS_VALUE",
           "MAX_LOGPROBS", "MAX_STOP_STRINGS", "MAX_STOP_STRING_LENGTH", "MAX_STOP_TOKEN_IDS", "MAX_LOGIT_BIAS",
           "MAX_BANNED_WORDS", "MAX_BANNED_WORD_LENGTH", "MAX_ALLOWED_TOKEN_IDS", "MAX_CACHE_SALT_LENGTH"]

# ---------------------------------------------------------------- the limits, each defined here once

MAX_COUNT = 2**31 - 1
"""Largest max_tokens, min_tokens and top_k: token counts travel as 32-bit integers."""
TOKEN_ID_LIMIT = 2**32
"""Token ids in any list (stop, allowed, banned, logit_bias) are below this: uint32 on the wire."""
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
"""torch.Generator's seed range (a negative seed maps to 2**64 + seed), so any int64 or uint64 does."""
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
"""Beyond these, dividing or multiplying a float32 logit by the penalty can reach 0 or inf."""
MAX_PENALTY = 2.0
"""presence_penalty and frequency_penalty lie in [-2, 2] (OpenAI's range)."""
MAX_LOGIT_BIAS_VALUE = 100.0
"""A logit_bias value lies in [-100, 100] (OpenAI's range)."""
MAX_LOGPROBS = 20
"""Most alternatives `logprobs` may ask for per generated token."""
MAX_STOP_STRINGS, MAX_STOP_STRING_LENGTH = 64, 1024
"""Stop strings are matched on every new character (one KMP automaton each): bound what one request asks."""
MAX_STOP_TOKEN_IDS = 1024
"""Stop token ids per request: checked against every sampled token."""
MAX_LOGIT_BIAS = 1024
"""logit_bias entries per request: added to the logits on every step."""
MAX_BANNED_WORDS = 64
"""Banned words per request: each is compiled against the whole vocabulary."""
MAX_BANNED_WORD_LENGTH = 128
"""Characters of a banned string, or ids of a banned token sequence: one vocabulary search each."""
MAX_ALLOWED_TOKEN_IDS = 262_144
"""Allowed token ids per request: the largest vocabularies in use (262,144), so any subset fits."""
MAX_CACHE_SALT_LENGTH = 256
"""Characters of a `cache_salt`: hashed into a request's first prompt block."""

TEXT_FIELDS = ("stop", "include_stop_str_in_output", "skip_special_tokens", "min_tokens", "max_tokens")
"""What `text_params` keeps: the fields that act on the text (max_tokens bounds min_tokens)."""


class SamplingError(ValueError):
    """A sampling value out of its range or of the wrong type; `field` names it."""

    def __init__(self, field_name: str, message: str):
        super().__init__(message)
        self.field = field_name


def _check(ok: bool, name: str, message: str, *values: Any) -> None:
    """Raise `SamplingError(name, message)` unless `ok`; each `{}` in `message` is one of `values`,
    through `show`, formatted only on failure (every request runs these checks, some per entry)."""
    if not ok:
        raise SamplingError(name, message.format(*map(show, values)) if values else message)


def _is_number(v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int too large for a float
        return False


def _in_range(name: str, value: Any, lo: float, hi: float, allowed: str, key: Any = None) -> None:
    """With `key`, the value is `name[key]` (the key shown only on failure, like the value)."""
    if not (_is_number(value) and lo <= value <= hi):
        label = name if key is None else f"{name}[{show(key)}]"
        raise SamplingError(name, f"{label} must be {allowed}, got {show(value)}")


def _is_token_id(v: Any) -> bool:
    return is_int(v) and 0 <= v < TOKEN_ID_LIMIT


def _bias_key(k: Any) -> int | None:
    """A logit_bias key as a token id: an int, or decimal text as JSON sends it; None if neither."""
    if _is_token_id(k):
        return k
    # ASCII digits only: str.isdigit() also accepts "²", which int() rejects.
    if isinstance(k, str) and 0 < len(k) <= 10 and k.isascii() and k.isdigit() and int(k) < TOKEN_ID_LIMIT:
        return int(k)
    return None


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)  # the struct is frozen; only `validate` normalises it


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    """0 means greedy; otherwise logits are divided by it before sampling. Any finite number >= 0:
    a temperature too small for float32 acts as greedy, a huge one as uniform."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 (or 0) keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches top_p (after top_k)."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one; 0 disables."""
    seed: int | None = None
    """A per-request generator: the same seed gives the same tokens whatever else is batched."""
    repetition_penalty: float = 1.0
    """Tokens seen in the prompt or output: positive logits divided by it, negative ones multiplied."""
    presence_penalty: float = 0.0
    """Subtracted once from every token already in the output (OpenAI semantics)."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence of a token in the output (OpenAI semantics)."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Token id -> value added to its logit; keys may also be decimal strings (as JSON sends them)."""
    max_tokens: int = 64
    min_tokens: int = 0
    """EOS and stop tokens/strings cannot end the output before this many tokens."""
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    """Stop strings, matched on the detokenized text; a single string is accepted too."""
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    """Return the log-probability of each generated token plus this many top alternatives."""
    prompt_logprobs: int | None = None
    """Return the log-probability of each prompt token (given the tokens before it; the first is
    given: logprob 0, no alternatives) plus this many top alternatives. The prompt is computed
    whole: no prefix-cache hits."""
    skip_special_tokens: bool = True
    banned_words: list[str | list[int]] = field(default_factory=list)
    """Strings (never appear in the output text) or token-id sequences (never generated)."""
    allowed_token_ids: list[int] | array | None = None
    """Only these tokens may be generated. Kept as an `array("I")`: 4 bytes an id, where a list of
    Python ints costs about 36, so a request at the limit holds 1 MiB instead of 9."""
    logits_processors: list[Callable] = field(default_factory=list)
    """In-process only: extra `LogitsProcessor`s, applied per request after the built-in ones."""
    response_format: dict | None = None
    """Structured output, OpenAI's shape: {"type": "json_object"}, {"type": "json_schema",
    "json_schema": {"name": ..., "schema": {...}}}, {"type": "regex", "regex": ...},
    {"type": "grammar", "grammar": <Lark>}, {"type": "choice", "choices": [...]}; enforced while
    sampling (see `nanovllm.structured`). JSON text of the same is accepted (the wire carries it so)."""
    cache_salt: str | None = None
    """Prefix-cache isolation: a request with a salt shares cached prompt blocks only with requests
    that carry the same salt (and one without, only with others without). The service can salt
    every request by its client (`--cache-salt-per-client`)."""
    speculative: bool = True
    """False: never verify drafted tokens for this request (speculative decoding, when the engine
    runs it, applies only to greedy requests without penalties, bias, logprobs, min_tokens or
    processors, and its output is the same either way; this opts out of its cost)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field against its limit and normalise it in place (a single stop string
        becomes a list, logit_bias keys ints, allowed ids an array); `SamplingError` naming the
        first field that fails. Construction runs it, so a SamplingParams is always valid."""
        self._validate_sampling()
        self._validate_penalties()
        self._validate_lengths()
        self._validate_stops()
        self._validate_tokens()
        salt = self.cache_salt
        _check(salt is None or (isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT_LENGTH), "cache_salt",
               f"cache_salt must be null or a non-empty string of at most {MAX_CACHE_SALT_LENGTH} characters, got {{}}",
               salt)
        try:
            _set(self, "response_format", check_response_format(self.response_format))
        except ValueError as e:
            raise SamplingError("response_format", str(e)) from None
        _check(self.response_format is None or not self.min_tokens, "min_tokens",
               "min_tokens cannot be combined with response_format: the grammar decides where the output ends "
               "(got min_tokens {})", self.min_tokens)

    def _validate_sampling(self) -> None:
        _check(_is_number(self.temperature) and self.temperature >= 0, "temperature",
               "temperature must be a number >= 0 (0 means greedy), got {}", self.temperature)
        _check(is_int(self.top_k) and -1 <= self.top_k <= MAX_COUNT, "top_k",
               f"top_k must be -1 or 0 (disabled) or an integer in [1, {MAX_COUNT}], got {{}}", self.top_k)
        if self.top_k == 0:
            _set(self, "top_k", -1)
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "top_p must be in (0, 1], got {}", self.top_p)
        _in_range("min_p", self.min_p, 0, 1, "in [0, 1]")
        _check(self.seed is None or (is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX), "seed",
               "seed must be null or an integer in [-2**63, 2**64), got {}", self.seed)
        _check(self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS), "logprobs",
               f"logprobs must be null or an integer in [0, {MAX_LOGPROBS}], got {{}}", self.logprobs)
        _check(self.prompt_logprobs is None or (is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
               "prompt_logprobs", f"prompt_logprobs must be null or an integer in [0, {MAX_LOGPROBS}], got {{}}",
               self.prompt_logprobs)

    def _validate_penalties(self) -> None:
        _in_range("repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY,
                  f"in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1 disables)")
        penalty_range = f"in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]"
        _in_range("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY, penalty_range)
        _in_range("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY, penalty_range)
        bias = self.logit_bias
        _check(isinstance(bias, dict), "logit_bias", "logit_bias must be a map of token id to bias, got {}", bias)
        _check(len(bias) <= MAX_LOGIT_BIAS, "logit_bias",
               f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
        normal = {}
        for k, v in bias.items():
            token = _bias_key(k)
            _check(token is not None, "logit_bias", "logit_bias keys must be token ids in [0, 2**32), got {}", k)
            _in_range("logit_bias", v, -MAX_LOGIT_BIAS_VALUE, MAX_LOGIT_BIAS_VALUE,
                      f"in [-{MAX_LOGIT_BIAS_VALUE:g}, {MAX_LOGIT_BIAS_VALUE:g}]", key=k)
            normal[token] = float(v)
        _set(self, "logit_bias", normal)

    def _validate_lengths(self) -> None:
        _check(is_int(self.max_tokens) and 1 <= self.max_tokens <= MAX_COUNT, "max_tokens",
               f"max_tokens must be an integer in [1, {MAX_COUNT}], got {{}}", self.max_tokens)
        _check(is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
               "min_tokens must be an integer in [0, max_tokens={}], got {}", self.max_tokens, self.min_tokens)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "speculative"):
            _check(isinstance(getattr(self, name), bool), name, f"{name} must be true or false, got {{}}",
                   getattr(self, name))

    def _validate_stops(self) -> None:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        _check(isinstance(stop, (list, tuple)), "stop", "stop must be a string or a list of non-empty strings, got {}",
               stop)
        _check(len(stop) <= MAX_STOP_STRINGS, "stop",
               f"stop may have at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        for s in stop:
            _check(isinstance(s, str) and s != "", "stop",
                   "stop must be a string or a list of non-empty strings, got {} in the list", s)
            _check(len(s) <= MAX_STOP_STRING_LENGTH, "stop",
                   f"stop strings may have at most {MAX_STOP_STRING_LENGTH} characters, got one of {len(s)}")
        _set(self, "stop", list(stop))
        ids = self.stop_token_ids
        _check(isinstance(ids, (list, tuple)) and len(ids) <= MAX_STOP_TOKEN_IDS and all(_is_token_id(t) for t in ids),
               "stop_token_ids",
               f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids in [0, 2**32), got {{}}", ids)
        _set(self, "stop_token_ids", list(ids))

    def _validate_tokens(self) -> None:
        words = self.banned_words
        _check(isinstance(words, (list, tuple)), "banned_words",
               "banned_words must be a list of strings or token-id lists, got {}", words)
        _check(len(words) <= MAX_BANNED_WORDS, "banned_words",
               f"banned_words may have at most {MAX_BANNED_WORDS} entries, got {len(words)}")
        for w in words:
            ok = (isinstance(w, str) and w) or (isinstance(w, (list, tuple)) and w and all(_is_token_id(t) for t in w))
            _check(bool(ok), "banned_words", "banned_words entries must be non-empty strings or non-empty lists of "
                   f"token ids in [0, 2**32), each at most {MAX_BANNED_WORD_LENGTH} long, got {{}}", w)
            _check(len(w) <= MAX_BANNED_WORD_LENGTH, "banned_words",
                   f"banned_words entries may have at most {MAX_BANNED_WORD_LENGTH} characters or token ids, "
                   f"got one of {len(w)}")
        _set(self, "banned_words", [w if isinstance(w, str) else list(w) for w in words])
        ids = self.allowed_token_ids
        if ids is not None:
            packed = isinstance(ids, array) and ids.typecode == "I"  # every entry is in [0, 2**32) already
            _check((packed or isinstance(ids, (list, tuple))) and 0 < len(ids) <= MAX_ALLOWED_TOKEN_IDS
                   and (packed or all(_is_token_id(t) for t in ids)), "allowed_token_ids",
                   f"allowed_token_ids must be null or a non-empty list of at most {MAX_ALLOWED_TOKEN_IDS} "
                   "token ids in [0, 2**32), got {}", ids)
            if not packed:
                _set(self, "allowed_token_ids", array("I", ids))
        procs = self.logits_processors
        _check(isinstance(procs, (list, tuple)) and all(callable(p) for p in procs), "logits_processors",
               "logits_processors must be a list of callables (in-process only; it cannot be sent over the wire)")
        _set(self, "logits_processors", list(procs))

    # -- what the engine reads -----------------------------------------------------------------

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    def text_params(self) -> SamplingParams:
        """These parameters with only the text-side fields kept (`TEXT_FIELDS`), the rest at their
        defaults: what the detokenizer needs, without the large lists the sampler needs."""
        if all(getattr(self, f.name) == _DEFAULTS[f.name] for f in fields(self) if f.name not in TEXT_FIELDS):
            return self
        return SamplingParams(**{name: getattr(self, name) for name in TEXT_FIELDS})

    # -- the wire ------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (msgpack-safe: `logit_bias` keys become strings, `response_format` JSON
        text, so a schema's nesting never meets a frame's limit); default values are left out."""
        if self.logits_processors:
            raise SamplingError("logits_processors", "logits_processors are in-process only and cannot be sent "
                                "over the wire; use banned_words or allowed_token_ids")
        out: dict[str, Any] = {}
        for name in _WIRE_ORDER:
            value = getattr(self, name)
            if value == _DEFAULTS[name]:
                continue
            if name == "response_format":
                value = json.dumps(value, separators=(",", ":"))
            elif name == "logit_bias":
                value = {str(k): v for k, v in value.items()}
            elif isinstance(value, array):
                value = value.tolist()
            out[name] = value
        return out

    @classmethod
    def from_dict(cls, data: Any) -> SamplingParams:
        """Build and validate from `to_dict()` output, or any JSON / msgpack map of these fields
        (a single stop string, bias keys as text); `SamplingError` for unknown names."""
        if not isinstance(data, dict):
            raise SamplingError("sampling", f"sampling parameters must be a map, got {type(data).__name__}")
        unknown = [k for k in data if k not in WIRE_FIELDS]
        if unknown:  # keys may be of any msgpack type: sorted by their text, never compared
            names = sorted(show(k) for k in unknown)[:8]
            raise SamplingError(str(unknown[0])[:64], f"unknown sampling parameter(s) [{', '.join(names)}]; "
                                f"allowed: {sorted(WIRE_FIELDS)}")
        return cls(**data)


_DEFAULTS = {f.name: getattr(SamplingParams(), f.name) for f in fields(SamplingParams)}
WIRE_FIELDS = frozenset(f.name for f in fields(SamplingParams)) - {"logits_processors"}
"""Fields that `to_dict` / `from_dict` carry."""
_WIRE_ORDER = tuple(f.name for f in fields(SamplingParams) if f.name in WIRE_FIELDS)
