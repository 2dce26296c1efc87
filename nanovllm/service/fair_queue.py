"""Requests of many clients, taken by turns: the one queue behind the tokenizer's backlog and the
engine stage's admission, so that a client with thousands of requests waiting delays another
client's request by one of its own at most, never by all of them.

Each client has its own first-in first-out line; the clients take turns (round-robin, one request
a turn), and a client whose turn comes but who may not take one (`peek`'s `eligible`: its share
of the engine is full) is passed over without losing its place. Within a client's line a higher
`rank` (a request's priority) goes first, arrival order among equals. Pure bookkeeping, no I/O;
a client with nothing queued leaves no entry behind.
"""
# [ZH-START]
# 【模块定位】按客户端轮流取请求的队列，分词进程的积压（pending）和引擎 stage 的准入（backlog）
# 共用这一个实现：一个客户端排了几千个请求，另一个客户端的请求最多被它的一个请求耽搁，
# 而不是全部。每个客户端一条先进先出的队；客户端轮流（round-robin，每轮一个请求）；轮到却不许取的
# 客户端（peek 的 eligible：它在引擎里的份额已满）被跳过，但保留位置。同一客户端内 rank（请求的
# priority）高的先出，相同时按到达顺序。纯记账，不做 I/O；没有排队请求的客户端不留下任何条目。
# [ZH-END]
from __future__ import annotations

import collections
from typing import Callable, Generic, Hashable, Iterator, TypeVar

T = TypeVar("T")


class FairQueue(Generic[T]):
    # [ZH-START]
    # 【职责】保存每个客户端的排队请求（key → (rank, item)，按到达顺序），和客户端的轮转顺序
    # （_lines 的插入顺序就是轮到的先后）；给出下一个该取的请求（peek），取走后把这个客户端
    # 移到队尾（take）；按 key 删除（remove，abort 用）；找出排得最多的客户端（largest，
    # 全局积压满时拒绝它多出来的，而不是新来的客户端）。
    # 【边界】不决定谁有资格（由调用方的 eligible 判断），不碰 socket，不计字节。
    # 【协作者】TokenizerStage（pending）；engine_proc.Admission（backlog）。
    # [ZH-END]

    def __init__(self) -> None:
        self._lines: dict[Hashable, collections.OrderedDict[Hashable, tuple[int, T]]] = {}
        """Client -> its queued items by key, in arrival order; the dict's order is the turn order."""
        self._client_of: dict[Hashable, Hashable] = {}
        """Key -> the client it is queued under."""
        self._ranked: collections.Counter[Hashable] = collections.Counter()
        """Client -> its items with a rank other than 0 (none: its line's head goes first, O(1))."""

    def __len__(self) -> int:
        return len(self._client_of)

    def __bool__(self) -> bool:
        return bool(self._client_of)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._client_of

    def keys(self) -> Iterator[Hashable]:
        return iter(self._client_of)

    def values(self) -> Iterator[T]:
        for line in self._lines.values():
            for _, item in line.values():
                yield item

    def count(self, client: Hashable) -> int:
        """Items `client` has queued."""
        line = self._lines.get(client)
        return len(line) if line else 0

    @property
    def num_clients(self) -> int:
        return len(self._lines)

    def push(self, client: Hashable, key: Hashable, item: T, rank: int = 0) -> None:
        """Queue `item` under a key not queued yet, at the end of its client's line (a new client
        takes its first turn after those already waiting)."""
        if key in self._client_of:
            raise KeyError(f"{key!r} is already queued")
        self._lines.setdefault(client, collections.OrderedDict())[key] = (rank, item)
        self._client_of[key] = client
        if rank:
            self._ranked[client] += 1

    def peek(self, eligible: Callable[[Hashable], bool] | None = None) -> tuple[Hashable, T] | None:
        """The next (key, item) by turns: the first client in turn order that is `eligible`, its
        highest-ranked item (the oldest among equals). None when no eligible client has one."""
        # [ZH-START]
        # 1. 按轮转顺序看每个客户端；eligible 给了且它不合格 → 跳过（位置不变）。
        # 2. 它没有 rank 非 0 的请求（常见情况）→ 取队头，O(1)；
        #    否则在它自己的队里找 rank 最大的（相同取最早的）。
        # 3. 都不合格 → None。
        # [ZH-END]
        for client, line in self._lines.items():
            if eligible is not None and not eligible(client):
                continue
            if not self._ranked[client]:
                key, (_, item) = next(iter(line.items()))
                return key, item
            best = None
            for key, (rank, item) in line.items():  # the oldest of the highest rank
                if best is None or rank > best[0]:
                    best = (rank, key, item)
            return best[1], best[2]
        return None

    def take(self, key: Hashable) -> T:
        """Remove the item `peek` named: its client has had its turn and goes to the back."""
        client = self._client_of[key]
        item = self.remove(key)
        line = self._lines.pop(client, None)
        if line is not None:
            self._lines[client] = line
        return item

    def remove(self, key: Hashable) -> T | None:
        """Remove an item out of turn (an abort), keeping its client's place; None if not queued."""
        client = self._client_of.pop(key, None)
        if client is None:
            return None
        line = self._lines[client]
        rank, item = line.pop(key)
        if rank:
            self._ranked[client] -= 1
            if not self._ranked[client]:
                del self._ranked[client]
        if not line:
            del self._lines[client]
        return item

    def largest(self) -> tuple[Hashable, int] | None:
        """The client with the most items queued and how many (the oldest in turn order among
        equals); None when empty."""
        if not self._lines:
            return None
        client = max(self._lines, key=lambda c: len(self._lines[c]))
        return client, len(self._lines[client])

    def newest(self, client: Hashable) -> Hashable:
        """The key `client` queued last (what a full backlog gives up first)."""
        return next(reversed(self._lines[client]))
