"""Choosing tokens from logits rows: temperature, the top_k / top_p / min_p filters and an
inverse-CDF draw with one uniform number per row.

`sample_rows` is what `Sampler` calls for its non-greedy rows; `filter_candidates` and `draw`
are its parts. Everything is tensor work over the rows; a seeded row's draw depends on its own
row and generator alone (neighbours only pad the candidate width with -inf).
"""
# [ZH-START]
# 【模块定位】采样器的"抽样"一段：温度缩放 → top_k / top_p / min_p 过滤（filter_candidates）
# → 逆 CDF 抽样（draw），每行一个均匀随机数。Sampler._choose 把非 greedy 的行交给 sample_rows；
# 有种子的行只取决于自己的行和 Generator。
# [ZH-END]
from __future__ import annotations

import torch

from nanovllm.layers.host_copy import upload
from nanovllm.sampling_params import SamplingParams

_NEG_INF = float("-inf")


def has_filters(p: SamplingParams, vocab: int) -> bool:
    """Whether the row keeps only part of the vocabulary (top_k, top_p or min_p)."""
    return 0 < p.top_k < vocab or p.top_p < 1 or p.min_p > 0


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                shared: torch.Generator, cpu_ops=None, probe: bool = True) -> torch.Tensor:
    """Draw one token per row of logits (R, V) with each row's temperature and filters -> (R,).

    Each row takes one uniform number: from its own generator if it has one, else from `shared`.
    `cpu_ops` (the compiled `CpuOps`, or None): rows without filters, float32 on CPU, are drawn by
    its compiled kernel (cpu_sample.c) instead of the torch ops below, ~10x faster at 64 rows.
    Nothing here waits for the device, unless `probe` lets `filter_candidates` probe.
    """
    # [ZH-START]
    # 1. 温度（upload：CUDA 上经 pinned 内存异步上传，不等设备）先转 float64，clamp 到 dtype 的
    #    [tiny, max]，再转回 logits 的 dtype：1e-40 这种会变成 0 的温度不会除出 inf / NaN。
    # 2. uniform (R,) float64 从共享 Generator 取；有种子的行再用自己的 Generator 取一个数覆盖，
    #    所以它的结果不受同批其他请求影响。
    # 3. 没有任何过滤、logits 是 CPU 上的 float32 且有 cpu_ops：直接 cpu_ops.draw(logits, 温度,
    #    uniform)（cpu_sample.c，每行两到三遍，行分给多线程），返回 (R,)，跳过下面的 torch 运算。
    # 4. 否则 scaled = (logits - 行最大值) / 温度，形状 (R, V)：最优 token 变成 0，极小温度把其余
    #    推向 -inf，等价于 greedy。
    # 5. 有过滤：top_k 为 0 或 >= V 的行按 V 处理，filter_candidates 得到候选 (R, W) 和对应
    #    token id；否则候选就是 scaled，ids 为 None。
    # 6. choice = draw(candidates, uniform)；有过滤时经 ids.gather 映射回真实 token id，返回 (R,)。
    # [ZH-END]
    vocab = logits.shape[1]
    finfo = torch.finfo(logits.dtype)
    # Clamped to the dtype's normal range: a temperature that rounds to 0 (1e-40 in float32) or
    # to inf would divide into inf or NaN. Each row's best logit is moved to 0 first, so a tiny
    # temperature sends it to 0 and every other token towards -inf: greedy, never NaN.
    temperature = upload([p.temperature for p in params], torch.float64, logits.device)
    temperature = temperature.clamp_(finfo.tiny, finfo.max).to(logits.dtype)
    uniform = torch.rand(len(params), dtype=torch.float64, device=logits.device, generator=shared)  # (R,)
    for j, g in enumerate(generators):
        if g is not None:
            uniform[j] = torch.rand(1, dtype=torch.float64, device=logits.device, generator=g)
    filtered = any(has_filters(p, vocab) for p in params)
    if cpu_ops is not None and not filtered and cpu_ops.supports_draw(logits):
        return cpu_ops.draw(logits, temperature, uniform)
    scaled = (logits - logits.amax(dim=-1, keepdim=True)).div_(temperature.unsqueeze(1))  # (R, V)
    if filtered:
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        candidates, ids = filter_candidates(scaled, top_k, [p.top_p for p in params], [p.min_p for p in params], probe)
    else:
        candidates, ids = scaled, None
    choice = draw(candidates, uniform)
    return choice if ids is None else ids.gather(1, choice.unsqueeze(1)).squeeze(1)


PROBE_WIDTH = 256
"""Tokens tried before a full sort when a row has top_p / min_p but no top_k (a cost choice only)."""


def filter_candidates(logits: torch.Tensor, top_k: list[int], top_p: list[float],
                      min_p: list[float], probe: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature-scaled logits (R, V) -> candidate logits and their token ids, both (R, W).

    Candidates are sorted most likely first and W is the largest top_k of the rows. Entries
    outside a row's top_k / top_p / min_p set are -inf. Rows without a top_k first try the
    PROBE_WIDTH most likely tokens: when every such row's set ends inside them, the full sort of
    the vocabulary is skipped (the result is the same; only the cost differs). Knowing whether
    they did reads a value back from the device: `probe=False` (the overlapped step, which must
    not wait for the device) sorts at once.
    """
    # [ZH-START]
    # 1. W = 各行 top_k 的最大值（没有 top_k 的行记为 V）。
    # 2. 探测（probe 为 False 时不做：要从设备读回一个值）：若 W == V、V > 256，
    #    且每行的 k 要么 <= 256 要么是 V（没有 top_k），先只取 topk(256) 调 _filter；
    #    每个无 top_k 行的保留集合都在这 256 个内结束，就直接返回，省掉整词表排序。
    # 3. 否则 W < V 时 topk(W)，W == V 时整词表降序 sort，再 _filter。
    # 4. 返回候选 logits 与 token id，都是 (R, W)，降序排列，被过滤的位置为 -inf。
    # [ZH-END]
    vocab = logits.shape[1]
    width = max(top_k)
    if probe and width == vocab and vocab > PROBE_WIDTH and all(k <= PROBE_WIDTH or k == vocab for k in top_k):
        probed = _filter(logits, *logits.topk(PROBE_WIDTH, dim=-1), top_k, top_p, min_p, probed=True)
        if probed is not None:
            return probed
    values, ids = logits.topk(width, dim=-1) if width < vocab else logits.sort(dim=-1, descending=True)
    return _filter(logits, values, ids, top_k, top_p, min_p, probed=False)


def _filter(logits: torch.Tensor, values: torch.Tensor, ids: torch.Tensor, top_k: list[int], top_p: list[float],
            min_p: list[float], probed: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Mask sorted candidates (R, W); when `probed` (W is the probe's, short of some rows'
    top_k), None if a row's set may extend past the W candidates."""
    # [ZH-START]
    # 1. 每行第 k 个之后的候选置 -inf（top_k）。
    # 2. norm = 候选的 logsumexp (R, 1)；没有 top_k 的行改用整词表的 logsumexp（候选可能
    #    只是探测的 256 个）。
    #    即 top_p / min_p 都在 top_k 重新归一化后的分布上判断。
    # 3. probs = exp(values - norm)，(R, W)。
    # 4. top_p：某 token 之前的累计概率已 >= top_p 就丢掉；top_p == 1 的行不做此判断（舍入后的
    #    cumsum 可能提前到 1）。
    # 5. min_p：概率 < min_p × 最优 token 概率的丢掉。
    # 6. 第 0 列（最可能的 token）永远保留，哪怕 top_p 小到 1e-50。
    # 7. probed（W 是探测的宽度）时，若某个无 top_k 的行连最后一个候选都保留着，它的集合可能延续到 W
    #    之外 → 返回 None 让调用方整词表排序。
    # 8. 返回 (丢弃位置填 -inf 的 values, ids)。
    # [ZH-END]
    dev, vocab, width = logits.device, logits.shape[1], values.shape[1]
    k = upload(top_k, torch.long, dev).unsqueeze(1)
    values = values.masked_fill(torch.arange(width, device=dev).unsqueeze(0) >= k, _NEG_INF)
    p = upload(top_p, torch.float32, dev).unsqueeze(1)
    m = upload(min_p, torch.float32, dev).unsqueeze(1)
    # top_p is judged on the top_k-renormalized distribution: normalize over the row's top_k
    # candidates, or over the whole vocabulary when the row has no top_k.
    norm = values.logsumexp(dim=-1, keepdim=True)  # (R, 1)
    if max(top_k) == vocab:
        norm = torch.where(k < vocab, norm, logits.logsumexp(dim=-1, keepdim=True))
    probs = (values - norm).exp()  # (R, W)
    # Keep a token while the mass before it is short of top_p; rows with top_p == 1 skip the
    # test, since a rounded cumsum can reach 1 before the tail. min_p compares with the best.
    drop = ((probs.cumsum(dim=-1) - probs) >= p) & (p < 1)
    drop |= probs < m * probs[:, :1]
    drop[:, 0] = False  # the most likely token always stays, however small top_p (1e-50 rounds to 0)
    if probed and not bool((drop[:, -1] | (k.squeeze(1) < vocab)).all()):
        return None  # a row without top_k keeps the last candidate: its set may go on past W
    return values.masked_fill(drop, _NEG_INF), ids


def draw(logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One index per row of logits (R, W), with probability softmax(row), by inverse CDF -> (R,).

    `uniform` (R,) holds one number in [0, 1) per row: cheaper than noise per token, and a seeded
    generator advances by exactly one number per token whatever the row's width.
    """
    # [ZH-START]
    # 1. weights = exp(logits - 行最大值)，(R, W)，被屏蔽的 -inf 变成 0。行最大值用 amax
    #    （不要下标，比 max 快得多）；exp 前不 clamp：本机 exp 对下溢的输入（如 -200）比 -inf 还慢。
    # 2. cdf = float64 的 cumsum（15 万词表也足够精确）。
    # 3. u = (1 - uniform) × 总和，落在 (0, 总和] 内。
    # 4. searchsorted(cdf, u)：第一个 cdf >= u 的下标，它的权重一定为正；返回 (R,)。
    # 每行只消耗一个随机数：有种子的 Generator 每个 token 恰好前进一步，与候选宽度无关。
    # [ZH-END]
    # amax, not max: the same values without the indices, which cost 10x the reduction on CPU.
    # No clamp before exp: measured slower here, as exp of an underflowing input (-200) is slower
    # on this CPU's vector exp than exp(-inf) (docs/architecture.md, structured output).
    weights = (logits - logits.amax(dim=-1, keepdim=True)).exp_()  # (R, W); masked -> 0
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)  # float64: exact enough over 150k tokens
    u = (1 - uniform).unsqueeze(1) * cdf[:, -1:]
    # u is in (0, total]: the first index whose cdf reaches u has a positive weight.
    return torch.searchsorted(cdf, u).squeeze(1)
