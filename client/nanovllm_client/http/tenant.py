"""Whom an HTTP request is for, as the front tells the service (`GenerateReq.tenant`): the API
key it came with, by a digest (the key itself never leaves the front), else the peer's address.
The service counts each tenant as one client for fair turns, per-client limits and the per-client
cache salt, as it counts each CURVE key of a ZeroMQ client."""
from __future__ import annotations

import hashlib


def tenant_of(api_key: str | None, peer: str | None) -> str:
    """'key:<blake2b-128 of the key>' for a request with an API key, 'peer:<address>' without one."""
    if api_key:
        return "key:" + hashlib.blake2b(api_key.encode(), digest_size=16).hexdigest()
    return "peer:" + (peer or "unknown")[:100]
