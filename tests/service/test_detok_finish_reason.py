"""A request whose stop string completes ends with "stop", as offline `LLM.generate` says, on
whichever engine row the string completes: the last one too, and a resync's, after the
detokenizer that saw the match restarted and the engine ended the request on its abort.

An in-process DetokStage fed engine frames directly (tests/service/test_detok_coalesce.py)."""
from __future__ import annotations

from nanovllm_client import protocol as p
from nanovllm_client.sampling import SamplingParams
from tests.service.test_detok_coalesce import ENGINE, rig, step, streamed  # noqa: F401 (rig: a fixture)

TEXT = "one two three four"


def rows_of(ids: list[int], last_reason: str) -> list[list]:
    return [["c:x", p.pack_token_ids([t]), k == len(ids) - 1, last_reason if k == len(ids) - 1 else None,
             3, k + 1, 0, None, None, None] for k, t in enumerate(ids)]


def test_a_stop_string_completed_by_the_last_row_ends_with_stop(rig):
    tok, stage, client, identity = rig
    ids = tok.encode(TEXT, add_special_tokens=False)
    stop = tok.decode(ids[-1:])  # completes only with the engine's final token (max_tokens reached)
    meta = p.RequestMeta(client=identity, client_request_id="x", sampling=SamplingParams(stop=[stop]))
    rows = rows_of(ids, "length")
    stage.on_engine_frames([step(rows[:1], [["c:x", meta]])])
    for r in rows[1:]:
        stage.on_engine_frames([step([r])])
    stage.delivery.flush_outbox()
    text, _, last = streamed(client)
    assert last.finish_reason == "stop", last
    assert text == tok.decode(ids[:-1]) and stop not in text
    assert not stage.streams.requests


def test_a_resynced_request_the_engine_ended_on_a_stop_abort_ends_with_stop(rig):
    # The detokenizer that saw the stop string aborted the request in the engine, then died; the
    # engine's resync to its successor lists the request as finished, reason "abort".
    tok, stage, client, identity = rig
    ids = tok.encode(TEXT, add_special_tokens=False)
    stop = tok.decode(ids[2:3])
    meta = p.RequestMeta(client=identity, client_request_id="x", sampling=SamplingParams(stop=[stop]))
    entry = [meta, ["c:x", p.pack_token_ids(ids[:3]), True, "abort", 3, 3, 0, None, None, None]]
    stage.on_engine_frames([p.Resync(instance_id=ENGINE, detok_instance=stage.instance_id, entries=[entry],
                                     last=True).encode()])
    stage.on_client_frames(identity, [p.Resume(requests=[["x", 1, len(tok.decode(ids[:1]))]]).encode()])
    stage.delivery.flush_outbox()
    text, tokens, last = streamed(client)
    assert last.finish_reason == "stop", last
    assert tok.decode(ids[:1]) + text == tok.decode(ids[:2])
    assert not stage.streams.requests
