"""`nanovllm health`: exit 0 only when all three stages answer and the engine is ready; a loading
engine is told apart from a dead one."""
from __future__ import annotations

import os
import subprocess
import sys

from nanovllm_client.health import check_health
from tests.service.conftest import TINY_ENGINE_ARGS
from tests.service.harness import REPO, ServiceProcs, short_tmpdir, wait_for

SLOW_IMPORT = '''import os
import time

# An extension module that takes a while to import: the engine is "loading" until the test
# creates the file named below (or two minutes pass).
deadline = time.monotonic() + 120
while not os.path.exists(os.path.join(os.path.dirname(__file__), "go")) and time.monotonic() < deadline:
    time.sleep(0.05)


def hook(metrics):
    pass
'''


def health_cli(url: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanovllm.cli", "health", "--url", url, "--timeout", "5"], cwd=REPO,
                          capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=REPO))


def test_health_tells_loading_from_ready_from_dead(tiny_model_dir, tmp_path):
    (tmp_path / "slow_import.py").write_text(SLOW_IMPORT)
    procs = ServiceProcs(tiny_model_dir, f"ipc://{short_tmpdir()}/svc",
                         engine_args=TINY_ENGINE_ARGS + ["--post-step-hook", "slow_import:hook"],
                         stage_env={"engine_proc": {"PYTHONPATH": os.pathsep.join(
                             [str(tmp_path), REPO, os.path.join(REPO, "client")])}}).start()
    try:
        # Under load one stage's answer may miss a one-second check: wait for a check that saw all three.
        loading = wait_for(lambda: (r := check_health(procs.url, timeout=1)).stages["engine"].state == "loading"
                           and r.stages["tokenizer"].state == r.stages["detokenizer"].state == "ready" and r,
                           timeout=60, what="the engine to report loading, the other two stages ready")
        assert not loading.healthy
        out = health_cli(procs.url)
        assert out.returncode == 1 and "engine       loading" in out.stdout and "NOT healthy" in out.stdout
        (tmp_path / "go").touch()

        ready = wait_for(lambda: (r := check_health(procs.url, timeout=1)).healthy and r, timeout=60,
                         what="the service to be healthy")
        assert ready.stages["engine"].instance_id and ready.stages["engine"].uptime_s > 0
        out = health_cli(procs.url)
        assert out.returncode == 0, out.stdout
        for role in ("tokenizer", "detokenizer", "engine"):
            assert f"{role:<12} ready" in out.stdout
        assert "live request(s)" in out.stdout and "KV cache" in out.stdout

        procs.kill("engine_proc")
        dead = wait_for(lambda: (r := check_health(procs.url, timeout=1)).stages["engine"].state == "dead" and r,
                        timeout=30, what="the engine to be reported dead")
        assert not dead.healthy
        assert health_cli(procs.url).returncode == 1
    finally:
        procs.stop()


def test_health_with_nothing_there_fails_quickly():
    out = health_cli(f"ipc://{short_tmpdir()}/nothing")
    assert out.returncode == 1 and out.stdout.count("no answer") == 3
