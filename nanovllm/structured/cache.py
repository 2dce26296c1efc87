"""Compiled response formats, cached by their JSON text: the one compile check of both stages.

The tokenizer stage compiles each format through one of these caches before the engine sees it
(`RequestBuilder.formats`), but a frame may reach the engine's socket from elsewhere. The engine stage's input thread therefore compiles every format
too, through this cache, before the request is queued: a bad one is refused there with the
compiler's reason, and the step loop only copies a compiled matcher (`LLMatcher.deep_copy`)
when it adds the request. llguidance drops the GIL while it builds a grammar and bounds the
work with its parser limits; errors are cached too, so a hostile format sent again costs a look-up.

Compiles run one at a time on the cache's own thread, whose stack is `COMPILE_STACK_BYTES`:
llguidance recurses over a grammar's nesting as it compiles (a chain of 1,000 `$ref`s, 75 KB of
JSON, overflows a default 8 MiB thread stack and kills the process), and every format the size
limits let in compiles within that stack (measured: `docs/benchmarks.md`). The cache holds at
most `max_entries` formats and `max_chars` characters of their JSON text.
"""
# [ZH-START]
# 【模块定位】两个阶段共用的编译缓存：按 response_format 的 JSON 文本缓存编译结果
# （编译好的 LLMatcher 模板，或编译错误）。tokenizer 阶段经自己的一个实例（RequestBuilder.formats）
# 编译校验，同一文本只编译一次；但帧可能绕过它直接打到引擎 socket：engine_proc 的输入线程对每个格式
# 再经本缓存编译一次，坏的在入队前就带着原因拒绝；step 循环 add_request 时只
# deep_copy 模板（便宜）。
# 错误也缓存（同一个恶意格式再来只是一次查表）；LRU，最多 max_entries 条；加锁，
# 输入线程与 step 线程可同时用。
# [ZH-END]
from __future__ import annotations

import json
import queue
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any, Callable

from nanovllm.structured import StructuredOutput, compile_format
from nanovllm.structured.schema_check import SchemaCheck

MAX_CACHED_FORMATS = 256
MAX_CACHED_CHARS = 8 << 20
"""The JSON text of the formats a cache holds, in all (a compiled format's memory grows with it)."""
COMPILE_STACK_BYTES = 512 << 20
"""The compile thread's stack: address space reserved, pages used only as deep as a compile goes."""


class GrammarCache:
    """For one vocabulary: response_format JSON text -> a compiled matcher to copy (and the
    schema's check where it compiled leniently: `compile_format`), or its error."""
    # [ZH-START]
    # 【职责】一个词表的 response_format 编译缓存：JSON 文本 → LLMatcher 模板（每个请求 deep_copy
    # 一份）加宽松编译时的 SchemaCheck，或 ValueError 文本；structured(fmt) 直接给出请求的
    # StructuredOutput（模板副本 + 校验）。
    # 【边界】不校验格式的形状（check_response_format 已做）；
    # 不跟踪任何请求的输出（StructuredOutput 的事）。
    # 【协作者】LLMEngine 持有一个（词表视图建好后惰性创建），tokenizer 阶段的 RequestBuilder
    #        也持有一个（formats）；engine_proc 输入线程经 LLMEngine.compile_response_format 调
    #        template；LLMEngine._structured 在 add_request 时经 structured 取模板副本和校验。
    # [ZH-END]

    def __init__(self, lltok: Any, max_entries: int = MAX_CACHED_FORMATS, max_chars: int = MAX_CACHED_CHARS):
        self.lltok = lltok
        self.max_entries = max_entries
        self.max_chars = max_chars
        self._entries: OrderedDict[str, tuple[Any, SchemaCheck | None, str | None]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        self._compiler = _CompileThread()
        self.num_compiled = 0
        """Formats compiled (cache misses), good or bad."""
        self.num_refused = 0
        """Look-ups that found a format that does not compile (its first compile included)."""

    def template(self, fmt: dict) -> Any:
        """A compiled `LLMatcher` for `fmt`, not to be advanced (copy it); ValueError naming the problem."""
        return self._entry(fmt)[0]

    def structured(self, fmt: dict) -> StructuredOutput:
        """A request's matcher for `fmt`: a copy of the compiled one, with its schema check if any."""
        matcher, check = self._entry(fmt)
        return StructuredOutput(matcher, self.lltok, check)

    def _entry(self, fmt: dict) -> tuple[Any, SchemaCheck | None]:
        key = json.dumps(fmt)  # key order kept: a schema's property order is the output's
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
        if entry is None:  # compiled outside the lock: two threads may both compile a new format, once
            entry = self._compiler.run(lambda: self._compile(fmt))
            with self._lock:
                self.num_compiled += 1
                if key not in self._entries:
                    self._chars += len(key)
                self._entries[key] = entry
                while len(self._entries) > 1 and (len(self._entries) > self.max_entries or self._chars > self.max_chars):
                    self._chars -= len(self._entries.popitem(last=False)[0])
        matcher, check, error = entry
        if error is not None:
            with self._lock:
                self.num_refused += 1
            raise ValueError(error)
        return matcher, check

    def _compile(self, fmt: dict) -> tuple[Any, SchemaCheck | None, str | None]:
        try:
            compiled = compile_format(fmt, self.lltok)
        except ValueError as e:
            return None, None, str(e)
        return compiled.matcher, compiled.check, None


class _CompileThread:
    """One daemon thread with a deep stack (`COMPILE_STACK_BYTES`) that runs compiles in turn."""
    # [ZH-START]
    # 【职责】一个栈很深的守护线程，依次执行编译（调用方阻塞等结果）。
    # 【边界】只管在哪个栈上跑：threading.stack_size 是全进程的设置，只在启动本线程时改、
    #        随即改回；异常原样交回调用方。
    # 【协作者】GrammarCache 每个实例一个；输入线程和 step 线程都经它编译。
    # [ZH-END]

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            threading.Thread(target=self._serve, name="nanovllm-grammar-compile", daemon=True).start()
        finally:
            threading.stack_size(previous)

    def _serve(self) -> None:
        while True:
            fn, future = self._jobs.get()
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to the caller
                future.set_exception(e)

    def run(self, fn: Callable[[], Any]) -> Any:
        future: Future = Future()
        self._jobs.put((fn, future))
        return future.result()
