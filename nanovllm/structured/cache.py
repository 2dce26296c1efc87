"""Compiled response formats, cached by their JSON text: the one compile check of both stages.

The tokenizer stage compiles each format through one of these caches before the engine sees it
(`RequestBuilder.formats`), but a frame may reach the engine's socket from elsewhere. The engine stage's input thread therefore compiles every format
too, through this cache, before the request is queued: a bad one is refused there with the
compiler's reason, and the step loop only copies a compiled matcher (`LLMatcher.deep_copy`)
when it adds the request. llguidance drops the GIL while it builds a grammar and bounds the
work with its parser limits; errors are cached too, so a hostile format sent again costs a look-up.
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
import threading
from collections import OrderedDict
from typing import Any

from nanovllm.structured import StructuredOutput, compile_format
from nanovllm.structured.schema_check import SchemaCheck

MAX_CACHED_FORMATS = 256


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

    def __init__(self, lltok: Any, max_entries: int = MAX_CACHED_FORMATS):
        self.lltok = lltok
        self.max_entries = max_entries
        self._entries: OrderedDict[str, tuple[Any, SchemaCheck | None, str | None]] = OrderedDict()
        self._lock = threading.Lock()
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
            entry = self._compile(fmt)
            with self._lock:
                self.num_compiled += 1
                self._entries[key] = entry
                if len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
        matcher, check, error = entry
        if error is not None:
            with self._lock:
                self.num_refused += 1
            raise ValueError(error)
        return matcher, check

    def _compile(self, fmt: dict) -> tuple[Any, SchemaCheck | None, str | None]:
        import llguidance

        try:
            compiled = compile_format(fmt, self.lltok)
        except ValueError as e:
            return None, None, str(e)
        matcher = llguidance.LLMatcher(self.lltok, compiled.grammar, log_level=0)
        if matcher.is_error():
            return None, None, f"response_format does not compile: {matcher.get_error()[:500]}"
        return matcher, compiled.check, None
