"""A restarted detokenizer loses no stream: the engine's resync and each client's resume.

A new detokenizer asks the engine for every request it holds (`DetokHello` -> `Resync`, which
carries each request's output so far); the requests are rebuilt in `RequestStreams`, their output
held. Each client then says how much of each stream it already received (`Resume`) and the stream
continues from there; what no client claims within the resume window is aborted. Resumes that
arrive before the resync is complete wait here, bounded in rows for all clients together.

No sockets: each call returns an `Outcome` (deltas for the client, aborts for the engine) or the
resumes refused, for the loop to answer.
"""
# [ZH-START]
# 【模块定位】反分词进程重启后不丢流：引擎的 resync 和客户端的 resume。
#   新的反分词进程向引擎要回全部在途请求（DetokHello → Resync，带着每个请求至今的输出），
#   在 RequestStreams 里重建、输出先累积；
#   客户端说出每条流已收到多少（Resume），流从那里继续；resume 期限内没人认领的在引擎里 abort。
#   resync 完成前先到的 Resume 存在这里，所有客户端合计有行数上限。
# 不碰 socket：每个调用返回 Outcome（给客户端的增量、给引擎的 abort）
# 或被拒的 Resume，由 loop 去回答。
# [ZH-END]
from __future__ import annotations

import logging

from nanovllm_client import protocol as p

from .streams import Outcome, RequestStreams

log = logging.getLogger("detok_proc")

RESUME_INTERVAL_S = 1.0
"""A client sends one Resume per detokenizer it meets; one listing 65,536 streams costs ~0.1-0.3 s
to apply, so more than one a second from the same client is refused as a flood."""
MAX_EARLY_RESUME_ROWS = p.MAX_ROWS
"""Streams held from Resume frames that arrive before the engine's resync, all clients together: one
Resume may list up to MAX_ROWS, far more than an engine holds (its live and queued requests are
bounded by a few thousand), so anything beyond this is a flood, not clients resuming. Over it the
largest held Resumes go first: a client resuming a few streams is never crowded out by a bigger one."""
Refusals = list[tuple[bytes, str]]
"""Resumes refused: the client, and why."""


class Recovery:
    # [ZH-START]
    # 【职责】resync 重建（RequestStreams.resynced 在最后一帧置位）、
    # 客户端 Resume 的频率限制和应用、resume 期限、resync 前先到的 Resume。
    # 【边界】不碰 socket；请求状态本身在 RequestStreams；被拒的 Resume 只作为返回值，
    # 由 stage 计数并回 ErrorOutput。
    # 【协作者】DetokStage（交给它 Resync、Resume、超时检查，按结果投递和 abort）；RequestStreams。
    # [ZH-END]
    def __init__(self, streams: RequestStreams, resume_window_s: float, max_early_rows: int = MAX_EARLY_RESUME_ROWS):
        self.streams = streams
        self.resume_window_s = resume_window_s
        """How long requests rebuilt from a resync wait for their clients' resumes."""
        self.deadline = float("inf")
        self.max_early_rows = max_early_rows
        self.early: dict[bytes, list[p.ResumeRow]] = {}
        """Resumes that came before the resync was complete, the latest of each client."""
        self.last_resume: dict[bytes, float] = {}
        """When each client's last Resume came (a client sends one per detokenizer it meets)."""

    def on_resume(self, identity: bytes, rows: list[p.ResumeRow], now: float) -> tuple[Outcome, Refusals]:
        """A client's Resume: applied once the resync is complete, held until then, refused as a
        flood within RESUME_INTERVAL_S of its last. What to send and abort, and the resumes refused."""
        # [ZH-START]
        # 1. 同一客户端 1 秒内（RESUME_INTERVAL_S）第二个 Resume：拒绝（正常客户端每遇到一个新的
        #    反分词进程只发一次；一个 65,536 行的 Resume 要花 0.1–0.3 秒处理）。
        # 2. 已 resync：立刻 resume；还没 resync：hold 保存，返回它挤掉或放不下的 Resume。
        # [ZH-END]
        if now - self.last_resume.get(identity, float("-inf")) < RESUME_INTERVAL_S:
            return Outcome(), [(identity, f"a second resume within {RESUME_INTERVAL_S:.0f}s")]
        self.last_resume[identity] = now
        if self.streams.resynced:
            return self.resume(identity, rows), []
        return Outcome(), self.hold(identity, rows)

    def resync(self, msg: p.Resync, now: float) -> Outcome:
        # [ZH-START]
        # 1. 每个条目：已经在正常流式输出的（我们起来之后才开始的）跳过；否则 start(resumed=True)，
        #    标 awaiting_resume，把它至今的全部输出一次喂进 advance（一次解码完，结果累积不发）。
        # 2. 最后一帧：resynced = True，resume 期限 = now + resume_window_s；
        #    调用方随后应用 take_early 取出的先到的 Resume。
        # [ZH-END]
        streams, out = self.streams, Outcome()
        for entry in msg.entries:
            if entry.request_id in streams.requests:
                continue  # started after we came up: already streaming normally
            state = streams.start(entry.request_id, entry.meta, msg.instance_id, out, resumed=True)
            state.awaiting_resume = True
            streams.advance(entry.output, out)
        if msg.last:
            streams.resynced = True
            self.deadline = now + self.resume_window_s
            log.info("resynced with engine %s: %d request(s) await their clients", msg.instance_id,
                     streams.num_awaiting_resume())
        return out

    def resume(self, identity: bytes, rows: list[p.ResumeRow]) -> Outcome:
        """Continue each listed stream from what the client has; abort what it no longer wants."""
        # [ZH-START]
        # 1. mine = 该客户端的全部请求（按客户端 rid 索引），waiting = 其中等待 resume 的。
        # 2. 对客户端报上的每一行 [rid, 已收 token 数, 已收字符数]（同一 rid
        #    重复列出只处理第一次）：
        #    a. 不在 waiting 里：若客户端已收到过 token 而我们根本没有这个请求 → 错误增量（引擎已不
        #       持有它，标 engine_dead）；跳过；
        #    b. 在 waiting 里：清除等待标记，增量 = all_text[已收字符数:] 和 all_ids[已收 token
        #       数:]，已结束则带上 final；客户端报的比引擎至今报告的还多（引擎重启后续写的流：
        #       新引擎会把续写起点之前的输出随第一个新 token 再报告一次），多出的部分记为
        #       skip_tokens / skip_chars，advance 以后从输出里截掉，不重复发送；
        #       释放累积缓冲；已结束就 finished。
        # 3. 等待中但客户端没提到的请求：客户端已不要了 → _drop_unclaimed（未结束
        #    就在引擎里 abort）。
        # 4. 增量都在 Outcome 里给这个客户端，调用方作为 StreamOutput 发出（超过帧大小上限
        #    就按顺序拆成几帧）。
        # [ZH-END]
        streams, out = self.streams, Outcome()
        mine = {streams.requests[rid].client_request_id: rid for rid in streams.by_client.get(identity, ())}
        waiting = {client_rid: rid for client_rid, rid in mine.items() if streams.requests[rid].awaiting_resume}
        seen = set()
        for client_rid, num_tokens, num_chars in rows:  # ResumeRow: request_id, num_tokens, num_chars
            if client_rid in seen:  # listed twice: answered once
                continue
            seen.add(client_rid)
            request_id = waiting.pop(client_rid, None)
            if request_id is None:
                if num_tokens and client_rid not in mine:
                    out.add(identity, p.error_delta(client_rid, "the engine no longer holds this request (it restarted, "
                                                                "or the request ended too long ago)", engine_dead=True))
                continue
            state = streams.requests[request_id]
            state.awaiting_resume = False
            # More than the engine has reported: a continued stream, whose engine reports the output
            # it continues from again with its first new token. Cut that then.
            state.skip_tokens = max(0, num_tokens - len(state.all_ids))
            state.skip_chars = max(0, num_chars - len(state.all_text))
            text, token_ids = state.all_text[num_chars:], p.pack_token_ids(state.all_ids[num_tokens:])
            out.add(identity, state.final.delta(client_rid, text, token_ids, state.reasoning_open)
                    if state.final is not None else p.DeltaRow(request_id=client_rid, text=text, token_ids=token_ids,
                                                               reasoning_open=state.reasoning_open))
            state.all_ids, state.all_text = [], ""
            if state.final is not None:
                streams.finished(request_id, state, state.final.finish_reason)
        for request_id in waiting.values():  # the client no longer waits for these
            self._drop_unclaimed(request_id, out)
        return out

    def _drop_unclaimed(self, request_id: str, out: Outcome) -> None:
        """A request rebuilt from the resync that no client claimed: abort it if it runs, forget it."""
        state = self.streams.requests.get(request_id)
        if state is not None and state.final is None:
            out.aborts.append(request_id)
        self.streams.forget(request_id)

    def expire(self, now: float) -> Outcome:
        """Past the resume deadline, the requests still waiting for their clients are dropped."""
        out = Outcome()
        if now > self.deadline:
            self.deadline = float("inf")
            for request_id in [r for r, s in self.streams.requests.items() if s.awaiting_resume]:
                self._drop_unclaimed(request_id, out)
        return out

    def stalled(self, seconds: float) -> None:
        """We were not listening for `seconds`: the clients' resumes wait unread, that much longer."""
        self.deadline += seconds

    # ------------------------------------------------------------------ resumes before the resync

    def hold(self, identity: bytes, rows: list[p.ResumeRow]) -> Refusals:
        """Hold the client's resume (its latest only) until the resync is complete; the resumes
        refused to stay within `max_early_rows`, with why. The largest held go first, or this one
        if none is larger: a client resuming a few streams is never crowded out by a bigger one."""
        # [ZH-START]
        # 1. 先去掉该客户端之前那份；合计放不下这份时，丢掉比它大的、最大的那几份（各自的客户端收到
        #    拒绝原因），它自己最大就拒绝它自己并返回。
        # 2. 放得下就记下；返回被拒的 (客户端, 原因) 列表，由 stage 计数并回 ErrorOutput。
        # [ZH-END]
        refused = []
        self.early.pop(identity, None)
        held = sum(map(len, self.early.values()))
        while held + len(rows) > self.max_early_rows:
            largest = max(self.early, key=lambda k: len(self.early[k]), default=None)
            if largest is None or len(self.early[largest]) <= len(rows):
                refused.append((identity, f"a resume of {len(rows)} stream(s) while {held} wait for the "
                                          f"engine's resync: over the limit of {self.max_early_rows}"))
                return refused
            held -= len(self.early.pop(largest))
            refused.append((largest, f"a resume of {len(rows)} stream(s) came while {held} waited for the "
                                     f"engine's resync: the largest held resume was dropped"))
        self.early[identity] = rows
        return refused

    def forget_client(self, identity: bytes) -> None:
        self.early.pop(identity, None)
        self.last_resume.pop(identity, None)

    def take_early(self) -> dict[bytes, list[p.ResumeRow]]:
        """Every held resume, detached (applying one may find its client gone, which drops its entry)."""
        early, self.early = self.early, {}
        return early
