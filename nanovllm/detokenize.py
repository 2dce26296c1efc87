"""In-process incremental detokenization with stop strings, for the offline `LLM`.

The engine works on token ids; stop strings are matched on text. This turns one request's
output tokens into text as they arrive and reports the first stop string. (The service does the
same in its detokenizer stage.)

Text grows by decoding a small window twice, vLLM style: `decode(ids[prefix:])` minus
`decode(ids[prefix:read])`. The overlap keeps tokenizers that drop a leading space at the start
of a decode (SentencePiece) correct, and a window that ends in U+FFFD (half a UTF-8 character)
is held back until the character completes.
"""
from __future__ import annotations

from typing import Any

from nanovllm.sampling_params import SamplingParams


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self.stop_reason: str | None = None
        """The stop string that ended the text, once one has."""
        self._prefix_offset = 0
        self._read_offset = 0
        self._max_stop_len = max(map(len, self.stop), default=0)

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def add(self, token_ids: list[int]) -> bool:
        """Feed newly generated tokens; True once a stop string has ended the text."""
        for token in token_ids:
            if self.stopped:
                break
            searched = len(self.text)
            self.token_ids.append(token)
            self.text += self._next_text()
            if self.stop and len(self.token_ids) >= self.min_tokens:
                self._find_stop(max(0, searched - self._max_stop_len + 1))
        return self.stopped

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _next_text(self) -> str:
        ids = self.token_ids
        prefix = self._decode(ids[self._prefix_offset:self._read_offset])
        full = self._decode(ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # nothing new yet, or a character still incomplete
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        return full[len(prefix):]

    def _find_stop(self, start: int) -> None:
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return
        index, stop = min(hits)
        self.text = self.text[:index + len(stop)] if self.include_stop else self.text[:index]
        self.stop_reason = stop
