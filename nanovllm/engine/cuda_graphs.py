"""Decode steps replayed from CUDA graphs: one launch per step instead of one per kernel.

A decode-only step of B sequences runs the graph captured for the smallest bucket >= B (sizes
1, 2, 4, 8, then every 16, always ending at `max_num_seqs`), its spare rows padded with slot -1
(the cache write skips them) and context length 0 (attention gives zeros). Graphs are captured
largest first into one shared memory pool, so all of them cost about as much as the largest.
Prefill and mixed steps, and batches no graph fits, run eagerly.

The graphs read fixed input buffers: `run` copies each step's tensors into them. The block
table buffer is as wide as the longest allowed sequence, so the decode kernel's split count (a
function of shapes only) is fixed per graph.
"""
# [ZH-START]
# 【模块定位】GPU 上纯解码步的 CUDA 图：录制一次，之后每步只需一次 replay，
# 而不是每个算子各启动一次。
#   ModelRunner._execute ─纯解码步且 can_run→ DecodeGraphs.run → 重放对应档位的图
#                        ─prefill / 混合步 / 没有合适档位→ eager 前向
# 档位（graph_batch_sizes）：1、2、4、8，之后每 16 一档，最后一档固定是 max_num_seqs。
# B 条序列落进不小于 B 的最小档位，多出的行填槽位 -1（写 KV 时跳过）、
# 上下文长度 0（注意力输出全零）。
# CPU 上从不走这里。
# [ZH-END]
from __future__ import annotations

import bisect

import torch
from torch import nn

from nanovllm.layers.attention import AttentionMetadata


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, 16, 32, 48, ... below `max_num_seqs`, then `max_num_seqs`."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    small = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    return small + list(range(16, max_num_seqs, 16)) + [max_num_seqs]


def padded_batch_size(batch: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds `batch` rows; None when none does (run eagerly)."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphs:
    # [ZH-START]
    # 【职责】按档位录制并重放解码的 CUDA 图。图只认固定地址的输入缓冲区（input_ids、positions、
    # slot_mapping、context_lens、block_tables，行数都按最大档位），
    # 所以每步先把张量拷进缓冲区再 replay。
    # 块表缓冲宽 max_blocks_per_seq，这样解码内核的切分数（只取决于形状）在每张图里固定。
    # [ZH-END]
    def __init__(self, model: nn.Module, max_num_seqs: int, max_blocks_per_seq: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.sizes = graph_batch_sizes(max_num_seqs)
        rows = self.sizes[-1]
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.context_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(rows, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(rows, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_replays = 0
        self._capture(model)

    def _metadata(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slot_mapping[:batch], num_decode=batch,
                                 decode_block_tables=self.block_tables[:batch],
                                 decode_context_lens=self.context_lens[:batch])

    @torch.inference_mode()
    def _capture(self, model: nn.Module) -> None:
        # [ZH-START]
        # 1. 从最大档位往小录：小图都能放进最大图的显存池，所有图合计约等于最大那张的开销。
        # 2. 每个档位先 eager 跑一遍预热（Triton 在录制之外编译），再在 torch.cuda.graph 里录一遍。
        # 3. 第一张图的 pool 给后面所有图共用。录制时缓冲区里是槽位 -1、上下文 0，不读写任何 KV。
        # [ZH-END]
        # Buffers hold slot -1 and context 0 here, so capturing writes and reads no cache.
        pool = None
        for batch in reversed(self.sizes):  # largest first: the others fit in its pool
            args = (self.input_ids[:batch], self.positions[:batch], self._metadata(batch))
            self.hidden[:batch] = model(*args)  # warm-up: Triton compiles outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.hidden[:batch] = model(*args)
            if pool is None:
                pool = graph.pool()
            self.graphs[batch] = graph
        torch.cuda.synchronize()

    def can_run(self, num_seqs: int, table_width: int) -> bool:
        return padded_batch_size(num_seqs, self.sizes) is not None and table_width <= self.block_tables.shape[1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states (B, C) of a decode-only step; a view into a buffer the next step overwrites."""
        # [ZH-START]
        # 1. batch = 不小于 n 的最小档位。
        # 2. 前 n 行拷入本步的 input_ids、positions、slot_mapping、context_lens；n..batch 的填充行
        #    设槽位 -1、上下文 0。
        # 3. 块表只拷本步实际宽度 width；右边的旧值位于所有上下文之外，永远不会被读到。
        # 4. 重放这个档位的图，返回 hidden[:n]（下一步会覆盖，调用方要在那之前用完）。
        # [ZH-END]
        n = input_ids.shape[0]
        batch = padded_batch_size(n, self.sizes)
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = meta.slot_mapping
        self.slot_mapping[n:batch] = -1
        self.context_lens[:n] = meta.decode_context_lens
        self.context_lens[n:batch] = 0
        # Entries right of `width` are stale but lie past every context, so they are never read.
        width = meta.decode_block_tables.shape[1]
        self.block_tables[:n, :width] = meta.decode_block_tables
        self._replay(batch)
        self.num_replays += 1
        return self.hidden[:n]

    def _replay(self, batch: int) -> None:
        self.graphs[batch].replay()
