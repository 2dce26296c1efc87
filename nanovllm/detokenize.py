"""Incremental detokenization with stop strings: one request's output tokens in, text out.

The one implementation behind both the offline `LLM` (nanovllm/llm.py) and the service's
detokenizer stage (detok_proc/server.py), so the two cut text and stop at the same places.

Decoding keeps two offsets into the ids, as vLLM and SGLang do: new text is
``decode(ids[surr:])`` minus ``decode(ids[surr:read])``. The overlap keeps tokenizers that drop a
leading space at the start of a decode (SentencePiece) correct; a decode ending in U+FFFD is half
a UTF-8 character and waits for the token that completes it. The last few prompt tokens seed
the window, so the first output token decodes with its real left context.

Stop strings are matched on the output text by one KMP automaton per stop string, advanced over
each newly decoded character only: the longest state is the longest tail of the text that could
still begin a stop string, which is exactly the text held back from the caller.

Tokens are decoded one at a time whatever the caller's batching, so feeding them in one call or
in many releases the same text and stops at the same token: a restarted detokenizer stage
rebuilds a request by feeding all of its output tokens at once.
"""
from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from typing import Any

from nanovllm.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 8
"""Prompt tokens kept as left context for the first output tokens. Only the first decode window
pays for them (the window moves past them once text comes out), so a few more than the one token
SentencePiece needs are cheap; the spare ones cover chat-template special tokens, which
`skip_special_tokens` removes from the decode and which would otherwise leave no real text as
context (vLLM takes 5 + 2 for the same reason)."""


class _StopMatcher:
    """One KMP automaton per stop string, advanced one character at a time.

    A stop string's state is the length of its longest prefix that the text ends with, and
    only stop strings in a nonzero state are visited: a character that begins none of them
    costs one dict lookup. Failure links are computed as far as a state has reached, so long
    stop strings cost what the text matched of them, not their length (the service allows 64 of
    1024 characters per request).
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = list(stops)
        self._starting_with: dict[str, list[int]] = {}
        for index, stop in enumerate(self.stops):
            self._starting_with.setdefault(stop[0], []).append(index)
        self._prefix_function: list[list[int]] = [[0] for _ in self.stops]
        self._states: dict[int, int] = {}
        """Stop string index -> its state, for the nonzero ones."""
        self.hold = 0
        """Characters that could still begin a stop string: the longest state."""

    def _fallback(self, index: int, k: int) -> int:
        """Longest proper prefix of stops[index][:k] that is also its suffix (KMP failure link)."""
        pi, stop = self._prefix_function[index], self.stops[index]
        while len(pi) < k:
            j, f = len(pi), pi[-1]
            while f and stop[j] != stop[f]:
                f = pi[f - 1]
            pi.append(f + 1 if stop[j] == stop[f] else 0)
        return pi[k - 1]

    def scan(self, text: str, report: bool) -> tuple[int, str] | None:
        """Advance over `text`. With `report`, stop at the first character that completes a stop
        string and return (characters of `text` consumed, that stop string); the longest one
        wins when several end there."""
        stops, states = self.stops, self._states
        for consumed, ch in enumerate(text, 1):
            starting = self._starting_with.get(ch)
            if not states and starting is None:
                continue
            advanced: dict[int, int] = {}
            done = -1
            for index in (*states, *(i for i in starting or () if i not in states)):
                stop, k = stops[index], states.get(index, 0)
                while k and stop[k] != ch:
                    k = self._fallback(index, k)
                if stop[k] == ch:
                    k += 1
                if k == len(stop):
                    if done < 0 or k > len(stops[done]):
                        done = index
                    k = self._fallback(index, k)
                if k:
                    advanced[index] = k
            self._states = states = advanced
            if report and done >= 0:
                return consumed, stops[done]
        self.hold = max(states.values(), default=0)
        return None


class _HeldText:
    """Decoded text not yet released, kept as chunks so that releasing it copies each character
    once (a single string would be re-copied on every append)."""

    def __init__(self) -> None:
        self._chunks: collections.deque[str] = collections.deque()
        self._start = 0
        """Characters of the first chunk already taken."""
        self.length = 0

    def push(self, text: str) -> None:
        if text:
            self._chunks.append(text)
            self.length += len(text)

    def take(self, n: int) -> str:
        """Remove and return the first `n` characters."""
        parts = []
        self.length -= n
        while n:
            chunk = self._chunks[0]
            available = len(chunk) - self._start
            if available > n:
                parts.append(chunk[self._start:self._start + n])
                self._start += n
                break
            parts.append(chunk[self._start:] if self._start else chunk)
            self._chunks.popleft()
            self._start = 0
            n -= available
        return "".join(parts)


class IncrementalDetokenizer:
    """One request's output tokens -> released text, with stop strings.

    `add` returns the text released by that call; `text` is all of it so far. Text that could
    still be the start of a stop string is held back until it cannot; on a match, the text before
    the stop string (or through it, with `include_stop_str_in_output`) is released and the
    detokenizer is `stopped`, with the stop string in `stop_reason`. No stop string ends the
    output before `min_tokens` output tokens: a match counts only if it completes in the text
    decoded once that many tokens are in.
    """

    def __init__(self, tokenizer: Any, *, prompt_tail: Sequence[int] = (), skip_special_tokens: bool = True,
                 stop: Sequence[str] = (), include_stop_str_in_output: bool = False, min_tokens: int = 0):
        stop = [stop] if isinstance(stop, str) else list(stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
        if not isinstance(min_tokens, int) or isinstance(min_tokens, bool) or min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {min_tokens!r}")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.stop_reason: str | None = None
        """The stop string that ended the text, once one has."""
        context = list(prompt_tail)[-PROMPT_CONTEXT_TOKENS:]
        context_text = self._decode(context) if context else ""
        if context_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: the output's first bytes would complete it and
            # vanish into the context. Without context the output is its own plain decode.
            context, context_text = [], ""
        self._ids = context
        self._num_context = len(context)
        self._surr, self._read = 0, len(context)
        self._window_prefix: str | None = context_text
        """decode(ids[surr:read]), kept while the window waits for a character to complete."""
        self._matcher = _StopMatcher(stop) if stop else None
        self._held = _HeldText()
        self._released: list[str] = []
        self._finished = False

    @classmethod
    def from_params(cls, tokenizer: Any, params: SamplingParams, *, prompt_tail: Sequence[int] = ()) -> IncrementalDetokenizer:
        return cls(tokenizer, prompt_tail=prompt_tail, skip_special_tokens=params.skip_special_tokens,
                   stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
                   min_tokens=params.min_tokens)

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    @property
    def token_ids(self) -> list[int]:
        """Output tokens consumed so far (none after the one that completed a stop string)."""
        return self._ids[self._num_context:]

    @property
    def text(self) -> str:
        """All the text released so far (kept as pieces, joined when read)."""
        if len(self._released) > 1:
            self._released[:] = ["".join(self._released)]
        return self._released[0] if self._released else ""

    def add(self, token_ids: Iterable[int], finished: bool = False) -> str:
        """Feed new output tokens; returns the text this call releases. `finished` marks the last
        call: the held-back text and a character that never completed (as U+FFFD) come out, so
        without a stop the text equals the decode of all the tokens. After a stop, returns "" and
        changes nothing."""
        if self.stopped:
            return ""
        if self._finished:
            raise RuntimeError("add() called after the call marked finished")
        out = []
        for token in token_ids:
            self._ids.append(token)
            out.append(self._release(self._decode_next(final=False)))
            if self.stopped:
                break
        if finished and not self.stopped:
            self._finished = True
            out.append(self._release(self._decode_next(final=True)))
            if not self.stopped:
                out.append(self._held.take(self._held.length))
        released = "".join(out)
        if released:
            self._released.append(released)
        return released

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_next(self, final: bool) -> str:
        """Text of the tokens past `read`, once it ends in a whole character (or `final`)."""
        ids = self._ids
        if self._read == len(ids):
            return ""
        if self._window_prefix is None:
            self._window_prefix = self._decode(ids[self._surr:self._read])
        prefix = self._window_prefix
        full = self._decode(ids[self._surr:])
        if len(full) < len(prefix) or (full.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        self._surr, self._read = self._read, len(ids)
        self._window_prefix = None
        return full[len(prefix):]

    def _release(self, new: str) -> str:
        """Run `new` through the stop strings; returns the text that is now safe to release."""
        if self._matcher is None or not new:
            return new
        can_stop = len(self._ids) - self._num_context >= self.min_tokens
        hit = self._matcher.scan(new, report=can_stop)
        if hit is None:
            self._held.push(new)
            return self._held.take(self._held.length - self._matcher.hold)
        consumed, stop = hit
        self._held.push(new[:consumed])
        self.stop_reason = stop
        kept = self._held.length - (0 if self.include_stop_str_in_output else len(stop))
        released = self._held.take(kept)
        self._held = _HeldText()
        return released
