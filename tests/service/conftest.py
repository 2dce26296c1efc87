"""Service fixtures: real stage processes over real sockets, torn down even when a test fails."""
from __future__ import annotations

import os
import sys

import pytest
import zmq

try:
    import nanovllm_client  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e ./client`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "client"))

from nanovllm_client import Client  # noqa: E402
from tests.service.chain_model import make_chain_model  # noqa: E402
from tests.service.harness import ServiceProcs, free_tcp_base_port, short_tmpdir  # noqa: E402

START_TIMEOUT = 120.0
"""Three processes importing torch/transformers on two busy cores can take a while."""
TINY_ENGINE_ARGS = ["--num-kvcache-blocks", "512", "--max-num-seqs", "64", "--num-threads", "1"]
FAST_FAILURE_ARGS = ["--client-timeout-s", "3", "--engine-timeout-s", "3"]
"""A client silent 3 s (the default is 5) has its requests aborted, so failure tests end sooner;
an engine silent 3 s (the default) is dead: twelve missed heartbeats, which a loaded machine's
scheduling does not make (the 1.5 s these tests once used could)."""
EXACT_ARGS = ["--dtype", "float32"]
"""For tests that hold a stream continued by a restarted engine to the uninterrupted answer:
the continuation prefills output that was decoded, and in bf16 (what `auto` picks on a CPU
with AVX-512-BF16) that rounds differently enough to flip a near-tie of the random tiny model
(one prompt of six, at some cuts); in fp32 none did."""


def start_service(model: str, url: str, engine_args=TINY_ENGINE_ARGS, detok_args=FAST_FAILURE_ARGS,
                  env: dict[str, dict[str, str]] | None = None, curve=None) -> ServiceProcs:
    procs = ServiceProcs(model, url, engine_args, detok_args, stage_env=env).start()
    try:
        with Client(url, connect_timeout=START_TIMEOUT, curve=curve) as c:
            c.wait_engine(timeout=START_TIMEOUT)
    except BaseException:
        print(procs.logs())
        procs.stop()
        raise
    return procs


@pytest.fixture
def ctx():
    """A zmq context for a test's raw sockets, destroyed (sockets and all) after it."""
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture(scope="session")
def service(tiny_model_dir):
    """The shared tiny-model service over ipc:// (tests here must leave it healthy)."""
    procs = start_service(tiny_model_dir, f"ipc://{short_tmpdir()}/svc")
    yield procs
    procs.stop()


@pytest.fixture(scope="session")
def service_with_auto(service, tiny_model_dir):
    """`service_with_auto(dtype)`: a tiny-model service whose engine resolves `dtype="auto"` to
    `dtype` (the `auto_dtype` fixture's values). The shared service where that is what auto gives
    here anyway; otherwise one started with NANOVLLM_AUTO_DTYPE on first use and kept for the
    session, so each way costs one start however many tests ask."""
    from nanovllm.layers.cpu_kernels import native_cpu_dtype

    # What the shared service's engine resolved auto to: forced for the whole run, or this CPU's.
    shared = os.environ.get("NANOVLLM_AUTO_DTYPE") or str(native_cpu_dtype()).removeprefix("torch.")
    started = {shared: service}

    def get(dtype: str) -> ServiceProcs:
        if dtype not in started:
            started[dtype] = start_service(tiny_model_dir, f"ipc://{short_tmpdir()}/svc",
                                           env={"engine_proc": {"NANOVLLM_AUTO_DTYPE": dtype}})
        procs = started[dtype]
        assert f"dtype auto -> {dtype}:" in procs.logs(tail=10**8), f"the engine did not resolve auto to {dtype}"
        return procs

    yield get
    for procs in started.values():
        if procs is not service:
            procs.stop()


@pytest.fixture(scope="session")
def slow_service(tiny_model_dir):
    """Steps of >= 10 ms: a request of N tokens runs N steps, over N/100 s on any machine, so one
    that ends sooner, counted in steps, was aborted (with the shared service a 600-token request
    ends in about a second, and a test could not tell an abort from the natural end)."""
    procs = start_service(tiny_model_dir, f"ipc://{short_tmpdir()}/svc",
                          engine_args=TINY_ENGINE_ARGS + ["--post-step-hook", "tests.helpers.hooks:slow_step"])
    yield procs
    procs.stop()


@pytest.fixture
def slow_client(slow_service):
    with Client(slow_service.url, timeout=120, connect_timeout=60) as c:
        yield c
    slow_service.assert_running()


@pytest.fixture
def client(service):
    with Client(service.url, timeout=60, connect_timeout=30) as c:
        yield c
    service.assert_running()


@pytest.fixture(scope="session")
def chain_model(tmp_path_factory, tokenizer_dir):
    path = str(tmp_path_factory.mktemp("chain-model"))
    return path, make_chain_model(path, tokenizer_dir)


@pytest.fixture(scope="session")
def tcp_chain_service(chain_model):
    """The scripted chain model served over tcp://127.0.0.1, each step >= 10 ms (a request's
    steps then last long enough to tell an abort from its natural end)."""
    path, _ = chain_model
    procs = start_service(path, f"tcp://127.0.0.1:{free_tcp_base_port()}",
                          engine_args=TINY_ENGINE_ARGS + ["--post-step-hook", "tests.helpers.hooks:slow_step"])
    yield procs
    procs.stop()
