"""What sampling keeps of one request between steps, held by the request itself.

The engine builds a `SamplingState` when it adds a request and hangs it on the request's
`Sequence` (`seq.sampling`), next to its tokens and its frozen `SamplingParams`: one owner for
everything a request is. The sampler is then a function over the step's rows (`SampledRow`: the
attributes it reads of a `Sequence`), with no table of its own to keep in step with the engine,
and a row without a state is an error, never a state made up on the spot.
"""
# [ZH-START]
# 【模块定位】一个请求跨步的采样状态，挂在请求自己身上（Sequence.sampling）。
#   LLMEngine.add_request ─SamplingState.build→ Sequence(params, sampling)
#   → 每一步 ModelRunner.run → Sampler(logits, 这一步要采样的 Sequence 列表)
#     读 seq.params（冻结的 SamplingParams）、seq.sampling（本模块）、seq.token_ids
#   → 引擎 _output 从 seq.sampling 取走 logprobs / 失败原因。
# 采样器不再自己按 request_id 存一张表，也就没有"引擎和采样器两边对不上"的问题；
# 请求结束，状态随 Sequence 一起消失。没有状态的行直接报错，不会临时造一个。
# [ZH-END]
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from nanovllm.layers.logits_processors import LogitsProcessor
from nanovllm.layers.logprobs import TokenLogprobs
from nanovllm.sampling_params import SamplingParams
from nanovllm.structured import StructuredOutput


@dataclass(slots=True, eq=False)  # a holder of mutable state: the same object, not equal values
class SamplingState:
    """One request's sampling state: its processors, its bias and min_tokens tensors on the
    sampler's device, its own generator when seeded, and what a step left for the engine to
    report (logprobs, or why its row could not be sampled)."""
    # [ZH-START]
    # 【职责】一个请求跨步的采样状态：logits processors（其中的 StructuredOutput 另记为 grammar，
    # 约束冲突时语法优先）、预先建好的张量（min_tokens 期间要屏蔽的 id、logit_bias 的 id 与值）、
    # 有种子时自己的 Generator、尚未上报的 logprobs、采样失败的原因；plain_greedy 在建的时候
    # 算好一次（SamplingParams 是冻结的，不会再变）。
    # 【边界】不保存 token 序列、不知道请求何时开始结束：这些在 Sequence 和 LLMEngine。
    # 【协作者】LLMEngine.add_request 用 build 建好挂到 Sequence.sampling；Sampler 每步读写；
    # LLMEngine._output 调 take_logprobs / take_error。
    # [ZH-END]
    processors: list[LogitsProcessor]
    min_tokens_blocked: torch.Tensor | None
    """EOS (unless ignore_eos) and stop token ids, masked while the output is shorter than min_tokens."""
    bias_ids: torch.Tensor | None
    bias_values: torch.Tensor | None
    generator: torch.Generator | None
    grammar: StructuredOutput | None
    """The request's response_format (one of `processors`): it wins where constraints conflict."""
    plain_greedy: bool
    """Greedy with nothing else on its row (no penalties, processors, logprobs, bias or
    min_tokens): a batch of such rows is one argmax."""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    """Computed but not yet reported by the engine."""
    error: str | None = None
    """Why the request's row could not be sampled, once it could not."""

    @classmethod
    def build(cls, params: SamplingParams, processors: list[LogitsProcessor], eos_token_ids: Sequence[int],
              vocab_size: int, device: torch.device, num_output_tokens: int = 0) -> SamplingState:
        """The state of a request with `params`; ValueError for a logit_bias id outside the
        vocabulary. `num_output_tokens`: output the request already has (continued after an
        engine died): a seeded generator skips the numbers those tokens drew (one each, see
        `sampling_ops.sample_rows`), so it draws what it would have drawn."""
        # [ZH-START]
        # 1. blocked = stop_token_ids + （除非 ignore_eos）模型的 EOS id 列表。
        # 2. logit_bias 里有 id >= vocab_size 就抛 ValueError（add_request 时就拒绝，不等到采样）。
        # 3. 非 greedy 且给了 seed：建一个只属于这个请求的 Generator(seed)，
        #    并跳过已有输出抽过的 num_output_tokens 个随机数（续写时与没中断一样）。
        # 4. 只有 min_tokens > 0 时才建 min_tokens_blocked 张量；有 bias 才建 bias_ids /
        #    bias_values，都放在采样器的设备上，之后每步直接 index_fill_ / index_add_；
        #    processors 里的 StructuredOutput 另记为 grammar；plain_greedy 一次算好。
        # [ZH-END]
        blocked = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))
        bias = [(t, b) for t, b in params.logit_bias.items() if t < vocab_size]
        if len(bias) < len(params.logit_bias):
            raise ValueError(f"logit_bias has a token id outside the vocabulary [0, {vocab_size})")
        generator = None
        if params.seed is not None and not params.is_greedy:
            generator = torch.Generator(device=device).manual_seed(params.seed)
            for _ in range(num_output_tokens):
                torch.rand(1, dtype=torch.float64, device=device, generator=generator)
        min_tokens_blocked = None
        if params.min_tokens:
            min_tokens_blocked = torch.tensor([t for t in blocked if t < vocab_size], dtype=torch.long, device=device)
        return cls(
            processors=list(processors),
            min_tokens_blocked=min_tokens_blocked,
            bias_ids=torch.tensor([t for t, _ in bias], dtype=torch.long, device=device) if bias else None,
            bias_values=torch.tensor([b for _, b in bias], dtype=torch.float32, device=device) if bias else None,
            generator=generator,
            grammar=next((p for p in processors if isinstance(p, StructuredOutput)), None),
            plain_greedy=params.is_greedy and not (params.has_penalties or processors or params.logprobs is not None
                                                   or bias or params.min_tokens),
        )

    def take_logprobs(self) -> list[TokenLogprobs]:
        """The logprobs computed since the last call."""
        out, self.logprobs = self.logprobs, []
        return out

    def take_error(self) -> str | None:
        """Why the request's last row could not be sampled, or None."""
        out, self.error = self.error, None
        return out


class SampledRow(Protocol):
    """What the sampler reads of each row it samples: an engine `Sequence` (the sampler does not
    import the engine; the engine uses the layers, not the other way round)."""
    request_id: str
    params: SamplingParams
    sampling: SamplingState | None
    token_ids: list[int]

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def num_output_tokens(self) -> int: ...
