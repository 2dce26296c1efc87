"""The compiled draw (layers/cpu_sample.c, `CpuOps.draw`) against an inverse CDF computed in
float64, and the sampler taking it for unfiltered rows on CPU; the packed grammar mask
(`CpuOps.mask_bits`) against the unpacked bits."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nanovllm.engine.sampler import Sampler
from nanovllm.layers.sampling_ops import draw
from nanovllm.sampling_params import SamplingParams
from tests.helpers.rows import sampled_row

MARGIN = 1e-5
"""A uniform number this close (relative to the row's total) to a step of the CDF may land on
either neighbour: float32 weights and another exp than float64's. Such draws are not compared."""


def reference(row: torch.Tensor, temperature: float, uniform: float) -> int | None:
    """The token a float64 inverse CDF picks, or None when `uniform` is within MARGIN of a step."""
    s = (row.double() - row.double().max()) / temperature
    cdf = torch.cumsum(s.exp(), 0)
    cdf = cdf / cdf[-1]
    target = 1.0 - uniform
    token = int(torch.searchsorted(cdf, torch.tensor([target], dtype=torch.float64)))
    near = (cdf - target).abs().min().item()
    return None if near < MARGIN else token


@pytest.mark.parametrize("width", [1, 15, 17, 1000, 49152])  # below, around and far past a vector
def test_draws_equal_a_float64_inverse_cdf(ops, width):
    g = torch.Generator().manual_seed(width)
    rows = 40 if width < 49152 else 4
    logits = torch.randn(rows, width, generator=g) * 4
    logits[rows // 2:, ::3] = float("-inf")  # masked tokens, as a grammar or a bias leaves them
    if width == 1:
        logits[rows // 2:] = 0.5
    temperature = torch.rand(rows, generator=g) * 1.5 + 0.05
    compared = 0
    for _ in range(25):
        uniform = torch.rand(rows, dtype=torch.float64, generator=g)
        got = ops.draw(logits, temperature, uniform).tolist()
        for r in range(rows):
            assert logits[r, got[r]] > float("-inf")
            expected = reference(logits[r], float(temperature[r]), float(uniform[r]))
            if expected is not None:
                assert got[r] == expected, (r, float(uniform[r]))
                compared += 1
    assert compared >= rows * 25 * (0.5 if width == 49152 else 0.9)


def test_the_uniform_ends_pick_the_first_and_last_possible_tokens(ops):
    logits = torch.full((3, 70), float("-inf"))
    logits[0, [5, 40, 66]] = torch.tensor([1.0, 2.0, 0.5])
    logits[1, 3:69] = 0.0
    logits[2, 69] = 7.0
    temperature = torch.ones(3)
    last = ops.draw(logits, temperature, torch.zeros(3, dtype=torch.float64)).tolist()  # u = total
    first = ops.draw(logits, temperature, torch.full((3,), 1 - 2**-53, dtype=torch.float64)).tolist()
    assert last == [66, 68, 69] and first == [5, 3, 69]


def test_a_row_without_a_finite_maximum_or_with_a_nan_gets_minus_one_alone(ops):
    logits = torch.randn(5, 300)
    logits[1] = float("-inf")
    logits[2, 7] = float("inf")
    logits[3, 100] = float("nan")
    uniform = torch.rand(5, dtype=torch.float64)
    got = ops.draw(logits, torch.ones(5), uniform).tolist()
    assert got[1:4] == [-1, -1, -1]
    for r in (0, 4):
        assert got[r] == draw(logits[r:r + 1], uniform[r:r + 1]).item() or reference(logits[r], 1.0, float(uniform[r])) is None


def test_rows_of_a_wider_tensor_are_read_in_place(ops):
    wide = torch.randn(6, 500) * 3
    logits = wide[:, 100:400]  # rows further apart than their length
    uniform = torch.rand(6, dtype=torch.float64)
    expected = ops.draw(logits.contiguous(), torch.ones(6), uniform)
    assert torch.equal(ops.draw(logits, torch.ones(6), uniform), expected)
    with pytest.raises(ValueError, match="float32"):
        ops.draw(logits.double(), torch.ones(6), uniform)
    with pytest.raises(ValueError, match="one temperature"):
        ops.draw(logits, torch.ones(5), uniform)


def test_the_sampler_draws_unfiltered_rows_with_the_kernel_and_seeds_stay_seeds(ops):
    """Seeded rows through a Sampler with the kernel equal the float64 inverse CDF of the same
    uniform numbers; filtered rows (top_k) keep the torch path, the same tokens with or without."""
    vocab = 512
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, vocab, generator=g) * 3

    def run(cpu_ops, params):
        sampler = Sampler(vocab, torch.device("cpu"))
        sampler.cpu_ops = cpu_ops
        rows = [sampled_row(f"r{i}", [1], p, vocab) for i, p in enumerate(params)]
        return sampler._choose(logits.clone(), rows).tolist()

    plain = [SamplingParams(temperature=0.8, seed=100 + i) for i in range(8)]
    got = run(ops, plain)
    for r, p in enumerate(plain):
        uniform = torch.rand(1, dtype=torch.float64, generator=torch.Generator().manual_seed(p.seed)).item()
        expected = reference(logits[r], 0.8, uniform)
        assert expected is None or got[r] == expected
    assert run(ops, plain) == got  # a seed gives the same tokens again
    filtered = [SamplingParams(temperature=0.8, top_k=20, seed=7 + i) for i in range(8)]
    assert run(ops, filtered) == run(None, filtered)


def unpacked_blocked(bits: np.ndarray, n_vocab: int, width: int) -> torch.Tensor:
    """(G, width) bool: a 0 bit, or an id at or past n_vocab (the reference for `mask_bits`)."""
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :n_vocab].astype(bool)
    blocked = torch.ones(len(bits), width, dtype=torch.bool)
    covered = min(n_vocab, width)
    blocked[:, :covered] = torch.from_numpy(~allowed[:, :covered])
    return blocked


@pytest.mark.parametrize("n_vocab,width", [(1, 1), (31, 40), (64, 64), (1000, 1003), (49152, 49152), (100, 90)])
def test_packed_masks_block_exactly_the_zero_bits_and_ids_past_the_vocabulary(ops, n_vocab, width):
    rng = np.random.default_rng(n_vocab)
    words = -(-n_vocab // 32)
    rows = [5, 0, 3]  # a subset of the rows, in any order
    bits = rng.integers(-2**31, 2**31, size=(len(rows), words), dtype=np.int64).astype(np.int32)
    bits[0, : words // 2] = 0  # whole words blocked and whole words allowed, as grammars leave them
    bits[1, : words // 2] = -1
    wide = torch.randn(6, width + 7)
    logits = wide[:, :width]  # rows of a wider tensor: the stride is not the width
    expected = logits.clone()
    for g, r in enumerate(rows):
        expected[r].masked_fill_(unpacked_blocked(bits, n_vocab, width)[g], float("-inf"))
    untouched = wide[:, width:].clone()
    ops.mask_bits(logits, rows, bits, n_vocab)
    assert torch.equal(logits, expected)
    assert torch.equal(wide[:, width:], untouched)  # nothing past a row's width is written


def test_packed_masks_refuse_bits_of_the_wrong_shape_type_or_rows(ops):
    logits = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="int32 bits"):
        ops.mask_bits(logits, [0], np.zeros((1, 3), dtype=np.int32), 64)
    with pytest.raises(ValueError, match="int32 bits"):
        ops.mask_bits(logits, [0], np.zeros((1, 2), dtype=np.int64), 64)
    with pytest.raises(IndexError, match="outside the 2 logits rows"):
        ops.mask_bits(logits, [2], np.zeros((1, 2), dtype=np.int32), 64)
    with pytest.raises(ValueError, match="float32 CPU logits"):
        ops.mask_bits(logits.bfloat16(), [0], np.zeros((1, 2), dtype=np.int32), 64)
    assert torch.equal(logits, torch.zeros(2, 64))
