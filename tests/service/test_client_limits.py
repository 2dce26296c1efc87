"""Per-client limits: one client's flood does not take the limits every client shares, and does not
slow another client's stream; what it is refused names the limit it hit."""
from __future__ import annotations

import pytest

from engine_proc.client_shares import ClientShares
from nanovllm_client import Client, RequestError
from tests.service.conftest import TINY_ENGINE_ARGS, start_service
from tests.service.harness import fresh_engine_stats, num_steps, short_tmpdir, wait_for

SLOW = ["--post-step-hook", "tests.helpers.hooks:slow_step"]


def test_client_shares_count_and_forget():
    shares = ClientShares(max_live=2, max_queued=3)
    for _ in range(3):
        assert shares.refusal(b"a") is None
        shares.queued(b"a")
    assert "limit (--max-queued-per-client 3)" in shares.refusal(b"a")
    assert shares.refusal(b"b") is None  # another client's share is its own
    for _ in range(2):
        shares.unqueued(b"a")
        shares.went_live(b"a")
    assert not shares.may_go_live(b"a") and shares.may_go_live(b"b")
    shares.ended(b"a")
    assert shares.may_go_live(b"a")
    shares.ended(b"a")
    shares.unqueued(b"a")
    assert shares.num_clients == 0  # nothing stays behind for a client gone
    assert ClientShares().may_go_live(b"x") and ClientShares().refusal(b"x") is None  # 0: no limit
    with pytest.raises(ValueError, match="max_live_per_client must be an integer >= 0"):
        ClientShares(max_live=-1)


@pytest.fixture(scope="module")
def shared_engine(tiny_model_dir):
    """Room for 4 sequences a step, each step >= 10 ms; each client at most 2 of them live and 6
    more waiting for admission."""
    args = TINY_ENGINE_ARGS + SLOW + ["--max-num-seqs", "4", "--max-live-per-client", "2",
                                      "--max-queued-per-client", "6"]
    procs = start_service(tiny_model_dir, f"ipc://{short_tmpdir()}/svc", engine_args=args)
    yield procs
    procs.stop()


def test_a_flooding_client_does_not_slow_another_clients_stream(shared_engine):
    with Client(shared_engine.url, timeout=120) as flood, Client(shared_engine.url, timeout=120) as other:
        flood.wait_engine(timeout=120)
        # 900 tokens: >= 9 s at >= 10 ms a step, so none ends while the test runs, however loaded the
        # machine (with 400, the requests of a loaded run came in over 4 s and one had ended).
        floods = [flood.stream(f"def f{i}():", max_tokens=900, ignore_eos=True) for i in range(8)]
        wait_for(lambda: (e := fresh_engine_stats(flood)).get("num_live") == 2 and e.get("num_queued") == 6,
                 timeout=60, what="the flood's 2 live and 6 waiting")
        floods += [flood.stream(f"def g{i}():", max_tokens=900, ignore_eos=True) for i in range(12)]
        for s in floods[8:]:  # its share is full: the other 12 are refused
            with pytest.raises(RequestError, match=r"its limit \(--max-queued-per-client 6\)"):
                list(s)
        since = num_steps(other)
        stream = other.stream("def mine():", max_tokens=8, ignore_eos=True)
        first = next(stream)
        waited = num_steps(other) - since
        # Admitted past the flood's 6 waiting requests and run beside its 2 live ones: a few
        # steps (and a heartbeat's lag). Behind them, FCFS, it would wait out 400-token requests.
        assert waited < 100, f"the other client's first token came {waited} steps after it asked"
        assert list(stream)[-1].finish_reason == "length" and first.finish_reason is None
        for s in floods[:8]:
            s.cancel()
        stats = wait_for(lambda: (e := fresh_engine_stats(other)).get("num_live") == 0 and e, timeout=60,
                         what="every request gone")
        assert stats["num_queued"] == 0 and stats["num_clients"] == 0


@pytest.fixture(scope="module")
def held_tokenizer(tiny_model_dir):
    """An engine that takes one request and queues one: the rest wait in the pipes and the
    tokenizer, which holds at most 40 of one client's and admits priorities up to 5."""
    args = TINY_ENGINE_ARGS + SLOW + ["--max-live", "1", "--max-queued", "1"]
    procs = start_service(tiny_model_dir, f"ipc://{short_tmpdir()}/svc", engine_args=args,
                          env={"tokenizer_proc": {"NANOVLLM_MAX_PENDING_PER_CLIENT": "40",
                                                  "NANOVLLM_MAX_PRIORITY": "5"}})
    yield procs
    procs.stop()


def test_one_client_cannot_fill_what_the_tokenizer_holds_for_everyone(held_tokenizer):
    from tokenizer_proc.server import PENDING_MAX_FRAMES

    with Client(held_tokenizer.url, timeout=300) as flood, Client(held_tokenizer.url, timeout=300) as other:
        flood.wait_engine(timeout=120)
        # More than the pipes and the tokenizer's own bound hold (3.6 KB frames).
        streams = [flood.stream(list(range(100, 1000)), max_tokens=100, ignore_eos=True)
                   for _ in range(PENDING_MAX_FRAMES + 300)]
        with pytest.raises(RequestError, match=r"its limit \(--max-pending-per-client 40\)"):
            list(streams[-1])
        mine = other.stream("def mine():", max_tokens=3, ignore_eos=True)  # not refused as overloaded
        for s in streams:
            s.cancel()
        assert list(mine)[-1].finish_reason == "length"


def test_a_priority_above_the_ceiling_is_refused_naming_it(held_tokenizer):
    with Client(held_tokenizer.url, timeout=120) as client:
        client.wait_engine(timeout=120)
        with pytest.raises(RequestError, match=r"priority 6 is above this service's ceiling of 5 \(--max-priority\)"):
            client.generate("x", max_tokens=2, priority=6)
        assert client.generate("x", max_tokens=2, ignore_eos=True, priority=5).finish_reason == "length"


def test_a_rate_limit_is_a_bucket_per_client():
    from tokenizer_proc.rate_limit import RateLimit

    limit = RateLimit(2.0)  # 2 a second, bursts of 2
    assert [limit.refusal(b"a", 0.0) for _ in range(2)] == [None, None]
    why = limit.refusal(b"a", 0.0)
    assert "faster than its limit of 2 a second (--max-request-rate-per-client); retry in 0.50s" in why
    assert limit.refusal(b"b", 0.0) is None  # another client's bucket is its own
    assert limit.refusal(b"a", 0.25) is not None and limit.refusal(b"a", 0.5) is None  # half a second: one more
    limit.forget_idle(0.6)
    assert limit.num_clients == 1  # b's bucket is full again at 0.5 s, a's not until 1.5 s
    limit.forget_idle(5.0)  # refilled: as if never seen
    assert limit.num_clients == 0
    assert RateLimit(0).refusal(b"a", 0.0) is None and RateLimit(0.5).burst == 1.0
    for bad in (-1, float("nan"), "3", True):
        with pytest.raises(ValueError, match="max_request_rate_per_client must be a number >= 0"):
            RateLimit(bad)
