"""Each tensor-parallel rank loads exactly its slice of the HF weights (no processes needed).

A layer built for rank r of N only reads its `TensorParallel(rank, size)` while loading, so the
slices are checked directly: the ranks' column-parallel outputs, concatenated, must equal the
unsplit layer's; the row-parallel ranks' partial sums must add up to it.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanovllm.distributed import TensorParallel, validate_tensor_parallel
from nanovllm.layers.embedding import VocabParallelEmbedding
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

HIDDEN, HEAD_DIM, HEADS, KV_HEADS = 10, 3, 4, 2


def ranks(size: int) -> list[TensorParallel]:
    return [TensorParallel(rank, size) for rank in range(size)]


def test_qkv_ranks_hold_whole_query_and_kv_heads_with_their_bias():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n * HEAD_DIM, HIDDEN, generator=g) for n in (HEADS, KV_HEADS, KV_HEADS))
    qb, kb, vb = (torch.randn(n * HEAD_DIM, generator=g) for n in (HEADS, KV_HEADS, KV_HEADS))
    x = torch.randn(5, HIDDEN, generator=g)
    per_rank = []
    for tp in ranks(2):
        layer = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias=True, tp=tp)
        for shard, (w, b) in enumerate(((q, qb), (k, kb), (v, vb))):
            layer.weight.weight_loader(layer.weight, w, shard)
            layer.bias.weight_loader(layer.bias, b, shard)
        assert (layer.num_heads, layer.num_kv_heads) == (HEADS // 2, KV_HEADS // 2)
        per_rank.append(layer(x).split([HEADS // 2 * HEAD_DIM, KV_HEADS // 2 * HEAD_DIM, KV_HEADS // 2 * HEAD_DIM], -1))
    for i, (w, b) in enumerate(((q, qb), (k, kb), (v, vb))):
        torch.testing.assert_close(torch.cat([out[i] for out in per_rank], -1), F.linear(x, w, b))


def test_gate_up_ranks_hold_matching_rows_of_gate_and_up():
    g = torch.Generator().manual_seed(1)
    gate, up = torch.randn(8, HIDDEN, generator=g), torch.randn(8, HIDDEN, generator=g)
    x = torch.randn(3, HIDDEN, generator=g)
    gates, ups = [], []
    for tp in ranks(2):
        layer = MergedColumnParallelLinear(HIDDEN, [8, 8], tp=tp)
        layer.weight.weight_loader(layer.weight, gate, 0)
        layer.weight.weight_loader(layer.weight, up, 1)
        local_gate, local_up = layer(x).chunk(2, dim=-1)  # what MLP.forward does on each rank
        gates.append(local_gate)
        ups.append(local_up)
    torch.testing.assert_close(torch.cat(gates, -1), x @ gate.T)
    torch.testing.assert_close(torch.cat(ups, -1), x @ up.T)


def test_row_parallel_partial_products_sum_to_the_full_product():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(HIDDEN, 12, generator=g)
    x = torch.randn(4, 12, generator=g)
    partial = []
    for tp in ranks(3):
        layer = RowParallelLinear(12, HIDDEN, tp=tp)
        layer.weight.weight_loader(layer.weight, w)
        cols = layer.weight.shape[1]
        partial.append(x[:, tp.rank * cols:(tp.rank + 1) * cols] @ layer.weight.T)  # each rank sees its columns
    torch.testing.assert_close(sum(partial), x @ w.T)


def test_vocab_shards_pad_the_last_rank_and_cover_the_vocabulary_once():
    table = torch.randn(7, 4)
    shards = []
    for tp in ranks(2):
        emb = VocabParallelEmbedding(7, 4, tp)
        emb.weight.weight_loader(emb.weight, table)
        shards.append(emb.weight.data)
    assert [s.shape[0] for s in shards] == [4, 4]
    torch.testing.assert_close(torch.cat(shards)[:7], table)
    assert torch.all(shards[1][3] == 0)  # padding row past the vocabulary


def test_loaders_reject_tensors_of_the_wrong_full_shape():
    layer = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, tp=TensorParallel(1, 2))
    with pytest.raises(ValueError, match=r"has shape \(6, 10\), expected \(12, 10\)"):
        layer.weight.weight_loader(layer.weight, torch.zeros(6, HIDDEN), 0)


@pytest.mark.parametrize("heads, kv_heads, inter, size, named", [
    (4, 2, 8, 3, "num_attention_heads (4)"),
    (8, 2, 8, 4, "num_key_value_heads (2)"),
    (4, 4, 6, 4, "intermediate_size (6)"),
])
def test_validation_names_what_does_not_divide(heads, kv_heads, inter, size, named):
    with pytest.raises(ValueError) as err:
        validate_tensor_parallel(heads, kv_heads, inter, size)
    assert named in str(err.value) and f"tensor_parallel_size={size}" in str(err.value)
    validate_tensor_parallel(8, 4, 16, 4)  # divides: no error
