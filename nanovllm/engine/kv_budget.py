"""How many KV-cache blocks fit: pure arithmetic, so it is tested on CPU with made-up numbers.

On CUDA the runner snapshots the card's free memory when it starts, loads the weights, runs a
warm-up forward of the largest step and frees it, then calls `gpu_kv_cache_bytes` with what it
measured. This process may use `gpu_memory_utilization` of the card in total; what it already
uses is counted from its own snapshot (free memory at start minus free memory now), never from
the card's total use, so another process on a shared card cannot push the budget negative. The
budget is also capped by the memory actually free, so it is never more than the card can give.
"""
from __future__ import annotations

_GIB = 1 << 30


def gpu_kv_cache_bytes(*, total: int, free_at_start: int, free_now: int, peak_allocated: int,
                       allocated_now: int, utilization: float) -> int:
    """Bytes this process may give its KV cache (never negative).

    total: the card's memory; free_at_start: free memory before this process loaded anything;
    free_now: free memory after the warm-up, its activations released; peak_allocated /
    allocated_now: torch's allocator during the warm-up and after it (their difference is the
    activation memory every later step needs again). The CUDA context, created before the
    first snapshot, is not counted: it is small next to the 1 - utilization headroom.
    """
    activations = max(0, peak_allocated - allocated_now)
    own_use = max(0, free_at_start - free_now) + activations
    allowed = int(total * utilization) - own_use
    available = free_now - activations
    return max(0, min(allowed, available))


def num_blocks_for(budget_bytes: int, bytes_per_block: int, what: str) -> int:
    """Whole blocks in the budget; ValueError (saying `what` to raise) if not even one fits."""
    num_blocks = budget_bytes // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"no KV-cache block fits: {budget_bytes / _GIB:.3f} GiB left for the cache, "
            f"{bytes_per_block / _GIB:.4f} GiB per block; {what}"
        )
    return num_blocks
