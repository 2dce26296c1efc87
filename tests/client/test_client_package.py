"""The client distribution: no heavy imports, endpoint naming, request building, CLI."""
from __future__ import annotations

import subprocess
import sys

import pytest

from nanovllm_client import Client, ServiceUnavailableError, service_endpoints
from nanovllm_client import protocol as p
from nanovllm_client.client_state import ClientState, build_request
from nanovllm_client.sampling import SamplingError, SamplingParams


def test_importing_the_client_never_imports_torch_transformers_or_numpy():
    code = ("import sys, nanovllm_client, nanovllm_client.cli, nanovllm.service.stage; "
            "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr  # nor does the stage runtime: a stage's --help is quick


def test_the_client_package_holds_and_imports_no_server_code():
    code = ("import importlib, pkgutil, sys, nanovllm_client\n"
            "names = [m.name for m in pkgutil.iter_modules(nanovllm_client.__path__)]\n"
            "for name in names: importlib.import_module('nanovllm_client.' + name)\n"
            "print(names)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'nanovllm' or m == 'zmq.auth.thread'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    modules, server_side = out.stdout.strip().splitlines()
    assert "stage" not in modules and "__main__" not in modules, modules
    assert server_side == "[]", server_side  # no stage runtime, no authenticator thread
    from nanovllm_client import security

    for name in ("ServiceSecurity", "AllowList", "keygen_main", "claimed_id"):  # the server half of CURVE
        assert not hasattr(security, name), name


def test_one_url_names_every_endpoint():
    ipc = service_endpoints("ipc:///run/nanovllm/")
    assert ipc.tokenizer == "ipc:///run/nanovllm/tokenizer.sock" and ipc.stream == "ipc:///run/nanovllm/stream.sock"
    tcp = service_endpoints("tcp://127.0.0.1:5550")
    assert ipc.control == "ipc:///run/nanovllm/control.sock"
    assert (tcp.tokenizer, tcp.stream, tcp.engine, tcp.detok, tcp.control) == tuple(
        f"tcp://127.0.0.1:{5550 + i}" for i in range(5))
    assert service_endpoints("tcp://h:65531").control == "tcp://h:65535"
    for bad in ("http://x", "tcp://host", "tcp://:1", "ipc://", "tcp://h:65535", "tcp://h:65532"):
        with pytest.raises(ValueError):
            service_endpoints(bad)


def test_build_request_accepts_text_chat_or_token_ids():
    text = build_request("hi", max_tokens=5, temperature=0, stop="END", seed=None)
    assert (text.prompt, text.sampling) == ("hi", SamplingParams(max_tokens=5, temperature=0, stop=["END"]))
    assert build_request("hi", sampling=text.sampling).sampling is text.sampling
    chat = build_request([{"role": "user", "content": "hi"}])
    assert chat.messages == [{"role": "user", "content": "hi"}] and chat.prompt is None
    ids = p.decode(build_request([1, 2, 3]).encode())
    assert ids.prompt_token_ids == [1, 2, 3] and ids.sampling == SamplingParams()


def test_bad_sampling_is_refused_before_anything_is_sent():
    """The client builds the one struct, so a bad value fails at the call, naming the field, with
    the words every other door uses."""
    with pytest.raises(SamplingError, match=r"^top_p must be in \(0, 1\], got 7$") as e:
        build_request("hi", top_p=7)
    assert e.value.field == "top_p"
    with pytest.raises(SamplingError, match=r"unknown sampling parameter\(s\) \['temprature'\]"):
        build_request("hi", temprature=0)
    with pytest.raises(TypeError, match="not both"):
        build_request("hi", sampling=SamplingParams(), max_tokens=3)


def state_with(*wire_ids: str, engine_restart_wait_s: float = 60.0) -> ClientState:
    """Requests in flight whose resend frames are real GenerateReqs (a continuation decodes one)."""
    state = ClientState(engine_restart_wait_s=engine_restart_wait_s)
    for wire_id in wire_ids:
        state.sent(wire_id, p.GenerateReq(wire_id, prompt=f"prompt of {wire_id}", resend=True).encode())
    return state


def answer(state: ClientState, *wire_ids: str, text: str = "xy", ids: tuple = (1, 2)) -> None:
    state.handle(p.StreamOutput(deltas=[p.DeltaRow(request_id=w, text=text, token_ids=p.pack_token_ids(list(ids)))
                                        for w in wire_ids]).encode())


def failures(deltas) -> list[tuple]:
    return [(d.request_id, d.finish_reason, d.engine_dead) for d in deltas]


def sent_again(frames: list[bytes]) -> dict[str, tuple]:
    """wire id -> (output token ids, output chars) of each request frame sent again."""
    reqs = [p.decode(f) for f in frames]
    assert all(isinstance(r, p.GenerateReq) and r.resend for r in reqs)
    return {r.request_id: (p.unpack_token_ids(r.output_token_ids or b""), r.output_chars) for r in reqs}


def test_with_no_wait_an_engine_death_fails_every_request_once():
    state = state_with("a", "b", engine_restart_wait_s=0)
    state.handle(p.Pong("detokenizer", "d1", True).encode())
    answer(state, "a")
    deltas = state.handle(p.EngineStatus(False, "e1", "crashed").encode()).deltas
    assert failures(deltas) == [("a", "error", True), ("b", "error", True)] and not state.parked
    assert state.engine_alive is False
    assert state.handle(p.EngineStatus(False, "e1").encode()).deltas == []  # already known dead


def test_every_request_of_a_dead_engine_goes_to_the_next_one_continued_from_what_it_received():
    """Nothing fails: a request that had streamed is sent with the tokens and the count of
    characters it received (the new engine continues from there), one that had not as it was."""
    state = state_with("a", "b", "c")
    state.handle(p.Pong("detokenizer", "d1", True).encode())
    state.handle(p.EngineStatus(True, "e1").encode())
    answer(state, "a", text="héllo", ids=(5, 6, 7))
    # The detokenizer fails what it knew, then tells of the death.
    reaction = state.handle(p.StreamOutput([p.error_delta("a", "engine died: x", engine_dead=True),
                                            p.error_delta("b", "engine died: x", engine_dead=True)]).encode())
    assert reaction.deltas == []
    assert state.handle(p.EngineStatus(False, "e1", "x").encode()).deltas == []
    assert set(state.parked) == {"a", "b", "c"} and not state.inflight
    assert state.handle(p.EngineStatus(True, "e1", state="loading").encode()).to_tokenizer == []  # not up yet
    reaction = state.handle(p.EngineStatus(True, "e2").encode())
    assert sent_again(reaction.to_tokenizer) == {"a": ([5, 6, 7], 5), "b": ([], 0), "c": ([], 0)}
    assert reaction.deltas == [] and set(state.inflight) == {"a", "b", "c"} and not state.parked
    # The next engine dies too: a request in flight at two deaths may be what kills the engine,
    # so it is not sent to a third (that would keep the service down for everyone).
    answer(state, "a", text="!", ids=(8,))
    state.handle(p.EngineStatus(False, "e2", "y").encode())
    reaction = state.handle(p.EngineStatus(True, "e3").encode())
    assert reaction.to_tokenizer == [] and failures(reaction.deltas) == [("a", "error", True), ("b", "error", True),
                                                                         ("c", "error", True)]
    assert "the engine died 2 times while this request was in flight" in reaction.deltas[0].error


def test_a_kept_request_fails_when_no_engine_comes_back_in_time(monkeypatch):
    import nanovllm_client.client_state as cs

    now = [1000.0]
    monkeypatch.setattr(cs.time, "monotonic", lambda: now[0])
    state = state_with("a", engine_restart_wait_s=5)
    state.handle(p.Pong("detokenizer", "d1", True).encode())
    state.handle(p.EngineStatus(False, "e1", "killed").encode())
    now[0] += 4.9
    assert state.check_detok() == [] and "a" in state.parked
    now[0] += 0.2
    (delta,) = state.check_detok()
    assert (delta.request_id, delta.engine_dead) == ("a", True)
    assert delta.error == "engine died: killed; no new engine came up within 5s" and not state.parked


def test_a_kept_request_fails_if_the_engine_it_went_to_comes_back():
    """Declared dead (silent too long), the same instance may speak again: the detokenizer has
    dropped the request meanwhile, and a resend would be ignored as a copy of one it holds."""
    state = state_with("a")
    state.handle(p.Pong("detokenizer", "d1", True).encode())
    state.handle(p.EngineStatus(True, "e1").encode())
    state.handle(p.EngineStatus(False, "e1", "no heartbeat").encode())
    reaction = state.handle(p.EngineStatus(True, "e1").encode())
    assert failures(reaction.deltas) == [("a", "error", True)] and reaction.to_tokenizer == []


def test_a_request_that_reached_no_engine_is_sent_again_while_one_is_up(monkeypatch):
    """The tokenizer refuses a request it had no engine to pass to (a new engine it has not
    connected to yet, though the detokenizer already reports it). That request reached no
    engine: it was kept under the engine instance the client knew, which was up, so it waited out
    the whole wait and failed. Now it goes again while an engine is up, as often as it is refused
    within the wait, never counted as a resend to a new engine; a continuation keeps its output."""
    import nanovllm_client.client_state as cs

    now = [1000.0]
    monkeypatch.setattr(cs.time, "monotonic", lambda: now[0])
    state = state_with("a", "b", engine_restart_wait_s=5)
    state.handle(p.Pong("detokenizer", "d1", True).encode())
    state.handle(p.EngineStatus(True, "e1").encode())
    answer(state, "a", text="héllo", ids=(5, 6, 7))
    state.handle(p.EngineStatus(False, "e1", "killed").encode())
    assert sent_again(state.handle(p.EngineStatus(True, "e2").encode()).to_tokenizer) == {"a": ([5, 6, 7], 5),
                                                                                       "b": ([], 0)}
    for _ in range(3):  # refused each time: the tokenizer has not reached e2 yet
        now[0] += 1.0
        refused = [p.error_delta(w, "engine is not available", engine_dead=True, unsent=True) for w in ("a", "b")]
        reaction = state.handle(p.StreamOutput(refused).encode())
        assert reaction.deltas == [] and sent_again(reaction.to_tokenizer) == {"a": ([5, 6, 7], 5), "b": ([], 0)}
    assert state.inflight["a"].resends == 1 and not state.parked
    answer(state, "a", text="!", ids=(8,))  # it got through
    now[0] += 2.5  # 5.5 s since "b" began to wait: refused once more, it fails
    refused = [p.error_delta(w, "engine is not available", engine_dead=True, unsent=True) for w in ("a", "b")]
    reaction = state.handle(p.StreamOutput(refused).encode())
    assert sent_again(reaction.to_tokenizer) == {"a": ([5, 6, 7, 8], 6)}  # its wait began at this refusal
    (delta,) = reaction.deltas
    assert (delta.request_id, delta.engine_dead) == ("b", True)
    assert delta.error == "engine is not available; the tokenizer reached no engine within 5s"


def test_a_cancelled_kept_request_is_not_sent_again():
    state = state_with("a", "b")
    state.handle(p.Pong("detokenizer", "d1", True).encode())
    state.handle(p.EngineStatus(False, "e1", "x").encode())
    state.forget("a")
    assert list(sent_again(state.handle(p.EngineStatus(True, "e2").encode()).to_tokenizer)) == ["b"]


def test_an_engine_restart_seen_only_as_a_new_instance_continues_every_request():
    """When the detokenizer died with the engine, the first sign is a new engine instance: the
    requests in flight go to the new engine as at an engine death (no abort: one would overtake
    the continuation and end it)."""
    state = state_with("a", "b")
    state.handle(p.Pong("detokenizer", "d1", True).encode())
    state.handle(p.EngineStatus(True, "e1").encode())
    answer(state, "a")
    reaction = state.handle(p.EngineStatus(True, "e2").encode())
    assert reaction.deltas == []
    assert sent_again(reaction.to_tokenizer) == {"a": ([1, 2], 2), "b": ([], 0)}


def test_a_restarted_detokenizer_is_asked_to_resume_each_stream_where_it_broke_off():
    state = state_with("a", "b")
    state.handle(p.Pong("detokenizer", "d1", True).encode())
    state.handle(p.StreamOutput([p.DeltaRow("a", "héllo", p.pack_token_ids([5, 6, 7]))]).encode())
    reaction = state.handle(p.Pong("detokenizer", "d2", True).encode())
    assert reaction.deltas == []  # nothing fails
    (resume,) = reaction.to_detok
    assert p.decode(resume).requests == [p.ResumeRow("a", 3, 5), p.ResumeRow("b", 0, 0)]


def test_a_detokenizer_that_just_started_does_not_count_as_a_dead_engine():
    state = state_with("a")
    state.handle(p.Pong("detokenizer", "d1", True).encode())
    reaction = state.handle(p.Pong("detokenizer", "d2", None).encode())
    assert state.engine_alive is None and not any(d.finished for d in reaction.deltas)


def test_a_restarted_tokenizer_gets_the_unanswered_requests_again():
    state = state_with("a", "b")
    state.handle(p.Pong("tokenizer", "t1", True).encode())
    state.handle(p.StreamOutput([p.DeltaRow("a", "x", p.pack_token_ids([1]))]).encode())
    assert state.handle(p.Pong("tokenizer", "t1", True).encode()).to_tokenizer == []  # same instance
    assert list(sent_again(state.handle(p.Pong("tokenizer", "t2", True).encode()).to_tokenizer)) == ["b"]


def test_a_silent_detokenizer_fails_streams_only_after_the_stage_timeout(monkeypatch):
    import nanovllm_client.client_state as cs

    now = [1000.0]
    monkeypatch.setattr(cs.time, "monotonic", lambda: now[0])
    state = state_with("a")
    state.handle(p.Pong("detokenizer", "d1", True).encode())
    now[0] += state.detok_timeout + 0.1
    assert state.check_detok() == [] and not state.ready  # new requests wait; this one keeps waiting
    now[0] += state.stage_timeout
    (delta,) = state.check_detok()
    assert delta.finish_reason == "error" and "has not answered" in delta.error


def test_each_stream_gets_its_own_wire_id_so_ids_can_be_reused():
    from nanovllm_client.client_state import wire_request

    first, second = wire_request(build_request("hi", request_id="r")), wire_request(build_request("hi", request_id="r"))
    assert first[0] != second[0] and first[0].startswith("r#")
    assert p.decode(first[2]).resend is True and p.decode(first[1]).resend is False
    with pytest.raises(ValueError, match="at most"):
        wire_request(build_request("hi", request_id="x" * 300))


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


def test_the_server_distribution_carries_the_client_package_its_stages_import(server_wheel):
    """`pip install .` alone must give stages that can import nanovllm_client."""
    import zipfile

    names = set(zipfile.ZipFile(server_wheel).namelist())
    for module in ("nanovllm_client/protocol.py", "nanovllm/service/stage.py", "engine_proc/server.py",
                   "nanovllm/supervisor.py"):
        assert module in names, module


def test_a_frame_the_tokenizer_could_not_read_fails_the_request_it_carried():
    """The tokenizer names an unreadable frame by its digest; the request whose frame (first
    send or resend) has that digest fails, and only while unanswered."""
    state = state_with("a", "b")  # sent as their resend frames: those are what the digests name
    resend_a = state.inflight["a"].resend_frame
    unreadable = p.ErrorOutput("frame is not valid msgpack", frame_digest=p.frame_digest(resend_a))
    # A digest of no frame of ours: logged, nothing fails.
    assert state.handle(p.ErrorOutput("x", frame_digest="0" * 16).encode()).deltas == []
    assert failures(state.handle(unreadable.encode()).deltas) == [("a", "error", False)]
    assert set(state.inflight) == {"b"} and set(state.unanswered.values()) == {"b"}
    answer(state, "b")  # answered: its frame was read, the digest is forgotten
    assert not state.unanswered
    # A tokenizer restart sends "c" again: that frame's digest names it now.
    state = state_with("c")
    state.handle(p.Pong("tokenizer", "t1").encode())
    frames = state.handle(p.Pong("tokenizer", "t2").encode()).to_tokenizer
    assert list(state.unanswered.items()) == [(p.frame_digest(frames[0]), "c")]
    deltas = state.handle(p.ErrorOutput("over the limits", frame_digest=p.frame_digest(frames[0])).encode()).deltas
    assert failures(deltas) == [("c", "error", False)] and not state.unanswered
