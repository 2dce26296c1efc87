"""Per-request output constraints: the `LogitsProcessor` interface and the two shipped ones.

A logits processor sees one request's next-token logits (V,) and the token ids it has generated
so far, and returns the logits to sample from (changing the row in place is fine). The sampler
calls each request's processors after penalties and before temperature / top-k / top-p, so a
token set to -inf here can never be drawn, greedy or not. A processor's decisions must depend on
`output_token_ids` alone: a preempted request is recomputed and must get the same decisions.
It may keep state derived from the output to save work (`BannedWords` does), as long as it
starts over when an output does not extend the one it saw last. A processor that raises, or
leaves NaN or +inf in the row, ends its own request with an error (the sampler's rule).

- `AllowedTokenIds`: only the listed tokens may be generated.
- `BannedTokenSequences`: token-id sequences that never appear in the output; a multi-token
  sequence is blocked at its last token, when the output already ends with the rest of it.
- `BannedWords`: strings that never appear in the output's bytes, however the model spells
  them in tokens: a token is blocked when it would complete the string (checked on the bytes
  of the tokens, see `token_bytes`). One Aho-Corasick automaton over the request's words
  follows the output, so a step costs the bytes of the new tokens, not the words' lengths.
"""
from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from typing import Callable, Protocol, Sequence

import torch

from nanovllm.sampling_params import SamplingParams, show

MAX_CACHED_WORDS = 4096
MAX_CACHED_MATCHERS = 256
"""Compiled word sets kept per vocabulary (requests often share one list of banned words)."""


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
        self._matchers: OrderedDict[tuple[str, ...], WordMatcher] = OrderedDict()

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

    def matcher(self, words: list[str]) -> WordMatcher:
        """The automaton for a request's banned strings, shared by requests with the same list."""
        key = tuple(words)
        if key in self._matchers:
            self._matchers.move_to_end(key)
            return self._matchers[key]
        matcher = self._matchers[key] = WordMatcher([self.word(w) for w in words])
        if len(self._matchers) > MAX_CACHED_MATCHERS:
            self._matchers.popitem(last=False)
        return matcher

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


class WordMatcher:
    """An Aho-Corasick automaton over banned words' bytes, and the tokens to block in each state.

    A state is a trie node: the longest suffix of the output so far that starts some word. The
    output ends with word[:k] exactly when that prefix's node is the state or on its chain of
    failure links; there, the tokens starting with word[k:] would complete the word. Dictionary
    links skip the chain's nodes that block nothing, so a step visits only nodes that do.
    """

    def __init__(self, words: list[BannedWord]):
        self.always = torch.cat([w.containing for w in words])
        """Tokens that hold a whole word: blocked in every state."""
        self.children: list[dict[int, int]] = [{}]
        completing: list[list[torch.Tensor]] = [[]]
        for word in words:
            node = 0
            for k, byte in enumerate(word.text, 1):
                if byte not in self.children[node]:
                    self.children[node][byte] = len(self.children)
                    self.children.append({})
                    completing.append([])
                node = self.children[node][byte]
                if k in word.completing:
                    completing[node].append(word.completing[k])
        self.blocks = [None if not c else c[0] if len(c) == 1 else torch.cat(c) for c in completing]
        """node -> the tokens that finish a word whose prefix is the node's bytes (None if none do)."""
        self.fail = [0] * len(self.children)
        self.next_blocking = [0] * len(self.children)
        """node -> the nearest node on its failure chain (itself excluded) that blocks something; 0 if none."""
        queue = deque(self.children[0].values())
        while queue:  # breadth first: a node's failure link is shallower, so already known
            node = queue.popleft()
            f = self.fail[node]
            self.next_blocking[node] = f if self.blocks[f] is not None else self.next_blocking[f]
            for byte, child in self.children[node].items():
                f = self.fail[node]
                while f and byte not in self.children[f]:
                    f = self.fail[f]
                self.fail[child] = self.children[f].get(byte, 0)
                queue.append(child)

    def advance(self, state: int, data: bytes) -> int:
        """The state after the output grows by `data` (amortized O(len(data)))."""
        children, fail = self.children, self.fail
        for byte in data:
            while state and byte not in children[state]:
                state = fail[state]
            state = children[state].get(byte, 0)
        return state

    def blocked(self, state: int) -> list[torch.Tensor]:
        """Token ids that would complete a word from `state` (besides `always`)."""
        out = []
        node = state if self.blocks[state] is not None else self.next_blocking[state]
        while node:
            out.append(self.blocks[node])
            node = self.next_blocking[node]
        return out


class BannedWords:
    """Blocks the tokens that would complete one of the request's banned strings.

    Between calls it keeps the matcher state for the output it last saw: an output that extends
    it costs only the new tokens' bytes; any other (shorter, or with a different token where the
    last seen one was, e.g. another caller's) is matched again from its start.
    """

    def __init__(self, words: list[str], index: WordIndex):
        self.table = index.table
        self.matcher = index.matcher(words)
        self._state = 0
        self._num_seen = 0
        self._last_seen = -1

    def __call__(self, output_token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        logits.index_fill_(0, self.matcher.always, float("-inf"))
        n, seen = len(output_token_ids), self._num_seen
        if n < seen or (seen and output_token_ids[seen - 1] != self._last_seen):
            self._state = seen = 0
        state, table, advance = self._state, self.table, self.matcher.advance
        for i in range(seen, n):
            state = advance(state, table[output_token_ids[i]])
        self._state, self._num_seen = state, n
        self._last_seen = output_token_ids[n - 1] if n else -1
        for ids in self.matcher.blocked(state):
            logits.index_fill_(0, ids, float("-inf"))
        return logits


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
