"""Warnings that a hot loop may raise on every iteration without flooding the log."""
from __future__ import annotations

import logging
import time


class ThrottledWarnings:
    """Warnings by key: the first of each key is logged at once, after that at most one line per
    `interval_s` per key, saying how many were suppressed since the last. Keys must come from a
    small fixed set (never from input), since each is remembered."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0):
        self.logger, self.interval_s = logger, interval_s
        self._last_logged: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warn(self, key: str, message: str, *args, exc_info: bool = False) -> bool:
        """Log `message % args` unless one of `key` was logged within `interval_s`; True if logged."""
        now = time.monotonic()
        if now - self._last_logged.get(key, -1e18) < self.interval_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        suppressed = self._suppressed.pop(key, 0)
        self._last_logged[key] = now
        if suppressed:
            message, args = message + " (%d more since the last report)", (*args, suppressed)
        self.logger.warning(message, *args, exc_info=exc_info)
        return True
