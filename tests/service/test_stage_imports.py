"""The tokenizer and detokenizer stages serve without torch (~200 MB a process), the engine with it."""
from __future__ import annotations


def _maps_torch(pid: int) -> bool:
    """Whether the process has torch's shared library mapped, i.e. has imported torch."""
    with open(f"/proc/{pid}/maps", encoding="utf-8") as f:
        return "libtorch" in f.read()


def test_text_stages_serve_a_chat_request_without_torch(service, client):
    result = client.generate([{"role": "user", "content": "Hello there"}], max_tokens=4, temperature=0, ignore_eos=True)
    assert result.usage["completion_tokens"] == 4 and result.text
    assert _maps_torch(service.pid("engine_proc")), "the engine computes with torch: the check must see it"
    assert not _maps_torch(service.pid("tokenizer_proc"))
    assert not _maps_torch(service.pid("detok_proc"))
