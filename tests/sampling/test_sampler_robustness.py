"""The sampler on valid but extreme parameter values: no crash, no NaN, the limit behaviour."""
from __future__ import annotations

import itertools

import pytest
import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.layers import sampler as sampler_module
from nanovllm.layers.sampler import Sampler
from nanovllm.sampling_params import SamplingParams

V = 512


def sample(params: list[SamplingParams], logits: torch.Tensor) -> list[int]:
    sampler = Sampler(V, torch.device("cpu"))
    seqs = []
    for i, p in enumerate(params):
        seqs.append(Sequence(f"r{i}", [1, 2, 3], p, arrival=i))
        sampler.add_request(f"r{i}", p)
    return sampler(logits.clone(), seqs)


@pytest.fixture(params=[10_000, 8], ids=["full-sort", "probe-8"])
def probe_width(request, monkeypatch):
    monkeypatch.setattr(sampler_module, "PROBE_WIDTH", request.param)


TINY_TEMPERATURES = [1e-40, 5e-324, 1e-45, 1e-38, 1e-30, 1e-12]
FILTERS = [dict(), dict(top_k=1), dict(top_k=5), dict(top_p=0.5), dict(top_p=1e-50), dict(min_p=0.5),
           dict(top_k=50, top_p=0.9, min_p=0.01)]
SEEDS = [None, 0, 2 ** 64 - 1]


def test_a_temperature_that_underflows_is_greedy(probe_width):
    # Every combination side by side in one batch, each row with its own logits (no ties).
    cases = [SamplingParams(temperature=t, seed=s, **f) for t, f, s in itertools.product(TINY_TEMPERATURES, FILTERS, SEEDS)]
    logits = torch.randn(len(cases), V, generator=torch.Generator().manual_seed(0)) * 3
    logits[::7, ::3] = float("-inf")  # some masked tokens too
    assert sample(cases, logits) == logits.argmax(dim=-1).tolist()


def test_a_top_p_below_the_top_probability_keeps_the_top_token(probe_width):
    cases = [SamplingParams(temperature=t, top_p=p, seed=s, **f)
             for t, p, s, f in itertools.product([0.5, 1.0, 3.0], [1e-50, 1e-30, 1e-8], SEEDS,
                                                  [dict(), dict(top_k=7), dict(min_p=0.2)])]
    logits = torch.randn(len(cases), V, generator=torch.Generator().manual_seed(1)) * 2
    assert sample(cases, logits) == logits.argmax(dim=-1).tolist()


def test_huge_temperatures_are_uniform_not_nan():
    cases = [SamplingParams(temperature=t, **f) for t in (1e30, 1e300, 10 ** 300) for f in FILTERS[:4]] * 20
    logits = torch.randn(len(cases), V, generator=torch.Generator().manual_seed(2)) * 3
    logits[:, :V // 2] = float("-inf")
    tokens = sample(cases, logits)
    assert all(V // 2 <= t < V for t in tokens)
