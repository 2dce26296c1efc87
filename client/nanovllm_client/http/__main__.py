"""`nanovllm-http`: an OpenAI-compatible HTTP front for a running nanovllm service.

Serves /v1/models, /v1/completions, /v1/chat/completions (streaming and not), /health and
/metrics, as a client of the service at --url (it may run on another host). SIGTERM drains:
no new connections, requests in flight finish (up to --drain-timeout), then it exits.
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import os
import socket
import sys

from ..endpoints import default_url
from ..security import CLIENT_KEY_ENV, SERVER_KEY_ENV, add_client_key_flags, client_keys_from_env


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_keys(path: str) -> tuple[str, ...]:
    """One key per line; blank lines and lines starting with # are skipped."""
    with open(path, encoding="utf-8") as f:
        keys = tuple(line.strip() for line in f if line.strip() and not line.lstrip().startswith("#"))
    if not keys:
        raise ValueError(f"{path} holds no key")
    return keys


def _sd_notify(message: str) -> None:
    """systemd's (or `nanovllm serve`'s) $NOTIFY_SOCKET; nothing without one. Never waits (the
    event loop sends it): a manager that is not reading costs this line. The stages' twin is
    nanovllm.service.notify.sd_notify, which this package may not import."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return
    if path.startswith("@"):
        path = "\0" + path[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        try:
            s.sendto(message.encode(), socket.MSG_DONTWAIT, path)
        except OSError:
            pass


async def _notify(server) -> None:
    """READY=1 once the port listens; then WATCHDOG=1 from the event loop that serves (a hung loop goes silent)."""
    while not server.started:
        await asyncio.sleep(0.05)
    _sd_notify("READY=1")
    usec = int(os.environ.get("WATCHDOG_USEC", "0") or 0)
    while usec > 0:
        _sd_notify("WATCHDOG=1")
        await asyncio.sleep(usec / 3e6)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="nanovllm-http", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=default_url(), help="the service's address (default %(default)s)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s); a non-loopback "
                                                        "address requires --api-key-file")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--model", default="default", help="the model name clients send (default %(default)s)")
    ap.add_argument("--api-key-file", help="file of API keys, one per line (Authorization: Bearer KEY)")
    ap.add_argument("--max-body-bytes", type=int, default=4 << 20, help="larger bodies get 413 (default %(default)s)")
    ap.add_argument("--max-streams", type=int, default=256,
                    help="requests in flight at most; more get 429 (default %(default)s)")
    ap.add_argument("--max-connections", type=int, default=1024,
                    help="open connections at most; more get 503 (default %(default)s)")
    ap.add_argument("--idle-timeout", type=float, default=5.0,
                    help="seconds an idle keep-alive connection is kept (default %(default)s)")
    ap.add_argument("--drain-timeout", type=float, default=30.0,
                    help="seconds SIGTERM waits for requests in flight (default %(default)s)")
    ap.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request is aborted")
    add_client_key_flags(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        import uvicorn
        from .app import Settings, build_app
    except ImportError as e:
        print(f"nanovllm-http: {e}; install the http extra: pip install 'nanovllm-client[http]'", file=sys.stderr)
        return 2
    from ..async_client import AsyncClient
    from ..health import check_health
    try:
        keys = read_keys(args.api_key_file) if args.api_key_file else ()
        curve = client_keys_from_env({CLIENT_KEY_ENV: args.curve_client_key or "",
                                      SERVER_KEY_ENV: args.curve_server_key or ""})
    except (OSError, ValueError) as e:
        print(f"nanovllm-http: {e}", file=sys.stderr)
        return 2
    if not keys and not _loopback(args.host):
        print(f"nanovllm-http: binding {args.host} (not loopback) requires --api-key-file", file=sys.stderr)
        return 2

    async def serve() -> None:
        client = AsyncClient(args.url, timeout=args.request_timeout, curve=curve, insecure_tcp=args.insecure_tcp)
        await client.start()
        settings = Settings(model=args.model, api_keys=keys, max_body_bytes=args.max_body_bytes,
                            max_streams=args.max_streams,
                            health=lambda: check_health(args.url, 5.0, curve))
        config = uvicorn.Config(build_app(client, settings), host=args.host, port=args.port,
                                limit_concurrency=args.max_connections, timeout_keep_alive=args.idle_timeout,
                                timeout_graceful_shutdown=args.drain_timeout, log_level="warning",
                                access_log=False, lifespan="off")
        server = uvicorn.Server(config)
        notifier = asyncio.get_running_loop().create_task(_notify(server))
        try:
            await server.serve()  # SIGTERM/SIGINT: stop accepting, finish what is in flight
        finally:
            notifier.cancel()
            await client.close()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
