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
import re
import sys

from ..endpoints import default_url
from ..sdnotify import sd_notify
from ..security import (CLIENT_KEY_ENV, SERVER_KEY_ENV, SERVICE_KEY_ENV, add_client_key_flags,
                        client_keys_from_env, service_pair_env)


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


async def _notify(server) -> None:
    """READY=1 once the port listens; then WATCHDOG=1 from the event loop that serves (a hung loop goes silent)."""
    while not server.started:
        await asyncio.sleep(0.05)
    sd_notify("READY=1")
    usec = int(os.environ.get("WATCHDOG_USEC", "0") or 0)
    while usec > 0:
        sd_notify("WATCHDOG=1")
        await asyncio.sleep(usec / 3e6)


ENV_PREFIX = "NANOVLLM_HTTP_"
"""Every --flag of the front has a default in $NANOVLLM_HTTP_FLAG (its unit's env file sets them);
--url reads $NANOVLLM_URL as every client does, --model falls back to $NANOVLLM_MODEL."""


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.removeprefix("--").upper().replace("-", "_")


def _flag(ap: argparse.ArgumentParser, flag: str, default, help: str, **kw) -> None:
    # A string default is parsed by `type` as the command line would be: a bad value in the
    # environment is the same clear error as a bad flag.
    ap.add_argument(flag, default=os.environ.get(env_name(flag)) or default,
                    help=f"{help} (env {env_name(flag)})", **kw)


_ORIGIN = r"https?://([A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(:[0-9]{1,5})?"


def origins(text: str) -> tuple[str, ...]:
    """--allowed-origins: '*', or origins as a browser sends them (scheme://host[:port], no path)."""
    out = tuple(o.strip().rstrip("/") for o in text.split(",") if o.strip())
    for o in out:
        if o != "*" and not re.fullmatch(_ORIGIN, o):
            raise argparse.ArgumentTypeError(f"{o!r} is not an origin (scheme://host[:port]) or '*'")
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="nanovllm-http", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=default_url(),
                    help="the service's address (default %(default)s; env NANOVLLM_URL)")
    _flag(ap, "--host", "127.0.0.1", "address to bind (default %(default)s); a non-loopback address requires "
                                     "--api-key-file")
    _flag(ap, "--port", 8000, "port to bind (default %(default)s)", type=int)
    _flag(ap, "--model", os.environ.get("NANOVLLM_MODEL") or "default",
          "the model name clients send (default %(default)s, from NANOVLLM_MODEL when set)")
    _flag(ap, "--api-key-file", None, "file of API keys, one per line (Authorization: Bearer KEY)")
    _flag(ap, "--max-body-bytes", 4 << 20, "larger bodies get 413 (default %(default)s)", type=int)
    _flag(ap, "--max-streams", 256, "requests in flight at most; more get 429 (default %(default)s)", type=int)
    _flag(ap, "--max-connections", 1024, "open connections at most; more get 503 (default %(default)s)", type=int)
    _flag(ap, "--idle-timeout", 5.0, "seconds an idle keep-alive connection is kept (default %(default)s)",
          type=float)
    _flag(ap, "--drain-timeout", 30.0, "seconds SIGTERM waits for requests in flight (default %(default)s)",
          type=float)
    _flag(ap, "--request-timeout", 600.0, "seconds before a request is aborted (default %(default)s)", type=float)
    _flag(ap, "--allowed-origins", "", "comma-separated origins (https://app.example) whose browser pages may call "
                                       "the API (CORS); '*' for any; none by default", type=origins)
    add_client_key_flags(ap)
    return ap


def curve_key_files(args: argparse.Namespace, environ) -> dict[str, str]:
    """The front's CURVE key files: its own (--curve-client-key, --curve-server-key or their
    variables) where given; else, beside a service that names its secret key in the environment
    (the instance's env file its systemd unit reads, as the stages' units do), the service's own
    pair, as `nanovllm serve` gives its front: the same variable meaning the same thing to both."""
    if not (args.curve_client_key or args.curve_server_key) and environ.get(SERVICE_KEY_ENV):
        return service_pair_env(environ[SERVICE_KEY_ENV])
    return {CLIENT_KEY_ENV: args.curve_client_key or "", SERVER_KEY_ENV: args.curve_server_key or ""}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        from .app import Settings, build_app
        from .server import build_server
    except ImportError as e:
        print(f"nanovllm-http: {e}; install the http extra: pip install 'nanovllm-client[http]'", file=sys.stderr)
        return 2
    from ..async_client import AsyncClient
    from ..health import check_health
    try:
        keys = read_keys(args.api_key_file) if args.api_key_file else ()
        curve = client_keys_from_env(curve_key_files(args, os.environ))
    except (OSError, ValueError) as e:
        print(f"nanovllm-http: {e}", file=sys.stderr)
        return 2
    if not keys and not _loopback(args.host):
        print(f"nanovllm-http: binding {args.host} (not loopback) requires --api-key-file", file=sys.stderr)
        return 2

    async def serve() -> None:
        client = AsyncClient(args.url, timeout=args.request_timeout, curve=curve, insecure_tcp=args.insecure_tcp)
        await client.start()
        # With a key pair of its own the front is one more client: the service does not take its word for whom
        # a request is for (it does with the service's own pair, or without CURVE).
        own_key = curve is not None and curve[0].public != curve[1]
        settings = Settings(model=args.model, api_keys=keys, max_body_bytes=args.max_body_bytes,
                            max_streams=args.max_streams, allowed_origins=args.allowed_origins, tenants=not own_key,
                            health=lambda: check_health(args.url, 5.0, curve))
        server = build_server(build_app(client, settings), host=args.host, port=args.port,
                              max_connections=args.max_connections, idle_timeout=args.idle_timeout,
                              drain_timeout=args.drain_timeout)
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
