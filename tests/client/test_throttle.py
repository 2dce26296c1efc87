"""ThrottledWarnings: the warning a hot loop raises on every iteration, logged without flooding."""
from __future__ import annotations

import logging

from nanovllm.service.stage import RejectLog
from nanovllm_client.throttle import ThrottledWarnings


def test_the_first_warning_of_a_key_at_once_then_one_an_interval_with_the_count(caplog, monkeypatch):
    now = [100.0]
    monkeypatch.setattr("nanovllm_client.throttle.time.monotonic", lambda: now[0])
    warnings = ThrottledWarnings(logging.getLogger("throttle-test"), interval_s=10.0)
    with caplog.at_level(logging.WARNING, logger="throttle-test"):
        logged = [warnings.warn("a", "dropped %s", "x") for _ in range(1000)]
        assert warnings.warn("b", "other")  # each key its own
        now[0] += 10.0
        assert warnings.warn("a", "dropped %s", "y")
        assert not warnings.warn("a", "dropped %s", "z")
    assert logged.count(True) == 1
    assert [r.getMessage() for r in caplog.records] == [
        "dropped x", "other", "dropped y (999 more since the last report)"]


def test_reject_log_counts_every_frame_and_logs_a_few(caplog):
    seen = []
    rejects = RejectLog(logging.getLogger("reject-test"), on_reject=seen.append)
    with caplog.at_level(logging.WARNING, logger="reject-test"):
        for _ in range(500):
            rejects("bad_frame", "not msgpack")
    assert rejects.counts == {"bad_frame": 500} and seen == ["bad_frame"] * 500
    assert [r.getMessage() for r in caplog.records] == ["rejected a frame (bad_frame): not msgpack"]
