"""/v1/responses through the real `openai` SDK over HTTP against a real server on the bundled model:
text, function calls and strict JSON schemas (whole and through `responses.stream()`), stored responses and
`previous_response_id`, 404 for unknown ids, 400 for what the server cannot honour, and faults that end a
stream with response.failed. The chat endpoint's path underneath: its traffic clusters, admission (429)
and metrics."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field
from server_helpers import API_KEY, start_server, wait_for

MODEL = "SmolLM2-135M-Instruct"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
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
    {"type": "function", "name": "get_weather", "description": "Current weather of a city",
     "parameters": WEATHER, "strict": True},
    {"type": "function", "name": "get_time", "description": "Local time of a city", "strict": False,
     "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}}},
]  # fmt: skip
ASK = "What is the weather in Paris right now?"
NAMED = {"type": "function", "name": "get_weather"}
# A message tells the SDK's stream helper how the whole stream must go.
TEXT_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
              "response.content_part.added", "response.output_text.delta"]  # fmt: skip
TEXT_END = ["response.output_text.done", "response.content_part.done", "response.output_item.done",
            "response.completed"]  # fmt: skip


def _post(server, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, **body}, headers={**AUTH, **(headers or {})},
                      timeout=120)  # fmt: skip


def _stream_events(client, **kw) -> tuple[list, object]:
    with client.responses.stream(model=MODEL, **kw) as stream:
        events = list(stream)
        return events, stream.get_final_response()


def test_text_whole_and_streamed_agree_and_stream_in_the_sdks_order(client):
    kw = dict(input="What is the capital of France?", max_output_tokens=200, temperature=0)
    whole = client.responses.create(model=MODEL, **kw)
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.status == "completed" and whole.incomplete_details is None and whole.error is None
    assert [o.type for o in whole.output] == ["message"]
    assert whole.output[0].content[0].type == "output_text" and whole.output_text.strip()
    u = whole.usage
    assert u.input_tokens > 10 and u.output_tokens > 0 and u.total_tokens == u.input_tokens + u.output_tokens

    events, final = _stream_events(client, **kw)
    kinds = [e.type for e in events]
    assert kinds[:5] == TEXT_ORDER and kinds[-4:] == TEXT_END, kinds
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text, "same request, same answer, streamed or not"
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.id == events[0].response.id


def test_max_output_tokens_makes_it_incomplete(client):
    whole = client.responses.create(model=MODEL, input="Write a long story.", max_output_tokens=5)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 5 and whole.output[0].status == "incomplete"
    stream = client.responses.create(
        model=MODEL, input="Write a long story.", max_output_tokens=5, stream=True
    )
    events = list(stream)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_the_same_request_on_chat_gives_the_same_prompt_and_answer(client):
    """instructions are the chat's system message, input its user message: one prompt, one answer."""
    pirate = "You are a pirate; answer like one."
    told = client.responses.create(
        model=MODEL, input="Hi", instructions=pirate, max_output_tokens=12, temperature=0
    )
    chat = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": pirate}, {"role": "user", "content": "Hi"}])  # fmt: skip
    assert told.instructions == pirate
    assert told.usage.input_tokens == chat.usage.prompt_tokens
    assert told.output_text == chat.choices[0].message.content
    plain = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1)
    assert plain.usage.input_tokens != told.usage.input_tokens


@pytest.mark.parametrize("tool_choice", [NAMED, "required"], ids=["named", "required"])
def test_function_call_whole_and_streamed(client, tool_choice):
    kw = dict(input=ASK, tools=TOOLS, tool_choice=tool_choice, max_output_tokens=80, temperature=0)
    whole = client.responses.create(model=MODEL, **kw)
    assert whole.status == "completed"
    calls = [o for o in whole.output if o.type == "function_call"]
    assert calls and calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_")
    if tool_choice == NAMED:
        assert [c.name for c in calls] == ["get_weather"]
    call = calls[0]
    schema = WEATHER if call.name == "get_weather" else TOOLS[1]["parameters"]
    jsonschema.validate(json.loads(call.arguments), schema)

    events, final = _stream_events(client, **kw)
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]  # fmt: skip
    pieces = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 3, "arguments arrive in pieces"
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(p.delta for p in pieces if p.output_index == done[0].output_index) == done[0].arguments
    streamed = [o for o in final.output if o.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    if streamed[0].name == "get_weather":  # a strict function tool: the SDK parses its arguments
        assert streamed[0].parsed_arguments["city"]


def test_function_call_output_continues_the_conversation(client):
    first = client.responses.create(model=MODEL, input=ASK, tools=TOOLS, tool_choice=NAMED, max_output_tokens=60,
                                    temperature=0)  # fmt: skip
    call = first.output[0]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature_c": 21}'}
    # the whole history sent back as items (what agent loops do without a store) ...
    again = client.responses.create(model=MODEL, input=[{"role": "user", "content": ASK}, call, result],
                                    tools=TOOLS, max_output_tokens=30, temperature=0)  # fmt: skip
    # ... or the stored response continued by id: the same prompt
    cont = client.responses.create(model=MODEL, previous_response_id=first.id, input=[result], tools=TOOLS,
                                   max_output_tokens=30, temperature=0)  # fmt: skip
    assert cont.previous_response_id == first.id
    assert cont.usage.input_tokens == again.usage.input_tokens > first.usage.input_tokens + 10
    assert cont.output_text == again.output_text


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    continent: Literal["Africa", "America", "Asia", "Europe", "Oceania"]
    is_capital: bool


def test_strict_json_schema_output_validates(client):
    schema = City.model_json_schema()
    text = {"format": {"type": "json_schema", "name": "city", "schema": {**schema, "additionalProperties": False},
                       "strict": True}}  # fmt: skip
    r = client.responses.create(model=MODEL, input="Describe Paris as JSON.", text=text, max_output_tokens=200,
                                temperature=0)  # fmt: skip
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), schema)
    # the SDK's own helpers: parse() and stream() with a pydantic text_format
    parsed = client.responses.parse(model=MODEL, input="Describe Rome as JSON.", text_format=City,
                                    max_output_tokens=200, temperature=0)  # fmt: skip
    assert isinstance(parsed.output_parsed, City)
    with client.responses.stream(model=MODEL, input="Describe Rome as JSON.", text_format=City,
                                 max_output_tokens=200, temperature=0) as stream:  # fmt: skip
        final = stream.get_final_response()
    assert final.output_parsed == parsed.output_parsed


def test_previous_response_id_continues_and_the_store_reads_back_and_deletes(client):
    from openai import NotFoundError

    first = client.responses.create(model=MODEL, input="My name is Ada Lovelace.", max_output_tokens=20,
                                    instructions="Be brief.", temperature=0)  # fmt: skip
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="What is my name?",
                                     max_output_tokens=20, temperature=0)  # fmt: skip
    fresh = client.responses.create(
        model=MODEL, input="What is my name?", max_output_tokens=20, temperature=0
    )
    # the first turn (input and output, not its instructions) is in the second's prompt
    grown = second.usage.input_tokens - fresh.usage.input_tokens
    assert first.usage.output_tokens + 8 <= grown < first.usage.input_tokens + first.usage.output_tokens
    got = client.responses.retrieve(first.id)
    assert got.model_dump() == first.model_dump()
    client.responses.delete(first.id)
    with pytest.raises(NotFoundError) as e:
        client.responses.retrieve(first.id)
    assert first.id in str(e.value)
    with pytest.raises(NotFoundError):
        client.responses.create(model=MODEL, previous_response_id=first.id, input="Hi", max_output_tokens=2)
    # a streamed response is stored too, incomplete as it ended
    final = list(client.responses.create(model=MODEL, input="Hello", max_output_tokens=4, stream=True))[
        -1
    ].response
    assert final.status == "incomplete"
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()


def test_unknown_and_unstored_ids_are_404_with_json(client, server):
    from openai import NotFoundError

    with pytest.raises(NotFoundError) as e:
        client.responses.retrieve("resp_nope")
    assert "resp_nope" in str(e.value) and "expired" in str(e.value)
    r = _post(server, {"input": "Hi", "previous_response_id": "resp_gone", "max_output_tokens": 2})
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "previous_response_id"
    assert r.json()["error"]["code"] == "response_not_found"
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(NotFoundError):
        client.responses.retrieve(unstored.id)
    r = httpx.delete(f"{server.url}/v1/responses/resp_nope", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_a_built_in_tool_is_refused_by_name(client):
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as e:
        client.responses.create(model=MODEL, input="Search the news", tools=[{"type": "web_search"}])
    assert "web_search" in str(e.value) and e.value.body["param"] == "tools[0]"


BAD = [
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[0]", "file_search"),
    ({"tools": [*TOOLS, {"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools[2]",
     "code_interpreter"),
    ({"background": True}, "background", "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "reasoning"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input[0]", "reasoning items"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0]", "input_image"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "item references"),
    ({"include": ["message.output_text.logprobs"]}, "include", "logprobs"),
    ({"tool_choice": {"type": "web_search_preview"}, "tools": TOOLS}, "tool_choice", "not supported"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "not in tools"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name", "pattern"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text.format",
     ""),
    ({"input": []}, "input", "empty"),
    ({"max_output_tokens": 10**6}, "max_output_tokens", "context length"),
    ({"temperature": 3}, "temperature", ""),
    ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0]", "call_id"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "param", "words"), BAD)
def test_what_cannot_be_honoured_is_a_400_naming_it(server, extra, param, words):
    r = _post(server, {"input": "Hi", "max_output_tokens": 5, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert words in err["message"], err


def test_inert_fields_are_accepted(client):
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, include=[], reasoning={},
                                truncation="disabled", metadata={"k": "v"}, background=False,
                                parallel_tool_calls=True, user="u1")  # fmt: skip
    assert r.status in ("completed", "incomplete") and r.metadata == {"k": "v"} and r.user == "u1"


def test_same_traffic_clusters_and_metrics_as_chat(server):
    before = server.metric("stallfree_requests_total", traffic_cluster="chat", outcome="length")
    r = _post(server, {"input": "Hi", "max_output_tokens": 3}, headers={"x-traffic-cluster": "chat"})
    assert r.status_code == 200 and r.json()["status"] == "incomplete"
    assert server.metric("stallfree_requests_total", traffic_cluster="chat", outcome="length") == before + 1
    r = _post(server, {"input": "Hi"}, headers={"x-traffic-cluster": "nope"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-traffic-cluster"


@pytest.fixture
def fresh(default_model):
    s = start_server(default_model, traffic={"trafficClusters": [{"name": "default", "maxWaiting": 2,
                                                                  "maxRunning": 1}]})  # fmt: skip
    yield s
    s.stop()


def test_overload_is_429_as_on_chat(fresh):
    body = {"model": MODEL, "input": "Count slowly:", "max_output_tokens": 6, "ignore_eos": True}
    with ThreadPoolExecutor(12) as pool:
        got = list(pool.map(lambda _: httpx.post(f"{fresh.url}/v1/responses", json=body, headers=AUTH,
                                                 timeout=120), range(12)))  # fmt: skip
    codes = sorted(r.status_code for r in got)
    assert set(codes) == {200, 429}, codes
    assert all(r.json()["usage"]["output_tokens"] == 6 for r in got if r.status_code == 200)
    assert all(int(r.headers["Retry-After"]) >= 1 for r in got if r.status_code == 429)
    rejected = fresh.metric("stallfree_rejections_total", traffic_cluster="default", reason="queue_full")
    assert rejected == codes.count(429)


def test_an_engine_fault_ends_the_stream_with_response_failed_then_503(fresh, monkeypatch):
    """The engine loop dies under a streaming request: response.failed with the cause; then the server says
    it cannot serve (503), whole or streamed."""
    from openai import InternalServerError, OpenAI

    def broken():
        raise RuntimeError("simulated device fault")

    client = OpenAI(base_url=f"{fresh.url}/v1", api_key=API_KEY, max_retries=0)
    monkeypatch.setattr(fresh.engine, "step", broken)
    events = list(client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, stream=True))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.failed"]
    failed = events[-1].response
    assert failed.status == "failed" and "simulated device fault" in failed.error.message
    assert failed.error.code == "server_error"
    with pytest.raises(InternalServerError) as e:
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=4)
    assert e.value.status_code == 503 and "simulated device fault" in str(e.value)
    with pytest.raises(InternalServerError):
        _stream_events(client, input="Hi", max_output_tokens=4)


def test_the_sdk_stream_helper_raises_on_response_failed(fresh, monkeypatch):
    from openai import OpenAI

    client = OpenAI(base_url=f"{fresh.url}/v1", api_key=API_KEY, max_retries=0)
    monkeypatch.setattr(fresh.engine, "step", lambda: 1 / 0)
    with pytest.raises(RuntimeError, match="response.completed"):  # never a short answer taken as whole
        _stream_events(client, input="Hi", max_output_tokens=4)


def test_a_fault_while_streaming_ends_with_response_failed_and_aborts(fresh, monkeypatch):
    from openai import OpenAI

    from stallfree.engine.server.responses_output import ResponseWriter

    calls = 0
    real = ResponseWriter.feed

    def flaky(self, out):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("simulated event fault")
        return real(self, out)

    monkeypatch.setattr(ResponseWriter, "feed", flaky)
    aborted = fresh.metric("stallfree_requests_total", traffic_cluster="default", outcome="abort")
    client = OpenAI(base_url=f"{fresh.url}/v1", api_key=API_KEY, max_retries=0)
    events = list(client.responses.create(model=MODEL, input="Count:", max_output_tokens=50, stream=True,
                                          extra_body={"ignore_eos": True}))  # fmt: skip
    kinds = [e.type for e in events]
    assert "response.output_text.delta" in kinds and kinds[-1] == "response.failed", kinds
    assert "simulated event fault" in events[-1].response.error.message
    assert events[-1].response.output[0].status == "incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert wait_for(lambda: fresh.metric("stallfree_requests_total", traffic_cluster="default", outcome="abort")
                    == aborted + 1)  # fmt: skip
