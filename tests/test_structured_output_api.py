"""Structured output and tool calling over HTTP: a real uvicorn server, the embedded model, the openai SDK."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from pagedserve.engine import EngineConfig
from pagedserve.engine.client.async_engine import AsyncEngine
from pagedserve.server import ServerSettings
from tests.servers import engine_and_url, serving
from tests.test_server_errors import assert_error

MODEL = "smol"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population: int = Field(ge=0, le=40_000_000)
    kind: Literal["capital", "town"]


engine, url = engine_and_url(EngineConfig(num_kv_blocks=256), ServerSettings([MODEL]))


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat(url: str, **body: object) -> httpx.Response:
    payload = {"model": MODEL, "messages": ASK_WEATHER, "max_tokens": 80, "temperature": 0, **body}
    return httpx.post(f"{url}/v1/chat/completions", json=payload, timeout=120)


def streamed_chunks(url: str, **body: object) -> list[dict]:
    payload = {"model": MODEL, "messages": ASK_WEATHER, "max_tokens": 80, "temperature": 0, "stream": True, **body}
    chunks = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=payload, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks


# ---- response_format and the other servers' constraint fields -----------------------------------------


def test_sdk_parse_returns_the_pydantic_model(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        temperature=0,
        max_tokens=120,
    )
    city = completion.choices[0].message.parsed
    assert isinstance(city, City) and completion.choices[0].finish_reason == "stop"


def test_json_object_on_completions(client: openai.OpenAI) -> None:
    completion = client.completions.create(
        model=MODEL, prompt="A JSON object about a cat:", max_tokens=60, temperature=0, extra_body={}
    )
    assert completion.choices[0].text  # unconstrained: anything
    constrained = httpx.post(
        f"{client.base_url}completions",
        json={
            "model": MODEL,
            "prompt": "A JSON object about a cat:",
            "max_tokens": 200,
            "temperature": 0,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "cat", "schema": City.model_json_schema()},
            },
        },
        timeout=120,
    ).json()
    City.model_validate_json(constrained["choices"][0]["text"])


@pytest.mark.parametrize(
    ("fields", "check"),
    [
        ({"guided_regex": "[0-9]{2}:[0-9]{2}"}, lambda text: re.fullmatch("[0-9]{2}:[0-9]{2}", text)),
        ({"guided_choice": ["sunny", "rainy"]}, lambda text: text in ("sunny", "rainy")),
        ({"structured_outputs": {"choice": ["sunny", "rainy"]}}, lambda text: text in ("sunny", "rainy")),
        ({"structured_outputs": {"regex": "[a-z]{3}"}}, lambda text: re.fullmatch("[a-z]{3}", text)),
        (
            {"guided_json": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}},
            lambda text: isinstance(json.loads(text)["ok"], bool),
        ),
        (
            {"json_schema": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
            lambda text: all(isinstance(x, int) for x in json.loads(text)),
        ),
        ({"grammar": 'root ::= "it is " ("warm" | "cold")'}, lambda text: text in ("it is warm", "it is cold")),
        ({"guided_grammar": 'start: "yes" | "no"'}, lambda text: text in ("yes", "no")),
        ({"response_format": {"type": "json_object"}}, lambda text: isinstance(json.loads(text), dict)),
    ],
)
def test_every_constraint_field_is_honoured(url: str, fields: dict, check: Callable[[str], object]) -> None:
    body = chat(url, max_tokens=200, **fields).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop", body
    assert check(choice["message"]["content"]), choice["message"]["content"]


@pytest.mark.parametrize(
    ("fields", "param", "needle"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"minimum": "a"}}}},
            "response_format",  # the grammar library's reason, naming the field it came from
            "minimum",
        ),
        ({"guided_regex": "(unclosed"}, "guided_regex", "unclosed group"),
        ({"grammar": "root ::= missing_rule"}, "grammar", "missing_rule"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex", "one output constraint"),
        ({"response_format": {"type": "xml"}}, "response_format", "response_format type"),
    ],
)
def test_bad_constraints_get_400_and_the_server_carries_on(
    url: str, fields: dict, param: str | None, needle: str
) -> None:
    message = assert_error(chat(url, **fields), 400, "invalid_value", param)
    assert needle in message
    assert chat(url, max_tokens=2).status_code == 200


def test_streamed_constrained_output(url: str) -> None:
    chunks = streamed_chunks(
        url, guided_json={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    )
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert isinstance(json.loads(text)["n"], int)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


# ---- tools ----------------------------------------------------------------------------------------------


def test_named_tool_choice_forces_a_valid_call(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL,
        messages=ASK_WEATHER,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=80,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_calls_one_of_the_tools(client: openai.OpenAI, parallel: bool) -> None:
    completion = client.chat.completions.create(
        model=MODEL,
        messages=ASK_WEATHER,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=parallel,
        temperature=0,
        max_tokens=150,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls and (parallel or len(calls) == 1)
    for call in calls:
        assert call.function.name in ("get_weather", "get_time")
        json.loads(call.function.arguments)
    assert len({call.id for call in calls}) == len(calls)


def test_streamed_named_call_comes_as_openai_streams_it(url: str) -> None:
    chunks = streamed_chunks(
        url, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    first = calls[0]
    assert first["index"] == 0 and first["id"].startswith("call_") and first["function"]["name"] == "get_weather"
    arguments = "".join(call["function"].get("arguments", "") for call in calls)
    assert set(json.loads(arguments)) == {"city", "unit"}
    assert all("id" not in call for call in calls[1:])
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_streamed_required_calls_match_the_whole_answer(url: str) -> None:
    body = {"tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 150}
    whole = chat(url, **body).json()["choices"][0]["message"]["tool_calls"]
    chunks = streamed_chunks(url, **body)
    streamed: dict[int, dict] = {}
    for chunk in chunks:
        for call in chunk["choices"][0]["delta"].get("tool_calls", []) if chunk["choices"] else []:
            entry = streamed.setdefault(call["index"], {"name": "", "arguments": ""})
            entry["name"] += call.get("function", {}).get("name", "")
            entry["arguments"] += call.get("function", {}).get("arguments", "")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole] == [
        (streamed[i]["name"], streamed[i]["arguments"]) for i in sorted(streamed)
    ]


def test_auto_reads_hermes_calls_and_history_round_trips(client: openai.OpenAI) -> None:
    """The small model rarely calls a tool by itself; what it writes is parsed either way, and an agent loop's
    history (assistant tool_calls with null content, tool results) is accepted."""
    completion = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], temperature=0, max_tokens=60
    )
    message = completion.choices[0].message
    assert message.content or message.tool_calls
    history = [
        *ASK_WEATHER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], temperature=0, max_tokens=30
    )
    assert answer.choices[0].message.content is not None


def test_tool_choice_none_writes_plain_content(url: str) -> None:
    message = chat(url, tools=[WEATHER], tool_choice="none", max_tokens=20).json()["choices"][0]["message"]
    assert message["tool_calls"] is None and message["content"]


@pytest.mark.parametrize(
    ("fields", "code", "param", "needle"),
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "invalid_value",
            "tool_choice",
            "not among the tools",
        ),
        ({"tool_choice": "required"}, "invalid_value", "tool_choice", "needs tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "a b"}}]},
            "invalid_value",
            "tools.0.function.name",
            "names",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"},
            "invalid_value",
            "tool_choice",
            "cannot be combined",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, "invalid_value", "messages.0", "tool_call_id"),
        ({"messages": [{"role": "user"}]}, "invalid_value", "messages.0", "content is required"),
        ({"functions": [{"name": "f"}]}, "unsupported_parameter", "functions", "deprecated"),
    ],
)
def test_bad_tool_requests_get_400(url: str, fields: dict, code: str, param: str | None, needle: str) -> None:
    assert needle in assert_error(chat(url, **fields), 400, code, param)


def test_constraint_metrics_are_exported(url: str) -> None:
    chat(url, guided_choice=["a", "b"], max_tokens=4)
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    count = re.search(r"^pagedserve:structured_output_requests_total\{[^}]*\} (\S+)$", metrics, re.MULTILINE)
    assert count and float(count.group(1)) >= 1
    assert "pagedserve:grammar_mask_seconds_total" in metrics and "pagedserve:jump_forward_tokens_total" in metrics


# ---- the Responses API ----------------------------------------------------------------------------------

RESPONSES_WEATHER = {"type": "function", **WEATHER["function"]}


def test_responses_named_function_call_and_its_output_round_trip(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[RESPONSES_WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=80,
    )
    assert response.status == "completed"
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    assert set(json.loads(call.arguments)) == {"city", "unit"}
    follow_up = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'},
        ],
        tools=[RESPONSES_WEATHER],
        temperature=0,
        max_output_tokens=30,
    )
    assert follow_up.output and follow_up.output[0].type in ("message", "function_call")


def test_responses_streamed_function_call_events(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(
            model=MODEL,
            input="What is the weather in Paris?",
            tools=[RESPONSES_WEATHER],
            tool_choice="required",
            temperature=0,
            max_output_tokens=120,
            stream=True,
        )
    )
    kinds = [event.type for event in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert "response.output_text.delta" not in kinds
    fragments = "".join(event.delta for event in events if event.type == "response.function_call_arguments.delta")
    done = next(event for event in events if event.type == "response.function_call_arguments.done")
    final = events[-1].response.output
    assert fragments == done.arguments == final[-1].arguments
    json.loads(done.arguments)
    assert [event.sequence_number for event in events] == list(range(len(events)))


def test_responses_text_format_json_schema(client: openai.OpenAI) -> None:
    response = client.responses.parse(
        model=MODEL, input="Describe Paris as JSON.", text_format=City, temperature=0, max_output_tokens=120
    )
    assert isinstance(response.output_parsed, City)
    assert response.text.format.type == "json_schema"


# ---- reasoning models -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def thinking_url(engine: AsyncEngine) -> Iterator[str]:
    with serving(engine, ServerSettings([MODEL], reasoning_parser="think")) as url:
        yield url


def test_thinking_is_split_off_and_the_constraint_applies_to_the_answer(thinking_url: str) -> None:
    """The assistant turn is continued inside an opened <think>: the grammar leaves the thought free and
    constrains what follows </think> (pushed by logit_bias: the small model does not think by itself)."""
    close_think = {9617: 60, 17400: 60, 46: 60}  # "</", "think", ">" in SmolLM2's vocabulary
    request = {
        "messages": [*ASK_WEATHER, {"role": "assistant", "content": "<think>"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
        "guided_choice": ["sunny", "rainy"],
        "logit_bias": close_think,
        "max_tokens": 20,
    }
    body = chat(thinking_url, **request).json()
    message = body["choices"][0]["message"]
    assert message["content"] in ("sunny", "rainy"), body
    assert message["reasoning_content"] is not None and "</think>" not in message["reasoning_content"]
    streamed = streamed_chunks(thinking_url, **request)
    deltas = [chunk["choices"][0]["delta"] for chunk in streamed if chunk["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
