"""The hostile inputs themselves: schemas, grammars, tools and raw requests that once crashed, stalled or fooled
the server. Pure builders, no I/O: the soak's attacks (benchmarks/hostile.py) send them, and the hardening tests
(tests/test_hardening_*.py) send them the same way and check the answers closely.
"""

from __future__ import annotations

from typing import Any

# ---- schemas and grammars ----------------------------------------------------------------------------------------


def chained_refs_schema(links: int = 1000) -> dict:
    """~94 KB: `$defs` that chain `links` `$ref`s, each an object holding the next (overflowed the compiler's
    stack from 700-1,000 links)."""
    defs: dict = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(links)}
    defs[f"d{links}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def chained_rules_grammar(rules: int = 3000) -> str:
    """A Lark grammar of `rules` rules, each a terminal and the next rule."""
    return "\n".join(["start: r0", *(f'r{i}: "t" r{i + 1}' for i in range(rules)), f'r{rules}: "t"'])


def many_alternatives_grammar(salt: str = "", alternatives: int = 20_000) -> str:
    """~180 KB of GBNF: one rule of `alternatives` literals (`salt`, one more, makes it one no cache has seen)."""
    fresh = f'"{salt}y" | ' if salt else ""
    return f"root ::= {fresh}" + " | ".join(f'"w{i:05d}x"' for i in range(alternatives))


def many_patterned_properties() -> dict:
    """3,000 optional string properties, each with a pattern whose DFA has 2^13 states."""
    props = {f"p{i}": {"type": "string", "pattern": "^(a|b)*a(a|b){12}$"} for i in range(3000)}
    return {"type": "object", "properties": props}


def nested(levels: int) -> dict[str, Any]:
    """An object holding an object ... `levels` deep, a string at the bottom (two JSON levels per object level)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


# $ref loops that admit no finite value, and a recursive schema that has a base case.
SELF_LOOP = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
TWO_STEP_LOOP = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
ENDLESS_LIST = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}
TREE = {  # a leaf has no kids
    "type": "object",
    "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
    "required": ["v"],
}

# ---- tools -------------------------------------------------------------------------------------------------------


def tool(name: str, parameters: object) -> dict[str, Any]:
    """A chat completions function tool."""
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = tool("get_weather", WEATHER_PARAMETERS)
# Two tools whose $defs (and draft-7 definitions) share a name but not a meaning: a forced call must keep each
# tool's `$ref`s pointing at its own.
WEATHER_DEFS = tool(
    "get_weather",
    {
        "$defs": {"City": {"type": "string", "maxLength": 12}, "Unit": {"enum": ["celsius", "fahrenheit"]}},
        "type": "object",
        "properties": {"city": {"$ref": "#/$defs/City"}, "unit": {"$ref": "#/$defs/Unit"}},
        "required": ["city", "unit"],
    },
)
TIME_DEFS = tool(
    "get_time",
    {
        "definitions": {"City": {"enum": ["Paris", "Rome"]}},
        "type": "object",
        "properties": {"city": {"$ref": "#/definitions/City"}},
        "required": ["city"],
    },
)


def hermes_call(name: str) -> str:
    """A tool call as the embedded model writes one: forced with guided_choice, it calls what the attacker names."""
    return '<tool_call>\n{"name": "' + name + '", "arguments": {"city": "Paris"}}\n</tool_call>'


# ---- raw requests ------------------------------------------------------------------------------------------------


def raw_post(path: str, body: bytes, headers: list[tuple[str, str]]) -> bytes:
    """A POST with exactly these headers (repeats and all) and a Content-Length: no Content-Type of its own."""
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{name}: {value}" for name, value in headers)]
    lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def head_only(path: str, content_length: int = 100, headers: list[tuple[str, str]] | None = None) -> bytes:
    """Complete POST headers announcing a JSON body that is never sent."""
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    lines += [f"{name}: {value}" for name, value in headers or []]
    lines.append(f"Content-Length: {content_length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()
