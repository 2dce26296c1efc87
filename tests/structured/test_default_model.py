"""response_format on the real default model through LLM.generate: 32 prompts with schemas
(nested objects, arrays, enums, ranged numbers, required fields, string patterns), greedy and
sampled in every mode, each output parsed and validated; regex, grammar and choice the same way;
and what wins where two constraints conflict. One engine for the module, batched calls."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from nanovllm.sampling_params import SamplingParams

ROLE = {"enum": ["admin", "user", "guest"]}
NAME = {"type": "string", "minLength": 1, "maxLength": 12}
AGE = {"type": "integer", "minimum": 18, "maximum": 99}
SCORE = {"type": "number", "minimum": 0, "maximum": 1}
CODE = {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}
TAGS = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}
POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                          "y": {"type": "integer", "minimum": -9, "maximum": 9}},
         "required": ["x", "y"], "additionalProperties": False}


def obj(**props) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


SCHEMAS = [
    obj(name=NAME, age=AGE), obj(name=NAME, role=ROLE), obj(code=CODE, score=SCORE), obj(tags=TAGS),
    obj(user=obj(name=NAME, age=AGE), role=ROLE), obj(point=POINT), obj(points={"type": "array", "items": POINT,
                                                                             "maxItems": 2}),
    obj(ok={"type": "boolean"}, code=CODE), obj(role=ROLE, tags=TAGS, age=AGE),
    obj(owner=obj(name=NAME, address=obj(city=NAME, zip={"type": "string", "pattern": "^[0-9]{5}$"}))),
]
PROMPTS = ["Describe a user as JSON.", "Return a JSON record for Alice.", "Give me data about a product.",
           "Output JSON only.", "Reply in JSON with keys name and age."]
CASES = [(PROMPTS[i % len(PROMPTS)], SCHEMAS[i % len(SCHEMAS)]) for i in range(32)]


def fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def llm():
    from nanovllm import LLM

    llm = LLM("default")
    yield llm
    llm.engine.close()


def chat(llm, text: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)


SAMPLED = [dict(temperature=0.8, seed=1), dict(temperature=1.0, top_k=20, seed=2), dict(temperature=0.9, top_p=0.8),
           dict(temperature=0.7, min_p=0.1, seed=3), dict(temperature=1.0, repetition_penalty=1.3, seed=4),
           dict(temperature=0.8, frequency_penalty=0.5, presence_penalty=0.5),
           dict(temperature=0, logit_bias={90: 5.0, 216: -5.0}), dict(temperature=0)]


def test_every_output_parses_and_validates_greedy_and_sampled(llm):
    prompts = [chat(llm, p) for p, _ in CASES] * 2
    params = [SamplingParams(max_tokens=96, temperature=0, response_format=fmt(s)) for _, s in CASES]
    params += [SamplingParams(max_tokens=96, response_format=fmt(s), **SAMPLED[i % len(SAMPLED)])
               for i, (_, s) in enumerate(CASES)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, (_, schema) in zip(outs, CASES * 2):
        assert out["finish_reason"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), schema)


def test_regex_grammar_choice_and_json_object(llm):
    date = r"[0-9]{4}-(0[1-9]|1[0-2])-[0-3][0-9]"
    lark = 'start: "(" expr ")"\nexpr: NUM (OP NUM)*\nNUM: /[0-9]{1,3}/\nOP: "+" | "-" | "*"'
    cases = [({"type": "regex", "regex": date}, lambda t: re.fullmatch(date, t)),
             ({"type": "grammar", "grammar": lark}, lambda t: re.fullmatch(r"\(\d{1,3}([+*-]\d{1,3})*\)", t)),
             ({"type": "choice", "choices": ["positive", "negative", "neutral"]},
              lambda t: t in ("positive", "negative", "neutral")),
             ({"type": "json_object"}, lambda t: isinstance(json.loads(t), dict))]
    prompts, params, checks = [], [], []
    for i in range(0, 8, 2):
        for f, ok in cases:
            prompts.append(chat(llm, f"Answer {i}: what date, sum, mood or record?"))
            params.append(SamplingParams(max_tokens=64, response_format=f, **SAMPLED[i]))
            checks.append(ok)
    for out, ok, p in zip(llm.generate(prompts, params, use_tqdm=False), checks, params):
        if p.response_format["type"] != "json_object":  # any object may run past 64 tokens
            assert out["finish_reason"] == "stop", out
        if out["finish_reason"] == "stop":
            assert ok(out["text"]), out


def test_max_tokens_first_gives_length_and_the_partial_output(llm):
    out = llm.generate([chat(llm, "Numbers.")], SamplingParams(max_tokens=5, temperature=0, response_format=fmt(
        {"type": "array", "items": {"type": "integer"}, "minItems": 20})), use_tqdm=False)[0]
    assert out["finish_reason"] == "length" and out["text"].startswith("[") and len(out["token_ids"]) == 5


def test_the_grammar_refuses_min_tokens_and_a_stop_string_wins_over_the_grammar(llm):
    with pytest.raises(ValueError, match="min_tokens cannot be combined with response_format"):
        SamplingParams(min_tokens=8, response_format={"type": "choice", "choices": ["yes", "no"]})
    stopped = llm.generate([chat(llm, "A name?")], SamplingParams(
        max_tokens=64, temperature=0, stop=['"'], response_format=fmt(obj(name=NAME))), use_tqdm=False)[0]
    assert stopped["text"] == "{" and stopped["finish_reason"] == "stop", stopped


def test_masks_computed_during_the_forward_give_the_outputs_computed_after_it(llm):
    """Grammar masks prefetched while the forward runs (the default) and computed in the sampler
    after it give the same tokens, greedy and seeded. A first run puts the prompts in the prefix
    cache, so the two compared runs compute exactly the same logits."""
    cases = CASES[:10]
    prompts = [chat(llm, p) for p, _ in cases]
    params = [SamplingParams(max_tokens=40, response_format=fmt(s),
                             **(dict(temperature=0) if i % 2 else dict(temperature=0.9, top_p=0.95, seed=i)))
              for i, (_, s) in enumerate(cases)]
    masks = llm.engine.sampler.masks
    llm.generate(prompts, params, use_tqdm=False)
    before = masks.num_prefetched
    ahead = llm.generate(prompts, params, use_tqdm=False)
    assert masks.num_prefetched - before == sum(len(o["token_ids"]) for o in ahead)  # every token's mask, ahead
    masks.enabled = False
    try:
        before = masks.num_prefetched
        after = llm.generate(prompts, params, use_tqdm=False)
        assert masks.num_prefetched == before
    finally:
        masks.enabled = True
    assert [o["token_ids"] for o in ahead] == [o["token_ids"] for o in after]
    for out, (_, schema) in zip(ahead, cases):
        if out["finish_reason"] == "stop":
            jsonschema.validate(json.loads(out["text"]), schema)


def test_masks_filled_in_parallel_give_the_outputs_filled_one_by_one(llm):
    """A step's grammar masks filled by one parallel llguidance call (two threads) and row by row
    give the same tokens, greedy and seeded, on a batch of mixed schemas and formats."""
    cases = CASES[10:18]
    prompts = [chat(llm, p) for p, _ in cases] + [chat(llm, "Pick one."), chat(llm, "A product code?")]
    formats = [fmt(s) for _, s in cases] + [{"type": "choice", "choices": ["red", "green", "blue"]},
                                             {"type": "regex", "regex": "[A-Z]{2}-[0-9]{3}"}]
    params = [SamplingParams(max_tokens=32, response_format=f,
                             **(dict(temperature=0) if i % 2 else dict(temperature=0.9, top_k=40, seed=i)))
              for i, f in enumerate(formats)]
    masks = llm.engine.sampler.masks
    threads = masks.threads
    llm.generate(prompts, params, use_tqdm=False)  # the prompts into the prefix cache: the same logits below
    try:
        masks.threads = 1
        before = masks.num_filled_in_parallel
        serial = llm.generate(prompts, params, use_tqdm=False)
        assert masks.num_filled_in_parallel == before
        masks.threads = 2
        before = masks.num_filled_in_parallel
        parallel = llm.generate(prompts, params, use_tqdm=False)
        assert masks.num_filled_in_parallel > before
    finally:
        masks.threads = threads
    assert [o["token_ids"] for o in parallel] == [o["token_ids"] for o in serial]
    assert parallel[-2]["text"] in ("red", "green", "blue") and re.fullmatch("[A-Z]{2}-[0-9]{3}", parallel[-1]["text"])


NEAR_TIE = 0.25
"""Nats between two tokens' log-probabilities below which another order of summation may swap
them: bfloat16 logits of size 10 to 30 carry errors of about 0.1."""
INVENTORY = " ".join(f"Shelf {i} holds {3 * i % 17} boxes of item {i * 7 % 31}." for i in range(40))


def test_greedy_output_with_the_prefix_cache_parts_from_the_output_without_only_at_a_near_tie(llm):
    """A long prompt run cold, then found in the prefix cache: the greedy token ids agree up to
    the first place where the two runs choose differently, and there the two choices were within
    NEAR_TIE of each other in both runs (a near-tie that another order of summation may break
    either way). Both outputs follow the schema."""
    schema = obj(name=NAME, age=AGE, role=ROLE)
    prompt = chat(llm, INVENTORY + " Describe the shelf keeper as JSON.")
    params = SamplingParams(max_tokens=48, temperature=0, logprobs=20, response_format=fmt(schema))
    hits = llm.engine.block_manager.prefix_cache_hits
    cold = llm.generate([prompt], params, use_tqdm=False)[0]
    warm_hits = llm.engine.block_manager.prefix_cache_hits
    warm = llm.generate([prompt], params, use_tqdm=False)[0]
    prompt_tokens = len(llm.tokenizer.encode(prompt))
    assert warm_hits - hits <= 32  # cold: at most the chat template's shared preamble was cached
    assert llm.engine.block_manager.prefix_cache_hits - warm_hits >= prompt_tokens - 2 * llm.engine.config.block_size
    for out in (cold, warm):
        assert out["finish_reason"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), schema)
    parted = next((k for k, (a, b) in enumerate(zip(cold["token_ids"], warm["token_ids"])) if a != b), None)
    if parted is None:
        assert cold["token_ids"] == warm["token_ids"]
        return
    for run in (cold, warm):
        lp = run["logprobs"][parted]
        top = dict(zip(lp.top_token_ids, lp.top_logprobs))
        a, b = cold["token_ids"][parted], warm["token_ids"][parted]
        assert a in top and b in top and abs(top[a] - top[b]) < NEAR_TIE, (parted, a, b, top)
