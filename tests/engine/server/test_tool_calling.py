"""Tool calling through the real `openai` SDK against a real server: a call -> tool message -> answer round
trip with the SDK's own types, streamed tool_calls deltas in OpenAI's shape, and 400s for bad tool input.

tool_choice required and named functions are forced by the grammar engine, so they work with the tiny
bundled model; what it does with tool_choice auto is up to the model (the parsers are tested on crafted
text in tool_calls/test_tool_parsers.py).
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai.types.chat import ChatCompletionMessageToolCall
from server_helpers import API_KEY

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time of a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                                                     "required": ["city"]}}},
]  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_round_trip_call_tool_message_answer(client, tool_choice):
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=80, temperature=0
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and all(isinstance(c, ChatCompletionMessageToolCall) for c in calls)
    call = calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    if tool_choice == NAMED:
        assert [c.function.name for c in calls] == ["get_weather"]
    assert call.function.name in ("get_weather", "get_time")
    args = json.loads(call.function.arguments)
    schema = TOOLS[0 if call.function.name == "get_weather" else 1]["function"]["parameters"]
    jsonschema.validate(args, schema)

    # the SDK's own message goes back into the history, followed by the tool's result
    history = [
        *ASK,
        choice.message,
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": json.dumps({"temperature_c": 21, "sky": "clear"}),
        },
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, max_tokens=40, temperature=0
    )
    final = answer.choices[0]
    assert final.finish_reason in ("stop", "length", "tool_calls")
    assert final.message.content or final.message.tool_calls
    # the result reached the prompt: it is longer than the one that asked
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens + 20


def test_streamed_tool_calls_come_as_openai_sends_them(client):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls: dict[int, dict] = {}
    pieces = 0
    for d in deltas:
        for tc in d.tool_calls or []:
            if tc.id is not None:
                assert tc.index not in calls, "id, type and name come once, in the call's first delta"
                assert tc.type == "function" and tc.function.name and tc.function.arguments == ""
                calls[tc.index] = {"name": tc.function.name, "arguments": ""}
            else:
                assert tc.index in calls, "the name comes before the arguments"
                calls[tc.index]["arguments"] += tc.function.arguments
                pieces += 1
    assert pieces > 3, "arguments arrive in pieces"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole
    ]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["tool_calls"]


def test_tool_choice_none_is_plain_content(client):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=20, temperature=0
    )
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason in ("stop", "length")


def test_auto_puts_the_tools_in_the_prompt(client):
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, temperature=0)
    auto = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=1, temperature=0)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the default tool prompt


BAD = [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not in tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", ""),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", ""),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "already constrains"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "param", "words"), BAD)
def test_bad_tool_requests_are_400(server, extra, param, words):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 5, **extra}
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].startswith(param), err
    assert words in err["message"], err


def test_auto_streams_what_it_answers_whole(client):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=40, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    streamed_calls = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
    if whole.message.tool_calls:  # the model chose to call: the calls match, whatever the model
        names = [tc.function.name for tc in streamed_calls if tc.function and tc.function.name]
        assert names == [tc.function.name for tc in whole.message.tool_calls]
    else:
        assert content == whole.message.content and not streamed_calls
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
