"""Structured outputs through the real `openai` SDK against a real server: response_format json_schema and
json_object, vLLM's structured_outputs / guided_* extras, and clear 400s for bad constraints."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import pytest
from openai import AsyncOpenAI
from server_helpers import API_KEY

MODEL = "SmolLM2-135M-Instruct"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "pets": {"type": "array", "items": {"type": "string", "enum": ["cat", "dog", "fish"]}, "maxItems": 3},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "pets", "employed"],
    "additionalProperties": False,
}
TOPICS = [
    "a baker", "a pilot", "a child", "a doctor", "a farmer", "a poet", "a sailor", "a chef", "a nurse", "a judge",
    "a miner", "a teacher", "a singer", "a painter", "a student", "a driver", "a monk", "a clown", "a coder", "a spy",
]  # fmt: skip


def test_json_schema_responses_parse_and_validate_for_20_prompts(server):
    async def one(client: AsyncOpenAI, topic: str):
        return await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Describe {topic} as a JSON object."}],
            max_tokens=120,
            temperature=0.7,
            seed=7,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON, "strict": True},
            },
        )

    async def run():
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(one(client, t) for t in TOPICS))
        finally:
            await client.close()

    responses = asyncio.run(run())
    assert len(responses) == 20
    for r in responses:
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object_is_a_json_object(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give me a JSON object about the moon."}],
        max_tokens=100,
        temperature=0,
        response_format={"type": "json_object"},
    )
    if r.choices[0].finish_reason == "stop":  # a free-form object may be long; a cut one cannot be parsed
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")


def test_streamed_json_schema_equals_the_whole(client):
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "A person as JSON."}],
        max_tokens=120,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    )
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(streamed), PERSON)


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"guided_choice": ["positive", "negative"]}, lambda t: t in ("positive", "negative")),
        ({"guided_regex": r"\d{3}-\d{4}"}, lambda t: re.fullmatch(r"\d{3}-\d{4}", t)),
        ({"guided_json": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}},
         lambda t: isinstance(json.loads(t)["ok"], bool)),
        ({"structured_outputs": {"choice": ["a", "b"]}}, lambda t: t in ("a", "b")),
        ({"structured_outputs": {"grammar": 'root ::= "x" [0-9] [0-9]'}}, lambda t: re.fullmatch(r"x\d\d", t)),
    ],
)  # fmt: skip
def test_vllm_extras_on_chat_and_completions(client, extra, check):
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Answer."}],
        max_tokens=40,
        temperature=0,
        extra_body=extra,
    )
    assert check(chat.choices[0].message.content), chat.choices[0].message.content
    done = client.completions.create(
        model=MODEL, prompt="Answer:", max_tokens=40, temperature=0, extra_body=extra
    )
    assert check(done.choices[0].text), done.choices[0].text
    assert done.choices[0].finish_reason == "stop"


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
     "response_format", "invalid json"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "invalid regex"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar", "invalid grammar"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "invalid regex"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one structured output constraint"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", "one structured output constraint"),
    ({"structured_outputs": {"regex": "a", "whitespace": "x"}}, "structured_outputs", "whitespace"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "param", "words"), BAD)
def test_bad_constraints_are_400_with_the_field_named(server, extra, param, words):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, **extra}
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].startswith(param), err
    assert words.lower() in err["message"].lower(), err
    ok = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "Hi", "max_tokens": 2},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert ok.status_code == 200, "the server keeps serving"
