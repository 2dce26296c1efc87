"""End-to-end streaming through the three real stage processes over ipc:// (tiny random model)."""
from __future__ import annotations

import asyncio
import collections
import threading
import time

import pytest

from nanovllm_client import AsyncClient, Client
from tests.service.harness import idle_before_the_natural_end, num_steps, wait_for

PROMPTS = ["def main():", "import os\nimport sys", "class Foo(object):\n    ", "Hello, world"]


def record_wire_deltas(client: Client) -> list:
    """Every delta that reaches the client, before the client's own bookkeeping."""
    seen: list = []
    handle = client._state.handle

    def recording(frame):
        reaction = handle(frame)
        # On the wire each stream is '<request id>#<n>'; the application sees '<request id>'.
        seen.extend((d.request_id.rsplit("#", 1)[0], d.finish_reason) for d in reaction.deltas)
        return reaction

    client._state.handle = recording
    return seen


def test_greedy_stream_equals_offline_generate(tiny_model_dir, service_with_auto, auto_dtype):
    import torch
    from nanovllm import LLM, SamplingParams

    offline = LLM(tiny_model_dir, num_kvcache_blocks=256, num_threads=1)  # auto, forced as the service's
    expected = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    procs = service_with_auto(auto_dtype)
    with Client(procs.url, timeout=60, connect_timeout=30) as client:
        deltas_by_prompt = [list(client.stream(prompt, max_tokens=24, temperature=0)) for prompt in PROMPTS]
    procs.assert_running()
    assert offline.engine.runner.dtype == getattr(torch, auto_dtype)
    for deltas, want in zip(deltas_by_prompt, expected):
        assert "".join(d.text for d in deltas) == want["text"]
        assert [t for d in deltas for t in d.token_ids] == want["token_ids"]
        assert deltas[-1].finish_reason in ("stop", "length")
        assert deltas[-1].usage["completion_tokens"] == len(want["token_ids"])
        assert all(d.finish_reason is None for d in deltas[:-1])


def test_64_concurrent_streams_from_threads_end_exactly_once(client):
    seen = record_wire_deltas(client)
    results: dict[str, tuple[str, int]] = {}
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            streams = [client.stream(PROMPTS[(k + i) % 4] + str(i), max_tokens=4 + (k * 8 + i) % 13,
                                     temperature=0 if i % 2 else 0.8, ignore_eos=True) for i in range(8)]
            for s in streams:
                deltas = list(s)
                results[s.request_id] = (deltas[-1].finish_reason, sum(len(d.token_ids) for d in deltas))
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a stream hung"
    assert not errors, errors
    assert len(results) == 64
    assert all(reason == "length" for reason, _ in results.values())
    time.sleep(0.5)  # anything duplicated would have arrived by now
    terminal = collections.Counter(rid for rid, reason in seen if reason is not None)
    assert set(terminal) == set(results) and set(terminal.values()) == {1}
    last_index = {rid: i for i, (rid, _) in enumerate(seen)}
    for i, (rid, reason) in enumerate(seen):
        if reason is not None:
            assert last_index[rid] == i, f"delta after the terminal one for {rid}"


def test_async_client_under_uvloop_matches_sync(client, service):
    uvloop = pytest.importorskip("uvloop")
    want = [client.generate(p, max_tokens=12, temperature=0).text for p in PROMPTS]

    async def main():
        async with AsyncClient(service.url, timeout=60) as ac:
            results = await asyncio.gather(*(ac.generate(p, max_tokens=12, temperature=0) for p in PROMPTS * 4))
            chunks = []
            async for delta in await ac.stream(PROMPTS[0], max_tokens=12, temperature=0):
                chunks.append(delta.text)
            return [r.text for r in results], "".join(chunks)

    texts, streamed = uvloop.run(main())
    assert texts == want * 4
    assert streamed == want[0]


def test_cancelling_half_mid_stream_frees_every_kv_block(slow_client):
    client = slow_client
    long = [client.stream(p, max_tokens=600, ignore_eos=True, temperature=0) for p in PROMPTS * 2]
    short = [client.stream(p, max_tokens=16, ignore_eos=True, temperature=0) for p in PROMPTS * 2]
    for s in long + short:
        first = next(s)
        assert first.finish_reason is None
    wait_for(lambda: client.server_stats()["engine"].get("num_live", 0) >= 8, timeout=60, what="the long requests live")
    since = num_steps(client)
    for i, s in enumerate(long):
        if i % 3 == 0:
            s.cancel()
        elif i % 3 == 1:
            client.abort(s.request_id)
        else:
            for _ in s:  # breaking out of the loop; the dropped stream aborts itself
                break
    del long, s
    for s in short:
        assert list(s)[-1].finish_reason == "length"
    idle_before_the_natural_end(client, since, 600, "all KV blocks free")


def test_cli_streams_an_answer_to_the_terminal(service):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "nanovllm_client.cli", "--url", service.url, "--max-tokens", "6",
                          "--usage", "Hello"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.endswith("\n") and len(out.stdout.strip()) > 0
    assert "completion_tokens" in out.stderr


def test_request_timeout_ends_the_stream_with_an_error_and_aborts(slow_client):
    from nanovllm_client import RequestTimeoutError

    client = slow_client
    since = num_steps(client)
    stream = client.stream("def main():", max_tokens=1000, ignore_eos=True, timeout=0.3)  # >= 10 s to run out
    with pytest.raises(RequestTimeoutError):
        for _ in stream:
            pass
    idle_before_the_natural_end(client, since, 1000, "timed-out request aborted")


def test_async_request_timeout_ends_the_stream_with_an_error_and_aborts(slow_client, slow_service):
    from nanovllm_client import RequestTimeoutError

    async def main():
        async with AsyncClient(slow_service.url, timeout=120) as ac:
            quick = await ac.generate(PROMPTS[0], max_tokens=4, temperature=0, timeout=60)
            stream = await ac.stream("def main():", max_tokens=1000, ignore_eos=True, timeout=0.3)
            got = 0
            with pytest.raises(RequestTimeoutError):
                async for delta in stream:
                    got += len(delta.token_ids)
            with pytest.raises(StopAsyncIteration):
                await stream.__anext__()  # the stream ended with its timeout
            return quick, got

    since = num_steps(slow_client)
    quick, got = asyncio.run(main())
    assert quick.finish_reason == "length" and quick.usage["completion_tokens"] == 4
    assert got < 1000
    idle_before_the_natural_end(slow_client, since, 1000, "timed-out request aborted")


def test_aborts_are_idempotent(slow_client):
    client = slow_client
    stream = client.stream("x", max_tokens=600, ignore_eos=True)
    next(stream)
    since = num_steps(client)
    for _ in range(3):
        client.abort(stream.request_id)
    client.abort("never-existed")
    idle_before_the_natural_end(client, since, 600, "aborted request gone")
    assert client.generate("x", max_tokens=3, ignore_eos=True).usage["completion_tokens"] == 3


def test_async_break_out_of_stream_aborts_the_request(slow_client, slow_service):
    async def main():
        async with AsyncClient(slow_service.url, timeout=120) as ac:
            stream = await ac.stream("def main():", max_tokens=600, ignore_eos=True)
            async for _ in stream:
                break
            del stream  # dropped unfinished: it aborts itself (checked before close() could)
            stats = await ac.server_stats()
            while not (stats["engine"].get("num_live") == 0 and stats["detok"]["num_requests"] == 0):
                await asyncio.sleep(0.1)
                stats = await ac.server_stats()
            return stats["engine"]["num_steps"]

    since = num_steps(slow_client)
    done_at = asyncio.run(asyncio.wait_for(main(), timeout=60))  # the limit only catches a hang
    assert done_at - since < 300, "the abandoned stream ran on to its end"
