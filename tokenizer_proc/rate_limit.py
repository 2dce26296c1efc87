"""Each client's request rate, as a token bucket: `--max-request-rate-per-client` requests a
second on average, in bursts of up to a second's worth (at least one).

Pure bookkeeping, no I/O and no clock of its own (the caller passes `now`): `TokenizerStage`
asks it before tokenizing a request. A client is what the tokenizer counts per client (its
allow-listed CURVE key, else its routing id). A client whose bucket has refilled is forgotten, so
memory holds only clients that sent within the last second or so.
"""
from __future__ import annotations

import math


class RateLimit:
    # [ZH-START]
    # 【职责】按客户端限速（令牌桶）：每秒补充 rate 个令牌，桶容量 burst = max(1, rate)，
    # 每个请求花一个令牌；没有令牌的请求被拒绝，错误里说出限额。rate = 0 表示不限。
    # 【边界】不碰 socket、不读时钟：现在的时间由调用者传入，所以单元测试不必等待真实时间。
    # 桶补满的客户端被忘掉（补满的桶和没有桶一样），内存只留最近一秒左右发过请求的客户端。
    # 【协作者】TokenizerStage._on_generate 在分词之前调用 refusal；_count_clients
    # 每秒调用 forget_idle。
    # [ZH-END]

    def __init__(self, rate: float = 0.0):
        if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not math.isfinite(rate) or rate < 0:
            raise ValueError(f"max_request_rate_per_client must be a number >= 0 (0: no limit), got {rate!r}")
        self.rate = float(rate)
        self.burst = max(1.0, self.rate)
        self._buckets: dict[bytes, tuple[float, float]] = {}
        """Client -> (tokens left, when they were counted)."""

    def refusal(self, client: bytes, now: float) -> str | None:
        """Take one request of `client` at time `now` (seconds, monotonic): None if it may go on,
        else why it is refused (its rate is spent; the bucket is left as it was)."""
        if not self.rate:
            return None
        tokens = self._tokens(client, now)
        if tokens < 1.0:
            self._buckets[client] = (tokens, now)
            return (f"this client sent requests faster than its limit of {self.rate:g} a second "
                    f"(--max-request-rate-per-client); retry in {(1.0 - tokens) / self.rate:.2f}s")
        self._buckets[client] = (tokens - 1.0, now)
        return None

    def forget_idle(self, now: float) -> None:
        """Drop the clients whose bucket is full again: they are as if never seen."""
        self._buckets = {c: b for c, b in self._buckets.items() if self._tokens(c, now) < self.burst}

    @property
    def num_clients(self) -> int:
        return len(self._buckets)

    def _tokens(self, client: bytes, now: float) -> float:
        tokens, then = self._buckets.get(client, (self.burst, now))
        return min(self.burst, tokens + max(0.0, now - then) * self.rate)
