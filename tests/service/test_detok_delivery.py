"""The detokenizer's client delivery and engine watch without sockets: frames go to a fake
`send`, budgets give clients up through a recorded callback (`Delivery`, `EngineWatch`)."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from detok_proc.delivery import GONE_CLIENT_MEMORY_S, NO_ROOM, Delivery
from detok_proc.engine_watch import EngineEvent, EngineWatch
from nanovllm.metrics import DetokMetrics
from nanovllm_client import protocol as p

A, B = b"client-a", b"client-b"


class FakeRouter:
    """Records what was sent; a client in `full` has no room, one in `gone` has no socket."""

    def __init__(self):
        self.sent: list[tuple[bytes, bytes]] = []
        self.full: set[bytes] = set()
        self.gone: set[bytes] = set()

    def __call__(self, identity: bytes, frame: bytes) -> str | None:
        if identity in self.gone:
            return "Host unreachable"
        if identity in self.full:
            return NO_ROOM
        self.sent.append((identity, frame))
        return None


@pytest.fixture
def rig():
    router, given_up = FakeRouter(), []
    metrics = DetokMetrics(CollectorRegistry())

    def give_up(identity: bytes, why: str) -> None:
        given_up.append((identity, why))
        delivery.forget(identity)

    delivery = Delivery(router, give_up, metrics, max_pending_frames=3, max_pending_bytes=1000)
    return delivery, router, given_up, metrics


def delta(rid: str, text: str, reason: str | None = None) -> dict:
    return p.DeltaRow(rid, text, p.pack_token_ids([ord(c) for c in text]), reason)


def deltas_sent(router: FakeRouter, identity: bytes) -> list[dict]:
    msgs = [p.decode(frame) for who, frame in router.sent if who == identity]
    return [d for m in msgs if isinstance(m, p.StreamOutput) for d in m.deltas]


def test_a_pass_merges_each_requests_deltas_into_one_frame(rig):
    delivery, router, _, _ = rig
    for text in ("he", "ll", "o"):
        delivery.stage_delta(A, delta("x", text))
    delivery.stage_delta(A, delta("y", "!", "length"))
    assert not router.sent, "nothing leaves before the pass ends"
    delivery.flush_outbox()
    assert len(router.sent) == 1
    sent = deltas_sent(router, A)
    assert [(d.request_id, d.text, d.finish_reason) for d in sent] == [("x", "hello", None), ("y", "!", "length")]
    assert p.unpack_token_ids(sent[0].token_ids) == [ord(c) for c in "hello"]


def test_an_id_reused_after_its_end_starts_a_new_delta_and_a_frame_sent_now_follows_the_pass(rig):
    delivery, router, _, _ = rig
    delivery.stage_delta(A, delta("r", "one", "length"))
    delivery.stage_delta(A, delta("r", "two"))  # the first frame goes: the two streams stay apart
    delivery.send(A, p.Pong("detokenizer", "D1", True, "ready", 1.0, "ready").encode())
    assert [type(p.decode(f)).__name__ for _, f in router.sent] == ["StreamOutput", "StreamOutput", "Pong"]
    assert [(d.text, d.finish_reason) for d in deltas_sent(router, A)] == [("one", "length"), ("two", None)]


def test_a_client_that_does_not_read_is_given_up_after_max_pending_frames(rig):
    delivery, router, given_up, _ = rig
    delivery.heard_from(A, 0.0)
    router.full.add(A)
    for k in range(3):
        delivery.send(A, b"frame%d" % k)
    assert delivery.num_pending_frames() == 3 and not given_up
    delivery.send(A, b"frame3")
    assert [who for who, _ in given_up] == [A] and "4" not in given_up[0][1]
    assert A not in delivery.clients and delivery.pending_bytes == 0


def test_frames_held_in_order_leave_when_there_is_room(rig):
    delivery, router, _, metrics = rig
    delivery.heard_from(A, 0.0)
    router.full.add(A)
    delivery.send(A, b"1")
    router.full.discard(A)
    delivery.send(A, b"2")  # behind the held one, not ahead of it
    assert not router.sent and delivery.has_pending()
    assert metrics.registry.get_sample_value("nanovllm:client_output_bytes_held") == 2
    delivery.flush_pending()
    assert router.sent == [(A, b"1"), (A, b"2")] and not delivery.has_pending() and delivery.pending_bytes == 0


def test_over_the_byte_budget_the_client_holding_the_most_is_given_up(rig):
    delivery, router, given_up, _ = rig
    for identity in (A, B):
        delivery.heard_from(identity, 0.0)
        router.full.add(identity)
    delivery.send(A, b"a" * 300)
    delivery.send(A, b"a" * 300)
    delivery.send(B, b"b" * 300)
    assert not given_up
    delivery.send(B, b"b" * 200)  # B crosses the budget, A holds the most
    assert [who for who, _ in given_up] == [A] and "the most of any client" in given_up[0][1]
    assert list(delivery.clients) == [B] and delivery.pending_bytes == 500


def test_a_socket_gone_gives_up_a_client_heard_from_but_holds_for_one_not_heard_yet(rig):
    delivery, router, given_up, _ = rig
    router.gone.update((A, B))
    delivery.know(A, 0.0)  # its requests came with the engine's resync: it may still be reconnecting
    delivery.send(A, b"held")
    assert not given_up and delivery.clients[A].pending
    delivery.heard_from(B, 0.0)
    delivery.send(B, b"lost")
    assert given_up == [(B, "its socket is gone (Host unreachable)")]


def test_silence_stalls_and_gone_clients_are_timed(rig):
    delivery, _, _, _ = rig
    delivery.heard_from(A, 0.0)
    delivery.heard_from(B, 4.0)
    assert delivery.silent(6.0, 5.0) == [A]
    delivery.stalled(3.0)
    assert delivery.silent(6.0, 5.0) == []
    delivery.remember_gone(A, 10.0, "no heartbeat", ["x"])
    delivery.expire_gone(10.0 + GONE_CLIENT_MEMORY_S)
    assert delivery.take_gone(A) == (10.0, "no heartbeat", ["x"]) and delivery.take_gone(A) is None
    delivery.remember_gone(B, 10.0, "no heartbeat", [])
    delivery.expire_gone(11.0 + GONE_CLIENT_MEMORY_S)
    assert not delivery.gone


@pytest.fixture
def watch() -> EngineWatch:
    return EngineWatch(3.0, DetokMetrics(CollectorRegistry()))


def test_the_first_engine_heard_is_followed_and_clients_told_when_its_state_changes(watch):
    assert watch.status(p.EngineStatus(True, "E1", state="loading")).announce.state == "loading"
    assert watch.alive is None, "a loading engine is not dead"
    event = watch.status(p.EngineStatus(True, "E1", state="ready"))
    assert (event.fail, event.announce.instance_id, watch.alive) == ("", "E1", True)
    assert watch.status(p.EngineStatus(True, "E1", state="ready")).announce is None, "no change, no news"
    assert watch.announcement().instance_id == "E1"


def test_a_new_instance_is_a_restart_and_another_ones_outputs_are_foreign(watch):
    watch.speaks("E1", "ready")
    assert watch.outputs("E2").foreign and watch.instance == "E1", "outputs alone never switch engines"
    event = watch.status(p.EngineStatus(True, "E2", state="ready"))
    assert event.fail.startswith("engine restarted (instance E2 replaced E1") and event.spare == "E2"
    assert watch.metrics.registry.get_sample_value("nanovllm:stage_restarts_total", {"stage": "engine"}) == 1


def test_death_is_told_once_and_only_the_followed_engines_counts(watch):
    watch.speaks("E1", "ready")
    assert watch.status(p.EngineStatus(False, "E9", "bye")).foreign and watch.alive is True
    assert watch.status(p.EngineStatus(False, "", "forged")).foreign
    event = watch.status(p.EngineStatus(False, "E1", "shutting down"))
    assert (event.fail, event.spare, event.announce.alive) == ("engine died: shutting down", None, False)
    again = watch.connection_closed()
    assert again.fail == "" and again.announce is None, "already dead"
    assert watch.dead("again").announce is None


def test_silence_counts_only_once_heard_and_not_while_we_stalled(watch):
    assert not watch.overdue(100.0) and watch.connection_closed() == EngineEvent(), "never heard: nothing to lose"
    watch.speaks("E1", "ready")
    watch.heard(10.0)
    assert not watch.overdue(13.0) and watch.overdue(13.5)
    watch.stalled(8.0)
    assert not watch.overdue(20.0)
    assert watch.connection_closed().announce.alive is False
