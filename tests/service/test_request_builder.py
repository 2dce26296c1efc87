"""The tokenizer stage's checks and tokenization (`tokenizer_proc.requests.RequestBuilder`), without sockets."""
from __future__ import annotations

import pytest

from nanovllm.models.tokenizer import load_tokenizer
from nanovllm.sampling_params import SamplingParams
from nanovllm_client import protocol as p
from tokenizer_proc.requests import RequestBuilder, RequestRejected

CLIENT = b"\x07" * 5


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


def builder(tokenizer, **kwargs) -> RequestBuilder:
    return RequestBuilder(tokenizer, **kwargs)


def received(**fields) -> p.GenerateReq:
    """A GenerateReq as the stage gets it: encoded by a client (`sampling` as its map), decoded."""
    return p.decode(p.GenerateReq(**fields).encode())


def test_a_request_becomes_the_engines_frame_with_the_meta_the_detokenizer_needs(tokenizer):
    req = received(request_id="r1", prompt="hello world", priority=3,
                   sampling=SamplingParams(max_tokens=4, stop=["y", "x"], temperature=0.5, min_tokens=2))
    out = p.decode(builder(tokenizer).build(CLIENT, req))
    assert isinstance(out, p.TokenizedReq) and out.request_id == CLIENT.hex() + ":r1" and out.priority == 3
    assert p.unpack_token_ids(out.prompt_token_ids) == tokenizer.encode("hello world")
    assert out.sampling == req.sampling  # the whole struct, as the client sent it
    assert out.meta.client == CLIENT and out.meta.client_request_id == "r1"
    # The detokenizer gets the text side: the stop strings and what governs them, nothing more.
    assert out.meta.sampling == SamplingParams(max_tokens=4, stop=["y", "x"], min_tokens=2)


@pytest.mark.parametrize("fields, why", [
    (dict(prompt_token_ids=p.pack_token_ids([7] * 14_000), prompt=None, sampling=SamplingParams(prompt_logprobs=19)),
     "prompt_logprobs=19 over a 14000-token prompt asks for 280000 scores, more than the 262144"),
    (dict(priority=11), "above this service's ceiling of 10"),
    (dict(prompt="x" * 10_000), "more than max_model_len"),
    (dict(prompt=""), "prompt is empty"),
])
def test_each_bad_request_is_refused_naming_the_problem(tokenizer, fields, why):
    with pytest.raises(RequestRejected) as caught:
        builder(tokenizer, max_prompt_tokens=64 if "prompt_logprobs" not in why else None,
                max_priority=10).build(CLIENT, received(**{
            "request_id": "r", "prompt": "hi", **fields}))
    assert why in str(caught.value)


@pytest.mark.parametrize("sampling, stop, why", [
    ({"temprature": 1.0}, [], "unknown sampling parameter(s) ['temprature']"),
    ({"top_p": 7.0}, [], "top_p must be in (0, 1], got 7.0"),
    ({"stop": ["b"] * 40}, ["a"] * 40, "stop may have at most 64 strings, got 80"),
])
def test_bad_sampling_is_refused_as_the_frame_is_read_by_the_structs_own_validator(sampling, stop, why):
    frame = p.GenerateReq(request_id="r", prompt="hi", sampling=sampling, stop=stop).encode()
    with pytest.raises(p.ProtocolError) as caught:
        p.decode(frame)
    assert why in str(caught.value) and caught.value.request_id == "r"  # answered to that request


def test_a_client_keys_own_priority_ceiling_holds_below_the_services(tokenizer):
    ceilings = {"key-a": 2}
    build = builder(tokenizer, max_priority=10, key_max_priority=ceilings.get).build
    build(CLIENT, received(request_id="r", prompt="hi", priority=5), key="key-b")
    with pytest.raises(RequestRejected, match="this client key's ceiling of 2"):
        build(CLIENT, received(request_id="r", prompt="hi", priority=5), key="key-a")


def test_cache_salts_part_clients_and_keep_each_clients_own_salt_apart(tokenizer):
    build = builder(tokenizer, cache_salt_per_client=True).build

    def salt(client: bytes, key: str | None = None, own: str | None = None) -> str:
        sampling = SamplingParams(cache_salt=own)
        return p.decode(build(client, received(request_id="r", prompt="hi", sampling=sampling), key)).sampling.cache_salt
    assert salt(CLIENT) == salt(CLIENT) != salt(b"\x08" * 5)
    assert salt(CLIENT, key="k") == salt(b"\x08" * 5, key="k")  # one key, one client, whatever its routing id
    assert salt(CLIENT, own="a") != salt(CLIENT, own="b") != salt(CLIENT)
    assert p.decode(builder(tokenizer).build(CLIENT, received(request_id="r", prompt="hi"))).sampling.cache_salt is None


def test_a_tenant_is_taken_only_from_a_connection_without_a_key_of_its_own(tokenizer):
    """The HTTP front (the service's own key, or no CURVE: `key` None) names whom a request is for;
    a client with a key of its own may not, or it could take another's share and cache salt."""
    build = builder(tokenizer, cache_salt_per_client=True).build

    def sent(tenant: str | None, key: str | None = None, client: bytes = CLIENT) -> p.TokenizedReq:
        return p.decode(build(client, received(request_id="r", prompt="hi", tenant=tenant), key))
    a, b = sent("key:aaaa"), sent("key:bbbb")
    assert a.tenant == "front:key:aaaa" and b.tenant == "front:key:bbbb"  # one front, two clients
    assert a.sampling.cache_salt != b.sampling.cache_salt == sent("key:bbbb", client=b"\x08" * 5).sampling.cache_salt
    assert sent(None).tenant == "id:" + CLIENT.hex() and sent(None, key="k").tenant == "key:k"
    with pytest.raises(RequestRejected, match="only the service's HTTP front.*may say whom a request is for"):
        sent("key:aaaa", key="k")
    with pytest.raises(p.ProtocolError, match="tenant must be a non-empty string of at most 128"):
        received(request_id="r", prompt="hi", tenant="x" * 129)
