"""Tensor parallelism on torch.distributed: who this rank is, its collectives, and the step channel.

With `tensor_parallel_size` N the model's heads, MLP rows and vocabulary are split over N ranks,
one process each: rank 0 lives in the engine's process (it schedules and samples), ranks 1..N-1
are worker processes (engine/tp_workers.py) that run every step in lockstep with it. Two process
groups join them, both rendezvousing at `Config.dist_init_method`:

- the *compute* group (NCCL on CUDA, gloo on CPU) carries the model's all-reduces and the
  logits gather;
- the *control* group (always gloo, on CPU tensors) carries each step's inputs from rank 0 as
  msgpack bytes in a uint8 tensor. Workers wait on it while the engine idles, so it gets a
  timeout of a year: an idle engine must not time its workers out.

No shared memory is used, so the only per-instance name is the rendezvous address.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import msgpack
import torch
import torch.distributed as dist

# Collectives of a step finish in milliseconds; this bounds how long a rank waits for a peer
# that died or never came up (rendezvous included).
COMPUTE_TIMEOUT = timedelta(minutes=10)
CONTROL_TIMEOUT = timedelta(days=365)


def split_evenly(total: int, parts: int, what: str) -> int:
    """`total // parts`, or a ValueError naming `what` when it does not divide."""
    if total % parts:
        raise ValueError(f"tensor_parallel_size={parts} must divide {what} ({total})")
    return total // parts


def validate_tensor_parallel(num_heads: int, num_kv_heads: int, intermediate_size: int, size: int) -> None:
    """Raise ValueError unless a model with these dimensions splits over `size` ranks."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if size == 1:
        return
    bad = [f"{name} ({n})" for name, n in (("num_attention_heads", num_heads),
                                             ("num_key_value_heads", num_kv_heads),
                                             ("intermediate_size", intermediate_size)) if n % size]
    if bad:
        raise ValueError(
            f"tensor_parallel_size={size} must divide {', '.join(bad)}; each rank holds whole heads "
            f"(key/value heads are not replicated). Choose a size that divides {num_kv_heads} key/value heads."
        )


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group; the default is a single rank."""
    rank: int = 0
    size: int = 1
    group: object = field(default=None, compare=False, repr=False)
    """The compute process group (None: the default group)."""

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over ranks in place (no-op on a single rank)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's `x` along the last dim on rank 0; other ranks get None."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_first else None
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if self.is_first else None

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (ranks must agree on e.g. the KV block count)."""
        if self.size == 1:
            return value
        device = "cuda" if dist.get_backend(self.group) == "nccl" else "cpu"
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


class StepChannel:
    """Rank 0 broadcasts each step's inputs (msgpack-able data) to the workers over gloo."""

    def __init__(self, group: object):
        self.group = group

    def send(self, message: object) -> None:
        payload = msgpack.packb(message)
        dist.broadcast(torch.tensor([len(payload)], dtype=torch.int64), src=0, group=self.group)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=self.group)

    def receive(self) -> object:
        size = torch.empty(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.group)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=self.group)
        return msgpack.unpackb(payload.numpy().tobytes())


def check_can_init() -> None:
    """RuntimeError if this process already belongs to a process group (torch allows one)."""
    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialised in this process: run one tensor-parallel engine "
            "per process (each with its own rendezvous address, Config.dist_init_method)"
        )


def init_tensor_parallel(init_method: str, rank: int, size: int, device: torch.device) -> tuple[TensorParallel, StepChannel]:
    """Join the group at `init_method`; every rank calls this with its own rank."""
    check_can_init()
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, world_size=size, rank=rank, timeout=COMPUTE_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return TensorParallel(rank, size, None), StepChannel(control)


def shutdown_tensor_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
