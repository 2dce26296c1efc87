"""The detokenizer's view of the engine: which instance it follows and whether that one lives.

The engine heartbeats every 0.25 s and names itself in every message. The first instance heard
is followed; outputs from any other are a dead engine's leftovers or a forgery and are dropped.
A new instance in a heartbeat means the old one died (a restart): the old one's requests end.
The followed engine is dead when it says so, when its connection closes, or when it stays
silent for `timeout_s` with nothing of it waiting unread.

No sockets: each method updates the view and returns an `EngineEvent` saying what the loop must
do about it (end requests, tell every client, count a rejected frame).
"""
# [ZH-START]
# 【模块定位】反分词进程眼中的引擎：跟随哪个实例、它是否活着。
#   引擎每 0.25 秒心跳，每条消息都带实例 id；跟随第一个听到的实例，别的实例的输出（死去引擎的残留或
#   伪造）丢弃；心跳里出现新实例 = 旧实例死了（重启）：旧实例的请求结束。
#   跟随的引擎自己说要死、连接断开、或安静超过 timeout_s 且 socket 里没有它未读的帧 → 判死。
# 不碰 socket：每个方法更新状态，返回 EngineEvent，告诉 loop 该做什么（结束请求、
# 通知所有客户端、记拒绝帧）。
# [ZH-END]
from __future__ import annotations

import logging
from typing import Any, NamedTuple

from nanovllm.metrics import DetokMetrics
from nanovllm_client import protocol as p

log = logging.getLogger("detok_proc")


class EngineEvent(NamedTuple):
    """What news of the engine asks of the loop (an empty event: nothing)."""
    # [ZH-START]
    # 【职责】引擎消息或超时带来的结果：要以什么原因结束哪些请求（fail，spare 实例的除外）、
    # 要向所有客户端广播的 EngineStatus、
    # 或这条消息来自不跟随的实例（foreign，loop 记拒绝帧并丢弃）。空事件表示什么都不用做。
    # [ZH-END]
    fail: str = ""
    """End the requests in flight with this error..."""
    spare: str | None = None
    """...except those held by this engine instance (the one that replaced the old)."""
    announce: p.EngineStatus | None = None
    """Tell every client this."""
    foreign: str = ""
    """The message came from an engine we do not follow and was ignored: what, for the rejection log."""


class EngineWatch:
    # [ZH-START]
    # 【职责】跟随的引擎实例、alive（None：还没听到就绪的引擎 / 加载中）、状态、运行时长、统计、
    # 最近一次听到它的时间；判断重启和死亡，返回 EngineEvent。
    # 【边界】不发送、不持有请求；"socket 里有没有未读帧" 由 loop 查（overdue 之后）。
    # 【协作者】DetokStage 把引擎消息、连接事件、超时检查交给它，按 EngineEvent 结束请求、
    # 广播 EngineStatus、记拒绝帧。
    # [ZH-END]
    def __init__(self, timeout_s: float, metrics: DetokMetrics):
        self.timeout_s, self.metrics = timeout_s, metrics
        self.instance = ""
        """The engine instance followed; "" until one is heard."""
        self.alive: bool | None = None
        """None until a ready engine is heard from (a stage that just started knows nothing yet;
        a loading engine is not dead)."""
        self.state = ""
        """The engine's state from its last message: "", loading, ready or draining."""
        self.uptime_s = 0.0
        self.stats: dict[str, Any] = {}
        self.last_seen = 0.0

    def heard(self, now: float) -> None:
        """Any accepted message from the engine socket: it is not silent."""
        self.last_seen = now

    def status(self, msg: p.EngineStatus) -> EngineEvent:
        # [ZH-START]
        # 1. 记下引擎统计和运行时长（stats 请求会返回它们）。
        # 2. alive=True → speaks(实例 id, 状态)。
        # 3. alive=False 且来自我们跟随的实例（或还没跟随任何实例）→ dead(原因)；
        #    别的实例的、或不带实例 id 的死亡通知（伪造）→ 事件带 foreign，不予理会。
        # [ZH-END]
        self.stats, self.uptime_s = msg.stats, msg.uptime_s
        if msg.alive:
            return self.speaks(msg.instance_id, msg.state)
        if msg.instance_id and (not self.instance or msg.instance_id == self.instance):
            return self.dead(msg.reason or "engine shut down")
        # another instance's death is no news of ours; one that names none is a forgery
        return EngineEvent(foreign=f"a death notice from engine {msg.instance_id!r}, following {self.instance or 'none yet'}")

    def outputs(self, instance_id: str) -> EngineEvent:
        """Outputs count only from the engine instance we follow (a stage that just started follows
        the first one it hears). Another instance's outputs are a dead engine's leftovers or a
        forgery: dropped (`foreign`), not taken as a restart; a new engine announces itself in its
        heartbeats."""
        if self.instance and instance_id != self.instance:
            return EngineEvent(foreign=f"outputs from engine {instance_id}, following {self.instance}")
        return self.speaks(instance_id)

    def speaks(self, instance_id: str, state: str | None = None) -> EngineEvent:
        """A live message from engine `instance_id` (`state` from its heartbeat; outputs mean it is
        at least ready): a new instance means the old one died."""
        # [ZH-START]
        # 1. 实例 id 与跟随的不同：若之前跟随过别的实例，记一次引擎重启，事件要求旧实例的所有请求以
        #    "engine restarted" 报错（fail，spare = 新实例）；改为跟随新实例。
        # 2. 没带状态（来自输出）时，有输出说明至少是 ready：沿用 ready / draining，否则设为 ready。
        # 3. alive = loading 时为 None（加载中不算死），否则 True；(alive, state) 有变化就记日志，
        #    事件要求向所有客户端广播 EngineStatus。
        # [ZH-END]
        fail = ""
        if instance_id != self.instance:
            if self.instance:
                self.metrics.stage_restart_seen("engine")
                fail = f"engine restarted (instance {instance_id} replaced {self.instance})"
            self.instance = instance_id
        if state is None:
            state = self.state if self.state in ("ready", "draining") else "ready"
        alive = None if state == "loading" else True
        announce = None
        if (alive, state) != (self.alive, self.state):
            self.alive, self.state = alive, state
            log.info("engine %s is %s", instance_id, state)
            announce = p.EngineStatus(alive=True, instance_id=instance_id, state=state)
        return EngineEvent(fail=fail, spare=instance_id, announce=announce)

    def dead(self, reason: str) -> EngineEvent:
        """Every request in flight fails; every client is told once (they fail the rest and refuse
        new ones until a heartbeat says it is back)."""
        announce = None
        if self.alive is not False:
            log.warning("engine %s dead: %s", self.instance, reason)
            self.alive = False
            announce = p.EngineStatus(alive=False, instance_id=self.instance, reason=p.clip(reason))
        return EngineEvent(fail=f"engine died: {reason}", announce=announce)

    def connection_closed(self) -> EngineEvent:
        """The engine's connection closed (crashed or killed): no need to wait for the timeout, if
        it was heard from and not yet taken for dead."""
        if self.state and self.alive is not False:
            return self.dead("its connection closed")
        return EngineEvent()

    def overdue(self, now: float) -> bool:
        """Heard from, not yet dead, and silent for longer than `timeout_s` (the loop still checks
        that nothing of it waits unread: that would be our being busy, not its silence)."""
        return bool(self.state) and self.alive is not False and now - self.last_seen > self.timeout_s

    def stalled(self, seconds: float) -> None:
        """We were not listening for `seconds`: its heartbeats wait, maybe still in zmq's I/O thread."""
        self.last_seen += seconds

    def announcement(self) -> p.EngineStatus | None:
        """Which engine we follow, for a client meeting us: one that knew another knows it restarted."""
        return p.EngineStatus(alive=True, instance_id=self.instance, state=self.state) if self.alive else None
