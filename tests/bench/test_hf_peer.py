"""bench/hf_peer.py: the static-cache decode loop it times computes HF's greedy tokens, and a real
run on CPU reports every figure with the token counts its workload asks for."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.hf_peer import decode_step, decode_worker, load_hf_model, prefill
from bench.models import make_bench_model
from bench.offline import random_output_lengths

ROOT = Path(__file__).resolve().parents[2]


def test_the_static_cache_decode_loop_follows_generate(tmp_path):
    from transformers import StaticCache

    model = load_hf_model(make_bench_model("tiny", str(tmp_path)), torch.device("cpu"), torch.float32)
    prompt = torch.randint(2, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                                  do_sample=False, pad_token_id=0, eos_token_id=None)[0, 9:].tolist()
        cache = StaticCache(config=model.config, max_cache_len=9 + 12)
        for _ in range(2):  # the second run reuses the cache, as the timed run reuses the warm-up's
            cache.reset()
            token = prefill(model, prompt, cache)
            tokens = [token.item()]
            for _ in range(11):
                token = decode_step(model, token, cache)
                tokens.append(token.item())
            assert tokens == expected


def test_a_step_that_fails_to_compile_is_timed_eager_and_the_reason_kept(tmp_path, monkeypatch):
    def failing_compile(fn, **options):
        def compiled(*args):
            raise RuntimeError("inductor: no C++ compiler\nmore detail")
        return compiled

    monkeypatch.setattr(torch, "compile", failing_compile)
    result = decode_worker(make_bench_model("tiny", str(tmp_path)), "cpu", "float32", prompt_len=5, steps=3,
                           compile_step=True, seed=0)
    assert result["compiled"] is False and result["cuda_graph_skips"] is None
    assert result["not_compiled_reason"] == "RuntimeError: inductor: no C++ compiler"
    assert result["decode_ms_batch1"] > 0


def test_a_cpu_run_reports_decode_latency_and_generate_throughput(tmp_path):
    sizes = dict(num_seqs=5, min_input=3, max_input=20, min_output=2, max_output=9, batch_size=2)
    argv = ["--shape", "tiny", "--model-dir", str(tmp_path), "--device", "cpu", "--no-compile",
            "--prompt-len", "12", "--decode-steps", "6"]
    argv += [arg for name, value in sizes.items() for arg in (f"--{name.replace('_', '-')}", str(value))]
    python_path = [str(ROOT), str(ROOT / "client"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(python_path))
    ran = subprocess.run([sys.executable, "-m", "bench.hf_peer", *argv], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr[-3000:]
    result = json.loads(next(line for line in ran.stdout.splitlines() if line.startswith('{"bench": "hf_peer"')))

    assert (result["device"], result["dtype"], result["shape"]) == ("cpu", "float32", "tiny")
    assert result["compiled"] is False and result["not_compiled_reason"] == "--no-compile"
    assert result["decode_steps"] == 6 and result["decode_ms_batch1"] > 0 and result["decode_tok_s"] > 0

    lens = random_output_lengths(sizes["min_output"], sizes["max_output"], sizes["num_seqs"])
    by_length = sorted(lens)
    batches = [by_length[i:i + sizes["batch_size"]] for i in range(0, len(lens), sizes["batch_size"])]
    assert result["offline_requested_tokens"] == sum(lens)
    # every batch runs to its longest request
    assert result["offline_generated_tokens"] == sum(max(b) * len(b) for b in batches) >= sum(lens)
    assert result["offline_s"] > 0
    # requested tokens over the seconds (rounded to ms in the JSON: a short run's rate moves by ~1%)
    assert result["offline_output_tok_s"] == pytest.approx(sum(lens) / result["offline_s"], rel=0.02)
    assert "generate" in ran.stdout.split(json.dumps(result))[1]  # the table follows the JSON line
