"""engine/heap.py: freed heap pages go back to the OS, and the engine does it after loading."""
import gc
import os
import platform
import subprocess
import sys
import textwrap

import pytest

from nanovllm.engine.heap import release_free_heap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")


def _rss_anon_mb() -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024


@glibc
def test_free_pages_between_live_chunks_are_returned():
    # 160 MB in 4 KB chunks (malloc's heap, not mmap), then every chunk but one in 200 freed: the
    # free space sits between live chunks, so free() alone cannot shrink the heap.
    chunks = [bytes([i % 251]) * 4000 for i in range(40_000)]
    kept = chunks[::200]
    del chunks
    gc.collect()
    held = _rss_anon_mb()
    assert release_free_heap() is True
    assert held - _rss_anon_mb() > 100, "malloc_trim returned less than 100 of ~158 free MB"
    assert len(kept) == 200


@glibc
def test_engine_load_leaves_no_load_temporaries_resident():
    # What LLMEngine keeps after loading the default model is its tensors plus the runtime; without
    # the release the process kept the load's freed temporaries too (~180 MB more on bf16 and fp32).
    # Measured in a fresh process: the resident memory a trim after the load would still return
    # must be small, i.e. the engine already returned it.
    code = textwrap.dedent("""
        import ctypes, gc
        def anon():
            with open("/proc/self/status") as f:
                return next(int(l.split()[1]) for l in f if l.startswith("RssAnon:")) / 1024
        from nanovllm.engine.llm_engine import LLMEngine
        engine = LLMEngine(model="default", num_kvcache_blocks=64)
        engine._word_index.result()
        gc.collect()
        before = anon()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        print(before - anon())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    returnable = float(out.stdout.strip().splitlines()[-1])
    assert returnable < 40, f"{returnable:.0f} MB of freed heap was still resident after the engine loaded"
