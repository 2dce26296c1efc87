"""`python -m engine_proc`: run the model (scheduler, paged KV cache) on tokenized requests and
push one batched output message per step to the detokenizer. Every engine `Config` field is a
flag (and a NANOVLLM_* variable)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import zmq

from nanovllm.service.stage import add_flag, build_stage, stage_setup

_SKIP_FIELDS = {"model"}


def _flag_type(annotation: str):
    for name, kind in (("bool", bool), ("float", float), ("int", int)):
        if name in str(annotation):
            return kind
    return str


def add_config_flags(parser: argparse.ArgumentParser, config_cls) -> list[str]:
    names = []
    for f in dataclasses.fields(config_cls):
        if f.name in _SKIP_FIELDS:
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        doc = "engine Config." + f.name
        add_flag(parser, "--" + f.name.replace("_", "-"), doc, default=default, type=_flag_type(f.type))
        names.append(f.name)
    return names


DEFAULT_MAX_QUEUED_PER_CLIENT = 1024
"""A quarter of --max-queued's default: four clients flooding at once still leave the engine reading."""


def live_per_client(flag: int | None, max_num_seqs: int) -> int:
    """--max-live-per-client as given, or by default half the batch: one client that floods
    leaves room for another's request at the next step."""
    return max(1, max_num_seqs // 2) if flag is None else flag


def main(argv: list[str] | None = None) -> int:
    from nanovllm.config import Config

    parser = argparse.ArgumentParser(prog="python -m engine_proc", description=__doc__)
    add_flag(parser, "--model", "'default', an HF folder or a .gguf file", default="default")
    add_flag(parser, "--heartbeat-s", "seconds between engine heartbeats to the detokenizer", default=0.25, type=float)
    add_flag(parser, "--stream-interval", "output tokens per streamed delta after a request's first: more costs "
             "the detokenizer and the clients fewer wake-ups (CPU the model step keeps where they share its cores), "
             "at the price of burstier streams; tokens are never held longer than --heartbeat-s", default=1, type=int)
    add_flag(parser, "--max-live", "most requests held by the engine (running or waiting) at once",
             default=4096, type=int)
    add_flag(parser, "--max-queued", "most requests received but not yet admitted (beyond --max-live) before "
             "the engine stops reading its input", default=4096, type=int)
    add_flag(parser, "--max-live-per-client", "most requests of one client held by the engine at once; its others "
             "wait while other clients' requests are admitted past them (default: half of --max-num-seqs, so a "
             "newcomer finds a free row in the batch; 0: no per-client limit)", type=int)
    add_flag(parser, "--max-queued-per-client", "most requests of one client waiting for admission; more are refused "
             "with an error naming this limit, so one client cannot fill the backlog every client shares "
             "(0: no per-client limit)", default=DEFAULT_MAX_QUEUED_PER_CLIENT, type=int)
    add_flag(parser, "--max-live-mib", "most MiB of requests held by the engine at once: each is charged its frame "
             "plus 40 bytes a prompt token", default=2048, type=int)
    add_flag(parser, "--max-queued-mib", "most MiB of requests received but not yet admitted before the engine stops "
             "reading its input", default=512, type=int)
    add_flag(parser, "--drain-timeout", "seconds a stopping engine lets requests in flight finish before it aborts "
             "them", default=30.0, type=float)
    add_flag(parser, "--scheduler-policy", "admission/preemption order: fair (clients take turns; arrival order "
             "within a client), fcfs, priority, or package.module:Class (a nanovllm.engine.policy.SchedulerPolicy)",
             default="fair")
    parser.add_argument("--post-step-hook", action="append", metavar="package.module:function",
                        default=[h for h in os.environ.get("NANOVLLM_POST_STEP_HOOK", "").split(",") if h],
                        help="call this with every step's StepMetrics (repeatable; env NANOVLLM_POST_STEP_HOOK, "
                             "comma-separated)")
    config_names = add_config_flags(parser, Config)
    args, log, endpoints, stop = stage_setup(parser, argv, "engine")

    from nanovllm.engine.llm_engine import LLMEngine
    from nanovllm.engine.policy import make_policy
    from nanovllm.metrics import EngineMetrics
    from nanovllm.plugins import load_hook

    from .server import EngineStage

    overrides = {n: getattr(args, n) for n in config_names if getattr(args, n) is not None}
    config = None

    def make(ctx: zmq.Context, security, metrics) -> EngineStage:
        nonlocal config
        config = Config(model=args.model, **overrides)
        return EngineStage(None, endpoints.engine, endpoints.detok, endpoints.control,
                           heartbeat_s=args.heartbeat_s, stream_interval=args.stream_interval,
                           max_live=args.max_live, max_queued=args.max_queued, max_live_bytes=args.max_live_mib << 20,
                           max_queued_bytes=args.max_queued_mib << 20, drain_timeout_s=args.drain_timeout,
                           max_live_per_client=live_per_client(args.max_live_per_client, config.max_num_seqs),
                           max_queued_per_client=args.max_queued_per_client,
                           ctx=ctx, security=security, metrics=metrics)
    stage = build_stage(log, "engine", args, EngineMetrics, make)

    def load_engine() -> LLMEngine:
        # Extension points first: a name that does not resolve fails before the model loads.
        policy = make_policy(args.scheduler_policy)
        hooks = [load_hook(spec) for spec in args.post_step_hook]
        engine = LLMEngine(config, scheduler_policy=policy)
        for hook in hooks:
            engine.add_post_step_hook(hook)
        runner = engine.runner
        log.info("model %s loaded; KV cache %d blocks of %d tokens (%.0f MiB), %d kept free at admission; "
                 "input at %s, control at %s; outputs to %s", args.model, runner.num_blocks, config.block_size,
                 runner.num_blocks * runner.bytes_per_block / (1 << 20), engine.scheduler.watermark_blocks,
                 endpoints.engine, endpoints.control, endpoints.detok)
        return engine

    return stage.run(stop, load_engine)


if __name__ == "__main__":
    sys.exit(main())
