"""`sd_notify`, the service-manager protocol the stages and the HTTP front speak (to systemd or
`nanovllm serve`): one implementation, in the client package."""
from __future__ import annotations

import os
import socket
import threading
import uuid

import nanovllm_client.sdnotify
from nanovllm.service.notify import sd_notify


def test_a_manager_that_does_not_read_never_blocks_the_stage(monkeypatch):
    """The datagram socket to the manager blocked once the manager's queue was full (10
    datagrams by default): a stage whose manager was busy elsewhere (`nanovllm serve` waiting on
    another stage while it stops them in order) hung in its own loop on a status line."""
    name = f"nanovllm-test/{os.getpid()}/{uuid.uuid4().hex}"
    manager = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    manager.bind("\0" + name)
    monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    try:
        sent: list[bool] = []
        sender = threading.Thread(target=lambda: sent.extend(sd_notify(f"STATUS=line {i}") for i in range(100)),
                                  daemon=True)
        sender.start()
        sender.join(timeout=10)
        assert not sender.is_alive(), "sd_notify blocked on a manager that does not read"
        assert sent[0] and not all(sent)  # the first lines queued, the rest were dropped
        assert manager.recv(4096) == b"STATUS=line 0"
    finally:
        manager.close()


def test_the_stages_and_the_http_front_send_with_the_one_implementation():
    from nanovllm_client.http import __main__ as front

    assert sd_notify is nanovllm_client.sdnotify.sd_notify is front.sd_notify


def test_a_socket_path_an_absent_manager_and_no_manager(monkeypatch, tmp_path):
    path = str(tmp_path / "notify")
    manager = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    manager.bind(path)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    try:
        assert sd_notify("READY=1\nSTATUS=serving")
        assert manager.recv(4096) == b"READY=1\nSTATUS=serving"
    finally:
        manager.close()
    os.unlink(path)
    assert sd_notify("WATCHDOG=1") is False  # the manager went away: dropped, no exception
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert sd_notify("WATCHDOG=1") is False
