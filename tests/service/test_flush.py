"""Flush: how the tokenizer and detokenizer stop (hand on what they hold, for the grace at most)."""
import threading
import time

from nanovllm.service.notify import Flush, Notifier


class Recorder(Notifier):
    def __init__(self) -> None:
        super().__init__()
        self.stopping_lines: list[str] = []

    def stopping(self, status: str) -> None:
        self.stopping_lines.append(status)


def test_serves_until_stop_then_only_while_holding():
    stop, notifier = threading.Event(), Recorder()
    flush = Flush(notifier, "handing on", grace_s=60.0)
    assert flush.serving(stop, holding=False) and flush.state == "ready"
    stop.set()
    assert flush.serving(stop, holding=True) and flush.state == "draining"
    assert flush.serving(stop, holding=True)
    assert not flush.serving(stop, holding=False)
    assert notifier.stopping_lines == ["handing on"]  # said once, at the stop


def test_a_stage_holding_nothing_stops_at_once():
    stop, flush = threading.Event(), Flush(Recorder(), "x")
    stop.set()
    assert not flush.serving(stop, holding=False)


def test_the_grace_ends_a_stage_that_never_empties():
    stop, flush = threading.Event(), Flush(Recorder(), "x", grace_s=0.05)
    stop.set()
    assert flush.serving(stop, holding=True)
    deadline = time.monotonic() + 30
    while flush.serving(stop, holding=True):
        assert time.monotonic() < deadline, "Flush kept a stage serving past its grace"
        time.sleep(0.01)
    assert flush.state == "draining"
