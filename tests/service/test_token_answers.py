"""The tokenizer stage's answers to tokenize and detokenize commands (`tokenizer_proc.tokens`),
without sockets: the frames as a client encodes them, decoded as the stage decodes them."""
from __future__ import annotations

import pytest

from nanovllm.models.tokenizer import load_tokenizer
from nanovllm_client import protocol as p
from tokenizer_proc.tokens import TokenAnswers


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


def received(msg: p.Message) -> p.Message:
    return p.decode(msg.encode())


def test_a_text_and_a_chat_tokenize_as_a_requests_prompt_would(tokenizer):
    answers = TokenAnswers(tokenizer, max_model_len=512)
    out = answers.answer(received(p.TokenizeReq("t1", prompt="def f(x): return x", return_token_strs=True)))
    ids = tokenizer.encode("def f(x): return x")
    assert isinstance(out, p.TokenizeOutput) and p.unpack_token_ids(out.token_ids) == ids
    assert out.token_strs == tokenizer.convert_ids_to_tokens(ids) and out.max_model_len == 512
    chat = [{"role": "user", "content": "hi"}]
    out = answers.answer(received(p.TokenizeReq("t2", messages=chat)))
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert p.unpack_token_ids(out.token_ids) == tokenizer.encode(text, add_special_tokens=False)
    assert out.token_strs is None
    back = answers.answer(received(p.DetokenizeReq("d1", p.pack_token_ids(ids))))
    assert isinstance(back, p.DetokenizeOutput) and back.text == "def f(x): return x"


def test_what_cannot_be_served_is_an_error_under_the_commands_id(tokenizer):
    answers = TokenAnswers(tokenizer, max_model_len=16)
    vocab = len(tokenizer)
    for req, words in [(p.DetokenizeReq("d1", [1, vocab, 2]), f"tokens[1] = {vocab} is outside the vocabulary"),
                       (p.DetokenizeReq("d2", [1] * 17), "more than the 16"),
                       (p.TokenizeReq("t1", prompt="x" * (64 * 16 + 1)), "more than max_model_len 16"),
                       (p.TokenizeReq("t2", messages=[{"role": "user", "content": "x"}], tools="[1]"),
                        "tools must be a list of tool objects")]:
        out = answers.answer(received(req))
        assert isinstance(out, p.ErrorOutput) and out.request_id == req.request_id and words in out.message, out


def test_a_malformed_command_is_refused_when_decoded():
    for msg, words in [(p.TokenizeReq("t", prompt="x", messages=[{"role": "user", "content": "x"}]), "exactly one"),
                       (p.TokenizeReq("t", messages=[{"role": "user", "content": "x"}], continue_final_message=True),
                        "continue_final_message cannot be combined"),
                       (p.TokenizeReq("t", prompt="x", tools="[]"), "only with messages"),
                       (p.DetokenizeReq("d", [-1]), "non-negative")]:
        with pytest.raises(p.ProtocolError, match=words):
            p.decode(msg.encode())
