"""Speculative decoding without a draft model: n-gram (prompt lookup) proposals and the rule that
decides how many drafted tokens a request verifies in a step.

A proposal never changes what a request outputs: the engine scores the drafted tokens together
with the request's last token (k+1 decode rows of one sequence, one forward) and keeps only the
drafts that equal what greedy sampling picks at each position (`Scheduler.settle`). A proposal
only changes how many tokens a step yields, and what the step costs.

On CPU verifying is not free: with the default model a step of k+1 rows of one sequence costs
about 1 + 0.55 k times a 1-row step (`bench/spec_verify_cost.py`, docs/benchmarks.md). So each
request keeps an estimate `a` of the chance that a drafted token is accepted, and drafts the k
that maximises expected tokens per step over cost, (1 + a + ... + a^k) / (1 + row_cost k), or
nothing when no k beats 1. A request that does not draft still checks its would-be first
drafted token against the token it then gets (a free observation), so its estimate can recover.
"""
# [ZH-START]
# 【模块定位】无草稿模型的投机解码：n-gram（prompt lookup）提议 + 每个请求每步草稿长度的决策。
# 在引擎一步之内的位置：
#   Scheduler.schedule ─_add_drafts：纯解码步、行数还有余量时
#     → Speculator.draft(seq.spec, token_ids, 上限)
#     → ScheduledSeq.draft（k 个草稿 token）→ StepInput 把它展开成 k+1 个 decode 行
#     → ModelRunner 一次前向 → Sampler（greedy argmax，每行一个 token）
#     → Scheduler.settle：逐位比较，接受最长相同前缀，再多一个模型自己的 token；
#       被拒的草稿占的块退回 BlockManager（trim），Speculator.record 更新接受率。
# 整个服务：客户端 → 分词进程 → 引擎进程（本模块在这里）→ 反分词进程 → 客户端。
# 提议只影响一步产出几个 token 和这一步的代价，不影响输出内容（验证保证逐 token 相同）。
# [ZH-END]
from __future__ import annotations

from dataclasses import dataclass, field


class NgramIndex:
    """Where each n-gram (min_n..max_n tokens) of one token list last ended, kept up to date as
    the list grows. The n-grams that end at the list's last token are not indexed yet, so the
    list's own suffix is looked up among earlier occurrences only."""
    # [ZH-START]
    # 【职责】一个请求（prompt + 输出）的 n-gram 索引：ends[n-gram 元组] = 它最近一次出现之后的
    # 下标，只追加、增量维护；propose 用最后 n 个 token（n 从 max_n 往下到 min_n）查最近一次
    # 更早的出现，把其后的 k 个 token 作为草稿。
    # 【边界】不知道接受率、不决定草稿长度（Speculator 的事）；token 只会被追加（被拒的草稿从不
    # 写进 token_ids），所以索引永远不需要回滚。
    # 【协作者】Speculator.draft 调 propose；索引挂在 SpecState 上，随 Sequence.spec 一起走。
    # [ZH-END]
    __slots__ = ("min_n", "max_n", "ends", "indexed")

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.ends: dict[tuple[int, ...], int] = {}
        self.indexed = 0
        """n-grams ending before this index are in `ends`."""

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of
        `tokens` (max_n down to min_n tokens) seen before; [] when no suffix was seen."""
        # [ZH-START]
        # 1. 先把索引补到 len(tokens) - 1：对每个结束下标 j ∈ [indexed, L-1]、每个 n ∈
        #    [min_n, max_n]（j >= n），ends[tokens[j-n:j]] = j（后写的覆盖先写的 → 最近一次）。
        #    以最后一个 token 结尾的 n-gram 不入索引，所以查到的一定是更早的出现。
        # 2. n 从 max_n 到 min_n：后缀 tokens[L-n:] 在 ends 里 → 返回 tokens[end:end+k]
        #    （end <= L-1，至少一个 token；续写可以和后缀重叠，重复的文本正是这样被提议的）。
        # 3. 都查不到 → []。
        # [ZH-END]
        last = len(tokens) - 1
        for j in range(max(self.indexed, self.min_n), last + 1):
            for n in range(self.min_n, min(self.max_n, j) + 1):
                self.ends[tuple(tokens[j - n:j])] = j
        self.indexed = max(self.indexed, last + 1)
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            end = self.ends.get(tuple(tokens[len(tokens) - n:]))
            if end is not None:
                return tokens[end:end + k]
        return []


@dataclass(slots=True, eq=False)  # a holder of mutable state
class SpecState:
    """What speculation keeps of one request: its n-gram index, its acceptance estimate, and the
    first token of the proposal it did not draft (checked against the token it then got)."""
    index: NgramIndex
    acceptance: float
    """Estimated chance that a drafted token is accepted (an exponential moving average)."""
    shadow: int | None = None
    """The first token of last step's proposal when it drafted nothing."""


@dataclass(slots=True)
class SpecCounters:
    """Totals since the engine started (vLLM's spec_decode metrics)."""
    num_drafts: int = 0
    """Steps in which a request verified drafted tokens."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    """accepted_per_position[i]: drafts whose (i+1)-th token was accepted."""


class Speculator:
    """Proposes drafted tokens for plain greedy requests and learns, per request, how far its
    proposals are right. The scheduler asks it for a draft; `settle` tells it what was accepted."""
    # [ZH-START]
    # 【职责】为请求提草稿（NgramIndex；Scheduler 只为 plain greedy 的请求来问），
    # 按每个请求的接受率估计 a 和每多一行的代价 row_cost 选草稿长度 k
    # （最大化 (1 + a + … + a^k) / (1 + row_cost·k)，不超过 1 就不草稿）；
    # 记录接受结果，累计指标 counters。
    # 【边界】不分配块、不决定一步能放几行（Scheduler._add_drafts 给出上限）；不验证草稿
    # （Scheduler.settle 逐位比较）；不看请求的采样参数。
    # 【协作者】Scheduler 调 new_state / draft / record / observe（状态挂在 Sequence.spec 上）；
    # LLMEngine.stats 读 counters。
    # [ZH-END]
    ALPHA = 0.25
    """Weight of one observation in the acceptance estimate."""
    PRIOR = 0.75
    """A new request's acceptance estimate: high enough that it tries."""

    def __init__(self, max_tokens: int, min_n: int, max_n: int, row_cost: float):
        self.max_tokens = max_tokens
        self.min_n, self.max_n = min_n, max_n
        self.row_cost = row_cost
        """A verification row's cost beyond the first, as a share of a 1-row step."""
        self.counters = SpecCounters(accepted_per_position=[0] * max_tokens)

    def new_state(self) -> SpecState:
        """A request's state when it first may draft: an empty index and the prior estimate."""
        return SpecState(NgramIndex(self.min_n, self.max_n), self.PRIOR)

    def draft(self, state: SpecState, tokens: list[int], limit: int) -> list[int]:
        """The tokens a request whose tokens are `tokens` verifies this step (at most `limit`,
        possibly none). Only plain greedy requests draft: the caller checks that."""
        # [ZH-START]
        # 1. limit <= 0 → []。
        # 2. k = best_length(state.acceptance, min(limit, max_tokens))；proposal = 索引提议的
        #    max(k, 1) 个 token。
        # 3. k == 0（不划算）：记下 proposal 的第一个 token 作 shadow，下一步拿真实 token 对照
        #    （observe），接受率因此能回升；返回 []。
        # 4. 否则返回 proposal[:k]（提议可能比 k 短，也可能为空）。
        # [ZH-END]
        if limit <= 0:
            return []
        k = self.best_length(state.acceptance, min(limit, self.max_tokens))
        proposal = state.index.propose(tokens, max(k, 1))
        if k == 0:
            state.shadow = proposal[0] if proposal else None
            return []
        state.shadow = None
        return proposal[:k]

    def best_length(self, acceptance: float, limit: int) -> int:
        """The draft length with the most expected tokens per unit of step cost, 0 if none beats
        a plain decode step."""
        best_k, best = 0, 1.0
        expected, term = 1.0, 1.0
        for k in range(1, limit + 1):
            term *= acceptance
            expected += term
            ratio = expected / (1.0 + self.row_cost * k)
            if ratio > best:
                best_k, best = k, ratio
        return best_k

    def record(self, state: SpecState, drafted: int, accepted: int) -> None:
        """A verification of `drafted` tokens of a request kept `accepted` of them."""
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += drafted
        c.num_accepted_tokens += accepted
        for i in range(accepted):
            c.accepted_per_position[i] += 1
        for _ in range(accepted):
            state.acceptance += self.ALPHA * (1.0 - state.acceptance)
        if accepted < drafted:
            state.acceptance -= self.ALPHA * state.acceptance

    def observe(self, state: SpecState, token: int) -> None:
        """A plain decode step of a request produced `token`: check last step's undrafted proposal."""
        if state.shadow is None:
            return
        hit = token == state.shadow
        state.acceptance += self.ALPHA * ((1.0 if hit else 0.0) - state.acceptance)
        state.shadow = None
