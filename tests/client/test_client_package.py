"""The client distribution: no heavy imports, endpoint naming, request building, CLI."""
from __future__ import annotations

import subprocess
import sys

import pytest

from nanovllm_client import Client, ServiceUnavailableError, service_endpoints
from nanovllm_client import protocol as p
from nanovllm_client.client_state import ClientState, build_request


def test_importing_the_client_never_imports_torch_transformers_or_numpy():
    code = ("import sys, nanovllm_client, nanovllm_client.cli, nanovllm_client.stage; "
            "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_one_url_names_every_endpoint():
    ipc = service_endpoints("ipc:///run/nanovllm/")
    assert ipc.tokenizer == "ipc:///run/nanovllm/tokenizer.sock" and ipc.stream == "ipc:///run/nanovllm/stream.sock"
    tcp = service_endpoints("tcp://127.0.0.1:5550")
    assert (tcp.tokenizer, tcp.stream, tcp.engine, tcp.detok) == tuple(f"tcp://127.0.0.1:{5550 + i}" for i in range(4))
    for bad in ("http://x", "tcp://host", "tcp://:1", "ipc://", "tcp://h:65535"):
        with pytest.raises(ValueError):
            service_endpoints(bad)


def test_build_request_accepts_text_chat_or_token_ids():
    text = build_request("hi", max_tokens=5, temperature=0, stop="END")
    assert (text.prompt, text.sampling, text.stop) == ("hi", {"max_tokens": 5, "temperature": 0}, ["END"])
    chat = build_request([{"role": "user", "content": "hi"}])
    assert chat.messages == [{"role": "user", "content": "hi"}] and chat.prompt is None
    ids = p.decode(build_request([1, 2, 3]).encode())
    assert ids.prompt_token_ids == [1, 2, 3] and ids.sampling == {}


def test_engine_death_notice_fails_every_live_request_once():
    state = ClientState()
    state.handle(p.Pong("detokenizer", "d1", True).encode(), [])
    deltas, _ = state.handle(p.EngineStatus(False, "e1", "crashed").encode(), ["a", "b"])
    assert [(d.request_id, d.finish_reason, d.engine_dead) for d in deltas] == [("a", "error", True), ("b", "error", True)]
    assert state.engine_alive is False
    assert state.handle(p.EngineStatus(False, "e1").encode(), ["a"])[0] == []  # already known dead


def test_a_restarted_detokenizer_fails_live_requests():
    state = ClientState()
    state.handle(p.Pong("detokenizer", "d1", True).encode(), ["a"])
    deltas, _ = state.handle(p.Pong("detokenizer", "d2", True).encode(), ["a"])
    assert deltas[0].finish_reason == "error" and "restarted" in deltas[0].error


def test_no_service_is_a_clear_error_not_a_hang(tmp_path):
    with Client(f"ipc://{tmp_path}", connect_timeout=0.5) as c:
        with pytest.raises(ServiceUnavailableError, match="no answer from the service"):
            c.generate("hi")


def test_cli_help_runs_without_a_service():
    out = subprocess.run([sys.executable, "-m", "nanovllm_client.cli", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "--max-tokens" in out.stdout


def test_cli_reports_an_unreachable_service(tmp_path):
    out = subprocess.run([sys.executable, "-m", "nanovllm_client.cli", "--url", f"ipc://{tmp_path}", "--connect-timeout", "0.5", "hi"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "no answer from the service" in out.stderr
