"""Per-request output constraints: the `LogitsProcessor` interface and the two shipped ones.

A logits processor sees one request's next-token logits (V,) and the token ids it has generated
so far, and returns the logits to sample from (changing the row in place is fine). The sampler
calls each request's processors after penalties and before temperature / top-k / top-p, so a
token set to -inf here can never be drawn, greedy or not. Processors must be stateless with
respect to the sequence (everything they need is in `output_token_ids`): a preempted request
is recomputed and must get the same decisions.

- `AllowedTokenIds`: only the listed tokens may be generated.
- `BannedTokenSequences`: token-id sequences that never appear in the output; a multi-token
  sequence is blocked at its last token, when the output already ends with the rest of it.
- `BannedWords`: strings that never appear in the output's bytes, however the model spells
  them in tokens: a token is blocked when it would complete the string (checked on the bytes
  of the tokens, see `token_bytes`).
"""
from __future__ import annotations

import bisect
from collections import OrderedDict
from typing import Callable, Protocol, Sequence

import torch

from nanovllm.sampling_params import SamplingParams, show

MAX_CACHED_WORDS = 4096


class LogitsProcessor(Protocol):
    def __call__(self, output_token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """logits (V,) float32 of one request -> the logits to sample from."""
        ...


class AllowedTokenIds:
    def __init__(self, token_ids: list[int], vocab_size: int, device: torch.device | str = "cpu"):
        self.blocked = torch.ones(vocab_size, dtype=torch.bool, device=device)
        self.blocked[torch.tensor(token_ids, dtype=torch.long, device=device)] = False

    def __call__(self, output_token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        return logits.masked_fill_(self.blocked, float("-inf"))


class BannedTokenSequences:
    def __init__(self, sequences: list[list[int]], device: torch.device | str = "cpu"):
        self.always = torch.tensor([s[0] for s in sequences if len(s) == 1], dtype=torch.long, device=device)
        self.longer = [(list(s[:-1]), s[-1]) for s in sequences if len(s) > 1]

    def __call__(self, output_token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        logits.index_fill_(0, self.always, float("-inf"))
        for prefix, last in self.longer:
            n = len(prefix)
            if len(output_token_ids) >= n and list(output_token_ids[-n:]) == prefix:
                logits[last] = float("-inf")
        return logits


class WordIndex:
    """For one vocabulary: which tokens contain, or start with the rest of, a banned string."""

    def __init__(self, table: list[bytes], device: torch.device | str = "cpu"):
        self.table = table
        self.device = device
        self._sorted = sorted(range(len(table)), key=table.__getitem__)  # token ids by their bytes
        self._sorted_bytes = [table[i] for i in self._sorted]
        self._offsets = [0]
        for piece in table:
            self._offsets.append(self._offsets[-1] + len(piece))
        self._blob = b"".join(table)
        self._words: OrderedDict[bytes, BannedWord] = OrderedDict()
        """Compiled words, least recently used first; bounded because clients choose the words."""

    def word(self, text: str) -> BannedWord:
        key = text.encode()
        if key in self._words:
            self._words.move_to_end(key)
            return self._words[key]
        completing = {k: self._ids(self._starting_with(key[k:])) for k in range(1, len(key))}
        word = self._words[key] = BannedWord(key, self._ids(self._containing(key)), completing)
        if len(self._words) > MAX_CACHED_WORDS:
            self._words.popitem(last=False)
        return word

    def _ids(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def _starting_with(self, prefix: bytes) -> list[int]:
        out = []
        for i in range(bisect.bisect_left(self._sorted_bytes, prefix), len(self._sorted)):
            if not self._sorted_bytes[i].startswith(prefix):
                break
            out.append(self._sorted[i])
        return out

    def _containing(self, needle: bytes) -> list[int]:
        # One C-speed scan of all token bytes laid end to end, instead of a loop over the vocabulary.
        out = []
        pos = self._blob.find(needle)
        while pos >= 0:
            token = bisect.bisect_right(self._offsets, pos) - 1
            if pos + len(needle) <= self._offsets[token + 1]:
                out.append(token)
            pos = self._blob.find(needle, pos + 1)
        return sorted(set(out))


class BannedWord:
    def __init__(self, text: bytes, containing: torch.Tensor, completing: dict[int, torch.Tensor]):
        self.text = text
        self.containing = containing
        """Tokens whose bytes hold the whole string."""
        self.completing = {k: ids for k, ids in completing.items() if ids.numel()}
        """k -> tokens that finish the string when the output ends with its first k bytes."""


class BannedWords:
    def __init__(self, words: list[str], index: WordIndex):
        self.index = index
        self.words = [index.word(w) for w in words]
        self.always = torch.cat([w.containing for w in self.words])
        self.tail_len = max(len(w.text) for w in self.words) - 1

    def __call__(self, output_token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        logits.index_fill_(0, self.always, float("-inf"))
        tail = self._tail(output_token_ids)
        for word in self.words:
            for k, ids in word.completing.items():
                if tail.endswith(word.text[:k]):
                    logits.index_fill_(0, ids, float("-inf"))
        return logits

    def _tail(self, output_token_ids: Sequence[int]) -> bytes:
        """The last `tail_len` bytes of the output (fewer tokens than that, walked backwards)."""
        pieces, size = [], 0
        for token in reversed(output_token_ids):
            if size >= self.tail_len:
                break
            piece = self.index.table[token]
            pieces.append(piece)
            size += len(piece)
        return b"".join(reversed(pieces))[-self.tail_len:] if self.tail_len else b""


def build_logits_processors(params: SamplingParams, vocab_size: int, device: torch.device | str,
                            word_index: Callable[[], WordIndex]) -> list[LogitsProcessor]:
    """The request's processors (built-in first, then its own); ValueError for ids outside the vocab.

    `word_index` is called only when string banned words are present (it may load a tokenizer).
    """
    processors: list[LogitsProcessor] = []
    if params.allowed_token_ids is not None:
        _check_ids("allowed_token_ids", params.allowed_token_ids, vocab_size)
        processors.append(AllowedTokenIds(params.allowed_token_ids, vocab_size, device))
    sequences = [w for w in params.banned_words if not isinstance(w, str)]
    if sequences:
        _check_ids("banned_words", [t for s in sequences for t in s], vocab_size)
        processors.append(BannedTokenSequences(sequences, device))
    words = [w for w in params.banned_words if isinstance(w, str)]
    if words:
        processors.append(BannedWords(words, word_index()))
    processors.extend(params.logits_processors)
    return processors


def _check_ids(name: str, ids: list[int], vocab_size: int) -> None:
    bad = [t for t in ids if t >= vocab_size]
    if bad:
        raise ValueError(f"{name} has token id {show(bad[0])} outside the vocabulary [0, {vocab_size})")
