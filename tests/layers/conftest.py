"""Shared fixtures for the layer tests."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module", params=[1, 2], ids=["1-thread", "2-threads"])
def kernel_threads(request):
    """Run a module's compiled-kernel tests on one thread and on two (the kernels use torch's
    OpenMP threads), restoring torch's thread count afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(threads)


def _compiled_or_skip(kernels):
    loaded = kernels.load()
    if loaded is None:
        pytest.skip("no C compiler on this machine")
    return loaded


@pytest.fixture(scope="module")
def ops(kernel_threads):
    """The compiled CPU ops (layers/cpu_kernels.py), on one thread and on two; skips without a compiler."""
    from nanovllm.layers.cpu_kernels import CpuOps

    return _compiled_or_skip(CpuOps)


@pytest.fixture(scope="module")
def kernel(kernel_threads):
    """The compiled CPU attention kernel, on one thread and on two; skips without a compiler."""
    from nanovllm.layers.cpu_kernels import CpuAttentionKernel

    return _compiled_or_skip(CpuAttentionKernel)
