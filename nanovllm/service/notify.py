"""A stage's line to its service manager (systemd, or `nanovllm serve`) and its way of stopping:
`sd_notify` speaks the readiness protocol (one implementation, `nanovllm_client.sdnotify`, shared
with the HTTP front and re-exported here), `Notifier` rate-limits what a stage loop sends with
it, and `Flush` is how a stage that holds nothing of its own stops (hand on what is queued, for a
moment at most, then end the loop).
"""
from __future__ import annotations

import os
import threading
import time

from nanovllm_client.sdnotify import sd_notify

__all__ = ["Flush", "Notifier", "sd_notify"]


class Notifier:
    """A stage's line to its service manager (systemd, or `nanovllm serve`): READY=1 once it
    serves, STATUS= lines a person reads in `systemctl status`, and WATCHDOG=1 from the loop that
    does the work, so a hung loop gets the stage killed and restarted. `tick()` and `status()`
    are rate-limited, so a hot loop may call them on every iteration."""

    STATUS_INTERVAL_S = 2.0

    def __init__(self) -> None:
        usec = os.environ.get("WATCHDOG_USEC")
        pid = os.environ.get("WATCHDOG_PID")
        mine = usec is not None and usec.isdigit() and (pid is None or pid == str(os.getpid()))
        self.watchdog_interval_s = int(usec) / 1e6 / 3 if mine else None
        """Ping three times per watchdog period (systemd's advice: at least twice)."""
        self._next_watchdog = 0.0
        self._next_status = 0.0
        self._last_status = ""

    def ready(self, status: str) -> None:
        self._last_status = status
        sd_notify(f"READY=1\nSTATUS={status}")

    def stopping(self, status: str) -> None:
        sd_notify(f"STOPPING=1\nSTATUS={status}")

    def tick(self) -> None:
        if self.watchdog_interval_s is None:
            return
        now = time.monotonic()
        if now >= self._next_watchdog:
            self._next_watchdog = now + self.watchdog_interval_s
            sd_notify("WATCHDOG=1")

    def status(self, text: str) -> None:
        now = time.monotonic()
        if text != self._last_status and now >= self._next_status:
            self._next_status, self._last_status = now + self.STATUS_INTERVAL_S, text
            sd_notify(f"STATUS={text}")


class Flush:
    """The stop of a stage whose requests live elsewhere (tokenizer, detokenizer): once `stop` is
    set, `serving()` stays true while the stage still holds something to hand on, for `grace_s`
    at most, and then false, ending its loop. `state` is what the stage reports meanwhile."""

    def __init__(self, notifier: Notifier, doing: str, grace_s: float = 1.0) -> None:
        self.notifier, self.doing, self.grace_s = notifier, doing, grace_s
        self.until: float | None = None
        """When the hand-over ends; None until the stop."""

    @property
    def state(self) -> str:
        return "ready" if self.until is None else "draining"

    def serving(self, stop: threading.Event, holding: bool) -> bool:
        """Whether the loop goes on, given the stop signal and whether the stage still holds
        anything to hand on."""
        now = time.monotonic()
        if self.until is None and stop.is_set():
            self.until = now + self.grace_s
            self.notifier.stopping(self.doing)
        return self.until is None or (holding and now < self.until)
