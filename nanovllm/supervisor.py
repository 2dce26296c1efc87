"""`nanovllm serve`: start the three service stages and keep them running.

Starts `python -m tokenizer_proc`, `engine_proc` and `detok_proc` on one service URL (by default
ipc:// sockets in a private runtime directory), restarts a stage that exits (with backoff; the
others keep running and the restarted one rejoins), and on SIGINT/SIGTERM stops all three in the
order that loses nothing: the tokenizer, the engine (which drains), the detokenizer. Flags it does
not know go to the engine stage (e.g. `--max-num-seqs 64`). The current stage pids are written to `<runtime dir>/stages.json`.

Each stage tells the supervisor when it serves the way it tells systemd: a `READY=1` datagram
on its own $NOTIFY_SOCKET. A stage that exits before it was ever ready (a bad model path, a bad
flag) is not restarted: the supervisor stops the others and exits 1, the stage's own error
being the last thing it printed.

With `--http-port`, a fourth process serves the OpenAI-compatible HTTP API (`nanovllm-http`,
a client of the service like any other): it starts with the stages, is stopped first (it drains
its streams while the stages still serve) and is watched and restarted like them. Where the
service runs CURVE (its keys, or a loopback tcp service's instance key) the front connects with
the service's own key pair, as the supervisor does (`service_pair_env`, which the front also
applies itself to $NANOVLLM_CURVE_SECRET_KEY under its systemd unit).

The watchdog is systemd's too: each stage gets $WATCHDOG_USEC and sends `WATCHDOG=1` from the
loop that does its work. A ready stage silent for `--watchdog-s` (a deadlock, a hung step, a
SIGSTOP) gets SIGABRT (its Python stack goes to its log: the stages enable faulthandler), then
SIGKILL if it outlives `WATCHDOG_KILL_S`, and is restarted like a stage that died.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

# At import, not in _announce_ready: that runs on a thread of its own, and no thread imports a
# library while another may be importing it (nanovllm.models.tokenizer says why).
from nanovllm_client import Client, NanovllmError
from nanovllm_client.security import load_keypair, service_pair_env
from nanovllm_client.throttle import ThrottledWarnings

STAGES = ("tokenizer_proc", "engine_proc", "detok_proc")


def shared_with_tokenizer(engine_args: list[str]) -> list[str]:
    """The engine flags the tokenizer stage takes too: `--max-model-len`, so it refuses a prompt the
    engine would refuse, in the engine's words, before spending the engine's queue on it."""
    out = []
    for i, arg in enumerate(engine_args):
        if arg.startswith("--max-model-len="):
            out.append(arg)
        elif arg == "--max-model-len" and i + 1 < len(engine_args):
            out += [arg, engine_args[i + 1]]
    return out
HTTP = "http"
"""The HTTP front's name among the supervised processes (with `--http-port`)."""
DEFAULT_WATCHDOG_S = 60.0
"""As the engine's unit (`WatchdogSec=60`): one step may be a long prefill on a small CPU."""
WATCHDOG_KILL_S = 5.0
"""How long a stage killed by the watchdog has to dump its stack and exit before SIGKILL."""
log = logging.getLogger("nanovllm.supervisor")


@dataclass
class StageProcess:
    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restart_at: float | None = None
    backoff_s: float = 1.0
    restarts: int = 0
    notify: socket.socket | None = None
    """Where the stage's READY=1 / STATUS= datagrams arrive (an abstract unix socket)."""
    notify_name: str = ""
    ready: bool = False
    """This run of the stage said READY=1."""
    served: bool = False
    """Some run of the stage said READY=1: after a crash it is worth restarting."""
    last_alive: float = 0.0
    """When this run last said READY=1 or WATCHDOG=1."""
    aborted_at: float | None = None
    """When the watchdog sent this run SIGABRT."""
    env: dict[str, str] = field(default_factory=dict)
    """Its own environment, over the one every process gets."""


def _die_with_parent() -> None:
    """Children get SIGTERM if the supervisor itself is killed (Linux), so none are orphaned."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class Supervisor:
    def __init__(self, url: str, model: str, runtime_dir: str, engine_args: list[str], log_level: str,
                 max_backoff_s: float = 30.0, drain_timeout_s: float = 30.0, metrics_port: int = 0,
                 stage_env: dict[str, str] | None = None, watchdog_s: float = DEFAULT_WATCHDOG_S,
                 http_args: list[str] | None = None, http_env: dict[str, str] | None = None):
        self.url, self.model, self.runtime_dir = url, model, runtime_dir
        self.watchdog_s = watchdog_s
        """A ready stage silent this long is killed and restarted; 0: no watchdog."""
        self.max_backoff_s = max_backoff_s
        self.drain_timeout_s = drain_timeout_s
        self.env = dict(os.environ, NANOVLLM_URL=url, NANOVLLM_MODEL=model, NANOVLLM_LOG_LEVEL=log_level,
                        NANOVLLM_DRAIN_TIMEOUT=str(drain_timeout_s), **(stage_env or {}))
        # Metrics: one port per stage from the base (tokenizer, engine, detokenizer), off by default.
        self.metrics_ports = {name: metrics_port + i if metrics_port else 0 for i, name in enumerate(STAGES)}
        stage_args = {"engine_proc": engine_args, "tokenizer_proc": shared_with_tokenizer(engine_args)}
        self.stages = {name: StageProcess(name, [sys.executable, "-m", name] + stage_args.get(name, []))
                       for name in STAGES}
        if http_args is not None:  # the HTTP front: a client of the service, started and watched like a stage
            self.stages[HTTP] = StageProcess(HTTP, [sys.executable, "-m", "nanovllm_client.http", *http_args],
                                             env=dict(http_env or {}))
        for stage in self.stages.values():
            stage.notify_name = f"@nanovllm-serve/{os.getpid()}/{stage.name}"
            stage.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
            # An abstract name has no permissions: any local user can send to it. The kernel's
            # word on each sender's pid (SO_PASSCRED) tells the stage's datagrams from forged ones.
            stage.notify.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            stage.notify.bind("\0" + stage.notify_name[1:])
        self._forged = ThrottledWarnings(log)
        self.failed: str | None = None
        """Why the service could not start, once a stage failed before it was ever ready."""

    def start(self, stage: StageProcess) -> None:
        env = dict(self.env, **stage.env, NOTIFY_SOCKET=stage.notify_name, NANOVLLM_METRICS_PORT=str(self.metrics_ports.get(stage.name, 0)))
        if self.watchdog_s:
            env["WATCHDOG_USEC"] = str(int(self.watchdog_s * 1e6))
        # Its own session: a terminal's Ctrl-C (SIGINT to the whole foreground group) reaches only
        # the supervisor, which stops the stages in the order that loses nothing (`stop`).
        stage.proc = subprocess.Popen(stage.argv, env=env, preexec_fn=_die_with_parent, start_new_session=True)
        stage.started_at, stage.restart_at, stage.ready, stage.aborted_at = time.monotonic(), None, False, None
        log.info("started %s (pid %d)", stage.name, stage.proc.pid)
        self.write_state()

    def write_state(self) -> None:
        state = {name: s.proc.pid if s.proc and s.proc.poll() is None else None for name, s in self.stages.items()}
        state["url"] = self.url
        # A fresh private name (O_EXCL, never a link someone planted), renamed over the old file:
        # rename replaces a link at the target, it never writes through one.
        fd, tmp = tempfile.mkstemp(prefix=".stages.", suffix=".json", dir=self.runtime_dir)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(state, f)
            os.replace(tmp, os.path.join(self.runtime_dir, "stages.json"))
        except BaseException:
            os.unlink(tmp)
            raise

    def read_notifications(self) -> None:
        for stage in self.stages.values():
            while True:
                try:
                    datagram, sender = _recv_with_sender(stage.notify)
                except BlockingIOError:
                    break
                if stage.proc is None or sender != stage.proc.pid:
                    self._forged.warn(stage.name, "ignored a notification for %s from pid %s, not the stage's",
                                      stage.name, sender)
                    continue
                for line in datagram.decode(errors="replace").splitlines():
                    if line in ("READY=1", "WATCHDOG=1"):
                        stage.last_alive = time.monotonic()
                    if line == "READY=1" and not stage.ready:
                        stage.ready = stage.served = True
                        log.info("%s is ready", stage.name)
                    elif line.startswith("STATUS="):
                        log.debug("%s: %s", stage.name, line[len("STATUS="):])

    def check(self, now: float) -> None:
        """Restart stages that exited, with exponential backoff (reset after a minute of uptime);
        a stage that never became ready ends the service instead (`failed`)."""
        self.read_notifications()
        for stage in self.stages.values():
            if stage.proc is None:
                continue
            if stage.proc.poll() is None:
                self._watch(stage, now)
                continue
            if not stage.served:
                self.failed = (f"{stage.name} exited with code {stage.proc.returncode} before it was ready "
                               "(its error is above); not restarting it")
                return
            if stage.restart_at is None:
                if now - stage.started_at > 60:
                    stage.backoff_s = 1.0
                log.warning("%s exited with %s; restarting in %.0fs", stage.name, stage.proc.returncode, stage.backoff_s)
                stage.restart_at = now + stage.backoff_s
                stage.backoff_s = min(self.max_backoff_s, stage.backoff_s * 2)
                self.write_state()
            elif now >= stage.restart_at:
                stage.restarts += 1
                self.start(stage)

    def _watch(self, stage: StageProcess, now: float) -> None:
        """Kill a ready stage that stopped sending watchdog pings: SIGABRT (and SIGCONT, so a
        stopped one gets it), then SIGKILL after `WATCHDOG_KILL_S`; `check` then restarts it."""
        if not self.watchdog_s or not stage.ready:
            return
        if stage.aborted_at is None and now - stage.last_alive > self.watchdog_s:
            log.error("%s (pid %d) sent no watchdog ping for %.0fs: it hangs; aborting it (its stack goes to its log) "
                      "and restarting it", stage.name, stage.proc.pid, now - stage.last_alive)
            stage.aborted_at = now
            stage.proc.send_signal(signal.SIGABRT)
            stage.proc.send_signal(signal.SIGCONT)
        elif stage.aborted_at is not None and now - stage.aborted_at > WATCHDOG_KILL_S:
            log.error("%s (pid %d) outlived SIGABRT by %.0fs; killing it", stage.name, stage.proc.pid, WATCHDOG_KILL_S)
            stage.proc.kill()
            stage.aborted_at = float("inf")  # killed: wait for it to be reaped

    def stop(self) -> None:
        """Stop the stages in the order that loses nothing: the HTTP front first (it drains its
        streams while the stages serve), the tokenizer (no new requests),
        then the engine (it drains: requests in flight finish, for up to its drain timeout), then
        the detokenizer (it streamed the last tokens). SIGKILL for any that outstays its time."""
        for name, grace_s in ((HTTP, self.drain_timeout_s + 10.0), ("tokenizer_proc", 5.0), ("engine_proc", self.drain_timeout_s + 10.0), ("detok_proc", 5.0)):
            proc = self.stages[name].proc if name in self.stages else None
            if proc is None or proc.poll() is not None:
                continue
            log.info("stopping %s (pid %d)", name, proc.pid)
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while proc.poll() is None and time.monotonic() < deadline:
                self.read_notifications()  # the stages still running keep sending; their queues stay short
                time.sleep(0.1)
            if proc.poll() is None:
                log.warning("%s (pid %d) did not stop within %.0fs; killing it", name, proc.pid, grace_s)
                proc.kill()
                proc.wait(timeout=5)
        self.write_state()

    def run(self, stop: threading.Event) -> int:
        for stage in self.stages.values():
            self.start(stage)
        threading.Thread(target=self._announce_ready, args=(stop,), daemon=True).start()
        while not stop.wait(0.2) and self.failed is None:
            self.check(time.monotonic())
        log.info("shutting down")
        self.stop()
        for stage in self.stages.values():
            stage.notify.close()
        if self.failed is not None:
            print(f"nanovllm serve: {self.failed}", file=sys.stderr)
            return 1
        return 0

    def _announce_ready(self, stop: threading.Event) -> None:
        try:
            # With CURVE the service's own key pair is let in everywhere: the supervisor uses it.
            secret = self.env.get("NANOVLLM_CURVE_SECRET_KEY")
            curve = None
            if secret:
                keys = load_keypair(secret)
                curve = (keys, keys.public)
            with Client(self.url, connect_timeout=600, curve=curve) as client:
                client.wait_engine(timeout=600)
            if not stop.is_set() and self.failed is None:
                log.info("service ready at %s  (try: nanovllm-client --url %s \"Hello\")", self.url, self.url)
        except NanovllmError as e:
            log.warning("service not ready: %s", e)


_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _recv_with_sender(sock: socket.socket) -> tuple[bytes, int | None]:
    """One datagram and the pid the kernel says sent it (None if it did not say)."""
    datagram, ancillary, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(_UCRED.size))
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= _UCRED.size:
            return datagram, _UCRED.unpack_from(data)[0]
    return datagram, None


def build_parser() -> argparse.ArgumentParser:
    from nanovllm_client.endpoints import default_runtime_dir

    parser = argparse.ArgumentParser(prog="nanovllm serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=os.environ.get("NANOVLLM_MODEL", "default"),
                        help="'default', an HF folder or a .gguf file (env NANOVLLM_MODEL; default %(default)s)")
    parser.add_argument("--runtime-dir", default=default_runtime_dir(),
                        help="where the ipc sockets, stages.json and a tcp service's instance key live (env "
                             "NANOVLLM_RUNTIME_DIR, which clients read too; default %(default)s)")
    parser.add_argument("--url", default=os.environ.get("NANOVLLM_URL"),
                        help="service address, ipc://DIR or tcp://127.0.0.1:PORT (env NANOVLLM_URL; "
                             "default ipc://<runtime dir>)")
    parser.add_argument("--log-level", default=os.environ.get("NANOVLLM_LOG_LEVEL", "INFO"))
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve Prometheus metrics: the tokenizer on this port, the engine on the next, the "
                             "detokenizer on the one after (0: off, the default)")
    parser.add_argument("--metrics-host", default="127.0.0.1", help="address the metrics endpoints bind")
    parser.add_argument("--curve-secret-key", default=os.environ.get("NANOVLLM_CURVE_SECRET_KEY"),
                        help="the service's CURVE secret key file: every stage requires CURVE on every socket")
    parser.add_argument("--curve-clients", default=os.environ.get("NANOVLLM_CURVE_CLIENTS"),
                        help="directory of allowed client public keys (*.key)")
    parser.add_argument("--insecure-tcp", action="store_true",
                        help="serve a tcp URL without CURVE: on loopback every local user can then reach every "
                             "socket, stage-to-stage ones included; elsewhere every host that reaches it. Without "
                             "it and without keys, a loopback service makes an instance key in its runtime directory "
                             "that only this user's clients (and root's) can read")
    parser.add_argument("--cache-salt-per-client", action="store_true",
                        default=os.environ.get("NANOVLLM_CACHE_SALT_PER_CLIENT", "0") == "1",
                        help="salt each client's prefix cache by its CURVE key (else its routing id): no client's "
                             "cached_tokens reveal another's prompts (env NANOVLLM_CACHE_SALT_PER_CLIENT=1)")
    parser.add_argument("--watchdog-s", type=float, default=float(os.environ.get("NANOVLLM_WATCHDOG_S", DEFAULT_WATCHDOG_S)),
                        help="restart a stage that sends no watchdog ping for this long once it serves (a hung "
                             "loop or step); 0: off (env NANOVLLM_WATCHDOG_S; default %(default)s)")
    parser.add_argument("--drain-timeout", type=float, default=float(os.environ.get("NANOVLLM_DRAIN_TIMEOUT", 30)),
                        help="on SIGTERM, seconds the engine lets requests in flight finish before it aborts them "
                             "(env NANOVLLM_DRAIN_TIMEOUT; default %(default)s)")
    parser.add_argument("--http-port", type=int, default=0,
                        help="also serve the OpenAI-compatible HTTP API on this port (nanovllm-http; needs the client's "
                             "http extra; 0: off, the default)")
    parser.add_argument("--http-host", default="127.0.0.1",
                        help="address the HTTP API binds (default %(default)s); not loopback: --http-api-key-file too")
    parser.add_argument("--http-api-key-file", default=os.environ.get("NANOVLLM_HTTP_API_KEY_FILE"),
                        help="API keys of the HTTP API, one per line (env NANOVLLM_HTTP_API_KEY_FILE)")
    return parser


def main(argv: list[str] | None = None) -> int:
    from nanovllm_client.endpoints import ensure_private_dir, service_endpoints
    from nanovllm.service.stage import service_secret_key, stop_event

    args, engine_args = build_parser().parse_known_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s supervisor %(levelname)s %(message)s")
    faulthandler.enable()  # like the stages: `kill -ABRT` on a hung supervisor prints every thread's stack
    url = args.url or f"ipc://{args.runtime_dir}"
    try:
        endpoints = service_endpoints(url)
    except ValueError as e:
        print(f"nanovllm serve: {e}", file=sys.stderr)
        return 2
    try:
        ensure_private_dir(args.runtime_dir)
        secret_key = service_secret_key(url, endpoints, args.curve_secret_key, args.insecure_tcp, args.runtime_dir)
    except (OSError, ValueError) as e:  # another user's directory, a symlink, a mode others can use; a bad key
        print(f"nanovllm serve: {e}", file=sys.stderr)
        return 2
    stop = stop_event()
    stage_env = {"NANOVLLM_METRICS_HOST": args.metrics_host, "NANOVLLM_INSECURE_TCP": "1" if args.insecure_tcp else "0",
                 "NANOVLLM_CACHE_SALT_PER_CLIENT": "1" if args.cache_salt_per_client else "0"}
    for name, value in (("NANOVLLM_CURVE_SECRET_KEY", secret_key), ("NANOVLLM_CURVE_CLIENTS", args.curve_clients)):
        if value:
            stage_env[name] = os.path.abspath(value)
    http_args, http_env = None, {}
    if args.http_port:
        http_args = ["--url", url, "--host", args.http_host, "--port", str(args.http_port), "--model", args.model,
                     "--drain-timeout", str(args.drain_timeout)]
        if args.http_api_key_file:
            http_args += ["--api-key-file", os.path.abspath(args.http_api_key_file)]
        if secret_key:  # as the supervisor does; set here too, so the caller's own client keys do not override it
            http_env = service_pair_env(secret_key)
    return Supervisor(url, args.model, args.runtime_dir, engine_args, args.log_level, drain_timeout_s=args.drain_timeout,
                      metrics_port=args.metrics_port, stage_env=stage_env, watchdog_s=args.watchdog_s,
                      http_args=http_args, http_env=http_env).run(stop)


if __name__ == "__main__":
    sys.exit(main())
