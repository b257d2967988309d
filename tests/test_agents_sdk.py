"""The OpenAI Agents SDK runs a two-tool agent loop against a real server, through /v1/responses.

The embedded model is random, so the loop is steered with the SDK's own controls rather than the model's
judgement: `tool_choice="required"` makes every turn call a tool (the server enforces the call's schema), each
tool is enabled only at its step of the plan (`is_enabled`), and `StopAtTools` ends the run on the second tool's
result. The model still writes every call's arguments, the SDK runs the tools and sends their outputs back as
function_call_output items, and the server renders them into the next turn's prompt. An agent with an output_type
on /v1/chat/completions also requires its tool calls (its format waits for a turn that answers in text).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Literal

import httpx
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunContextWrapper,
    Runner,
    StopAtTools,
    function_tool,
    set_tracing_disabled,
)
from pydantic import BaseModel

from tests._server_helpers import MODEL, server_fixture

set_tracing_disabled(True)  # traces would go to OpenAI's servers
server = server_fixture("--num-blocks", "256", "--max-model-len", "1024")


@dataclass
class Trip:
    """The run's context: which tools ran, with what arguments."""

    calls: list[tuple[str, str]] = field(default_factory=list)

    def called(self, name: str) -> bool:
        return any(called == name for called, _ in self.calls)


def _weather_step(context: RunContextWrapper[Trip], agent: Agent) -> bool:
    return not context.context.called("get_weather")


def _time_step(context: RunContextWrapper[Trip], agent: Agent) -> bool:
    return context.context.called("get_weather") and not context.context.called("get_time")


@function_tool(is_enabled=_weather_step)
def get_weather(context: RunContextWrapper[Trip], city: Literal["Paris", "Rome", "Oslo"]) -> str:
    """The weather in a city."""
    context.context.calls.append(("get_weather", city))
    return f"sunny in {city}"


@function_tool(is_enabled=_time_step)
def get_time(context: RunContextWrapper[Trip], zone: Literal["UTC", "CET"]) -> str:
    """The time in a time zone."""
    context.context.calls.append(("get_time", zone))
    return f"12:00 {zone}"


def travel_agent(server) -> Agent[Trip]:
    model = OpenAIResponsesModel(model=MODEL, openai_client=server.async_client())
    settings = ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=64)
    return Agent(
        name="travel assistant", instructions="Check the weather first, then the time.", model=model,
        model_settings=settings, tools=[get_weather, get_time], reset_tool_choice=False,
        tool_use_behavior=StopAtTools(stop_at_tool_names=["get_time"]),
    )  # fmt: skip


QUESTION = "Is it a good time for a walk in Rome?"


def run(server, **options):
    trip = Trip()
    result = asyncio.run(Runner.run(travel_agent(server), QUESTION, context=trip, max_turns=4, **options))
    return trip, result


@pytest.fixture(scope="module")
def plain_run(server):
    return run(server)


def test_the_agent_calls_both_tools_and_finishes(plain_run):
    trip, result = plain_run
    assert [name for name, _ in trip.calls] == ["get_weather", "get_time"]
    assert result.final_output == f"12:00 {trip.calls[1][1]}"
    assert len(result.raw_responses) == 2  # one model turn per tool
    assert all(response.response_id.startswith("resp_") for response in result.raw_responses)
    calls = [item for item in result.new_items if item.type == "tool_call_item"]
    assert [json.loads(call.raw_item.arguments) for call in calls] == [
        {"city": trip.calls[0][1]},
        {"zone": trip.calls[1][1]},
    ]
    outputs = [item.output for item in result.new_items if item.type == "tool_call_output_item"]
    assert outputs == [f"sunny in {trip.calls[0][1]}", result.final_output]


def test_a_server_side_conversation_gives_the_same_run_from_the_prefix_cache(server, plain_run):
    plain_trip, plain = plain_run
    trip, chained = run(server, auto_previous_response_id=True)
    assert trip.calls == plain_trip.calls and chained.final_output == plain.final_output
    first, second = chained.raw_responses
    stored = server.client().responses.retrieve(second.response_id)
    assert stored.previous_response_id == first.response_id  # the SDK sent only the new items
    assert second.usage.input_tokens == plain.raw_responses[1].usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0


def test_a_streamed_run_gives_the_same_calls(server, plain_run):
    async def streamed():
        trip = Trip()
        result = Runner.run_streamed(travel_agent(server), QUESTION, context=trip, max_turns=4)
        kinds = [event.type async for event in result.stream_events()]
        return trip, result, kinds

    plain_trip, plain = plain_run
    trip, result, kinds = asyncio.run(streamed())
    assert trip.calls == plain_trip.calls and result.final_output == plain.final_output
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds


class Verdict(BaseModel):
    walk: Literal["yes", "no"]


def test_a_chat_completions_agent_with_an_output_type_can_require_tool_calls(server):
    """Agents on /v1/chat/completions send their output_type as response_format on every turn, tool_choice
    "required" included: the forced call wins over the format (vLLM's rule) instead of a 400."""
    sent: list[dict] = []

    async def record(request: httpx.Request) -> None:
        sent.append(json.loads(request.content))

    client = server.async_client(http_client=httpx.AsyncClient(event_hooks={"request": [record]}))
    model = OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
    agent = Agent(
        name="walk planner", instructions="Check the weather first.", model=model, output_type=Verdict,
        model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=64),
        tools=[get_weather], tool_use_behavior=StopAtTools(stop_at_tool_names=["get_weather"]),
    )  # fmt: skip
    trip = Trip()
    result = asyncio.run(Runner.run(agent, QUESTION, context=trip, max_turns=2))
    [(name, city)] = trip.calls
    assert name == "get_weather" and result.final_output == f"sunny in {city}"
    [request] = sent
    assert request["tool_choice"] == "required" and request["response_format"]["type"] == "json_schema"


@pytest.fixture(autouse=True)
def drained(server):
    yield
    server.wait_until_drained()
