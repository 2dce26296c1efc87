"""`sd_notify`: one state line to the service manager (systemd, or `nanovllm serve`).

Used by the three stages (through `nanovllm.service.notify`) and by the HTTP front, so it lives
here, torch-free, in the client distribution the front is part of.
"""
# [ZH-START]
# 【模块定位】服务管理器通知协议（sd_notify）的唯一实现：三个 stage（经 nanovllm.service.notify
# 转出）和 HTTP 前端共用。放在 client 包里是因为 HTTP 前端属于 client 发行包、不能依赖服务端代码；
# 本模块不引入 torch。
# 【关键约束】MSG_DONTWAIT：管理器不读（队列满，默认 10 个数据报）时丢掉这一行而不阻塞发送方的循环。
# [ZH-END]
from __future__ import annotations

import logging
import os
import socket


def sd_notify(message: str) -> bool:
    """Send a state line ("READY=1", "STATUS=...", "WATCHDOG=1", "STOPPING=1") to the service
    manager named by $NOTIFY_SOCKET (systemd, or `nanovllm serve`); a no-op without one. True
    when the line was queued.

    The protocol is one datagram on a unix socket (an abstract one when the name starts with
    "@"), so no libsystemd is needed. It never waits: a manager that is not reading (its queue
    holds 10 datagrams by default) costs this one line, which the next status or watchdog ping
    replaces, instead of hanging the loop that sends it (a stage's work loop, the front's event
    loop).
    """
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):
        path = "\0" + path[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(path)
            sock.send(message.encode(), socket.MSG_DONTWAIT)
    except OSError as e:  # the manager went away, or its queue is full: nothing to wait for
        logging.getLogger("nanovllm.notify").debug("sd_notify(%r) failed: %s", message, e)
        return False
    return True
