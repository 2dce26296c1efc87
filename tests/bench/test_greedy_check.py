"""bench/greedy_check.py: how a divergence is judged, and nanovllm against HF for real on CPU."""
from __future__ import annotations

import pytest
import torch

from bench.greedy_check import compare_tokens, default_tolerance, main


def test_a_divergence_is_judged_by_hfs_logit_gap_where_it_starts():
    logits = torch.zeros(3, 8)  # (tokens, vocab)
    logits[1, 5], logits[1, 6] = 2.0, 1.99  # HF chose 5 at token 1; 6 is 0.01 behind
    near = compare_tokens(4, nano=[3, 6, 7], hf=[3, 5, 1], hf_logits=logits, tolerance=0.05)
    assert near == {"prompt_len": 4, "equal": False, "first_mismatch": 1, "nano_token": 6, "hf_token": 5,
                    "gap": pytest.approx(0.01, abs=1e-6), "near_tie": True}
    assert compare_tokens(4, [3, 6, 7], [3, 5, 1], logits, tolerance=0.001)["near_tie"] is False
    assert compare_tokens(4, [3, 5, 1], [3, 5, 1], logits, tolerance=0.05) == \
        {"prompt_len": 4, "equal": True, "first_mismatch": None}
    short = compare_tokens(4, [3, 5], [3, 5, 1], logits, tolerance=0.05)
    assert (short["equal"], short["first_mismatch"], short["near_tie"]) == (False, 2, False)


def test_the_default_tolerance_scales_with_precision():
    assert default_tolerance(torch.bfloat16) == 0.05
    assert default_tolerance(torch.float16) == pytest.approx(0.05 / 8)
    assert default_tolerance(torch.float32) < 1e-6


def test_nanovllm_and_hf_choose_the_same_greedy_tokens_in_float32(tmp_path, capsys):
    result = main(["--shape", "tiny", "--model-dir", str(tmp_path), "--device", "cpu", "--dtype", "float32",
                   "--num-prompts", "4", "--min-prompt-len", "3", "--max-prompt-len", "70", "--tokens", "16"])
    assert result["exact"] and result["equal"], result["prompts"]
    assert len(result["prompts"]) == 4 and len({p["prompt_len"] for p in result["prompts"]}) > 1
    assert capsys.readouterr().out.startswith('{"bench": "greedy_check"')
