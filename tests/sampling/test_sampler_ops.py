"""The batch sampler against exact references: filtered sets, distributions, seeds, penalties, masks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nanovllm.layers import sampling_ops
from nanovllm.engine.sampler import Sampler, apply_penalties_
from nanovllm.sampling_params import SamplingParams
from tests.helpers.rows import sampled_row

V = 64


def sampler_for(params: list[SamplingParams], prompts: list[list[int]] | None = None, seed: int = 0,
                eos: tuple[int, ...] = ()) -> tuple[Sampler, list]:
    sampler = Sampler(V, torch.device("cpu"), seed)
    seqs = [sampled_row(f"r{i}", (prompts[i] if prompts else [1, 2, 3]), p, V, eos=eos, arrival=i)
            for i, p in enumerate(params)]
    return sampler, seqs


def reference_support(logits: np.ndarray, p: SamplingParams) -> dict[int, float]:
    """The exact allowed set and its renormalized probabilities, in float64, step by step."""
    x = logits.astype(np.float64) / p.temperature
    order = np.argsort(-x, kind="stable")
    if p.top_k != -1:
        order = order[:p.top_k]
    probs = np.exp(x[order] - x[order].max())
    probs /= probs.sum()
    keep = np.ones(len(order), dtype=bool)
    if p.top_p < 1:
        keep &= (np.cumsum(probs) - probs) < p.top_p
    keep &= probs >= p.min_p * probs[0]
    kept = probs[keep] / probs[keep].sum()
    return dict(zip(order[keep].tolist(), kept.tolist()))


def midpoint_top_p(logits: np.ndarray, temperature: float, top_k: int, j: int) -> float:
    """A top_p halfway between two cumulative sums, so the exact set is unambiguous in float32."""
    x = np.sort(logits.astype(np.float64) / temperature)[::-1][:top_k if top_k != -1 else None]
    probs = np.exp(x - x.max())
    cum = np.cumsum(probs / probs.sum())
    return float((cum[j - 1] + cum[j]) / 2)


def midpoint_min_p(logits: np.ndarray, temperature: float, j: int) -> float:
    x = np.sort(logits.astype(np.float64) / temperature)[::-1]
    ratio = np.exp(x - x[0])
    return float((ratio[j - 1] + ratio[j]) / 2)


@pytest.fixture(params=[1024, 8], ids=["full-sort", "probe-8"])
def probe_width(request, monkeypatch):
    """Run with the default probe (wider than V: no probe) and with a probe narrower than most sets."""
    monkeypatch.setattr(sampling_ops, "PROBE_WIDTH", request.param)
    return request.param


def test_filters_never_leave_the_exact_set_and_match_its_distribution(probe_width):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(V, generator=g) * 1.5
    row = base.numpy()
    cases = [  # sets of 4 to 14 tokens: some fit the 8-token probe, some need the fallback sort
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=midpoint_top_p(row, 1.3, -1, 14)),
        SamplingParams(temperature=1.0, min_p=midpoint_min_p(row, 1.0, 11)),
        SamplingParams(temperature=0.6, min_p=midpoint_min_p(row, 0.6, 4)),
        SamplingParams(temperature=0.8, top_p=midpoint_top_p(row, 0.8, -1, 5)),  # fits the probe
        SamplingParams(temperature=0.9, top_k=7, top_p=midpoint_top_p(row, 0.9, 7, 6),
                       min_p=midpoint_min_p(row, 0.9, 6)),
        SamplingParams(temperature=1.0),  # no filter: the whole softmax
        SamplingParams(temperature=0),  # greedy in the same batch
    ]
    draws_per_case = 3000
    params = [p for p in cases for _ in range(draws_per_case)]  # one batch, every case side by side
    sampler, seqs = sampler_for(params)
    tokens = np.array(sampler(base.repeat(len(params), 1), seqs)).reshape(len(cases), draws_per_case)
    for p, drawn in zip(cases, tokens):
        if p.is_greedy:
            assert set(drawn.tolist()) == {int(base.argmax())}
            continue
        expected = reference_support(row, p)
        assert set(drawn.tolist()) <= set(expected), f"{p}: drew {set(drawn.tolist()) - set(expected)} outside the set"
        counts = np.bincount(drawn, minlength=V) / draws_per_case
        tv = 0.5 * sum(abs(counts[t] - expected.get(t, 0.0)) for t in range(V))
        assert tv < 0.06, f"{p}: total variation {tv:.3f} from the renormalized distribution"
        assert all(counts[t] > 0 for t, q in expected.items() if q > 0.003), f"{p}: a token of the set is never drawn"


def test_each_row_is_exact_for_its_own_logits(probe_width):
    # Every row has its own random logits and parameters; each draw must lie in its own row's set.
    g = torch.Generator().manual_seed(2)
    kinds = [SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=2.0, top_p=0.3),
             SamplingParams(temperature=0.5, min_p=0.5), SamplingParams(top_k=10, top_p=0.5, min_p=0.2),
             SamplingParams(temperature=0.7, top_p=0.8, min_p=0.05)]
    params = kinds * 250
    logits = torch.randn(len(params), V, generator=g) * 3
    sampler, seqs = sampler_for(params)
    checked = 0
    for p, row, tok in zip(params, logits.numpy(), sampler(logits.clone(), seqs)):
        if not near_a_boundary(row, p):  # float32 rounding may decide those; the midpoint test covers them
            assert tok in reference_support(row, p), p
            checked += 1
    assert checked > 1100


def near_a_boundary(logits: np.ndarray, p: SamplingParams, eps: float = 1e-4) -> bool:
    x = np.sort(logits.astype(np.float64) / p.temperature)[::-1]
    ratio = np.exp(x - x[0])
    probs = ratio[:p.top_k] if p.top_k != -1 else ratio
    cum = np.cumsum(probs / probs.sum())
    return bool((p.top_p < 1 and np.any(np.abs(cum - p.top_p) < eps)) or (p.min_p > 0 and np.any(np.abs(ratio - p.min_p) < eps)))


def test_seeded_rows_do_not_depend_on_batch_neighbours():
    g = torch.Generator().manual_seed(3)
    steps = [torch.randn(V, generator=g) * 2 for _ in range(25)]
    seeded = SamplingParams(temperature=1.0, top_k=20, seed=42)
    neighbourhoods = [
        [],
        [SamplingParams(temperature=1.0)] * 3,  # needs all V candidates
        [SamplingParams(temperature=0.5, top_k=5), SamplingParams(temperature=0)],
        [SamplingParams(temperature=0.8, seed=7, top_p=0.9), SamplingParams(temperature=1.5, min_p=0.1)] * 4,
    ]
    runs = []
    for neighbours in neighbourhoods:
        row = len(neighbours) // 2  # the seeded request sits at a different row in each batch
        params = neighbours[:row] + [seeded] + neighbours[row:]
        sampler, seqs = sampler_for(params)
        tokens = []
        for logits in steps:
            batch = torch.randn(len(params), V, generator=g)
            batch[row] = logits
            tokens.append(sampler(batch, seqs)[row])
        runs.append(tokens)
    assert all(r == runs[0] for r in runs), runs
    other_seed, seqs = sampler_for([SamplingParams(temperature=1.0, top_k=20, seed=43)])
    assert [other_seed(s.unsqueeze(0), seqs)[0] for s in steps] != runs[0]


def reference_penalties(logits: torch.Tensor, prompt: list[int], output: list[int], rep: float, pres: float,
                        freq: float) -> torch.Tensor:
    out = logits.clone()
    for v in range(logits.shape[0]):
        if v in prompt or v in output:
            out[v] = out[v] / rep if out[v] > 0 else out[v] * rep
        c = output.count(v)
        out[v] -= freq * c + pres * (c > 0)
    return out


def test_penalties_match_the_reference_formula():
    g = torch.Generator().manual_seed(4)
    rows = [(1.3, 0.0, 0.0), (1.0, 0.7, 0.0), (1.0, 0.0, 0.4), (0.8, -0.5, 1.2), (1.0, 0.0, 0.0)]
    logits = torch.randn(len(rows), V, generator=g) * 3
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (5, 1, 9, 3, 4)]
    outputs = [torch.randint(0, V, (n,), generator=g).tolist() for n in (0, 12, 7, 20, 3)]
    got = apply_penalties_(logits.clone(), [p + o for p, o in zip(prompts, outputs)], outputs,
                           *(torch.tensor(c) for c in zip(*rows)))
    for i, (rep, pres, freq) in enumerate(rows):
        torch.testing.assert_close(got[i], reference_penalties(logits[i], prompts[i], outputs[i], rep, pres, freq))


def test_greedy_with_penalties_picks_the_penalized_argmax():
    g = torch.Generator().manual_seed(5)
    for trial in range(30):
        params = [SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=1.5, presence_penalty=1.0),
                  SamplingParams(temperature=0)]
        prompts = [torch.randint(0, V, (6,), generator=g).tolist() for _ in params]
        sampler, seqs = sampler_for(params, prompts)
        for s in seqs:
            s.token_ids += torch.randint(0, V, (8,), generator=g).tolist()
        logits = torch.randn(2, V, generator=g) * 2
        ref = reference_penalties(logits[0], prompts[0], seqs[0].output_token_ids, 2.0, 1.0, 1.5)
        assert sampler(logits.clone(), seqs) == [int(ref.argmax()), int(logits[1].argmax())]


def test_bias_allowed_ids_and_min_tokens_masks():
    logits = torch.zeros(3, V)
    logits[:, 9] = 10.0  # 9 is EOS and the favourite
    params = [SamplingParams(temperature=0, logit_bias={33: 20.0}),
              SamplingParams(temperature=1.0, allowed_token_ids=[4, 5]),
              SamplingParams(temperature=0, min_tokens=2)]
    from nanovllm.layers.logits_processors import AllowedTokenIds
    sampler = Sampler(V, torch.device("cpu"))
    processors = [[], [AllowedTokenIds([4, 5], V)], []]
    seqs = [sampled_row(f"r{i}", [1], p, V, processors=processors[i], eos=(9,), arrival=i) for i, p in enumerate(params)]
    for _ in range(50):
        first, second, third = sampler(logits.clone(), seqs)
        assert first == 33 and second in (4, 5) and third != 9
    seqs[2].token_ids += [3, 3]  # min_tokens reached: EOS allowed again
    assert sampler(logits.clone(), seqs)[2] == 9


def test_logprobs_are_of_the_raw_distribution():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(2, V, generator=g)
    params = [SamplingParams(temperature=0.5, top_k=3, repetition_penalty=1.5, logprobs=4), SamplingParams(temperature=0, logprobs=0)]
    sampler, seqs = sampler_for(params)
    tokens = sampler(logits.clone(), seqs)
    ref = torch.log_softmax(logits, dim=-1)
    for i, tok in enumerate(tokens):
        (lp,) = seqs[i].sampling.take_logprobs()
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(ref[i, tok].item(), abs=1e-6)
        assert lp.rank == int((ref[i] > ref[i, tok]).sum()) + 1
        n = params[i].logprobs
        assert lp.top_token_ids == ref[i].topk(n).indices.tolist() if n else lp.top_token_ids == []
        assert seqs[i].sampling.take_logprobs() == []  # taken


def test_plain_greedy_batch_is_one_argmax():
    sampler, seqs = sampler_for([SamplingParams(temperature=0)] * 4)
    state = sampler.generator.get_state()
    logits = torch.randn(4, V)
    assert sampler(logits, seqs) == logits.argmax(-1).tolist()
    assert torch.equal(sampler.generator.get_state(), state)  # no random numbers drawn


def test_constraints_that_leave_no_token_fall_back_to_the_unconstrained_row(caplog):
    from nanovllm.layers.logits_processors import AllowedTokenIds
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(7))
    params = [SamplingParams(temperature=0, min_tokens=3), SamplingParams(temperature=1.0, min_tokens=3)]
    sampler = Sampler(V, torch.device("cpu"))
    # only EOS is allowed, and EOS is held back by min_tokens
    seqs = [sampled_row(f"r{i}", [1], p, V, processors=[AllowedTokenIds([9], V)], eos=(9,), arrival=i)
            for i, p in enumerate(params)]
    with caplog.at_level("WARNING"):
        greedy, sampled = sampler(logits.clone(), seqs)
    assert greedy == int(logits[0].argmax()) and 0 <= sampled < V
    assert "allow no token" in caplog.text and "'r0', 'r1'" in caplog.text


def kept_distribution(candidates: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Candidates (R, W) -> each row's sampling distribution over the vocabulary (R, V)."""
    return torch.zeros(len(ids), vocab).scatter_(1, ids, candidates.softmax(dim=-1))


@pytest.mark.parametrize("scale", [2.5, 0.5], ids=["sets-fit-the-probe", "sets-need-the-sort"])
def test_probe_gives_the_same_sets_as_a_full_sort(monkeypatch, scale):
    # At scale 2.5 the 32 most likely of 512 tokens hold 64-91% of each row's mass: the sets fit
    # in them, but top_p must still be judged against the whole vocabulary's mass.
    logits = torch.randn(6, 512, generator=torch.Generator().manual_seed(8)) * scale
    top_k, top_p, min_p = [512, 512, 4, 512, 16, 512], [0.6, 1.0, 0.8, 0.5, 1.0, 0.55], [0.0, 0.2, 0.0, 0.1, 0.3, 0.0]
    monkeypatch.setattr(sampling_ops, "PROBE_WIDTH", 10_000)
    full = kept_distribution(*sampling_ops.filter_candidates(logits, top_k, top_p, min_p), 512)
    monkeypatch.setattr(sampling_ops, "PROBE_WIDTH", 32)
    candidates, ids = sampling_ops.filter_candidates(logits, top_k, top_p, min_p)
    assert (ids.shape[1] == 32) == (scale > 1)  # the probe was kept only where every set fits in it
    torch.testing.assert_close(kept_distribution(candidates, ids, 512), full)


def test_draw_is_the_exact_inverse_cdf_on_rows_with_inf_huge_negative_and_ordinary_values():
    import bisect

    from nanovllm.layers.sampling_ops import draw
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(6, 512, generator=g) * 4  # (R, W)
    logits[0, ::2] = float("-inf")  # half the row masked
    logits[1, 3:] = float("-inf")  # a grammar row: three tokens left
    logits[2, 100:200] = -1e30  # huge negative: weight 0, like -inf
    logits[3, 50:60] = torch.linspace(-120, -80, 10)  # exp under- and near-underflow
    logits[4] += 1e4  # large but ordinary
    uniform = torch.rand(6, dtype=torch.float64, generator=g)
    for u_case in (uniform, torch.zeros(6, dtype=torch.float64), torch.full((6,), 1 - 2 ** -53, dtype=torch.float64)):
        chosen = draw(logits.clone(), u_case).tolist()
        for r, row in enumerate(logits):
            weights = torch.exp(row - row.max()).double()  # exp of the row minus its max, nothing clamped
            cdf = weights.cumsum(0).tolist()
            u = (1 - float(u_case[r])) * cdf[-1]
            assert chosen[r] == bisect.bisect_left(cdf, u), r
            assert weights[chosen[r]] > 0  # never a masked or underflowed token
