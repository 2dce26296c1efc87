"""Tensor-parallel worker processes: started by rank 0's ModelRunner, tied to its lifetime.

Rank 0 starts ranks 1..N-1 as fresh interpreters running `tp_worker.main()` (unlike multiprocessing's
spawn, the engine's `__main__` is never re-imported, and nothing is pickled: the config travels
as JSON on the command line). Each worker builds its own ModelRunner shard, joins the rendezvous at
`Config.dist_init_method`, then runs every step rank 0 broadcasts until told to stop.

No orphans: a worker exits when rank 0 says so (`WorkerProcesses.close`, also run by a
`weakref.finalize` at interpreter exit), and a watchdog thread in each worker exits it as soon
as its parent process is gone, even if the parent was killed and could not say goodbye.
"""
from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import time
from dataclasses import asdict

from nanovllm.config import Config

logger = logging.getLogger(__name__)
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class WorkerProcesses:
    def __init__(self, procs: dict[int, subprocess.Popen], ready_fds: dict[int, int]):
        self.procs = procs
        self._ready_fds = ready_fds

    @classmethod
    def start(cls, config: Config, model_path: str) -> "WorkerProcesses":
        env = dict(os.environ)
        # The worker must import this very nanovllm, installed or not.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        procs, ready_fds = {}, {}
        for rank in range(1, config.tensor_parallel_size):
            read_fd, write_fd = os.pipe()
            cmd = [sys.executable, "-c", "from nanovllm.engine.tp_worker import main; main()", "--rank", str(rank),
                   "--model-path", model_path, "--config", json.dumps(asdict(config)),
                   "--parent-pid", str(os.getpid()), "--ready-fd", str(write_fd)]
            procs[rank] = subprocess.Popen(cmd, env=env, pass_fds=(write_fd,))
            os.close(write_fd)
            ready_fds[rank] = read_fd
        return cls(procs, ready_fds)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Block until every worker is about to join the rendezvous; RuntimeError if one dies first.

        Without this, a worker that fails to start (an import error, say) would leave rank 0
        waiting in the rendezvous for its whole timeout.
        """
        deadline = time.monotonic() + timeout_s
        pending = {fd: rank for rank, fd in self._ready_fds.items()}
        try:
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"tensor-parallel workers {sorted(pending.values())} did not start in {timeout_s:.0f} s")
                readable, _, _ = select.select(list(pending), [], [], min(left, 1.0))
                for fd in readable:
                    rank = pending.pop(fd)
                    if not os.read(fd, 1):  # EOF before the ready byte: the worker died
                        code = self.procs[rank].wait()
                        raise RuntimeError(f"tensor-parallel worker rank {rank} exited with code {code} while starting; "
                                           "its error is above in stderr")
        finally:
            for fd in self._ready_fds.values():
                os.close(fd)
            self._ready_fds = {}

    def close(self, timeout_s: float = 10.0) -> None:
        """Wait for the workers to exit (after rank 0 told them to), then terminate any left."""
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for fd in self._ready_fds.values():
            os.close(fd)
        self._ready_fds = {}
