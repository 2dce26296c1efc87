"""One step's model input: plain data from the schedule, then tensors and attention metadata.

Rank 0 turns the scheduler's `ScheduledSeq`s into a `StepInput` of plain lists (so it can go to
tensor-parallel workers as msgpack); every rank then builds the same input tensors from it, with
the metadata its attention path reads: `build_cpu_batch` for the torch / compiled-C path,
`build_gpu_batch` for the Triton kernels. The batch is ordered decode rows first (one token per
sequence), then prefill chunks in scheduled order.
"""
from __future__ import annotations

from dataclasses import astuple, dataclass

import torch

from nanovllm.engine.scheduler import ScheduledSeq
from nanovllm.layers.attention import AttentionMetadata, PrefillSpan


@dataclass(slots=True)
class StepInput:
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

    @classmethod
    def from_scheduled(cls, scheduled: list[ScheduledSeq]) -> "StepInput":
        step = cls([], [], [], [], [], [], [])
        places: list[tuple[bool, int]] = []  # (is_decode, row among decodes / last row among prefill rows)
        num_prefill_rows = 0
        for item in scheduled:
            seq, pos = item.seq, item.seq.num_computed_tokens
            if item.num_new_tokens == 1:
                places.append((True, len(step.decode_token_ids)))
                step.decode_token_ids.append(seq.token_ids[pos])
                step.decode_positions.append(pos)
                step.decode_block_tables.append(seq.block_table)
            else:
                num_prefill_rows += item.num_new_tokens
                places.append((False, num_prefill_rows - 1))
                step.prefill_token_ids.append(seq.token_ids[pos:pos + item.num_new_tokens])
                step.prefill_starts.append(pos)
                step.prefill_block_tables.append(seq.block_table)
        num_decode = len(step.decode_token_ids)
        step.sample_rows = [row if is_decode else num_decode + row
                            for item, (is_decode, row) in zip(scheduled, places) if item.samples]
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
        span = PrefillSpan(start=len(input_ids), q_len=n, num_cached=start, block_table=table.view(1, -1),
                           row_ctx=pos + 1)
        if start > 0 and torch_attention:
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
    bs = block_size
    pin = device.type == "cuda"  # pinned host memory makes the copies asynchronous

    def upload(values, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, pin_memory=pin).to(device, non_blocking=True)

    input_ids = list(step.decode_token_ids)
    positions = list(step.decode_positions)
    slots = [table[pos // bs] * bs + pos % bs for pos, table in zip(positions, step.decode_block_tables)]
    meta = AttentionMetadata(slot_mapping=torch.empty(0), num_decode=step.num_decode)
    if step.num_decode:
        meta.decode_block_tables = upload(_pad(step.decode_block_tables), torch.int32)  # (B, max_blocks)
        meta.decode_context_lens = upload([p + 1 for p in positions], torch.int32)
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
        meta.gpu_prefill_cu_seqlens = upload(cu_seqlens, torch.int32)
        meta.gpu_prefill_context_lens = upload(context_lens, torch.int32)
        meta.gpu_prefill_block_tables = upload(_pad(step.prefill_block_tables), torch.int32)
        meta.gpu_max_prefill_len = max(map(len, step.prefill_token_ids))
    meta.slot_mapping = upload(slots, torch.long)
    return upload(input_ids, torch.long), upload(positions, torch.long), meta
