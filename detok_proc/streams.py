"""The detokenizer's requests in flight: from the engine's rows to each client's text deltas.

A request begins here with its meta (in the engine step that starts it, ahead of its first
token on the same ordered pipe), advances by one `OutputRow` a step (incremental detokenizing,
stop strings) and ends with one terminal delta. A stop string that matches here ends the
request in the engine too; its terminal delta is held until the engine's final row confirms the
engine dropped it, so an id reused after it never meets the old request there. A request
rebuilt from the engine's resync after a restart of this stage (recovery.py) holds its output
here until its client's `Resume` says how much of the stream it has.

No sockets and no clients' frames: each call returns an `Outcome`, the deltas for each client
and the request ids to abort in the engine (as vLLM's OutputProcessor returns reqs_to_abort).
"""
# [ZH-START]
# 【模块定位】反分词进程的在途请求：把引擎的输出行变成每个客户端的文本增量。
#   请求随引擎 step 的 started 行（meta 比它的第一个 token 先到，同一条有序管道）开始，
#   每步一个 OutputRow 推进（增量反分词、stop string），以一个终止增量结束。
#   stop string 在这里命中也要在引擎里结束它；终止增量要等引擎的最后一行确认它已丢掉这个请求才发，
#   这样客户端复用同一个 id 时引擎里一定没有旧请求。本 stage 重启后由 resync
#   重建的请求（recovery.py）在这里累积输出，等客户端的 Resume 说出已收到多少。
# 不碰 socket：每个调用返回 Outcome——每个客户端的增量、要在引擎里 abort 的请求 id（如 vLLM
# OutputProcessor 的 reqs_to_abort）。
# [ZH-END]
from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from nanovllm.detokenize import IncrementalDetokenizer, TokenTexts
from nanovllm.metrics import DetokMetrics
from nanovllm_client import protocol as p

log = logging.getLogger("detok_proc")

MAX_ABORTED_ORPHANS = 65536
RESEND_ABORT_S = 1.0
"""A stopped request the engine still reports has its abort sent again this long after the last:
the last may have found no room."""


def _terminal(reason: p.FinishReason, row: p.OutputRow) -> Final:
    """A terminal delta's fields: why the request ended, and its usage as of `row`."""
    return Final(finish_reason=reason, usage=p.Usage(prompt_tokens=row.num_prompt_tokens,
                                                      completion_tokens=row.num_output_tokens,
                                                      cached_tokens=row.num_cached_tokens))


class Final(NamedTuple):
    # [ZH-START]
    # 【职责】一个请求的终止字段：finish_reason、usage（prompt / 输出 / 命中缓存的 token 数）、
    # 错误文本、结束它的 stop string（stop_reason）；delta() 把它们和最后一段文本、token
    # 拼成一行终止 DeltaRow。
    # 【边界】不可变的值，不做 I/O；出错或 resync 等待期间，由调用方决定何时把它发出去。
    # 【协作者】finished()/error 路径创建；RequestStreams.advance 与 fail 用它结束一条流。
    # [ZH-END]
    """The fields of a request's terminal delta."""
    finish_reason: p.FinishReason
    usage: p.Usage | None = None
    error: str | None = None
    stop_reason: str | None = None
    """The stop string that ended it, if one did."""

    def delta(self, client_request_id: str, text: str = "", token_ids: bytes = b"",
              reasoning_open: bool = False, logprobs: list[p.TokenLogprob] | None = None,
              prompt_logprobs: list[p.TokenLogprob] | None = None) -> p.DeltaRow:
        """The terminal delta, with the last text and tokens (and their logprobs)."""
        return p.DeltaRow(request_id=client_request_id, text=text, token_ids=token_ids,
                          finish_reason=self.finish_reason, error=self.error, usage=self.usage,
                          reasoning_open=reasoning_open, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                          stop_reason=self.stop_reason)


@dataclass
class RequestState:
    # [ZH-START]
    # 【职责】本进程为一个在途请求保存的状态：所属客户端、客户端侧的请求 id（流的 wire id）、
    # IncrementalDetokenizer、持有它的引擎实例；resync 重建后等待 Resume 期间累积的全部
    # token / 文本 / 终止字段；最近的 token 计数；reasoning_open（来自 meta，每个增量都带上）。
    # 【边界】不保存 prompt 或采样参数（这些在引擎里）；不直接发送任何东西。
    # 【协作者】RequestStreams.start 创建，advance 每步推进，resume 在客户端报到后放出累积内容。
    # [ZH-END]
    client: bytes
    client_request_id: str
    detok: IncrementalDetokenizer
    engine: str
    """The engine instance that holds it."""
    awaiting_resume: bool = False
    """Rebuilt from a resync: nothing is sent until the client says what it already has."""
    all_ids: list[int] = field(default_factory=list)
    all_text: str = ""
    """While awaiting resume: every output token and every character released so far."""
    final: Final | None = None
    """While awaiting resume: the terminal fields, once the engine finished it."""
    num_prompt: int = 0
    num_output: int = 0
    """Token counts from its latest output (for the metrics of a request that ends here)."""
    stopped: Final | None = None
    """Its stop string matched here: the terminal fields ("stop", usage at the match), held until
    the engine's final row says it dropped the request. Only then does the client hear the end,
    so an id reused after the terminal delta never meets the old request in the engine."""
    abort_sent_at: float = 0.0
    skip_tokens: int = 0
    skip_chars: int = 0
    """Output the client has but the engine will report (again): a stream continued after an
    engine restart, whose engine reports the output it continues from with its first new token.
    Cut from what follows, not sent twice. From the request's meta (`have`), or from a resume
    that says the client has more than the engine had reported."""
    reasoning_open: bool = False
    """Its meta's: the output starts inside a reasoning block; every delta says so."""


@dataclass
class Outcome:
    """What a call on `RequestStreams` asks the loop to do."""
    # [ZH-START]
    # 【职责】RequestStreams 一次调用的结果：每个客户端按序的增量、要在引擎里 abort 的请求 id、
    # 新出现请求的客户端。
    # 【边界】只是数据；由 DetokStage 投递（step 的进 outbox 合并，其余立即发出）和发送 abort。
    # [ZH-END]
    deltas: dict[bytes, list[p.DeltaRow]] = field(default_factory=dict)
    """Deltas per client, in order."""
    aborts: list[str] = field(default_factory=list)
    """Engine request ids to abort in the engine."""
    clients: list[bytes] = field(default_factory=list)
    """Clients whose requests began here: the loop knows them from now (their silence is timed)."""

    def add(self, client: bytes, delta: p.DeltaRow) -> None:
        self.deltas.setdefault(client, []).append(delta)


class RequestStreams:
    # [ZH-START]
    # 【职责】全部在途请求（requests，按客户端索引 by_client）：开始、逐行推进（反分词、
    # stop string 等引擎确认）、结束与遗忘、整批报错（引擎死 / 重启）、客户端走了时丢掉它的请求、
    # 孤儿输出的一次性 abort。
    # 【边界】不碰 socket、不管客户端投递和引擎存活：结果放进 Outcome 交给 loop；指标照记；
    #   resync 重建和 Resume 的应用在 Recovery（recovery.py），
    #   它用这里的 start / advance / finished / forget。
    # 【协作者】DetokStage（把引擎 step、客户端离开、引擎事件交给它，按 Outcome 投递增量、
    #   发 abort）；Recovery；IncrementalDetokenizer；DetokMetrics。
    # [ZH-END]
    def __init__(self, tokenizer: Any, metrics: DetokMetrics):
        self.tokenizer, self.metrics = tokenizer, metrics
        self.token_texts = TokenTexts(tokenizer)
        self.requests: dict[str, RequestState] = {}
        self.by_client: dict[bytes, dict[str, None]] = {}
        """Engine request ids of each client's requests in flight, in the order they began."""
        self.resynced = False
        """The engine's resync arrived (set by `Recovery`): every request it holds is known here,
        so outputs of any other have no owner."""
        self._aborted_orphans: collections.OrderedDict[str, None] = collections.OrderedDict()

    # ------------------------------------------------------------------ a step

    def step(self, step: p.StepOutput) -> Outcome:
        # [ZH-START]
        # 1. started 行：为每个新请求 start，建好反分词器，客户端记进 Outcome.clients。
        # 2. rejected 行：按 meta.client / meta.client_request_id 生成错误增量（引擎拒绝的请求
        #    从这里告诉客户端）。
        # 3. outputs 行：逐行 advance，得到的增量按客户端放进 Outcome；整步的反分词耗时记一次指标。
        # [ZH-END]
        out = Outcome()
        for row in step.started:
            self.start(row.request_id, row.meta, step.instance_id, out)
        for row in step.rejected:
            out.add(row.meta.client, p.error_delta(row.meta.client_request_id, row.error))
        started = time.perf_counter()
        for row in step.outputs:
            state, delta = self.advance(row, out)
            if delta is not None:
                out.add(state.client, delta)
        if step.outputs:
            self.metrics.detokenize_seconds(time.perf_counter() - started)
        return out

    def start(self, request_id: str, meta: p.RequestMeta, engine: str, out: Outcome,
              resumed: bool = False) -> RequestState:
        # [ZH-START]
        # 1. 用 RequestMeta 建 IncrementalDetokenizer：prompt_tail（prompt 最后几个 token）和
        #    meta.sampling（文本侧的采样参数：stop、include_stop_str_in_output、min_tokens、
        #    skip_special_tokens）。
        # 2. 建 RequestState(客户端身份, 客户端 rid, 反分词器, 引擎实例) 记进 requests 和
        #    by_client；续写的流（meta.have_tokens / have_chars，客户端已有的输出）
        #    记为 skip_tokens / skip_chars：引擎会随第一个新 token 把它们再报告一次，advance 截掉；
        #    meta.reasoning_open（输出从思考块内开始）记下，之后每个增量都带上。
        # 3. 指标记录开始时间（resync 重建的额外记下恢复时间）；客户端记进 out.clients。
        # [ZH-END]
        detok = IncrementalDetokenizer(self.tokenizer, meta.sampling, prompt_tail=p.unpack_token_ids(meta.prompt_tail))
        client = meta.client
        state = self.requests[request_id] = RequestState(client, meta.client_request_id, detok, engine)
        state.skip_tokens, state.skip_chars = meta.have_tokens, meta.have_chars
        state.reasoning_open = meta.reasoning_open
        self.metrics.request_started(request_id, meta.arrival or time.time(), resumed_at=time.time() if resumed else None)
        self.by_client.setdefault(client, {})[request_id] = None
        out.clients.append(client)
        return state

    def advance(self, row: p.OutputRow, out: Outcome) -> tuple[RequestState | None, p.DeltaRow | None]:
        """The delta `row` makes for its client, with the request's state (None, None: nothing to
        send; it is held, or it is not ours). Aborts it needs go in `out`."""
        # [ZH-START]
        # 1. 一行 OutputRow：id、打包的 token、finished、reason、
        #    prompt / output / cached 数、error。
        # 2. 本地不认识这个请求（已结束、客户端已走、或比 resync 还早）：若引擎仍在生成且已 resync，
        #    就 abort 这个孤儿一次；返回 (None, None)。
        # 3. 解包 token，text = detok.add(token, finished)。
        # 4. 反分词器命中 stop string：把终止字段（STOP、此刻的 usage、命中的 stop string）
        #    存进 state.stopped（命中在引擎最后一行上、或重启后 resync 里引擎已因旧 abort
        #    结束的请求，也照 STOP 结束）；引擎还没结束就把它放进 out.aborts，
        #    这一行的文本照常发出，但终止增量要等引擎的最后一行（它确认已丢掉这个请求）到了才发——
        #    这样客户端收到终止增量后复用同一个 id，引擎里一定已经没有旧请求。
        #    已 stopped 的请求：引擎之后的非最后行不发送（超过 1 秒就再 abort 一次，
        #    防止上次没送到）；最后一行到了才结束。
        # 5. 已结束：final = state.stopped，或 Final(finish_reason, Usage(prompt_tokens,
        #    completion_tokens, cached_tokens))，有错误（或 reason 为 ERROR）加 error。
        # 6. awaiting_resume（resync 重建、客户端还没报到）：token、文本、final 都累积起来，不发送，
        #    返回 (state, None)；这期间的 logprobs 不保留（resync 的行本来就不带）。
        # 7. 有 skip_tokens / skip_chars（resume 时客户端已有、引擎将再报告的续写前缀）：
        #    先从 token 和文本开头截掉，截完什么都不剩且没结束就返回 (state, None)。
        #    引擎的 logprobs 对应行里最后那些 token（续写的第一行还重复了已有的输出，那些没有）：
        #    够每个要发的 token 一项就取最后那么多项，不够就不带。
        # 8. 否则组装增量 DeltaRow(客户端 rid, text, token_ids（原样打包）, reasoning_open，
        #    行里有 logprobs / prompt_logprobs 就由 _texts 配上每个 token 的文本和字节一起带上)，
        #    已结束就由 final.delta 带上终止字段；已结束就 finished（计指标、遗忘该请求）；
        #    返回 (state, 增量)，调用方按 state.client 路由。
        # [ZH-END]
        request_id, packed_ids, finished = row.request_id, row.token_ids, row.finished
        state = self.requests.get(request_id)
        if state is None:  # already ended here, orphaned (client gone), or older than our resync
            if not finished and self.resynced:
                self._abort_orphan(request_id, out)
            return None, None
        if state.stopped is not None:  # ended by its stop string; what the engine made since is not sent
            if not finished:
                if time.monotonic() - state.abort_sent_at > RESEND_ABORT_S:  # the abort may have found no room: again
                    self._abort_stopped(request_id, state, out)
                return state, None
            token_ids, packed_ids, text = [], b"", ""
            logprobs = prompt_logprobs = None
        else:
            logprobs, prompt_logprobs = self._texts(row.logprobs), self._texts(row.prompt_logprobs)
            token_ids = p.unpack_token_ids(packed_ids)
            text = state.detok.add(token_ids, finished)
            state.num_prompt, state.num_output = row.num_prompt_tokens, row.num_output_tokens
            if state.detok.stopped:  # its stop string ends it, on whichever row it completes
                state.stopped = _terminal(p.FinishReason.STOP, row)._replace(stop_reason=state.detok.stop_reason)
                if not finished:  # the end, once the engine confirms it dropped it
                    self._abort_stopped(request_id, state, out)
        final = None
        if finished and state.stopped is not None:
            final = state.stopped
        elif finished:
            final = _terminal(row.finish_reason, row)
            if row.error or row.finish_reason is p.FinishReason.ERROR:  # an abort may say why too (a drain ran out)
                final = final._replace(error=row.error or "the request failed in the engine")
        if state.awaiting_resume:  # hold everything until the client says what it has
            state.all_ids.extend(token_ids)
            state.all_text += text
            state.final = final
            return state, None
        if state.skip_tokens or state.skip_chars:  # what the client has already (see `skip_tokens`)
            n, m = min(state.skip_tokens, len(token_ids)), min(state.skip_chars, len(text))
            state.skip_tokens, state.skip_chars = state.skip_tokens - n, state.skip_chars - m
            token_ids, text = token_ids[n:], text[m:]
            packed_ids = p.pack_token_ids(token_ids)
            if not (token_ids or text or final):
                return state, None
        if token_ids:
            self.metrics.tokens_streamed(request_id, len(token_ids), time.time())
        if logprobs is not None:  # the engine's entries cover the row's last tokens: one per token sent, or none
            logprobs = logprobs[len(logprobs) - len(token_ids):] if len(logprobs) >= len(token_ids) else None
        if final is None:
            return state, p.DeltaRow(request_id=state.client_request_id, text=text, token_ids=packed_ids,
                                     reasoning_open=state.reasoning_open, logprobs=logprobs,
                                     prompt_logprobs=prompt_logprobs)
        self.finished(request_id, state, final.finish_reason)
        return state, final.delta(state.client_request_id, text, packed_ids, state.reasoning_open, logprobs,
                                  prompt_logprobs)

    def _texts(self, entries: list[p.TokenLogprobs] | None) -> list[p.TokenLogprob] | None:
        """The engine's logprob entries with each token's text and bytes (`TokenTexts`)."""
        if entries is None:
            return None
        texts = self.token_texts
        out = []
        for e in entries:
            text, raw = texts(e.token_id)
            top = []
            for t, lp in zip(e.top_token_ids, e.top_logprobs):
                top_text, top_raw = texts(t)
                top.append(p.TopLogprob(token_id=t, token=top_text, bytes=top_raw, logprob=lp))
            out.append(p.TokenLogprob(token_id=e.token_id, token=text, bytes=raw, logprob=e.logprob, rank=e.rank,
                                      top=top))
        return out

    def _abort_stopped(self, request_id: str, state: RequestState, out: Outcome) -> None:
        state.abort_sent_at = time.monotonic()
        out.aborts.append(request_id)

    def _abort_orphan(self, request_id: str, out: Outcome) -> None:
        """Abort, once, a request whose outputs have no owner here."""
        if request_id in self._aborted_orphans:
            return
        self._aborted_orphans[request_id] = None
        if len(self._aborted_orphans) > MAX_ABORTED_ORPHANS:
            self._aborted_orphans.popitem(last=False)
        out.aborts.append(request_id)

    # ------------------------------------------------------------------ ends

    def finished(self, request_id: str, state: RequestState, reason: p.FinishReason) -> None:
        """A terminal delta went (or is going) to the client: count it, forget the request."""
        self.metrics.request_finished(request_id, reason, state.num_prompt, state.num_output, time.time())
        self.forget(request_id)

    def forget(self, request_id: str) -> None:
        self.metrics.request_dropped(request_id)  # nothing left to free if it was counted as finished
        state = self.requests.pop(request_id, None)
        if state is not None:
            mine = self.by_client.get(state.client)
            if mine is not None:
                mine.pop(request_id, None)
                if not mine:
                    del self.by_client[state.client]

    def drop_client(self, identity: bytes) -> tuple[list[str], Outcome]:
        """The client is gone: its requests are forgotten. The client request ids it was told
        nothing about yet, and the aborts of those the engine still runs."""
        out, lost = Outcome(), []
        for request_id in self.by_client.pop(identity, ()):
            self.metrics.request_dropped(request_id)
            state = self.requests.pop(request_id, None)
            if state is not None:
                lost.append(state.client_request_id)
                if state.final is None:
                    out.aborts.append(request_id)
        return lost, out

    def fail(self, why: str, spare: str | None = None) -> Outcome:
        """End every request with an error (`why`), but those held by engine instance `spare`."""
        # [ZH-START]
        # 1. 遍历所有请求（持有它的引擎实例是 spare 的除外），生成错误增量（engine_dead=True），
        #    按客户端放进 Outcome，并 finished(..., ERROR)。
        #    例外：已被 stop string 结束、只差引擎确认、且不在等客户端 resume 的请求——
        #    文本已完整发出，照 STOP 结束（发它的 stopped 终止增量）。
        # 2. 调用方把每个客户端的增量立即发出（排在该客户端本轮已积累的增量之后）。
        # [ZH-END]
        out = Outcome()
        for request_id, state in list(self.requests.items()):
            if spare is not None and state.engine == spare:
                continue
            if state.stopped is not None and not state.awaiting_resume:  # its text is complete: it ended by its stop
                out.add(state.client, state.stopped.delta(state.client_request_id, reasoning_open=state.reasoning_open))
                self.finished(request_id, state, p.FinishReason.STOP)
            else:
                out.add(state.client, p.error_delta(state.client_request_id, why, engine_dead=True))
                self.finished(request_id, state, p.FinishReason.ERROR)
        return out

    def num_awaiting_resume(self) -> int:
        return sum(s.awaiting_resume for s in self.requests.values())

