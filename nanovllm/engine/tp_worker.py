"""One tensor-parallel worker rank, as `engine/tp_workers.py` starts it: a fresh interpreter that
builds its `ModelRunner` shard and runs every step rank 0 broadcasts, until told to exit or until
rank 0 is gone. Apart from the parent side so that the runner, which starts the workers, and the
worker, which builds a runner, do not import each other.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import time

from nanovllm.config import Config
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.models.loader import read_hf_config
from nanovllm.models.model_config import ModelConfig


def _exit_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)  # rank 0 is gone: nothing will ever be sent again


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="one tensor-parallel worker rank (started by nanovllm itself)")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--config", required=True, help="the engine's Config as JSON")
    ap.add_argument("--parent-pid", type=int, required=True)
    ap.add_argument("--ready-fd", type=int, required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"tp-rank-{args.rank} %(levelname)s %(name)s: %(message)s")
    threading.Thread(target=_exit_when_orphaned, args=(args.parent_pid,), daemon=True).start()

    config = Config(**json.loads(args.config))
    model_config = ModelConfig.from_hf_dict(read_hf_config(args.model_path))
    os.write(args.ready_fd, b"r")
    os.close(args.ready_fd)
    runner = ModelRunner(config, model_config, args.model_path, rank=args.rank)
    try:
        runner.serve_steps()
    finally:
        runner.close()
