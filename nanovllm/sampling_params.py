"""Per-request sampling parameters, validated with errors that name the field and its range.

The same object travels from the client to the engine: `to_dict()` gives plain msgpack-safe
types (string keys only) and `from_dict()` rebuilds and re-validates it. Text-level knobs
(`stop`, `include_stop_str_in_output`, `skip_special_tokens`) are honoured by whoever
detokenizes (the offline `LLM` or the detokenizer stage); everything else acts in the engine.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable

MAX_LOGPROBS = 20
"""Most alternatives `logprobs` may ask for per generated token."""
_SEED_LIMIT = 1 << 64


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _in_range(name: str, value: Any, lo: float, hi: float, allowed: str) -> None:
    _check(_is_number(value) and lo <= value <= hi, f"{name} must be {allowed}, got {value!r}")


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
    skip_special_tokens: bool = True
    banned_words: list[str | list[int]] = field(default_factory=list)
    """Strings (never appear in the output text) or token-id sequences (never generated)."""
    allowed_token_ids: list[int] | None = None
    """Only these tokens may be generated."""
    logits_processors: list[Callable] = field(default_factory=list)
    """In-process only: extra `LogitsProcessor`s, applied per request after the built-in ones."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._validate_sampling()
        self._validate_penalties()
        self._validate_lengths()
        self._validate_tokens()
        self.stop_token_ids = list(self.stop_token_ids)
        self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self.banned_words = [w if isinstance(w, str) else list(w) for w in self.banned_words]
        self.logits_processors = list(self.logits_processors)

    def _validate_sampling(self) -> None:
        _check(_is_number(self.temperature) and self.temperature >= 0,
               f"temperature must be a number >= 0 (0 means greedy), got {self.temperature!r}")
        _check(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1),
               f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        _in_range("min_p", self.min_p, 0, 1, "in [0, 1]")
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < _SEED_LIMIT),
               f"seed must be null or an integer in [0, 2**64), got {self.seed!r}")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
               f"logprobs must be null or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    def _validate_penalties(self) -> None:
        _check(_is_number(self.repetition_penalty) and self.repetition_penalty > 0,
               f"repetition_penalty must be a number > 0 (1 disables), got {self.repetition_penalty!r}")
        _in_range("presence_penalty", self.presence_penalty, -2, 2, "in [-2, 2]")
        _in_range("frequency_penalty", self.frequency_penalty, -2, 2, "in [-2, 2]")
        _check(isinstance(self.logit_bias, dict), f"logit_bias must be a map of token id to bias, got {self.logit_bias!r}")
        for k, v in self.logit_bias.items():
            key_ok = (_is_int(k) and k >= 0) or (isinstance(k, str) and k.isdigit())
            _check(key_ok, f"logit_bias keys must be token ids >= 0, got {k!r}")
            _in_range(f"logit_bias[{k}]", v, -100, 100, "in [-100, 100]")

    def _validate_lengths(self) -> None:
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _check(isinstance(getattr(self, name), bool), f"{name} must be true or false, got {getattr(self, name)!r}")
        _check(isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) and s for s in self.stop),
               f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        self.stop = list(self.stop)

    def _validate_tokens(self) -> None:
        _check(isinstance(self.stop_token_ids, (list, tuple)) and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids must be a list of token ids >= 0, got {self.stop_token_ids!r}")
        _check(isinstance(self.banned_words, (list, tuple)),
               f"banned_words must be a list of strings or token-id lists, got {self.banned_words!r}")
        for w in self.banned_words:
            ok = (isinstance(w, str) and w) or (isinstance(w, (list, tuple)) and w and all(_is_int(t) and t >= 0 for t in w))
            _check(bool(ok), f"banned_words entries must be non-empty strings or non-empty lists of token ids >= 0, got {w!r}")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            _check(isinstance(ids, (list, tuple)) and ids and all(_is_int(t) and t >= 0 for t in ids),
                   f"allowed_token_ids must be null or a non-empty list of token ids >= 0, got {ids!r}")
            self.allowed_token_ids = list(ids)
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
                    or self.logits_processors or self.min_tokens)

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
            if f.name == "logit_bias":
                value = {str(k): v for k, v in value.items()}
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
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; allowed: {sorted(allowed)}")
        return cls(**data)


_DEFAULTS = {f.name: getattr(SamplingParams(), f.name) for f in fields(SamplingParams)}
WIRE_FIELDS = frozenset(f.name for f in fields(SamplingParams)) - {"logits_processors"}
"""Fields that `to_dict` / `from_dict` carry."""
