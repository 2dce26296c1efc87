"""The detokenizer merges the engine steps it finds waiting into one frame per client: a stage that
fell behind catches up with one frame of k tokens per request instead of k frames, and the text,
the tokens, their order and the terminal fields are exactly what the frames one by one would give.

An in-process DetokStage on real ipc sockets; the test calls its frame handler directly, so which
engine frames belong to one pass is decided here, not by timing."""
from __future__ import annotations

import uuid

import pytest
import zmq

from detok_proc.server import DetokStage
from nanovllm_client import protocol as p
from nanovllm_client.endpoints import service_endpoints
from tests.service.harness import short_tmpdir

ENGINE = "fake-engine"


@pytest.fixture
def rig(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    eps = service_endpoints(f"ipc://{short_tmpdir()}")
    ctx = zmq.Context()
    try:
        stage = DetokStage(tok, eps.stream, eps.detok, eps.control, ctx=ctx)
        identity = uuid.uuid4().bytes
        client = ctx.socket(zmq.DEALER)
        client.setsockopt(zmq.ROUTING_ID, identity)
        client.connect(eps.stream)
        client.send(p.Ping().encode())
        assert stage.clients_sock.poll(10_000), "the ping never reached the stage"
        stage._drain_clients()
        assert isinstance(receive(client)[0], p.Pong)
        stage.on_engine_frames([p.EngineStatus(True, ENGINE).encode()])
        yield tok, stage, client, identity
    finally:
        ctx.destroy(linger=0)


def receive(client, wait_ms: int = 2000) -> list[p.Message]:
    """Every message waiting for the client (the first may take `wait_ms` to arrive)."""
    msgs = []
    while client.poll(wait_ms if not msgs else 200):
        msgs.append(p.decode(client.recv()))
    return msgs


def step(rows: list[list], started: list[list] = ()) -> bytes:
    return p.StepOutput(ENGINE, list(started), [], rows).encode()


def row(engine_id: str, token: int, k: int, last: bool) -> list:
    return [engine_id, p.pack_token_ids([token]), last, "length" if last else None, 7, k + 1, 0, None, None, None]


def test_steps_handled_in_one_pass_reach_the_client_as_one_frame(rig):
    tok, stage, client, identity = rig
    texts = {"a": "def café(): return '你好' 😀 # naïve", "b": "Hello there, world! 🚀🎉 done."}
    ids = {rid: tok.encode(text, add_special_tokens=False) for rid, text in texts.items()}
    started = [[f"c:{rid}", p.RequestMeta(client=identity, client_request_id=rid)] for rid in ids]
    n = max(len(v) for v in ids.values())
    for k in range(n):
        rows = [row(f"c:{rid}", v[k], k, k == len(v) - 1) for rid, v in ids.items() if k < len(v)]
        stage.on_engine_frames([step(rows, started if k == 0 else [])])
    stage.delivery.flush_outbox()
    streams = [m for m in receive(client) if isinstance(m, p.StreamOutput)]
    assert len(streams) == 1, f"{n} steps in one pass should make one frame, got {len(streams)}"
    deltas = {d.request_id: d for d in streams[0].deltas}
    assert set(deltas) == set(ids)
    for rid, d in deltas.items():
        assert p.unpack_token_ids(d.token_ids) == ids[rid]
        assert d.text == tok.decode(ids[rid]) == texts[rid]
        assert d.finish_reason == "length"
        assert d.usage.completion_tokens == len(ids[rid])
    assert stage.stats()["detok"]["num_requests"] == 0


def test_a_request_id_reused_within_a_pass_keeps_its_two_streams_apart(rig):
    tok, stage, client, identity = rig
    first, second = tok.encode("one two", add_special_tokens=False), tok.encode("three", add_special_tokens=False)
    meta = p.RequestMeta(client=identity, client_request_id="r")
    for k, token in enumerate(first):
        stage.on_engine_frames([step([row("c:r#1", token, k, k == len(first) - 1)], [["c:r#1", meta]] if k == 0 else [])])
    for k, token in enumerate(second):  # the client reused its id once the first had ended
        stage.on_engine_frames([step([row("c:r#2", token, k, k == len(second) - 1)], [["c:r#2", meta]] if k == 0 else [])])
    stage.delivery.flush_outbox()
    deltas = [d for m in receive(client) if isinstance(m, p.StreamOutput) for d in m.deltas]
    assert [(d.request_id, p.unpack_token_ids(d.token_ids), d.finish_reason) for d in deltas] == [
        ("r", first, "length"), ("r", second, "length")]
    assert [d.text for d in deltas] == [tok.decode(first), tok.decode(second)]


def test_a_frame_sent_to_a_client_mid_pass_follows_what_the_pass_holds_for_it(rig):
    tok, stage, client, identity = rig
    ids = tok.encode("steady text", add_special_tokens=False)
    stage.on_engine_frames([step([row("c:s", ids[0], 0, False)], [["c:s", p.RequestMeta(client=identity, client_request_id="s")]])])
    stage.on_engine_frames([p.EngineStatus(False, ENGINE, "gone").encode()])  # fails the request mid-pass
    stage.delivery.flush_outbox()
    deltas = [d for m in receive(client) if isinstance(m, p.StreamOutput) for d in m.deltas]
    assert [d.finish_reason for d in deltas] == [None, "error"]
    assert p.unpack_token_ids(deltas[0].token_ids) == ids[:1] and deltas[1].engine_dead is True


TEXT = "Hello there, world! 🚀🎉 done."


def continued_rows(ids: list[int], have: int) -> list[list]:
    """What an engine continuing from `ids[:have]` reports: that output again with its first new
    token, then one token a step."""
    rows = [["c:x", p.pack_token_ids(ids[:have + 1]), False, None, 7, have + 1, 0, None, None, None]]
    for k in range(have + 1, len(ids)):
        last = k == len(ids) - 1
        rows.append(["c:x", p.pack_token_ids([ids[k]]), last, "length" if last else None, 7, k + 1, 0, None, None, None])
    return rows


def streamed(client) -> tuple[str, list[int], dict]:
    deltas = [d for m in receive(client) if isinstance(m, p.StreamOutput) for d in m.deltas]
    return "".join(d.text for d in deltas), [t for d in deltas for t in p.unpack_token_ids(d.token_ids)], deltas[-1]


def test_a_continued_stream_sends_only_what_follows_what_its_client_has(rig):
    """A client continuing a stream after an engine restart says what it has (`meta.have_tokens`, `meta.have_chars`); the
    engine reports that output again with its first new token, and the client gets the rest."""
    tok, stage, client, identity = rig
    ids = tok.encode(TEXT, add_special_tokens=False)
    have, chars = 5, len(tok.decode(ids[:5]))
    meta = p.RequestMeta(client=identity, client_request_id="x", have_tokens=have, have_chars=chars)
    rows = continued_rows(ids, have)
    stage.on_engine_frames([step(rows[:1], [["c:x", meta]])])
    for r in rows[1:]:
        stage.on_engine_frames([step([r])])
    stage.delivery.flush_outbox()
    text, tokens, last = streamed(client)
    assert (text, tokens) == (TEXT[chars:], ids[have:])
    assert last.finish_reason == "length" and last.usage.completion_tokens == len(ids)


@pytest.mark.parametrize("reported", [0, 2], ids=["before-its-first-row", "after-two-new-tokens"])
def test_a_continued_stream_survives_a_detokenizer_restart(rig, reported):
    """A detokenizer restarted after a continued stream began. Before the engine's first row
    for it, the engine's resync has no output for it and the client's resume says it has more:
    the engine's first row then reports that output again, and only what follows reaches the
    client. After it, the resync holds the output again plus the new tokens, and nothing more
    may be cut (the request's `meta.have_tokens` no longer applies)."""
    tok, stage, client, identity = rig
    ids = tok.encode(TEXT, add_special_tokens=False)
    have = 5
    meta = p.RequestMeta(client=identity, client_request_id="x", have_tokens=have, have_chars=len(tok.decode(ids[:have])))
    rows = continued_rows(ids, have)
    output = ids[:have + reported] if reported else []
    client_has = have + reported  # it received every reported token before the restart
    chars = len(tok.decode(ids[:client_has]))
    stage.on_engine_frames([p.Resync(instance_id=ENGINE, detok_instance=stage.instance_id, last=True, entries=[
        [meta, ["c:x", p.pack_token_ids(output), False, None, 7, len(output), 0, None, None, None]]]).encode()])
    stage.on_client_frames(identity, [p.Resume([["x", client_has, chars]]).encode()])
    for r in rows[reported:]:  # rows[0] holds the output again and the first new token
        stage.on_engine_frames([step([r])])
    stage.delivery.flush_outbox()
    text, tokens, last = streamed(client)
    assert (text, tokens) == (TEXT[chars:], ids[client_has:]) and last.finish_reason == "length"


def test_every_rejection_reaches_a_client_the_stage_has_not_heard_from(rig):
    tok, stage, _, _ = rig
    quiet = stage.ctx.socket(zmq.DEALER)
    quiet_id = uuid.uuid4().bytes
    quiet.setsockopt(zmq.ROUTING_ID, quiet_id)
    quiet.connect(stage.clients_sock.getsockopt(zmq.LAST_ENDPOINT).decode())
    rejected = [[f"c:{rid}", p.RequestMeta(client=quiet_id, client_request_id=rid), f"{rid} refused"] for rid in ("a", "b")]
    for _ in range(50):  # until its connection is up: a frame to an unknown peer is refused, not held
        stage.on_engine_frames([p.StepOutput(ENGINE, [], rejected, []).encode()])
        stage.delivery.flush_outbox()
        if quiet.poll(100):
            break
    deltas = [d for m in receive(quiet) if isinstance(m, p.StreamOutput) for d in m.deltas]
    assert [(d.request_id, d.error) for d in deltas[:2]] == [("a", "a refused"), ("b", "b refused")]
