"""Bodies of vLLM's `POST /tokenize` and `POST /detokenize`, checked and mapped to the client's
`tokenize` / `detokenize` commands, and their answers in vLLM's shapes.

/tokenize takes `{"model"?, "prompt", "add_special_tokens"?, "return_token_strs"?}` or
`{"model"?, "messages", "add_generation_prompt"?, "continue_final_message"?, "add_special_tokens"?,
"tools"?, "chat_template_kwargs"?, "return_token_strs"?}` (the messages and tools checked by the
chat parser, so they render exactly as a chat request's prompt) and answers `{"count",
"max_model_len", "tokens"}`, with `"token_strs"` when asked for. /detokenize takes `{"model"?,
"tokens"}` and answers `{"prompt"}`. Fields follow the chat rule: vLLM's fields that change nothing
here accepted, `chat_template` and multimodal ones refused unless null, others accepted and logged
once by name (as vLLM does).
"""
from __future__ import annotations

from typing import Any

from .errors import bad
from .schema import _ignored, foreign_fields, parse_chat

_PROMPT_FIELDS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
_CHAT_FIELDS = {"model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
                "return_token_strs", "tools", "chat_template_kwargs"}
_NEUTRAL: dict[str, tuple] = {"chat_template": (), "mm_processor_kwargs": (), "media_io_kwargs": ()}
MAX_TOKENS = 1 << 20
"""Token ids in one /detokenize body (the 4 MiB body limit holds fewer; the tokenizer stage
refuses more than the model's context)."""


def _flag(body: dict, name: str, default: bool | None) -> bool | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be a boolean", name)
    return value


def _model(body: Any) -> str | None:
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    return model


def parse_tokenize(body: Any) -> tuple[str | None, str | list[dict], dict[str, Any]]:
    """(model or None, the text or the chat's messages, the client's `tokenize` keywords); a 400
    naming the field otherwise."""
    model = _model(body)
    chat = "messages" in body
    if chat == ("prompt" in body):
        raise bad("give exactly one of 'prompt' (a text) and 'messages' (a chat)", "messages" if chat else "prompt")
    for name in foreign_fields(body, _CHAT_FIELDS if chat else _PROMPT_FIELDS, set(), _NEUTRAL):
        _ignored("tokenize", str(name), False)
    options: dict[str, Any] = {"add_special_tokens": _flag(body, "add_special_tokens", None),
                               "return_token_strs": _flag(body, "return_token_strs", False)}
    if not chat:
        if not isinstance(body["prompt"], str):
            raise bad("'prompt' must be a string", "prompt")
        return model, body["prompt"], options
    options["add_generation_prompt"] = _flag(body, "add_generation_prompt", True)
    options["continue_final_message"] = _flag(body, "continue_final_message", False)
    if options["add_generation_prompt"] and options["continue_final_message"]:
        raise bad("'continue_final_message' cannot be combined with 'add_generation_prompt' (set it false)",
                  "continue_final_message")
    call = parse_chat({k: body[k] for k in ("messages", "tools", "chat_template_kwargs") if k in body}
                      | {"model": model or "-"})
    options.update({k: v for k, v in call.kwargs.items() if k in ("tools", "chat_template_kwargs")})
    return model, call.prompt, options


def parse_detokenize(body: Any) -> tuple[str | None, list[int]]:
    """(model or None, the token ids); a 400 naming the field otherwise."""
    model = _model(body)
    for name in foreign_fields(body, {"model", "tokens"}, set(), {}):
        _ignored("detokenize", str(name), False)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or len(tokens) > MAX_TOKENS or \
            not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32 for t in tokens):
        raise bad(f"'tokens' must be a list of at most {MAX_TOKENS} token ids (non-negative integers)", "tokens")
    return model, tokens


def tokenize_body(tokenized: Any, max_model_len: int | None, token_strs: bool) -> dict:
    """vLLM's TokenizeResponse."""
    out = {"count": len(tokenized.token_ids), "max_model_len": tokenized.max_model_len or max_model_len,
           "tokens": tokenized.token_ids}
    if token_strs:
        out["token_strs"] = tokenized.token_strs
    return out

