"""nanovllm-client: stream answers from a nanovllm service; also the wire protocol its stages share.

Depends on pyzmq and msgpack only (never torch, transformers or numpy).

    from nanovllm_client import Client
    with Client("ipc:///run/nanovllm") as c:
        for delta in c.stream("Hello", max_tokens=64, temperature=0):
            print(delta.text, end="", flush=True)

The names below load on first use, so a module that needs only the wire protocol or the checks
(`nanovllm_client.protocol`, `nanovllm_client.checks`: msgpack, no pyzmq) imports without pyzmq.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .async_client import AsyncClient, AsyncStream
    from .client_state import Delta, Result
    from .endpoints import Endpoints, UnsafeRuntimeDirError, default_url, service_endpoints
    from .errors import (EngineDeadError, NanovllmError, RequestError, RequestTimeoutError, ServiceDrainingError,
                         ServiceUnavailableError)
    from .protocol import PROTOCOL_VERSION, FinishReason, ProtocolError, TokenLogprob, TopLogprob
    from .sampling import SamplingError, SamplingParams
    from .sync_client import Client, Stream

_HOMES = {
    "AsyncClient": "async_client", "AsyncStream": "async_client", "Delta": "client_state", "Result": "client_state",
    "Endpoints": "endpoints", "UnsafeRuntimeDirError": "endpoints", "default_url": "endpoints",
    "service_endpoints": "endpoints", "EngineDeadError": "errors", "NanovllmError": "errors",
    "RequestError": "errors", "RequestTimeoutError": "errors", "ServiceDrainingError": "errors",
    "ServiceUnavailableError": "errors", "PROTOCOL_VERSION": "protocol", "ProtocolError": "protocol",
    "FinishReason": "protocol", "TokenLogprob": "protocol", "TopLogprob": "protocol", "SamplingParams": "sampling", "SamplingError": "sampling",
    "Client": "sync_client", "Stream": "sync_client"}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
