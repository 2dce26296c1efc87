"""The wire's cost per frame: today's msgpack + checks against msgspec's typed structs.

    pip install msgspec            # only for this benchmark; not a dependency
    python -m bench.wire_codec [--rows 64] [--frames 5000] [--rounds 5]

The two frames the service sends most under load, both ends of each:
  * an engine step (`StepOutput`) with `--rows` output rows of one token each: the engine
    encodes it, the detokenizer decodes and checks it;
  * a client's `StreamOutput` with `--rows` deltas of one token each: the detokenizer encodes it,
    the client decodes and checks it.

"protocol" is `nanovllm_client.protocol` as the service runs it (msgpack, then the rows read by
`typed_row` and every field checked in Python). "msgspec" is the same messages as
`msgspec.Struct`s with `array_like=True` (positional on the wire, like our rows), the limits as
`msgspec.Meta` constraints and the checks msgspec cannot state (packed ids a multiple of 4 bytes)
in `__post_init__`, decoded in two stages as the service would have to: the envelope
[version, type, raw body], then the body by its type. The two are checked to decode each
other's frames to the same values first. Rounds alternate the two; the table gives the median
microseconds per frame of each, and one JSON line follows.
"""

import argparse
import json
import statistics
import sys
import time
from typing import Annotated, Literal, Optional

from nanovllm_client import protocol as p
from nanovllm_client.sampling import SamplingParams


def frames(rows: int) -> dict[str, object]:
    meta = p.RequestMeta(client=b"\x00k" * 8, client_request_id="r", sampling=SamplingParams(stop=["\n\n"]),
                         prompt_tail=p.pack_token_ids([1, 2, 3]), arrival=1.0)
    outputs = [p.OutputRow(request_id=f"{'ab' * 8}:req-{i}", token_ids=p.pack_token_ids([1000 + i]), finished=False,
                           finish_reason=None, num_prompt_tokens=200, num_output_tokens=10, num_cached_tokens=0,
                           error=None) for i in range(rows)]
    step = p.StepOutput(instance_id="e" * 12, started=[p.StartedRow(request_id="c:new", meta=meta)], outputs=outputs)
    stream = p.StreamOutput(deltas=[p.DeltaRow(request_id=f"req-{i}", text=" tok",
                                               token_ids=p.pack_token_ids([1000 + i])) for i in range(rows)])
    return {"step": step, "stream": stream}


def msgspec_codec():
    """(encode, decode) for the same messages as msgspec structs; None without msgspec."""
    try:
        import msgspec
        from msgspec import Meta, Struct
    except ImportError:
        return None

    Count = Annotated[int, Meta(ge=0, lt=2**31)]
    EngineId = Annotated[str, Meta(min_length=1, max_length=p.MAX_ENGINE_ID_LEN)]
    Reason = Optional[Literal["stop", "length", "abort", "error"]]
    ErrorText = Optional[Annotated[str, Meta(max_length=p.MAX_ERROR_LEN)]]

    def packed(value: bytes, name: str) -> None:
        if len(value) % 4:
            raise msgspec.ValidationError(f"packed {name} must be a multiple of 4 bytes")

    class Meta_(Struct, array_like=True):
        client: Annotated[bytes, Meta(max_length=255)]
        client_request_id: Annotated[str, Meta(min_length=1, max_length=p.MAX_ID_LEN)]
        sampling: dict  # the text-side sampling map (the struct's own validator is not mirrored here)
        prompt_tail: Annotated[bytes, Meta(max_length=4 * p.MAX_PROMPT_TAIL)]
        arrival: float
        have_tokens: Count
        have_chars: Count
        reasoning_open: bool

        def __post_init__(self):
            packed(self.prompt_tail, "prompt_tail")

    class Started(Struct, array_like=True):
        request_id: EngineId
        meta: Meta_

    class Rejected(Struct, array_like=True):
        request_id: EngineId
        meta: Meta_
        error: Annotated[str, Meta(max_length=p.MAX_ERROR_LEN)]

    class Output(Struct, array_like=True):
        request_id: EngineId
        token_ids: bytes
        finished: bool
        finish_reason: Reason
        num_prompt_tokens: Count
        num_output_tokens: Count
        num_cached_tokens: Count
        error: ErrorText

        def __post_init__(self):
            packed(self.token_ids, "token ids")

    class Step(Struct):
        instance_id: Annotated[str, Meta(min_length=1, max_length=p.MAX_INSTANCE_ID_LEN)]
        started: Annotated[list[Started], Meta(max_length=p.MAX_ROWS)] = []
        rejected: Annotated[list[Rejected], Meta(max_length=p.MAX_ROWS)] = []
        outputs: Annotated[list[Output], Meta(max_length=p.MAX_ROWS)] = []

    class Usage(Struct, array_like=True):
        prompt_tokens: Count
        completion_tokens: Count
        cached_tokens: Count

    class Delta(Struct, array_like=True):
        request_id: EngineId
        text: str = ""
        token_ids: bytes = b""
        finish_reason: Reason = None
        error: ErrorText = None
        usage: Optional[Usage] = None
        engine_dead: bool = False
        unsent: bool = False

        def __post_init__(self):
            packed(self.token_ids, "token ids")

    class Stream(Struct, forbid_unknown_fields=False):
        deltas: Annotated[list[Delta], Meta(max_length=p.MAX_ROWS)]

    types = {"step": Step, "stream": Stream}
    envelope = msgspec.msgpack.Decoder(tuple[int, str, msgspec.Raw])
    bodies = {name: msgspec.msgpack.Decoder(t) for name, t in types.items()}
    encoder = msgspec.msgpack.Encoder()

    def to_struct(msg: p.Message):
        if isinstance(msg, p.StepOutput):
            return "step", Step(msg.instance_id, [Started(r.request_id, Meta_(*r.meta._replace(
                sampling=r.meta.sampling.to_dict()))) for r in msg.started], [], [Output(*r) for r in msg.outputs])
        return "stream", Stream([Delta(*d[:5], Usage(*d.usage) if d.usage else None, *d[6:]) for d in msg.deltas])

    versions = {"step": p.StepOutput.VERSION, "stream": p.StreamOutput.VERSION}

    def encode(name: str, struct) -> bytes:
        return encoder.encode((versions[name], name, struct))

    def decode(frame: bytes):
        version, name, raw = envelope.decode(frame)
        if version != versions[name]:
            raise ValueError("protocol version")
        return bodies[name].decode(raw)

    return to_struct, encode, decode


def per_frame_us(call, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - start) / n * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--frames", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    codec = msgspec_codec()
    if codec is None:
        print("msgspec is not installed: pip install msgspec", file=sys.stderr)
        return 1
    to_struct, ms_encode, ms_decode = codec
    results: dict[str, dict[str, list[float]]] = {}
    for name, msg in frames(args.rows).items():
        ours = msg.encode()
        kind, struct = to_struct(msg)
        theirs = ms_encode(kind, struct)
        # Each decodes the other's frame to the same values: the same bytes on the wire.
        assert ms_decode(ours) == struct, name
        assert p.decode(theirs) == p.decode(ours), name
        cases = {"protocol encode": lambda: msg.encode(), "protocol decode+check": lambda: p.decode(ours),
                 "msgspec encode": lambda: ms_encode(kind, struct), "msgspec decode+check": lambda: ms_decode(ours)}
        times = results[f"{name} ({args.rows} rows, {len(ours):,} bytes)"] = {case: [] for case in cases}
        for _ in range(args.rounds):
            for case, call in cases.items():
                times[case].append(per_frame_us(call, args.frames))
    print("| frame | protocol encode µs | protocol decode+check µs | msgspec encode µs | msgspec decode+check µs |")
    print("| --- | --- | --- | --- | --- |")
    medians = {frame: {case: statistics.median(v) for case, v in times.items()} for frame, times in results.items()}
    for frame, m in medians.items():
        print(f"| {frame} | " + " | ".join(f"{m[c]:.1f}" for c in ("protocol encode", "protocol decode+check",
                                                                   "msgspec encode", "msgspec decode+check")) + " |")
    print(json.dumps({"bench": "wire_codec", "rows": args.rows, "frames": args.frames, "median_us": medians}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
