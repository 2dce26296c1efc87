"""Engine-test helpers: HF transformers greedy references on the same weights."""
from __future__ import annotations

import pytest
import torch


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int,
              dtype: torch.dtype = torch.float32) -> list[list[int]]:
    """HF transformers greedy continuations, one prompt at a time (no padding), fp32 by default."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    # Like the engine's ignore_eos: EOS may be generated and does not stop generation. (HF's
    # min_new_tokens would instead forbid EOS, which the engine does not do.)
    model.generation_config.eos_token_id = None
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=0)
            outs.append(out[0, len(prompt):].tolist())
    return outs


def finish_all(engine, step, ids: list[str], terminal) -> None:
    """Step until nothing is left (at most 500 steps); every request then ended exactly once
    (`terminal` counts finished outputs per id) and every KV block is free again."""
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        step()
    assert not engine.has_unfinished_requests(), "requests left hanging"
    assert all(terminal[r] == 1 for r in ids), f"terminal outputs per request: {terminal}"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="session")
def hf_reference():
    return hf_greedy
