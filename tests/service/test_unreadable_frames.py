"""A request frame the tokenizer cannot read fails its request at once, not at the client's timeout.

A frame over the wire's msgpack limits (here a map of more entries than a map may hold: a
`logit_bias` sent raw, or a chat message with that many keys, which the client passes on as it is)
decodes to nothing, so the tokenizer cannot name the request in its error; it names the frame by
its digest (`protocol.frame_digest`), and the client that sent it finds the request."""
from __future__ import annotations

import asyncio
import uuid

import pytest
import zmq

from nanovllm_client import AsyncClient, Client, RequestError
from nanovllm_client import protocol as p
from nanovllm_client.endpoints import service_endpoints

CLIENT_TIMEOUT_S = 300.0
"""Long: a request the client could not match to the error would end in RequestTimeoutError."""
TOO_MANY = {str(i): 0.5 for i in range(5000)}
"""A map longer than the wire allows (4096 entries): the whole frame is unreadable."""
WIDE_CHAT = [{"role": "user", "content": "hi", **{f"k{i}": "" for i in range(5000)}}]
"""A chat message of as many keys: the client checks sampling values, not a message's keys."""


def test_the_tokenizer_names_an_unreadable_frame_by_its_digest(service):
    frame = p.GenerateReq("r1", prompt="hi", sampling={"logit_bias": TOO_MANY}).encode()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, uuid.uuid4().bytes)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(service_endpoints(service.url).tokenizer)
    try:
        sock.send(frame)
        assert sock.poll(60_000), "no reply from the tokenizer"
        reply = p.decode(sock.recv())
    finally:
        sock.close()
        ctx.term()
    assert isinstance(reply, p.ErrorOutput) and reply.request_id is None
    assert "msgpack" in reply.message
    assert reply.frame_digest == p.frame_digest(frame)


def test_async_client_fails_the_request_at_once(service):
    async def run():
        client = AsyncClient(service.url, timeout=CLIENT_TIMEOUT_S)
        await client.start()
        try:
            with pytest.raises(RequestError, match="msgpack"):
                await client.generate(WIDE_CHAT, max_tokens=4)
            assert not client._state.unanswered and not client._state.inflight
            # The client and the same request id serve on.
            result = await client.generate("hi", max_tokens=3, temperature=0, ignore_eos=True)
            assert len(result.token_ids) == 3
        finally:
            await client.close()

    asyncio.run(run())


def test_sync_client_fails_the_request_at_once(service):
    with Client(service.url, timeout=CLIENT_TIMEOUT_S) as client:
        stream = client.stream(WIDE_CHAT, max_tokens=4, request_id="big", raise_on_error=False)
        deltas = list(stream)
        assert deltas[-1].finish_reason == "error" and "msgpack" in deltas[-1].error
        result = client.generate("hi", max_tokens=3, temperature=0, ignore_eos=True, request_id="big")
        assert len(result.token_ids) == 3
