"""A request inside the engine, all of it in one object: its tokens, its KV blocks, how far it
has run, its frozen sampling parameters and its sampling state (`SamplingState`: processors, seed
generator, bias tensors, logprobs and errors not yet reported). The scheduler, the block manager
and the sampler read and write its fields; the engine builds it in `add_request` and drops it when
the request ends, and nothing else keeps a table of requests beside it."""
# [ZH-START]
# 【模块定位】一个请求在引擎里的全部状态，各部件共享的那份数据：Sequence（token、块表、进度、
# 冻结的 SamplingParams）和挂在它身上的 SamplingState（采样跨步要记的东西）。
# 整个服务：客户端 → 分词进程 → 引擎进程（LLMEngine.add_request 在这里创建 Sequence）
#   → 反分词进程 → 客户端。
# 引擎一步之内谁碰它：
#   Scheduler.schedule ─按 status 在 waiting 堆 / running 列表之间搬动→ BlockManager
#     改 block_table 等
#   → StepInput.from_scheduled 读 token_ids、block_table、num_computed_tokens 组本步输入
#   → Sampler 读 params 和 sampling（本模块的 SamplingState：processors、种子、logprobs……）
#   → Scheduler.advance 推进 num_computed_tokens、在 token_ids 末尾放占位 token，
#     Scheduler.settle 把读回的 token 换进去
# 状态机：
#   WAITING ─schedule 接纳→ RUNNING ─stop / length / error→ FINISHED
#      ▲                       │
#      └────被抢占（_preempt）─┘        （任何状态下 abort 都直接进 FINISHED）
# [ZH-END]
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Sequence as Seq

import torch

from nanovllm.engine.speculative import SpecState
from nanovllm.layers.logits_processors import LogitsProcessor
from nanovllm.layers.logprobs import TokenLogprobs
from nanovllm.sampling_params import SamplingParams
from nanovllm.structured import StructuredOutput
from nanovllm_client.protocol import FinishReason



class SequenceStatus(Enum):
    # [ZH-START]
    # 只有三个状态，没有单独的"被抢占"：抢占就是 RUNNING → WAITING，块全部释放，之后重算。
    # FINISHED 是终态，原因在 Sequence.finish_reason
    # （FinishReason：STOP / LENGTH / ABORT / ERROR）。
    # [ZH-END]
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    # [ZH-START]
    # 职责：保存一个请求在引擎里的全部状态——token（prompt + 已生成的输出）、调度状态、
    # KV 块表、几个进度计数、冻结的 SamplingParams 和采样状态 sampling（SamplingState）。
    # 不做的事：除了 num_tokens 等几个只读属性，没有逻辑。不分配块、不做调度、不采样，
    # 这些由 BlockManager、Scheduler、Sampler 完成，它们直接读写这里的字段（所以字段名就是接口）。
    # 和谁打交道：LLMEngine 创建它（连同 SamplingState）并在 requests 里按 request_id 索引；
    # Scheduler、BlockManager 修改它；StepInput 读它组批；Sampler 读 params、sampling、token_ids。
    # [ZH-END]
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival: int,
                 priority: int = 0, sampling: SamplingState | None = None, client: str = ""):
        # [ZH-START]
        # 1. token_ids 复制一份 prompt，之后的输出 token 直接追加在后面；num_prompt_tokens 记 prompt
        #    长度，所以输出就是 token_ids[num_prompt_tokens:]。
        # 2. arrival：LLMEngine 递增分配的到达序号（FCFS 的排序键）；arrival_time 记单调时钟，
        #    首次被调度时写 first_scheduled_time，两者之差就是排队时间（抢占后重新接纳不再改）。
        # 3. priority 只在 "priority" 策略下起作用；client 是公平分享的单位（"fair" 策略按它轮流），
        #    fair_tag 由 FairPolicy 第一次看到它时写下；status = WAITING，
        #    finish_reason = None，block_table 为空；sampling 是引擎建好的 SamplingState
        #    （只排队、不采样的测试可以不给，采样时没有就报错）。
        # 4. 进度计数都从 0 开始：
        #    num_computed_tokens：K/V 已在缓存里的 token 数，prefill 分块时每步往前推；
        #    num_cached_tokens：最近一次接纳时前缀缓存命中的 token 数；
        #    block_hashes：前面各满块的链式哈希，算一次存一次；
        #    num_registered_blocks：已登记进前缀缓存的前导块数；
        #    num_sent_tokens：step() 已经报告给调用方的输出 token 数。
        # 5. spec：投机解码的状态（n-gram 索引、接受率），第一次可能草稿时由 Scheduler 建。
        # [ZH-END]
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params
        self.sampling = sampling
        """What sampling keeps of it between steps (`SamplingState`); the engine builds it, and a
        row without one cannot be sampled."""
        self.arrival = arrival
        """Arrival order (the FCFS key)."""
        self.arrival_time = time.monotonic()
        """When the request was added (monotonic clock), for its queue time."""
        self.first_scheduled_time: float | None = None
        """When it was first admitted (monotonic); re-admissions after a preemption keep it."""
        self.priority = priority
        """Higher runs first under the priority scheduling policy."""
        self.client = client
        """Who sent it: the unit the "fair" scheduling policy shares the engine between."""
        self.fair_tag: int | None = None
        """Its virtual start time under the "fair" policy, set when that policy first sees it."""
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        """Tokens whose K/V are in the cache."""
        self.num_cached_tokens = 0
        """Prompt tokens served from the prefix cache at the last admission."""
        self.block_hashes: list[int] = []
        """Chained hashes of the leading full blocks, computed once and reused."""
        self.num_registered_blocks = 0
        """Leading blocks already offered to the prefix cache."""
        self.num_sent_tokens = 0
        """Output tokens already reported by `step()`."""
        self.spec: SpecState | None = None
        """Speculative decoding's state (n-gram index, acceptance estimate), made when it first
        may draft."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_logprob_start(self) -> int | None:
        """The first position whose logits give a prompt logprob still to compute (position p
        scores prompt token p + 1), or None when the request asked for none or has them all."""
        if self.params.prompt_logprobs is None or self.sampling is None:
            return None
        start = self.sampling.num_prompt_logprobs
        return start if start < self.num_prompt_tokens - 1 else None

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")


@dataclass(slots=True, eq=False)  # a holder of mutable state: the same object, not equal values
class SamplingState:
    """One request's sampling state: its processors, its bias and min_tokens tensors on the
    sampler's device, its own generator when seeded, and what a step left for the engine to
    report (logprobs, or why its row could not be sampled)."""
    # [ZH-START]
    # 【职责】一个请求跨步的采样状态：logits processors（其中的 StructuredOutput 另记为 grammar，
    # 约束冲突时语法优先）、预先建好的张量（min_tokens 期间要屏蔽的 id、logit_bias 的 id 与值）、
    # 有种子时自己的 Generator、尚未上报的 logprobs 和 prompt logprobs（及已算到第几个
    # prompt 位置）、采样失败的原因；on_device / plain_greedy
    # 在建的时候算好一次（SamplingParams 是冻结的，不会再变）。
    # 【边界】不保存 token 序列、不知道请求何时开始结束：这些在 Sequence 和 LLMEngine。
    # 【协作者】LLMEngine.add_request 用 build 建好挂到 Sequence.sampling；
    # Sampler 与 constraints 每步读写；
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
    on_device: bool
    """No logits processors (response_format among them), logprobs or min_tokens: penalties,
    logit_bias, temperature and filters only, so its row is sampled on the device without the
    host reading anything back (`Sampler.sample_on_device`; the overlapped step, `LLMEngine`)."""
    plain_greedy: bool
    """Greedy with nothing else on its row (no penalties, processors, logprobs, bias or
    min_tokens): a batch of such rows is one argmax."""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    """Computed but not yet reported by the engine."""
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    """Prompt tokens' logprobs (`SamplingParams.prompt_logprobs`) computed but not yet reported."""
    num_prompt_logprobs: int = 0
    """Prompt positions scored so far (position p scores token p + 1; the first token is given)."""
    error: str | None = None
    """Why the request's row could not be sampled, once it could not."""

    @classmethod
    def build(cls, params: SamplingParams, processors: list[LogitsProcessor], eos_token_ids: Seq[int],
              vocab_size: int, device: torch.device, num_output_tokens: int = 0) -> SamplingState:
        """The state of a request with `params`; ValueError for a logit_bias id outside the
        vocabulary. `num_output_tokens`: output the request already has (continued after an
        engine died): a seeded generator skips the numbers those tokens drew (one each, see
        `sampling_ops.sample_rows`), so it draws what it would have drawn."""
        # [ZH-START]
        # 1. logit_bias 里有 id >= vocab_size 就抛 ValueError（add_request 时就拒绝，不等到采样）。
        # 2. 非 greedy 且给了 seed：建一个只属于这个请求的 Generator(seed)，
        #    并跳过已有输出抽过的 num_output_tokens 个随机数（续写时与没中断一样）。
        # 3. 只有 min_tokens > 0 时才建 min_tokens_blocked 张量（stop_token_ids + 除非 ignore_eos
        #    模型的 EOS id，min_tokens 之前屏蔽）；有 bias 才建 bias_ids /
        #    bias_values，都放在采样器的设备上，之后每步直接 index_fill_ / index_add_；
        #    processors 里的 StructuredOutput 另记为 grammar；on_device（没有 processors、
        #    logprobs、prompt_logprobs、min_tokens，可在设备上采样）和 plain_greedy（on_device、
        #    greedy，且没有惩罚和 bias）一次算好。
        # [ZH-END]
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
            blocked = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))
            min_tokens_blocked = torch.tensor([t for t in blocked if t < vocab_size], dtype=torch.long, device=device)
        on_device = not (processors or params.logprobs is not None or params.prompt_logprobs is not None
                         or params.min_tokens)
        return cls(
            processors=list(processors),
            min_tokens_blocked=min_tokens_blocked,
            bias_ids=torch.tensor([t for t, _ in bias], dtype=torch.long, device=device) if bias else None,
            bias_values=torch.tensor([b for _, b in bias], dtype=torch.float32, device=device) if bias else None,
            generator=generator,
            grammar=next((p for p in processors if isinstance(p, StructuredOutput)), None),
            on_device=on_device,
            plain_greedy=on_device and params.is_greedy and not (params.has_penalties or bias),
        )

    def take_logprobs(self) -> list[TokenLogprobs]:
        """The logprobs computed since the last call."""
        out, self.logprobs = self.logprobs, []
        return out

    def take_prompt_logprobs(self) -> list[TokenLogprobs]:
        """The prompt logprobs computed since the last call."""
        out, self.prompt_logprobs = self.prompt_logprobs, []
        return out

    def take_error(self) -> str | None:
        """Why the request's last row could not be sampled, or None."""
        out, self.error = self.error, None
        return out
