"""Prefix-cache isolation through the service: `cache_salt` per request, and the tokenizer's
--cache-salt-per-client, under which a client's right guess of another's prompt gets no more of
it from the cache than a wrong guess does (without it, `usage.cached_tokens` gives the guess away)."""
from __future__ import annotations

import random

import pytest

from nanovllm_client import Client
from tests.service.conftest import TINY_ENGINE_ARGS, start_service
from tests.service.harness import short_tmpdir

BLOCK = 16  # the engine's default block size


def memo_and_guesses() -> tuple[list[int], list[int], list[int]]:
    """A confidential prompt (a shared first block, then 300 tokens of its own), a right guess of
    it, and a wrong one that shares only the first block."""
    rng = random.Random(29)
    head = [rng.randrange(3, 2000) for _ in range(BLOCK)]
    secret = [rng.randrange(3, 2000) for _ in range(300)]
    other = [rng.randrange(3, 2000) for _ in range(300)]
    return head + secret, head + secret, head + other


def cached_tokens(url: str, prompt: list[int], **sampling) -> int:
    """What a fresh client (its own identity) is told came from the cache for `prompt`."""
    with Client(url, timeout=120, connect_timeout=60) as c:
        return c.generate(prompt_token_ids=prompt, max_tokens=2, ignore_eos=True, **sampling).usage["cached_tokens"]


@pytest.fixture(scope="module")
def salted_service(tiny_model_dir):
    procs = start_service(tiny_model_dir, f"ipc://{short_tmpdir()}/svc", engine_args=TINY_ENGINE_ARGS,
                          env={"tokenizer_proc": {"NANOVLLM_CACHE_SALT_PER_CLIENT": "1"}})
    yield procs
    procs.stop()


def test_without_salting_the_cache_gives_a_right_guess_away(service):
    memo, right, wrong = memo_and_guesses()
    memo = [t + 1 for t in memo]  # a memo of its own: the shared service may have seen the other
    right, wrong = [t + 1 for t in right], [t + 1 for t in wrong]
    cached_tokens(service.url, memo)
    assert cached_tokens(service.url, wrong) == BLOCK
    assert cached_tokens(service.url, right) >= 300  # what the salting below takes away


def test_salted_per_client_a_right_guess_gets_no_more_than_a_wrong_one(salted_service):
    url = salted_service.url
    memo, right, wrong = memo_and_guesses()
    with Client(url, timeout=120, connect_timeout=60) as owner:
        first = owner.generate(prompt_token_ids=memo, max_tokens=2, ignore_eos=True)
        again = owner.generate(prompt_token_ids=memo, max_tokens=2, ignore_eos=True)
    assert first.usage["cached_tokens"] == 0
    assert again.usage["cached_tokens"] >= 300  # a client's own prompts are still cached for it
    guessed, missed = cached_tokens(url, right), cached_tokens(url, wrong)
    assert guessed <= missed, (guessed, missed)
    assert guessed == 0


def test_a_clients_own_salt_narrows_its_sharing_further(salted_service):
    memo, _, _ = memo_and_guesses()
    memo = [t + 2 for t in memo]
    with Client(salted_service.url, timeout=120, connect_timeout=60) as c:
        c.generate(prompt_token_ids=memo, max_tokens=2, ignore_eos=True, cache_salt="conversation-1")
        same = c.generate(prompt_token_ids=memo, max_tokens=2, ignore_eos=True, cache_salt="conversation-1")
        other = c.generate(prompt_token_ids=memo, max_tokens=2, ignore_eos=True, cache_salt="conversation-2")
    assert same.usage["cached_tokens"] >= 300 and other.usage["cached_tokens"] == 0


def test_a_bad_salt_is_refused_naming_it(client):
    from nanovllm_client import SamplingError

    with pytest.raises(SamplingError, match="cache_salt must be null or a non-empty string"):
        client.generate("x", max_tokens=2, cache_salt="")
