"""Commands: one question to the service and one answer, not a stream. The sync `Client` and the
`AsyncClient` build them here and read the answers here, so both say the same; each sends a
command's frame to the tokenizer and waits, under the command's request id, for the reply
message (`ClientState.handle` hands those over as `Reaction.replies`) or for the error that ends
it (an `ErrorOutput` under that id, routed like a failed stream's).

- tokenize / detokenize (vLLM's /tokenize, /detokenize): answered by the tokenizer stage.
- reset_prefix_cache (vLLM's /reset_prefix_cache): passed on by the tokenizer to the engine, which
  answers through the detokenizer (refused while the service drains).
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any

from . import protocol as p
from .checks import ProtocolError
from .client_state import chat_extras
from .errors import RequestError, ServiceDrainingError

_serial = itertools.count()


def command_id(kind: str) -> str:
    """A request id no stream of this process uses (streams' wire ids end in '#<n>')."""
    return f"{kind}-{os.getpid():x}-{next(_serial):x}"


@dataclass
class Tokenized:
    """A text or chat as the service tokenizes it."""
    token_ids: list[int]
    max_model_len: int | None
    """The engine's context length, as the tokenizer stage knows it."""
    token_strs: list[str] | None = None
    """Each token's own string, where asked for."""


def _checked(msg: p.Message) -> p.Message:
    """The command as the stage will check it; ValueError (the stage's own words) before it is sent."""
    try:
        msg.validate()
    except ProtocolError as e:
        raise ValueError(str(e)) from None
    return msg


def tokenize_request(prompt: str | list[dict[str, Any]], *, add_special_tokens: bool | None = None,
                     add_generation_prompt: bool = True, continue_final_message: bool = False,
                     tools: list[dict] | str | None = None, chat_template_kwargs: dict[str, Any] | str | None = None,
                     return_token_strs: bool = False) -> p.TokenizeReq:
    """`prompt`: a text, or a chat's messages (rendered through the model's chat template, with
    `tools` and `chat_template_kwargs` as for a request). `add_special_tokens` None: the text gets
    them, the chat not (its template writes them). ValueError naming the problem."""
    chat = isinstance(prompt, list)
    try:
        tools_text, kwargs_text = chat_extras(tools, chat_template_kwargs)
    except ProtocolError as e:
        raise ValueError(str(e)) from None
    return _checked(p.TokenizeReq(
        request_id=command_id("tokenize"), prompt=None if chat else prompt, messages=prompt if chat else None,
        add_special_tokens=add_special_tokens, add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message, tools=tools_text, chat_template_kwargs=kwargs_text,
        return_token_strs=return_token_strs))


def detokenize_request(token_ids: list[int]) -> p.DetokenizeReq:
    return _checked(p.DetokenizeReq(request_id=command_id("detokenize"), token_ids=list(token_ids)))


def reset_prefix_cache_request() -> p.ResetPrefixCacheReq:
    return p.ResetPrefixCacheReq(request_id=command_id("reset"))


def answer(reply: Any) -> Any:
    """A command's reply as what the caller asked for; RequestError with the service's words
    (ServiceDrainingError for a cache reset refused during a drain)."""
    if isinstance(reply, p.TokenizeOutput):
        return Tokenized(token_ids=p.unpack_token_ids(reply.token_ids), max_model_len=reply.max_model_len,
                         token_strs=reply.token_strs)
    if isinstance(reply, p.DetokenizeOutput):
        return reply.text
    if isinstance(reply, p.ResetPrefixCacheOutput):
        if reply.draining:
            raise ServiceDrainingError(reply.error or "the service is draining")
        if reply.error is None:
            return reply.freed_blocks
    error = getattr(reply, "error", None) or f"unexpected reply {type(reply).__name__}"
    raise RequestError(error, getattr(reply, "request_id", None))
