"""Per-request sampling parameters, validated with errors that name the field and its range.

The same object travels from the client to the engine: `to_dict()` gives plain msgpack-safe
types (string keys only) and `from_dict()` rebuilds and re-validates it. Text-level knobs
(`stop`, `include_stop_str_in_output`, `skip_special_tokens`) are honoured by whoever
detokenizes (the offline `LLM` or the detokenizer stage); everything else acts in the engine.
Lists a client sends are bounded (the MAX_* constants below), since each entry costs work on
every step or on admission.
"""
from __future__ import annotations

import json
import math
from array import array
from dataclasses import dataclass, field, fields
from typing import Any, Callable

# One bounded repr and one set of stop-string limits for the engine and the wire: the protocol
# (torch-free, in the client package) owns them, so a limit cannot differ between the two.
from nanovllm_client.checks import show
from nanovllm_client.protocol import MAX_STOP_LEN as MAX_STOP_STRING_LENGTH
from nanovllm_client.protocol import MAX_STOP_STRINGS

MAX_LOGPROBS = 20
"""Most alternatives `logprobs` may ask for per generated token."""
_SEED_LIMIT = 1 << 64
_ID_LIMIT = 1 << 32
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
"""Beyond these, dividing or multiplying a float32 logit by the penalty can reach 0 or inf."""

# Per-request work a client can ask for: every one of these is paid on each step or on admission.
MAX_BANNED_WORDS = 64
"""Banned words per request: each is compiled against the whole vocabulary."""
MAX_BANNED_WORD_LENGTH = 128
"""Characters of a banned string, or ids of a banned token sequence: one vocabulary search each."""
MAX_STOP_TOKEN_IDS = 1024
"""Stop token ids per request: checked against every sampled token."""
MAX_ALLOWED_TOKEN_IDS = 262_144
"""Allowed token ids per request: the largest vocabularies in use (262,144), so any subset fits."""
MAX_LOGIT_BIAS = 1024
"""logit_bias entries per request: added to the logits on every step."""
MAX_CACHE_SALT_LENGTH = 256
"""Characters of a `cache_salt`: hashed into a request's first prompt block."""

def _check(ok: bool, message: str, *values: Any) -> None:
    """Raise `ValueError(message)` unless `ok`; each `{}` in `message` is one of `values`, through
    `show`, formatted only on failure (every request runs these checks, some once per entry)."""
    if not ok:
        raise ValueError(message.format(*map(show, values)) if values else message)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


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
        raise ValueError(f"{label} must be {allowed}, got {show(value)}")


def _is_token_id(v: Any) -> bool:
    return _is_int(v) and v >= 0


def _is_bias_key(k: Any) -> bool:
    # ASCII digits only: str.isdigit() also accepts "²", which int() rejects.
    return _is_token_id(k) or (isinstance(k, str) and 0 < len(k) <= 20 and k.isascii() and k.isdigit())


@dataclass
class SamplingParams:
    temperature: float = 1.0
    """0 means greedy; otherwise logits are divided by it before sampling."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 keeps all."""
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
    """Token id -> value added to its logit; keys may also be decimal strings (as JSON sends them).
    At most 1024 entries (MAX_LOGIT_BIAS)."""
    max_tokens: int = 64
    min_tokens: int = 0
    """EOS and stop tokens/strings cannot end the output before this many tokens."""
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    """At most 1024 (MAX_STOP_TOKEN_IDS)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings, matched on the detokenized text; a single string is accepted too. At most 64
    strings (MAX_STOP_STRINGS) of at most 1024 characters (MAX_STOP_STRING_LENGTH)."""
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    """Return the log-probability of each generated token plus this many top alternatives."""
    skip_special_tokens: bool = True
    banned_words: list[str | list[int]] = field(default_factory=list)
    """Strings (never appear in the output text) or token-id sequences (never generated). At most 64
    entries (MAX_BANNED_WORDS) of at most 128 characters or token ids (MAX_BANNED_WORD_LENGTH)."""
    allowed_token_ids: list[int] | array | None = None
    """Only these tokens may be generated; at most 262,144 ids (MAX_ALLOWED_TOKEN_IDS), each below
    2**32. Kept as an `array("I")`: 4 bytes an id, where a list of Python ints costs about 36, so
    a request at the limit holds 1 MiB instead of 9."""
    logits_processors: list[Callable] = field(default_factory=list)
    """In-process only: extra `LogitsProcessor`s, applied per request after the built-in ones."""
    response_format: dict | None = None
    """Structured output, OpenAI's shape: {"type": "json_object"}, {"type": "json_schema",
    "json_schema": {"name": ..., "schema": {...}}}, {"type": "regex", "regex": ...},
    {"type": "grammar", "grammar": <Lark>}, {"type": "choice", "choices": [...]}; enforced while
    sampling (see `nanovllm.structured`). JSON text of the same is accepted (the wire carries it so)."""
    cache_salt: str | None = None
    """Prefix-cache isolation: a request with a salt shares cached prompt blocks only with requests
    that carry the same salt (and one without, only with others without). At most 256 characters
    (MAX_CACHE_SALT_LENGTH). The service can salt every request by its client
    (`--cache-salt-per-client`), so one client's prompts never show in another's `cached_tokens`."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._validate_sampling()
        self._validate_penalties()
        self._validate_lengths()
        self._validate_tokens()
        _check(self.cache_salt is None or (isinstance(self.cache_salt, str) and self.cache_salt),
               "cache_salt must be null or a non-empty string, got {}", self.cache_salt)
        _check(self.cache_salt is None or len(self.cache_salt) <= MAX_CACHE_SALT_LENGTH,
               f"cache_salt may have at most {MAX_CACHE_SALT_LENGTH} characters, got {{}}",
               len(self.cache_salt or ""))
        self.stop_token_ids = list(self.stop_token_ids)
        self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self.banned_words = [w if isinstance(w, str) else list(w) for w in self.banned_words]
        self.logits_processors = list(self.logits_processors)
        from nanovllm.structured import check_response_format  # torch-free, no llguidance import

        self.response_format = check_response_format(self.response_format)
        _check(self.response_format is None or not self.min_tokens,
               "min_tokens cannot be combined with response_format: the grammar decides where the output ends "
               "(got min_tokens {})", self.min_tokens)

    def _validate_sampling(self) -> None:
        _check(_is_number(self.temperature) and self.temperature >= 0,
               "temperature must be a number >= 0 (0 means greedy), got {}", self.temperature)
        _check(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1),
               "top_k must be -1 (disabled) or an integer >= 1, got {}", self.top_k)
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p must be in (0, 1], got {}", self.top_p)
        _in_range("min_p", self.min_p, 0, 1, "in [0, 1]")
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < _SEED_LIMIT),
               "seed must be null or an integer in [0, 2**64), got {}", self.seed)
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
               f"logprobs must be null or an integer in [0, {MAX_LOGPROBS}], got {{}}", self.logprobs)

    def _validate_penalties(self) -> None:
        _in_range("repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY,
                  f"in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1 disables)")
        _in_range("presence_penalty", self.presence_penalty, -2, 2, "in [-2, 2]")
        _in_range("frequency_penalty", self.frequency_penalty, -2, 2, "in [-2, 2]")
        _check(isinstance(self.logit_bias, dict), "logit_bias must be a map of token id to bias, got {}", self.logit_bias)
        _check(len(self.logit_bias) <= MAX_LOGIT_BIAS,
               f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        for k, v in self.logit_bias.items():
            _check(_is_bias_key(k), "logit_bias keys must be token ids >= 0, got {}", k)
            _in_range("logit_bias", v, -100, 100, "in [-100, 100]", key=k)

    def _validate_lengths(self) -> None:
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens must be an integer >= 1, got {}", self.max_tokens)
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
               "min_tokens must be an integer in [0, max_tokens={}], got {}", self.max_tokens, self.min_tokens)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _check(isinstance(getattr(self, name), bool), f"{name} must be true or false, got {{}}", getattr(self, name))
        _check(isinstance(self.stop, (list, tuple)), "stop must be a string or a list of non-empty strings, got {}", self.stop)
        _check(len(self.stop) <= MAX_STOP_STRINGS, f"stop may have at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            _check(isinstance(s, str) and s, "stop must be a string or a list of non-empty strings, got {} in the list", s)
            _check(len(s) <= MAX_STOP_STRING_LENGTH,
                   f"stop strings may have at most {MAX_STOP_STRING_LENGTH} characters, got one of {len(s)}")
        self.stop = list(self.stop)

    def _validate_tokens(self) -> None:
        ids = self.stop_token_ids
        _check(isinstance(ids, (list, tuple)) and len(ids) <= MAX_STOP_TOKEN_IDS and all(_is_token_id(t) for t in ids),
               f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids >= 0, got {{}}", ids)
        words = self.banned_words
        _check(isinstance(words, (list, tuple)), "banned_words must be a list of strings or token-id lists, got {}", words)
        _check(len(words) <= MAX_BANNED_WORDS, f"banned_words may have at most {MAX_BANNED_WORDS} entries, got {len(words)}")
        for w in words:
            ok = (isinstance(w, str) and w) or (isinstance(w, (list, tuple)) and w and len(w) <= MAX_BANNED_WORD_LENGTH
                                                and all(_is_token_id(t) for t in w))
            _check(bool(ok), f"banned_words entries must be non-empty strings or non-empty lists of token ids >= 0, "
                             f"each at most {MAX_BANNED_WORD_LENGTH} long, got {{}}", w)
            _check(len(w) <= MAX_BANNED_WORD_LENGTH,
                   f"banned_words strings may have at most {MAX_BANNED_WORD_LENGTH} characters, got one of {len(w)}")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            packed = isinstance(ids, array) and ids.typecode == "I"  # every entry is in [0, 2**32) already
            _check((packed or isinstance(ids, (list, tuple))) and 0 < len(ids) <= MAX_ALLOWED_TOKEN_IDS
                   and (packed or all(_is_token_id(t) and t < _ID_LIMIT for t in ids)),
                   f"allowed_token_ids must be null or a non-empty list of at most {MAX_ALLOWED_TOKEN_IDS} "
                   "token ids >= 0 and < 2**32, got {}", ids)
            self.allowed_token_ids = array("I", ids)
        _check(isinstance(self.logits_processors, (list, tuple)) and all(callable(p) for p in self.logits_processors),
               "logits_processors must be a list of callables (in-process only; it cannot be sent over the wire)")

    # -- properties the engine reads -----------------------------------------------------------

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def has_constraints(self) -> bool:
        """Whether anything besides penalties changes this request's logits before sampling."""
        return bool(self.logit_bias or self.banned_words or self.allowed_token_ids is not None
                    or self.logits_processors or self.min_tokens or self.response_format is not None)

    # -- the wire ------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (msgpack-safe: `logit_bias` keys become strings); omits default values."""
        if self.logits_processors:
            raise ValueError("logits_processors are in-process only and cannot be sent over the wire; "
                             "use banned_words or allowed_token_ids")
        default = _DEFAULTS
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "logits_processors" or value == default[f.name]:
                continue
            if f.name == "response_format":  # JSON text: a schema's nesting never meets the frame's limit
                value = json.dumps(value, separators=(",", ":"))
            elif f.name == "logit_bias":
                value = {str(k): v for k, v in value.items()}
            elif isinstance(value, array):
                value = value.tolist()
            elif isinstance(value, list):
                value = [list(v) if isinstance(v, list) else v for v in value]
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Rebuild from `to_dict()` output (or any JSON/msgpack map); unknown keys are a ValueError."""
        if not isinstance(data, dict):
            raise ValueError(f"sampling parameters must be a map, got {type(data).__name__}")
        allowed = WIRE_FIELDS
        unknown = set(data) - allowed
        if unknown:  # keys may be of any msgpack type: sorted by their text, never compared
            names = ", ".join(sorted(show(k) for k in unknown)[:8])
            raise ValueError(f"unknown sampling parameter(s) [{names}]; allowed: {sorted(allowed)}")
        return cls(**data)


_DEFAULTS = {f.name: getattr(SamplingParams(), f.name) for f in fields(SamplingParams)}
WIRE_FIELDS = frozenset(f.name for f in fields(SamplingParams)) - {"logits_processors"}
"""Fields that `to_dict` / `from_dict` carry."""
