"""HTTP streams under faults: `nanovllm serve --http-port`, streamed chat and completions (greedy
and sampled) in flight while one process is SIGKILLed (the engine, the detokenizer, the tokenizer,
the HTTP front itself). Every stream ends (with `[DONE]`, an error event then `[DONE]`, or, when
the front itself dies, a broken connection), none hangs, nothing stays live in the engine, greedy
streams continued across an engine restart equal a fault-free run's, and the restarted front
serves. What an HTTP client sees in each case: docs/service.md, "Through the HTTP front"."""
from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import pytest

pytest.importorskip("uvicorn")

from tests.service.conftest import EXACT_ARGS, TINY_ENGINE_ARGS  # noqa: E402
from tests.service.harness import engine_idle, wait_for  # noqa: E402
from tests.service.test_fair_share import SLOW  # noqa: E402
from tests.service.test_http_serve import _get, serve_with_front  # noqa: E402
from tests.service.test_supervisor import read_pids  # noqa: E402

MAX_TOKENS = 150
"""At >= 10 ms a step a stream lasts over 1.5 s: the kill lands while every stream runs."""
KINDS = [("chat", 0.0), ("chat", 0.8), ("completions", 0.0), ("completions", 0.8)]
"""Each kind twice per fault: chat and completions, greedy and sampled (seeded)."""


@dataclass
class Outcome:
    """What one streamed HTTP request came to."""
    text: str = ""
    events: int = 0
    done: bool = False
    """`data: [DONE]` came."""
    error: str | None = None
    """The error event's message, if one came."""
    broken: str | None = None
    """The connection broke before `[DONE]` (the exception's name)."""
    first: threading.Event = field(default_factory=threading.Event)


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    with serve_with_front(tiny_model_dir, [*TINY_ENGINE_ARGS, *EXACT_ARGS, *SLOW]) as (_, runtime_dir, port, client):
        yield runtime_dir, port, client, tiny_model_dir


def _stream(port: int, model: str, kind: str, temperature: float, i: int, out: Outcome) -> None:
    """POST one streamed request and read its SSE events into `out` until `[DONE]` or a break."""
    prompt = f"def f{i % 2}():"
    body = {"model": model, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "temperature": temperature, "seed": 7 + i}
    body.update({"messages": [{"role": "user", "content": prompt}]} if kind == "chat" else {"prompt": prompt})
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("POST", f"/v1/{'chat/completions' if kind == 'chat' else 'completions'}", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            out.error = f"HTTP {response.status}: {response.read()[:200]!r}"
            return
        while True:
            line = response.readline()
            if not line:
                out.broken = "closed before [DONE]"
                return
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                out.done = True
                return
            event = json.loads(data)
            if "error" in event:
                out.error = event["error"]["message"]
                continue
            out.events += 1
            choice = event["choices"][0] if event["choices"] else {}
            out.text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            if out.text:
                out.first.set()
    except (OSError, http.client.HTTPException) as e:
        out.broken = type(e).__name__
    finally:
        out.first.set()


def _run(port: int, model: str, kill=None) -> list[Outcome]:
    """Every kind twice at once; `kill()` once every stream has text, and then one more request
    (as request 2: a greedy completion), sent while the killed process is down. Returns when all
    have ended; a stream still open 120 s after is a hang."""
    outcomes = [Outcome() for _ in range(2 * len(KINDS))]
    threads = [threading.Thread(target=_stream, args=(port, model, *KINDS[i % len(KINDS)], i, outcomes[i]))
               for i in range(len(outcomes))]
    for t in threads:
        t.start()
    if kill is not None:
        for o in outcomes:
            assert o.first.wait(120), "a stream got no text"
        kill()
        outcomes.append(Outcome())
        threads.append(threading.Thread(target=_stream, args=(port, model, *KINDS[2], 2, outcomes[-1])))
        threads[-1].start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "an HTTP stream hangs"
    return outcomes


def _kill(runtime_dir: str, stage: str) -> int:
    pid = read_pids(runtime_dir)[stage]
    os.kill(pid, signal.SIGKILL)
    return pid


def _restarted(runtime_dir: str, stage: str, old: int) -> None:
    wait_for(lambda: (p := read_pids(runtime_dir)) and p.get(stage) not in (None, old), timeout=120,
             what=f"{stage} restarted")


GREEDY = [i for i in range(2 * len(KINDS)) if KINDS[i % len(KINDS)][1] == 0.0]


@pytest.mark.parametrize("stage", ["engine_proc", "detok_proc", "tokenizer_proc"])
def test_http_streams_survive_a_stage_killed_mid_stream(served, stage):
    runtime_dir, port, client, model = served
    reference = _run(port, model)
    assert all(o.done and o.error is None for o in reference), reference
    killed: list[int] = []
    outcomes = _run(port, model, kill=lambda: killed.append(_kill(runtime_dir, stage)))
    for o in outcomes:
        assert o.done and o.broken is None, o  # [DONE], never a broken connection: the front lives
    clean = [o for o in outcomes if o.error is None]
    if stage == "engine_proc":  # continued on the restarted engine: every stream, as if nothing happened
        assert len(clean) == len(outcomes), [o.error for o in outcomes]
    for i in GREEDY:
        if outcomes[i].error is None:
            assert outcomes[i].text == reference[i].text, f"greedy stream {i} after the {stage} restart differs"
    late = outcomes[-1]  # sent while the stage was down: it waited for the restart, and was served
    assert late.error is None and late.text == reference[2].text, late
    _restarted(runtime_dir, stage, killed[0])
    wait_for(lambda: engine_idle(client), timeout=60, what="nothing live in the engine")
    assert all(o.done and o.error is None for o in _run(port, model))  # serving again


def test_a_killed_front_leaves_nothing_live_and_its_restart_serves(served):
    runtime_dir, port, client, model = served
    killed: list[float] = []

    def kill_front() -> None:
        _kill(runtime_dir, "http")
        killed.append(time.monotonic())
    outcomes = _run(port, model, kill=kill_front)
    *streams, late = outcomes
    assert all(o.broken and not o.done for o in streams), streams  # the connection breaks: no [DONE]
    # Nothing listens until the restart (reset: it reached the port as the process died).
    assert late.broken in ("ConnectionRefusedError", "ConnectionResetError") and not late.done, late
    # The front's requests are aborted once the detokenizer misses its pings (client timeout, 5 s).
    wait_for(lambda: engine_idle(client), timeout=60, what="the dead front's requests aborted in the engine")
    wait_for(lambda: _get(port, "/health")[0] == 200, timeout=60, what="the restarted front")
    print(f"front serving {time.monotonic() - killed[0]:.1f}s after its SIGKILL")
    assert all(o.done and o.error is None for o in _run(port, model))
