"""Incremental detokenization with stop strings: one request's output tokens in, text out.

The one implementation behind both the offline `LLM` (nanovllm/llm.py) and the service's
detokenizer stage (detok_proc/streams.py), so the two cut text and stop at the same places.

Decoding keeps two offsets into the ids, as vLLM and SGLang do: new text is
``decode(ids[surr:])`` minus ``decode(ids[surr:read])``. The overlap keeps tokenizers that drop a
leading space at the start of a decode (SentencePiece) correct; a decode ending in U+FFFD is half
a UTF-8 character and waits for the token that completes it. The last few prompt tokens seed
the window, so the first output token decodes with its real left context.

Stop strings are matched on the output text by one KMP automaton per stop string, advanced over
each newly decoded character only: the longest state is the longest tail of the text that could
still begin a stop string, which is exactly the text held back from the caller.

Tokens are decoded one at a time whatever the caller's batching, so feeding them in one call or
in many releases the same text and stops at the same token: a restarted detokenizer stage
rebuilds a request by feeding all of its output tokens at once.
"""
# [ZH-START]
# 【模块定位】增量反分词 + stop string：一个请求的输出 token 进，可以发给用户的文本出。
# 在服务里的位置：
#   客户端 → tokenizer_proc → engine_proc（每步产出新 token id）
#     →【detok_proc 用本模块】→ 客户端（文本增量）
# 离线 LLM.generate（nanovllm/llm.py）也用同一份实现，所以两边在同样的位置切文本、
# 在同样的 token 停下。
# 核心思路：
#   1. 两个偏移 surr / read：新文本 = decode(ids[surr:]) 去掉 decode(ids[surr:read])，重叠窗口让
#      SentencePiece 这类"解码开头会吞空格"的分词器也正确；
#   2. 解码结果以 U+FFFD 结尾说明是半个 UTF-8 字符，先不输出，等补全它的 token；
#   3. prompt 最后 8 个 token 作为左侧上下文，第一个输出 token 也按真实上下文解码；
#   4. 每个 stop string 一个 KMP 自动机，只推进新解码出的字符；可能是 stop string
#      开头的尾部文本先扣住不发。
# token 一个一个地解码，与调用方怎么分批无关：重启的 detok_proc 一次喂入全部输出也得到同样文本。
# [ZH-END]
from __future__ import annotations

import collections
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from nanovllm.sampling_params import SamplingParams

_TEXT_DEFAULTS = SamplingParams()

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 8
"""Prompt tokens kept as left context for the first output tokens. Only the first decode window
pays for them (the window moves past them once text comes out), so a few more than the one token
SentencePiece needs are cheap; the spare ones cover chat-template special tokens, which
`skip_special_tokens` removes from the decode and which would otherwise leave no real text as
context (vLLM takes 5 + 2 for the same reason)."""


def direct_decode(tokenizer: Any) -> Callable[..., str] | None:
    """The Rust tokenizer's own `decode`, where `tokenizer.decode` only wraps it: a transformers
    fast tokenizer whose class overrides neither `decode` nor `_decode` and that does not clean up
    spaces. The wrapper (argument conversion, kwargs, dispatch) costs ~2 us a call against ~0.7 us
    for the decode itself, and the detokenizer decodes up to twice per output token."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:  # the tokenizer is some other object with a decode()
        return None
    cls = type(tokenizer)
    if (isinstance(tokenizer, PreTrainedTokenizerFast) and cls.decode is PreTrainedTokenizerFast.decode
            and cls._decode is PreTrainedTokenizerFast._decode
            and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False):
        return tokenizer._tokenizer.decode
    return None


class _StopMatcher:
    """One KMP automaton per stop string, advanced one character at a time.

    A stop string's state is the length of its longest prefix that the text ends with, and
    only stop strings in a nonzero state are visited: a character that begins none of them
    costs one dict lookup. Failure links are computed as far as a state has reached, so long
    stop strings cost what the text matched of them, not their length (the service allows 64 of
    1024 characters per request).
    """
    # [ZH-START]
    # 【职责】所有 stop string 的 KMP 自动机：每个 stop string 的状态 = 文本结尾匹配到它的
    # 最长前缀长度；只访问状态非零的 stop string，失败链接按需延长；hold = 最大状态，
    # 即必须扣住不发的字符数。
    # 【边界】不保存文本，也不决定释放多少文本（由 IncrementalDetokenizer._release 决定）；
    # 不关心 min_tokens，只按 report 参数决定是否报告命中。
    # 【协作者】IncrementalDetokenizer 在有 stop 时建一个，每次有新文本就调 scan。
    # [ZH-END]

    def __init__(self, stops: Sequence[str]):
        self.stops = list(stops)
        self._starting_with: dict[str, list[int]] = {}
        for index, stop in enumerate(self.stops):
            self._starting_with.setdefault(stop[0], []).append(index)
        self._prefix_function: list[list[int]] = [[0] for _ in self.stops]
        self._states: dict[int, int] = {}
        """Stop string index -> its state, for the nonzero ones."""
        self.hold = 0
        """Characters that could still begin a stop string: the longest state."""

    def _fallback(self, index: int, k: int) -> int:
        """Longest proper prefix of stops[index][:k] that is also its suffix (KMP failure link)."""
        # [ZH-START]
        # 1. pi 是 stops[index] 的前缀函数，只算到目前用到的长度（长 stop string
        #    不用一开始就全算）。
        # 2. 还不够 k 项时按标准 KMP 递推补齐：沿 pi 回退直到字符相等或回到 0。
        # 3. 返回 pi[k - 1]：stops[index][:k] 的最长真前缀且同时是后缀的长度，即失败链接。
        # [ZH-END]
        pi, stop = self._prefix_function[index], self.stops[index]
        while len(pi) < k:
            j, f = len(pi), pi[-1]
            while f and stop[j] != stop[f]:
                f = pi[f - 1]
            pi.append(f + 1 if stop[j] == stop[f] else 0)
        return pi[k - 1]

    def scan(self, text: str, report: bool) -> tuple[int, str] | None:
        """Advance over `text`. With `report`, stop at the first character that completes a stop
        string and return (characters of `text` consumed, that stop string); the longest one
        wins when several end there."""
        # [ZH-START]
        # 1. 逐字符处理 text，consumed 从 1 计数。
        # 2. starting = 以这个字符开头的 stop string；既没有活跃状态、也没有以它开头的，
        #    就跳过（只花一次字典查找）。
        # 3. 对活跃的 stop string 和新开头的 stop string：k = 当前状态，失配就沿 _fallback
        #    回退，相等则 k + 1。
        # 4. k == len(stop) 表示完整匹配：记下 done（同一位置多个命中时取最长的那个），
        #    再回退 k 以便继续匹配。
        # 5. 只保留 k > 0 的状态，替换旧的状态表。
        # 6. report 为真且本字符有命中：返回 (consumed, 命中的 stop string)，后面的字符不再处理。
        # 7. 全部处理完：hold = 最大状态（0 表示没有要扣住的），返回 None。
        # [ZH-END]
        stops, states = self.stops, self._states
        for consumed, ch in enumerate(text, 1):
            starting = self._starting_with.get(ch)
            if not states and starting is None:
                continue
            advanced: dict[int, int] = {}
            done = -1
            for index in (*states, *(i for i in starting or () if i not in states)):
                stop, k = stops[index], states.get(index, 0)
                while k and stop[k] != ch:
                    k = self._fallback(index, k)
                if stop[k] == ch:
                    k += 1
                if k == len(stop):
                    if done < 0 or k > len(stops[done]):
                        done = index
                    k = self._fallback(index, k)
                if k:
                    advanced[index] = k
            self._states = states = advanced
            if report and done >= 0:
                return consumed, stops[done]
        self.hold = max(states.values(), default=0)
        return None


class _HeldText:
    """Decoded text not yet released, kept as chunks so that releasing it copies each character
    once (a single string would be re-copied on every append)."""
    # [ZH-START]
    # 【职责】已解码但还不能发出的文本，按块存在 deque 里，take(n) 取走前 n
    # 个字符时每个字符只复制一次。
    # 【边界】不知道为什么要扣住文本（由 stop string 决定）。
    # 【协作者】IncrementalDetokenizer._release 往里 push、从前面 take。
    # [ZH-END]

    def __init__(self) -> None:
        self._chunks: collections.deque[str] = collections.deque()
        self._start = 0
        """Characters of the first chunk already taken."""
        self.length = 0

    def push(self, text: str) -> None:
        if text:
            self._chunks.append(text)
            self.length += len(text)

    def take(self, n: int) -> str:
        """Remove and return the first `n` characters."""
        # [ZH-START]
        # 1. length 先减去 n。
        # 2. 循环：看第一块还剩多少（减去已取的 _start）；剩余比 n 多就切出 n
        #    个字符、推进 _start，结束。
        # 3. 否则整块剩余都取走，弹出这一块，_start 归零，n 减去取走的数量，继续下一块。
        # 4. 拼接各段返回。
        # [ZH-END]
        parts = []
        self.length -= n
        while n:
            chunk = self._chunks[0]
            available = len(chunk) - self._start
            if available > n:
                parts.append(chunk[self._start:self._start + n])
                self._start += n
                break
            parts.append(chunk[self._start:] if self._start else chunk)
            self._chunks.popleft()
            self._start = 0
            n -= available
        return "".join(parts)


class IncrementalDetokenizer:
    """One request's output tokens -> released text, with stop strings.

    `add` returns the text released by that call; `text` is all of it so far. Text that could
    still be the start of a stop string is held back until it cannot; on a match, the text before
    the stop string (or through it, with `include_stop_str_in_output`) is released and the
    detokenizer is `stopped`, with the stop string in `stop_reason`. No stop string ends the
    output before `min_tokens` output tokens: a match counts only if it completes in the text
    decoded once that many tokens are in.
    """
    # [ZH-START]
    # 【职责】一个请求的输出 token → 已释放的文本：增量解码、等待不完整的 UTF-8 字符、
    # 扣住可能是 stop string 开头的文本、命中 stop string 时停下（stop_reason 记下命中的串），
    # 并遵守 min_tokens 和 include_stop_str_in_output。
    # 【边界】不通知引擎停止（detok_proc 发现 stopped 后自己发 abort）；不处理 token id 的转发和
    # finish_reason / usage；一次只服务一个请求，不跨请求共享状态。
    # 【协作者】detok_proc.streams.RequestStreams.start 为每个请求建一个，advance 每步调 add；
    # 离线 LLM 同样使用；tokenizer.decode 是唯一依赖的分词器接口。
    # [ZH-END]

    def __init__(self, tokenizer: Any, params: SamplingParams = _TEXT_DEFAULTS, *, prompt_tail: Sequence[int] = ()):
        """`params`: the request's sampling parameters (already checked by their validator); their
        text-side fields are read: stop, include_stop_str_in_output, min_tokens, skip_special_tokens."""
        # [ZH-START]
        # 1. 从 params（已校验的 SamplingParams）读文本侧字段：stop、include_stop_str_in_output、
        #    min_tokens、skip_special_tokens，这里不再重复检查。
        # 2. context = prompt_tail 的最后 PROMPT_CONTEXT_TOKENS = 8 个 token，
        #    先解码成 context_text。
        # 3. context_text 以 U+FFFD 结尾（prompt 停在一个字符中间）：输出的前几个字节会被并进上下文
        #    而消失，所以这种情况下干脆不要上下文。
        # 4. _ids 从上下文开始，之后追加输出 token；_num_context 记上下文长度；surr = 0，
        #    read = len(context)；_window_prefix = context_text，即 decode(ids[surr:read]) 的缓存。
        # 5. 有 stop 才建 _StopMatcher；_held 放扣住的文本，_released 放已发出的文本片段。
        # [ZH-END]
        stop = params.stop
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self._decode_ids = direct_decode(tokenizer) or tokenizer.decode
        self.stop = stop
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.stop_reason: str | None = None
        """The stop string that ended the text, once one has."""
        context = list(prompt_tail)[-PROMPT_CONTEXT_TOKENS:]
        context_text = self._decode(context) if context else ""
        if context_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: the output's first bytes would complete it and
            # vanish into the context. Without context the output is its own plain decode.
            context, context_text = [], ""
        self._ids = context
        self._num_context = len(context)
        self._surr, self._read = 0, len(context)
        self._window_prefix: str | None = context_text
        """decode(ids[surr:read]), kept while the window waits for a character to complete."""
        self._matcher = _StopMatcher(stop) if stop else None
        self._held = _HeldText()
        self._released: list[str] = []
        self._finished = False

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    @property
    def token_ids(self) -> list[int]:
        """Output tokens consumed so far (none after the one that completed a stop string)."""
        return self._ids[self._num_context:]

    @property
    def text(self) -> str:
        """All the text released so far (kept as pieces, joined when read)."""
        if len(self._released) > 1:
            self._released[:] = ["".join(self._released)]
        return self._released[0] if self._released else ""

    def add(self, token_ids: Iterable[int], finished: bool = False) -> str:
        """Feed new output tokens; returns the text this call releases. `finished` marks the last
        call: the held-back text and a character that never completed (as U+FFFD) come out, so
        without a stop the text equals the decode of all the tokens. After a stop, returns "" and
        changes nothing."""
        # [ZH-START]
        # 1. 已经命中 stop：返回 ""，什么都不变；之前已有 finished=True 的调用：抛 RuntimeError。
        # 2. 逐个 token 处理：追加到 _ids → _decode_next(final=False) 得到新文本 → _release 过 stop
        #    string → 收集释放的文本；一旦 stopped 就停止，后面的 token 不再消费。
        # 3. finished 且未停止：标记 _finished，用 _decode_next(final=True) 把最后不完整的字符（以
        #    U+FFFD）也解出来并 _release；仍未停止就把 _held 里扣住的文本全部放出。
        # 4. 把本次释放的文本拼起来，记进 _released，返回它。
        # [ZH-END]
        if self.stopped:
            return ""
        if self._finished:
            raise RuntimeError("add() called after the call marked finished")
        out = []
        for token in token_ids:
            self._ids.append(token)
            out.append(self._release(self._decode_next(final=False)))
            if self.stopped:
                break
        if finished and not self.stopped:
            self._finished = True
            out.append(self._release(self._decode_next(final=True)))
            if not self.stopped:
                out.append(self._held.take(self._held.length))
        released = "".join(out)
        if released:
            self._released.append(released)
        return released

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_next(self, final: bool) -> str:
        """Text of the tokens past `read`, once it ends in a whole character (or `final`)."""
        # [ZH-START]
        # 1. read == len(ids)：没有新 token，返回 ""。
        # 2. prefix = decode(ids[surr:read])（窗口没动时用缓存 _window_prefix，不重复解码）。
        # 3. full = decode(ids[surr:])。
        # 4. full 比 prefix 还短，或 full 以 U+FFFD 结尾且不是 final：字符还没完整，返回 ""，
        #    窗口保持不动等下一个 token。
        # 5. 否则窗口前移：surr = 旧 read，read = len(ids)，清掉前缀缓存；
        #    返回 full[len(prefix):] 作为新文本。
        # [ZH-END]
        ids = self._ids
        if self._read == len(ids):
            return ""
        if self._window_prefix is None:
            self._window_prefix = self._decode(ids[self._surr:self._read])
        prefix = self._window_prefix
        full = self._decode(ids[self._surr:])
        if len(full) < len(prefix) or (full.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        self._surr, self._read = self._read, len(ids)
        self._window_prefix = None
        return full[len(prefix):]

    def _release(self, new: str) -> str:
        """Run `new` through the stop strings; returns the text that is now safe to release."""
        # [ZH-START]
        # 1. 没有 stop string 或新文本为空：原样返回。
        # 2. can_stop = 已有输出 token 数 >= min_tokens；不满足时 scan 仍推进状态，但不报告命中。
        # 3. hit = _matcher.scan(new, report=can_stop)。
        # 4. 没命中：new 放进 _held，只释放 "_held 长度 - hold" 个字符，尾部可能是 stop string
        #    开头的 hold 个字符继续扣住。
        # 5. 命中 (consumed, stop)：只把 new[:consumed] 放进 _held（stop string 之后的文本丢弃），
        #    记 stop_reason；释放的长度 = _held 长度 - len(stop)（include_stop_str_in_output
        #    时不减），然后清空 _held 并返回。
        # [ZH-END]
        if self._matcher is None or not new:
            return new
        can_stop = len(self._ids) - self._num_context >= self.min_tokens
        hit = self._matcher.scan(new, report=can_stop)
        if hit is None:
            self._held.push(new)
            return self._held.take(self._held.length - self._matcher.hold)
        consumed, stop = hit
        self._held.push(new[:consumed])
        self.stop_reason = stop
        kept = self._held.length - (0 if self.include_stop_str_in_output else len(stop))
        released = self._held.take(kept)
        self._held = _HeldText()
        return released


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins -> the bytes they stand for: printable Latin-1 bytes
    stand for themselves, the other 68 for characters from U+0100 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    stand_ins = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            stand_ins[chr(256 + extra)] = b
            extra += 1
    return stand_ins


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenTexts:
    """Each vocabulary token's own bytes and text, for logprobs: (text, bytes) where bytes are
    what the token adds to the output (a byte-level BPE token's real bytes, a SentencePiece
    piece with its space, a byte-fallback token's byte) and text their UTF-8 decoding (U+FFFD
    where a token holds part of a character). Special tokens are their own name. Cached per id."""
    # [ZH-START]
    # 【职责】logprobs 里每个 token 的文本和字节：byte-level BPE 的 token 还原成真实字节（可见字符 →
    # 字节的映射反过来查），SentencePiece 的 ▁ 换成空格，<0xNN> 换成那个字节；文本是字节的 UTF-8
    # 解码（半个字符处是 U+FFFD，和 OpenAI 一样另给 bytes）；特殊 token 就是它的名字。按 id 缓存。
    # 【边界】只给单个 token 的文本，不做增量反分词（那是 IncrementalDetokenizer）。
    # 【协作者】反分词进程（detok_proc/streams.py）给带 logprobs 的增量配上 token 文本。
    # [ZH-END]
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._alphabet = _byte_level_alphabet() if self._byte_level else {}
        self._special = set(getattr(tokenizer, "all_special_ids", ()))
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._text(token_id)
        return cached

    def _text(self, token_id: int) -> tuple[str, bytes]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return "", b""
        if token_id in self._special:
            return piece, piece.encode()
        fallback = _BYTE_FALLBACK.fullmatch(piece)
        if fallback:
            raw = bytes([int(fallback.group(1), 16)])
        elif self._byte_level and all(c in self._alphabet for c in piece):
            raw = bytes(self._alphabet[c] for c in piece)
        else:
            raw = piece.replace("\u2581", " ").encode()
        return raw.decode("utf-8", errors="replace"), raw
