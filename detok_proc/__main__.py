"""`python -m detok_proc`: turn engine steps into streamed text deltas for each client, apply stop
strings, and detect vanished clients and a dead engine."""
from __future__ import annotations

import argparse
import sys

import zmq

from nanovllm.service.stage import add_flag, build_stage, stage_setup


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m detok_proc", description=__doc__)
    add_flag(parser, "--model", "model whose tokenizer to use: 'default', an HF folder or a .gguf file", default="default")
    add_flag(parser, "--client-timeout-s", "abort the requests of a client silent this long", default=5.0, type=float)
    add_flag(parser, "--engine-timeout-s", "declare the engine dead after this long without a heartbeat",
             default=3.0, type=float)
    add_flag(parser, "--max-pending-frames", "frames held for a client that is not reading before its requests "
             "are aborted", default=1000, type=int)
    add_flag(parser, "--max-pending-mib", "output held for all clients that are not reading, together; over it the "
             "client holding the most has its requests aborted", default=256, type=int)
    args, log, endpoints, stop = stage_setup(parser, argv, "detok")

    from nanovllm.metrics import DetokMetrics
    from nanovllm.models.tokenizer import load_tokenizer

    from .server import DetokStage

    def make(ctx: zmq.Context, security, metrics) -> DetokStage:
        return DetokStage(load_tokenizer(args.model), endpoints.stream, endpoints.detok, endpoints.control,
                          client_timeout_s=args.client_timeout_s, engine_timeout_s=args.engine_timeout_s,
                          max_pending_frames=args.max_pending_frames, max_pending_bytes=args.max_pending_mib << 20,
                          ctx=ctx, security=security, metrics=metrics)
    log.info("starting: model %s; clients at %s; engine outputs at %s", args.model, endpoints.stream, endpoints.detok)
    build_stage(log, "detokenizer", args, DetokMetrics, make).run(stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
