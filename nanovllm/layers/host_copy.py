"""Host values onto the device and device values back, without making the host wait.

On CUDA a copy from ordinary (pageable) host memory waits for the stream to drain first, so a
small `torch.tensor(values, device="cuda")` in the middle of a step makes the host wait for every
kernel queued before it. `upload` stages the values in pinned memory and copies asynchronously;
a `Download` starts the copy back into pinned memory and records an event, waited on only when
the values are needed. On CPU both are plain tensors and nothing waits.
"""
from __future__ import annotations

import torch


def upload(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` (a list of numbers, or of equal-length lists) as a tensor on `device`, copied
    without a host wait on CUDA."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class Download:
    """Device tensors on their way to host memory: `wait()` returns them as lists."""

    __slots__ = ("host", "ready")

    def __init__(self, *values: torch.Tensor):
        self.ready: torch.cuda.Event | None = None
        self.host = list(values)
        if any(v.device.type == "cuda" for v in values):
            self.host = [torch.empty(v.shape, dtype=v.dtype, pin_memory=True).copy_(v, non_blocking=True)
                         for v in values]
            self.ready = torch.cuda.Event()
            self.ready.record()

    def wait(self) -> list[list]:
        """The values, once the copies (and everything queued before them) have finished."""
        if self.ready is not None:
            self.ready.synchronize()
        return [v.tolist() for v in self.host]
