"""Where each stage listens, derived from one service address.

A service is named by one URL, so a client needs one string and two instances on one host differ
in one string (systemd template units):

- ``ipc:///run/nanovllm`` (a directory) -> ``ipc:///run/nanovllm/{tokenizer,stream,engine,detok,control}.sock``
- ``tcp://127.0.0.1:5550`` -> tokenizer on port 5550, stream 5551, engine 5552, detok 5553, control 5554.

Each stage can still be given each endpoint explicitly (flags / NANOVLLM_* environment).
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

_TCP_OFFSETS = {"tokenizer": 0, "stream": 1, "engine": 2, "detok": 3, "control": 4}


@dataclass(frozen=True)
class Endpoints:
    tokenizer: str
    """Tokenizer ROUTER: clients send requests and aborts here."""
    stream: str
    """Detokenizer ROUTER: clients receive their streamed outputs here."""
    engine: str
    """Engine PULL: tokenized requests (from the tokenizer); not read while the engine's queue is full."""
    detok: str
    """Detokenizer PULL: the engine's step outputs."""
    control: str
    """Engine PULL: aborts (from tokenizer and detokenizer) and detokenizer hellos, read whatever
    the load, so an abort never waits behind the requests that fill the engine's queue."""


def default_runtime_dir() -> str:
    """$NANOVLLM_RUNTIME_DIR, else $XDG_RUNTIME_DIR/nanovllm, else <tmp>/nanovllm-<uid>."""
    if os.environ.get("NANOVLLM_RUNTIME_DIR"):
        return os.environ["NANOVLLM_RUNTIME_DIR"]
    if os.environ.get("XDG_RUNTIME_DIR"):
        return os.path.join(os.environ["XDG_RUNTIME_DIR"], "nanovllm")
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return os.path.join(tempfile.gettempdir(), f"nanovllm-{uid}")


def default_url() -> str:
    """$NANOVLLM_URL, else the ipc directory of `default_runtime_dir()`."""
    return os.environ.get("NANOVLLM_URL") or f"ipc://{default_runtime_dir()}"


def service_endpoints(url: str) -> Endpoints:
    """One service URL -> the five stage endpoints (see the module docstring)."""
    if url.startswith("ipc://"):
        base = url[len("ipc://"):].rstrip("/")
        if not base:
            raise ValueError(f"ipc service URL needs a directory path, got {url!r}")
        return Endpoints(*(f"ipc://{base}/{name}.sock" for name in _TCP_OFFSETS))
    if url.startswith("tcp://"):
        host, sep, port = url[len("tcp://"):].rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise ValueError(f"tcp service URL must look like tcp://HOST:PORT, got {url!r}")
        base_port = int(port)
        last = len(_TCP_OFFSETS) - 1
        if not 0 < base_port <= 65535 - last:
            raise ValueError(f"tcp base port must be in 1..{65535 - last} ({last + 1} consecutive ports are used), "
                             f"got {base_port}")
        return Endpoints(*(f"tcp://{host}:{base_port + off}" for off in _TCP_OFFSETS.values()))
    raise ValueError(f"service URL must start with ipc:// or tcp://, got {url!r}")


def ensure_ipc_dir(endpoint: str) -> None:
    """Create the directory of an ipc:// endpoint (mode 0700: only this user may connect)."""
    if endpoint.startswith("ipc://"):
        directory = os.path.dirname(endpoint[len("ipc://"):])
        if directory:
            os.makedirs(directory, mode=0o700, exist_ok=True)
