"""The real default model (SmolLM2-135M-Instruct) through the service equals offline LLM.generate."""
from __future__ import annotations

import pytest

from nanovllm_client import Client
from tests.service.conftest import start_service
from tests.service.harness import short_tmpdir

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.slow
def test_default_model_greedy_chat_through_the_service_equals_llm_generate(auto_dtype):
    # Both sides resolve dtype "auto", forced to each precision in turn (the engine stage inherits
    # NANOVLLM_AUTO_DTYPE): what the README's first command does, on either kind of CPU.
    from nanovllm import LLM, SamplingParams

    llm = LLM("default")
    assert str(llm.engine.runner.dtype) == f"torch.{auto_dtype}"
    ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False),
                               add_special_tokens=False)
    offline = llm.generate([ids], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    del llm
    procs = start_service("default", f"ipc://{short_tmpdir()}/svc", engine_args=[])
    try:
        with Client(procs.url, timeout=120) as client:
            deltas = list(client.stream(QUESTION, max_tokens=32, temperature=0))
        assert f"dtype auto -> {auto_dtype}:" in procs.logs(tail=10**8)
    finally:
        procs.stop()
    text = "".join(d.text for d in deltas)
    assert text == offline["text"]
    assert [t for d in deltas for t in d.token_ids] == offline["token_ids"]
    assert text == "The capital of France is Paris."
    assert len([d for d in deltas if d.text]) > 3, "the answer should arrive in pieces, not at once"
