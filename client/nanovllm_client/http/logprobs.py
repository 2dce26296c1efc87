"""Logprobs in OpenAI's shapes (chat's `logprobs.content`, completions' legacy lists) and vLLM's
`prompt_logprobs`, from the service's entries (`protocol.TokenLogprob`: each token's text, bytes,
logprob, rank and alternatives)."""
from __future__ import annotations

from typing import Any

from ..protocol import TokenLogprob

FLOOR = -9999.0
"""A logprob of -inf (a token the model rules out) as JSON can carry it (OpenAI's and vLLM's)."""


def _lp(value: float) -> float:
    return max(value, FLOOR)


def chat_content(entries: list[TokenLogprob]) -> list[dict[str, Any]]:
    """Chat's `logprobs.content`: per token its text, logprob, bytes and top alternatives."""
    return [{"token": e.token, "logprob": _lp(e.logprob), "bytes": list(e.bytes),
             "top_logprobs": [{"token": t.token, "logprob": _lp(t.logprob), "bytes": list(t.bytes)} for t in e.top]}
            for e in entries]


def chat_logprobs(entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
    return None if entries is None else {"content": chat_content(entries), "refusal": None}


class CompletionLogprobs:
    """Completions' legacy `logprobs` lists, built piece by piece (a stream's chunks, or the whole
    answer in one): `text_offset` counts characters from the start of the choice's text, echoed
    prompt included."""

    def __init__(self, offset: int = 0):
        self.offset = offset

    def piece(self, entries: list[TokenLogprob], first_given: bool = False) -> dict[str, Any]:
        """The lists for `entries`; `first_given`: the first is the prompt's first token, which has
        no logprob (null, as OpenAI's echo shows it)."""
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i, e in enumerate(entries):
            given = first_given and i == 0
            out["tokens"].append(e.token)
            out["token_logprobs"].append(None if given else _lp(e.logprob))
            out["top_logprobs"].append(None if given else {t.token: _lp(t.logprob) for t in e.top})
            out["text_offset"].append(self.offset)
            self.offset += len(e.token)
        return out


def joined(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    return {key: first[key] + second[key] for key in first}


def vllm_prompt_logprobs(entries: list[TokenLogprob] | None) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs`: null for the first token, then per token a map from token id (as
    text) to its logprob, rank and text: the prompt's token and the alternatives."""
    if entries is None:
        return None
    out: list[dict[str, Any] | None] = [None]
    for e in entries[1:]:
        scores = {str(t.token_id): {"logprob": _lp(t.logprob), "rank": rank, "decoded_token": t.token}
                  for rank, t in enumerate(e.top, 1)}
        scores[str(e.token_id)] = {"logprob": _lp(e.logprob), "rank": e.rank, "decoded_token": e.token}
        out.append(scores)
    return out


def prompt_text(entries: list[TokenLogprob]) -> str:
    """A prompt's text from its tokens' entries (their bytes, joined and decoded)."""
    return b"".join(e.bytes for e in entries).decode("utf-8", errors="replace")
