"""Tool and schema requests that used to break the server: deep or looping schemas, `$defs` under a forced call,
calls to tools the request never declared, and errors that named no field. A real uvicorn server, the
embedded model, httpx and the openai SDK."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from benchmarks.hostile_inputs import (
    ENDLESS_LIST,
    SELF_LOOP,
    TIME_DEFS,
    TREE,
    TWO_STEP_LOOP,
    WEATHER,
    WEATHER_DEFS,
    chained_refs_schema,
    chained_rules_grammar,
    hermes_call,
    nested,
    tool,
)
from pagedserve.engine import EngineConfig
from pagedserve.server import ServerSettings
from tests.servers import engine_and_url
from tests.test_server_errors import assert_error

MODEL = "smol"
MAX_SCHEMA_DEPTH = 64  # server/response_format.py's limit, levels of JSON objects and arrays
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


engine, url = engine_and_url(EngineConfig(num_kv_blocks=256), ServerSettings([MODEL]))


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat(url: str, **body: object) -> httpx.Response:
    payload = {"model": MODEL, "messages": ASK_WEATHER, "max_tokens": 60, "temperature": 0, **body}
    return httpx.post(f"{url}/v1/chat/completions", json=payload, timeout=120)


def respond(url: str, **body: object) -> httpx.Response:
    payload = {"model": MODEL, "input": "What is the weather in Paris?", "max_output_tokens": 60, **body}
    return httpx.post(f"{url}/v1/responses", json=payload, timeout=120)


def streamed_deltas(url: str, **body: object) -> list[dict]:
    payload = {"model": MODEL, "messages": ASK_WEATHER, "max_tokens": 60, "temperature": 0, "stream": True, **body}
    deltas = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=payload, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                deltas += [choice["delta"] for choice in json.loads(line[len("data: ") :])["choices"]]
    return deltas


# ---- 1. nesting depth ------------------------------------------------------------------------------------


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "deep"}}, "auto"])
def test_deeply_nested_tool_parameters_get_400_naming_the_limit(url: str, choice: object) -> None:
    message = assert_error(
        chat(url, tools=[tool("deep", nested(250))], tool_choice=choice),
        400,
        "invalid_value",
        "tools.0.function.parameters",
    )
    assert f"{MAX_SCHEMA_DEPTH} levels" in message
    responses_tool = {"type": "function", "name": "deep", "parameters": nested(250)}
    message = assert_error(
        respond(url, tools=[responses_tool], tool_choice="required"), 400, "invalid_value", "tools.0.parameters"
    )
    assert f"{MAX_SCHEMA_DEPTH} levels" in message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": nested(250)}}},
            "response_format",
        ),
        ({"guided_json": nested(250)}, "guided_json"),
        ({"guided_json": json.dumps(nested(250))}, "guided_json"),
        ({"structured_outputs": {"json": json.dumps(nested(250))}}, "structured_outputs.json"),
        ({"json_schema": nested(250)}, "json_schema"),
    ],
)
def test_deeply_nested_response_schemas_get_400_naming_the_limit(url: str, fields: dict, param: str) -> None:
    message = assert_error(chat(url, **fields), 400, "invalid_value", param)
    assert f"{MAX_SCHEMA_DEPTH} levels" in message
    text_format = {"type": "json_schema", "name": "x", "schema": nested(250)}
    message = assert_error(respond(url, text={"format": text_format}), 400, "invalid_value", "text.format")
    assert f"{MAX_SCHEMA_DEPTH} levels" in message


def test_schemas_at_the_depth_limit_still_work(url: str) -> None:
    levels = (MAX_SCHEMA_DEPTH - 1) // 2  # two JSON levels per object level, one for the string inside
    response = chat(url, tools=[tool("deep", nested(levels))], tool_choice="required", max_tokens=4)
    assert response.status_code == 200, response.text


# ---- 2. $defs under a forced call ------------------------------------------------------------------------


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_keeps_each_tool_s_defs(client: openai.OpenAI, parallel: bool) -> None:
    completion = client.chat.completions.create(
        model=MODEL,
        messages=ASK_WEATHER,
        tools=[WEATHER_DEFS, TIME_DEFS],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=parallel,
        temperature=0,
        max_tokens=120,
    )
    calls = completion.choices[0].message.tool_calls
    assert calls and completion.choices[0].finish_reason == "tool_calls"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER_DEFS, TIME_DEFS)}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])  # type: ignore[union-attr]


def test_named_tool_choice_keeps_the_tool_s_defs(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL,
        messages=ASK_WEATHER,
        tools=[WEATHER_DEFS, TIME_DEFS],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=0,
        max_tokens=60,
    )
    (call,) = completion.choices[0].message.tool_calls or []
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")  # type: ignore[union-attr]


def test_responses_required_tool_choice_keeps_each_tool_s_defs(client: openai.OpenAI) -> None:
    tools = [{"type": "function", **t["function"]} for t in (WEATHER_DEFS, TIME_DEFS)]
    response = client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=tools,  # type: ignore[arg-type]
        tool_choice="required",
        temperature=0,
        max_output_tokens=120,
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and response.status == "completed"
    schemas = {t["name"]: t["parameters"] for t in tools}
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_required_tool_choice_with_a_recursive_tool(client: openai.OpenAI) -> None:
    """A `$ref: "#"` means the tool's own root, not the wrapper's (an array of calls)."""
    completion = client.chat.completions.create(
        model=MODEL,
        messages=ASK_WEATHER,
        tools=[tool("tree", TREE)],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=120,
    )
    assert_tree_so_far(completion.choices[0], completion.choices[0].message.content or "")


def assert_tree_so_far(choice: Any, text: str) -> None:
    """A whole tree call is valid; one cut by the length limit (the small model nests on) nests trees."""
    if choice.finish_reason == "length":
        assert '"kids": [{"v": ' in text, text
        return
    (call,) = choice.message.tool_calls or []
    jsonschema.validate(json.loads(call.function.arguments), TREE)


# ---- 3. only declared tools come back as calls -----------------------------------------------------------


def test_a_declared_call_the_model_writes_is_a_tool_call(url: str) -> None:
    """The control: guided_choice makes the model write the call, which comes back as one."""
    body = chat(url, tools=[WEATHER], guided_choice=[hermes_call("get_weather")]).json()
    message = body["choices"][0]["message"]
    assert [call["function"]["name"] for call in message["tool_calls"]] == ["get_weather"], body
    deltas = streamed_deltas(url, tools=[WEATHER], guided_choice=[hermes_call("get_weather")])
    starts = [d["tool_calls"][0] for d in deltas if "tool_calls" in d and "id" in d["tool_calls"][0]]
    assert [start["function"]["name"] for start in starts] == ["get_weather"]


def test_an_undeclared_call_the_model_writes_stays_content(url: str) -> None:
    text = hermes_call("delete_all")
    body = chat(url, tools=[WEATHER], tool_choice="auto", guided_choice=[text]).json()
    message = body["choices"][0]["message"]
    assert message["tool_calls"] is None and message["content"] == text, body
    assert body["choices"][0]["finish_reason"] == "stop"
    deltas = streamed_deltas(url, tools=[WEATHER], tool_choice="auto", guided_choice=[text])
    assert not any("tool_calls" in d for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == text


def test_an_undeclared_call_among_declared_ones_makes_the_reply_content(url: str) -> None:
    text = hermes_call("get_weather") + "\n" + hermes_call("delete_all")
    message = chat(url, tools=[WEATHER], guided_choice=[text], max_tokens=120).json()["choices"][0]["message"]
    assert message["tool_calls"] is None and message["content"] == text


# ---- 4. $ref loops without a base case -------------------------------------------------------------------


@pytest.mark.parametrize("schema", [SELF_LOOP, TWO_STEP_LOOP, ENDLESS_LIST, {"$ref": "#"}])
def test_schemas_that_admit_no_finite_value_get_400(url: str, schema: dict) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    message = assert_error(chat(url, response_format=response_format), 400, "invalid_value", "response_format")
    assert "$ref" in message and "finite" in message
    message = assert_error(
        chat(url, tools=[tool("f", schema)], tool_choice="required"),
        400,
        "invalid_value",
        "tools.0.function.parameters",
    )
    assert "finite" in message
    text_format = {"type": "json_schema", "name": "x", "schema": schema}
    assert_error(respond(url, text={"format": text_format}), 400, "invalid_value", "text.format")


def test_recursive_schemas_with_a_base_case_still_work(url: str) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "tree", "schema": TREE}}
    choice = chat(url, response_format=response_format, max_tokens=80).json()["choices"][0]
    text = choice["message"]["content"]
    if choice["finish_reason"] == "length":  # the small model nests on
        assert text.startswith('{"v": ') and '"kids": [{"v": ' in text, text
    else:
        jsonschema.validate(json.loads(text), TREE)


# ---- 5. errors name their field, in OpenAI's shape -------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"minimum": "a"}}}},
            "response_format",
        ),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"structured_outputs": {"grammar": "root ::= missing_rule"}}, "structured_outputs.grammar"),
        (
            {"tools": [tool("f", {"minimum": "a"})], "tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tools.0.function.parameters",
        ),
        (
            {
                "tools": [WEATHER, tool("f", {"minimum": "a"})],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
            "tools.1.function.parameters",
        ),
        ({"tools": [tool("f", {"minimum": "a"})], "tool_choice": "required"}, "tools.0.function.parameters"),
    ],
)
def test_constraint_compile_errors_name_their_field(url: str, fields: dict, param: str) -> None:
    assert_error(chat(url, **fields), 400, "invalid_value", param)


def test_responses_compile_errors_name_their_field(url: str) -> None:
    text_format = {"type": "json_schema", "name": "x", "schema": {"minimum": "a"}}
    assert_error(respond(url, text={"format": text_format}), 400, "invalid_value", "text.format")
    bad_tool = {"type": "function", "name": "f", "parameters": {"minimum": "a"}}
    choice = {"type": "function", "name": "f"}
    assert_error(respond(url, tools=[bad_tool], tool_choice=choice), 400, "invalid_value", "tools.0.parameters")


def test_constraints_too_complex_to_compile_name_their_field(url: str) -> None:
    """A constraint that crashes the compiler is refused as too complex: that refusal names its field too."""
    rules = chat(url, structured_outputs={"grammar": chained_rules_grammar()})
    assert "too complex" in assert_error(rules, 400, "invalid_value", "structured_outputs.grammar")
    text_format = {"type": "json_schema", "name": "x", "schema": chained_refs_schema()}
    refs = respond(url, text={"format": text_format})
    assert "too complex" in assert_error(refs, 400, "invalid_value", "text.format")


def test_responses_bad_tool_name_gets_an_openai_message(url: str) -> None:
    message = assert_error(
        respond(url, tools=[{"type": "function", "name": "a b"}]), 400, "invalid_value", "tools.0.name"
    )
    assert "function names are 1 to 64" in message and "pydantic" not in message and "validation error" not in message


@pytest.mark.parametrize("endpoint", ["chat", "responses"])
def test_named_tool_choice_without_tools_gets_a_plain_message(url: str, endpoint: str) -> None:
    if endpoint == "chat":
        response = chat(url, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    else:
        response = respond(url, tool_choice={"type": "function", "name": "get_weather"})
    message = assert_error(response, 400, "invalid_value", "tool_choice")
    assert "get_weather" in message and "NamedToolChoice" not in message and "function=" not in message


def test_json_schema_format_without_a_schema_gets_400_on_both_endpoints(url: str) -> None:
    assert_error(chat(url, response_format={"type": "json_schema"}), 400, "invalid_value", "response_format")
    schemaless = {"type": "json_schema", "json_schema": {"name": "x"}}
    assert_error(chat(url, response_format=schemaless), 400, "invalid_value", "response_format")
    message = assert_error(
        respond(url, text={"format": {"type": "json_schema", "name": "x"}}), 400, "invalid_value", "text.format"
    )
    assert "schema" in message


def test_function_call_output_without_its_call_gets_400(url: str) -> None:
    orphan = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call_output", "call_id": "call_nowhere", "output": "21"},
    ]
    message = assert_error(respond(url, input=orphan), 400, "invalid_value", "input")
    assert "call_nowhere" in message
    answered = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "21"},
    ]
    assert respond(url, input=answered, max_output_tokens=2).status_code == 200
