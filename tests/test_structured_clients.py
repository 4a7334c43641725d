"""Structured output and tool calling through real client libraries (LangChain, LiteLLM) against a real server.

The clients build the requests themselves (schemas from Pydantic models, tool_choice spellings, streamed tool-call
deltas, agent-loop history), so these tests check that what they send is accepted and what comes back parses."""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import ModuleType
from typing import Any, Literal

import openai
import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from pagedserve.engine import EngineConfig
from pagedserve.engine.worker.model_loader import LoadedModel
from pagedserve.server import ServerSettings
from tests.servers import served_engine

MODEL = "smol"
ASK_CITY = "Describe Paris, the capital of France, as a JSON object."
ASK_WEATHER = "What is the weather in Paris?"

# LangChain's bind_tools and with_structured_output(method="function_calling") send non-strict schemas by default
# (no "additionalProperties"): the server still admits the declared keys only, as OpenAI does, or the small model
# would copy schema keywords ("maxLength", "type") into the arguments.


class City(BaseModel):
    """A city and what kind of place it is."""

    name: str = Field(max_length=20)
    kind: Literal["capital", "town"]
    population: int = Field(ge=0, le=40_000_000)


class LooseCity(BaseModel):
    """json_mode only promises some JSON object: every field has a default, but what is there must have its type."""

    name: str | None = Field(default=None, max_length=40)
    country: str | None = Field(default=None, max_length=40)


class GetWeather(BaseModel):
    """The current weather in a city."""

    city: str = Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]


class GetTime(BaseModel):
    """The current time in a time zone."""

    zone: str = Field(max_length=12)


TOOLS: dict[str, type[BaseModel]] = {"GetWeather": GetWeather, "GetTime": GetTime, "City": City}


@pytest.fixture(scope="module")
def url(smol_loaded: LoadedModel) -> Iterator[str]:
    with served_engine(EngineConfig(num_kv_blocks=256), smol_loaded, ServerSettings([MODEL])) as url:
        yield url


@pytest.fixture(scope="module")
def llm(url: str) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=f"{url}/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=150, max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def litellm() -> Iterator[ModuleType]:
    """LiteLLM, offline: its bundled model cost map instead of a download, no telemetry."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        patch.setenv("LITELLM_OFFLINE_MODE", "true")
        import litellm

        patch.setattr(litellm, "telemetry", False, raising=False)
        yield litellm


def assert_valid_calls(message: AIMessage | AIMessageChunk, names: set[str]) -> list[tuple[str, dict[str, Any]]]:
    """The message's tool calls as (name, args), each naming one of `names` with exactly its schema's keys."""
    assert message.tool_calls and not message.invalid_tool_calls, message
    calls = []
    for call in message.tool_calls:
        assert call["name"] in names and call["id"]
        schema = TOOLS[call["name"]]
        assert isinstance(call["args"], dict) and set(call["args"]) == set(schema.model_fields), call
        schema.model_validate(call["args"])
        calls.append((call["name"], call["args"]))
    return calls


# ---- LangChain: with_structured_output ---------------------------------------------------------------------


def test_langchain_json_schema_method(llm: ChatOpenAI) -> None:
    result = llm.with_structured_output(City, method="json_schema", include_raw=True).invoke(ASK_CITY)
    assert result["parsing_error"] is None, result
    city = result["parsed"]
    assert isinstance(city, City) and city.kind in ("capital", "town") and 0 <= city.population <= 40_000_000
    assert result["raw"].response_metadata["finish_reason"] == "stop"


@pytest.mark.parametrize("strict", [True, None])
def test_langchain_function_calling_method(llm: ChatOpenAI, strict: bool | None) -> None:
    structured = llm.with_structured_output(City, method="function_calling", strict=strict, include_raw=True)
    result = structured.invoke(ASK_CITY)
    assert result["parsing_error"] is None, result
    raw = result["raw"]
    assert raw.response_metadata["finish_reason"] == "tool_calls"  # forced through a named tool_choice
    assert [name for name, _ in assert_valid_calls(raw, {"City"})] == ["City"]
    city = result["parsed"]
    assert isinstance(city, City) and city.kind in ("capital", "town")


def test_langchain_json_mode_method(llm: ChatOpenAI) -> None:
    structured = llm.with_structured_output(LooseCity, method="json_mode", include_raw=True)
    result = structured.invoke(
        'Reply with a JSON object with the keys "name" and "country" for the capital of France, e.g. '
        '{"name": "Berlin", "country": "Germany"}.'
    )
    assert result["parsing_error"] is None, result
    assert result["raw"].response_metadata["finish_reason"] == "stop"
    content = json.loads(result["raw"].content)
    assert isinstance(content, dict) and LooseCity.model_validate(content) == result["parsed"]
    assert isinstance(result["parsed"], LooseCity) and isinstance(result["parsed"].name, str)


# ---- LangChain: bind_tools ---------------------------------------------------------------------------------


@pytest.mark.parametrize("tool_choice", ["GetWeather", "required", "any"])
def test_langchain_bind_tools_forces_valid_calls(llm: ChatOpenAI, tool_choice: str) -> None:
    message = llm.bind_tools([GetWeather], tool_choice=tool_choice, strict=True).invoke(ASK_WEATHER)
    assert isinstance(message, AIMessage) and message.response_metadata["finish_reason"] == "tool_calls"
    calls = assert_valid_calls(message, {"GetWeather"})
    assert tool_choice != "GetWeather" or len(calls) == 1


@pytest.mark.parametrize("tool_choice", ["GetWeather", "required"])
def test_langchain_bind_tools_non_strict_calls_have_the_declared_keys(llm: ChatOpenAI, tool_choice: str) -> None:
    message = llm.bind_tools([GetWeather], tool_choice=tool_choice).invoke(ASK_WEATHER)
    assert_valid_calls(message, {"GetWeather"})


def test_langchain_required_picks_one_of_several_tools(llm: ChatOpenAI) -> None:
    bound = llm.bind_tools([GetWeather, GetTime], tool_choice="required", strict=True, parallel_tool_calls=False)
    message = bound.invoke(ASK_WEATHER)
    assert len(assert_valid_calls(message, {"GetWeather", "GetTime"})) == 1


@pytest.mark.parametrize("tool_choice", ["GetWeather", "required"])
def test_langchain_streamed_tool_calls_aggregate_to_the_whole_answer(llm: ChatOpenAI, tool_choice: str) -> None:
    bound = llm.bind_tools([GetWeather], tool_choice=tool_choice, strict=True)
    whole = bound.invoke(ASK_WEATHER)
    chunks = list(bound.stream(ASK_WEATHER))
    assert len(chunks) > 2 and all(isinstance(chunk, AIMessageChunk) for chunk in chunks)
    aggregate = chunks[0]
    for chunk in chunks[1:]:
        aggregate += chunk
    assert assert_valid_calls(aggregate, {"GetWeather"}) == assert_valid_calls(whole, {"GetWeather"})
    assert aggregate.response_metadata["finish_reason"] == "tool_calls"


def test_langchain_agent_loop_round_trip(llm: ChatOpenAI) -> None:
    """An agent loop's second turn: the assistant's tool_calls message (no content) and the tool's result."""
    history: list[BaseMessage] = [HumanMessage(ASK_WEATHER)]
    call_message = llm.bind_tools([GetWeather], tool_choice="GetWeather", strict=True).invoke(history)
    ((_, args),) = assert_valid_calls(call_message, {"GetWeather"})
    result = {"city": args["city"], "temperature": 21, "unit": args["unit"]}
    history += [call_message, ToolMessage(json.dumps(result), tool_call_id=call_message.tool_calls[0]["id"])]
    answer = llm.bind_tools([GetWeather]).invoke(history)  # tool_choice auto: an answer, or another call
    assert isinstance(answer, AIMessage)
    assert answer.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")
    assert (isinstance(answer.content, str) and answer.content.strip()) or answer.tool_calls


# ---- LiteLLM -----------------------------------------------------------------------------------------------


def litellm_completion(litellm: ModuleType, url: str, **fields: object) -> Any:
    return litellm.completion(
        model=f"openai/{MODEL}",
        api_base=f"{url}/v1",
        api_key="unused",
        temperature=0,
        max_tokens=150,
        timeout=120,
        num_retries=0,
        **fields,
    )


def test_litellm_response_format_pydantic(litellm: ModuleType, url: str) -> None:
    response = litellm_completion(litellm, url, messages=[{"role": "user", "content": ASK_CITY}], response_format=City)
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    city = City.model_validate_json(choice.message.content)
    assert city.kind in ("capital", "town") and 0 <= city.population <= 40_000_000


@pytest.mark.parametrize(
    "tool",
    [
        pytest.param(openai.pydantic_function_tool(GetWeather, name="get_weather"), id="strict"),
        pytest.param(
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": GetWeather.__doc__,
                    "parameters": GetWeather.model_json_schema(),
                },
            },
            id="non-strict",
        ),
    ],
)
def test_litellm_named_tool_choice(litellm: ModuleType, url: str, tool: dict) -> None:
    response = litellm_completion(
        litellm,
        url,
        messages=[{"role": "user", "content": ASK_WEATHER}],
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "unit"}, arguments
    GetWeather.model_validate(arguments)
