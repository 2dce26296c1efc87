"""`nanovllm health`: is every stage of a service up, and is the engine ready?

One ping to the tokenizer, one ping and one stats request to the detokenizer (which follows the
engine's heartbeats), over the same sockets and keys a client uses. Healthy means: both answer,
neither is draining, and the engine is ready. Exit code 0 only then, so a probe (systemd,
a load balancer, a container runtime) can use it as is; the printout tells a person which stage
is loading, draining or dead, since when, and the engine's live requests and KV cache figures.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from . import protocol as p
from .checks import ProtocolError
from .endpoints import default_url, service_endpoints
from .security import CurveKeys, client_curve, client_socket_security, new_routing_id


@dataclass
class StageHealth:
    role: str
    state: str = "dead"
    """loading / ready / draining; "dead" when it did not answer (for the engine: the detokenizer
    knows it died); "unknown" for an engine the detokenizer has not heard from yet."""
    instance_id: str = ""
    uptime_s: float = 0.0


@dataclass
class HealthReport:
    url: str
    stages: dict[str, StageHealth] = field(default_factory=dict)
    engine_stats: dict[str, Any] = field(default_factory=dict)

    @property
    def healthy(self) -> bool:
        return all(s.state == "ready" for s in self.stages.values())

    def lines(self) -> list[str]:
        out = [f"service {self.url}: {'healthy' if self.healthy else 'NOT healthy'}"]
        for s in self.stages.values():
            since = f"up {s.uptime_s:.0f}s" if s.state != "dead" else "no answer"
            out.append(f"  {s.role:<12} {s.state:<9} {s.instance_id or '-':<13} {since}")
        st = self.engine_stats
        if st.get("num_total_blocks"):
            used = 1 - st["num_free_blocks"] / st["num_total_blocks"]
            out.append(f"  engine: {st.get('num_live', 0)} live request(s) ({st.get('num_running', 0)} running, "
                       f"{st.get('num_waiting', 0)} waiting, {st.get('num_queued', 0)} queued); KV cache "
                       f"{used:.1%} used of {st['num_total_blocks']} blocks")
        return out


def check_health(url: str | None = None, timeout: float = 5.0, curve: tuple[CurveKeys, bytes] | None = None
                 ) -> HealthReport:
    url = url or default_url()
    endpoints = service_endpoints(url)
    curve = client_curve(url, curve)
    report = HealthReport(url, {role: StageHealth(role) for role in ("tokenizer", "detokenizer", "engine")})
    ctx = zmq.Context()
    try:
        tok, out = (_dealer(ctx, endpoint, curve) for endpoint in (endpoints.tokenizer, endpoints.stream))
        tok.send(p.Ping().encode())
        out.send(p.Ping().encode())
        out.send(p.StatsReq().encode())
        poller = zmq.Poller()
        poller.register(tok, zmq.POLLIN)
        poller.register(out, zmq.POLLIN)
        deadline, waiting = time.monotonic() + timeout, {"tokenizer", "detokenizer", "stats"}
        while waiting and time.monotonic() < deadline:
            for sock in dict(poller.poll(max(1, int((deadline - time.monotonic()) * 1000)))):
                waiting.discard(_read(sock.recv(), report))
    finally:
        ctx.destroy(linger=0)
    return report


def _dealer(ctx: zmq.Context, endpoint: str, curve: tuple[CurveKeys, bytes] | None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, new_routing_id(curve))
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_FRAME_BYTES)
    if curve is not None:
        client_socket_security(sock, *curve)
    sock.connect(endpoint)
    return sock


def _read(frame: bytes, report: HealthReport) -> str:
    """Fill in what one reply says; returns which question it answered."""
    try:
        msg = p.decode(frame)
    except ProtocolError:
        return ""
    if isinstance(msg, p.Pong):
        report.stages[msg.role] = StageHealth(msg.role, msg.state, msg.instance_id, msg.uptime_s)
        return msg.role
    if isinstance(msg, p.StatsOutput):
        stats = msg.stats
        engine_state = stats.get("engine_state") or "unknown"  # the detokenizer has not heard from it yet
        if stats.get("engine_alive") is False:
            engine_state = "dead"
        report.stages["engine"] = StageHealth("engine", engine_state, str(stats.get("engine_instance", "")),
                                              float(stats.get("engine_uptime_s", 0.0)))
        report.engine_stats = stats.get("engine", {})
        return "stats"
    return ""


def health_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nanovllm health", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=default_url(), help="service address (default: $NANOVLLM_URL or %(default)s)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answers")
    args = parser.parse_args(argv)
    report = check_health(args.url, args.timeout)
    print("\n".join(report.lines()))
    return 0 if report.healthy else 1
