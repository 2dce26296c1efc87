"""Structured output: a request's `response_format` enforced while sampling, built on llguidance.

- `check_response_format(value)` (from `nanovllm_client.response_format`, where every door runs
  it): validates OpenAI's shape with size and depth limits; ValueError naming the problem.
- `grammar_text(fmt)`: the llguidance grammar for a checked format (cached by its JSON text).
- `GrammarCache` (cache.py): compiled formats by text, the engine's own check (its input thread).
- `MaskPrefetcher` (prefetch.py): masks computed while the model runs the step's forward;
  `prepare_masks` fills a batch's masks in one parallel llguidance call.
- `StructuredOutput`: a `LogitsProcessor` holding one request's matcher. It follows the request's
  output tokens (consuming new ones, starting over when the output does not extend what it saw,
  as after a preemption), fills the token bitmask and sets every disallowed logit to -inf, so
  the mask holds with every sampling mode. When the grammar is complete only EOS stays allowed,
  so the request finishes with `stop`.
"""
# [ZH-START]
# 【模块定位】结构化输出：
# 把请求的 response_format（json_object / json_schema / regex / grammar / choice）编译成 llguidance
# 语法，在采样器里逐步屏蔽不合语法的 token（作为一个 logits processor 运行）。
# check_response_format（在客户端包 nanovllm_client.response_format 里，每个入口都用它）校验形状和
# 大小/深度上限；grammar_text 按 JSON 文本缓存编译结果；
# StructuredOutput 跟踪一个请求的输出 token，填 bitmask，把不允许的 logits 设为 -inf。
# [ZH-END]
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence

# The shape check every door runs (torch-free, in the client package), re-exported here.
from nanovllm_client.response_format import (MAX_CHOICE_CHARS, MAX_CHOICES, MAX_FORMAT_CHARS,  # noqa: F401
                                             MAX_SCHEMA_CHARS, MAX_SCHEMA_DEPTH, TYPES, check_response_format)
from nanovllm.structured.schema_check import SchemaCheck


def _lark_string(s: str) -> str:
    return json.dumps(s)  # a Lark string literal: JSON's escapes are Lark's


STRICT = {"whitespace_flexible": False}
"""llguidance's JSON options: compact JSON, every keyword enforced or an error."""
LENIENT = {**STRICT, "lenient": True, "coerce_one_of": True}
"""The same, with the keywords the grammar cannot express left out and `oneOf` taken as `anyOf`:
used only with a `SchemaCheck` of the whole schema (unknown `format`s aside, see compile_format)."""


@lru_cache(maxsize=256)
def _grammar(text: str, lenient: bool = False) -> str:
    import llguidance

    fmt = json.loads(text)
    kind = fmt["type"]
    M = llguidance.LLMatcher
    if kind == "json_object":
        return M.grammar_from_json_schema({"type": "object"})
    if kind == "json_schema":
        schema = fmt["json_schema"]["schema"]
        return M.grammar_from_json_schema(schema if isinstance(schema, dict) else {},
                                          defaults=LENIENT if lenient else STRICT)
    if kind == "regex":
        return M.grammar_from_regex(fmt["regex"])
    if kind == "grammar":
        return M.grammar_from_lark(fmt["grammar"])
    return M.grammar_from_lark("start: " + " | ".join(_lark_string(c) for c in fmt["choices"]))


def grammar_text(fmt: dict, lenient: bool = False) -> str:
    """The llguidance grammar of a checked format, cached by the format's JSON text."""
    try:
        return _grammar(json.dumps(fmt), lenient)  # key order kept: a schema's property order is the output's
    except ValueError as e:
        raise ValueError(f"response_format does not compile: {str(e)[:500]}") from None


@lru_cache(maxsize=4)
def _ll_tokenizer(tokenizer: Any, n_vocab: int) -> Any:
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab)


def ll_tokenizer(tokenizer: Any, n_vocab: int) -> Any:
    """llguidance's view of a Hugging Face tokenizer (built once per tokenizer object)."""
    return _ll_tokenizer(tokenizer, n_vocab)


@dataclass(frozen=True)
class CompiledFormat:
    """A format compiled for one vocabulary: its grammar, the compiled matcher (a template to
    copy), and the check of its whole schema where the grammar enforces less."""

    grammar: str
    matcher: Any
    """An `llguidance.LLMatcher` of `grammar`, not advanced: `StructuredOutput` copies it."""
    check: SchemaCheck | None = None
    """None where the grammar is the whole format (every format but a leniently compiled schema)."""


def compile_format(fmt: dict, lltok: Any) -> CompiledFormat:
    """`fmt` compiled against the vocabulary; ValueError naming the problem.

    A JSON schema that does not compile as it is, only because of keywords the grammar cannot
    express, compiles leniently with a `SchemaCheck` of the whole schema. An unknown `format`
    alone needs no check: JSON Schema makes `format` an annotation, which validators ignore by
    default, so the lenient grammar (the format left out) is the whole schema.

    llguidance recurses over a grammar's nesting as it compiles: run this where the stack is
    deep enough for the formats allowed in (`GrammarCache` does; `COMPILE_STACK_BYTES`)."""
    # [ZH-START]
    # 1. 严格编译：grammar_text 后直接建 LLMatcher（只编译一次，不再先 validate_grammar）；
    #    没有错误就返回，不带校验。
    # 2. 有错误且是 json_schema：宽松编译（LENIENT：不支持的关键字不进语法，oneOf 当 anyOf）；
    #    还出错（悬空 $ref、正则里的 lookaround……）就以宽松编译的原因拒绝。
    # 3. 宽松编译的警告里去掉 "Unknown format"（format 只是注解，规范要求忽略未知值）；剩下的
    #    就是语法没有强制的关键字：建 SchemaCheck（完整 schema 的 jsonschema 校验器），
    #    建不出来也拒绝。
    # [ZH-END]
    import llguidance

    grammar = grammar_text(fmt)
    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
    if not matcher.is_error():
        return CompiledFormat(grammar, matcher)
    error = matcher.get_error()
    if fmt["type"] == "json_schema":
        lenient = grammar_text(fmt, lenient=True)
        matcher = llguidance.LLMatcher(lltok, lenient, log_level=0)
        if matcher.is_error():  # its reason: what no leniency gets past
            error = matcher.get_error()
        else:
            relaxed = [w for w in matcher.get_grammar_warnings() if not w.startswith("Unknown format")]
            if not relaxed:
                return CompiledFormat(lenient, matcher)
            try:
                return CompiledFormat(lenient, matcher, SchemaCheck(fmt["json_schema"]["schema"], relaxed))
            except Exception as e:  # a schema jsonschema cannot read: its outputs could not be checked
                error = f"{error}; and the schema cannot be checked ({type(e).__name__}: {str(e)[:200]})"
    raise ValueError(f"response_format does not compile: {error[:500]}")


class StructuredOutput:
    """One request's grammar, enforced on its logits (a `LogitsProcessor`).

    `prepare(output)` computes the mask for the token after `output`; the sampler's mask thread
    calls it while the model runs the step's forward (`MaskPrefetcher`), and `__call__` then only
    applies it. Called for an output it has not prepared, it computes the mask itself: the mask
    is a function of the output alone, so both ways give the same logits. The sampler calls it
    for rows with other constraints too; rows with the grammar alone take `bits` (the packed
    mask) and are masked all at once (`constraints.mask_grammar_rows`).

    With a `check` (a schema compiled leniently), wherever the grammar would let the output end
    the JSON so far is checked against the whole schema; one that fails may not end there (EOS
    is masked), and where the grammar then allows nothing, `bits` raises the check's reason."""
    # [ZH-START]
    # 【职责】一个请求的语法约束：跟踪已生成 token（新 token 逐个 consume；输出变短或位置 seen-1 的
    #        token 变了，即不再延续已见的输出时 reset 重来，如续写），算出"下一个 token"的 blocked
    #        掩码，把不允许的 logits 设为 -inf。
    # 【边界】不编译语法（compile_format / GrammarCache 已编译并校验）；语法完成后只剩 EOS
    #        可选，请求以 stop 结束。有 check（宽松编译的 schema）时，在语法可结束处用完整
    #        schema 校验已生成的文本：不满足就去掉 EOS 位；一个 token 都不剩时 bits 抛出原因，
    #        请求以 error 结束。
    #        prepare 可在掩码线程上提前算（与前向重叠），__call__ 遇到没准备好的输出就自己算——
    #        掩码只取决于输出，结果相同。
    # 【协作者】build_logits_processors 在有 response_format 时创建；MaskPrefetcher 调 prepare；
    #        只有语法约束的行由 constraints.mask_grammar_rows 取打包的 bits 后整批屏蔽，
    #        还有别的约束的行每步逐行调 __call__；与其他约束冲突（合起来一个 token 都不剩）
    #        时 Sampler 只保留语法掩码（语法优先）。
    # [ZH-END]

    def __init__(self, grammar: str | Any, lltok: Any, check: SchemaCheck | None = None):
        """`grammar`: llguidance grammar text, or a compiled `LLMatcher` to copy (`GrammarCache`);
        `check`: the whole schema where the grammar enforces less (`CompiledFormat.check`)."""
        import llguidance
        import llguidance.numpy as lln

        self._lln = lln
        if isinstance(grammar, str):
            self.matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        else:
            self.matcher = grammar.deep_copy()
            self.matcher.reset()
        if self.matcher.is_error():
            raise ValueError(f"response_format does not compile: {self.matcher.get_error()[:500]}")
        self.n_vocab = lltok.vocab_size
        self.lltok = lltok
        self.check = check
        self.violation: str | None = None
        """Why the output may not end where the grammar would let it (`check`), for the current mask."""
        self.bitmask = lln.allocate_token_bitmask(1, self.n_vocab)
        self.seen: list[int] = []
        self._bits: Any = None
        """numpy int32 (ceil(n_vocab / 32),): the tokens allowed after `seen` as llguidance packs
        them (token t is bit t % 32 of word t // 32), once computed for it."""
        self._blocked: Any = None
        """torch bool (n_vocab,): `_bits` unpacked and negated, made when first asked for."""
        self._bits_at = -1
        """len(seen) when `_bits` was computed."""

    def _follow(self, output: Sequence[int]) -> None:
        # Outputs only grow; one that does not extend what was seen (shorter, or another token
        # at the last seen place) is matched again from its start. O(new tokens), not O(output).
        n = len(self.seen)
        if len(output) < n or (n and int(output[n - 1]) != self.seen[-1]):
            self.matcher.reset()
            self.seen, self._bits_at, n = [], -1, 0
        for t in output[n:]:
            if not self.matcher.consume_token(int(t)):
                raise ValueError(f"token {int(t)} does not fit the response_format: {self.matcher.get_error()[:300]}")
            self.seen.append(int(t))

    def allowed(self, output: Sequence[int]) -> Any:
        """A numpy bool array (n_vocab,) of the tokens the grammar allows next."""
        return _unpack(self.bits(output), self.n_vocab)

    def prepare(self, output: Sequence[int]) -> None:
        """Compute the mask for the token after `output` (ahead of the forward that needs it)."""
        self._follow(output)
        self._lln.fill_next_token_bitmask(self.matcher, self.bitmask, 0)  # Rust, without the GIL
        self._set_bits(self.bitmask[0].copy())

    def _set_bits(self, bits: Any) -> None:
        self.violation = None
        if self.check is not None and self.matcher.is_accepting():
            self.violation = self.check.violation(self.lltok.decode_bytes(self.seen))
            if self.violation is not None:  # it may not end here: EOS masked (bits is this row's own)
                import numpy as np

                words = bits.view(np.uint32)
                for eos in self.lltok.eos_tokens:
                    if eos < self.n_vocab:
                        words[eos // 32] &= np.uint32(0xFFFFFFFF ^ (1 << (eos % 32)))
        self._bits, self._blocked, self._bits_at = bits, None, len(self.seen)

    def bits(self, output: Sequence[int]) -> Any:
        """numpy int32 (ceil(n_vocab / 32),): the tokens the grammar allows after `output`,
        packed as llguidance fills them (the form `CpuOps.mask_bits` applies directly)."""
        self._follow(output)
        if self._bits_at != len(self.seen):
            self.prepare(output)
        if self.violation is not None and not self._bits.any():
            raise ValueError(self.violation)
        return self._bits

    def blocked(self, output: Sequence[int]) -> Any:
        """torch bool (n_vocab,) on the CPU: the tokens the grammar does not allow after `output`."""
        import numpy as np
        import torch

        bits = self.bits(output)
        if self._blocked is None:
            self._blocked = torch.from_numpy(np.logical_not(_unpack(bits, self.n_vocab)))
        return self._blocked

    def __call__(self, output_token_ids: Sequence[int], logits: Any) -> Any:
        import torch

        blocked = self.blocked(output_token_ids).to(logits.device, non_blocking=True)
        v = min(len(blocked), logits.shape[-1])
        if v < logits.shape[-1]:  # logits wider than the vocabulary: the padding is never allowed
            blocked = torch.cat([blocked[:v], torch.ones(logits.shape[-1] - v, dtype=torch.bool, device=logits.device)])
        return logits.masked_fill_(blocked[: logits.shape[-1]], float("-inf"))


def prepare_masks(jobs: Sequence[tuple[StructuredOutput, Sequence[int]]], executor: Any | None = None) -> int:
    """`grammar.prepare(output)` for each (grammar, output), the fills in one parallel llguidance
    call when `executor` (an `llguidance.LLExecutor`) is given and more than one row needs a mask.
    Returns the number of masks that call filled (0 when the rows were filled one by one).

    The masks are exactly those of the serial calls. A row whose output does not fit its grammar
    is skipped: `StructuredOutput.bits` computes it again and raises the request's error."""
    # [ZH-START]
    # 1. 每行先 _follow(output)（Python 里逐个 consume 新 token）；抛异常的行跳过，
    #    采样时由 bits() / blocked() 重算并报告错误。
    # 2. 已为当前输出算过掩码的行跳过；剩下的若不足两行、没有 executor、或词表大小不一，
    #    就逐行串行 prepare。
    # 3. 否则分配共享 bitmask (N, ⌈V/32⌉)，fill_next_token_bitmask_par 一次调用：
    #    Rust 线程并行填，释放 GIL。
    # 4. 每行存共享 bitmask 里自己那一行的视图（打包的允许位，不解包）——与串行结果逐位相同；
    #    constraints.mask_grammar_rows 在 CPU 上直接用这些打包位屏蔽（CpuOps.mask_bits）。
    # [ZH-END]
    todo = []
    for grammar, output in jobs:
        try:
            grammar._follow(output)
        except Exception:  # computed again where the mask is applied, which reports the request's error
            continue
        if grammar._bits_at != len(grammar.seen):
            todo.append((grammar, output))
    if executor is None or len(todo) < 2 or len({g.n_vocab for g, _ in todo}) > 1:
        for grammar, output in todo:
            try:
                grammar.prepare(output)
            except Exception:  # as above
                pass
        return 0
    grammars = [g for g, _ in todo]
    n_vocab, lln = grammars[0].n_vocab, grammars[0]._lln
    bitmask = lln.allocate_token_bitmask(len(grammars), n_vocab)  # (N, ceil(V / 32)) int32
    try:
        lln.fill_next_token_bitmask_par(executor, [(g.matcher, i) for i, g in enumerate(grammars)], bitmask)
    except Exception:  # every row is computed again, one by one, where its mask is applied
        return 0
    for i, grammar in enumerate(grammars):
        grammar._set_bits(bitmask[i])  # rows of one array: `constraints` applies them all at once
    return len(grammars)


def _unpack(bits: Any, n_vocab: int) -> Any:
    """Packed allowed-token bits (ceil(n_vocab / 32),) int32 -> numpy bool (n_vocab,)."""
    import numpy as np

    return np.unpackbits(bits.view(np.uint8), bitorder="little")[:n_vocab].astype(bool)
