"""The soak's attacks on schemas, grammars, tools and /v1/responses (issue 32's): constraints that crashed the
grammar compiler, stalled the batch while compiling or failed mid-generation, tool schemas that were too deep or
lost their `$defs`, a tool call nobody declared, and requests whose errors were not OpenAI-shaped.
"""

from __future__ import annotations

import json
import random
import re

import httpx

from benchmarks.attack_kit import (
    CHAT,
    RESPONSES,
    Attack,
    Target,
    Unplanned,
    chat_body,
    check_openai_error,
    planned,
    post,
)
from benchmarks.hostile_inputs import (
    ENDLESS_LIST,
    SELF_LOOP,
    TIME_DEFS,
    TWO_STEP_LOOP,
    WEATHER,
    WEATHER_DEFS,
    chained_refs_schema,
    chained_rules_grammar,
    hermes_call,
    many_alternatives_grammar,
    many_patterned_properties,
    nested,
    tool,
)

ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
TEMPERATURES = (0.0, 1.0, 1.5)
REF_CHAIN = chained_refs_schema()  # built once: ~94 KB
RULE_CHAIN = chained_rules_grammar()
PATTERNED = many_patterned_properties()


def refused_saying(response: httpx.Response, *words: str, param: str | None = None) -> int:
    """The status; a 400 must say each of `words` (what the refusal is about, not any 400) and, given `param`,
    name that field (a compile error once named none)."""
    if response.status_code == 400:
        error = response.json()["error"]
        if not all(word in error["message"] for word in words):
            raise Unplanned(f"400 not about {words}: {error['message'][:200]}")
        if param is not None and error["param"] != param:
            raise Unplanned(f"400 naming {error['param']!r}, not {param!r}: {error['message'][:200]}")
    return response.status_code


def response_format(schema: object) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def forced(rng: random.Random, name: str) -> object:
    return rng.choice(["required", {"type": "function", "function": {"name": name}}])


def respond_body(model: str, **fields: object) -> dict:
    return {"model": model, "input": "What is the weather in Paris?", "max_output_tokens": 8, **fields}


# ---- constraints that crashed the compiler (400 now), stalled the batch or failed mid-generation ---------------


async def ref_chain(target: Target, rng: random.Random) -> int:
    """In chat's response_format, or /v1/responses' text.format."""
    if rng.random() < 0.5:
        response = await post(target, CHAT, chat_body(target.model, response_format=response_format(REF_CHAIN)))
        return refused_saying(response, "too complex", param="response_format")
    text = {"format": {"type": "json_schema", "name": "x", "schema": REF_CHAIN}}
    response = await post(target, RESPONSES, respond_body(target.model, text=text))
    return refused_saying(response, "too complex", param="text.format")


async def rule_chain(target: Target, rng: random.Random) -> int:
    body = chat_body(target.model, structured_outputs={"grammar": RULE_CHAIN})
    return refused_saying(await post(target, CHAT, body), "too complex", param="structured_outputs.grammar")


async def ref_chain_in_a_forced_tool(target: Target, rng: random.Random) -> int:
    """The chat template writes the tool into the prompt: ~35,000 tokens, past the context of a small model (the
    embedded one's is 8,192), which refuses it for its length before any grammar compiles; with a long context
    the compiler's crash is refused."""
    body = chat_body(target.model, tools=[tool("chain", REF_CHAIN)], tool_choice=forced(rng, "chain"))
    response = await post(target, CHAT, body)
    if response.status_code == 400 and "maximum context length" in response.json()["error"]["message"]:
        return 400
    return refused_saying(response, "too complex")


async def fresh_alternatives(target: Target, rng: random.Random) -> int:
    """A 20,000-alternative grammar no cache has seen: seconds to compile, which others must not wait for."""
    salt = f"s{rng.randrange(10**9)}"
    body = chat_body(
        target.model,
        structured_outputs={"grammar": many_alternatives_grammar(salt)},
        temperature=rng.choice(TEMPERATURES),
        max_tokens=8,
    )
    status, text, finish_reason = await chat_text(target, body, stream=rng.random() < 0.5)
    if status == 200:
        whole = re.fullmatch(r"w\d{5}x", text) or text == f"{salt}y"
        begun = re.fullmatch(r"w\d{0,5}", text) or f"{salt}y".startswith(text)
        if not (whole if finish_reason == "stop" else whole or begun):
            raise Unplanned(f"output outside the grammar: {text!r} ({finish_reason})")
    return status


async def patterned_properties(target: Target, rng: random.Random) -> int:
    """3,000 properties with a 2^13-state pattern each: compiles, and must generate valid output, in chat
    (streamed or not) and /v1/responses."""
    temperature = rng.choice(TEMPERATURES)
    if rng.random() < 1 / 3:
        text_format = {"format": {"type": "json_schema", "name": "x", "schema": PATTERNED}}
        body = respond_body(target.model, text=text_format, temperature=temperature, max_output_tokens=24)
        response = await post(target, RESPONSES, body)
        if response.status_code == 200 and response.json()["status"] == "completed":
            text = "".join(part["text"] for item in response.json()["output"] for part in item.get("content", []))
            _check_json_object(text)
        return response.status_code
    body = chat_body(target.model, response_format=response_format(PATTERNED), temperature=temperature, max_tokens=24)
    status, text, finish_reason = await chat_text(target, body, stream=rng.random() < 0.5)
    if status == 200 and finish_reason == "stop":
        _check_json_object(text)
    return status


def _check_json_object(text: str) -> None:
    if not isinstance(_json_or_none(text), dict):
        raise Unplanned(f"stopped with output that is no JSON object: {text!r}")


async def chat_text(target: Target, body: dict, stream: bool) -> tuple[int, str, str | None]:
    """A chat completion's status, its text and finish reason, asked for whole or streamed."""
    if not stream:
        response = await post(target, CHAT, body)
        if response.status_code != 200:
            return response.status_code, "", None
        choice = response.json()["choices"][0]
        return 200, choice["message"]["content"] or "", choice["finish_reason"]
    pieces, finish_reason = [], None
    async with target.client.stream("POST", CHAT, json={**body, "stream": True}) as response:
        if response.status_code != 200:
            await response.aread()
            check_openai_error(response)
            return response.status_code, "", None
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                raise Unplanned(f"a stream that failed after it began: {event['error']}")
            for choice in event["choices"]:
                pieces.append(choice["delta"].get("content") or "")
                finish_reason = choice.get("finish_reason") or finish_reason
    return 200, "".join(pieces), finish_reason


def _json_or_none(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


# ---- tools -----------------------------------------------------------------------------------------------------


async def deep_tool_parameters(target: Target, rng: random.Random) -> int:
    if rng.random() < 0.5:
        body = chat_body(target.model, tools=[tool("deep", nested(250))], tool_choice=forced(rng, "deep"))
        return refused_saying(await post(target, CHAT, body), "levels", param="tools.0.function.parameters")
    tools = [{"type": "function", "name": "deep", "parameters": nested(250)}]
    body = respond_body(target.model, tools=tools, tool_choice="required")
    return refused_saying(await post(target, RESPONSES, body), "levels", param="tools.0.parameters")


async def defs_under_required(target: Target, rng: random.Random) -> int:
    """Two tools whose `$defs` share names: a forced call keeps each tool's `$ref`s, in chat and responses."""
    declared = {"get_weather", "get_time"}
    if rng.random() < 0.5:
        body = chat_body(target.model, messages=ASK_WEATHER, tools=[WEATHER_DEFS, TIME_DEFS], tool_choice="required")
        response = await post(target, CHAT, {**body, "max_tokens": 60, "temperature": rng.choice(TEMPERATURES)})
        if response.status_code == 200:
            message = response.json()["choices"][0]["message"]
            calls = [(call["function"]["name"], call["function"]["arguments"]) for call in message["tool_calls"] or []]
            _check_calls(calls, declared, response.json()["choices"][0]["finish_reason"])
        return response.status_code
    tools = [{"type": "function", **t["function"]} for t in (WEATHER_DEFS, TIME_DEFS)]
    response = await post(target, RESPONSES, respond_body(target.model, tools=tools, tool_choice="required"))
    if response.status_code == 200:
        output = response.json()["output"]
        calls = [(item["name"], item["arguments"]) for item in output if item["type"] == "function_call"]
        _check_calls(calls, declared, "tool_calls" if response.json()["status"] == "completed" else "length")
    return response.status_code


def _check_calls(calls: list[tuple[str, str]], declared: set[str], finish_reason: str) -> None:
    """A finished forced reply is calls to declared tools with JSON object arguments."""
    if finish_reason != "tool_calls":
        return  # cut by max_tokens: the small model may nest on
    if not calls or any(name not in declared or not isinstance(_json_or_none(args), dict) for name, args in calls):
        raise Unplanned(f"a forced reply that is not calls to declared tools: {calls}")


async def undeclared_tool_call(target: Target, rng: random.Random) -> int:
    """The model is made to write a call to a tool the request never declared: it must stay content."""
    text = hermes_call("delete_all")
    body = chat_body(target.model, tools=[WEATHER], tool_choice="auto", guided_choice=[text], max_tokens=60)
    if rng.random() < 0.5:
        response = await post(target, CHAT, body)
        if response.status_code == 200:
            message = response.json()["choices"][0]["message"]
            if message["tool_calls"] or message["content"] != text:
                raise Unplanned(f"an undeclared call came back as {message}")
        return response.status_code
    async with target.client.stream("POST", CHAT, json={**body, "stream": True}) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code
        async for line in response.aiter_lines():
            if line.startswith("data: {") and '"tool_calls"' in line:
                deltas = [choice["delta"] for choice in json.loads(line[len("data: ") :])["choices"]]
                if any(delta.get("tool_calls") for delta in deltas):
                    raise Unplanned(f"an undeclared call streamed as a tool call: {line[:200]}")
    return response.status_code


async def self_referencing_schema(target: Target, rng: random.Random) -> int:
    schema = rng.choice([SELF_LOOP, TWO_STEP_LOOP, ENDLESS_LIST])
    if rng.random() < 0.5:
        body, param = chat_body(target.model, response_format=response_format(schema)), "response_format"
    else:
        body = chat_body(target.model, tools=[tool("loop", schema)], tool_choice="required")
        param = "tools.0.function.parameters"
    return refused_saying(await post(target, CHAT, body), "finite", param=param)


# ---- OpenAI-shaped refusals on /v1/responses and chat -----------------------------------------------------------


async def responses_bad_tool_name(target: Target, rng: random.Random) -> int:
    body = respond_body(target.model, tools=[{"type": "function", "name": "a b"}])
    return refused_saying(await post(target, RESPONSES, body), "function names")


async def named_tool_choice_without_tools(target: Target, rng: random.Random) -> int:
    if rng.random() < 0.5:
        body = chat_body(target.model, tool_choice={"type": "function", "function": {"name": "get_weather"}})
        return refused_saying(await post(target, CHAT, body), "get_weather")
    body = respond_body(target.model, tool_choice={"type": "function", "name": "get_weather"})
    return refused_saying(await post(target, RESPONSES, body), "get_weather")


async def json_schema_without_schema(target: Target, rng: random.Random) -> int:
    if rng.random() < 0.5:
        body = chat_body(target.model, response_format={"type": "json_schema", "json_schema": {"name": "x"}})
        return refused_saying(await post(target, CHAT, body), "schema")
    body = respond_body(target.model, text={"format": {"type": "json_schema", "name": "x"}})
    return refused_saying(await post(target, RESPONSES, body), "schema")


async def function_call_output_without_its_call(target: Target, rng: random.Random) -> int:
    orphan = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call_output", "call_id": "call_nowhere", "output": "21"},
    ]
    return refused_saying(await post(target, RESPONSES, respond_body(target.model, input=orphan)), "call_nowhere")


CONSTRAINT_ATTACKS = (
    Attack("1,000-link $ref chain", planned(400), ref_chain),
    Attack("3,000-rule Lark grammar", planned(400), rule_chain),
    Attack("$ref chain in a forced tool", planned(400), ref_chain_in_a_forced_tool),
    Attack("fresh 20k-alternative grammar", planned(200), fresh_alternatives, heavy=True),
    Attack("3,000 patterned properties", planned(200), patterned_properties, heavy=True),
    Attack("250-deep tool parameters", planned(400), deep_tool_parameters),
    Attack("$defs under a forced call", planned(200), defs_under_required),
    Attack("undeclared tool call", planned(200), undeclared_tool_call),
    Attack("self-referencing schema", planned(400), self_referencing_schema),
    Attack("responses: bad tool name", planned(400), responses_bad_tool_name),
    Attack("named tool_choice without tools", planned(400), named_tool_choice_without_tools),
    Attack("json_schema without a schema", planned(400), json_schema_without_schema),
    Attack("function_call_output without its call", planned(400), function_call_output_without_its_call),
)
