"""What the tokenizer stage makes of a client's `GenerateReq`: the checked, tokenized
`TokenizedReq` frame for the engine, or `RequestRejected` saying what was wrong. No sockets and
no state beyond its settings. The request's sampling struct was checked by its own validator when
the frame was decoded; the checks left are here, in order (priority ceilings, what the service
does not serve, the prompt's size before and after tokenizing, the engine's own frame checks). A
response_format is compiled once, by the engine (it needs the compiled grammar to enforce it).
"""
# [ZH-START]
# 【模块定位】分词进程对一个 GenerateReq 做的全部事情：检查、套 chat 模板、分词，
# 得到给引擎的 TokenizedReq 帧，或抛出 RequestRejected 说明哪里不对。没有 socket，
# 除了设置不保存任何状态。采样参数（SamplingParams）在解帧时已由它自己的校验器检查过；
# 这里剩下的检查按顺序：priority 上限、服务还不支持的参数、分词前后 prompt 的大小、
# 引擎自己的帧检查。response_format 只由引擎编译一次（它要用编译好的语法来约束采样）。
# [ZH-END]
from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import Any, Callable

from nanovllm.detokenize import PROMPT_CONTEXT_TOKENS
from nanovllm_client import protocol as p
from nanovllm_client.checks import ProtocolError, prompt_too_long

from .chat import opens_reasoning, render_chat

MAX_CHARS_PER_TOKEN = 64
"""Generous bound on characters per token (real text averages about 4), used to refuse text too
long for the model before spending time tokenizing it."""


class RequestRejected(ValueError):
    """A request the stage refuses; the text goes back to the client."""
    # [ZH-START]
    # 【职责】"这个请求被拒绝"的异常，消息文本原样作为错误增量回给客户端。
    # 【边界】只表示请求本身的问题（参数、长度、模板）；内部 bug 不用它，由 handle 的兜底捕获。
    # 【协作者】RequestBuilder.build / _prompt_ids / _bounded 抛出，
    # TokenizerStage._on_generate 捕获并回复。
    # [ZH-END]


class RequestBuilder:
    # [ZH-START]
    # 【职责】把客户端的 GenerateReq 变成给引擎的 TokenizedReq 帧：校验（priority 上限、
    # 服务不支持的参数）、套 chat 模板、分词、检查长度，加上反分词进程需要的 meta；
    # 按客户端给前缀缓存加盐（--cache-salt-per-client）。
    # 【边界】纯函数式：不碰 socket、不保存请求；出错只抛 RequestRejected，
    # 回复由 TokenizerStage 负责。采样参数的取值不在这里查（解帧时 SamplingParams 已查过）。
    # 【协作者】TokenizerStage._on_generate 调 build；分词器（encode、apply_chat_template）。
    # [ZH-END]

    def __init__(self, tokenizer: Any, max_prompt_tokens: int | None = None, cache_salt_per_client: bool = False,
                 max_priority: int | None = None,
                 key_max_priority: Callable[[str | None], int | None] = lambda key: None):
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        """The engine's max_model_len: no longer prompt can ever be served, so none is tokenized."""
        self.cache_salt_per_client = cache_salt_per_client
        """Salt every request's prefix-cache blocks by its client (`client_cache_salt`)."""
        self.max_priority = max_priority
        """The highest `priority` a request may ask for (None: any the protocol allows); an
        allow-listed key's file may set a lower one for that key (`key_max_priority`)."""
        self.key_max_priority = key_max_priority

    def build(self, identity: bytes, req: p.GenerateReq, key: str | None = None, tenant: str | None = None) -> bytes:
        """Validate and tokenize: the TokenizedReq frame for the engine, or `RequestRejected` saying
        what was wrong. `key`: the client's CURVE key (its priority ceiling); `tenant`: the client
        it counts as (`tenant_of`, worked out here if not given), which salts its cache."""
        # [ZH-START]
        # 1. priority 超过 --max-priority，或超过这把客户端钥匙在 allow-list 文件里的 max-priority →
        #    拒绝并说出是哪个上限。
        #    req.sampling 已是校验过的 SamplingParams（解帧时旧客户端放在帧顶层的 stop、
        #    skip_special_tokens 也已并进去）。
        # 2. tenant（没给就 tenant_of 算：前端说的 API key / 地址、CURVE 公钥或路由 id）；
        #    开了 --cache-salt-per-client：sampling.cache_salt 换成 client_cache_salt(tenant,
        #    客户端自己给的盐)，前缀缓存只在同一客户端（同一把钥匙、同一个 API key）内共享。
        # 3. ids, reasoning_open = _prompt_ids(req)；要了 prompt_logprobs 而 prompt 长度 ×
        #    (1 + prompt_logprobs) 超过 MAX_PROMPT_SCORES（一帧装得下的分数）→ 拒绝并说明。
        # 4. meta = RequestMeta(client 身份, 客户端 rid, sampling = sampling.text_params()（stop、
        #    include_stop_str_in_output、skip_special_tokens、min_tokens，其余取默认值）,
        #    prompt_tail = prompt 最后 8 个 token（打包）, arrival = 时间,
        #    have_tokens / have_chars = 续写时客户端已有的 token 数和字符数,
        #    reasoning_open = chat 模板在 prompt 末尾打开了 <think>)，按关键字建，
        #    线上是按位置的数组；
        #    引擎原样转给反分词进程，用来建 IncrementalDetokenizer 和路由输出。
        # 5. 建 TokenizedReq(引擎侧 id, 打包的 prompt ids, sampling, meta, priority, resend,
        #    output_ids = 续写时客户端已收到的输出 token, tenant)，先用引擎自己的 validate
        #    检查一遍，再编码、检查帧长：超过 16 MiB 的帧引擎的 socket 会连同连接一起丢掉，
        #    在这里就拒绝并说明原因；通过则返回编码好的帧。
        # [ZH-END]
        self._check_priority(req.priority, key)
        sampling = req.sampling
        tenant = tenant or tenant_of(identity, req, key)
        if self.cache_salt_per_client:
            sampling = dataclasses.replace(sampling, cache_salt=client_cache_salt(tenant, sampling.cache_salt))
        ids, reasoning_open = self._prompt_ids(req)
        if sampling.prompt_logprobs is not None and len(ids) * (1 + sampling.prompt_logprobs) > MAX_PROMPT_SCORES:
            raise RequestRejected(f"prompt_logprobs={sampling.prompt_logprobs} over a {len(ids)}-token prompt asks for "
                                  f"{len(ids) * (1 + sampling.prompt_logprobs)} scores, more than the {MAX_PROMPT_SCORES} "
                                  "one answer carries: ask for fewer alternatives or a shorter prompt")
        have_tokens, have_chars = (len(req.output_token_ids) // 4, req.output_chars) if req.output_token_ids else (0, 0)
        meta = p.RequestMeta(client=identity, client_request_id=req.request_id, sampling=sampling.text_params(),
                             prompt_tail=p.pack_token_ids(ids[-PROMPT_CONTEXT_TOKENS:]), arrival=time.time(),
                             have_tokens=have_tokens, have_chars=have_chars, reasoning_open=reasoning_open)
        out = p.TokenizedReq(request_id=engine_request_id(identity, req.request_id),
                             prompt_token_ids=p.pack_token_ids(ids), sampling=sampling, meta=meta, priority=req.priority, resend=req.resend,
                             output_ids=req.output_token_ids or b"", tenant=tenant)
        try:  # the engine's own checks: a frame it would drop (it cannot answer the client) is refused here
            out.validate()
        except ProtocolError as e:
            raise RequestRejected(f"the request cannot be passed to the engine: {e}") from None
        frame = out.encode()
        if len(frame) > p.MAX_FRAME_BYTES:  # its socket would drop it, and the connection with it
            raise RequestRejected(f"the request is {len(frame)} bytes once tokenized, over the {p.MAX_FRAME_BYTES}-byte "
                                  "frame limit: shorten the prompt or the sampling lists")
        return frame

    def _check_priority(self, priority: int, key: str | None) -> None:
        """RequestRejected for a priority above the service's ceiling or the client key's own."""
        if self.max_priority is not None and priority > self.max_priority:
            raise RequestRejected(f"priority {priority} is above this service's ceiling of {self.max_priority} "
                                  f"(--max-priority)")
        own = self.key_max_priority(key)
        if own is not None and priority > own:
            raise RequestRejected(f"priority {priority} is above this client key's ceiling of {own} "
                                  f"(max-priority in its allow-list file)")

    def _prompt_ids(self, req: p.GenerateReq) -> tuple[list[int], bool]:
        """The prompt's token ids, and whether the chat template left it inside a reasoning block."""
        # [ZH-START]
        # 1. 给了 prompt_token_ids：直接用。
        # 2. 给了 messages：render_chat 经模型的 chat 模板渲染（带 tools 时见 chat.py，
        #    chat_template_kwargs 作为模板变量），tools 或模板变量不合法、模板失败 → 拒绝；
        #    文本先过 _bounded，再 encode(add_special_tokens=False)（模板里已经带了特殊 token）；
        #    opens_reasoning(文本)：模板在末尾打开了 <think>。
        # 3. 否则是 prompt 文本：_bounded 后 encode。
        # 4. 空 prompt → 拒绝；token 数 >= max_prompt_tokens（引擎的 max_model_len）→ 拒绝：
        #    prompt 加至少一个输出 token 必须放得下。
        # 5. 返回 (ids, reasoning_open)；非 chat 的 prompt 一律 False。
        # [ZH-END]
        reasoning_open = False
        if req.prompt_token_ids is not None:
            ids = req.prompt_token_ids
        elif req.messages is not None:
            try:
                text = render_chat(self.tokenizer, req.messages, req.tools, req.chat_template_kwargs)
            except ValueError as e:  # the tools (JSON text, their shape), the template variables
                raise RequestRejected(str(e)) from None
            except Exception as e:  # template errors come in many types
                raise RequestRejected(f"cannot apply the model's chat template: {e}") from None
            ids = self.tokenizer.encode(self._bounded(text), add_special_tokens=False)
            reasoning_open = opens_reasoning(text)
        else:
            ids = self.tokenizer.encode(self._bounded(req.prompt))
        if not ids:
            raise RequestRejected("prompt is empty: at least one token is needed")
        if self.max_prompt_tokens is not None and len(ids) >= self.max_prompt_tokens:
            raise RequestRejected(prompt_too_long(len(ids), self.max_prompt_tokens))
        return ids, reasoning_open

    def _bounded(self, text: str) -> str:
        """Refuse, before tokenizing, text far longer than any prompt the model could take: a
        megabyte of text costs the stage seconds and hundreds of MB to turn into tokens."""
        # [ZH-START]
        # 1. 字符数 > 64 × max_prompt_tokens：不可能是放得下的 prompt，分词前就拒绝（1 MB
        #    文本分词要花几秒和几百 MB）。
        # 2. 否则原样返回。
        # [ZH-END]
        if self.max_prompt_tokens is not None and len(text) > MAX_CHARS_PER_TOKEN * self.max_prompt_tokens:
            raise RequestRejected(f"prompt has {len(text)} characters, more than max_model_len "
                                  f"{self.max_prompt_tokens} tokens could hold (at most {MAX_CHARS_PER_TOKEN} "
                                  "characters per token are allowed for)")
        return text


UNTRUSTED_TENANT = ("refused: only the service's HTTP front, connected with the service's own key (or to a service "
                    "without CURVE), may say whom a request is for ('tenant'); this connection has a client key of "
                    "its own: send the request without it")


def tenant_of(identity: bytes, req: p.GenerateReq, key: str | None) -> str:
    """The client a request counts as for fair turns, per-client limits and the per-client cache
    salt: whom the HTTP front says it is for ('front:' + its `tenant`), trusted only from a
    connection with no key of its own (`key` None: the service's own key, or no CURVE); else the
    sender's CURVE key ('key:'), else its routing id ('id:'). RequestRejected for a `tenant`
    from any other client."""
    # [ZH-START]
    # 1. 请求带 tenant：发送者有自己的 CURVE 钥匙（key 不是 None）→ 拒绝（UNTRUSTED_TENANT），
    #    只有用服务自己钥匙（或没开 CURVE）的 HTTP 前端说了算；否则 "front:" + tenant。
    # 2. 没带：有钥匙 → "key:" + 钥匙；否则 "id:" + 路由 id 的 hex。
    # [ZH-END]
    if req.tenant is not None:
        if key is not None:
            raise RequestRejected(UNTRUSTED_TENANT)
        return "front:" + req.tenant
    return "key:" + key if key else "id:" + identity.hex()


def engine_request_id(identity: bytes, request_id: str) -> str:
    """Client request ids are only unique per client; the engine sees '<client>:<request>'."""
    return f"{identity.hex()}:{request_id}"


MAX_PROMPT_SCORES = 1 << 18
"""Prompt tokens × (1 + prompt_logprobs) one request may ask for: the prompt's logprobs travel in
one frame (to the client about 30 bytes a score with its token's text: 8 MiB at most, under the
16 MiB frame limit)."""


def client_cache_salt(client: str, own: str | None) -> str:
    """The cache salt of a request from `client` (its CURVE key, else its routing identity) that
    asked for salt `own` (or none): requests share cached prompt blocks only within one client,
    and within it only under one salt of its own. A digest, so the salt stays within its length
    limit and names no client."""
    digest = hashlib.blake2b(client.encode(), digest_size=16)
    if own is not None:
        digest.update(b"\0" + own.encode("utf-8", "surrogatepass"))
    return "client:" + digest.hexdigest()
