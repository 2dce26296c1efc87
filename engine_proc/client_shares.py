"""Each client's share of the engine stage's admission: how many of its requests may be live
(admitted into the engine) and how many may wait in the backlog, so that one client cannot take
the limits every client shares.

Pure bookkeeping, no I/O: `Admission` asks it before queueing and admitting, and tells it
when a request goes live or ends. A client is the tenant the tokenizer named for each request
(an HTTP front's API key, a CURVE key, else a routing id). Counts are dropped at zero, so nothing stays behind for a client gone.
"""
from __future__ import annotations

import collections


class ClientShares:
    # [ZH-START]
    # 【职责】按客户端计数：在引擎里（live）和在 backlog 里排队（queued）的请求各有几个；
    # 超过 --max-queued-per-client 的新请求被拒绝，达到 --max-live-per-client 的客户端的请求先不准入
    # （排在后面的别的客户端的请求照常准入，一个客户端占不满全局的名额）。0 表示不限。
    # 【边界】不碰 socket、不碰引擎；什么时候排队、准入、结束由 Admission 告诉它。
    # 【协作者】Admission.queue（refusal / queued）、admit（may_go_live / unqueued）、
    # abort（unqueued）、_go_live（went_live）、record（ended）。
    # [ZH-END]

    def __init__(self, max_live: int = 0, max_queued: int = 0):
        for name, value in (("max_live_per_client", max_live), ("max_queued_per_client", max_queued)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0 (0: no limit), got {value!r}")
        self.max_live, self.max_queued = max_live, max_queued
        self._live: collections.Counter[str] = collections.Counter()
        self._queued: collections.Counter[str] = collections.Counter()

    def refusal(self, client: str) -> str | None:
        """Why a new request of `client` is refused, or None: its queued share is full."""
        if self.max_queued and self._queued[client] >= self.max_queued:
            return (f"this client already has {self._queued[client]} requests waiting for admission, its limit "
                    f"(--max-queued-per-client {self.max_queued}); retry when some have started")
        return None

    def may_go_live(self, client: str) -> bool:
        return not self.max_live or self._live[client] < self.max_live

    def queued(self, client: str) -> None:
        self._queued[client] += 1

    def unqueued(self, client: str) -> None:
        _decrement(self._queued, client)

    def went_live(self, client: str) -> None:
        self._live[client] += 1

    def ended(self, client: str) -> None:
        _decrement(self._live, client)

    @property
    def num_clients(self) -> int:
        """Clients with a request queued or live: 0 when the stage is idle."""
        return len(self._live.keys() | self._queued.keys())


def _decrement(counts: collections.Counter[str], client: str) -> None:
    counts[client] -= 1
    if counts[client] <= 0:
        del counts[client]
