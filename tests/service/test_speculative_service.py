"""The service with speculative decoding on (`--speculative ngram`): streams carry exactly the
tokens the offline engine gives without it, stop strings end the text where they do without it,
and the engine's stats count the verified drafts. Real processes and sockets, tiny random model."""
from __future__ import annotations

from nanovllm_client import Client
from tests.service.conftest import EXACT_ARGS, TINY_ENGINE_ARGS, start_service
from tests.service.harness import short_tmpdir
from tests.service.test_aborts_under_load import engine_stats

PROMPTS = ["def main():", "import os\nimport sys\nimport os\nimport sys\n", "abc abc abc abc abc", "Hello, world"]
SPEC_ARGS = TINY_ENGINE_ARGS + EXACT_ARGS + ["--speculative", "ngram", "--speculative-ngram-min", "1"]


def test_speculative_engine_streams_what_the_plain_offline_engine_generates(tiny_model_dir):
    from nanovllm import LLM, SamplingParams

    offline = LLM(tiny_model_dir, num_kvcache_blocks=512, num_threads=1, dtype="float32")
    lengths = [30, 12, 40, 5]
    expected = [offline.generate([p], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                                 use_tqdm=False)[0] for p, n in zip(PROMPTS, lengths)]
    text = expected[2]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    stopped = offline.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                             stop=[stop]), use_tqdm=False)[0]
    procs = start_service(tiny_model_dir, f"ipc://{short_tmpdir()}/svc", engine_args=SPEC_ARGS)
    try:
        with Client(procs.url, timeout=60, connect_timeout=30) as client:
            got = [client.generate(p, max_tokens=n, temperature=0, ignore_eos=True) for p, n in zip(PROMPTS, lengths)]
            got_stop = client.generate(PROMPTS[2], max_tokens=40, temperature=0, ignore_eos=True, stop=[stop])
            stats = engine_stats(client, until=lambda s: s.get("spec_decode_num_drafts", 0) > 0)
        procs.assert_running()
    finally:
        procs.stop()
    assert [g.token_ids for g in got] == [e["token_ids"] for e in expected]
    assert (got_stop.text, got_stop.finish_reason) == (stopped["text"], "stop")
    assert stats["spec_decode_num_draft_tokens"] >= stats["spec_decode_num_accepted_tokens"] > 0
