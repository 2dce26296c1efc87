"""The engine stage's request bookkeeping: which requests wait, which are live in the engine,
which ended lately; no sockets, no threads.

The step loop hands it each request the input thread received (`queue`), each abort (`abort`)
and each output of the engine's step (`record`), and asks it to admit what fits (`admit`); what
the detokenizer must hear of that comes back in one `StepMessages` (typed rows, filled as
requests start, are refused or end), which the output thread encodes. Admission keeps
`max_live` requests and `max_live_bytes` of them in the engine at most, each client within its
share (`ClientShares`), the clients taking turns (`FairQueue`: a client's flood delays another's
request by one of its own, not all of them); an abort takes a request out of the backlog at once, and one that
overtook its request on the control socket ends that request the moment it arrives.
"""
# [ZH-START]
# 【模块定位】引擎 stage 的请求记账，纯状态：没有 socket、没有线程。
#   主线程把输入线程收下的请求交给 queue、把 abort 交给 abort、把引擎每步的输出交给 record，
#   再让 admit 准入放得下的；反分词进程要知道的（开始、拒绝、结束）都记进同一个 StepMessages（带
#   名字的行），由输出线程编码发出。
#   准入闸门：引擎里最多 max_live 个、max_live_bytes 字节的请求，
#   每个客户端不超过它的份额（ClientShares），客户端轮流准入（FairQueue：一个客户端的洪水只让别人的
#   请求多等它的一个请求，而不是全部）；abort 把 backlog 里的请求立即拿出来；
#   比请求先到的 abort 先记下，请求一到就结束它。
# [ZH-END]
from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import Callable

from nanovllm.engine.llm_engine import LLMEngine, RequestOutput
from nanovllm.service.fair_queue import FairQueue
from nanovllm.service.stage import RejectLog
from nanovllm_client import protocol as p
from nanovllm_client.protocol import FinishReason

from .client_shares import ClientShares
from .ledger import FinishedRing, LiveRequest
from .output import StepMessages, output_row

log = logging.getLogger("engine_proc")

EARLY_ABORT_S = 60.0
"""How long an abort for a request the engine has not seen yet is kept: it came on the control
socket ahead of its request, which still waits in the tokenizer or in the input pipe."""
MAX_EARLY_ABORTS = 65_536
DRAINING = "the engine is draining (shutting down): it takes no new requests; retry on another instance or later"


@dataclass(slots=True)
class Queued:
    """A request received and not yet admitted: its frame decoded (the sampling struct checked,
    its response_format compiled by the input thread), its prompt still packed."""
    # [ZH-START]
    # 【职责】收到、还没准入的一个请求：帧已解开（采样参数已校验，response_format 已由输入线程
    # 编译，编译不过则 error 记下原因），prompt 仍是打包的字节，带着它的字节额度 nbytes
    # （帧长 + 每个 prompt token 和续写输出 token 40 字节），从排队一直记到请求结束。
    # 【边界】不做校验以外的事；准入、拒绝、abort 都由 Admission 决定。
    # 【协作者】Input._queued 创建；inbox / Admission.backlog 保存；Admission 的 admit、_add、
    # abort 和 dequeued 回调使用它的 nbytes。
    # [ZH-END]
    req: p.TokenizedReq
    error: str | None
    """Why it is refused before admission (its response_format does not compile), or None."""
    nbytes: int
    """Its charge against the byte budgets (`ledger.request_bytes`), held until it ends."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.req.prompt_token_ids) // 4


class Admission:
    # [ZH-START]
    # 【职责】请求在引擎 stage 里的一生：backlog（收到、未准入；FairQueue：每个客户端按到达顺序，
    # 客户端之间轮流，同一客户端内 priority 高的先）
    # → live（已加入引擎，记着 meta 和已输出 token）
    # → FinishedRing（结束后保留一分钟，供重启的反分词进程 resync）；
    # 还管字节额度、客户端份额、提前到达的 abort、stage 自己 abort 的原因（abort_notes）。
    # 【边界】不碰 socket、不开线程、不编码：要发的都放进调用方给的 StepMessages；
    # 输入线程那边的排队计数由 dequeued 回调退回（它在锁里）。只有主线程调用它。
    # 【协作者】EngineStage.run_once / drain；LLMEngine（add_request、abort）；ClientShares；
    # ledger 的 LiveRequest / FinishedRing。
    # [ZH-END]

    def __init__(self, max_live: int, max_live_bytes: int, shares: ClientShares, rejects: RejectLog,
                 dequeued: Callable[[Queued], None]):
        self.engine: LLMEngine | None = None
        """The LLMEngine, once loaded (requests are only queued before)."""
        self.max_live, self.max_live_bytes = max_live, max_live_bytes
        self.shares = shares
        """Each client's part of `max_live` and of the backlog (0: no per-client limit)."""
        self.rejects = rejects
        self.dequeued = dequeued
        """Called when a queued request leaves the backlog or is refused: the input thread's counts."""
        self.backlog: FairQueue[Queued] = FairQueue()
        """Requests received and not admitted, by client: the clients take turns at admission."""
        self.live: dict[str, LiveRequest] = {}
        """request id -> its meta and output so far, for every request added and not yet finished."""
        self.live_bytes = 0
        """The bytes charged to the requests in `live`."""
        self.finished = FinishedRing()
        self.early_aborts: collections.OrderedDict[str, float] = collections.OrderedDict()
        """Request id -> when its abort came, for aborts that overtook their request."""
        self.abort_notes: dict[str, str] = {}
        """Why the stage (not the client) aborted a request: sent with its last output."""

    def in_flight(self) -> list[str]:
        """Every request live or waiting."""
        return list(self.live) + list(self.backlog.keys())

    def resync_entries(self) -> list[p.ResyncEntry]:
        """Everything a new detokenizer needs: each live request's output so far, and those that
        ended lately."""
        return [p.ResyncEntry(meta=r.meta, output=r.output_row(rid)) for rid, r in self.live.items()] \
            + self.finished.values()

    def queue(self, queued: Queued, sent: StepMessages, draining: bool = False) -> None:
        # [ZH-START]
        # 1. draining 且这个 id 没见过：计数减一，以 DRAINING 原因记进 sent.rejected。
        # 2. id 已在 live / backlog 中，或是 resend 且在最近一分钟结束的请求里：
        #    忽略（第一次的那个有效）；不是 resend 的重复记为 "duplicate" 拒绝帧。计数减一。
        # 3. 这个客户端排队的已达 --max-queued-per-client：若它在引擎里的还没到
        #    --max-live-per-client（一批请求同时到，还没来得及准入），先 admit 再数一次；
        #    仍满 → 拒绝并说出限额。
        #    否则放进 backlog（FairQueue：排在它客户端的队尾，rank = priority）。
        # 4. 它的 abort 已经先到（early_aborts 里，且不超过 EARLY_ABORT_S）：立即 abort：
        #    请求刚加入就结束，开始和结束在同一条输出里发出。
        # [ZH-END]
        req = queued.req
        rid = req.request_id
        if draining and rid not in self.live and rid not in self.backlog:
            self.dequeued(queued)
            sent.rejected.append(p.RejectedRow(request_id=rid, meta=req.meta, error=DRAINING))
            return
        # A resend (the client's tokenizer restarted) of a request that got through after all,
        # or a client reusing an id that is still live: the first one stands.
        if rid in self.live or rid in self.backlog or (req.resend and rid in self.finished):
            if not req.resend:
                self.rejects("duplicate", f"request id {rid!r} is already live; the new request is ignored")
            self.dequeued(queued)
            return
        why = self.shares.refusal(_client(req))
        if why is not None and self.shares.may_go_live(_client(req)):
            # Its queued share is full but its live share is not (its requests came in one batch,
            # before any could be admitted): admit first, then count what still waits.
            self.admit(sent)
            why = self.shares.refusal(_client(req))
        if why is not None:  # one client may not fill the backlog every client shares
            self.dequeued(queued)
            sent.rejected.append(p.RejectedRow(request_id=rid, meta=req.meta, error=why))
            return
        self.backlog.push(_client(req), rid, queued, rank=req.priority)
        self.shares.queued(_client(req))
        aborted_at = self.early_aborts.pop(rid, None)
        if aborted_at is not None and time.monotonic() - aborted_at < EARLY_ABORT_S:
            self.abort(rid, sent)  # its abort overtook it on the control socket

    def admit(self, sent: StepMessages) -> None:
        """Admit queued requests, the clients taking turns, while the live ones stay within
        `max_live` and `max_live_bytes` (one is always admitted when none is live, whatever its
        size), passing over clients that have their share live: they wait, the others do not."""
        # [ZH-START]
        # 1. live 不到 max_live 个时，backlog.peek 按客户端轮流给出下一个请求（跳过 live 份额已满的
        #    客户端；同一客户端内 priority 高的先）；没有就停。
        # 2. 已有 live 请求且加上它会超过 max_live_bytes：停（没有 live 时总放一个，不管多大）。
        # 3. backlog.take 取走（它的客户端排到轮转队尾），退回客户端的排队份额和输入线程的
        #    排队计数（dequeued），_add 加入引擎。
        # [ZH-END]
        while self.backlog and len(self.live) < self.max_live:
            head = self.backlog.peek(self.shares.may_go_live)
            if head is None:
                return
            rid, queued = head
            if self.live and self.live_bytes + queued.nbytes > self.max_live_bytes:
                return
            self.backlog.take(rid)
            self.shares.unqueued(_client(queued.req))
            self.dequeued(queued)
            self._add(queued, sent)

    def _add(self, queued: Queued, sent: StepMessages) -> None:
        # [ZH-START]
        # 1. 采样参数是解帧时校验过的 req.sampling；输入线程编译 response_format 失败的
        #    （queued.error）直接走第 3 步。
        # 2. 此时才把打包的 prompt 解成 list，engine.add_request(id, prompt ids, params, priority,
        #    output_prefix, client = _client(req)，"fair" 调度策略按它轮流)；
        #    output_prefix 是续写时客户端已收到的输出（引擎死后发给新引擎），
        #    它随第一个新 token 一起再报告一次。
        # 3. 失败：ValueError / TypeError 是请求本身的问题（参数、超过 max_model_len、
        #    永远放不进 KV cache、词表外 id），其他异常额外记 traceback；都作为 RejectedRow(id,
        #    meta, 错误) 发出，并以 FinishReason.ERROR 条目记进 FinishedRing，
        #    resync 时也知道它已结束。
        # 4. 成功：_go_live 记进 live（连同它的字节额度），sent.started 加 StartedRow(id, meta)——
        #    反分词进程在同一条有序管道上先拿到 meta，再拿到第一个 token。
        # [ZH-END]
        req, error = queued.req, queued.error
        if error is None:
            try:
                self.engine.add_request(req.request_id, p.unpack_token_ids(req.prompt_token_ids), req.sampling,
                                        priority=req.priority, output_prefix=p.unpack_token_ids(req.output_ids),
                                        client=_client(req))
            except Exception as e:  # refused (ValueError/TypeError) or failed: either way this request's own
                error = refusal(e, req.request_id)
        if error is not None:
            sent.rejected.append(p.RejectedRow(request_id=req.request_id, meta=req.meta, error=error))
            ended = RequestOutput(request_id=req.request_id, new_token_ids=[], finished=True,
                                  finish_reason=FinishReason.ERROR, num_prompt_tokens=queued.num_prompt_tokens,
                                  error=error)
            self.finished.add(p.ResyncEntry(meta=req.meta, output=output_row(ended)))
            return
        self._go_live(queued)
        sent.started.append(p.StartedRow(request_id=req.request_id, meta=req.meta))

    def _go_live(self, queued: Queued) -> None:
        self.live[queued.req.request_id] = LiveRequest(meta=queued.req.meta, nbytes=queued.nbytes,
                                                       client=_client(queued.req))
        self.live_bytes += queued.nbytes
        self.shares.went_live(_client(queued.req))

    def abort(self, request_id: str, sent: StepMessages) -> None:
        # [ZH-START]
        # 1. 不在 backlog：在 live 里就 engine.abort(id)（幂等；最终输出由下一步产生）；
        #    也不在 live、不在 FinishedRing：请求还没到（abort 走 control socket 超过了它），
        #    _remember_early_abort 记下。
        # 2. 在 backlog（从未准入）：移出、计数和字节额度退回（shares.unqueued：它的客户端少算一个
        #    排队的）；记进 live 并加入 started，再合成一个
        #    RequestOutput(finished=True, FinishReason.ABORT, prompt 长度) 放进 sent.outputs
        #    并 record——
        #    开始和结束在同一条输出里发出，客户端立刻得到终止增量，abort 不必等准入。
        # [ZH-END]
        queued = self.backlog.remove(request_id)
        if queued is None:
            if request_id in self.live:
                self.engine.abort(request_id)  # idempotent; its final output comes from the next step
            elif request_id not in self.finished:
                self._remember_early_abort(request_id)
            return
        # Never admitted: it starts and ends in this message, so its client still gets a terminal delta.
        self.shares.unqueued(_client(queued.req))
        self.dequeued(queued)
        self._go_live(queued)
        sent.started.append(p.StartedRow(request_id=request_id, meta=queued.req.meta))
        out = RequestOutput(request_id=request_id, new_token_ids=[], finished=True, finish_reason=FinishReason.ABORT,
                            num_prompt_tokens=queued.num_prompt_tokens)
        sent.outputs.append(out)
        self.record(out)

    def _remember_early_abort(self, request_id: str) -> None:
        """An abort for an id not seen yet: keep it (at most `MAX_EARLY_ABORTS`, for `EARLY_ABORT_S`)
        for the request it overtook; one never sent (a client's stray abort) just expires."""
        now = time.monotonic()
        early = self.early_aborts
        early.pop(request_id, None)
        early[request_id] = now
        while early and (len(early) > MAX_EARLY_ABORTS or now - next(iter(early.values())) >= EARLY_ABORT_S):
            early.popitem(last=False)

    def record(self, out: RequestOutput) -> None:
        """Keep what a resync needs: the output so far, and the whole request once it ends."""
        # [ZH-START]
        # 1. 不在 live 里的输出忽略。
        # 2. 已结束且 abort_notes 里有它的原因（例如 drain 超时）→ 把原因写进 out.error。
        # 3. 追加新 token，更新 (prompt, output, cached) 计数。
        # 4. 已结束：移出 live、退回它的字节额度、shares.ended 让它的客户端少算一个在引擎里的请求，
        #    把完整的 ResyncEntry(meta, output = 全部 token 的 OutputRow：结束原因、计数、error)
        #    记进 FinishedRing。
        # [ZH-END]
        live = self.live.get(out.request_id)
        if live is None:
            return
        if out.finished and out.request_id in self.abort_notes:
            out.error = self.abort_notes.pop(out.request_id)
        live.tokens.extend(out.new_token_ids)
        live.last = out
        if out.finished:
            del self.live[out.request_id]
            self.live_bytes -= live.nbytes
            self.shares.ended(live.client)
            self.finished.add(p.ResyncEntry(meta=live.meta, output=live.output_row(out.request_id)))


def _client(req: p.TokenizedReq) -> str:
    """The client a request counts as: the tenant its tokenizer named (an HTTP front's API key, a
    CURVE key, a routing id), else its routing identity."""
    return req.tenant or req.meta.client.hex()


def refusal(e: Exception, request_id: str) -> str:
    """Why a request was refused: ValueError / TypeError are the request's own fault (its
    parameters, its size); anything else is a failure, logged with its traceback."""
    if isinstance(e, (ValueError, TypeError)):
        return p.clip(str(e))
    log.error("adding request %r failed", request_id, exc_info=e)
    return p.clip(f"{type(e).__name__}: {e}")
