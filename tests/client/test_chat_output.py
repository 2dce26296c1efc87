"""The chat output parser of the HTTP front: reasoning, tool calls and content, the same whether
the text arrives whole or in pieces split anywhere (one parser for streaming and not)."""
import json

import pytest

from nanovllm_client.http.chat_output import ChatOutputParser


def parse(pieces, tools=True, reasoning=True, max_calls=None, reasoning_open=False):
    """(content, reasoning, [(name, arguments)]) from the events, as a client assembles them."""
    parser = ChatOutputParser(tools=tools, reasoning=reasoning, max_calls=max_calls, reasoning_open=reasoning_open)
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    content = "".join(e.text for e in events if e.kind == "content")
    thought = "".join(e.text for e in events if e.kind == "reasoning")
    calls: dict[int, list] = {}
    for e in events:
        if e.kind == "call":
            assert e.index not in calls and e.call_id.startswith("call_")
            calls[e.index] = [e.name, ""]
        elif e.kind == "arguments":
            calls[e.index][1] += e.text  # arguments only ever follow their call's start
    assert [(c.name, c.arguments) for c in parser.calls] == [tuple(calls[i]) for i in sorted(calls)]
    return content, thought, [tuple(calls[i]) for i in sorted(calls)]


WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c}\\"{"}}'
CASES = [
    # (text, tools, expected (content, reasoning, calls))
    ("Hello there.", True, ("Hello there.", "", [])),
    ("<think>\nThe user wants weather.\n</think>\n\nIt is sunny.", False,
     ("It is sunny.", "\nThe user wants weather.\n", [])),
    ("Let me check. <tool_call>\n" + WEATHER + "\n</tool_call>", True,
     ("Let me check. ", "", [("get_weather", '{"city": "Paris", "unit": "c}\\"{"}')])),
    ("<think>hmm</think><tool_call>" + WEATHER + "</tool_call>\n<tool_call>\n"
     '{"name": "now", "arguments": {}}\n</tool_call>', True,
     ("", "hmm", [("get_weather", '{"city": "Paris", "unit": "c}\\"{"}'), ("now", "{}")])),
    # arguments before the name: read whole once the call closes
    ('<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>', True, ("", "", [("f", '{"x": 1}')])),
    # not a call: stays text, as does every tag when the request offered no tools
    ("<tool_call>not json</tool_call> ok", True, ("<tool_call>not json</tool_call> ok", "", [])),
    ("a <tool_call>" + WEATHER + "</tool_call>", False, ("a <tool_call>" + WEATHER + "</tool_call>", "", [])),
    # cut off by max_tokens: an unclosed call head is text; unclosed arguments go as far as they went
    ('<tool_call>{"na', True, ('<tool_call>{"na', "", [])),
    ('<tool_call>{"name": "f", "arguments": {"city": "Par', True, ("", "", [("f", '{"city": "Par')])),
    # <think> counts only where the output opens; an unclosed one is all reasoning
    ("So <think>x</think>", True, ("So <think>x</think>", "", [])),
    ("  <think>still thinking", True, ("", "still thinking", [])),
    ("<thinking>", True, ("<thinking>", "", [])),
    ("<tool", True, ("<tool", "", [])),
    # Llama 3.x: a bare call that opens the output, several joined by ";"
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', True,
     ("", "", [("get_weather", '{"city": "Paris"}')])),
    ('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": [1]}}', True,
     ("", "", [("a", "{}"), ("b", '{"x": [1]}')])),
    ('{"parameters": {"x": 1}, "name": "f"}', True, ("", "", [("f", '{"x": 1}')])),
    ('{"answer": 42}', True, ('{"answer": 42}', "", [])),
    ('{"name": "f", "parameters": {}}', False, ('{"name": "f", "parameters": {}}', "", [])),
]


@pytest.mark.parametrize("text, tools, want", CASES)
def test_whole_and_in_pieces_split_anywhere_agree(text, tools, want):
    assert parse([text], tools) == want
    assert parse(list(text), tools) == want  # a character at a time
    for cut in range(1, len(text)):
        assert parse([text[:cut], text[cut:]], tools) == want, cut


def test_reasoning_off_leaves_think_as_content():
    assert parse(["<think>a</think>b"], tools=False, reasoning=False) == ("<think>a</think>b", "", [])


def test_arguments_stream_as_they_arrive():
    parser = ChatOutputParser(tools=True)
    assert parser.feed("<tool_call>\n{\"name\": \"get_weather\", ") == []  # the name is not known yet
    started = parser.feed('"arguments": {"ci')
    assert [(e.kind, e.name or e.text) for e in started] == [("call", "get_weather"), ("arguments", '{"ci')]
    assert [(e.kind, e.text) for e in parser.feed('ty": "Oslo"}')] == [("arguments", 'ty": "Oslo"}')]
    assert parser.feed("}\n</tool_call>") == [] and parser.finish() == []
    assert json.loads(parser.calls[0].arguments) == {"city": "Oslo"}


ONE_CALL_CASES = [
    # parallel_tool_calls false: the first complete call, nothing after it
    ("<tool_call>" + WEATHER + "</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call> bye",
     ("", "", [("get_weather", '{"city": "Paris", "unit": "c}\\"{"}')])),
    ('Checking. <tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call><tool_call>{"name": "g", "arguments": {}}',
     ("Checking. ", "", [("f", '{"x": 1}')])),
    ('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": [1]}}', ("", "", [("a", "{}")])),
    ("No call at all.", ("No call at all.", "", [])),
]


@pytest.mark.parametrize("text, want", ONE_CALL_CASES)
def test_one_call_at_most_whole_and_in_pieces(text, want):
    assert parse([text], max_calls=1) == want
    for size in (1, 3, 7):
        assert parse([text[i:i + size] for i in range(0, len(text), size)], max_calls=1) == want


OPEN_CASES = [
    # the chat template opened <think> in the prompt: the output starts inside the reasoning
    ("The user asks.\n</think>\n\nIt is sunny.", True, ("It is sunny.", "The user asks.\n", [])),
    ("hmm</think><tool_call>" + WEATHER + "</tool_call>", True,
     ("", "hmm", [("get_weather", '{"city": "Paris", "unit": "c}\\"{"}')])),
    ("still thinking when max_tokens ran out", False, ("", "still thinking when max_tokens ran out", [])),
    ("</think>at once", False, ("at once", "", [])),
    # a <think> the model writes itself is reasoning text here, not a second opening
    ("<think>x</think>y", False, ("y", "<think>x", [])),
]


@pytest.mark.parametrize("text, tools, want", OPEN_CASES)
def test_a_prompt_that_opened_think_starts_the_output_as_reasoning(text, tools, want):
    assert parse([text], tools, reasoning_open=True) == want
    for cut in range(1, len(text)):
        assert parse([text[:cut], text[cut:]], tools, reasoning_open=True) == want, cut
    # reasoning off: nothing is reasoning, whatever the prompt did
    assert parse([text], tools, reasoning=False, reasoning_open=True)[1] == ""
