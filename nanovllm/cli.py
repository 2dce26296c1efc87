"""`nanovllm` command line: `generate` runs the engine in-process, `serve` runs the service,
`health` probes a running one, `reset-prefix-cache` makes its engine forget the cached KV blocks no
request holds, `keygen` writes CURVE key pairs for tcp, `install-systemd` installs the units that
run it under systemd."""
from __future__ import annotations

import argparse
import sys


def _generate(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="nanovllm generate", description="Generate in-process (no service).")
    ap.add_argument("prompt", nargs="+", help="one or more prompts")
    ap.add_argument("--model", default="default", help="'default', an HF folder or a .gguf file")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    args = ap.parse_args(argv)

    from nanovllm import LLM, SamplingParams

    llm = LLM(args.model)
    prompts = args.prompt
    if not args.raw and getattr(llm.tokenizer, "chat_template", None):
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                     tokenize=False) for p in prompts]
    outs = llm.generate(prompts, SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens),
                        use_tqdm=False)
    for prompt, out in zip(args.prompt, outs):
        print(f"> {prompt}\n{out['text']}\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"generate": _generate, "serve": _serve, "health": _health, "reset-prefix-cache": _reset_prefix_cache,
                "keygen": _keygen, "install-systemd": _install_systemd}
    if not argv or argv[0] not in commands:
        print(f"usage: nanovllm {{{','.join(commands)}}} ...  (nanovllm COMMAND --help for details)", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return commands[argv[0]](argv[1:])


def _health(argv: list[str]) -> int:
    from nanovllm_client.health import health_main
    return health_main(argv)


def _reset_prefix_cache(argv: list[str]) -> int:
    from nanovllm_client import Client, NanovllmError, default_url

    ap = argparse.ArgumentParser(prog="nanovllm reset-prefix-cache", description=(
        "Make a running service's engine forget every cached KV block no running request holds (the "
        "prefix cache starts empty again; requests in flight are untouched). Refused while it drains."))
    ap.add_argument("--url", default=default_url(), help="service address (default: $NANOVLLM_URL or %(default)s)")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the answer")
    args = ap.parse_args(argv)
    try:
        with Client(args.url, connect_timeout=args.timeout) as client:
            freed = client.reset_prefix_cache(timeout=args.timeout)
    except NanovllmError as e:
        print(f"nanovllm reset-prefix-cache: {e}", file=sys.stderr)
        return 1
    print(f"freed {freed} cached KV block(s)")
    return 0


def _keygen(argv: list[str]) -> int:
    from nanovllm.service.security import keygen_main
    return keygen_main(argv)


def _serve(argv: list[str]) -> int:
    from nanovllm.supervisor import main as serve_main
    return serve_main(argv)


def _install_systemd(argv: list[str]) -> int:
    from nanovllm.install_systemd import main as install_main
    return install_main(argv)


if __name__ == "__main__":
    sys.exit(main())
