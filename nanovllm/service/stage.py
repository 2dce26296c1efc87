"""Plumbing the three service stages share: flags with NANOVLLM_* environment defaults, socket
setup (bounded queues and frame sizes, ROUTER_MANDATORY), signal handling, the counted log of
rejected frames, and the service manager's readiness protocol (`sd_notify`). Server code, so it
lives with the service, not in the client package; each stage package holds only its own job.
Imports nothing heavy (no torch: a stage's --help stays fast).
"""
from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import logging
import os
import signal
import threading
import uuid

import zmq
from zmq.utils.monitor import recv_monitor_message  # at import: poll() runs on stage threads

from nanovllm_client.endpoints import Endpoints, default_url, ensure_private_dir, ipc_dir, service_endpoints
from nanovllm_client.protocol import MAX_FRAME_BYTES
from nanovllm_client.security import ensure_instance_key, exposure
from nanovllm_client.throttle import ThrottledWarnings

from .notify import sd_notify
from .security import ServiceSecurity

DEFAULT_HWM = 10_000
"""Messages queued per peer before senders see backpressure (EAGAIN / a blocking send)."""
REQUEST_PIPE_HWM = 64
"""The same for the sockets that carry requests (client -> tokenizer, per client; tokenizer ->
engine, at both ends). zmq counts messages, not bytes, and a request frame may be up to 16 MiB:
whatever waits in these pipes is outside the engine's byte budgets, so they hold few."""


def env_name(flag: str) -> str:
    return "NANOVLLM_" + flag.lstrip("-").replace("-", "_").upper()


def add_flag(parser: argparse.ArgumentParser, flag: str, help: str, default=None, type=str, **kwargs) -> None:
    """A flag whose default comes from NANOVLLM_<FLAG> when that variable is set."""
    env = env_name(flag)
    value = os.environ.get(env)
    if value is not None:
        if type is bool:
            default = value.lower() in ("1", "true", "yes", "on")
        else:
            default = type(value)
    if type is bool:
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=bool(default),
                            help=f"{help} (env {env})", **kwargs)
    else:
        parser.add_argument(flag, type=type, default=default, help=f"{help} (env {env}; default %(default)s)", **kwargs)


def add_security_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--curve-secret-key", "the service's CURVE secret key file (made by `nanovllm keygen`): "
             "encrypt and authenticate every socket")
    add_flag(parser, "--curve-clients", "directory of client public keys (*.key) allowed to connect")
    add_flag(parser, "--insecure-tcp", "run tcp without CURVE: every local user can then reach every socket on "
             "loopback, every host that reaches it elsewhere (without it and without keys, a loopback service uses "
             "an instance key made in its runtime directory, and a non-loopback bind is refused)", default=False,
             type=bool)


def add_endpoint_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--url", "service address from which all endpoints are derived: ipc://DIR or tcp://HOST:PORT",
             default=default_url())
    for name, what in (("tokenizer", "tokenizer ROUTER (client requests)"), ("stream", "detokenizer ROUTER (client outputs)"),
                       ("engine", "engine PULL (tokenized requests)"), ("detok", "detokenizer PULL (engine steps)"),
                       ("control", "engine PULL (aborts, detokenizer hellos)")):
        add_flag(parser, f"--{name}-endpoint", f"override the {what} endpoint")
    add_flag(parser, "--log-level", "logging level", default="INFO")
    add_security_flags(parser)
    add_metrics_flags(parser)


def add_metrics_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--metrics-port", "serve Prometheus metrics over HTTP on this port (0: off)", default=0, type=int)
    add_flag(parser, "--metrics-host", "address the metrics endpoint binds (loopback unless you say otherwise)",
             default="127.0.0.1")


def resolve_endpoints(args: argparse.Namespace) -> Endpoints:
    derived = service_endpoints(args.url)
    return Endpoints(*(getattr(args, f"{f.name}_endpoint") or getattr(derived, f.name)
                       for f in dataclasses.fields(Endpoints)))


def setup_logging(level: str, role: str) -> logging.Logger:
    """Log lines naming the stage and its pid; and on a fatal signal (SIGABRT from a watchdog, a
    crash in native code) the Python stack of every thread, so a hang can be read afterwards."""
    faulthandler.enable()
    logging.basicConfig(level=level.upper(), format=f"%(asctime)s {role}[%(process)d] %(levelname)s %(message)s")
    return logging.getLogger(role)


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit, and return it. zmq aborts
    the process when it finds no free descriptor for a new connection, and the usual soft limit
    (1,024) is far below what the hard limit allows."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # an infinite hard limit some kernels refuse as a soft one
            pass
    return soft


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def stop_event() -> threading.Event:
    """An event set by SIGINT/SIGTERM; nothing else happens in the handler (the loop does the
    cleanup). Call it from the main thread, before other threads start.

    Python runs a signal's handler only in the main thread, between bytecodes, and a handler
    must not log (the logging locks may be held by the code it interrupted). A thread of its
    own, woken by the byte the signal writes to the wakeup pipe, logs which signal came the
    moment it arrives and sets the event as well; the stage acts on it when its loop next looks,
    and a stop that hangs shows in the log as a signal received with no stop after it."""
    # [ZH-START]
    # 1. 建一个 Event；SIGINT / SIGTERM 的 Python 处理函数只做 stop.set()，不记日志：
    #    它打断的代码可能正持有 logging 的锁。
    # 2. 另建一条管道作 wakeup fd，写端设为非阻塞（信号处理绝不能因管道满而卡住）：
    #    信号到达时 C 层就往里写一个字节（信号编号），不必等主线程执行到下一条字节码。
    # 3. 守护线程阻塞读这条管道：读到 SIGINT / SIGTERM 就记一行日志并 stop.set()；
    #    两条路径谁先到都行，set 是幂等的。
    #    stage 在主循环下一次检查时才真正停下；卡住的停止在日志里表现为"收到信号，之后没有停止"。
    # [ZH-END]
    stop = threading.Event()
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # the signal handler must never block on a full pipe
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

    def watch() -> None:
        while True:
            received = [n for n in os.read(read_fd, 64) if n in STOP_SIGNALS]
            if received:
                logging.getLogger("nanovllm.signals").info("%s received: stopping", signal.Signals(received[0]).name)
                stop.set()

    threading.Thread(target=watch, name="stop-signals", daemon=True).start()
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda *_: stop.set())
    return stop


def new_instance_id() -> str:
    return uuid.uuid4().hex[:12]


def bind(sock: zmq.Socket, endpoint: str) -> None:
    """Bind, an ipc:// endpoint only inside this user's private directory (made if missing)."""
    directory = ipc_dir(endpoint)
    if directory:
        ensure_private_dir(directory)
    sock.bind(endpoint)


def stage_security(ctx: zmq.Context, args: argparse.Namespace) -> ServiceSecurity:
    """A stage's CURVE setup from its flags: keys (or none) and the loopback rule for tcp binds.
    A service on loopback tcp given no keys uses its instance key (made by whichever stage comes
    first): loopback keeps other hosts out but lets every local user in, stage sockets included."""
    return ServiceSecurity.from_files(ctx, service_secret_key(args.url, resolve_endpoints(args), args.curve_secret_key,
                                                              args.insecure_tcp),
                                      args.curve_clients, args.insecure_tcp)


def service_secret_key(url: str, endpoints: Endpoints, secret_key_file: str | None, insecure_tcp: bool,
                       runtime_dir: str | None = None) -> str | None:
    """The secret key file a service at `url` runs with: the one it was given; else, where every
    tcp endpoint is on loopback and not `insecure_tcp`, its instance key (made if missing); else
    none (an ipc service; a non-loopback bind, which `check_bind` refuses without keys or
    `insecure_tcp`)."""
    tcp = [e for e in dataclasses.astuple(endpoints) if e.startswith("tcp://")]
    if secret_key_file or insecure_tcp or not tcp or any(exposure(e) for e in tcp):
        return secret_key_file
    return ensure_instance_key(url, runtime_dir)


def recv_from_client(sock: zmq.Socket, keyed: bool) -> tuple[bytes, list[bytes], str | None]:
    """One message from a client-facing ROUTER (NOBLOCK; zmq.Again if none): the sender's routing
    id, its frames, and under CURVE (`keyed`) the key ZAP authenticated it with (User-Id)."""
    if not keyed:
        parts = sock.recv_multipart(zmq.NOBLOCK)
        return parts[0], parts[1:], None
    parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
    return parts[0].bytes, [f.bytes for f in parts[1:]], parts[-1].get("User-Id")


def client_router(ctx: zmq.Context, endpoint: str, hwm: int = DEFAULT_HWM,
                  security: ServiceSecurity | None = None, rcv_hwm: int | None = None) -> zmq.Socket:
    """A client-facing ROUTER: sends to a vanished or slow peer fail loudly, never silently.
    With `security`, only allowed clients' keys get through (and the bind must be allowed).
    `rcv_hwm` (default `hwm`): frames held per client that the stage has not read yet."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # EHOSTUNREACH / EAGAIN instead of a silent drop
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm if rcv_hwm is None else rcv_hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    sock.setsockopt(zmq.LINGER, 0)
    if security is not None:
        security.check_bind(endpoint)
        security.server(sock)
    bind(sock, endpoint)
    return sock


def pipeline_push(ctx: zmq.Context, endpoint: str, hwm: int = DEFAULT_HWM, immediate: bool = True,
                  security: ServiceSecurity | None = None, connect: bool = True) -> zmq.Socket:
    """A PUSH to the next stage. `immediate`: nothing queues for a peer that is not there (the
    send fails instead). Options must be set before connect: libzmq asserts on a change after.
    `connect=False`: the caller connects (after attaching a `PeerMonitor`)."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.IMMEDIATE, int(immediate))
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.LINGER, 1000)
    if security is not None:
        security.client(sock)  # stage to stage: the service's own key pair
    if connect:
        sock.connect(endpoint)
    return sock


def pipeline_pull(ctx: zmq.Context, endpoint: str, hwm: int = DEFAULT_HWM,
                  security: ServiceSecurity | None = None, listen: bool = True) -> zmq.Socket:
    """A PULL from the previous stage; over tcp anyone may connect, so frames are size-limited
    too. With `security`, only the service's own key gets through (not even allowed clients).
    `listen=False`: the caller binds (`bind`, after attaching a `PeerMonitor`)."""
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    sock.setsockopt(zmq.LINGER, 0)
    if security is not None:
        security.check_bind(endpoint)
        security.pipeline_server(sock)
    if listen:
        bind(sock, endpoint)
    return sock


_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class PeerMonitor:
    """Counts the peers of a socket that completed the zmq handshake (e.g. is an engine there at
    all?). A connection that closes before its handshake ends (a port scan, a client gone at
    once, a wrong key) also reports a disconnect: libzmq reports its handshake failure just
    before, and that disconnect is not taken off the count (it once made a detokenizer declare
    its live engine dead).

    Attach it before the socket connects or binds: a handshake that completes before the monitor
    exists is never reported, and the peer never counted (a tokenizer once took its live engine
    for absent and refused held requests as "engine is not available")."""

    def __init__(self, sock: zmq.Socket):
        # A unique address: pyzmq's default is derived from the fd, which a later socket may reuse.
        self.socket = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED,
                                              addr=f"inproc://monitor-{uuid.uuid4().hex}")
        self.num_peers = 0
        self._failed = 0
        """Handshake failures whose disconnect has not come yet."""

    def poll(self) -> None:
        while self.socket.poll(0):
            event = recv_monitor_message(self.socket)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.num_peers += 1
            elif event & _HANDSHAKE_FAILED:
                self._failed += 1
            elif event == zmq.EVENT_DISCONNECTED:
                if self._failed:
                    self._failed -= 1
                else:
                    self.num_peers = max(0, self.num_peers - 1)

    @property
    def connected(self) -> bool:
        self.poll()
        return self.num_peers > 0


class RejectLog:
    """Counts frames a stage could not handle, by reason, and logs them without flooding.

    The first frame of each reason is logged at once; after that at most one line per
    `interval_s` per reason, saying how many were suppressed. `reason` must come from a small
    fixed set (never from the frame itself), since it keys the counts.
    """

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0, on_reject=None):
        self.on_reject = on_reject
        """Called with the reason of every rejected frame (the stage's metrics)."""
        self.counts: dict[str, int] = {}
        self._warnings = ThrottledWarnings(logger, interval_s)

    def __call__(self, reason: str, detail: str, *, exc_info: bool = False) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        if self.on_reject is not None:
            self.on_reject(reason)
        self._warnings.warn(reason, "rejected a frame (%s): %s", reason, detail, exc_info=exc_info)


def startup_failed(logger: logging.Logger, role: str, error: BaseException) -> int:
    """A stage that cannot start (bad model path, bad config) says why in one line and exits 1;
    `nanovllm serve` then stops instead of restarting it forever."""
    logger.error("the %s stage cannot start: %s", role, error)
    sd_notify(f"STATUS=cannot start: {error}"[:1000])
    return 1


def stage_setup(parser: argparse.ArgumentParser, argv: list[str] | None,
                role: str) -> tuple[argparse.Namespace, logging.Logger, Endpoints, threading.Event]:
    """The start every stage's `__main__` shares: its endpoint and security flags added and every
    flag parsed, logging as `role`, the open-files limit raised, the endpoints resolved, and the
    stop signals caught."""
    add_endpoint_flags(parser)
    args = parser.parse_args(argv)
    log = setup_logging(args.log_level, role)
    raise_open_files_limit()
    return args, log, resolve_endpoints(args), stop_event()


def build_stage(log: logging.Logger, role: str, args: argparse.Namespace, metrics_cls, make):
    """`make(ctx, security, metrics)` with the stage's zmq context, CURVE settings and metrics
    (served on `--metrics-port` if set): the stage; one that cannot start (no such model, a bad
    setting, an address in use) exits 1 once `startup_failed` said why."""
    from nanovllm.metrics import stage_metrics  # prometheus_client: only once the stage is built
    try:
        ctx = zmq.Context.instance()
        metrics, _ = stage_metrics(metrics_cls, args.metrics_host, args.metrics_port)
        return make(ctx, stage_security(ctx, args), metrics)
    except (OSError, ValueError, zmq.ZMQError) as e:
        raise SystemExit(startup_failed(log, role, e)) from None
