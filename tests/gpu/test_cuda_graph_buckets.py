"""Which batch sizes get a CUDA graph, and which graph a decode batch replays (runs on CPU)."""
from __future__ import annotations

import pytest

from nanovllm.engine.cuda_graphs import graph_batch_sizes, padded_batch_size


@pytest.mark.parametrize("max_num_seqs, expected", [
    (1, [1]),
    (3, [1, 2, 3]),
    (8, [1, 2, 4, 8]),
    (12, [1, 2, 4, 8, 12]),
    (16, [1, 2, 4, 8, 16]),
    (40, [1, 2, 4, 8, 16, 32, 40]),
    (64, [1, 2, 4, 8, 16, 32, 48, 64]),
])
def test_buckets_always_end_at_max_num_seqs(max_num_seqs, expected):
    assert graph_batch_sizes(max_num_seqs) == expected


def test_buckets_for_the_default_256():
    sizes = graph_batch_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and sizes == sorted(set(sizes))


@pytest.mark.parametrize("batch, padded", [(1, 1), (3, 4), (5, 8), (9, 16), (16, 16), (17, 32), (33, 40), (40, 40)])
def test_a_batch_pads_to_the_next_bucket(batch, padded):
    assert padded_batch_size(batch, graph_batch_sizes(40)) == padded


def test_a_batch_larger_than_every_bucket_runs_eagerly():
    assert padded_batch_size(41, graph_batch_sizes(40)) is None
