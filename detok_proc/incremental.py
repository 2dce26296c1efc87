"""Per-request incremental detokenization and stop-string matching (no I/O).

Decoding token by token breaks multi-byte characters and some tokenizers' spacing, so, as in
SGLang, each request keeps two offsets into its token ids: `surr_offset` (where the surrounding
context starts) and `read_offset` (the first token not yet turned into text). New text is
``decode(ids[surr:]) minus decode(ids[surr:read])``. If it ends in U+FFFD, the last character is
still incomplete: nothing is emitted and the offsets stay, so the character comes out whole with
a later token (never a U+FFFD, never a dropped character).

Stop strings: text is held back while its tail could still be the start of a stop string; when
one matches, the text before it is emitted and the request is finished (the caller aborts it in
the engine).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5
"""Prompt tokens kept as left context, so the first output token decodes with correct spacing."""


@dataclass
class DetokState:
    tokenizer: Any
    skip_special_tokens: bool
    stop: list[str]
    token_ids: list[int] = field(default_factory=list)
    surr_offset: int = 0
    read_offset: int = 0
    text: str = ""
    """All output text decoded so far (complete characters only)."""
    sent_len: int = 0
    """How much of `text` has gone to the client."""

    @classmethod
    def create(cls, tokenizer: Any, prompt_tail: list[int], skip_special_tokens: bool = True,
               stop: list[str] | None = None) -> DetokState:
        tail = list(prompt_tail[-PROMPT_CONTEXT_TOKENS:])
        return cls(tokenizer, skip_special_tokens, list(stop or []), tail, 0, len(tail))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, new_token_ids: list[int], finished: bool) -> tuple[str, bool]:
        """Feed one step's tokens. Returns (text to send now, whether a stop string matched)."""
        self.token_ids.extend(new_token_ids)
        if self.read_offset < len(self.token_ids):
            prefix = self._decode(self.token_ids[self.surr_offset:self.read_offset])
            full = self._decode(self.token_ids[self.surr_offset:])
            if finished or not full.endswith(REPLACEMENT_CHAR):
                # At the end a trailing U+FFFD is the model's own output (or bytes that never
                # completed): emit it so the stream equals decode(all tokens).
                self.text += full[len(prefix):]
                self.surr_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return self._release(finished)

    def _release(self, finished: bool) -> tuple[str, bool]:
        if self.stop:
            # A match cannot start in text already sent: `_held_back` kept every tail that
            # could begin a stop string.
            hits = [i for i in (self.text.find(s, self.sent_len) for s in self.stop) if i >= 0]
            if hits:
                out = self.text[self.sent_len:min(hits)]
                self.sent_len = min(hits)
                return out, True
        end = len(self.text) if finished else len(self.text) - self._held_back()
        out = self.text[self.sent_len:end]
        self.sent_len = max(self.sent_len, end)
        return out, False

    def _held_back(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(self.text) - self.sent_len), longest, -1):
                if self.text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
