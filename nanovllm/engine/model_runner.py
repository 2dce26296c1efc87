"""Runs one engine step through the model: builds the batch, attends over the paged cache, samples.

The runner owns the model weights and the KV cache tensor. Its input is the scheduler's list of
`ScheduledSeq`; its output is one sampled token per sequence whose chunk reaches its end, in
scheduled order. The batch is reordered decode-first because the attention layer handles all
single-token rows as one padded batch and prompt chunks one by one.
"""
from __future__ import annotations

import os

import torch

from nanovllm.config import Config
from nanovllm.engine.scheduler import ScheduledSeq
from nanovllm.layers.attention import AttentionMetadata, PrefillSpan
from nanovllm.layers.attention import PagedAttention
from nanovllm.layers.cpu_kernels import CpuAttentionKernel
from nanovllm.layers.sampler import Sampler
from nanovllm.models.decoder import DecoderForCausalLM
from nanovllm.models.loader import iter_weights, load_weights
from nanovllm.models.model_config import ModelConfig

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(config: Config) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' was requested but no CUDA device is available")
    return torch.device(config.device)


def resolve_dtype(config: Config, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return _DTYPES[config.dtype]
    # fp32 on CPU: bf16/fp16 matmuls are several times slower on CPUs without AVX-512.
    return torch.float32 if device.type == "cpu" else (model_config.torch_dtype if model_config.torch_dtype != torch.float32 else torch.bfloat16)


class ModelRunner:
    def __init__(self, config: Config, model_config: ModelConfig, model_path: str):
        self.config = config
        self.model_config = model_config
        self.block_size = config.block_size
        self.device = resolve_device(config)
        self.dtype = resolve_dtype(config, model_config, self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(config.num_threads or len(os.sched_getaffinity(0)))
        self.sampler = Sampler(model_config.vocab_size, self.device, config.seed)
        with torch.device(self.device):
            self.model = DecoderForCausalLM(model_config).to(self.dtype)
        load_weights(self.model, iter_weights(model_path))
        self.model.eval()
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        self.cpu_kernel = CpuAttentionKernel.load() if self.device.type == "cpu" else None
        for layer in self.attention_layers:
            layer.cpu_kernel = self.cpu_kernel
        self.num_blocks = self._num_kv_blocks()
        self._allocate_kv_cache()

    # -- KV cache ----------------------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        cfg = self.model_config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * cfg.num_layers * self.block_size * cfg.num_kv_heads * cfg.head_dim * elem

    def _num_kv_blocks(self) -> int:
        if self.config.num_kvcache_blocks is not None:
            return self.config.num_kvcache_blocks
        budget = int(self.config.kv_cache_memory_gib * (1 << 30))
        num_blocks = budget // self.bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_gib={self.config.kv_cache_memory_gib} holds no KV block "
                f"({self.bytes_per_block} bytes each); raise it"
            )
        return num_blocks

    def _allocate_kv_cache(self) -> None:
        cfg = self.model_config
        shape = (2, cfg.num_layers, self.num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    # -- one step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq]) -> list[int]:
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        prefills = [s for s in scheduled if s.num_new_tokens > 1]
        input_ids, positions, meta, last_row = self._prepare(decodes, prefills)
        hidden = self.model(input_ids, positions, meta)  # (T, C)
        sampling = [s for s in scheduled if s.samples]
        if not sampling:
            return []
        rows = torch.tensor([last_row[id(s)] for s in sampling], device=self.device)
        logits = self.model.compute_logits(hidden[rows])  # (B, V)
        return self.sampler(logits, [s.seq for s in sampling])

    def _prepare(self, decodes: list[ScheduledSeq], prefills: list[ScheduledSeq]):
        bs, dev = self.block_size, self.device
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_row: dict[int, int] = {}
        for item in decodes:
            seq = item.seq
            pos = seq.num_computed_tokens
            last_row[id(item)] = len(input_ids)
            input_ids.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(seq.block_table[pos // bs] * bs + pos % bs)
        meta = AttentionMetadata(slot_mapping=torch.empty(0), num_decode=len(decodes))
        if decodes:
            max_blocks = max(len(s.seq.block_table) for s in decodes)
            tables = [s.seq.block_table + [0] * (max_blocks - len(s.seq.block_table)) for s in decodes]
            meta.decode_block_tables = torch.tensor(tables, dtype=torch.long, device=dev)  # (B, max_blocks)
            context_lens = torch.tensor(positions, dtype=torch.long, device=dev) + 1
            meta.decode_context_lens = context_lens
            meta.decode_rows = torch.arange(len(decodes), device=dev)
            if self.cpu_kernel is None:
                keys = torch.arange(max_blocks * bs, device=dev)
                meta.decode_mask = (keys[None, :] < context_lens[:, None]).view(len(decodes), 1, 1, -1)
        for item in prefills:
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            table = torch.tensor(seq.block_table, dtype=torch.long)
            pos = torch.arange(start, start + n)
            span = PrefillSpan(start=len(input_ids), q_len=n, num_cached=start)
            if start > 0:
                ctx = torch.arange(start + n)
                span.context_slots = (table[ctx // bs] * bs + ctx % bs).to(dev)
                span.mask = (ctx[None, :] <= pos[:, None]).to(dev)  # (Q, K) causal with offset
                span.block_table = table.view(1, -1).to(dev)
                span.row_ctx = (pos + 1).to(dev)
            meta.prefills.append(span)
            input_ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            slots.extend((table[pos // bs] * bs + pos % bs).tolist())
            last_row[id(item)] = len(input_ids) - 1
        meta.slot_mapping = torch.tensor(slots, dtype=torch.long, device=dev)
        return (torch.tensor(input_ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev), meta, last_row)
