"""The tokenizer stage's answers to `TokenizeReq` and `DetokenizeReq` (vLLM's /tokenize and
/detokenize): a text or a chat to token ids the way a request's prompt is made (the same chat
rendering, the same size bound), and token ids back to text. No sockets, no state beyond the
tokenizer and the limits; every refusal is an `ErrorOutput` naming the problem, for the sender.
"""
# [ZH-START]
# 【模块定位】分词进程对"只分词 / 只反分词"命令的回答（对应 vLLM 的 /tokenize、/detokenize）：
#   客户端 ─TokenizeReq / DetokenizeReq→ 分词进程（本模块算出答案）─TokenizeOutput /
#   DetokenizeOutput（或 ErrorOutput）→ 同一客户端；不经过引擎和反分词进程。
# 文本或对话变成 token 的方式与请求的 prompt 完全相同（同一个 render_chat、同一个长度上限）；
# 反分词时每个 id 都要在词表内。没有 socket，除了分词器和上限不保存状态。
# [ZH-END]
from __future__ import annotations

from typing import Any

from nanovllm_client import protocol as p

from .chat import render_chat
from .requests import MAX_CHARS_PER_TOKEN

MAX_DETOKENIZE_TOKENS = 1 << 20
"""Token ids one detokenize may carry when the context length is not known (else that length)."""


class TokenAnswers:
    # [ZH-START]
    # 【职责】把 TokenizeReq / DetokenizeReq 变成回答：TokenizeOutput（token、可选的 token 字符串、
    # max_model_len）、DetokenizeOutput（文本），或说明问题的 ErrorOutput（带 request_id）。
    # 【边界】不碰 socket，回复由 TokenizerStage 发；不经过引擎；文本长度上限与请求相同
    # （64 × max_model_len 个字符），反分词的 id 必须在词表内、个数不超过 max_model_len。
    # 【协作者】TokenizerStage._handle 调 answer；chat.render_chat；分词器（encode、decode、
    # convert_ids_to_tokens）。
    # [ZH-END]

    def __init__(self, tokenizer: Any, max_model_len: int | None = None):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    @property
    def vocab_size(self) -> int:
        """Ids at or above this are outside the vocabulary (added tokens included)."""
        return len(self.tokenizer)

    def answer(self, req: p.TokenizeReq | p.DetokenizeReq) -> p.Message:
        """The reply to one command; an `ErrorOutput` naming the problem if it cannot be served."""
        # [ZH-START]
        # 1. TokenizeReq → _tokenize；DetokenizeReq → _detokenize。
        # 2. ValueError（长度、词表范围、tools、模板变量）→ ErrorOutput（原文 + request_id）；
        #    模板自己的各种异常 → ErrorOutput("cannot apply the model's chat template: ...")。
        # [ZH-END]
        try:
            return self._tokenize(req) if isinstance(req, p.TokenizeReq) else self._detokenize(req)
        except ValueError as e:
            return p.ErrorOutput(message=p.clip(str(e)), request_id=req.request_id)
        except Exception as e:  # noqa: BLE001 — a chat template fails in many types
            return p.ErrorOutput(message=p.clip(f"cannot apply the model's chat template: {e}"),
                                 request_id=req.request_id)

    def _tokenize(self, req: p.TokenizeReq) -> p.TokenizeOutput:
        # [ZH-START]
        # 1. 有 messages：render_chat（add_generation_prompt / continue_final_message 照请求），
        #    add_special_tokens 默认 False（模板里已经带了特殊 token）；
        #    否则是 prompt 文本，默认 True。
        # 2. 文本超过 64 × max_model_len 个字符 → ValueError（与请求同一上限，分词前就拒绝）。
        # 3. encode；要 token 字符串时 convert_ids_to_tokens（最多 MAX_TOKEN_STRS 个，
        #    多了 → ValueError：回答是一个 msgpack 数组，有长度上限）。
        # 4. 返回 TokenizeOutput(打包的 ids, max_model_len, token_strs)。
        # [ZH-END]
        if req.messages is not None:
            text = render_chat(self.tokenizer, req.messages, req.tools, req.chat_template_kwargs,
                               add_generation_prompt=req.add_generation_prompt,
                               continue_final_message=req.continue_final_message)
            special = bool(req.add_special_tokens)
        else:
            text, special = req.prompt, req.add_special_tokens is not False
        if self.max_model_len is not None and len(text) > MAX_CHARS_PER_TOKEN * self.max_model_len:
            raise ValueError(f"the text has {len(text)} characters, more than max_model_len {self.max_model_len} "
                             f"tokens could hold (at most {MAX_CHARS_PER_TOKEN} characters per token are allowed for)")
        ids = self.tokenizer.encode(text, add_special_tokens=special)
        if req.return_token_strs and len(ids) > p.MAX_TOKEN_STRS:
            raise ValueError(f"return_token_strs is served for at most {p.MAX_TOKEN_STRS} tokens; this text has "
                             f"{len(ids)} (ask for the ids alone)")
        strs = [str(t) for t in self.tokenizer.convert_ids_to_tokens(ids)] if req.return_token_strs else None
        return p.TokenizeOutput(request_id=req.request_id, token_ids=p.pack_token_ids(ids),
                                max_model_len=self.max_model_len, token_strs=strs)

    def _detokenize(self, req: p.DetokenizeReq) -> p.DetokenizeOutput:
        # [ZH-START]
        # 1. id 个数超过 max_model_len（不知道时 MAX_DETOKENIZE_TOKENS）→ ValueError。
        # 2. 第一个不在词表 [0, vocab_size) 内的 id → ValueError，说出它的位置和值。
        # 3. decode（特殊 token 照原样保留，与 vLLM 一致），返回 DetokenizeOutput。
        # [ZH-END]
        ids = req.token_ids
        limit = self.max_model_len or MAX_DETOKENIZE_TOKENS
        if len(ids) > limit:
            raise ValueError(f"tokens has {len(ids)} ids, more than the {limit} this service takes at once")
        if ids and max(ids) >= self.vocab_size:
            bad = next(i for i, t in enumerate(ids) if t >= self.vocab_size)
            raise ValueError(f"tokens[{bad}] = {ids[bad]} is outside the vocabulary (ids 0 to {self.vocab_size - 1})")
        return p.DetokenizeOutput(request_id=req.request_id, text=self.tokenizer.decode(ids))
