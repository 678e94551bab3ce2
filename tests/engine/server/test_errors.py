"""Bad inputs get the right status and an OpenAI-style error naming the problem; the server keeps serving."""

from __future__ import annotations

import httpx
import pytest
from server_helpers import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
OK = {"prompt": "Hello", "max_tokens": 2}
MSGS = [{"role": "user", "content": "Hi"}]

# (name, path, body (dict or raw str), headers, status, words the message must contain)
CASES = [
    ("bad json", "/v1/completions", "{not json", None, 400, "JSON"),
    ("body not an object", "/v1/completions", "[1, 2]", None, 400, "JSON object"),
    ("missing prompt", "/v1/completions", {"max_tokens": 2}, None, 400, "prompt"),
    ("prompt wrong type", "/v1/completions", {"prompt": 12}, None, 400, "prompt"),
    ("max_tokens wrong type", "/v1/completions", {**OK, "max_tokens": "many"}, None, 400, "max_tokens"),
    ("negative max_tokens", "/v1/completions", {**OK, "max_tokens": -5}, None, 400, "max_tokens"),
    ("huge max_tokens", "/v1/completions", {**OK, "max_tokens": 10**9}, None, 400, "context length"),
    ("temperature out of range", "/v1/completions", {**OK, "temperature": -1}, None, 400, "temperature"),
    ("top_p zero", "/v1/completions", {**OK, "top_p": 0}, None, 400, "top_p"),
    ("n zero", "/v1/completions", {**OK, "n": 0}, None, 400, "n"),
    ("n above 128", "/v1/completions", {**OK, "n": 129}, None, 400, "n"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, None, 400, "empty"),
    ("token id out of vocab", "/v1/completions", {"prompt": [1, 99999999]}, None, 400, "token ids"),
    ("batched prompts", "/v1/completions", {"prompt": ["a", "b"]}, None, 400, "one prompt"),
    (
        "prompt too long",
        "/v1/completions",
        {"prompt": "hello " * 9000, "max_tokens": 1},
        None,
        400,
        "context length",
    ),
    ("empty messages", "/v1/chat/completions", {"messages": []}, None, 400, "messages"),
    (
        "bad role",
        "/v1/chat/completions",
        {"messages": [{"role": "robot", "content": "x"}]},
        None,
        400,
        "role",
    ),
    (
        "top_logprobs without logprobs",
        "/v1/chat/completions",
        {"messages": MSGS, "top_logprobs": 2},
        None,
        400,
        "logprobs",
    ),
    ("logprobs too many", "/v1/completions", {**OK, "logprobs": 50}, None, 400, "logprobs"),
    ("empty stop string", "/v1/completions", {**OK, "stop": [""]}, None, 400, "stop"),
    (
        "penalty out of range",
        "/v1/completions",
        {**OK, "presence_penalty": 2.5},
        None,
        400,
        "presence_penalty",
    ),
    ("repetition_penalty zero", "/v1/completions", {**OK, "repetition_penalty": 0}, None, 400, "repetition"),
    ("logit_bias key", "/v1/completions", {**OK, "logit_bias": {"x": 1}}, None, 400, "logit_bias"),
    ("logit_bias value", "/v1/completions", {**OK, "logit_bias": {"5": 101}}, None, 400, "logit_bias"),
    (
        "logit_bias id out of vocab",
        "/v1/completions",
        {**OK, "logit_bias": {"99999999": 1}},
        None,
        400,
        "vocabulary",
    ),  # fmt: skip
    ("echo refused", "/v1/completions", {**OK, "echo": True}, None, 400, "echo"),
    (
        "tool_choice names no given tool",
        "/v1/chat/completions",
        {
            "messages": MSGS,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        None,
        400,
        "which is not in tools",
    ),  # fmt: skip
    ("beam search refused", "/v1/completions", {**OK, "use_beam_search": True}, None, 400, "beam"),
    ("unknown model", "/v1/completions", {**OK, "model": "gpt-9"}, None, 404, "gpt-9"),
    ("unknown traffic cluster", "/v1/completions", OK, {"x-traffic-cluster": "nope"}, 400, "chat"),
    ("no api key", "/v1/completions", OK, {"Authorization": ""}, 401, "API key"),
    ("wrong api key", "/v1/completions", OK, {"Authorization": "Bearer nope"}, 401, "API key"),
    ("unknown route", "/v1/embeddings", OK, None, 404, "no route"),
]


@pytest.mark.parametrize(
    ("name", "path", "body", "headers", "status", "words"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_input_gets_a_clear_error(server, name, path, body, headers, status, words):
    h = {**AUTH, "Content-Type": "application/json", **(headers or {})}
    if h.get("Authorization") == "":
        del h["Authorization"]
    content = body if isinstance(body, str) else None
    r = httpx.post(
        f"{server.url}{path}", headers=h, content=content, json=None if content else body, timeout=60
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert words.lower() in err["message"].lower(), err["message"]


def test_server_keeps_serving_after_bad_inputs(server):
    for _, path, body, _headers, _, _ in CASES[:5]:
        content = body if isinstance(body, str) else None
        httpx.post(f"{server.url}{path}", headers=AUTH, content=content, json=None if content else body)
    r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, json=OK, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_health_ready_and_metrics_need_no_key(server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/ready").status_code == 200
    assert "stallfree_token_budget" in httpx.get(f"{server.url}/metrics").text
