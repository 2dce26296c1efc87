"""Rows for the sampler as the engine makes them: a `Sequence` carrying its `SamplingState`."""
from __future__ import annotations

from typing import Sequence as Seq

import torch

from nanovllm.engine.sequence import SamplingState, Sequence
from nanovllm.sampling_params import SamplingParams


def sampled_row(request_id: str, prompt: Seq[int], params: SamplingParams, vocab: int, *, processors: Seq = (),
                eos: Seq[int] = (), arrival: int = 0, output: Seq[int] = ()) -> Sequence:
    """A request as `LLMEngine.add_request` builds it (its processors given here), with `output`
    already generated."""
    state = SamplingState.build(params, list(processors), eos, vocab, torch.device("cpu"))
    seq = Sequence(request_id, list(prompt), params, arrival, sampling=state)
    seq.token_ids += list(output)
    return seq
