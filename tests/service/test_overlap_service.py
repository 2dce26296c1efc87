"""The service with the overlapped step forced on (`--overlap-scheduling`, the default on CUDA):
outputs arrive a step later inside the engine, and streams must still carry exactly the tokens
the offline engine gives, end once, and a cancel mid-stream must end only its own stream.
Real processes and sockets, tiny random model."""
from __future__ import annotations

from nanovllm_client import Client
from tests.service.conftest import TINY_ENGINE_ARGS, start_service
from tests.service.harness import short_tmpdir
from tests.service.test_aborts_under_load import engine_stats

PROMPTS = ["def main():", "import os\nimport sys", "class Foo(object):\n    ", "Hello, world"]


def test_overlapped_engine_streams_what_the_offline_engine_generates(tiny_model_dir):
    from nanovllm import LLM, SamplingParams

    offline = LLM(tiny_model_dir, num_kvcache_blocks=512, num_threads=1)
    lengths = [24, 7, 16, 3]
    expected = [offline.generate([p], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                                 use_tqdm=False)[0] for p, n in zip(PROMPTS, lengths)]
    procs = start_service(tiny_model_dir, f"ipc://{short_tmpdir()}/svc", engine_args=TINY_ENGINE_ARGS + ["--overlap-scheduling"])
    try:
        with Client(procs.url, timeout=60, connect_timeout=30) as client:
            streams = [client.stream(p, max_tokens=n, temperature=0, ignore_eos=True) for p, n in zip(PROMPTS, lengths)]
            doomed = client.stream("def doomed():", max_tokens=2000, temperature=0, ignore_eos=True)
            first = next(doomed)
            deltas = [list(s) for s in streams]
            before = engine_stats(client)["num_steps"]
            doomed.cancel()
            steps = engine_stats(client, until=lambda s: s.get("num_live") == 0)["num_steps"] - before
            again = client.generate(PROMPTS[0], max_tokens=24, temperature=0, ignore_eos=True)
        procs.assert_running()
    finally:
        procs.stop()
    for got, want in zip(deltas, expected):
        assert [t for d in got for t in d.token_ids] == want["token_ids"]
        assert got[-1].finish_reason == "length" and all(d.finish_reason is None for d in got[:-1])
    assert first.finish_reason is None
    assert steps < 1000, f"the cancelled request ran {steps} more steps"  # the abort landed, a step late at most
    assert again.token_ids == expected[0]["token_ids"]
