"""The sampler on valid but extreme parameter values: no crash, no NaN, the limit behaviour."""
from __future__ import annotations

import itertools

import pytest
import torch

from nanovllm.engine import sampler as sampler_module
from nanovllm.layers import sampling_ops
from nanovllm.engine.sampler import Sampler
from nanovllm.sampling_params import SamplingParams
from tests.helpers.rows import sampled_row

V = 512


def sample(params: list[SamplingParams], logits: torch.Tensor) -> list[int]:
    sampler = Sampler(V, torch.device("cpu"))
    seqs = [sampled_row(f"r{i}", [1, 2, 3], p, V, arrival=i) for i, p in enumerate(params)]
    return sampler(logits.clone(), seqs)


@pytest.fixture(params=[10_000, 8], ids=["full-sort", "probe-8"])
def probe_width(request, monkeypatch):
    monkeypatch.setattr(sampling_ops, "PROBE_WIDTH", request.param)


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


# -- a failing row ends its own request, not the batch ---------------------------------------

NEIGHBOURS = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=3, top_p=0.9),
              SamplingParams(temperature=0, repetition_penalty=1.3, logprobs=2),
              SamplingParams(temperature=1.1, seed=4, top_k=20, min_p=0.05)]


class Poison:
    """A logits processor that misbehaves from the `at`-th output token on."""

    def __init__(self, how: str, at: int = 0):
        self.how, self.at = how, at

    def __call__(self, output_ids, logits):
        if len(output_ids) < self.at:
            return logits
        if self.how == "raise":
            raise KeyError("the processor broke")
        if self.how == "wrong-shape":
            return logits[:3]
        logits[5] = {"nan": float("nan"), "+inf": float("inf")}[self.how]
        return logits


def run_steps(params: list[SamplingParams], processors: dict[int, list], steps: int,
              absent: frozenset[int] = frozenset()) -> tuple[list[list[int]], list]:
    """Sample `steps` tokens for each request, feeding each one back; per-step logits from a fixed stream."""
    sampler = Sampler(V, torch.device("cpu"), seed=1)
    seqs = [sampled_row(f"r{i}", [1, 2, 3], p, V, processors=processors.get(i, []), arrival=i)
            for i, p in enumerate(params)]
    g = torch.Generator().manual_seed(0)
    out = [[] for _ in params]
    live = [i for i in range(len(params)) if i not in absent]
    for _ in range(steps):
        logits = torch.randn(len(params), V, generator=g) * 3  # every request has its own row stream
        tokens = sampler(logits[live], [seqs[i] for i in live])
        for i, t in zip(live, tokens):
            out[i].append(t)
            if t != sampler_module.SAMPLE_FAILED:
                seqs[i].token_ids.append(t)
        live = [i for i in live if out[i][-1] != sampler_module.SAMPLE_FAILED]
    return out, seqs


@pytest.mark.parametrize("how", ["raise", "wrong-shape", "nan", "+inf"])
@pytest.mark.parametrize("bad_params", [SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=9, top_k=5)],
                         ids=["greedy", "sampled"])
def test_a_failing_row_fails_alone(how, bad_params):
    params = NEIGHBOURS[:2] + [bad_params] + NEIGHBOURS[2:]
    out, seqs = run_steps(params, {2: [Poison(how, at=3)]}, steps=6)
    assert out[2][:3] != [sampler_module.SAMPLE_FAILED] * 3 and out[2][3] == sampler_module.SAMPLE_FAILED
    assert len(out[2]) == 4  # not sampled again after it failed
    error = seqs[2].sampling.take_error()
    expected = {"raise": "KeyError: 'the processor broke'", "wrong-shape": "processor", "nan": "NaN", "+inf": "+inf"}[how]
    assert expected in error, error
    alone, _ = run_steps(params, {}, steps=6, absent=frozenset({2}))  # the same batch without it
    for i in (0, 1, 3, 4):
        assert out[i] == alone[i] and all(0 <= t < V for t in out[i])
        assert seqs[i].sampling.take_error() is None


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_model_logits_fail_their_row_on_the_greedy_fast_path(value):
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(5))
    logits[1, 7] = value
    if value == float("-inf"):
        logits[1] = value  # nothing left to choose
    sampler = Sampler(V, torch.device("cpu"))
    seqs = [sampled_row(f"r{i}", [1], SamplingParams(temperature=0), V, arrival=i) for i in range(4)]
    tokens = sampler(logits.clone(), seqs)
    expected = logits.argmax(dim=-1).tolist()
    expected[1] = sampler_module.SAMPLE_FAILED
    assert tokens == expected
    assert "logits" in seqs[1].sampling.take_error() and seqs[0].sampling.take_error() is None


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=1)],
                         ids=["greedy", "sampled"])
def test_an_id_outside_the_vocabulary_fails_its_row(params):
    # Logits wider than the vocabulary (a padded output layer): a padding column must never be returned.
    logits = torch.randn(3, V + 8, generator=torch.Generator().manual_seed(6))
    logits[2, V + 3] = 1e4
    sampler = Sampler(V, torch.device("cpu"))
    seqs = [sampled_row(f"r{i}", [1], params, V, arrival=i) for i in range(3)]
    tokens = sampler(logits, seqs)
    assert tokens[2] == sampler_module.SAMPLE_FAILED and all(0 <= t < V for t in tokens[:2])
    assert f"outside the vocabulary [0, {V})" in seqs[2].sampling.take_error()
