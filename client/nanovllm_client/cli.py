"""`nanovllm-client "prompt"`: stream one answer from a running service to the terminal."""
from __future__ import annotations

import argparse
import sys

from .endpoints import default_url
from .errors import NanovllmError
from .security import CLIENT_KEY_ENV, SERVER_KEY_ENV, add_client_key_flags, client_keys_from_env
from .sync_client import Client


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nanovllm-client", description=__doc__)
    parser.add_argument("prompt", help="the user message (sent through the model's chat template)")
    parser.add_argument("--url", default=default_url(),
                        help="service address, ipc://DIR or tcp://HOST:PORT (default: $NANOVLLM_URL or %(default)s)")
    parser.add_argument("--system", help="an optional system message")
    parser.add_argument("--raw", action="store_true", help="send the prompt as plain text, no chat template")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before the request is aborted")
    parser.add_argument("--connect-timeout", type=float, default=60.0,
                        help="seconds to wait for the service and its engine to be up (default %(default)s)")
    parser.add_argument("--usage", action="store_true", help="print token usage to stderr at the end")
    add_client_key_flags(parser)
    args = parser.parse_args(argv)

    if args.raw:
        prompt = args.prompt
    else:
        prompt = ([{"role": "system", "content": args.system}] if args.system else [])
        prompt.append({"role": "user", "content": args.prompt})
    try:
        curve = client_keys_from_env({CLIENT_KEY_ENV: args.curve_client_key or "", SERVER_KEY_ENV: args.curve_server_key or ""})
    except ValueError as e:  # one key without the other, or an unreadable key file
        print(f"nanovllm-client: {e}", file=sys.stderr)
        return 2
    try:
        with Client(args.url, timeout=args.timeout, connect_timeout=args.connect_timeout, curve=curve,
                    insecure_tcp=args.insecure_tcp) as client:
            client.wait_engine(timeout=args.connect_timeout)  # a service just started may still be loading
            last = None
            for delta in client.stream(prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                                       stop=args.stop):
                sys.stdout.write(delta.text)
                sys.stdout.flush()
                last = delta
            sys.stdout.write("\n")
            if args.usage and last is not None:
                print(f"[{last.finish_reason}] {last.usage}", file=sys.stderr)
    except NanovllmError as e:
        print(f"nanovllm-client: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
