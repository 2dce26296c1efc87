"""bench/cpu_attention.py times the compiled kernels and torch's path on the same attention."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nanovllm.layers.cpu_kernels import CpuAttentionKernel

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(CpuAttentionKernel.load() is None, reason="no C compiler for the CPU kernels")
@pytest.mark.parametrize("shape", [["--seqs", "3", "--context", "37"],  # a decode step
                                   ["--chunk", "70", "--cached", "30"]])  # a prompt chunk of two tiles after a cached prefix
def test_both_implementations_compute_the_same_attention_in_both_layouts(tmp_path, shape):
    out = tmp_path / "attn.json"
    subprocess.run([sys.executable, "-m", "bench.cpu_attention", "--dtype", "float32", *shape,
                    "--layers", "2", "--repeats", "1", "--json", str(out)], cwd=ROOT, check=True, capture_output=True)
    results = json.loads(out.read_text())
    impls = ("kernel", "rows", "torch") if "--chunk" in shape else ("kernel", "torch")  # rows: chunks only
    assert {(r["layout"], r["impl"]) for r in results} == {(l, i) for l in ("contiguous", "scattered") for i in impls}
    for layout in ("contiguous", "scattered"):
        kernel, *others = (next(r for r in results if r["layout"] == layout and r["impl"] == impl) for impl in impls)
        for other in others:
            assert kernel["checksum"] == pytest.approx(other["checksum"], rel=1e-3, abs=1e-2)
        assert kernel["ms_per_layer"] > 0 and kernel["kv_gb_per_s"] > 0
