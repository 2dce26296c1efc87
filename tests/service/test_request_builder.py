"""The tokenizer stage's checks and tokenization (`tokenizer_proc.requests.RequestBuilder`), without sockets."""
from __future__ import annotations

import pytest

from nanovllm.models.tokenizer import load_tokenizer
from nanovllm.sampling_params import SamplingParams
from nanovllm_client import protocol as p
from tokenizer_proc.requests import RequestBuilder, RequestRejected, sampling_fields

CLIENT = b"\x07" * 5


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


def builder(tokenizer, **kwargs) -> RequestBuilder:
    return RequestBuilder(tokenizer, sampling_fields(SamplingParams), SamplingParams, **kwargs)


def test_a_request_becomes_the_engines_frame_with_the_meta_the_detokenizer_needs(tokenizer):
    req = p.GenerateReq("r1", prompt="hello world", sampling={"max_tokens": 4, "stop": "x"}, stop=["y"], priority=3)
    out = p.decode(builder(tokenizer).build(CLIENT, req))
    assert isinstance(out, p.TokenizedReq) and out.request_id == CLIENT.hex() + ":r1" and out.priority == 3
    assert p.unpack_token_ids(out.prompt_token_ids) == tokenizer.encode("hello world")
    assert out.sampling == {"max_tokens": 4}  # text-side fields go to the detokenizer, in the meta
    assert out.meta.client == CLIENT and out.meta.client_request_id == "r1" and out.meta.stop == ["y", "x"]


@pytest.mark.parametrize("req, why", [
    (p.GenerateReq("r", prompt="hi", sampling={"temprature": 1.0}), "unknown sampling parameter(s) ['temprature']"),
    (p.GenerateReq("r", prompt="hi", sampling={"logprobs": 2}), "'logprobs' is not supported by the service"),
    (p.GenerateReq("r", prompt="hi", sampling={"top_p": 7.0}), "invalid sampling parameters"),
    (p.GenerateReq("r", prompt="hi", stop=["a"] * 40, sampling={"stop": ["b"] * 40}), "count together"),
    (p.GenerateReq("r", prompt="hi", priority=11), "above this service's ceiling of 10"),
    (p.GenerateReq("r", prompt="x" * 10_000), "more than the model's context length"),
    (p.GenerateReq("r", prompt=""), "prompt is empty"),
])
def test_each_bad_request_is_refused_naming_the_problem(tokenizer, req, why):
    with pytest.raises(RequestRejected) as caught:
        builder(tokenizer, max_prompt_tokens=64, max_priority=10).build(CLIENT, req)
    assert why in str(caught.value)


def test_a_client_keys_own_priority_ceiling_holds_below_the_services(tokenizer):
    ceilings = {"key-a": 2}
    build = builder(tokenizer, max_priority=10, key_max_priority=ceilings.get).build
    build(CLIENT, p.GenerateReq("r", prompt="hi", priority=5), key="key-b")
    with pytest.raises(RequestRejected, match="this client key's ceiling of 2"):
        build(CLIENT, p.GenerateReq("r", prompt="hi", priority=5), key="key-a")


def test_cache_salts_part_clients_and_keep_each_clients_own_salt_apart(tokenizer):
    build = builder(tokenizer, cache_salt_per_client=True).build

    def salt(client: bytes, key: str | None = None, own: str | None = None) -> str:
        sampling = {} if own is None else {"cache_salt": own}
        return p.decode(build(client, p.GenerateReq("r", prompt="hi", sampling=sampling), key)).sampling["cache_salt"]
    assert salt(CLIENT) == salt(CLIENT) != salt(b"\x08" * 5)
    assert salt(CLIENT, key="k") == salt(b"\x08" * 5, key="k")  # one key, one client, whatever its routing id
    assert salt(CLIENT, own="a") != salt(CLIENT, own="b") != salt(CLIENT)
    assert p.decode(builder(tokenizer).build(CLIENT, p.GenerateReq("r", prompt="hi"))).sampling.get("cache_salt") is None
