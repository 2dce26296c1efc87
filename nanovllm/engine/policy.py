"""Scheduling policies: the order in which waiting requests are admitted and running ones preempted.

A policy is one sort key over sequences: the scheduler admits waiting sequences smallest key
first, gives running sequences their share of the step's token budget in key order, and under KV
memory pressure preempts the running sequence with the largest key first. One key for both
keeps the two decisions consistent (what is admitted first is preempted last).

- `FCFSPolicy` (default): arrival order, so preemption takes the latest arrival.
- `PriorityPolicy`: higher `priority` first, arrival order among equals; preemption takes the
  lowest priority first.

Custom policies subclass `SchedulerPolicy` and pass an instance as `scheduler_policy`. A key is
read when a sequence enters the waiting queue and on each step for running ones, so it must not
change while the request lives (key on `arrival`, `priority`, `num_prompt_tokens`, `params`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from nanovllm.engine.sequence import Sequence


class SchedulerPolicy(ABC):
    name: str = "custom"

    @abstractmethod
    def key(self, seq: Sequence) -> tuple:
        """Smaller is admitted earlier and preempted later."""


class FCFSPolicy(SchedulerPolicy):
    name = "fcfs"

    def key(self, seq: Sequence) -> tuple:
        return (seq.arrival,)


class PriorityPolicy(SchedulerPolicy):
    name = "priority"

    def key(self, seq: Sequence) -> tuple:
        return (-seq.priority, seq.arrival)


POLICIES: dict[str, type[SchedulerPolicy]] = {"fcfs": FCFSPolicy, "priority": PriorityPolicy}


def make_policy(policy: str | SchedulerPolicy | None) -> SchedulerPolicy:
    """A policy from its name ("fcfs", "priority"), an import path of a `SchedulerPolicy`
    subclass ("package.module:Class"), an instance, or None for FCFS."""
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
