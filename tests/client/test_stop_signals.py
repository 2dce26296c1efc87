"""`stop_event`, how every stage and `nanovllm serve` learn of SIGTERM / SIGINT."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

CHILD = textwrap.dedent("""
    import os, sys, time
    from nanovllm_client.stage import setup_logging, stop_event
    setup_logging("INFO", "child")
    stop = stop_event()
    print("ready", flush=True)
    # One long native call that releases the GIL and retries its wait on EINTR itself (glibc's
    # system() does): the main thread runs no bytecode, so the Python handler cannot run.
    os.system("sleep 3")
    print("set-during-call" if stop.is_set() else "not-set-during-call", flush=True)
    print("set" if stop.wait(5) else "never-set", flush=True)
""")


def test_a_stop_signal_is_seen_while_the_main_thread_is_in_native_code():
    """A stage's main thread acts on SIGTERM only between bytecodes, in Python's handler; a
    step in native code delays it, and the service's ordered stop waited on it. The event is now
    set by a thread the signal wakes at once, with a log line saying which signal came."""
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # the child is in os.system now
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert out.split() == ["set-during-call", "set"], err
    assert "SIGTERM received: stopping" in err
    assert child.returncode == 0, err
