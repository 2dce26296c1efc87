"""response_format: its checks and limits, and the matcher on the default model's vocabulary."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

from nanovllm.sampling_params import SamplingParams
from nanovllm.structured import (MAX_CHOICES, MAX_FORMAT_CHARS, MAX_SCHEMA_CHARS, MAX_SCHEMA_DEPTH, StructuredOutput,
                                 check_response_format, compile_format, ll_tokenizer)

PERSON = {"type": "json_schema", "json_schema": {"name": "p", "schema": {
    "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def tok():
    from nanovllm.models.tokenizer import load_tokenizer

    t = load_tokenizer("default")
    return t, ll_tokenizer(t, len(t))


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}


@pytest.mark.parametrize("fmt, message", [
    ({"type": "xml"}, "type must be one of"),
    ([1], "must be a map"),
    ({"type": "json_schema"}, "needs {'json_schema'"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}, "unknown key"),
    ({"type": "regex", "regex": ""}, "non-empty string 'regex'"),
    ({"type": "choice", "choices": []}, "'choices'"),
    ({"type": "choice", "choices": ["a"] * (MAX_CHOICES + 1)}, "'choices'"),
    ({"type": "json_object", "extra": 1}, "unknown key"),
    (nested(MAX_SCHEMA_DEPTH // 2), "nests containers deeper than"),
    ({"type": "regex", "regex": "a" * (MAX_FORMAT_CHARS + 1)}, "characters of JSON"),
    ("{not json", "not valid JSON text"),
])
def test_bad_formats_are_refused_naming_the_problem(fmt, message):
    with pytest.raises(ValueError, match=message):
        check_response_format(fmt)
    with pytest.raises(ValueError, match=message):
        SamplingParams(response_format=fmt)


def test_the_wire_carries_a_schema_as_json_text_whatever_its_depth():
    fmt = nested(20)
    wire = SamplingParams(response_format=fmt).to_dict()
    assert isinstance(wire["response_format"], str)
    assert SamplingParams.from_dict(wire).response_format == fmt
    assert SamplingParams(response_format={"type": "text"}).response_format is None


@pytest.mark.parametrize("fmt, message", [
    ({"type": "regex", "regex": "(unclosed"}, "does not compile"),
    ({"type": "grammar", "grammar": "start: undefined_rule"}, "does not compile"),
    ({"type": "json_schema", "json_schema": {"name": "r", "schema": {"$ref": "#/$defs/missing"}}}, "does not compile"),
])
def test_invalid_grammars_do_not_compile(tok, fmt, message):
    with pytest.raises(ValueError, match=message):
        compile_format(check_response_format(fmt), tok[1])


def test_recursive_ref_compiles_and_stays_bounded(tok):
    schema = {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"}
    compile_format(check_response_format({"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}),
                   tok[1])


def greedy_walk(so: StructuredOutput, tokenizer, prefer: str, steps: int = 40) -> list[int]:
    """Follow the mask, preferring the tokens that spell `prefer` (the mask decides what is legal)."""
    out: list[int] = []
    for _ in range(steps):
        logits = torch.zeros(so.n_vocab + 7)  # a model's vocabulary may be padded past the tokenizer's
        target = tokenizer.encode(prefer[len(tokenizer.decode(out)):] or " ", add_special_tokens=False)
        if target:
            logits[target[0]] = 5.0
        so(out, logits)
        assert torch.isinf(logits[so.n_vocab:]).all()
        t = int(logits.argmax())
        out.append(t)
        if t == tokenizer.eos_token_id:
            break
    return out


def test_the_mask_spells_only_what_the_schema_allows_then_eos(tok):
    tokenizer, lltok = tok
    so = StructuredOutput(compile_format(check_response_format(PERSON), lltok).grammar, lltok)
    out = greedy_walk(so, tokenizer, 'I think {"name": "Bob", "age": 7}')
    assert out[-1] == tokenizer.eos_token_id
    value = json.loads(tokenizer.decode(out[:-1]))
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)


def test_a_restarted_or_preempted_output_is_followed_from_the_start(tok):
    tokenizer, lltok = tok
    fmt = check_response_format({"type": "choice", "choices": ["yes", "no"]})
    so = StructuredOutput(compile_format(fmt, lltok).grammar, lltok)
    yes = tokenizer.encode("yes", add_special_tokens=False)
    no = tokenizer.encode("no", add_special_tokens=False)
    assert so.allowed(yes[:1])[yes[1]] if len(yes) > 1 else so.allowed(yes)[tokenizer.eos_token_id]
    # Another output (a recomputed request, an engine continuing a client's stream) replaces it.
    allowed = so.allowed(no)
    assert allowed[tokenizer.eos_token_id] and allowed.sum() == 1
    fresh = StructuredOutput(compile_format(fmt, lltok).grammar, lltok)
    assert (fresh.allowed(no) == allowed).all()
    with pytest.raises(ValueError, match="does not fit"):
        so.allowed(tokenizer.encode("maybe", add_special_tokens=False))


def test_the_tokenizer_stage_passes_a_format_on_checked_and_leaves_the_compile_to_the_engine(tok):
    """A format is compiled once, where it is enforced: the engine (its input thread, cached by
    text; `tests/service/test_structured_output.py` holds its refusals). The tokenizer stage checks
    its shape with the struct's validator and passes it on; it loads no grammar compiler."""
    from nanovllm_client import protocol as p
    from tokenizer_proc.requests import RequestBuilder

    builder = RequestBuilder(tok[0])
    for fmt in (PERSON, {"type": "regex", "regex": "(unclosed"}):
        req = p.GenerateReq(request_id="r", prompt="hi", sampling=SamplingParams(max_tokens=8, response_format=fmt))
        out = p.decode(builder.build(b"\x01" * 5, p.decode(req.encode())))
        assert out.sampling.response_format == fmt and out.meta.sampling.response_format is None
    code = ("import sys; from tokenizer_proc.requests import RequestBuilder; import tokenizer_proc.server; "
            "print('llguidance' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=pathlib.Path(__file__).parents[2]).stdout.strip() == "False"


def schema_format(schema: dict) -> dict:
    return check_response_format({"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})


def follow(so: StructuredOutput, lltok, text: str):
    """The allowed-token mask after the tokens of `text` (which the grammar must allow)."""
    return so.allowed(lltok.tokenize_str(text))


def test_unknown_formats_are_ignored_as_json_schema_says(tok):
    """`format` is an annotation: a value this compiler does not know constrains nothing, and
    needs no check of the output (a known one, `date`, is still enforced)."""
    tokenizer, lltok = tok
    schema = {"type": "object", "properties": {"data": {"type": "string", "format": "byte"},
                                               "link": {"type": "string", "format": "uri-reference"},
                                               "day": {"type": "string", "format": "date"}},
              "required": ["data", "link", "day"], "additionalProperties": False}
    compiled = compile_format(schema_format(schema), lltok)
    assert compiled.check is None
    so = StructuredOutput(compiled.grammar, lltok)
    out = greedy_walk(so, tokenizer, '{"data":"not base64!","link":"../up","day":"2026-12-07"}', steps=80)
    assert out[-1] == tokenizer.eos_token_id
    assert json.loads(tokenizer.decode(out[:-1])) == {"data": "not base64!", "link": "../up", "day": "2026-12-07"}
    with pytest.raises(ValueError, match="does not fit"):
        so.allowed(lltok.tokenize_str('{"data":"a","link":"b","day":"yesterday"'))


UNIQUE_PAIR = {"type": "array", "items": {"enum": [1, 2]}, "minItems": 2, "maxItems": 2, "uniqueItems": True}


def test_a_keyword_the_grammar_cannot_express_is_checked_where_the_output_would_end(tok):
    tokenizer, lltok = tok
    compiled = compile_format(schema_format(UNIQUE_PAIR), lltok)
    assert compiled.check is not None and "uniqueItems" in compiled.check.relaxed[0]
    allowed = follow(StructuredOutput(compiled.grammar, lltok, compiled.check), lltok, "[1,2]")
    assert allowed[tokenizer.eos_token_id] and allowed.sum() == 1
    # [1,1] is the grammar's (items from the enum, two of them) but not the schema's: it may not
    # end, and the grammar allows nothing else, so the request fails with the reason.
    so = StructuredOutput(compiled.grammar, lltok, compiled.check)
    with pytest.raises(ValueError, match=r"does not satisfy the schema at \$: \[1, 1\] has non-unique.*uniqueItems"):
        follow(so, lltok, "[1,1]")
    # Followed again from its start (a recomputed request), another output ends where it may.
    assert follow(so, lltok, "[2")[tokenizer.eos_token_id] == 0 and follow(so, lltok, "[2,1]")[tokenizer.eos_token_id]


def test_a_oneof_it_cannot_prove_exclusive_may_end_only_where_exactly_one_branch_holds(tok):
    tokenizer, lltok = tok
    compiled = compile_format(schema_format({"oneOf": [{"type": "integer"}, {"minimum": 2}]}), lltok)
    assert compiled.check is not None and "oneOf" in compiled.check.relaxed[0]

    def after(text: str):
        return follow(StructuredOutput(compiled.grammar, lltok, compiled.check), lltok, text)

    assert after("1")[tokenizer.eos_token_id]  # an integer below 2: one branch
    three = after("3")  # both branches: the output goes on (3.5 holds one) instead of ending
    assert not three[tokenizer.eos_token_id] and three.sum() > 0
    assert after("3.5")[tokenizer.eos_token_id]


def test_a_schema_past_the_old_64_kib_compiles_and_one_past_the_limit_is_refused(tok):
    def wide(n: int) -> dict:
        return {"type": "object", "properties": {f"field_{i:05d}": {"type": "string", "description": "x" * 40}
                                                 for i in range(n)}}
    big = {"type": "object", "properties": {f"field_{i}": {"type": "string", "description": "x" * 4000}
                                            for i in range(20)}, "required": [f"field_{i}" for i in range(20)]}
    assert len(json.dumps(big)) > 64 * 1024
    so = StructuredOutput(compile_format(schema_format(big), tok[1]).grammar, tok[1])
    assert so.allowed(tok[1].tokenize_str('{"field_0":"a","field_1":"'))[tok[1].tokenize_str("b")[0]]
    too_big = wide(MAX_SCHEMA_CHARS // 60)
    assert len(json.dumps(too_big)) > MAX_SCHEMA_CHARS
    with pytest.raises(ValueError, match=f"characters of JSON, at most {MAX_SCHEMA_CHARS} for a json_schema"):
        schema_format(too_big)
    with pytest.raises(ValueError, match=f"at most {MAX_FORMAT_CHARS} \\({MAX_SCHEMA_CHARS} for a json_schema\\)"):
        check_response_format({"type": "regex", "regex": "a" * (MAX_FORMAT_CHARS + 1)})


def test_a_ref_chain_that_overflows_a_default_thread_stack_compiles_on_the_cache_thread(tok):
    """llguidance recurses over nesting as it compiles: 1,500 chained `$ref`s (~110 KB) overflow
    an 8 MiB stack and would kill the process. The cache compiles on its own deep-stack thread,
    in a child process here so that a regression fails this test instead of the whole run."""
    code = """if True:
        import json, threading
        threading.stack_size(8 << 20)  # the default of a Linux thread, whatever this shell's ulimit
        from nanovllm.models.tokenizer import load_tokenizer
        from nanovllm.structured import check_response_format, ll_tokenizer
        from nanovllm.structured.cache import GrammarCache
        t = load_tokenizer("default")
        n = 1500
        defs = {f"d{i}": {"type": "object", "properties": {"n": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
        defs[f"d{n}"] = {"type": "string"}
        fmt = check_response_format({"type": "json_schema", "json_schema": {"name": "c", "schema": {
            "$defs": defs, "$ref": "#/$defs/d0"}}})
        result = {}
        def run():
            so = GrammarCache(ll_tokenizer(t, len(t))).structured(fmt)
            result["ok"] = bool(so.allowed([]).any())
        th = threading.Thread(target=run)
        th.start()
        th.join()
        print(json.dumps(result))
    """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=pathlib.Path(__file__).parents[2])
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"ok": True}
