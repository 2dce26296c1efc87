"""Seeded generators of hostile frames for every socket of the service (tests/service/test_fuzz.py).

Each generator yields raw frames (bytes), or lists of frames for a multipart send: random bytes,
random msgpack values, truncated and padded real messages, real messages with one field swapped
for a value of the wrong type or shape, nesting far past any real message, oversized strings and
binaries, and generate requests whose sampling values are valid but extreme. Nothing here knows
how the stages validate; it only knows what real messages look like.
"""
from __future__ import annotations

import random
from typing import Any, Iterator

import msgpack

from nanovllm_client import protocol as p
from nanovllm_client.sampling import SamplingParams

VOCAB = 2048
"""The tiny test model's vocabulary: extreme token ids straddle it."""


def _meta(rng: random.Random) -> p.RequestMeta:
    return p.RequestMeta(client=rng.randbytes(16), client_request_id=f"fz{rng.randrange(10**6)}",
                         sampling=SamplingParams(stop=["\n"]), prompt_tail=p.pack_token_ids([rng.randrange(VOCAB)]))


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(12 if depth < 6 else 8)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 1, 2**31, -2**63, 2**64 - 1, rng.randrange(-10**6, 10**6)])
    if kind == 3:
        return rng.choice([0.0, -0.0, 1e-300, 5e-324, 1e308, float("inf"), float("-inf"), float("nan"), rng.random()])
    if kind == 4:
        return "".join(rng.choice("aé中😀\x00\n ") for _ in range(rng.randrange(0, 40)))
    if kind == 5:
        return rng.randbytes(rng.randrange(0, 40))
    if kind == 6:
        return rng.choice(["generate", "abort", "ping", "stats", "step", "tokenized", "engine_status", "resync",
                           "resume", "detok_hello", "stream", "pong", "error", "stats_result"])
    if kind == 7:
        return msgpack.ExtType(rng.randrange(0, 128), rng.randbytes(rng.randrange(0, 8)))
    if kind < 10:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(0, 6))]
    return {random_key(rng): random_value(rng, depth + 1) for _ in range(rng.randrange(0, 6))}


def random_key(rng: random.Random) -> Any:
    return rng.choice(["request_id", "prompt", "sampling", "meta", "client", "rid", "stop", "tail", "deltas",
                       "instance_id", "alive", "entries", "requests", "x", "", b"bytes-key", "temperature"])


def deep(rng: random.Random) -> bytes:
    """A value nested 50-1000 levels deep, as raw msgpack (the packer itself would recurse)."""
    levels = rng.choice([50, 200, 1000])
    if rng.random() < 0.5:
        return b"\x91" * levels + b"\x01"
    return b"\x81\xa1k" * levels + b"\x01"


def templates(rng: random.Random) -> list[p.Message]:
    """One real message of every type (small, so a valid one costs the engine little)."""
    ids = p.pack_token_ids([rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6))])
    meta = _meta(rng)
    rid = f"fz{rng.randrange(10**6)}"
    return [
        p.GenerateReq(rid, prompt="hello", sampling={"max_tokens": 2}),
        p.GenerateReq(rid, messages=[{"role": "user", "content": "hi"}], sampling={"max_tokens": 2}),
        p.GenerateReq(rid, prompt_token_ids=ids, sampling={"max_tokens": 1}),
        p.AbortReq(rid), p.Ping(), p.StatsReq(), p.Resume([[rid, 1, 2]]), p.DetokHello("fz"),
        p.TokenizedReq(f"fz:{rid}", ids, {"max_tokens": 1}, meta),
        p.StepOutput("fz-engine", [[f"fz:{rid}", meta]], [], [[f"fz:{rid}", ids, False, None, 1, 1, 0, None, None, None]]),
        p.EngineStatus(True, "fz-engine", "", {"num_running": 1}),
        p.Resync("fz-engine", "fz-detok", [[meta, [f"fz:{rid}", ids, False, None, 1, 1, 0, None, None, None]]], True),
        p.StreamOutput([p.error_delta(rid, "x")]), p.ErrorOutput("x"), p.Pong("detokenizer", "fz", True),
        p.StatsOutput({"a": 1}),
        p.TokenizeReq(rid, prompt="hello", return_token_strs=True),
        p.TokenizeReq(rid, messages=[{"role": "user", "content": "hi"}], add_generation_prompt=False),
        p.DetokenizeReq(rid, ids), p.ResetPrefixCacheReq(rid), p.ResetPrefixCacheReq(rid, client=b"fz-client"),
        p.TokenizeOutput(rid, ids), p.DetokenizeOutput(rid, "x"), p.ResetPrefixCacheOutput(rid, 3, client=b"fz"),
    ]


def mutate(rng: random.Random, msg: p.Message) -> bytes:
    """A real message with one field (or one nested item) replaced by something else."""
    version, type_name, body = msgpack.unpackb(msg.encode(), raw=False)  # as it travels: plain values
    choice = rng.randrange(8)
    if choice == 0 and body:
        body[rng.choice(sorted(body))] = random_value(rng)
    elif choice == 1:
        body[random_key(rng)] = random_value(rng)
    elif choice == 2 and body:
        del body[rng.choice(sorted(body))]
    elif choice == 3:
        version = random_value(rng)
    elif choice == 4:
        type_name = random_value(rng)
    elif choice == 5:
        for value in body.values():  # reach one level into a list or map field
            if isinstance(value, list) and value:
                index = rng.randrange(len(value))
                value[index] = random_value(rng) if rng.random() < 0.5 else [random_value(rng)]
                break
            if isinstance(value, dict) and value:
                value[rng.choice(sorted(value, key=str))] = random_value(rng)
                break
    elif choice == 6:
        return b"\x93" + msgpack.packb(version) + msgpack.packb(type_name) + deep(rng)
    else:
        return msgpack.packb([version, type_name, body, random_value(rng)], use_bin_type=True)
    try:
        return msgpack.packb([version, type_name, body], use_bin_type=True)
    except (ValueError, OverflowError, TypeError):
        return msgpack.packb([version, type_name, {}])


EXTREME_SAMPLING = {
    "temperature": [0, 5e-324, 1e-45, 1e-40, 1e-10, 1e-5, 0.7, 2.0, 100.0, 1e30],
    "top_p": [1e-50, 1e-30, 1e-8, 0.001, 0.5, 0.999999, 1.0],
    "top_k": [-1, 1, 2, VOCAB - 1, VOCAB, VOCAB + 1, 2**31 - 1],
    "min_p": [0.0, 1e-30, 0.5, 0.999, 1.0],
    "repetition_penalty": [0.01, 0.5, 1.0, 2.0, 100.0],
    "presence_penalty": [-2.0, 0.0, 2.0],
    "frequency_penalty": [-2.0, 0.0, 2.0],
    "seed": [0, 1, 2**63, 2**64 - 1],
    "min_tokens": [0, 1, 2],
    "ignore_eos": [True, False],
}


def extreme_generate(rng: random.Random) -> bytes:
    """A generate request with valid but extreme sampling values (small, so the engine stays quick)."""
    sampling: dict[str, Any] = {"max_tokens": rng.randrange(1, 4)}
    for name in rng.sample(sorted(EXTREME_SAMPLING), rng.randrange(1, 6)):
        sampling[name] = rng.choice(EXTREME_SAMPLING[name])
    sampling["min_tokens"] = min(sampling.get("min_tokens", 0), sampling["max_tokens"])
    if rng.random() < 0.3:
        sampling["logit_bias"] = {str(rng.choice([0, 1, VOCAB - 1, VOCAB, 10**9])): rng.choice([-100.0, 100.0, 0.5])}
    if rng.random() < 0.2:
        sampling["allowed_token_ids"] = [rng.randrange(VOCAB)]
    if rng.random() < 0.2:
        sampling["banned_words"] = rng.choice([["x"], [[1, 2]], ["def", [3]], ["é中"]])
    if rng.random() < 0.2:
        sampling["stop"] = rng.choice(["END", ["a", "bb"], 5, [""], ["x" * 2000]])
    return p.GenerateReq(f"fz{rng.randrange(10**9)}", prompt=rng.choice(["def f(", "x", "中文 😀"]),
                         sampling=sampling).encode()


def hostile_frames(rng: random.Random, count: int, big_every: int = 500) -> Iterator[bytes | list[bytes]]:
    """`count` frames of every kind above, in a seeded random order."""
    for i in range(count):
        kind = rng.randrange(10)
        if big_every and i % big_every == big_every - 1:  # a large one now and then: 1-2 MB
            size = rng.randrange(1 << 20, 2 << 20)
            yield msgpack.packb([p.PROTOCOL_VERSION, "generate", {"request_id": "big", "prompt": "x" * size}]) \
                if rng.random() < 0.5 else rng.randbytes(size)
        elif kind == 0:
            yield rng.randbytes(rng.randrange(0, 300))
        elif kind == 1:
            try:
                yield msgpack.packb(random_value(rng), use_bin_type=True)
            except (ValueError, OverflowError):
                yield b"\xc1"
        elif kind == 2:
            frame = rng.choice(templates(rng)).encode()
            yield frame[:rng.randrange(0, len(frame))]
        elif kind == 3:
            yield [rng.choice(templates(rng)).encode(), rng.randbytes(rng.randrange(0, 20))]
        elif kind in (4, 5, 6):
            yield mutate(rng, rng.choice(templates(rng)))
        elif kind == 7:
            yield extreme_generate(rng)
        else:
            name, version = rng.choice([("generate", p.PROTOCOL_VERSION), ("tokenized", p.STAGE_PROTOCOL_VERSION),
                                        ("step", p.STAGE_PROTOCOL_VERSION), ("ping", p.PROTOCOL_VERSION)])
            yield b"\x93" + msgpack.packb(version) + msgpack.packb(name) + deep(rng)
