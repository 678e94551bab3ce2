"""The OpenAI Agents SDK against a real server on the bundled model: an agent with a function tool runs its
tool loop to a final answer with the SDK's defaults (a model name and the default client: its provider picks
OpenAIResponsesModel, /v1/responses) and with OpenAIChatCompletionsModel (/v1/chat/completions), whole and
streamed.

The first turn names the tool (tool_choice, forced by the grammar engine: the tiny model would not call it
on its own); the SDK then resets tool_choice, so the second turn answers from the tool's result. Tracing is
off: nothing leaves this machine.
"""

from __future__ import annotations

import asyncio
import os

import pytest
from server_helpers import API_KEY

os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")
import agents  # noqa: E402 - openai-agents, in the dev extra; tracing is off before it loads

MODEL = "SmolLM2-135M-Instruct"


def _agent(server, model_class: str, calls: list[dict]):
    """model_class "default": the model by name, through the SDK's default client and provider."""
    from openai import AsyncOpenAI

    @agents.function_tool
    def get_weather(city: str, unit: str = "celsius") -> str:
        """Current weather of a city."""
        calls.append({"city": city, "unit": unit})
        return f"It is sunny and 21 degrees {unit} in {city}."

    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    if model_class == "default":
        agents.set_default_openai_client(client, use_for_tracing=False)
        model = MODEL
    else:
        model = getattr(agents, model_class)(model=MODEL, openai_client=client)
    return client, agents.Agent(
        name="weather",
        instructions="Answer questions about the weather with the get_weather tool.",
        tools=[get_weather],
        model=model,
        model_settings=agents.ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=60),
    )


async def _run(client_and_agent, streamed: bool):
    client, agent = client_and_agent
    try:
        if not streamed:
            return await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        run = agents.Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=4)
        kinds = set()
        async for event in run.stream_events():
            kinds.add(event.type)
        assert "raw_response_event" in kinds, "the model's events were streamed"
        return run
    finally:
        await client.close()


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("model_class", ["default", "OpenAIResponsesModel", "OpenAIChatCompletionsModel"])
def test_an_agent_runs_its_tool_loop_to_a_final_answer(server, model_class, streamed):
    agents.set_tracing_disabled(True)
    calls: list[dict] = []
    result = asyncio.run(_run(_agent(server, model_class, calls), streamed))
    assert len(calls) == 1 and isinstance(calls[0]["city"], str) and calls[0]["city"], calls
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
    assert len(result.raw_responses) == 2, "one turn called the tool, the next answered"
    assert isinstance(result.final_output, str) and result.final_output.strip()
    ids = [r.response_id for r in result.raw_responses]
    if model_class == "OpenAIChatCompletionsModel":
        assert not any(i and i.startswith("resp_") for i in ids), ids
    else:  # the default model is the Responses one
        assert all(i and i.startswith("resp_") for i in ids), ids


def test_a_server_error_ends_the_agent_run_with_an_exception(server):
    """A refused request is an explicit error in the agent, not an empty answer."""
    from openai import BadRequestError

    agents.set_tracing_disabled(True)
    client, agent = _agent(server, "default", [])
    agent.model_settings = agents.ModelSettings(max_tokens=10**6)  # beyond the context length
    with pytest.raises(BadRequestError, match="max_output_tokens"):
        asyncio.run(_run((client, agent), False))
