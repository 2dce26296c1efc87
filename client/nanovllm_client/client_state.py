"""The client's protocol logic without any I/O, shared by the sync `Client` and `AsyncClient`.

It builds request frames, turns incoming frames into per-request `Delta`s, and keeps every
request in flight with how much of its stream has arrived. From that it follows the service's
health and keeps streams alive across stage restarts:
- an engine-dead notice ends no request: each one in flight is kept and, once a new engine
  instance is up (for up to `engine_restart_wait_s`), sent to it again, with the output tokens
  and the count of characters it had received; the new engine continues from there, and the
  stream goes on where it broke off;
- a request the tokenizer could pass to no engine (`unsent`: a new engine it has not connected
  to yet) is kept the same way and sent again while an engine is up, within the same wait;
- a restarted tokenizer (a new instance id in its pong) may have lost requests it had not yet
  passed on: every request with no answer yet is sent again, marked as a resend, which the
  engine ignores if it got the first copy;
- a restarted detokenizer is told how many tokens and characters of each stream arrived
  (`Resume`), and continues each stream from there;
- a detokenizer silent for `stage_timeout` fails the requests in flight with a clear error.

Each stream travels under its own wire id ('<request id>#<n>'), so a request id may be reused
as soon as the earlier stream is done or cancelled: late outputs of the old one never reach the
new one.
"""
# [ZH-START]
# 【模块定位】客户端的协议逻辑，不做任何 I/O；同步 Client 和 AsyncClient 共用它。
#   客户端 API ─请求帧→ 分词进程
#   反分词进程 ─StreamOutput / Pong / EngineStatus→ ClientState.handle → 各流的 Delta
# 重发与续传都在这里（两个客户端的注释说"见 client_state"，指的就是本模块）：
#   - 引擎挂了：在途请求不算失败，先停放（parked）；新引擎实例起来后（最多等
#     engine_restart_wait_s），带着已收到的输出 token 和字符数重发，
#     新引擎从那里接着算，流从断开处继续；
#   - 分词进程重启（Pong 里换了实例 id）：还没收到回答的请求全部标成重发再发一次，
#     收过第一份的引擎会忽略；
#   - 反分词进程重启：用 Resume 告诉它每个流已经收到多少 token 和字符；
#   - 反分词进程沉默超过 stage_timeout：在途请求以明确的错误结束。
# 每个流用自己的线上 id（'<request id>#<n>'），旧流的迟到输出不会串到复用同一 request id 的新流上。
# [ZH-END]
from __future__ import annotations

import itertools
import json
import logging
import time
import uuid
from array import array
from dataclasses import dataclass, field, replace
from typing import Any

import zmq

from . import protocol as p
from .checks import ProtocolError
from .errors import EngineDeadError, ServiceDrainingError
from .protocol import FinishReason
from .sampling import SamplingParams
from .security import CurveKeys, client_curve, client_socket_security, new_routing_id
from .template_kwargs import template_kwargs_text
from .endpoints import check_ipc_endpoint, default_url, service_endpoints

log = logging.getLogger("nanovllm_client")

ENGINE_DEAD = "engine is not available (dead or not started yet)"
MAX_ENGINE_RESENDS = 1
"""Times a request goes to a new engine after its engine died. A request that was in flight at
two deaths fails: it may be what kills the engine, and sending it to every new one would keep
the service down for everyone."""
MAX_APP_ID_LEN = p.MAX_ID_LEN - 16
"""A request id given by the caller; the rest of the wire id is the per-stream suffix."""
_wire_serial = itertools.count()


@dataclass
class Delta:
    """One piece of a streamed answer."""
    # [ZH-START]
    # 流式回答的一段：新文本、新 token；带 finish_reason 的那一段是终止消息。
    # [ZH-END]
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    """None while streaming; why it ended on the last delta (a str: "stop", "length", "abort", "error")."""
    usage: dict[str, int] | None = None
    """On the last delta: prompt_tokens, completion_tokens, cached_tokens."""
    error: str | None = None
    engine_dead: bool = False
    reasoning_open: bool = False
    """The chat template opened a reasoning block at the prompt's end (`<think>`): the output
    starts inside it, with no `<think>` of its own, up to `</think>`."""
    logprobs: list[p.TokenLogprob] | None = None
    """With `logprobs`: one entry per token of `token_ids` (token text, bytes, logprob, rank, top
    alternatives). None on a delta whose tokens the service rebuilt after its detokenizer
    restarted (their logprobs were lost with it)."""
    prompt_logprobs: list[p.TokenLogprob] | None = None
    """With `prompt_logprobs`, on the first delta: one entry per prompt token. The first token is
    given, not predicted: its entry has logprob 0 and no alternatives."""
    stop_reason: str | None = None
    """On the last delta of an answer a stop string ended: that string."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def failed(cls, request_id: str, why: str, engine_dead: bool = False) -> Delta:
        """The terminal delta of a request that failed, for `why`."""
        return cls(request_id=request_id, text="", token_ids=[], finish_reason=FinishReason.ERROR, error=why,
                   engine_dead=engine_dead)


@dataclass
class Result:
    """A whole answer (`generate`)."""
    # [ZH-START]
    # generate 返回的整段回答：把一个流的所有增量拼起来。
    # [ZH-END]
    request_id: str
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    usage: dict[str, int] | None = None
    logprobs: list[p.TokenLogprob] | None = None
    """With `logprobs`: every delta's entries, in order (see `Delta.logprobs`)."""
    prompt_logprobs: list[p.TokenLogprob] | None = None


def build_request(prompt: str | list[int] | list[dict] | None = None, *, messages: list[dict] | None = None,
                  prompt_token_ids: list[int] | None = None, request_id: str | None = None, priority: int = 0,
                  tools: list[dict] | str | None = None, chat_template_kwargs: dict | str | None = None,
                  sampling: SamplingParams | None = None, tenant: str | None = None, **params: Any) -> p.GenerateReq:
    """The GenerateReq for one call. `prompt` may be text, a chat message list or token ids.

    Sampling is `sampling` (one `SamplingParams`), or its fields as keywords (`max_tokens=64,
    temperature=0, stop=..., response_format=...`; a keyword given as None is left at its
    default), validated here by the struct's own checks: a bad value raises `SamplingError`
    naming it before anything is sent. `tools` (OpenAI's list, with a chat) is sent as JSON text;
    the model's chat template renders them into the prompt. `chat_template_kwargs` (with a
    chat): extra variables for that template, e.g. {"enable_thinking": False}, sent as JSON text.
    `tenant`: whom the request is for (`GenerateReq.tenant`; the HTTP front's, honoured only from
    a connection with the service's own key)."""
    if sampling is None:
        sampling = SamplingParams.from_dict({k: v for k, v in params.items() if v is not None})
    elif params:
        raise TypeError(f"give sampling parameters either as `sampling` or as keywords, not both (got "
                        f"{sorted(params)[:4]})")
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        messages, prompt = prompt, None
    elif isinstance(prompt, list):
        prompt_token_ids, prompt = prompt, None
    ids = p.pack_token_ids(prompt_token_ids) if prompt_token_ids is not None else None
    tools_text, kwargs_text = chat_extras(tools, chat_template_kwargs)
    return p.GenerateReq(request_id=request_id or uuid.uuid4().hex, prompt=prompt, messages=messages,
                         prompt_token_ids=ids, sampling=sampling, priority=priority, tools=tools_text, tenant=tenant,
                         chat_template_kwargs=kwargs_text)


def chat_extras(tools: list[dict] | str | None,
                chat_template_kwargs: dict | str | None) -> tuple[str | None, str | None]:
    """A chat's `tools` and `chat_template_kwargs` as they travel: JSON text (given as text, as is)."""
    tools_text = (tools if isinstance(tools, str) or tools is None
                  else json.dumps(tools, separators=(",", ":"), ensure_ascii=False))
    return tools_text, (template_kwargs_text(chat_template_kwargs) if isinstance(chat_template_kwargs, dict)
                        else chat_template_kwargs)


def wire_request(req: p.GenerateReq) -> tuple[str, bytes, bytes]:
    """(wire id, frame, resend frame) for a request: the wire id is unique to this stream."""
    app_id = req.request_id
    if not isinstance(app_id, str) or not 0 < len(app_id) <= MAX_APP_ID_LEN:
        raise ValueError(f"request_id must be a non-empty string of at most {MAX_APP_ID_LEN} characters")
    wire = replace(req, request_id=f"{app_id}#{next(_wire_serial):x}")
    return wire.request_id, wire.encode(), replace(wire, resend=True).encode()


@dataclass
class InFlight:
    # [ZH-START]
    # 一个在途请求的续传进度：原始请求帧，以及已收到的 token 数、字符数；
    # answered 表示已收到回答（分词进程重启时，只重发还没回答的请求）；resends 记重发次数。
    # [ZH-END]
    resend_frame: bytes
    tokens: int = 0
    chars: int = 0
    answered: bool = False
    ids: array = field(default_factory=lambda: array("I"))
    """The output token ids received: what a continuation sends a new engine."""
    resends: int = 0
    """Times it was sent to a new engine after an engine death (`MAX_ENGINE_RESENDS`)."""
    kept_since: float | None = None
    """When it began waiting for an engine (kept across refusals, cleared by output)."""
    digest: str | None = None
    """`protocol.frame_digest` of the frame last sent for it, until it is answered: a frame the
    tokenizer cannot read comes back named by it (`ClientState.unanswered`)."""

    def frame(self) -> bytes:
        """The request as a resend; with output received, asking the engine to continue from it."""
        if not self.ids:
            return self.resend_frame
        req = p.decode(self.resend_frame)
        req.output_token_ids, req.output_chars = p.pack_token_ids(self.ids), self.chars
        if req.sampling.prompt_logprobs is not None:  # they came with the first output, received
            req.sampling = replace(req.sampling, prompt_logprobs=None)
        if req.prompt_token_ids is not None:  # decoding unpacked them
            req.prompt_token_ids = p.pack_token_ids(req.prompt_token_ids)
        return req.encode()


@dataclass
class Parked:
    """A request whose engine died: sent again to the next engine instance, continued from the
    output it had received."""
    # [ZH-START]
    # 停放的请求：等下一个引擎实例。engine 是停放时所属的实例（没到过引擎时为 None），
    # dead_seen 表示已听到该实例的死讯；frame() 生成带已收输出的续传帧。
    # [ZH-END]
    progress: InFlight
    engine: str | None
    """The engine instance it was sent to (the one that died), if known; None for one that
    reached no engine."""
    why: str
    dead_seen: bool
    """A death of `engine` was announced since: that instance speaking again lived on without it."""
    unsent: bool = False
    """The tokenizer had no engine to pass it to: it reached none, so sending it again is no
    resend to a new engine (`MAX_ENGINE_RESENDS`)."""

    def frame(self) -> bytes:
        return self.progress.frame()


@dataclass
class Reaction:
    """What one incoming frame (or a heartbeat) means for the client."""
    # [ZH-START]
    # 处理一帧（或一次心跳）的结果：要交给各流的 Delta、
    # 要发给分词进程的帧（to_tokenizer），以及统计和命令的回答（replies）。
    # [ZH-END]
    deltas: list[Delta] = field(default_factory=list)
    """To route to their streams (by wire id)."""
    stats: dict[str, Any] | None = None
    replies: list[p.Message] = field(default_factory=list)
    """Answers to commands (`commands.py`), for whoever waits under their request id."""
    to_tokenizer: list[bytes] = field(default_factory=list)
    to_detok: list[bytes] = field(default_factory=list)


COMMAND_REPLIES = (p.TokenizeOutput, p.DetokenizeOutput, p.ResetPrefixCacheOutput)
"""The answers to commands (`commands.py`): one message each, under the command's request id."""


class ClientState:
    """Health of the service as this client sees it, the requests in flight, and frame -> deltas.

    Used from one thread (the sync client's I/O thread, or the event loop)."""
    # [ZH-START]
    # 【职责】客户端眼中的服务状态：引擎是否活着、各进程的实例 id、反分词进程是否在回 ping；
    # 在途请求 inflight（线上 id → 已收到的输出，用来续传）和停放的请求 parked（等下一个引擎实例）。
    # 【边界】不碰 socket：handle 把一帧变成 Reaction（要交给各流的 Delta、
    # 要发给分词进程的帧），由调用方发送。
    # 只在一个线程里用（同步客户端的 I/O 线程，或 asyncio 事件循环），所以不加锁。
    # [ZH-END]

    def __init__(self, detok_timeout: float = 3.0, stage_timeout: float = 30.0,
                 engine_restart_wait_s: float = 60.0) -> None:
        self.engine_alive: bool | None = None
        """True once a ready engine is known, False once it is known dead, None meanwhile."""
        self.engine_state = ""
        """The engine's state as the detokenizer reports it: "", loading, ready or draining."""
        self.detok_instance: str | None = None
        self.tokenizer_instance: str | None = None
        self.engine_instance: str | None = None
        """The engine instance the detokenizer follows, once it has named one."""
        self.detok_timeout, self.stage_timeout = detok_timeout, stage_timeout
        self.detok_responsive = False
        self.last_pong = time.monotonic()
        self.inflight: dict[str, InFlight] = {}
        self.engine_restart_wait_s = engine_restart_wait_s
        """How long a request in flight when its engine died waits for a new engine to continue it
        (0: it fails with the engine)."""
        self.parked: dict[str, Parked] = {}
        self.unanswered: dict[str, str] = {}
        """Frame digest -> wire id, for each request sent and not answered yet: a frame the
        tokenizer could not read (so cannot name by its request id) fails its request at once."""

    @property
    def ready(self) -> bool:
        """The detokenizer answers our pings: it knows our routing id, outputs can reach us."""
        return self.detok_instance is not None and self.detok_responsive

    def sent(self, wire_id: str, resend_frame: bytes, frame: bytes | None = None) -> bool:
        """Register a new request (`frame`: what is sent now, if not `resend_frame`); False if it
        must not be sent now: the engine is known dead, so it waits (as a request that reached no
        engine) for the next one, within `engine_restart_wait_s` and its own timeout, instead of
        failing at once."""
        self.inflight[wire_id] = InFlight(resend_frame)
        if self.engine_alive is False and self._park(wire_id, ENGINE_DEAD, False, unsent=True):
            return False
        self._sending(wire_id, frame if frame is not None else resend_frame)
        return True

    def forget(self, wire_id: str) -> None:
        self._answered(self.inflight.pop(wire_id, None))
        parked = self.parked.pop(wire_id, None)
        self._answered(parked.progress if parked else None)

    def _sending(self, wire_id: str, frame: bytes) -> bytes:
        """`frame` goes to the tokenizer for request `wire_id`: note its digest until an answer."""
        progress = self.inflight[wire_id]
        self._answered(progress)
        progress.digest = p.frame_digest(frame)
        self.unanswered[progress.digest] = wire_id
        return frame

    def _answered(self, progress: InFlight | None) -> None:
        if progress is not None and progress.digest is not None:
            self.unanswered.pop(progress.digest, None)
            progress.digest = None

    def handle(self, frame: bytes) -> Reaction:
        # [ZH-START]
        # 按消息类型分派，返回 Reaction，不做 I/O：
        # 1. 解不开的帧：记警告后丢弃。
        # 2. StreamOutput：每行变成 Delta 并更新续传进度（_track）；随后 _unpark，
        #    把停放的请求发给新引擎。
        # 3. ErrorOutput：带 request_id 的结束那个流；不带的，若 frame_digest 对上本客户端发出、
        #    尚未得到回答的请求帧（unanswered），结束那个请求的流，否则只记日志。
        # 4. Pong：_on_pong（反分词进程在回应；分词进程换了实例就重发没回答的请求）。
        # 5. EngineStatus：记下引擎状态和实例，更新"引擎是否活着"（loading
        #    时记为未知），再 _unpark。
        # 6. StatsOutput：把统计交给调用方；命令的回答（COMMAND_REPLIES）：交给等它的调用方。
        # [ZH-END]
        try:
            msg = p.decode(frame)
        except ProtocolError as e:
            log.warning("dropping an undecodable frame from the service: %s", e)
            return Reaction()
        if isinstance(msg, p.StreamOutput):
            tracked = (self._track(self._delta(d), d.unsent) for d in msg.deltas)
            reaction = Reaction([d for d in tracked if d is not None])
            self._unpark(reaction)  # one refused for want of an engine while a new one is known up
            return reaction
        if isinstance(msg, p.ErrorOutput):
            # A frame the tokenizer could not read has no request id it can name: the digest of
            # the frame finds the request this client sent in it.
            wire_id = msg.request_id or self.unanswered.get(msg.frame_digest or "")
            if wire_id is not None:
                delta = self._track(Delta.failed(wire_id, msg.message))
                return Reaction([delta] if delta is not None else [])
            log.warning("service error: %s", msg.message)
            return Reaction()
        if isinstance(msg, p.Pong):
            return self._on_pong(msg)
        if isinstance(msg, p.EngineStatus):
            reaction = Reaction()
            if msg.alive:
                self.engine_state = msg.state
                self._follow_engine(msg.instance_id, reaction)
            reaction.deltas += self._set_engine_alive(msg.alive if msg.state != "loading" else None, msg.reason)
            self._unpark(reaction)
            return reaction
        if isinstance(msg, p.StatsOutput):
            return Reaction(stats=msg.stats)
        if isinstance(msg, COMMAND_REPLIES):
            return Reaction(replies=[msg])
        log.warning("unexpected %r message from the service", msg.TYPE)
        return Reaction()

    def check_detok(self) -> list[Delta]:
        """Called once per heartbeat. A detokenizer silent for `detok_timeout` makes new requests
        wait; silent for `stage_timeout`, the requests in flight fail (their outputs are lost).
        Requests kept for a new engine fail once they have waited `engine_restart_wait_s`."""
        now = time.monotonic()
        expired = [w for w, parked in self.parked.items() if self._waited_out(parked, now)]
        deltas = [self._give_up(w, self.parked.pop(w)) for w in expired]
        silent = now - self.last_pong
        if self.detok_responsive and silent >= self.detok_timeout:
            self.detok_responsive, self.engine_alive = False, None
        if self.detok_instance is None or silent < self.stage_timeout or not self.inflight:
            return deltas
        why = f"the detokenizer has not answered for {self.stage_timeout:.0f}s; outputs were lost"
        return deltas + self._fail_all(why, engine_dead=False)

    # ------------------------------------------------------------------ internals

    def _on_pong(self, msg: p.Pong) -> Reaction:
        reaction = Reaction()
        if msg.role == "tokenizer":
            if self.tokenizer_instance is not None and msg.instance_id != self.tokenizer_instance:
                # It may have died holding requests it had not passed on: send those again.
                reaction.to_tokenizer = [self._sending(wire_id, f.frame()) for wire_id, f in list(self.inflight.items())
                                         if not f.answered]
                if reaction.to_tokenizer:
                    log.info("tokenizer restarted: sending %d unanswered request(s) again", len(reaction.to_tokenizer))
            self.tokenizer_instance = msg.instance_id
            return reaction
        self.last_pong, self.detok_responsive = time.monotonic(), True
        if self.detok_instance is not None and msg.instance_id != self.detok_instance and self.inflight:
            rows = [p.ResumeRow(request_id=wire_id, num_tokens=f.tokens, num_chars=f.chars)
                    for wire_id, f in self.inflight.items()]
            log.info("detokenizer restarted: resuming %d stream(s)", len(rows))
            reaction.to_detok = [p.Resume(requests=rows).encode()]
        self.detok_instance, self.engine_state = msg.instance_id, msg.engine_state
        reaction.deltas += self._set_engine_alive(msg.engine_alive)
        self._unpark(reaction)
        return reaction

    def _follow_engine(self, instance_id: str, reaction: Reaction) -> None:
        """The detokenizer names the engine it follows. Another instance than the one known means
        the engine restarted; when the detokenizer that saw the old one die died with it, nobody
        else tells us: the requests in flight are handled as at an engine death (kept for the new
        engine, which `_unpark` then sends them to; failed, and aborted in case one reached the
        new engine after all, when waiting is off)."""
        if not instance_id:
            return
        if self.engine_instance is not None and instance_id != self.engine_instance and self.inflight:
            log.info("engine restarted (%s replaced %s): %d request(s) in flight", instance_id,
                     self.engine_instance, len(self.inflight))
            if not self.engine_restart_wait_s:
                reaction.to_tokenizer += [p.AbortReq(request_id=wire_id).encode() for wire_id in self.inflight]
            reaction.deltas += self._fail_all(f"engine restarted (instance {instance_id} replaced "
                                              f"{self.engine_instance}); the request was lost", engine_dead=True)
        self.engine_instance = instance_id

    def _park(self, wire_id: str, why: str, dead_seen: bool, unsent: bool = False) -> bool:
        """Keep a request whose engine died (or that reached none: `unsent`) for the next engine
        instead of failing it; False if it cannot be kept (not in flight, or waiting is off)."""
        progress = self.inflight.get(wire_id)
        if progress is None or not self.engine_restart_wait_s:
            return False
        del self.inflight[wire_id]
        self._answered(progress)  # sent again (`_sending`) when it goes to the next engine
        if progress.kept_since is None:
            progress.kept_since = time.monotonic()
        self.parked[wire_id] = Parked(progress, None if unsent else self.engine_instance, why,
                                      dead_seen or self.engine_alive is False, unsent)
        return True

    def _waited_out(self, parked: Parked, now: float) -> bool:
        return now - parked.progress.kept_since >= self.engine_restart_wait_s

    def _give_up(self, wire_id: str, parked: Parked) -> Delta:
        wait = f"{self.engine_restart_wait_s:.0f}s"
        why = (f"{parked.why}; the tokenizer reached no engine within {wait}" if parked.unsent
               else f"{parked.why}; no new engine came up within {wait}")
        return Delta.failed(wire_id, why, engine_dead=True)

    def _unpark(self, reaction: Reaction) -> None:
        """While an engine is up, send the kept requests again that were sent to another instance
        (marked as resends: an engine that got a copy after all ignores it). Kept under this very
        instance: after its death was announced they fail (it lived on, and the detokenizer dropped
        them); before (the detokenizer fails a dead engine's requests just before it says so), they
        wait for that announcement and the next instance."""
        # [ZH-START]
        # 1. 引擎不是确知活着，或没有停放的请求 → 什么都不做。
        # 2. 对每个停放的请求：
        #    a. 停放时属于别的实例（或根本没到过引擎）：
        #       - 没到过引擎（unsent）：等满 engine_restart_wait_s 就报错，否则直接重新发出；
        #       - 已重发 MAX_ENGINE_RESENDS 次：报错——它可能就是把引擎搞挂的那个请求；
        #       - 否则 resends 加一，带着已收到的输出重新发出（_resume_in_flight）。
        #    b. 停放时就属于当前实例、且已听到它的死讯：这个实例其实还活着，
        #       反分词进程已丢掉这些请求，只能报错。
        #    c. 属于当前实例但还没听到死讯：继续等（反分词进程先让请求失败，稍后才宣布引擎死亡）。
        # 3. 有请求重新发出时记一条 INFO 日志。
        # [ZH-END]
        if self.engine_alive is not True or not self.parked:
            return
        for wire_id, parked in list(self.parked.items()):
            if parked.engine is None or parked.engine != self.engine_instance:
                if parked.unsent:  # it reached no engine: not a resend to a new one
                    if self._waited_out(parked, time.monotonic()):
                        reaction.deltas.append(self._give_up(wire_id, parked))  # refused all along
                    else:
                        self._resume_in_flight(wire_id, parked, reaction)
                elif parked.progress.resends >= MAX_ENGINE_RESENDS:
                    reaction.deltas.append(Delta.failed(wire_id, (
                        f"{parked.why}; the engine died {parked.progress.resends + 1} times while this request was "
                        "in flight, so it is not sent again (it may be what kills it)"), engine_dead=True))
                else:
                    parked.progress.resends += 1
                    self._resume_in_flight(wire_id, parked, reaction)
            elif parked.dead_seen:
                reaction.deltas.append(Delta.failed(wire_id, parked.why, engine_dead=True))
            else:
                continue
            del self.parked[wire_id]
        if reaction.to_tokenizer:
            log.info("engine %s is up: sending %d request(s) again, each continued from the output received",
                     self.engine_instance, len(reaction.to_tokenizer))

    def _resume_in_flight(self, wire_id: str, parked: Parked, reaction: Reaction) -> None:
        """In flight again, sent to the tokenizer for the engine now up. Unanswered until that
        engine's first output: should the tokenizer die before passing it on, its successor gets
        it again (`_on_pong`), continued from the output received, not started over."""
        parked.progress.answered = False
        self.inflight[wire_id] = parked.progress
        reaction.to_tokenizer.append(self._sending(wire_id, parked.frame()))

    def _set_engine_alive(self, alive: bool | None, reason: str = "") -> list[Delta]:
        """None: not known (a detokenizer that just started, an engine loading) - not a death."""
        was_alive, self.engine_alive = self.engine_alive, alive
        if alive is False and was_alive is not False:
            for parked in self.parked.values():
                parked.dead_seen = True
            return self._fail_all(f"engine died: {reason}" if reason else "engine died", engine_dead=True)
        return []

    def _fail_all(self, why: str, engine_dead: bool) -> list[Delta]:
        """Fail the requests in flight; at an engine death each is kept for the next engine instead
        (`_park`), unless waiting is off."""
        deltas = [Delta.failed(wire_id, why, engine_dead=engine_dead)
                  for wire_id in list(self.inflight) if not (engine_dead and self._park(wire_id, why, True))]
        self.inflight.clear()
        self.unanswered.clear()  # the parked send a new frame (`_sending`) when they go again
        return deltas

    def _track(self, delta: Delta, unsent: bool = False) -> Delta | None:
        """Count the delta against its request; None when it is an engine death (or a refusal for
        want of an engine: `unsent`) that the request waits out for the next engine instead (`_park`)."""
        if (delta.engine_dead and delta.finish_reason is FinishReason.ERROR
                and self._park(delta.request_id, delta.error or "", False, unsent)):
            return None
        progress = self.inflight.get(delta.request_id)
        if progress is None:
            return delta
        self._answered(progress)
        progress.answered, progress.kept_since = True, None
        progress.tokens += len(delta.token_ids)
        progress.chars += len(delta.text)
        progress.ids.extend(delta.token_ids)
        if delta.finished:
            del self.inflight[delta.request_id]
        return delta

    @staticmethod
    def _delta(d: p.DeltaRow) -> Delta:
        usage = None if d.usage is None else d.usage._asdict()
        return Delta(request_id=d.request_id, text=d.text, token_ids=p.unpack_token_ids(d.token_ids),
                     finish_reason=d.finish_reason, usage=usage, error=d.error, engine_dead=d.engine_dead,
                     reasoning_open=d.reasoning_open, logprobs=d.logprobs, prompt_logprobs=d.prompt_logprobs,
                     stop_reason=d.stop_reason)


def merge(deltas: list[Delta], request_id: str) -> Result:
    result = Result(request_id=request_id, text="".join(d.text for d in deltas))
    for d in deltas:
        result.logprobs = p.join_logprobs(result.logprobs, len(result.token_ids), d.logprobs, len(d.token_ids))
        result.token_ids.extend(d.token_ids)
        if d.prompt_logprobs is not None:
            result.prompt_logprobs = d.prompt_logprobs
        if d.finished:
            result.finish_reason, result.usage, result.stop_reason = d.finish_reason, d.usage, d.stop_reason
    return result


class ClientBase:
    """What the sync `Client` and the `AsyncClient` share: the service address, the limits, the
    client's identity on both sockets, its CURVE keys, and the protocol state.

    `curve`: (this client's key pair, the service's public key), for a service that requires
    CURVE; by default from $NANOVLLM_CURVE_CLIENT_KEY and $NANOVLLM_CURVE_SERVER_KEY (files), else
    for a loopback tcp service of this user its instance key (`security.client_curve`).
    `insecure_tcp`: no CURVE unless keys are given, for a tcp service run with --insecure-tcp
    (also $NANOVLLM_INSECURE_TCP=1).
    `engine_restart_wait_s`: how long a request whose engine died waits for a new engine, which
    then continues it from the output received (0: it fails with the engine, `EngineDeadError`)."""
    # [ZH-START]
    # 同步 Client 和 AsyncClient 共用的部分：服务地址、各种上限、两个 socket 上的客户端身份、
    # CURVE 密钥，以及一个 ClientState。I/O 由子类各自实现。
    # [ZH-END]

    def __init__(self, url: str | None, timeout: float | None, connect_timeout: float,
                 heartbeat_interval: float, hwm: int, stage_timeout: float = 30.0,
                 curve: tuple[CurveKeys, bytes] | None = None, engine_restart_wait_s: float = 60.0,
                 insecure_tcp: bool = False):
        self.url = url or default_url()
        self.endpoints = service_endpoints(self.url)
        check_ipc_endpoint(self.endpoints.tokenizer)  # both sockets live in one directory
        self._curve = client_curve(self.url, curve, insecure_tcp=insecure_tcp)
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self._heartbeat_interval, self._hwm = heartbeat_interval, hwm
        self._identity = new_routing_id(self._curve)
        self._state = ClientState(stage_timeout=stage_timeout, engine_restart_wait_s=engine_restart_wait_s)
        self._wire_ids: dict[str, str] = {}
        """Caller's request id -> wire id of its stream in flight."""
        self._replies: dict[str, Any] = {}
        """Request id of a command waiting for its answer -> the queue its answer goes to (a
        `queue.Queue` or an `asyncio.Queue`, each client its own kind)."""

    @property
    def engine_alive(self) -> bool | None:
        return self._state.engine_alive

    def _ping_wait(self, ready: bool) -> float:
        """Seconds to this client's next heartbeat. Ready: to the next multiple of the interval on
        the monotonic clock (system-wide), so the clients of a host ping at the same instants and a
        stage serves their pings in one wake-up; a ping that wakes it alone costs it 3-4 times as much
        (bench/ping_cost.py). Not yet ready: 0.1 s, to finish the handshake soon."""
        if not ready:
            return 0.1
        wait = self._heartbeat_interval - time.monotonic() % self._heartbeat_interval
        # Woken a hair before the grid point just pinged for (timers may fire early by the clock's
        # resolution): the next one, not a second ping at once.
        return wait if wait > 0.01 * self._heartbeat_interval else wait + self._heartbeat_interval

    def _deadline(self, timeout: float | None) -> float:
        """The monotonic time a request started now must end by (its own timeout, else the client's)."""
        limit = timeout if timeout is not None else self.timeout
        return time.monotonic() + (limit if limit is not None else 1e9)

    def _refuse_if_unavailable(self, request_id: str) -> None:
        """New requests fail at once while the service is draining, and while the engine is known
        dead if they may not wait for a new one (`engine_restart_wait_s` 0; else `sent` keeps them)."""
        if self._state.engine_alive is False and not self._state.engine_restart_wait_s:
            raise EngineDeadError(ENGINE_DEAD, request_id)
        if self._state.engine_state == "draining":
            raise ServiceDrainingError(f"the service is draining (shutting down): request {request_id} was not sent; "
                                       "retry on another instance or later")

    def _claim(self, req: p.GenerateReq) -> tuple[str, bytes, bytes]:
        """Register a new stream for the caller's request id; ValueError if that id is in flight."""
        if req.request_id in self._wire_ids:
            raise ValueError(f"request id {req.request_id!r} is already in flight on this client")
        wire_id, frame, resend_frame = wire_request(req)
        self._wire_ids[req.request_id] = wire_id
        return wire_id, frame, resend_frame

    def _release(self, app_id: str, wire_id: str) -> None:
        if self._wire_ids.get(app_id) == wire_id:
            del self._wire_ids[app_id]

    def _take_frame(self, frame: bytes) -> Reaction | None:
        """One frame from the service through the protocol state, with what both clients do alike:
        mark the client ready, queue a stats reply. None if the frame could not be handled (logged:
        a bug costs one frame, never the reader every stream waits on). The caller sends the
        reaction's frames on its own sockets, then `_route`s its deltas.

        Both clients hold `_ready` (an Event), `_stats` and `_streams` (wire id -> queue) of their
        own kind; `put_nowait` and `set` are the same on the threading and asyncio ones."""
        try:
            reaction = self._state.handle(frame)
        except Exception:
            log.exception("could not handle a frame from the service")
            return None
        if self._state.ready:
            self._ready.set()
        if reaction.stats is not None:
            self._stats.put_nowait(reaction.stats)
        for reply in reaction.replies:
            waiter = self._replies.get(reply.request_id)
            if waiter is not None:
                waiter.put_nowait(reply)
        return reaction

    def _route(self, deltas: list[Delta]) -> None:
        # [ZH-START]
        # 1. 按增量的 wire id 找到流的队列并放入；不是流的，可能是等回答的命令（出错时它的
        #    ErrorOutput 变成一个失败的增量），放进它的回答队列。
        # 2. 都找不到（流已结束或已取消）就丢弃：旧流迟到的输出永远到不了复用同一 id 的新流。
        # [ZH-END]
        for delta in deltas:
            target = self._streams.get(delta.request_id)
            if target is None:
                target = self._replies.get(delta.request_id)
            if target is not None:
                target.put_nowait(delta)

    def _dealer(self, ctx: zmq.Context, endpoint: str) -> zmq.Socket:
        """A DEALER to one stage; both carry this client's identity so the stages can route to it."""
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, self._identity)
        sock.setsockopt(zmq.SNDHWM, self._hwm)
        sock.setsockopt(zmq.RCVHWM, self._hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_FRAME_BYTES)
        sock.setsockopt(zmq.LINGER, 1000)
        if self._curve is not None:
            client_socket_security(sock, *self._curve)
        sock.connect(endpoint)
        return sock
