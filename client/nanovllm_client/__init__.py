"""nanovllm-client: stream answers from a nanovllm service; also the wire protocol its stages share.

Depends on pyzmq and msgpack only (never torch, transformers or numpy).

    from nanovllm_client import Client
    with Client("ipc:///run/nanovllm") as c:
        for delta in c.stream("Hello", max_tokens=64, temperature=0):
            print(delta.text, end="", flush=True)
"""
from .async_client import AsyncClient, AsyncStream
from .client_state import Delta, Result
from .endpoints import Endpoints, UnsafeRuntimeDirError, default_url, service_endpoints
from .errors import (EngineDeadError, NanovllmError, RequestError, RequestTimeoutError, ServiceDrainingError,
                     ServiceUnavailableError)
from .protocol import PROTOCOL_VERSION, ProtocolError
from .sync_client import Client, Stream

__all__ = ["AsyncClient", "AsyncStream", "Client", "Delta", "EngineDeadError", "Endpoints", "NanovllmError",
           "PROTOCOL_VERSION", "ProtocolError", "RequestError", "RequestTimeoutError", "Result",
           "ServiceDrainingError", "ServiceUnavailableError", "Stream", "UnsafeRuntimeDirError", "default_url",
           "service_endpoints"]
