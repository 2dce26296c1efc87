"""`python -m tokenizer_proc`: validate, chat-template and tokenize client requests for the engine."""
from __future__ import annotations

import argparse
import sys

import zmq

from nanovllm.service.stage import add_flag, build_stage, stage_setup

from .server import DEFAULT_MAX_PENDING_PER_CLIENT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenizer_proc", description=__doc__)
    add_flag(parser, "--model", "model whose tokenizer to use: 'default', an HF folder or a .gguf file", default="default")
    add_flag(parser, "--cache-salt-per-client", "salt every request's prefix cache by its client (its CURVE key, "
             "else its routing id), so no client's cached_tokens reveal another's prompts; a prompt shared by "
             "several clients is then computed once per client", default=False, type=bool)
    add_flag(parser, "--max-pending-per-client", "most requests of one client the tokenizer holds while the engine "
             "takes none; more are refused as overloaded (0: only the stage's own bounds)",
             default=DEFAULT_MAX_PENDING_PER_CLIENT, type=int)
    add_flag(parser, "--max-priority", "the highest priority a request may ask for (the priority scheduling policy "
             "admits higher first); higher is refused with an error naming this ceiling (default: any)", type=int)
    add_flag(parser, "--max-request-rate-per-client", "requests a second one client may send on average, in bursts "
             "of a second's worth (at least one); faster ones are refused naming this limit (0: no limit)",
             default=0.0, type=float)
    add_flag(parser, "--max-model-len", "prompt plus output limit, as the engine's --max-model-len (default: the "
             "model's context length capped at 4096, the engine's default); `nanovllm serve` passes the engine's on",
             type=int)
    args, log, endpoints, stop = stage_setup(parser, argv, "tokenizer")

    from nanovllm.metrics import TokenizerMetrics
    from nanovllm.models.model_files import max_model_len
    from nanovllm.models.tokenizer import load_tokenizer

    from .server import TokenizerStage

    def make(ctx: zmq.Context, security, metrics) -> TokenizerStage:
        return TokenizerStage(load_tokenizer(args.model), frontend=endpoints.tokenizer, engine=endpoints.engine,
                              control=endpoints.control, ctx=ctx, max_prompt_tokens=max_model_len(args.model, args.max_model_len), security=security,
                              metrics=metrics, cache_salt_per_client=args.cache_salt_per_client,
                              max_pending_per_client=args.max_pending_per_client, max_priority=args.max_priority,
                              max_request_rate_per_client=args.max_request_rate_per_client)
    log.info("starting: model %s; clients at %s; engine at %s", args.model, endpoints.tokenizer, endpoints.engine)
    build_stage(log, "tokenizer", args, TokenizerMetrics, make).run(stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
