"""One step's model input: plain data from the schedule, then tensors and attention metadata.

Rank 0 turns the scheduler's `ScheduledSeq`s into a `StepInput` of plain lists (so it can go to
tensor-parallel workers as msgpack); every rank then builds the same input tensors from it, with
the metadata its attention path reads: `build_cpu_batch` for the torch / compiled-C path,
`build_gpu_batch` for the Triton kernels. The batch is ordered decode rows first (one token per
sequence), then prefill chunks in scheduled order.
"""
# [ZH-START]
# 【模块定位】把调度结果变成"一步的模型输入"，分两段：
#   Scheduler → list[ScheduledSeq]
#     → StepInput.from_scheduled()（只在 rank 0，产出纯 list，可 msgpack 广播给 TP worker）
#     → build_cpu_batch()（torch / 编译 C 核路径）或 build_gpu_batch()（Triton 路径），
#       每个 rank 各建一份
#     → input_ids (T,)、positions (T,)、AttentionMetadata → 模型前向 → PagedAttention
# 批内行序固定：先是 decode 行（每条序列 1 个 token），再是各 prefill 分块（按调度顺序）。
# 位置 p 的 token 写在 slot = block_table[p // block_size] * block_size + p % block_size。
# [ZH-END]
from __future__ import annotations

from dataclasses import astuple, dataclass, field

import torch

from nanovllm.engine.scheduler import ScheduledSeq
from nanovllm.layers.attention import AttentionMetadata, PrefillSpan
from nanovllm.layers.host_copy import upload


@dataclass(slots=True)
class StepInput:
    # [ZH-START]
    # 【职责】一步前向所需的全部输入，只用 int 列表表示：decode 的 token / 位置 / 块表，
    # prefill 分块的 token / 起始位置 / 块表，以及要采样的批内行号 sample_rows。
    # 【边界】不含张量、不含 Sequence 对象、不知道设备和注意力路径；也不决定谁被调度。
    # 【协作者】ModelRunner.run 用 from_scheduled 生成它；张量并行时 to_wire / from_wire 经
    # StepChannel 发给 worker；build_cpu_batch / build_gpu_batch 把它变成张量。
    # [ZH-END]
    decode_token_ids: list[int]
    decode_positions: list[int]
    decode_block_tables: list[list[int]]
    prefill_token_ids: list[list[int]]
    """The new tokens of each prefill chunk."""
    prefill_starts: list[int]
    """Tokens already in the cache before each chunk (its first position)."""
    prefill_block_tables: list[list[int]]
    sample_rows: list[int]
    """Batch rows whose hidden state is sampled, in scheduled order."""
    prompt_rows: list[int] = field(default_factory=list)
    """Batch rows whose logits score prompt tokens (`ScheduledSeq.prompt_logprob_span`), in
    scheduled order; empty unless a request asked for prompt logprobs."""
    prompt_targets: list[int] = field(default_factory=list)
    """The prompt token each of `prompt_rows` scores (the one after its position)."""
    prompt_top: list[int] = field(default_factory=list)
    """Alternatives wanted for each of `prompt_rows` (its request's `prompt_logprobs`)."""

    @classmethod
    def from_scheduled(cls, scheduled: list[ScheduledSeq]) -> "StepInput":
        # [ZH-START]
        # 1. 遍历 scheduled，pos = seq.num_computed_tokens（本次第一个新 token 的位置）。
        # 2. num_new_tokens == 1 → 当作 decode 行：记 token_ids[pos]、pos、seq.block_table；
        #    places 记 (True, 它在 decode 行中的序号)。只剩 1 个 token 的 prefill
        #    分块也走这里，算法相同。有草稿（投机解码的验证）→ k+1 个 decode 行：
        #    token_ids[pos] 和 k 个草稿，位置 pos..pos+k，同一张块表；places 记第一行的序号。
        #    各行的 K/V 都先写进 cache 再做注意力，所以第 i 行看得到它前面的行（因果）。
        # 3. 否则是 prefill 分块：记 token_ids[pos:pos+n]、起始位置 pos、block_table；
        #    num_prefill_rows 累加 n，places 记 (False, 该分块最后一行在 prefill 行中的下标)。
        # 4. 全部遍历完 decode 行数 num_decode 才确定，再算 sample_rows：每项 num_samples 行，
        #    decode 行取其序号（有草稿的项是连续的 1 + k 行），prefill 取 num_decode + 末行下标；
        #    顺序就是 scheduled 的顺序，
        #    与 Sampler 收到的 seqs 一一对应。
        # 5. 有 prompt_logprob_span 的项：从它那一块的第一行起，按（偏移、个数）把对应的行号依次
        #    记进 prompt_rows（这些行的 logits 给 prompt token 打分），每行要打分的 token（它位置
        #    之后的那个 prompt token）记进 prompt_targets，候选个数记进 prompt_top。
        # [ZH-END]
        step = cls([], [], [], [], [], [], [])
        places: list[tuple[bool, int]] = []  # (is_decode, first row among decodes / last row among prefill rows)
        num_prefill_rows = 0
        for item in scheduled:
            seq, pos = item.seq, item.seq.num_computed_tokens
            if item.num_new_tokens == 1 or item.draft:
                # A verification is k+1 decode rows of one sequence: each row's K/V is stored
                # before any row attends, so row i sees the rows before it.
                places.append((True, len(step.decode_token_ids)))
                step.decode_token_ids.append(seq.token_ids[pos])
                step.decode_token_ids.extend(item.draft)
                step.decode_positions.extend(range(pos, pos + item.num_new_tokens))
                step.decode_block_tables.extend([seq.block_table] * item.num_new_tokens)
            else:
                num_prefill_rows += item.num_new_tokens
                places.append((False, num_prefill_rows - 1))
                step.prefill_token_ids.append(seq.token_ids[pos:pos + item.num_new_tokens])
                step.prefill_starts.append(pos)
                step.prefill_block_tables.append(seq.block_table)
        num_decode = len(step.decode_token_ids)
        step.sample_rows = [row + i if is_decode else num_decode + row
                            for item, (is_decode, row) in zip(scheduled, places) for i in range(item.num_samples)]
        for item, (is_decode, row) in zip(scheduled, places):
            if item.prompt_logprob_span is not None:
                offset, count = item.prompt_logprob_span
                first = row if is_decode else num_decode + row - item.num_new_tokens + 1  # the chunk's first row
                step.prompt_rows.extend(range(first + offset, first + offset + count))
                position = item.seq.num_computed_tokens + offset  # the first scoring position
                step.prompt_targets.extend(item.seq.token_ids[position + 1:position + 1 + count])
                step.prompt_top.extend([item.seq.params.prompt_logprobs] * count)
        return step

    @property
    def num_decode(self) -> int:
        return len(self.decode_token_ids)

    def to_wire(self) -> list:
        return list(astuple(self))

    @classmethod
    def from_wire(cls, fields: list) -> "StepInput":
        return cls(*fields)


def _pad(tables: list[list[int]]) -> list[list[int]]:
    width = max(map(len, tables))
    return [t + [0] * (width - len(t)) for t in tables]


def build_cpu_batch(step: StepInput, block_size: int, torch_attention: bool):
    """(input_ids, positions, meta) for the CPU path; `torch_attention` adds the masks and slot
    lists only the torch attention path reads (the compiled kernel walks the block tables)."""
    # [ZH-START]
    # 1. input_ids / positions 先放 decode 行；每行 slot = table[pos // bs] * bs + pos % bs。
    # 2. 有 decode 行时：块表用 0 补齐成 (B, max_blocks) long；decode_context_lens = pos + 1（含新
    #    token）；decode_rows = arange(B)（编译核约定：第 r 行读块表第 r 行）。
    #    torch_attention 时再建 decode_mask (B, 1, 1, max_blocks * bs)：
    #    key 下标 < context_len 为 True。
    # 3. 每个 prefill 分块（n 个新 token，pos = arange(start, start + n)）：
    #    PrefillSpan(start=它在批内的首行, q_len=n, num_cached=start, block_table=(nblocks,))。
    #    torch_attention 且 start > 0 时：
    #    context_slots = 位置 0..start+n-1 的 slot，
    #    mask (n, start + n) = ctx <= pos，即带偏移的因果掩码；start == 0 时直接用
    #    SDPA 的 is_causal。
    # 4. 把分块的 token、位置、slot 追加到批尾。
    # 5. slot_mapping 转成 (T,) long；返回 input_ids (T,)、positions (T,)、meta，全部在 CPU 上。
    # [ZH-END]
    bs = block_size
    input_ids = list(step.decode_token_ids)
    positions = list(step.decode_positions)
    slots = [table[pos // bs] * bs + pos % bs for pos, table in zip(positions, step.decode_block_tables)]
    meta = AttentionMetadata(slot_mapping=torch.empty(0), num_decode=step.num_decode)
    if step.num_decode:
        meta.decode_block_tables = torch.tensor(_pad(step.decode_block_tables), dtype=torch.long)  # (B, max_blocks)
        context_lens = torch.tensor(positions, dtype=torch.long) + 1
        meta.decode_context_lens = context_lens
        meta.decode_rows = torch.arange(step.num_decode)
        if torch_attention:
            keys = torch.arange(meta.decode_block_tables.shape[1] * bs)
            meta.decode_mask = (keys[None, :] < context_lens[:, None]).view(step.num_decode, 1, 1, -1)
    for tokens, start, block_table in zip(step.prefill_token_ids, step.prefill_starts, step.prefill_block_tables):
        n = len(tokens)
        table = torch.tensor(block_table, dtype=torch.long)
        pos = torch.arange(start, start + n)
        span = PrefillSpan(start=len(input_ids), q_len=n, num_cached=start, block_table=table)
        if torch_attention and start > 0:
            ctx = torch.arange(start + n)
            span.context_slots = table[ctx // bs] * bs + ctx % bs
            span.mask = ctx[None, :] <= pos[:, None]  # (Q, K) causal with offset
        meta.prefills.append(span)
        input_ids.extend(tokens)
        positions.extend(range(start, start + n))
        slots.extend((table[pos // bs] * bs + pos % bs).tolist())
    meta.slot_mapping = torch.tensor(slots, dtype=torch.long)
    return torch.tensor(input_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), meta


def build_gpu_batch(step: StepInput, block_size: int, device: torch.device):
    """(input_ids, positions, meta) on `device` for the Triton path; built on the host, copied once each."""
    # [ZH-START]
    # 1. upload()（layers/host_copy.py）：先在 host 上建张量（CUDA 上用 pinned 内存），
    #    再 non_blocking 拷到设备，
    #    每个张量一次拷贝，不触发设备同步。
    # 2. decode 行：input_ids / positions / slot 与 CPU 路径相同；块表补 0 成 (B, max_blocks)
    #    int32，decode_context_lens = pos + 1（int32）。没有 mask：
    #    Triton 核按 context_len 自己截断。
    # 3. 有 prefill 时逐块追加 slot / token / 位置，并累积：
    #    cu_seqlens (P + 1,)：各块行偏移，从第一条 prefill 行算起（不含 decode 行）；
    #    gpu_prefill_context_lens (P,) = start + n；块表补 0 成 (P, max_blocks) int32；
    #    gpu_max_prefill_len = 最长分块长度，在 host 上就知道，Triton 网格不必从 GPU 读回。
    # 4. slot_mapping (T,) long 上传；返回设备上的 input_ids、positions 和 meta。
    # [ZH-END]
    bs = block_size
    input_ids = list(step.decode_token_ids)
    positions = list(step.decode_positions)
    slots = [table[pos // bs] * bs + pos % bs for pos, table in zip(positions, step.decode_block_tables)]
    meta = AttentionMetadata(slot_mapping=torch.empty(0), num_decode=step.num_decode)
    if step.num_decode:
        meta.decode_block_tables = upload(_pad(step.decode_block_tables), torch.int32, device)  # (B, max_blocks)
        meta.decode_context_lens = upload([p + 1 for p in positions], torch.int32, device)
    if step.prefill_token_ids:
        cu_seqlens, context_lens = [0], []
        for tokens, start, block_table in zip(step.prefill_token_ids, step.prefill_starts, step.prefill_block_tables):
            n = len(tokens)
            pos = torch.arange(start, start + n)
            table = torch.tensor(block_table, dtype=torch.long)
            slots.extend((table[pos // bs] * bs + pos % bs).tolist())
            input_ids.extend(tokens)
            positions.extend(range(start, start + n))
            cu_seqlens.append(cu_seqlens[-1] + n)
            context_lens.append(start + n)
        meta.gpu_prefill_cu_seqlens = upload(cu_seqlens, torch.int32, device)
        meta.gpu_prefill_context_lens = upload(context_lens, torch.int32, device)
        meta.gpu_prefill_block_tables = upload(_pad(step.prefill_block_tables), torch.int32, device)
        meta.gpu_max_prefill_len = max(map(len, step.prefill_token_ids))
    meta.slot_mapping = upload(slots, torch.long, device)
    return upload(input_ids, torch.long, device), upload(positions, torch.long, device), meta

