"""Scheduling policies: the order in which waiting requests are admitted and running ones preempted.

A policy is one sort key over sequences: the scheduler admits waiting sequences smallest key
first, gives running sequences their share of the step's token budget in key order, and under KV
memory pressure preempts the running sequence with the largest key first. One key for both
keeps the two decisions consistent (what is admitted first is preempted last).

- `FCFSPolicy` (default): arrival order, so preemption takes the latest arrival.
- `PriorityPolicy`: higher `priority` first, arrival order among equals; preemption takes the
  lowest priority first.
- `FairPolicy`: clients (`Sequence.client`) take turns, one request each (start-time fair
  queuing); a client's own requests in arrival order; preemption takes the request furthest
  ahead of its client's fair share. With a single client it orders exactly as FCFS. The service's
  engine stage uses it by default.

Custom policies subclass `SchedulerPolicy` and pass an instance as `scheduler_policy`. A key is
read when a sequence enters the waiting queue and on each step for running ones, so it must not
change while the request lives (key on `arrival`, `priority`, `num_prompt_tokens`, `params`).
"""
# [ZH-START]
# 【模块定位】调度策略：waiting 里谁先被接纳、running 里谁先分到 token 预算、显存不够时谁先被抢占。
# 在引擎一步之内的位置：
#   LLMEngine.step → Scheduler.schedule ─policy.key(seq)→ 排序（接纳 / 分预算 / 抢占）
#                  → ModelRunner.run → Sampler → Scheduler.advance / settle
# 整个服务：客户端 → 分词进程 → 引擎进程（本模块在这里）→ 反分词进程 → 客户端。
# 只有一个排序键 key(seq)：键小的先接纳、后抢占；键大的后接纳、先抢占。
# 一个键管两件事，两者就不会矛盾——最先接纳的最后被踢。
#   FCFSPolicy：(arrival,)      PriorityPolicy：(-priority, arrival)
#   FairPolicy：(fair_tag, arrival)——按客户端轮流（start-time fair queuing），
#   只有一个客户端时等于 FCFS。
# [ZH-END]
from __future__ import annotations

from abc import ABC, abstractmethod

from nanovllm.engine.sequence import Sequence


class SchedulerPolicy(ABC):
    # [ZH-START]
    # 职责：抽象基类，只规定 `key(seq) -> tuple`，给出顺序。
    # 不做的事：不看 KV 块、不看 token 预算，也不修改 Sequence。
    # 和谁打交道：只被 Scheduler 调用（入 waiting 堆时一次，每步给 running 排序时一次）。
    # 约束：键在请求存活期间不能变（只基于 arrival、priority、num_prompt_tokens、params），
    # 否则已经入堆的顺序就失效了。
    # [ZH-END]
    name: str = "custom"

    @abstractmethod
    def key(self, seq: Sequence) -> tuple:
        """Smaller is admitted earlier and preempted later."""

    def admitted(self, seq: Sequence) -> None:
        """The scheduler moved `seq` from waiting to running (a policy with a clock of its own
        advances it here)."""


class FCFSPolicy(SchedulerPolicy):
    # [ZH-START]
    # 先来先服务（默认）：key 就是 (seq.arrival,)——add_request 时递增分配的到达序号，越小越早到。
    # Scheduler 的 waiting 堆条目是 (key, 插入序号, seq)，running 按 key 升序排；抢占从 running 末尾
    # pop，所以被踢掉的总是最晚到达的序列。
    # [ZH-END]
    name = "fcfs"

    def key(self, seq: Sequence) -> tuple:
        return (seq.arrival,)


class PriorityPolicy(SchedulerPolicy):
    # [ZH-START]
    # 优先级调度：priority 大的先接纳；同优先级内按到达顺序。抢占时先踢优先级最低、到达最晚的。
    # priority 由 add_request(priority=...) 给出（整数，默认 0）。
    # [ZH-END]
    name = "priority"

    def key(self, seq: Sequence) -> tuple:
        # [ZH-START]
        # 1. 第一项取 -priority：堆是最小堆，-priority 越小即 priority 越大 → 越先接纳、越晚被抢占。
        # 2. 第二项 arrival：同优先级内先来先服务。
        # 3. 返回 (-priority, arrival)。例：priority 5 的请求即使晚到，
        #    也排在所有 priority 0 的前面。
        # [ZH-END]
        return (-seq.priority, seq.arrival)


class FairPolicy(SchedulerPolicy):
    """Start-time fair queuing across clients, one request one unit of work. Each request gets a
    virtual start time once, when the policy first sees it: its client's next free slot, but never
    earlier than the virtual time now (the start time of the latest request admitted), so a client
    that was idle cannot claim the turns it missed. A client with a thousand requests waiting
    holds start times now .. now + 999; another client's one request gets now and goes next."""
    # [ZH-START]
    # 【职责】按客户端公平轮流：每个请求第一次被看到时得到一个虚拟开始时间 fair_tag =
    # max(当前虚拟时间, 它客户端的下一个空位)，之后不变；key = (fair_tag, arrival)。
    # 当前虚拟时间 = 最近被接纳的请求的 fair_tag（admitted 推进），所以闲了一阵的客户端
    # 不能补回错过的轮次。排了 1000 个请求的客户端占着 now..now+999，别的客户端的一个请求拿到 now，
    # 下一个就轮到它；抢占先踢 fair_tag 最大的（离自己份额最远的）。只有一个客户端时就是 FCFS。
    # 【边界】只看 seq.client；不知道客户端是谁、不限额（限额在引擎 stage 的 ClientShares）。
    # 【协作者】Scheduler（add / 每步排序时读 key，接纳时调 admitted）；
    # LLMEngine.add_request 给出 client。
    # [ZH-END]
    name = "fair"

    def __init__(self) -> None:
        self._now = 0
        """The virtual time: the start time of the latest request admitted."""
        self._next: dict[str, int] = {}
        """Client -> the start time its next request gets. Entries at most one turn ahead of `_now`
        are dropped now and then: such a client loses at most one turn, and a client with a
        request each (the common case) leaves nothing behind."""
        self._kept = 0
        """Entries left by the last pruning of `_next`."""

    def key(self, seq: Sequence) -> tuple:
        # [ZH-START]
        # 1. seq.fair_tag 还没有：tag = max(_now, 它客户端的 _next)，客户端的 _next = tag + 1，
        #    写进 seq.fair_tag（之后不再变，抢占回到 waiting 时也用同一个）。
        # 2. _next 条目超过 64 且比上次清理时多出一倍：丢掉最多领先 _now 一轮的条目（这样的客户端
        #    至多少等一轮），每次只有一个请求的客户端不留下状态。
        # 3. 返回 (fair_tag, arrival)。
        # [ZH-END]
        if seq.fair_tag is None:
            tag = max(self._now, self._next.get(seq.client, 0))
            self._next[seq.client] = tag + 1
            seq.fair_tag = tag
            if len(self._next) > 64 and len(self._next) > 2 * self._kept:
                self._next = {c: t for c, t in self._next.items() if t > self._now + 1}
                self._kept = len(self._next)
        return (seq.fair_tag, seq.arrival)

    def admitted(self, seq: Sequence) -> None:
        self._now = max(self._now, seq.fair_tag or 0)


POLICIES: dict[str, type[SchedulerPolicy]] = {"fcfs": FCFSPolicy, "priority": PriorityPolicy, "fair": FairPolicy}


def make_policy(policy: str | SchedulerPolicy | None) -> SchedulerPolicy:
    """A policy from its name ("fcfs", "priority"), an import path of a `SchedulerPolicy`
    subclass ("package.module:Class"), an instance, or None for FCFS."""
    # [ZH-START]
    # 1. None → FCFSPolicy()。
    # 2. 已经是 SchedulerPolicy 实例 → 原样返回。
    # 3. 含 ":" 的字符串（"package.module:Class"）→ plugins.load_object 导入；
    #    导入结果不是 SchedulerPolicy 的子类 → ValueError，否则无参实例化返回。
    # 4. 其它：必须是 POLICIES 里的名字（"fcfs" / "priority"），否则 ValueError 列出所有可选写法。
    # 5. 返回 POLICIES[policy]() 的新实例。
    # [ZH-END]
    if policy is None:
        return FCFSPolicy()
    if isinstance(policy, SchedulerPolicy):
        return policy
    if isinstance(policy, str) and ":" in policy:
        from nanovllm.plugins import load_object

        cls = load_object(policy, "scheduler policy")
        if not (isinstance(cls, type) and issubclass(cls, SchedulerPolicy)):
            raise ValueError(f"scheduler policy {policy!r} is not a SchedulerPolicy subclass")
        return cls()
    if policy not in POLICIES:
        raise ValueError(f"scheduler_policy must be one of {sorted(POLICIES)}, package.module:Class or a "
                         f"SchedulerPolicy, got {policy!r}")
    return POLICIES[policy]()
