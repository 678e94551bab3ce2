"""Nothing silently dropped: every field of the openai SDK's request schemas is implemented, harmlessly
ignored, or refused with 400 naming it; the lists follow the installed SDK, so a new SDK field fails here
until it is classified."""

from __future__ import annotations

import httpx
import pytest
from server_helpers import API_KEY

from stallfree.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from stallfree.engine.server.request_fields import IGNORED_FIELDS, REFUSED_FIELDS

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MSGS = [{"role": "user", "content": "Hi"}]
BASE = {
    "/v1/chat/completions": {"messages": MSGS, "max_tokens": 2},
    "/v1/completions": {"prompt": "Hello", "max_tokens": 2},
}
MODELS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}

# A value for each SDK field that is not a no-op (what a client would send to get the feature), as the
# extra body fields to add to BASE.
SAMPLES = {
    "audio": {"audio": {"voice": "alloy", "format": "wav"}},
    "best_of": {"best_of": 3},
    "echo": {"echo": True},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "function_call": {"function_call": "auto"},
    "functions": {"functions": [{"name": "f", "parameters": {"type": "object"}}]},
    "logit_bias": {"logit_bias": {"5": 3}},
    "logprobs": {"logprobs": 2},  # the chat variant below
    "max_completion_tokens": {"max_completion_tokens": 2},
    "max_tokens": {"max_tokens": 3},
    "messages": {},
    "metadata": {"metadata": {"who": "test"}},
    "modalities": {"modalities": ["text", "audio"]},
    "model": {"model": "SmolLM2-135M-Instruct"},
    "moderation": {"moderation": {"model": "omni-moderation-latest"}},
    "n": {"n": 2},
    "parallel_tool_calls": {"parallel_tool_calls": False},
    "prediction": {"prediction": {"type": "content", "content": "Hello there"}},
    "presence_penalty": {"presence_penalty": 0.5},
    "prompt": {},
    "prompt_cache_key": {"prompt_cache_key": "k"},
    "prompt_cache_options": {"prompt_cache_options": {"mode": "explicit"}},
    "prompt_cache_retention": {"prompt_cache_retention": "24h"},
    "reasoning_effort": {"reasoning_effort": "high"},
    "response_format": {"response_format": {"type": "json_object"}},
    "safety_identifier": {"safety_identifier": "user-1"},
    "seed": {"seed": 7},
    "service_tier": {"service_tier": "flex"},
    "stop": {"stop": ["\n"]},
    "store": {"store": True},
    "stream": {"stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_usage": True}},
    "suffix": {"suffix": " the end"},
    "temperature": {"temperature": 0.5},
    "tool_choice": {"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f"}}]},
    "tools": {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
    "top_logprobs": {"logprobs": True, "top_logprobs": 2},
    "top_p": {"top_p": 0.9},
    "user": {"user": "user-1"},
    "verbosity": {"verbosity": "low"},
    "web_search_options": {"web_search_options": {"search_context_size": "low"}},
}
CHAT_SAMPLES = {"logprobs": {"logprobs": True}}


def sdk_fields(path: str) -> list[str]:
    if path == "/v1/chat/completions":
        from openai.types.chat.completion_create_params import CompletionCreateParamsStreaming as T
    else:
        from openai.types.completion_create_params import CompletionCreateParamsStreaming as T
    return sorted(T.__required_keys__ | T.__optional_keys__)


def classify(path: str, name: str) -> str:
    if name in IGNORED_FIELDS:
        return "ignored"
    if name in REFUSED_FIELDS:
        return "refused"
    if name in MODELS[path].model_fields:
        return "implemented"
    return "unclassified"


CASES = [(path, name) for path in BASE for name in sdk_fields(path)]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", headers=AUTH, json=body, timeout=60)


def test_the_sdk_schemas_are_read():
    """Guards the field lists themselves (a renamed SDK type would otherwise make the test below empty)."""
    chat, cmpl = sdk_fields("/v1/chat/completions"), sdk_fields("/v1/completions")
    assert {"messages", "n", "logit_bias", "tools", "response_format"} <= set(chat)
    assert {"prompt", "n", "logit_bias", "echo", "best_of"} <= set(cmpl)


@pytest.mark.parametrize(("path", "name"), CASES, ids=[f"{p.split('/')[-1]}-{n}" for p, n in CASES])
def test_every_sdk_field_is_implemented_ignored_or_refused(server, path, name):
    kind = classify(path, name)
    assert kind != "unclassified", (
        f"{name} ({path}) is in the openai SDK but not classified in request_fields"
    )
    assert name in SAMPLES, f"add a sample value for {name}"
    extra = (CHAT_SAMPLES if path == "/v1/chat/completions" else {}).get(name, SAMPLES[name])
    r = post(server, path, {**BASE[path], **extra})
    if kind == "refused":
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == name and err["type"] == "invalid_request_error", err
    else:
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("name", sorted(REFUSED_FIELDS))
def test_vllm_and_openai_fields_that_would_change_the_output_are_refused(server, name):
    r = post(server, "/v1/chat/completions", {**BASE["/v1/chat/completions"], name: {"x": 1}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == name


@pytest.mark.parametrize("name", sorted(IGNORED_FIELDS))
def test_harmless_fields_and_no_op_values_are_accepted(server, name):
    r = post(server, "/v1/chat/completions", {**BASE["/v1/chat/completions"], name: "x"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "text"}},
        {"tool_choice": "none"},
        {"tools": []},
        {"modalities": ["text"]},
        {"best_of": 1},
        {"echo": False},
        {"guided_json": None},
        {"some_future_field": 1},
    ],
)
def test_values_that_change_nothing_and_unknown_fields_pass(server, extra):
    path = "/v1/completions" if "echo" in extra or "best_of" in extra else "/v1/chat/completions"
    assert post(server, path, {**BASE[path], **extra}).status_code == 200


def test_structured_outputs_and_tools_are_implemented_not_refused_or_ignored():
    """response_format, tools and vLLM's structured-output fields are fields of the request models, so they
    reach the engine (engine/structured, engine/server/tool_calls): never refused, never dropped."""
    fields = {"response_format", "tools", "tool_choice", "parallel_tool_calls", "structured_outputs"}
    fields |= {"guided_json", "guided_regex", "guided_choice", "guided_grammar"}
    assert fields <= set(ChatCompletionRequest.model_fields)
    assert not fields & (set(REFUSED_FIELDS) | IGNORED_FIELDS)
