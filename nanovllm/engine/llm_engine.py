"""The step API: add requests, abort them, advance the whole batch one step at a time.

This is what the engine stage wraps and what the offline `LLM` drives in a loop. Every request
ends with exactly one output whose `finished` is True: on a stop token, on a length limit,
(reported by the next `step()`) after `abort`, or with `FinishReason.ERROR` when its own sampling
failed (its logits processor raised, its logits went NaN): other requests carry on. A request is
one object here (`Sequence`): its tokens, blocks, frozen `SamplingParams` and sampling state. Post-step
hooks (hooks.py) see a metrics snapshot after every step; the scheduling policy (policy.py)
orders admission and preemption.
"""
# [ZH-START]
# 【模块定位】引擎的"一步 API"：add_request / abort / step，把各部件装成一台能一步步推进的机器。
# 整个服务：
#   客户端 → tokenizer_proc → engine_proc（在 step 线程上调用本模块的 LLMEngine）
#     → detok_proc → 客户端
# 离线使用时 nanovllm.LLM 在进程内循环调用 step()，不经过任何进程和 ZeroMQ。
# 一次 step() 内部：
#   _aborted 里的终止输出 → Scheduler.schedule()（向 BlockManager 要块）
#   → Sampler.prepare（语法掩码与前向并行）→ ModelRunner.run()（前向，要采样的行的 logits）
#   → Sampler（每行一个 token）→ Scheduler.advance()（推进进度、commit、放占位 token）
#   → Scheduler.settle()（占位换成 token、判断结束；重叠调度时晚一步，在下一步发射之后）
#   → 每个有新 token 或刚结束的请求一条 RequestOutput → post-step hooks（指标）
# 约定：每个请求恰好有一条 finished=True 的输出（FinishReason：STOP / LENGTH / ABORT / ERROR）。
# 一个请求在引擎里就是一个 Sequence：token、块表、冻结的 SamplingParams 和采样状态都在它身上。
# [ZH-END]
from __future__ import annotations

import json
import importlib
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.heap import release_free_heap
from nanovllm.engine.hooks import PostStepHook, PostStepHooks, StepMetrics
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.policy import SchedulerPolicy, make_policy
from nanovllm.engine.sampler import SAMPLE_FAILED, Sampler
from nanovllm.engine.scheduler import ScheduledSeq, Scheduler
from nanovllm.engine.sequence import SamplingState, Sequence
from nanovllm.engine.speculative import Speculator
from nanovllm.layers.host_copy import Download
from nanovllm.layers.logits_processors import WordIndex, build_logits_processors
from nanovllm.layers.logprobs import TokenLogprobs
from nanovllm.layers.token_bytes import token_byte_table
from nanovllm.structured import StructuredOutput, ll_tokenizer
from nanovllm.structured.cache import GrammarCache
from nanovllm.models.loader import is_gguf, read_hf_config, resolve_model_path
from nanovllm.models.model_config import ModelConfig, resolve_max_model_len
from nanovllm.sampling_params import SamplingParams
from nanovllm_client.checks import prompt_too_long, show
from nanovllm_client.protocol import FinishReason



@dataclass(slots=True)
class StepStats:
    """What the last step computed."""
    # [ZH-START]
    # 上一步算了什么：prefill / decode 的 token 数、序列数、采样出的 token 数、
    # 首次被调度的序列的排队时间。
    # 只用于指标（_metrics → post-step hooks），不影响调度。
    # [ZH-END]
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_seqs: int = 0
    num_generated_tokens: int = 0
    """Tokens sampled (a prompt chunk that completes its prompt samples one too)."""
    queue_times_s: tuple[float, ...] = ()
    """For each sequence scheduled for the first time: seconds since its `add_request`."""


@dataclass(slots=True)
class RequestOutput:
    # [ZH-START]
    # step() 交给调用方的一条输出：只带本步新增的 token（new_token_ids，增量）和计数，不带文本——
    # 文本在反分词进程（或离线 LLM 里）才解码。finished 为真时 finish_reason（FinishReason）
    # 必有值，error 只在 ERROR 时有值（abort 也可能带原因）；logprobs 每个新 token 一项
    # （请求要了才有）；prompt_logprobs（请求要了才有）是 prompt 每个 token 一项，全在请求的
    # 第一条输出上；第一个 token 是给定的、不是预测的：logprob 为 0、没有候选。
    # engine_proc 把一步的所有 RequestOutput 打包成一个 StepOutput 帧发给 detok_proc。
    # [ZH-END]
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    """Why it ended, once finished (a str-valued enum: "stop", "length", "abort", "error")."""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    """One entry per new token when the request asked for logprobs."""
    error: str | None = None
    """Why the request failed, with FinishReason.ERROR (e.g. its logits processor raised)."""
    prompt_logprobs: list[TokenLogprobs] | None = None
    """With `SamplingParams.prompt_logprobs`: an entry per prompt token, all on the request's first
    output (None on the others). The first token is given, not predicted: its entry has logprob 0
    and no alternatives."""


@dataclass(slots=True)
class LaunchedStep:
    """A step whose forward and sampling were launched and whose tokens are not yet settled."""
    # [ZH-START]
    # 已经发射（前向 + 采样）、结果还没落地的一步：settle 它所需要的一切。
    # tokens 不为 None 时是重叠调度在设备上采样的结果，download 把它和每行最大的 logit（失败时
    # 就是原因：NaN / +inf / -inf）异步拷回 pinned 内存，host 要用时才等。
    # 同步的一步（有需要 host 采样的请求）tokens 为 None，sampled 直接是 token 列表。
    # [ZH-END]
    scheduled: list[ScheduledSeq]
    rows: list[Sequence]
    """The sequences it samples for, in row order."""
    sampled: list[int] | None = None
    """Their tokens, when sampled on the host path (`Sampler.__call__`)."""
    tokens: torch.Tensor | None = None
    """(len(rows),) on the device, when sampled there (`Sampler.sample_on_device`)."""
    download: Download | None = None
    """`tokens` and each row's largest logit (which says why a row failed) on their way to host memory."""


class LLMEngine:
    # [ZH-START]
    # 职责：装配 ModelRunner、BlockManager、Scheduler（含策略）、Sampler；
    # 校验并接收请求（建 Sequence 和它的采样状态）；一步步推进整个批：调度 → 前向 → 采样 →
    # 推进，把结果整理成 RequestOutput。
    # 不做的事：不 tokenize / detokenize、不匹配 stop string、不碰网络（三个进程阶段的事）；
    # 不自己跑主循环——由调用方（engine_proc 的 step 线程，或 LLM.generate）反复调 step()。
    # 和谁打交道：上游 engine_proc / LLM；下游 Scheduler、BlockManager、ModelRunner（只做前向）、
    # Sampler（引擎自己持有；每请求的状态在 Sequence 上，采样器没有按 id 的表）。
    # requests：request_id → Sequence（请求的全部状态，采样状态也在上面），只放活着的请求
    # （abort 时立刻移出）；
    # _aborted：已 abort、等下一步报告终止输出的序列；
    # _pending：重叠调度时上一次发射、还没 settle 的一步（LaunchedStep）；
    # _host_sampled：需要 host 采样的活请求的 id，非空时每一步都同步执行。
    # [ZH-END]
    def __init__(self, config: Config | None = None, *, scheduler_policy: str | SchedulerPolicy | None = None, **kwargs):
        # [ZH-START]
        # 1. config：传了 Config 就用，否则用 kwargs 构造（Config.__post_init__ 校验各项）。
        # 2. 解析模型路径，读 HF config.json 得到 ModelConfig，定下 max_model_len。
        # 3. ModelRunner：加载权重、按内存预算分配 KV cache，给出块数 runner.num_blocks；
        #    Sampler(词表, 设备, seed)，CPU 上用 runner 编译好的算子（sample_ops）抽样。
        # 4. BlockManager(runner.num_blocks, block_size, enable_prefix_caching)。
        # 5. eos_token_ids = 模型 config 的 eos + generation_config.json 里额外的
        #    eos（去重，GGUF 不读）。
        # 6. speculative == "ngram" 时建 Speculator（草稿长度上限、n-gram 长度、每行代价），
        #    否则 None；
        #    Scheduler：max_num_seqs、max_num_batched_tokens、max_model_len、eos，
        #    策略 make_policy(scheduler_policy)，speculator。
        # 7. 请求表、_aborted、到达计数 _arrivals、last_step / num_steps、post-step hooks 初始化；
        #    overlap = config.overlap_scheduling，为 None 时按设备定（CUDA 且单 rank、
        #    没开投机解码才开：验证要在 host 上逐位比较，同步执行），
        #    _pending = None，_host_sampled 为空集。
        # 8. start_word_index：先在本线程 import 加载分词器要用的 transformers 模块
        #    （两个线程同时 import transformers 的惰性模块不安全），再由后台线程加载分词器、
        #    建 string banned_words 用的词表字节索引（WordIndex）：加载要几秒，不能卡在
        #    add_request 所在的 step 线程上。
        # 9. _grammar_cache 先留空、配 _grammar_lock：response_format 的编译结果按文本缓存，
        #    第一次用到时才建（要等词表视图），引擎的输入线程和 step 线程都会用它。
        # [ZH-END]
        self.config = config = config or Config(**kwargs)
        self.model_path = resolve_model_path(config.model)
        self.model_config = ModelConfig.from_hf_dict(read_hf_config(self.model_path))
        self.max_model_len = resolve_max_model_len(config.max_model_len, self.model_config)
        self.runner = ModelRunner(config, self.model_config, self.model_path)
        self.sampler = Sampler(self.model_config.vocab_size, self.runner.device, config.seed,
                               cpu_ops=self.runner.sample_ops)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.eos_token_ids = self.model_config.eos_token_ids + self._generation_eos_ids()
        self.speculator = (Speculator(config.speculative_tokens, config.speculative_ngram_min,
                                      config.speculative_ngram_max, config.speculative_row_cost)
                           if config.speculative == "ngram" else None)
        """Proposes drafted tokens (Config.speculative), or None."""
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, self.eos_token_ids, make_policy(scheduler_policy),
                                   config.kv_watermark, config.preempt_ratio, speculator=self.speculator)
        self.requests: dict[str, Sequence] = {}
        self._aborted: list[Sequence] = []
        self.overlap = (config.overlap_scheduling if config.overlap_scheduling is not None
                        else self.runner.device.type == "cuda" and config.tensor_parallel_size == 1
                        and self.speculator is None)
        """Whether steps overlap (Config.overlap_scheduling, resolved for this device)."""
        self._pending: LaunchedStep | None = None
        """The overlapped step launched last, settled by the next `step()`."""
        self._host_sampled: set[str] = set()
        """Live requests whose rows need the host's sampler (not `SamplingState.on_device`):
        while there is one, steps do not overlap."""
        self._arrivals = 0
        self.last_step = StepStats()
        self.num_steps = 0
        self.post_step_hooks = PostStepHooks()
        # Loading a tokenizer takes seconds, and add_request runs on the step loop (the engine
        # stage's thread): the index for string banned words is built now, off that loop.
        self._word_index = start_word_index(self.model_path, self.model_config.vocab_size, self.runner.device)
        self._grammar_cache: GrammarCache | None = None
        self._grammar_lock = threading.Lock()
        """Compiled response formats by text (`compile_response_format`), once the vocabulary view exists."""

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def _generation_eos_ids(self) -> tuple[int, ...]:
        path = os.path.join(self.model_path, "generation_config.json")
        if is_gguf(self.model_path) or not os.path.isfile(path):
            return ()
        with open(path, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
        ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        return tuple(i for i in ids if i not in self.model_config.eos_token_ids)

    # -- requests ----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    priority: int = 0, output_prefix: list[int] | None = None, client: str = "") -> None:
        """Queue a request; raises ValueError naming the problem if it can never be served.

        `priority` matters under the "priority" scheduling policy: higher runs first. `client`
        (who sent it) under the "fair" one: clients take turns.
        `output_prefix`: output the request already has (a stream continued after the engine that
        ran it died). It counts as output (`max_tokens`, `min_tokens`, penalties, usage), is
        prefilled with the prompt, and is reported again with the first new token; greedy and
        seeded requests go on as they would have (up to the rounding difference between
        prefilling the prefix and having decoded it, as after a preemption).
        """
        # [ZH-START]
        # 1. params 缺省为 SamplingParams()。
        # 2. 校验（都在改动任何状态之前，失败抛 ValueError 说明原因）：request_id 没被占用；
        #    priority 是 int（bool 不算）；_validate_prompt：prompt 非空、长度 < max_model_len、
        #    每个 id 在 [0, vocab_size)。
        # 3. longest = min(len(prompt) + max_tokens, max_model_len)；blocks_for(longest)
        #    超过整个 cache 的块数
        #    → ValueError：这种请求永远放不下，接进来只会被反复抢占。
        # 4. build_logits_processors 为它构造 logits 处理器，SamplingState.build 建采样状态
        #    （bias / min_tokens 张量、有种子时自己的 Generator）。
        # 5. 创建 Sequence(params, sampling=状态, client)（arrival = _arrivals，
        #    随后 _arrivals += 1），放进 requests；采样状态不是 on_device（要 host 采样）
        #    就记进 _host_sampled；scheduler.add 入 waiting 堆。
        # 6. 续写（output_prefix，引擎死后客户端把已收到的输出发回来）：先校验（比 max_tokens 少、
        #    prompt + 前缀 < max_model_len、id 在词表内），再接到 token_ids 后面——
        #    它们算输出（num_prompt_tokens 不变），和被抢占的序列一样整段 prefill；有种子的
        #    Generator 前进 len(prefix) 个数（每个 token 恰好一个），所以续写与没中断时一样（只差
        #    prefill 与 decode 的舍入差异，与抢占后重算相同）；num_sent_tokens = 0：
        #    第一个新 token 和前缀一起报告。
        # [ZH-END]
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {show(request_id)} is already in use")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer (higher runs first), got {show(priority)}")
        self._validate_prompt(prompt_token_ids)
        prefix = list(output_prefix or ())
        if prefix:
            self._validate_output_prefix(prompt_token_ids, prefix, params)
        longest = min(len(prompt_token_ids) + params.max_tokens, self.max_model_len)
        if self.block_manager.blocks_for(longest) > self.block_manager.num_total_blocks:
            raise ValueError(
                f"request needs up to {longest} tokens of KV cache but the cache holds only "
                f"{self.block_manager.num_total_blocks * self.config.block_size}; lower max_tokens or enlarge the cache"
            )
        vocab, device = self.model_config.vocab_size, self.runner.device
        processors = build_logits_processors(params, vocab, device, self._words, self._structured)
        sampling = SamplingState.build(params, processors, self.eos_token_ids, vocab, device, len(prefix))
        seq = Sequence(request_id=request_id, prompt_token_ids=prompt_token_ids, params=params, arrival=self._arrivals,
                       priority=priority, sampling=sampling, client=client)
        seq.token_ids.extend(prefix)
        self._arrivals += 1
        self.requests[request_id] = seq
        if not sampling.on_device:
            self._host_sampled.add(request_id)
        self.scheduler.add(seq)

    def _validate_output_prefix(self, prompt: list[int], prefix: list[int], params: SamplingParams) -> None:
        if len(prefix) >= params.max_tokens:
            raise ValueError(f"the output to continue from has {len(prefix)} tokens, max_tokens is {params.max_tokens}: "
                             "the request is complete")
        if len(prompt) + len(prefix) >= self.max_model_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) and the output to continue from ({len(prefix)}) leave no "
                             f"room for another token within max_model_len {self.max_model_len}")
        self._check_in_vocabulary("output", prefix)

    def _validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt is empty: at least one token is needed")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(prompt_too_long(len(prompt_token_ids), self.max_model_len))
        self._check_in_vocabulary("prompt", prompt_token_ids)

    def _check_in_vocabulary(self, what: str, token_ids: list[int]) -> None:
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab)), None)
        if bad is not None:
            raise ValueError(f"{what} token id {show(bad)} is outside the vocabulary [0, {vocab})")

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks now; idempotent. True if it was live."""
        # [ZH-START]
        # 1. 从 requests 弹出；不存在（未知 id 或已结束）→ 返回 False（幂等）；
        #    同时移出 _host_sampled。
        # 2. scheduler.finish(seq, FinishReason.ABORT)：KV 块立刻释放、标记 FINISHED（末尾还是占位
        #    token 的话去掉：重叠调度时它那一行的结果会被丢弃）；队列里的条目之后惰性清理。
        #    采样状态在 Sequence 身上，同一个 request_id 在下一步之前就被复用也不会串。
        # 3. 追加到 _aborted：下一次 step() 开头为它产出唯一的终止输出（ABORT）。
        # 4. 返回 True。整个过程 O(1)，不扫描任何队列。
        # [ZH-END]
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        self._host_sampled.discard(request_id)
        self.scheduler.finish(seq, FinishReason.ABORT)
        self._aborted.append(seq)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._aborted)

    # -- stepping ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; return an output for every request that advanced or ended.

        Overlapped (`self.overlap`), a step launches its forward and sampling on the device, then
        settles the step before it while the device runs, and leaves its own tokens on the device
        until the next call: outputs come one call later, and a request that stops is computed
        for one more step whose token is dropped. A step runs synchronously instead (the one in
        flight settled first) while some live request needs the host's sampler, or when the
        next schedule would preempt."""
        # [ZH-START]
        # 1. 先为 _aborted 里的每个序列生成终止输出，清空 _aborted。
        # 2. 上一步还在飞（_pending），而这一步不能重叠：有需要 host 采样的请求（_host_sampled：
        #    logprobs、min_tokens、processors、语法），或调度将要抢占（被抢占的序列要
        #    重算，需要真 token）→ 先 _settle 它（等设备、读回 token）。
        # 3. scheduled = scheduler.schedule()；统计 decode / prefill token 数：decode 是
        #    num_computed_tokens >= num_prompt_tokens 的项，各 1 + len(draft) 个；
        #    抢占后重新接纳的从 0 重算，算 prefill。
        # 4. 有调度项就 _launch：前向 + 采样都发射出去（重叠时 token 留在设备上，下一步的输入
        #    直接在设备上取用上一步的 token）。
        # 5. 再 _settle 上一步（重叠的正是这里：host 读上一步的结果、出输出时，设备在跑这一步）。
        # 6. scheduler.advance(本步)：进度前移、采样的序列末尾放占位 token；重叠时本步成为
        #    _pending，留给下一次 step()；否则（同步）立刻 _settle。
        # 7. 记 last_step = StepStats(...)（generated 是本次 settle 落地的 token 数），
        #    num_steps += 1，有 hook 就把本步耗时和指标快照交给它们，返回 outputs。
        # [ZH-END]
        start = time.perf_counter()
        outputs = [self._output(seq) for seq in self._aborted]
        self._aborted.clear()
        generated = 0
        if self._pending is not None and (self._host_sampled or self.scheduler.must_preempt()):
            generated += self._settle(self._pending, outputs)  # this step needs its tokens on the host
            self._pending = None
        scheduled = self.scheduler.schedule()
        decode_tokens = sum(1 + len(s.draft) for s in scheduled
                            if s.seq.num_computed_tokens >= s.seq.num_prompt_tokens)
        prefill_tokens = sum(s.num_new_tokens for s in scheduled) - decode_tokens
        launched = self._launch(scheduled) if scheduled else None
        if self._pending is not None:  # the device runs `launched` meanwhile
            generated += self._settle(self._pending, outputs)
            self._pending = None
        if launched is not None:
            self.scheduler.advance(launched.scheduled)
            if launched.tokens is not None:
                self._pending = launched
            else:
                generated += self._settle(launched, outputs)
        self.last_step = StepStats(num_prefill_tokens=prefill_tokens, num_decode_tokens=decode_tokens,
                                   num_seqs=len(scheduled), num_generated_tokens=generated,
                                   queue_times_s=tuple(self.scheduler.queue_times))
        self.num_steps += 1
        if self.post_step_hooks:
            self.post_step_hooks.run(self._metrics(time.perf_counter() - start))
        return outputs

    def _launch(self, scheduled: list[ScheduledSeq]) -> LaunchedStep:
        """The step's forward and sampling: on the device with nothing read back when overlapping
        (no live request needs the host's sampler), else sampled on the host path."""
        rows = [item.seq for item in scheduled for _ in range(item.num_samples)]  # a verification: 1 + k rows
        previous = self._pending.tokens if self._pending is not None else None
        launched = LaunchedStep(scheduled, rows)
        if self.overlap and not self._host_sampled:
            logits = self.runner.run(scheduled, previous)  # (len(rows), V), or None when no row samples
            if rows:
                launched.tokens, best = self.sampler.sample_on_device(logits, rows, previous)
                launched.download = Download(launched.tokens, best)
            else:
                launched.sampled = []
        else:
            self.sampler.prepare(rows)  # grammar masks, computed while the forward runs
            logits = self.runner.run(scheduled, previous)
            launched.sampled = self.sampler(logits, rows) if rows else []
            self._keep_prompt_logprobs(scheduled)
        return launched

    def _keep_prompt_logprobs(self, scheduled: list[ScheduledSeq]) -> None:
        """Hand the step's prompt logprobs (`ModelRunner.take_prompt_logprobs`, in the order of the
        items' `prompt_logprob_span`s) to their requests; called before `Scheduler.advance`."""
        entries = self.runner.take_prompt_logprobs()
        at = 0
        for item in scheduled:
            if item.prompt_logprob_span is not None:
                offset, count = item.prompt_logprob_span
                seq, first = item.seq, item.seq.num_computed_tokens + offset
                if first == 0:  # the first token is given, not predicted: logprob 0, no alternatives
                    seq.sampling.prompt_logprobs.append(TokenLogprobs(token_id=seq.token_ids[0], logprob=0.0, rank=1,
                                                                    top_token_ids=[], top_logprobs=[]))
                seq.sampling.prompt_logprobs.extend(entries[at:at + count])
                seq.sampling.num_prompt_logprobs = first + count
                at += count

    def _settle(self, launched: LaunchedStep, outputs: list[RequestOutput]) -> int:
        """Land a launched step (`Scheduler.advance` ran for it): its tokens into its sequences,
        an output for each request it advanced or ended, appended to `outputs`. Returns the
        number of tokens landed."""
        # [ZH-START]
        # 1. 设备上采样的：download.wait() 等拷贝完成，读出 token 和每行最大的 logit；SAMPLE_FAILED
        #    的行（序列还活着）由那个值说明原因（record_failure，记进 sampling.error）。
        #    host 上采样的：直接用 sampled。
        # 2. scheduler.settle：占位换成 token、commit 前缀缓存、判定结束。
        # 3. 对每个调度项：序列还是 requests 里的这一个（没被 abort、没在前面报告过结束）
        #    且有未报告的输出 token 或刚结束 → _output 产出一条；结束的从 requests 和 _host_sampled
        #    删除（采样状态随 Sequence 一起走）。prompt 中间分块的项没有输出。
        # [ZH-END]
        if launched.sampled is not None:
            sampled = launched.sampled
        else:
            sampled, best = launched.download.wait()
            for i, token in enumerate(sampled):
                seq = launched.rows[i]
                if token == SAMPLE_FAILED and not seq.is_finished:
                    self.sampler.record_failure(seq, best[i])
        generated = self.scheduler.settle(launched.scheduled, sampled)
        for item in launched.scheduled:
            seq = item.seq
            if self.requests.get(seq.request_id) is not seq:
                continue  # aborted (reported then), or ended by the step before (reported then)
            if seq.num_output_tokens > seq.num_sent_tokens or seq.is_finished:
                outputs.append(self._output(seq))
                if seq.is_finished:
                    del self.requests[seq.request_id]
                    self._host_sampled.discard(seq.request_id)
        return generated

    def _output(self, seq: Sequence) -> RequestOutput:
        # [ZH-START]
        # 1. new = 还没报告的输出 token：token_ids[num_prompt_tokens + num_sent_tokens:]；
        #    然后 num_sent_tokens = num_output_tokens。
        # 2. 请求要了 logprobs：seq.sampling.take_logprobs()（取走即清），否则 None；
        #    要了 prompt logprobs：take_prompt_logprobs()，算完 prompt 后的第一条输出带走全部，
        #    之后为空（None）。
        # 3. finish_reason 是 ERROR 时 error = seq.sampling.take_error()，
        #    取不到就写 "sampling failed"。
        # 4. 按关键字组装 RequestOutput：新 token、是否结束及原因、prompt / 输出 / 前缀缓存命中的
        #    token 数、logprobs、error。
        # [ZH-END]
        new = seq.token_ids[seq.num_prompt_tokens + seq.num_sent_tokens:]
        seq.num_sent_tokens = seq.num_output_tokens
        logprobs = seq.sampling.take_logprobs() if seq.params.logprobs is not None else None
        prompt = seq.sampling.take_prompt_logprobs() if seq.params.prompt_logprobs is not None else []
        error = None
        if seq.finish_reason is FinishReason.ERROR:
            error = seq.sampling.take_error() or "sampling failed"
        return RequestOutput(request_id=seq.request_id, new_token_ids=new, finished=seq.is_finished,
                             finish_reason=seq.finish_reason, num_prompt_tokens=seq.num_prompt_tokens,
                             num_output_tokens=seq.num_output_tokens, num_cached_tokens=seq.num_cached_tokens,
                             logprobs=logprobs, error=error, prompt_logprobs=prompt or None)

    def _words(self) -> WordIndex:
        """The vocabulary's token bytes, for string `banned_words`; waits if still being built."""
        try:
            return self._word_index.result()
        except Exception as e:  # no tokenizer files: many kinds of errors
            raise ValueError(f"string banned_words need the model's tokenizer, which did not load ({str(e)[:300]}); "
                             "pass banned words as token-id lists instead") from None

    def _structured(self, fmt: dict) -> StructuredOutput:
        """The matcher for a request's response_format: a copy of its compiled grammar (cached by text),
        with the schema's check where it compiled leniently."""
        return self._grammars().structured(fmt)

    def _grammars(self) -> GrammarCache:
        try:
            index = self._words()
        except ValueError as e:
            raise ValueError(str(e).replace("string banned_words need", "response_format needs")) from None
        if index.ll_tokenizer is None:
            raise ValueError("response_format needs llguidance's view of the tokenizer, which did not build")
        with self._grammar_lock:  # the engine stage's input thread and the step loop both get here
            if self._grammar_cache is None:
                self._grammar_cache = GrammarCache(index.ll_tokenizer)
            return self._grammar_cache

    def compile_response_format(self, fmt: dict) -> bool:
        """Compile a checked response_format now (any thread; cached by its text), so that adding
        its request later only copies the result: ValueError naming the problem if it does not
        compile. False (nothing done) while the vocabulary view is still being built."""
        # [ZH-START]
        # 引擎侧的编译钩子（engine_proc 输入线程调用，不占 step 循环）：词表视图还在后台建 → 返回
        # False，由 add_request 在 step 循环上编译（同一个缓存）；否则经 GrammarCache
        # 编译或命中缓存，编译不过抛 ValueError（带原因，输入线程据此拒绝请求），成功返回 True。
        # [ZH-END]
        if not self._word_index.done():
            return False
        self._grammars().template(fmt)
        return True

    # -- monitoring ----------------------------------------------------------------------------

    def add_post_step_hook(self, fn: PostStepHook) -> PostStepHook:
        """Call `fn(StepMetrics)` after every step; a hook that raises is logged and removed."""
        return self.post_step_hooks.add(fn)

    def remove_post_step_hook(self, fn: PostStepHook) -> bool:
        return self.post_step_hooks.remove(fn)

    def _metrics(self, step_time_s: float) -> StepMetrics:
        bm, last = self.block_manager, self.last_step
        return StepMetrics(
            step=self.num_steps, num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            num_kv_blocks_used=bm.num_total_blocks - bm.num_free_blocks, num_kv_blocks_total=bm.num_total_blocks,
            prefix_cache_queries=bm.prefix_cache_queries, prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions, num_prefill_tokens=last.num_prefill_tokens,
            num_decode_tokens=last.num_decode_tokens, num_seqs=last.num_seqs, step_time_s=step_time_s,
            num_generated_tokens=last.num_generated_tokens, queue_times_s=last.queue_times_s,
            **self._spec_metrics(),
        )

    def _spec_metrics(self) -> dict:
        if self.speculator is None:
            return {}
        c = self.speculator.counters
        return dict(spec_decode_num_drafts=c.num_drafts, spec_decode_num_draft_tokens=c.num_draft_tokens,
                    spec_decode_num_accepted_tokens=c.num_accepted_tokens,
                    spec_decode_accepted_per_position=tuple(c.accepted_per_position))

    def close(self) -> None:
        """Stop tensor-parallel workers now (a finalizer does it at exit otherwise); idempotent."""
        self.runner.close()

    def reset_prefix_cache(self) -> int:
        """Forget every cached KV block no running request holds; returns how many
        (`BlockManager.reset_prefix_cache`)."""
        # [ZH-START]
        # 1. 交给 BlockManager.reset_prefix_cache：空闲表里带哈希的缓存块全部清掉，
        #    运行中请求持有的块不动。
        # 2. 在两步之间调用（engine_proc 主循环处理 control 消息时），不与本步的调度交错。
        # [ZH-END]
        return self.block_manager.reset_prefix_cache()

    def stats(self) -> dict:
        bm = self.block_manager
        return {
            "max_model_len": self.max_model_len,
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "num_free_blocks": bm.num_free_blocks,
            "num_total_blocks": bm.num_total_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_watermark_blocks": self.scheduler.watermark_blocks,
            "preempt_blocks": self.scheduler.preempt_blocks,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "formats_compiled": self._grammar_cache.num_compiled if self._grammar_cache else 0,
            "formats_refused": self._grammar_cache.num_refused if self._grammar_cache else 0,
            **self._spec_stats(),
        }

    def _spec_stats(self) -> dict:
        """Speculative decoding's totals (vLLM's spec_decode metric names), when it is on."""
        if self.speculator is None:
            return {}
        c = self.speculator.counters
        return {"spec_decode_num_drafts": c.num_drafts, "spec_decode_num_draft_tokens": c.num_draft_tokens,
                "spec_decode_num_accepted_tokens": c.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(c.accepted_per_position)}


def start_word_index(model_path: str, vocab_size: int, device: torch.device) -> Future:
    """The token bytes of the model's vocabulary, indexed for banned strings, built on a daemon
    thread; the future holds the index, or why there is none (no tokenizer files, ...).

    The imports the build needs happen first, here: the thread imports nothing, so it never
    meets another thread inside a half-imported transformers module (`tokenizer_loader`)."""
    from nanovllm.models.tokenizer import tokenizer_loader  # only string banned words need it
    future: Future = Future()
    try:
        load = tokenizer_loader(model_path)
    except Exception as e:  # no tokenizer files, an unreadable GGUF: many kinds of errors
        future.set_exception(e)
        return future

    try:
        importlib.import_module("llguidance.hf")  # here, not on the thread (see above)
    except ImportError:
        pass

    def build() -> None:
        try:
            tokenizer = load()
            table = token_byte_table(tokenizer, vocab_size)
            if not any(table):  # transformers builds an empty tokenizer from a folder without its files
                raise ValueError("the tokenizer has no text tokens")
            index = WordIndex(table, device)
            try:  # structured output's view of the vocabulary; without it only response_format fails
                index.ll_tokenizer = ll_tokenizer(tokenizer, vocab_size)
            except Exception:
                index.ll_tokenizer = None
            release_free_heap()  # the tokenizer loaded for the index is dropped: return its pages
            future.set_result(index)
        except BaseException as e:  # handed to whoever waits on the future
            future.set_exception(e)

    threading.Thread(target=build, name="nanovllm-word-index", daemon=True).start()
    return future
