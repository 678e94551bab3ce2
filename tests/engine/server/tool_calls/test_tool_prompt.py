"""Tools and tool history in the prompt: through the template when it knows them, else the default prompt."""

import json

from stallfree.engine.model.tokenizer import Tokenizer
from stallfree.engine.server.tool_calls.choice import plan_tools, required_schema
from stallfree.engine.server.tool_calls.parsers import HermesParser, Llama3JsonParser
from stallfree.engine.server.tool_calls.prompt import render_chat

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    ]},
    {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"},
]  # fmt: skip
# A template in the style of Qwen 2.5's: it renders `tools` and `tool_calls` itself.
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}\n"
    "{% endfor %}"
)


def render(tok, messages, tools, parser):
    return tok.decode(render_chat(tok, messages, tools, parser, True), skip_special_tokens=False)


def test_a_template_that_ignores_tools_gets_the_default_tool_prompt(default_model):
    tok = default_model.tokenizer
    text = render(tok, HISTORY, TOOLS, HermesParser())
    assert "<tools>" in text and '"get_weather"' in text and "<tool_call>" in text
    assert text.index("<tools>") < text.index("Weather in Paris?")
    # the history's call, written as the model is told to write calls, and the result wrapped
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in text
    llama = render(tok, HISTORY, TOOLS, Llama3JsonParser())
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in llama


def test_a_template_that_knows_tools_renders_them_itself(default_model):
    base = default_model.tokenizer
    tok = Tokenizer(
        base.backend, bos_token_id=None, eos_token_id=base.eos_token_id, chat_template=TOOL_TEMPLATE
    )
    text = render(tok, HISTORY, TOOLS, HermesParser())
    assert text.startswith("TOOLS:get_weather;")
    assert "<tools>" not in text
    assert 'CALL get_weather {"city": "Paris"}' in text, "arguments reach the template as an object"


def test_tool_choice_plans():
    p = HermesParser()
    assert plan_tools(TOOLS, None, p).parser is p
    none = plan_tools(TOOLS, "none", p)
    assert none.prompt_tools is None and none.parser is None
    required = plan_tools(TOOLS, "required", p)
    assert json.loads(required.structured_outputs.json)["minItems"] == 1
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, p)
    assert json.loads(named.structured_outputs.json) == {"type": "object"}
    assert required_schema(TOOLS, parallel_tool_calls=False)["maxItems"] == 1


def test_bad_tool_choices_are_refused():
    import pytest

    p = HermesParser()
    with pytest.raises(ValueError, match="needs tools"):
        plan_tools(None, "required", p)
    with pytest.raises(ValueError, match="not in tools"):
        plan_tools(TOOLS, {"type": "function", "function": {"name": "nope"}}, p)
    with pytest.raises(ValueError, match="unique"):
        plan_tools(TOOLS * 2, "auto", p)
