"""Prometheus metrics for the service: one metric set per stage, and the HTTP endpoint that serves it.

- `EngineMetrics` is an engine post-step hook (hooks.py) plus the engine stage's own gauges and
  counters: scheduler state, KV-cache use, prefix cache, tokens, queue time, step time.
- `DetokMetrics` holds the request-level latencies, which only the detokenizer can measure: it
  sees each request's arrival time (stamped by the tokenizer), every output and the final usage.
- `TokenizerMetrics` covers the front door: tokenize time, forwarded and refused requests.
- `serve_metrics` exposes one registry over HTTP on a daemon thread, on loopback unless told; it
  serves at most 16 connections at once and closes one idle for 5 s, so scrapers that never
  hang up cannot use up the stage's threads and file descriptors.

Each set lives on the `CollectorRegistry` it is given, never on prometheus_client's global one,
so several stages (or several tests) in one process do not collide. Names use vLLM's with the
`nanovllm:` prefix (counters gain `_total` in the exposition), so its dashboards translate.
"""
from __future__ import annotations

import ipaddress
import socket
import sys
import threading
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from nanovllm_client.protocol import FinishReason

if TYPE_CHECKING:
    from nanovllm.engine.hooks import StepMetrics

PREFIX = "nanovllm:"

TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 60.0)
"""Time to first token: 1 ms (a warm GPU) to a minute (a long prompt queued on a CPU)."""
ITL_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03,
               0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
"""Inter-token latency and step time: 0.1 ms to 10 s."""
REQUEST_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                        15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 3600.0)
"""Queue time and end-to-end latency: 1 ms to an hour."""
STAGE_TIME_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025,
                      0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
"""Tokenize / detokenize work per call: 10 us to 2.5 s."""
TOKEN_COUNT_BUCKETS = tuple(float(2 ** i) for i in range(17))
"""Token counts: 1, 2, 4, ... 65536."""

ENGINE_STATES = ("loading", "ready", "draining")
STAGES = ("tokenizer", "engine", "detokenizer")
MAX_REASONS = 32
"""Distinct `frames_rejected` reasons kept as labels; more are counted as "other" (each label
value is a time series, and reasons come from code, but a bug must not grow them forever)."""
MAX_TRACKED_REQUESTS = 65536
"""Requests `DetokMetrics` follows at once; past it the oldest is forgotten (not observed)."""


class _StageMetrics:
    """What every stage reports: frames in, frames refused, restarts of other stages it noticed."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self.frames_received = Counter(PREFIX + "frames_received", "Frames received on the stage's sockets.",
                                       registry=registry)
        self.frames_rejected = Counter(PREFIX + "frames_rejected", "Frames the stage refused, by reason.",
                                       ["reason"], registry=registry)
        self.stage_restarts = Counter(PREFIX + "stage_restarts", "Restarts of another stage that this stage noticed.",
                                      ["stage"], registry=registry)
        self._reasons: set[str] = set()

    def frame_received(self) -> None:
        self.frames_received.inc()

    def frame_rejected(self, reason: str) -> None:
        """`reason` is a short fixed word from the code (as for `RejectLog`), never frame content."""
        if reason not in self._reasons:
            if len(self._reasons) >= MAX_REASONS:
                reason = "other"
            self._reasons.add(reason)
        self.frames_rejected.labels(reason=reason).inc()

    def stage_restart_seen(self, stage: str) -> None:
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")
        self.stage_restarts.labels(stage=stage).inc()


class _ClientFacingMetrics(_StageMetrics):
    """A stage that clients connect to: it also counts them."""

    def __init__(self, registry: CollectorRegistry):
        super().__init__(registry)
        self.live_clients = Gauge(PREFIX + "live_clients", "Clients the stage currently knows.", registry=registry)

    def set_live_clients(self, n: int) -> None:
        self.live_clients.set(n)


class EngineMetrics(_StageMetrics):
    """The engine stage's metrics; register the instance itself as a post-step hook.

    The hook runs on the engine's thread after every step: a few gauge sets and counter
    increments plus one observation per newly scheduled request, no allocation per token.
    """

    def __init__(self, registry: CollectorRegistry):
        super().__init__(registry)
        r = registry
        self.num_requests_running = Gauge(PREFIX + "num_requests_running", "Requests in the running batch.", registry=r)
        self.num_requests_waiting = Gauge(PREFIX + "num_requests_waiting", "Requests waiting for admission.",
                                          registry=r)
        self.kv_cache_usage = Gauge(PREFIX + "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).",
                                    registry=r)
        self.prefix_cache_queries = Counter(PREFIX + "prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.", registry=r)
        self.prefix_cache_hits = Counter(PREFIX + "prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                                         registry=r)
        self.num_preemptions = Counter(PREFIX + "num_preemptions", "Preemptions of running requests.", registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prefill tokens computed (prefix-cache hits excluded).",
                                     registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens sampled.", registry=r)
        self.request_queue_time = Histogram(PREFIX + "request_queue_time_seconds",
                                            "Time from add_request to first scheduling.",
                                            buckets=REQUEST_TIME_BUCKETS, registry=r)
        self.step_time = Histogram(PREFIX + "step_time_seconds", "Duration of one engine step.",
                                   buckets=ITL_BUCKETS, registry=r)
        self.engine_state = Gauge(PREFIX + "engine_state", "1 for the engine's current state, 0 for the others.",
                                  ["state"], registry=r)
        self.num_requests_live = Gauge(PREFIX + "num_requests_live", "Requests the engine stage holds (admitted).",
                                       registry=r)
        self.num_requests_queued = Gauge(PREFIX + "num_requests_queued",
                                         "Requests received and waiting for the engine stage to admit them.",
                                         registry=r)
        self.request_bytes_live = Gauge(PREFIX + "request_bytes_live",
                                        "Bytes charged to the admitted requests (against --max-live-mib).", registry=r)
        self.request_bytes_queued = Gauge(PREFIX + "request_bytes_queued",
                                          "Bytes charged to the requests waiting for admission (against "
                                          "--max-queued-mib).", registry=r)
        self.spec_decode_num_drafts = Counter(PREFIX + "spec_decode_num_drafts",
                                              "Verifications of drafted tokens (speculative decoding).", registry=r)
        self.spec_decode_num_draft_tokens = Counter(PREFIX + "spec_decode_num_draft_tokens",
                                                    "Drafted tokens verified.", registry=r)
        self.spec_decode_num_accepted_tokens = Counter(PREFIX + "spec_decode_num_accepted_tokens",
                                                       "Drafted tokens accepted.", registry=r)
        self.spec_decode_num_accepted_tokens_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos", "Drafted tokens accepted, by position in the draft.",
            ["position"], registry=r)
        self._last_cumulative = (0, 0, 0, 0, 0, 0)
        self._last_per_position: tuple[int, ...] = ()
        self.set_state("loading")

    def __call__(self, m: StepMetrics) -> None:
        self.num_requests_running.set(m.num_running)
        self.num_requests_waiting.set(m.num_waiting)
        self.kv_cache_usage.set(m.kv_cache_usage)
        cumulative = (m.prefix_cache_queries, m.prefix_cache_hits, m.num_preemptions, m.spec_decode_num_drafts,
                      m.spec_decode_num_draft_tokens, m.spec_decode_num_accepted_tokens)
        counters = (self.prefix_cache_queries, self.prefix_cache_hits, self.num_preemptions,
                    self.spec_decode_num_drafts, self.spec_decode_num_draft_tokens, self.spec_decode_num_accepted_tokens)
        for counter, now, before in zip(counters, cumulative, self._last_cumulative):
            # Below the last value: a new engine reports to this hook, counting from zero again.
            counter.inc(now - before if now >= before else now)
        self._last_cumulative = cumulative
        if m.spec_decode_accepted_per_position != self._last_per_position:
            before = self._last_per_position
            for i, now in enumerate(m.spec_decode_accepted_per_position):
                last = before[i] if i < len(before) else 0
                self.spec_decode_num_accepted_tokens_per_pos.labels(position=str(i)).inc(
                    now - last if now >= last else now)
            self._last_per_position = m.spec_decode_accepted_per_position
        self.prompt_tokens.inc(m.num_prefill_tokens)
        self.generation_tokens.inc(m.num_generated_tokens)
        for seconds in m.queue_times_s:
            self.request_queue_time.observe(seconds)
        self.step_time.observe(m.step_time_s)

    def set_state(self, state: str) -> None:
        """One of "loading", "ready", "draining"."""
        if state not in ENGINE_STATES:
            raise ValueError(f"unknown engine state {state!r}; expected one of {ENGINE_STATES}")
        for s in ENGINE_STATES:
            self.engine_state.labels(state=s).set(1 if s == state else 0)

    def set_live(self, n: int, nbytes: int) -> None:
        self.num_requests_live.set(n)
        self.request_bytes_live.set(nbytes)

    def set_queued(self, n: int, nbytes: int) -> None:
        self.num_requests_queued.set(n)
        self.request_bytes_queued.set(nbytes)


@dataclass(slots=True)
class _RequestTimes:
    arrival: float
    first_token: float | None = None
    """When its first token went out; None also for a request resumed after it."""
    last_token: float | None = None
    """When its latest tokens went out (or it was resumed); None before its first token."""


class DetokMetrics(_ClientFacingMetrics):
    """Request-level latencies, measured where outputs leave the service. One thread only.

    Times are wall-clock seconds (`time.time()`): arrival is stamped by the tokenizer process.
    Semantics follow vLLM V1 (vllm/v1/metrics/stats.py `IterationStats.update_from_output`,
    vllm/v1/metrics/loggers.py `PrometheusStatLogger`):
    - time to first token: from arrival to the first call that carries tokens;
    - inter-token latency: one observation per later call that carries tokens (one engine step's
      output for the request), the time since the previous such call, whatever the number of
      tokens in it (as vLLM observes one value per engine output, not one per token);
    - time per output token: per finished request, (last token time - first token time) divided
      by (generation tokens - 1), as vLLM's `request_time_per_output_token_seconds`;
    - `request_success`, labelled by `finished_reason`, counts every request that finishes through
      `request_finished`, whatever its reason (stop, length, abort, error), as vLLM counts every
      request whose engine output carries a finish reason. `request_dropped` (the client is gone)
      counts nothing, as a request vLLM's frontend aborts itself is not counted.
    """

    def __init__(self, registry: CollectorRegistry, max_tracked_requests: int = MAX_TRACKED_REQUESTS):
        super().__init__(registry)
        r = registry
        self.time_to_first_token = Histogram(PREFIX + "time_to_first_token_seconds",
                                             "Time from arrival to the first output token.",
                                             buckets=TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(PREFIX + "inter_token_latency_seconds",
                                             "Time between consecutive outputs of a request.",
                                             buckets=ITL_BUCKETS, registry=r)
        self.time_per_output_token = Histogram(PREFIX + "request_time_per_output_token_seconds",
                                               "Per request: mean time per output token after the first.",
                                               buckets=ITL_BUCKETS, registry=r)
        self.e2e_latency = Histogram(PREFIX + "e2e_request_latency_seconds", "Time from arrival to the last output.",
                                     buckets=REQUEST_TIME_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram(PREFIX + "request_prompt_tokens", "Prompt tokens per finished request.",
                                               buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram(PREFIX + "request_generation_tokens",
                                                   "Generated tokens per finished request.",
                                                   buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self.request_success = Counter(PREFIX + "request_success", "Finished requests, by finish reason.",
                                       ["finished_reason"], registry=r)
        for reason in FinishReason:  # every series exists from the start, as in vLLM
            self.request_success.labels(finished_reason=reason.value)
        self.detokenize_latency = Histogram(PREFIX + "detokenize_latency_seconds",
                                            "Detokenizer work per engine step.", buckets=STAGE_TIME_BUCKETS, registry=r)
        self.output_bytes_held = Gauge(PREFIX + "client_output_bytes_held",
                                       "Output held for clients that are not reading (their socket pipe is full).",
                                       registry=r)
        self.max_tracked_requests = max_tracked_requests
        self._requests: dict[str, _RequestTimes] = {}

    @property
    def num_tracked_requests(self) -> int:
        return len(self._requests)

    def request_started(self, request_id: str, arrival_time: float, *, resumed_at: float | None = None) -> None:
        """Follow a request from `arrival_time` on. For one rebuilt after a detokenizer restart, pass
        `resumed_at` (now): its first token was already seen, so no time to first token is
        observed and the next inter-token gap counts from then."""
        self._requests.pop(request_id, None)
        if len(self._requests) >= self.max_tracked_requests:
            del self._requests[next(iter(self._requests))]
        self._requests[request_id] = _RequestTimes(arrival_time, last_token=resumed_at)

    def tokens_streamed(self, request_id: str, n_tokens: int, now: float) -> None:
        """`n_tokens` new tokens of `request_id` went out at `now`; calls without tokens are ignored."""
        times = self._requests.get(request_id)
        if times is None or n_tokens <= 0:
            return
        if times.last_token is None:
            self.time_to_first_token.observe(max(0.0, now - times.arrival))
            times.first_token = now
        else:
            self.inter_token_latency.observe(max(0.0, now - times.last_token))
        times.last_token = now

    def request_finished(self, request_id: str, reason: FinishReason, prompt_tokens: int, generation_tokens: int,
                         now: float) -> None:
        """The request's terminal output went out; frees its state. Token counts come from the
        final usage; latencies are observed only for a request seen from `request_started` on."""
        reason = FinishReason(reason)  # ValueError naming the value for anything else
        times = self._requests.pop(request_id, None)
        self.request_success.labels(finished_reason=reason.value).inc()
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        if times is None:
            return
        self.e2e_latency.observe(max(0.0, now - times.arrival))
        if times.first_token is not None and times.last_token is not None and generation_tokens > 1:
            self.time_per_output_token.observe(max(0.0, times.last_token - times.first_token) / (generation_tokens - 1))

    def request_dropped(self, request_id: str) -> None:
        """Forget a request without observing anything (its client is gone, its stream given up)."""
        self._requests.pop(request_id, None)

    def detokenize_seconds(self, seconds: float) -> None:
        self.detokenize_latency.observe(seconds)

    def set_output_held(self, nbytes: int) -> None:
        self.output_bytes_held.set(nbytes)


class TokenizerMetrics(_ClientFacingMetrics):
    def __init__(self, registry: CollectorRegistry):
        super().__init__(registry)
        self.tokenize_latency = Histogram(PREFIX + "tokenize_latency_seconds", "Validate, template and tokenize one "
                                          "request.", buckets=STAGE_TIME_BUCKETS, registry=registry)
        self.requests_forwarded = Counter(PREFIX + "requests_forwarded", "Requests passed on to the engine.",
                                          registry=registry)
        self.requests_rejected = Counter(PREFIX + "requests_rejected", "Requests refused with an error to the client.",
                                         registry=registry)
        self.requests_held = Gauge(PREFIX + "requests_held", "Requests tokenized and held for room in the engine "
                                   "pipe (the engine's queue is full).", registry=registry)
        self.request_bytes_held = Gauge(PREFIX + "request_bytes_held", "Bytes of the requests held for the engine.",
                                        registry=registry)

    def tokenize_seconds(self, seconds: float) -> None:
        self.tokenize_latency.observe(seconds)

    def request_forwarded(self) -> None:
        self.requests_forwarded.inc()

    def request_rejected(self) -> None:
        self.requests_rejected.inc()

    def set_held(self, n: int, nbytes: int) -> None:
        self.requests_held.set(n)
        self.request_bytes_held.set(nbytes)


# ---------------------------------------------------------------------------------- HTTP endpoint


class MetricsServer:
    """A running `/metrics` endpoint; `close()` stops it and frees the port (idempotent)."""

    def __init__(self, server, thread: threading.Thread):
        self._server, self._thread = server, thread
        self.host: str = server.server_address[0]
        self.port: int = server.server_address[1]
        """The bound port (the one the OS chose when asked for port 0)."""
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve_metrics(registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0, *,
                  allow_remote: bool = False) -> MetricsServer:
    """Serve `registry` in Prometheus text format over HTTP on a daemon thread.

    `port` 0 lets the OS pick a free port (read it back from `.port`). The endpoint has no
    authentication, so only a loopback `host` is accepted unless `allow_remote=True`.
    Raises OSError if the port cannot be bound.
    """
    if not _is_loopback(host) and not allow_remote:
        raise ValueError(f"metrics host {host!r} is not a loopback address; the endpoint has no authentication, "
                         "so serve it on 127.0.0.1 or ::1 (or pass allow_remote=True to expose it)")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(f"metrics port must be an integer in [0, 65535] (0: any free port), got {port!r}")
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    server_cls = type("MetricsHTTPServer", (_BoundedServer,), {"address_family": family})
    server = make_server(host, port, make_wsgi_app(registry), server_cls, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return MetricsServer(server, thread)


METRICS_MAX_CONNECTIONS = 16
"""Connections the `/metrics` endpoint serves at once; more are closed at once. Each holds a
thread and a file descriptor, and zmq aborts the process when it finds no free descriptor."""
METRICS_IDLE_S = 5.0
"""A connection silent this long is closed: an idle scraper cannot keep its slot."""


class _QuietHandler(WSGIRequestHandler):
    timeout = METRICS_IDLE_S  # socket timeout: a read that waits longer ends the connection

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _BoundedServer(ThreadingMixIn, WSGIServer):
    """prometheus_client's threaded WSGI server, with at most METRICS_MAX_CONNECTIONS at once."""
    daemon_threads = True
    request_queue_size = 64  # the listen backlog: a burst of connections is accepted (and refused) at once

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(METRICS_MAX_CONNECTIONS)
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # full: the scraper retries, the stage keeps its descriptors
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], TimeoutError):  # an idle connection closed: not worth a traceback
            super().handle_error(request, client_address)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it could resolve to anything
        return False


def stage_metrics(cls, host: str, port: int):
    """A stage's metric set on its own registry, served on `host:port` unless `port` is 0 (off).
    A non-loopback `host` is allowed here: the operator asked for it by name (`--metrics-host`)."""
    registry = CollectorRegistry()
    metrics = cls(registry)
    server = serve_metrics(registry, host, port, allow_remote=True) if port else None
    return metrics, server
