"""The uvicorn server the front runs its app in: the open-connection limit answered in OpenAI's
error shape, and a clean exit (status 0) after a SIGTERM drain."""
from __future__ import annotations

from typing import Any, Callable

import uvicorn
from starlette.responses import JSONResponse

from .errors import ApiError


class ConnectionLimit:
    """ASGI wrapper: a request that arrives while more than `limit` connections are open gets a
    503 in OpenAI's shape and its connection closed. uvicorn's own limit (limit_concurrency)
    answers in plain text, which the SDKs cannot read as an error body."""

    def __init__(self, app: Any, open_connections: Callable[[], int], limit: int):
        self.app, self.open_connections, self.limit = app, open_connections, limit

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and self.open_connections() > self.limit:
            error = ApiError(503, f"too many open connections (at most {self.limit}); retry later",
                             code="too_many_connections")
            response = JSONResponse(error.body(), status_code=503, headers={"Connection": "close",
                                                                            "Retry-After": "1"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class Server(uvicorn.Server):
    """uvicorn raises the signal that stopped it again once it has drained, so the process would
    die of SIGTERM; after a drain the front exits 0, as the stages do (systemd, the supervisor and
    a shell read a clean stop alike)."""

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        getattr(self, "_captured_signals", []).clear()


def build_server(app: Any, *, host: str, port: int, max_connections: int, idle_timeout: float,
                 drain_timeout: float) -> Server:
    """The server for `app`, its open connections counted from uvicorn's own bookkeeping."""
    server: Server | None = None

    def open_connections() -> int:
        return len(server.server_state.connections) if server is not None else 0

    config = uvicorn.Config(ConnectionLimit(app, open_connections, max_connections), host=host, port=port,
                            timeout_keep_alive=idle_timeout, timeout_graceful_shutdown=drain_timeout,
                            log_level="warning", access_log=False, lifespan="off")
    server = Server(config)
    return server
