"""Tool-call parsers on crafted model outputs: whole and streamed, Hermes/Qwen and Llama 3.1 JSON."""

import json

import pytest

from stallfree.engine.server.tool_calls.parsers import (
    HermesParser,
    Llama3JsonParser,
    NamedParser,
    RequiredParser,
    resolve_parser,
)
from stallfree.engine.server.tool_calls.stream import ToolCallExtractor

HERMES = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2], "note": "a \\"}\\" b"}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
)
LLAMA3 = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'


def whole(parser, text):
    return ToolCallExtractor(parser).message(text)


def streamed(parser, text, step=3):
    """Feed the text a few characters at a time; gather content, calls and what each delta looked like."""
    ex = ToolCallExtractor(parser)
    deltas = []
    for i in range(0, len(text), step):
        piece = text[i : i + step]
        deltas += ex.feed(piece, final=i + step >= len(text))
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            entry = calls.setdefault(c["index"], {"name": None, "arguments": "", "id": None, "deltas": 0})
            if "id" in c:
                assert entry["id"] is None, "the id comes once, in the call's first delta"
                assert c["type"] == "function" and c["function"]["arguments"] == ""
                entry["id"], entry["name"] = c["id"], c["function"]["name"]
            else:
                assert entry["name"] is not None, "the name comes before any arguments"
                entry["arguments"] += c["function"]["arguments"]
            entry["deltas"] += 1
    return content, [calls[i] for i in sorted(calls)]


def test_hermes_whole():
    content, calls = whole(HermesParser(), HERMES)
    assert content.strip() == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {
        "city": "Paris",
        "days": [1, 2],
        "note": 'a "}" b',
    }
    assert json.loads(calls[1]["function"]["arguments"]) == {"tz": "CET"}
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)


@pytest.mark.parametrize("step", [1, 2, 5, 40])
def test_hermes_streamed_equals_whole(step):
    content, calls = streamed(HermesParser(), HERMES, step)
    w_content, w_calls = whole(HermesParser(), HERMES)
    assert content.strip() == w_content.strip()
    assert "<tool" not in content, "a partial <tool_call> tag is never shown as content"
    assert [c["name"] for c in calls] == [c["function"]["name"] for c in w_calls]
    assert [c["arguments"] for c in calls] == [c["function"]["arguments"] for c in w_calls]
    if step == 1:
        assert calls[0]["deltas"] > 5, "arguments arrive in pieces"


def test_plain_text_is_content_and_a_lookalike_tag_is_released():
    text = "Use <tool> tags? No: 1 < 2."
    assert whole(HermesParser(), text) == (text, [])
    content, calls = streamed(HermesParser(), text, 1)
    assert content == text and calls == []


def test_a_broken_call_is_content():
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1}'  # never closed
    assert whole(HermesParser(), text) == (text, [])
    assert whole(HermesParser(), "<tool_call>not json</tool_call>")[1] == []


def test_llama3_json_whole_and_streamed():
    content, calls = whole(Llama3JsonParser(), LLAMA3)
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    s_content, s_calls = streamed(Llama3JsonParser(), LLAMA3, 2)
    assert s_content == ""
    assert [c["arguments"] for c in s_calls] == [c["function"]["arguments"] for c in calls]


def test_llama3_text_that_is_not_json_is_content():
    assert whole(Llama3JsonParser(), "The weather is fine.") == ("The weather is fine.", [])
    assert streamed(Llama3JsonParser(), "The weather is fine.")[0] == "The weather is fine."


def test_arguments_written_as_a_json_string_are_unwrapped():
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    _, calls = whole(HermesParser(), text)
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1}


def test_required_and_named_read_the_grammar_forced_shapes():
    text = '[{"name": "f", "parameters": {"x": 1}}, {"name": "g", "parameters": {}}]'
    _, calls = whole(RequiredParser(), text)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("f", '{"x": 1}'),
        ("g", "{}"),
    ]
    _, s_calls = streamed(RequiredParser(), text, 4)
    assert [(c["name"], c["arguments"]) for c in s_calls] == [("f", '{"x": 1}'), ("g", "{}")]
    _, named = streamed(NamedParser("f"), '{"x": [1, 2]}', 1)
    assert named[0]["name"] == "f" and named[0]["arguments"] == '{"x": [1, 2]}'


def test_the_parser_is_picked_from_the_template():
    assert resolve_parser("auto", "{{ '<tool_call>' }}").name == "hermes"
    assert resolve_parser("auto", "{% if ipython %}<|python_tag|>{% endif %}").name == "llama3_json"
    assert resolve_parser("auto", None).name == "hermes"
    assert resolve_parser("llama3_json", "<tool_call>").name == "llama3_json"
    with pytest.raises(ValueError, match="unknown tool call parser"):
        resolve_parser("mistral", None)
