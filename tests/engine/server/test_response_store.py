"""The in-memory response store: bounded (oldest out first), TTL, 404s that say why; and the translation of
Responses input items into the chat messages the shared chat path takes."""

from __future__ import annotations

import pytest

from stallfree.engine.server.errors import BadRequest, NotFound
from stallfree.engine.server.response_store import ResponseStore
from stallfree.engine.server.responses_protocol import ResponsesRequest, items_to_messages


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _body(i: int) -> dict:
    return {"id": f"resp_{i}", "object": "response"}


def test_the_store_keeps_the_newest_within_its_bound():
    store = ResponseStore(max_entries=3, ttl_s=60, clock=Clock())
    for i in range(5):
        store.put(_body(i), [{"role": "user", "content": str(i)}])
    assert len(store) == 3
    assert store.get("resp_4").conversation == [{"role": "user", "content": "4"}]
    with pytest.raises(NotFound) as e:
        store.get("resp_0", "previous_response_id")
    assert (
        e.value.param == "previous_response_id"
        and "expired" in e.value.message
        and "at most 3" in e.value.message
    )


def test_the_store_forgets_after_its_ttl_and_deletes_on_request():
    clock = Clock()
    store = ResponseStore(max_entries=10, ttl_s=60, clock=clock)
    store.put(_body(1), [])
    clock.now = 30
    store.put(_body(2), [])
    clock.now = 61
    with pytest.raises(NotFound):
        store.get("resp_1")
    assert store.get("resp_2").body == _body(2)
    store.delete("resp_2")
    with pytest.raises(NotFound):
        store.delete("resp_2")
    assert len(store) == 0


def test_a_store_of_size_zero_keeps_nothing_and_says_so():
    store = ResponseStore(max_entries=0, ttl_s=60)
    store.put(_body(1), [])
    with pytest.raises(NotFound) as e:
        store.get("resp_1")
    assert "--responses-store-size 0" in e.value.message


@pytest.mark.parametrize(("size", "ttl"), [(-1, 60), (10, 0)])
def test_bad_store_settings_are_refused(size, ttl):
    with pytest.raises(ValueError):
        ResponseStore(size, ttl)


def test_items_become_chat_messages_with_calls_joined():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                         {"type": "input_text", "text": "Paris?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
        {"type": "function_call", "call_id": "c3", "name": "get_time", "arguments": "{}"},
    ]  # fmt: skip
    msgs = items_to_messages(items, "input")
    assert [m["role"] for m in msgs] == ["developer", "user", "assistant", "tool", "tool", "assistant"]
    assert msgs[1]["content"] == "Weather in Paris?"
    assert msgs[2]["content"] == "Checking." and [c["id"] for c in msgs[2]["tool_calls"]] == ["c1", "c2"]
    assert msgs[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}
    assert msgs[4] == {"role": "tool", "tool_call_id": "c2", "content": "noon"}
    assert msgs[5]["content"] is None and msgs[5]["tool_calls"][0]["id"] == "c3"


def test_a_request_becomes_the_chat_request_it_amounts_to():
    body = ResponsesRequest.model_validate({
        "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 7, "temperature": 0.3, "seed": 5,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}],
        "tool_choice": {"type": "function", "name": "f"},
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}},
    })  # fmt: skip
    body.check_unsupported()
    chat = body.to_chat([{"role": "user", "content": "Earlier."}, *body.conversation()])
    assert [m.role for m in chat.messages] == ["system", "user", "user"]
    assert chat.messages[0].content == "Be brief." and chat.messages[2].content == "Hi"
    assert chat.max_completion_tokens == 7 and chat.temperature == 0.3 and chat.seed == 5
    assert chat.tool_dicts() == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"},
                                                                   "strict": True}}]  # fmt: skip
    assert chat.tool_choice_value() == {"type": "function", "function": {"name": "f"}}
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.strict is True


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "Hi", "tools": [{"type": "web_search_preview"}]}, "tools[0]"),
        ({"input": "Hi", "background": True}, "background"),
        ({"input": "Hi", "reasoning": {"effort": "low"}}, "reasoning"),
        ({"input": "Hi", "prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"input": "Hi", "truncation": "auto"}, "truncation"),
        ({"input": "Hi", "modalities": ["audio"]}, "modalities"),
        ({"input": "Hi", "text": {"verbosity": "high"}}, "text.verbosity"),
    ],
)
def test_unsupported_fields_are_named(body, param):
    with pytest.raises(BadRequest) as e:
        ResponsesRequest.model_validate(body).check_unsupported()
    assert e.value.param == param


def test_serve_has_the_store_flags_and_says_what_they_keep():
    from stallfree.engine.serve_cli import build_configs, build_parser

    helptext = " ".join(build_parser().format_help().split())
    assert "--responses-store-size N" in helptext and "--responses-store-ttl S" in helptext
    assert "in this process's memory" in helptext and "lost on restart" in helptext
    _, settings = build_configs(
        build_parser().parse_args(["--responses-store-size", "7", "--responses-store-ttl", "9"])
    )
    assert (settings.responses_store_size, settings.responses_store_ttl_s) == (7, 9.0)
    with pytest.raises(ValueError, match="--responses-store-ttl"):
        build_configs(build_parser().parse_args(["--responses-store-ttl", "0"]))
