"""The detokenizer's request streams and restart recovery without sockets: engine rows in,
deltas per client and engine aborts out (`RequestStreams`, `Recovery`)."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from detok_proc.recovery import Recovery
from detok_proc.streams import RequestStreams
from nanovllm.metrics import DetokMetrics
from nanovllm_client import protocol as p
from nanovllm_client.sampling import SamplingParams

ENGINE = "E1"
CLIENT = b"client-1"


class CharTokenizer:
    """One token per character: ids are code points."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def row(rid: str, text: str, n: int, finished: bool = False, reason: str | None = None) -> p.OutputRow:
    return p.OutputRow(request_id=rid, token_ids=p.pack_token_ids(ids(text)), finished=finished,
                       finish_reason=p.FinishReason(reason) if reason else None, num_prompt_tokens=3,
                       num_output_tokens=n, num_cached_tokens=0, error=None)


def step(rows=(), started=(), rejected=(), engine: str = ENGINE) -> p.StepOutput:
    return p.StepOutput(instance_id=engine, started=[p.StartedRow(request_id=rid, meta=m) for rid, m in started],
                        rejected=[p.RejectedRow(request_id=rid, meta=m, error=e) for rid, m, e in rejected],
                        outputs=list(rows))


@pytest.fixture
def streams() -> RequestStreams:
    return RequestStreams(CharTokenizer(), DetokMetrics(CollectorRegistry()))


def meta(rid: str = "x", client: bytes = CLIENT, **text) -> p.RequestMeta:
    """A request's meta; `text`: its text-side sampling parameters (stop=..., min_tokens=...)."""
    return p.RequestMeta(client=client, client_request_id=rid, sampling=SamplingParams(**text))


def test_a_request_streams_its_text_and_ends_with_usage(streams):
    out = streams.step(step([row("c:x", "hel", 3)], started=[("c:x", meta())]))
    assert out.clients == [CLIENT] and not out.aborts
    assert [(d.request_id, d.text, d.finish_reason) for d in out.deltas[CLIENT]] == [("x", "hel", None)]
    out = streams.step(step([row("c:x", "lo", 5, True, "length")]))
    (last,) = out.deltas[CLIENT]
    assert (last.text, p.unpack_token_ids(last.token_ids), last.finish_reason) == ("lo", ids("lo"), "length")
    assert last.usage == p.Usage(prompt_tokens=3, completion_tokens=5, cached_tokens=0)
    assert not streams.requests and not streams.by_client


def test_a_rejected_request_becomes_an_error_delta(streams):
    out = streams.step(step(rejected=[("c:y", meta("y"), "prompt too long")]))
    (delta,) = out.deltas[CLIENT]
    assert (delta.request_id, delta.finish_reason, delta.error) == ("y", "error", "prompt too long")


def test_a_stop_string_ends_the_stream_only_once_the_engine_confirms(streams):
    out = streams.step(step([row("c:x", "hello world", 11)], started=[("c:x", meta(stop=["lo w"]))]))
    assert out.aborts == ["c:x"], "the engine must stop generating"
    assert [(d.text, d.finish_reason) for d in out.deltas[CLIENT]] == [("hel", None)]
    assert "c:x" in streams.requests, "held until the engine's final row"
    out = streams.step(step([row("c:x", "d", 12)]))  # the engine made one more before the abort reached it
    assert not out.deltas and not out.aborts
    streams.requests["c:x"].abort_sent_at -= 5  # the abort found no room a while ago: sent again
    assert streams.step(step([row("c:x", "!", 13)])).aborts == ["c:x"]
    out = streams.step(step([row("c:x", "", 13, True, "abort")]))
    (last,) = out.deltas[CLIENT]
    assert (last.text, last.finish_reason) == ("", "stop")
    assert last.usage.completion_tokens == 11, "usage at the match"
    assert not streams.requests


def test_outputs_with_no_owner_are_aborted_once_after_the_resync(streams):
    assert not streams.step(step([row("c:lost", "a", 1)])).aborts, "before the resync it may be someone's"
    streams.resynced = True
    assert streams.step(step([row("c:lost", "a", 1)])).aborts == ["c:lost"]
    assert not streams.step(step([row("c:lost", "b", 2)])).aborts
    assert not streams.step(step([row("c:done", "a", 1, True, "length")])).aborts


def test_failing_requests_spares_the_new_engines_and_ends_a_stopped_one_with_stop(streams):
    streams.step(step([row("c:a", "hello", 5)], started=[("c:a", meta("a", stop=["ll"])), ("c:b", meta("b"))]))
    streams.step(step(started=[("c:c", meta("c"))], engine="E2"))
    out = streams.fail("engine restarted", spare="E2")
    assert {d.request_id: d.finish_reason for d in out.deltas[CLIENT]} == {"a": "stop", "b": "error"}
    assert [d.engine_dead for d in out.deltas[CLIENT] if d.request_id == "b"] == [True]
    assert list(streams.requests) == ["c:c"]


def test_a_gone_client_loses_its_requests_and_the_running_ones_are_aborted(streams):
    streams.step(step(started=[("c:a", meta("a")), ("c:b", meta("b")), ("c:o", meta("o", client=b"other"))]))
    lost, out = streams.drop_client(CLIENT)
    assert sorted(lost) == ["a", "b"] and sorted(out.aborts) == ["c:a", "c:b"]
    assert list(streams.requests) == ["c:o"] and list(streams.by_client) == [b"other"]


def resync(recovery: Recovery, entries: list[tuple], now: float = 0.0):
    rows = [p.ResyncEntry(meta=m, output=row(rid, text, len(text), finished, reason))
            for rid, m, text, finished, reason in entries]
    return recovery.resync(p.Resync(instance_id=ENGINE, detok_instance="D1", entries=rows, last=True), now)


@pytest.fixture
def recovery(streams) -> Recovery:
    return Recovery(streams, resume_window_s=10.0, max_early_rows=10)


def test_a_resumed_stream_continues_from_what_its_client_has(recovery):
    out = resync(recovery, [("c:x", meta(), "hello", False, None)])
    assert not out.deltas and out.clients == [CLIENT] and recovery.streams.resynced
    out = recovery.resume(CLIENT, [p.ResumeRow("x", 2, 2)])
    (delta,) = out.deltas[CLIENT]
    assert (delta.text, p.unpack_token_ids(delta.token_ids), delta.finish_reason) == ("llo", ids("llo"), None)
    out = recovery.streams.step(step([row("c:x", "!", 6, True, "length")]))
    assert [(d.text, d.finish_reason) for d in out.deltas[CLIENT]] == [("!", "length")]


def test_a_client_that_has_more_than_the_engine_reported_is_not_sent_it_twice(recovery):
    resync(recovery, [("c:x", meta(), "hel", False, None)])
    out = recovery.resume(CLIENT, [p.ResumeRow("x", 5, 5)])  # it had "hello" from an engine that restarted
    assert [(d.text, d.token_ids) for d in out.deltas[CLIENT]] == [("", b"")]
    state = recovery.streams.requests["c:x"]
    assert (state.skip_tokens, state.skip_chars) == (2, 2)
    out = recovery.streams.step(step([row("c:x", "lo wo", 8)]))  # reported again with what is new
    assert [d.text for d in out.deltas[CLIENT]] == [" wo"]


def test_a_finished_resynced_request_ends_on_its_resume(recovery):
    resync(recovery, [("c:x", meta(), "done", True, "length")])
    out = recovery.resume(CLIENT, [p.ResumeRow("x", 0, 0)])
    assert [(d.text, d.finish_reason) for d in out.deltas[CLIENT]] == [("done", "length")]
    assert not recovery.streams.requests


def test_streams_no_client_claims_are_aborted(recovery):
    resync(recovery, [("c:x", meta("x"), "ab", False, None), ("c:y", meta("y"), "cd", False, None),
                      ("c:z", meta("z"), "ef", False, None)], now=100.0)
    out = recovery.resume(CLIENT, [p.ResumeRow("x", 2, 2), p.ResumeRow("gone", 3, 3), p.ResumeRow("x", 0, 0)])
    assert [d.request_id for d in out.deltas[CLIENT]] == ["x", "gone"]
    assert out.deltas[CLIENT][1].engine_dead is True, "a stream the engine no longer holds"
    assert sorted(out.aborts) == ["c:y", "c:z"], "the client did not list them: it no longer wants them"
    assert list(recovery.streams.requests) == ["c:x"]


def test_resumes_past_the_deadline_are_given_up(recovery):
    resync(recovery, [("c:x", meta(), "ab", False, None)], now=100.0)
    recovery.stalled(5.0)
    assert not recovery.expire(114.0).aborts, "the stall moved the deadline"
    assert recovery.expire(116.0).aborts == ["c:x"] and not recovery.streams.requests


def test_early_resumes_give_up_the_largest_first(recovery):
    assert recovery.hold(b"big", [p.ResumeRow("r", 0, 0)] * 7) == []
    assert recovery.hold(b"small", [p.ResumeRow("r", 0, 0)] * 2) == []
    refused = recovery.hold(b"mid", [p.ResumeRow("r", 0, 0)] * 4)
    assert [who for who, _ in refused] == [b"big"] and list(recovery.early) == [b"small", b"mid"]
    refused = recovery.hold(b"huge", [p.ResumeRow("r", 0, 0)] * 9)
    assert [who for who, _ in refused] == [b"huge"], "nothing held is larger: it is the one refused"
    assert list(recovery.take_early()) == [b"small", b"mid"] and not recovery.early


def test_a_second_resume_within_the_interval_is_refused_and_one_before_the_resync_is_held(recovery):
    out, refused = recovery.on_resume(CLIENT, [p.ResumeRow("x", 1, 1)], now=50.0)
    assert not refused and not out.deltas and recovery.early == {CLIENT: [p.ResumeRow("x", 1, 1)]}, "held for the resync"
    out, refused = recovery.on_resume(CLIENT, [p.ResumeRow("x", 2, 2)], now=50.5)
    assert [who for who, _ in refused] == [CLIENT] and recovery.early[CLIENT] == [p.ResumeRow("x", 1, 1)]
    resync(recovery, [("c:x", meta(), "abc", False, None)])
    out, refused = recovery.on_resume(CLIENT, [p.ResumeRow("x", 1, 1)], now=51.5)
    assert not refused and [d.text for d in out.deltas[CLIENT]] == ["bc"]
    recovery.forget_client(CLIENT)
    assert CLIENT not in recovery.last_resume
