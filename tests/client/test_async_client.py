"""AsyncClient under load: its reader must not starve the rest of the event loop."""
from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import time

import zmq

from nanovllm_client import AsyncClient
from nanovllm_client import protocol as p
from nanovllm_client.endpoints import service_endpoints

FLOOD = 40_000
"""Frames queued for the client at once: far more than it decodes in one heartbeat interval."""


def fake_detokenizer(endpoint: str, report, flood: int = FLOOD) -> None:
    """Answers pings. After the first ping it queues `flood` stream frames, in batches between which
    it keeps reading, so each ping's arrival time is noted within a few ms; a stats request is
    answered once the whole flood is queued, so the answer arrives behind it (at once without a
    flood). Sends (flood start, ping arrival times) to `report` when told to stop."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.bind(endpoint)
    delta = p.StreamOutput([p.DeltaRow("nobody#1", "x", p.pack_token_ids([7]))]).encode()
    pings: list[float] = []
    flood_started, left, client, stats_for = None, flood, None, []
    while not report.poll():
        if client is not None and left:
            for _ in range(min(left, 500)):
                sock.send_multipart([client, delta])
            left -= min(left, 500)
        if not left:
            for identity in stats_for:
                sock.send_multipart([identity, p.StatsOutput({"engine": {"answered": 1}}).encode()])
            stats_for.clear()
        if not sock.poll(0 if left and client is not None else 10):
            continue
        identity, frame = sock.recv_multipart()
        msg = p.decode(frame)
        if isinstance(msg, p.Ping):
            pings.append(time.monotonic())
            sock.send_multipart([identity, p.Pong("detokenizer", "d1", True).encode()])
            if client is None:
                client, flood_started = identity, time.monotonic()
        elif isinstance(msg, p.StatsReq):
            stats_for.append(identity)
    report.send((flood_started, pings))
    sock.close(linger=0)
    ctx.term()


@contextlib.contextmanager
def running_fake_detokenizer(url: str, flood: int = FLOOD):
    """`fake_detokenizer` in its own process, for the service at `url`. Yields a dict that holds
    its report once the block has ended: `started` (when the flood began) and `pings` (when each
    ping arrived)."""
    report, fake_end = multiprocessing.Pipe()
    fake = multiprocessing.get_context("spawn").Process(target=fake_detokenizer,
                                                        args=(service_endpoints(url).stream, fake_end, flood))
    fake.start()
    seen: dict = {}
    try:
        yield seen
    finally:
        report.send("stop")
        seen["started"], seen["pings"] = report.recv()
        fake.join(10)


def fake_detokenizer_answering(url: str):
    """`running_fake_detokenizer` with no flood: it answers pings and stats requests."""
    return running_fake_detokenizer(url, 0)


def test_a_client_draining_a_backlog_keeps_sending_heartbeats(tmp_path):
    # A service gives up on a client that sends no ping for 5 s, so a reader that decodes a backlog
    # without ever yielding to the loop would get a busy client's requests aborted.
    url = f"ipc://{tmp_path}"

    async def drain() -> float:
        client = AsyncClient(url, heartbeat_interval=0.05, connect_timeout=60)
        try:
            await client.wait_engine(timeout=60)  # the first pong: the flood follows it
            await client.server_stats(timeout=120)  # answered behind the whole flood
            return time.monotonic()
        finally:
            await client.close()

    with running_fake_detokenizer(url) as seen:
        finished = asyncio.run(drain())
    started, pings = seen["started"], seen["pings"]
    during = [started] + [t for t in pings if started < t < finished] + [finished]
    longest_gap = max(b - a for a, b in zip(during, during[1:]))
    assert finished - started > 0.3, "the backlog was too small to tell"
    assert longest_gap < max(0.25, (finished - started) / 4), (
        f"no ping for {longest_gap:.2f}s of the {finished - started:.2f}s spent on the backlog")


def test_a_frame_whose_wakeup_was_taken_elsewhere_is_still_read(tmp_path):
    # zmq's socket descriptor only signals changes: anything that reads the socket's EVENTS while
    # the loop is busy takes the signal of a frame that arrived meanwhile, and the loop never
    # hears of it. The client must read such a frame anyway, long before its next heartbeat.
    url = f"ipc://{tmp_path}"

    async def scenario() -> tuple[bool, dict, float]:
        client = AsyncClient(url, heartbeat_interval=60, connect_timeout=60)
        try:
            await client.wait_engine(timeout=60)
            await asyncio.sleep(0.3)  # the heartbeat's last ping before its 60 s sleep (a send also looks at EVENTS)
            await client._send(client._out, p.StatsReq().encode())  # what server_stats() sends
            seen, spin_end = False, time.monotonic() + 60
            while not seen and time.monotonic() < spin_end:  # the loop is busy until the answer has arrived
                seen = bool(client._out.getsockopt(zmq.EVENTS) & zmq.POLLIN)
            waited = time.monotonic()
            stats = await asyncio.wait_for(client._stats.get(), 30)
            return seen, stats, time.monotonic() - waited
        finally:
            await client.close()

    with fake_detokenizer_answering(url):
        seen, stats, waited = asyncio.run(scenario())
    assert seen, "the answer should have arrived while the loop was busy"
    assert stats == {"engine": {"answered": 1}}
    # Read at the loop's next turn, not at the next heartbeat 60 s on (the limit allows a loaded machine).
    assert waited < 10, f"the answer was read {waited:.2f}s after the loop was free again"


def test_the_clients_of_one_loop_share_one_recheck_task(tmp_path):
    # The recheck under the descriptors runs ten times a second; one task per client cost 64 idle
    # clients 3% of a core. One task serves every started client of a loop, ends with the last
    # one closed, and a client started later gets a new one.
    from nanovllm_client import async_client

    url = f"ipc://{tmp_path}"

    def rechecks() -> list[asyncio.Task]:
        return [t for t in asyncio.all_tasks() if t.get_coro().__name__ == "_recheck_all" and not t.done()]

    async def scenario() -> list[tuple[int, int]]:
        seen = []
        clients = [AsyncClient(url, connect_timeout=60) for _ in range(3)]
        for c in clients:
            await c.start()
        loop = asyncio.get_running_loop()
        seen.append((len(rechecks()), len(async_client._watched[loop])))
        await clients[0].wait_engine(timeout=60)
        await clients[1].close()
        seen.append((len(rechecks()), len(async_client._watched[loop])))
        for c in clients:
            await c.close()
        await asyncio.sleep(3 * async_client.RECHECK_S)
        seen.append((len(rechecks()), len(async_client._watched.get(loop, ()))))
        late = AsyncClient(url, connect_timeout=60)
        await late.wait_engine(timeout=60)
        seen.append((len(rechecks()), len(async_client._watched[loop])))
        assert await late.server_stats(timeout=5) == {"engine": {"answered": 1}}
        await late.close()
        return seen

    with fake_detokenizer_answering(url):
        seen = asyncio.run(scenario())
    assert seen == [(1, 3), (1, 2), (0, 0), (1, 1)]


def deaf_tokenizer(endpoint: str, stop) -> None:
    """A tokenizer endpoint that takes one frame into its queue and then reads nothing: the
    client's pipe to it fills, and every further send waits."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.bind(endpoint)
    stop.poll(None)
    sock.close(linger=0)
    ctx.term()


def test_a_send_that_waits_on_a_full_pipe_can_be_cancelled_and_the_client_closed(tmp_path):
    # A caller that gives up on stream() while the tokenizer's pipe is full (asyncio.wait_for, a
    # cancelled task) must leave nothing behind: the request was never sent, so its id is free
    # again. And close() must not wait for room that never comes to send its aborts.
    url = f"ipc://{tmp_path}"
    endpoints = service_endpoints(url)
    spawn = multiprocessing.get_context("spawn")
    stop_detok, detok_end = multiprocessing.Pipe()
    stop_tok, tok_end = multiprocessing.Pipe()
    detok = spawn.Process(target=fake_detokenizer, args=(endpoints.stream, detok_end, 0))
    tok = spawn.Process(target=deaf_tokenizer, args=(endpoints.tokenizer, tok_end))
    detok.start()
    tok.start()
    big = "x" * (4 << 20)  # a few frames of this fill the socket buffers between the two

    async def scenario() -> tuple[int, bool, float]:
        client = AsyncClient(url, hwm=1, connect_timeout=60, heartbeat_interval=60)
        await client.wait_engine(timeout=60)
        sent = 0
        while sent < 64:
            try:
                await asyncio.wait_for(client.stream(big, request_id="r", max_tokens=1), 1.0)
            except asyncio.TimeoutError:
                break
            client.abort_nowait("r")  # the stream was sent: let the id go for the next try
            sent += 1
        refused_reuse = False
        try:  # the id of the request that never left is free: this send waits again, no ValueError
            await asyncio.wait_for(client.stream("hi", request_id="r", max_tokens=1), 0.5)
        except asyncio.TimeoutError:
            pass
        except ValueError:
            refused_reuse = True
        start = time.monotonic()
        await asyncio.wait_for(client.close(), 10)
        return sent, refused_reuse or bool(client._wire_ids), time.monotonic() - start

    try:
        sent, left_behind, closing = asyncio.run(scenario())
    finally:
        stop_detok.send("stop")
        stop_tok.send("stop")
        detok.join(10)
        tok.join(10)
    assert sent < 64, "the pipe never filled: the test did not reach a waiting send"
    assert not left_behind, "a request whose send was cancelled stayed registered"
    assert closing < 8, f"close() took {closing:.1f}s with a full pipe"  # its linger is 1 s; a hang never ends


def test_clients_started_apart_ping_at_the_same_instants(tmp_path):
    # A ping that wakes a stage on its own costs it 3-4 times one that arrives with others
    # (bench/ping_cost.py), so ready clients ping on a grid of their interval on the monotonic
    # clock, not at whatever phase they happened to start: a stage then serves a host's pings in
    # few wake-ups. Two clients started a quarter interval apart must ping in the same instants.
    url = f"ipc://{tmp_path}"
    interval = 0.5

    async def scenario() -> float:
        first = AsyncClient(url, heartbeat_interval=interval, connect_timeout=60)
        second = AsyncClient(url, heartbeat_interval=interval, connect_timeout=60)
        try:
            await first.wait_engine(timeout=60)
            await asyncio.sleep(interval / 4)
            await second.wait_engine(timeout=60)
            settled = time.monotonic() + interval  # the handshakes' 0.1 s pings are over
            await asyncio.sleep(4 * interval)
            return settled
        finally:
            await first.close()
            await second.close()

    with fake_detokenizer_answering(url) as seen:
        settled = asyncio.run(scenario())
    later = [t for t in seen["pings"] if t > settled]
    off_grid = [round(min(t % interval, interval - t % interval), 3) for t in later]
    assert len(later) >= 6, f"only {len(later)} pings arrived after the handshakes"
    # A ping may come late on a loaded machine; off the grid, half of them would lie ~interval/4 away.
    on_grid = [d for d in off_grid if d < 0.05]
    assert len(on_grid) >= 0.75 * len(off_grid), f"pings this far (s) from the {interval} s grid: {off_grid}"


def test_the_wait_to_the_next_ping_lands_on_the_grid(monkeypatch):
    from nanovllm_client import client_state

    client = AsyncClient("ipc:///nonexistent", heartbeat_interval=0.7)
    assert client._ping_wait(False) == 0.1  # the handshake is pending: soon
    for now in (12.34, 100.1, 100.1 + 0.69, 7.0 + 0.001, 1e6 + 0.123):  # the clock, held still
        monkeypatch.setattr(client_state.time, "monotonic", lambda: now)
        wait = client._ping_wait(True)
        assert 0.007 < wait < 0.707  # never a second ping at once
        assert min((now + wait) % 0.7, 0.7 - (now + wait) % 0.7) < 1e-6
