"""Tool-call parsers: whole replies, streamed replies cut anywhere, and their agreement."""

from __future__ import annotations

import json
import random

import pytest

from pagedserve.server.tool_parsers import (
    PARSERS,
    HermesParser,
    JsonArrayParser,
    Llama3JsonParser,
    MistralParser,
    parser_for_template,
)
from pagedserve.server.tool_parsers.base import (
    ContentDelta,
    ParsedReply,
    ParsedToolCall,
    StreamEvent,
    ToolArgumentsDelta,
    ToolCallStart,
    ToolCallStream,
    ToolParser,
)

ARGUMENTS = {
    "city": "東京",
    "note": 'café 🙂 "quoted" \\ back\nslash',
    "code": "if (x) { return '}'; } else { [{]} }",
    "nested": {"a": {"b": [1, {"c": 2.5}, None, True]}, "empty": {}},
    "count": -3,
}
SIMPLE = {"city": "Paris"}


def call(name: str, arguments: object) -> ParsedToolCall:
    return ParsedToolCall(name, json.dumps(arguments, ensure_ascii=False))


def random_pieces(text: str, rng: random.Random, longest: int = 8) -> list[str]:
    pieces, position = [], 0
    while position < len(text):
        size = rng.randint(1, longest)
        pieces.append(text[position : position + size])
        position += size
    return pieces


def replay(stream: ToolCallStream, pieces: list[str]) -> tuple[ParsedReply, list[StreamEvent]]:
    """Folds a stream's events into a reply, checking the events come in an order a client can follow."""
    events = [event for piece in pieces for event in stream.feed(piece)] + stream.finish()
    content: list[str] = []
    names: list[str] = []
    arguments: list[list[str]] = []
    for event in events:
        if isinstance(event, ContentDelta):
            assert event.text
            content.append(event.text)
        elif isinstance(event, ToolCallStart):
            assert event.index == len(names) and event.name
            names.append(event.name)
            arguments.append([])
        else:
            assert isinstance(event, ToolArgumentsDelta) and event.index == len(names) - 1
            arguments[event.index].append(event.text)
    calls = [ParsedToolCall(name, "".join(parts)) for name, parts in zip(names, arguments)]
    return ParsedReply("".join(content) or None, calls), events


def assert_stream_matches_parse(parser: ToolParser, text: str, splits: int = 40, seed: int = 0) -> ParsedReply:
    parsed = parser.parse(text)
    rng = random.Random(seed)
    for pieces in [list(text), [text]] + [random_pieces(text, rng) for _ in range(splits)]:
        streamed, _ = replay(parser.stream(), pieces)
        assert (streamed.content or "") == (parsed.content or ""), pieces
        assert streamed.tool_calls == parsed.tool_calls, pieces
    return parsed


# ---------------------------------------------------------------------------------------------------------------
# Choosing a parser


@pytest.mark.parametrize(
    "template, expected",
    [
        ("{% for t in tools %}<tool_call>{{ t }}</tool_call>{% endfor %}", "hermes"),
        ("{{ '<|python_tag|>' }}", "llama3_json"),
        ("{% if message.role == 'ipython' %}", "llama3_json"),
        ("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS] [TOOL_CALLS]", "mistral"),
        ("{{ messages }}", "hermes"),
        (None, "hermes"),
    ],
)
def test_parser_for_template_looks_for_each_format_s_markers(template: str | None, expected: str) -> None:
    assert parser_for_template(template) == expected


def test_registry_names_every_parser() -> None:
    assert set(PARSERS) == {"hermes", "llama3_json", "mistral", "phi4_mini_json", "pythonic", "json_array"}
    for name, parser in PARSERS.items():
        assert parser.name == name
        assert isinstance(parser().stream(), ToolCallStream)


# ---------------------------------------------------------------------------------------------------------------
# hermes


def hermes_block(name: str, arguments: object, key: str = "arguments") -> str:
    return "<tool_call>\n" + json.dumps({"name": name, key: arguments}, ensure_ascii=False) + "\n</tool_call>"


def test_hermes_call_after_content() -> None:
    text = "Let me check the weather.\n\n" + hermes_block("get_weather", SIMPLE)
    assert HermesParser().parse(text) == ParsedReply("Let me check the weather.", [call("get_weather", SIMPLE)])


def test_hermes_several_calls_and_no_content() -> None:
    text = hermes_block("a", SIMPLE) + "\n" + hermes_block("b", ARGUMENTS) + "\n"
    assert HermesParser().parse(text) == ParsedReply(None, [call("a", SIMPLE), call("b", ARGUMENTS)])


def test_hermes_arguments_keep_unicode_nested_braces_and_braces_in_strings() -> None:
    parsed = HermesParser().parse(hermes_block("run", ARGUMENTS))
    assert json.loads(parsed.tool_calls[0].arguments) == ARGUMENTS
    assert "東京" in parsed.tool_calls[0].arguments and "🙂" in parsed.tool_calls[0].arguments


def test_hermes_arguments_as_a_json_string_are_decoded() -> None:
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\":1,\\"b\\":[1,2]}"}</tool_call>'
    assert HermesParser().parse(text).tool_calls == [ParsedToolCall("f", '{"a": 1, "b": [1, 2]}')]


def test_hermes_arguments_are_rewritten_with_json_dumps_spacing() -> None:
    text = '<tool_call>{"name":"f","arguments":{"a":1,"b":{"c":"\\u00e9"}}}</tool_call>'
    assert HermesParser().parse(text).tool_calls == [ParsedToolCall("f", '{"a": 1, "b": {"c": "é"}}')]


def test_hermes_missing_arguments_are_an_empty_object() -> None:
    assert HermesParser().parse('<tool_call>{"name": "now"}</tool_call>').tool_calls == [ParsedToolCall("now", "{}")]


def test_hermes_text_between_and_after_calls_is_content() -> None:
    text = "First.\n" + hermes_block("a", {}) + "\nThen.\n" + hermes_block("b", {}) + "\n\nDone.\n"
    assert HermesParser().parse(text) == ParsedReply("First.Then.Done.\n", [call("a", {}), call("b", {})])


def test_hermes_block_left_open_at_the_end_counts_when_complete() -> None:
    text = 'Sure. <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n'
    assert HermesParser().parse(text) == ParsedReply("Sure.", [call("f", {"x": 1})])


@pytest.mark.parametrize(
    "text",
    [
        "Just an answer, no tools.",
        "",
        "A <tool_call> tag mentioned, no JSON",
        '<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call>',  # one brace short
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>',
        '<tool_call>["f", {}]</tool_call>',
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", "argu',
        "<tool_call>" + "[" * 100_000 + "</tool_call>",
    ],
)
def test_hermes_reply_without_a_well_formed_call_is_all_content(text: str) -> None:
    assert HermesParser().parse(text) == ParsedReply(text, [])


HERMES_REPLIES = [
    "Plain answer with trailing space \n",
    "Mentions <tool_ without being a call <tool_call",
    "Let me check.\n\n" + hermes_block("get_weather", SIMPLE),
    hermes_block("a", ARGUMENTS) + "\n" + hermes_block("b", SIMPLE, key="parameters"),
    "First.\n" + hermes_block("a", {}) + "\nThen.\n" + hermes_block("b", {}) + "\n\nDone.\n",
    'Sure. <tool_call>\n{"name": "f", "arguments": "{\\"x\\": [1, {\\"y\\": \\"}\\"}]}"}\n',
    'Oops \n<tool_call>{"name": "f", "arguments": {</tool_call> rest',  # first call malformed: all content
    "<tool_call>",
]


@pytest.mark.parametrize("text", HERMES_REPLIES)
def test_hermes_stream_matches_parse_however_the_reply_is_cut(text: str) -> None:
    assert_stream_matches_parse(HermesParser(), text)


def test_hermes_stream_holds_back_only_what_may_be_a_tag() -> None:
    stream = HermesParser().stream()
    assert stream.feed("Hello <tool") == [ContentDelta("Hello")]
    assert stream.feed("box> is not a tag") == [ContentDelta(" <toolbox> is not a tag")]
    assert stream.finish() == []


def test_hermes_stream_sends_each_call_at_its_closing_tag() -> None:
    stream = HermesParser().stream()
    assert stream.feed("Checking.\n<tool_call>\n") == [ContentDelta("Checking.")]
    assert stream.feed('{"name": "get_weather", "arguments": {"city": "Paris"}}\n') == []
    assert stream.feed("</tool_call>\n") == [
        ToolCallStart(0, "get_weather"),
        ToolArgumentsDelta(0, '{"city": "Paris"}'),
    ]
    assert stream.feed("<tool_call>{") == []
    assert stream.feed('"name": "b"}</tool_call>') == [ToolCallStart(1, "b"), ToolArgumentsDelta(1, "{}")]
    assert stream.finish() == []


def test_hermes_stream_sends_a_malformed_call_after_a_sent_one_as_content() -> None:
    text = hermes_block("a", SIMPLE) + "\n<tool_call>{bad}</tool_call> tail"
    streamed, _ = replay(HermesParser().stream(), list(text))
    assert streamed == ParsedReply("<tool_call>{bad}</tool_call> tail", [call("a", SIMPLE)])


# ---------------------------------------------------------------------------------------------------------------
# llama3_json


def test_llama3_single_call() -> None:
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert Llama3JsonParser().parse(text) == ParsedReply(None, [call("get_weather", SIMPLE)])


def test_llama3_python_tag_and_arguments_key() -> None:
    text = '<|python_tag|>{"name": "f", "arguments": {"x": 1}}'
    assert Llama3JsonParser().parse(text) == ParsedReply(None, [call("f", {"x": 1})])


def test_llama3_calls_separated_by_semicolons_even_inside_strings() -> None:
    first = {"query": "a; b; {c}"}
    text = (
        json.dumps({"name": "search", "parameters": first})
        + "; "
        + json.dumps({"name": "run", "parameters": ARGUMENTS})
        + ";\n"
    )
    assert Llama3JsonParser().parse(text) == ParsedReply(None, [call("search", first), call("run", ARGUMENTS)])


@pytest.mark.parametrize(
    "text",
    [
        'Here you go: {"name": "f", "parameters": {}}',  # calls only when the reply starts with them
        '{"answer": 42}',
        '{"name": "f", "parameters": {"x": 1}',
        '{"name": "f", "parameters": {}} and then some words',
        '{"name": "f", "parameters": {}}; {"name": 3}',
        '<|python_tag|>print("hello")',
        "<|python_tag|>",
        "",
    ],
)
def test_llama3_reply_without_well_formed_calls_is_all_content(text: str) -> None:
    assert Llama3JsonParser().parse(text) == ParsedReply(text, [])


LLAMA3_REPLIES = [
    "  Plain answer.",
    "<|python_",
    '\n<|python_tag|>{"name": "f", "parameters": ' + json.dumps(ARGUMENTS) + "}",
    '{"name": "a", "parameters": {"q": "x;y"}}; {"name": "b", "arguments": {}}',
    '{"name": "a", "parameters": {"q": 1}}; {"oops"',
    '{"answer": 42}',
]


@pytest.mark.parametrize("text", LLAMA3_REPLIES)
def test_llama3_stream_matches_parse_however_the_reply_is_cut(text: str) -> None:
    assert_stream_matches_parse(Llama3JsonParser(), text)


def test_llama3_stream_sends_content_as_soon_as_the_start_rules_calls_out() -> None:
    stream = Llama3JsonParser().stream()
    assert stream.feed(" ") == []
    assert stream.feed("<|py") == []
    assert stream.feed("thon is a language") == [ContentDelta(" <|python is a language")]


# ---------------------------------------------------------------------------------------------------------------
# mistral


def test_mistral_array_after_content() -> None:
    calls = [{"name": "a", "arguments": SIMPLE}, {"name": "b", "arguments": ARGUMENTS, "id": "abc123xyz"}]
    text = "Checking both.\n[TOOL_CALLS]" + json.dumps(calls)
    assert MistralParser().parse(text) == ParsedReply("Checking both.", [call("a", SIMPLE), call("b", ARGUMENTS)])


def test_mistral_arguments_as_a_json_string() -> None:
    text = '[TOOL_CALLS] [{"name": "f", "arguments": "{\\"x\\": 1}"}]'
    assert MistralParser().parse(text) == ParsedReply(None, [call("f", {"x": 1})])


def test_mistral_name_and_args_form() -> None:
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]run[ARGS]' + json.dumps(ARGUMENTS)
    assert MistralParser().parse(text) == ParsedReply(None, [call("get_weather", SIMPLE), call("run", ARGUMENTS)])


@pytest.mark.parametrize(
    "text",
    [
        "No calls here.",
        "[TOOL_CALLS]",
        "[TOOL_CALLS][]",
        '[TOOL_CALLS][{"name": "f", "arguments": {}}',
        '[TOOL_CALLS][{"name": "f", "arguments": {}}] trailing words',
        '[TOOL_CALLS]{"name": "f", "arguments": {}}',
        '[TOOL_CALLS]bad name[ARGS]{"x": 1}',
        '[TOOL_CALLS]f[ARGS]{"x": ',
        "[TOOL_CALLS]f",
    ],
)
def test_mistral_reply_without_well_formed_calls_is_all_content(text: str) -> None:
    assert MistralParser().parse(text) == ParsedReply(text, [])


MISTRAL_REPLIES = [
    "Plain [TOOL answer",
    "Sure.\n\n[TOOL_CALLS]" + json.dumps([{"name": "a", "arguments": ARGUMENTS}, {"name": "b", "arguments": {}}]),
    '[TOOL_CALLS]a[ARGS]{"x": "[ARGS]"} [TOOL_CALLS]b[ARGS]{}',
    'Sure. [TOOL_CALLS][{"name": "f", "arguments": {',
]


@pytest.mark.parametrize("text", MISTRAL_REPLIES)
def test_mistral_stream_matches_parse_however_the_reply_is_cut(text: str) -> None:
    assert_stream_matches_parse(MistralParser(), text)


# ---------------------------------------------------------------------------------------------------------------
# json_array (tool_choice "required")


def required_reply(*calls: tuple[str, object]) -> str:
    return json.dumps([{"name": name, "parameters": parameters} for name, parameters in calls], ensure_ascii=False)


def test_json_array_calls() -> None:
    text = required_reply(("a", SIMPLE), ("b", ARGUMENTS))
    assert JsonArrayParser().parse(text) == ParsedReply(None, [call("a", SIMPLE), call("b", ARGUMENTS)])


def test_json_array_arguments_key_and_missing_parameters() -> None:
    text = '[{"name": "a", "arguments": {"x": 1}}, {"name": "b"}]'
    assert JsonArrayParser().parse(text) == ParsedReply(None, [call("a", {"x": 1}), call("b", {})])


@pytest.mark.parametrize(
    "text",
    [
        "I would rather answer in words.",
        "[]",
        "{}",
        '[{"name": "a", "parameters": {}}',
        '[{"parameters": {}}]',
        '[{"name": "a", "parameters": {}}, 3]',
        "[" * 100_000,
    ],
)
def test_json_array_reply_without_well_formed_calls_is_all_content(text: str) -> None:
    assert JsonArrayParser().parse(text) == ParsedReply(text, [])


JSON_ARRAY_REPLIES = [
    required_reply(("get_weather", SIMPLE)),
    required_reply(("a", ARGUMENTS), ("b", {}), ("c", {"list": [[], [{}], "]}"]})),
    "\n " + required_reply(("a", SIMPLE)),
    '[{"parameters": {"x": [1, 2]}, "name": "late_name"}]',  # arguments before the name wait for it
    '[{"name": "a", "parameters": {"x": 1}, "arguments": {"ignored": true}}]',
    '[{"name": "a"}]',
    '[{"id": {"n": "x"}, "name": "a", "parameters": 5}]',
    "Not a call at all",
    "  ",
    "[]",
]


@pytest.mark.parametrize("text", JSON_ARRAY_REPLIES)
def test_json_array_stream_matches_parse_however_the_reply_is_cut(text: str) -> None:
    assert_stream_matches_parse(JsonArrayParser(), text)


def test_json_array_stream_sends_the_name_then_the_arguments_as_they_arrive() -> None:
    text = '[{"name": "write_file", "parameters": {"path": "a.txt", "text": "long text"}}]'
    stream = JsonArrayParser().stream()
    name_end = text.index('"write_file"') + len('"write_file"')
    assert stream.feed(text[: name_end - 1]) == []
    assert stream.feed(text[name_end - 1 : name_end]) == [ToolCallStart(0, "write_file")]
    argument_fragments = []
    for char in text[name_end:-2]:  # up to the end of the parameters, before the object and array close
        for event in stream.feed(char):
            assert isinstance(event, ToolArgumentsDelta)
            argument_fragments.append(event.text)
    assert "".join(argument_fragments) == '{"path": "a.txt", "text": "long text"}'
    assert stream.feed("}]") == [] and stream.finish() == []


def test_json_array_stream_decodes_strings_as_they_come() -> None:
    stream = JsonArrayParser().stream()
    stream.feed('[{"name": "f", "parameters": {"text": "hello wo')
    assert stream.feed("rld, caf\\u00") == [ToolArgumentsDelta(0, "rld, caf")]  # the cut escape waits
    assert stream.feed("e9") == [ToolArgumentsDelta(0, "é")]


def random_json(rng: random.Random, depth: int = 0) -> object:
    kinds = ["string", "int", "float", "literal"] + (["object", "array"] * 2 if depth < 4 else [])
    kind = rng.choice(kinds)
    if kind == "object":
        return {random_string(rng): random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    if kind == "array":
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind == "string":
        return random_string(rng)
    if kind == "int":
        return rng.randint(-(10**20), 10**20)
    if kind == "float":
        return rng.choice([0.1, -2.5e-8, 1e300, 3.0, rng.uniform(-1e6, 1e6)])
    return rng.choice([True, False, None])


def random_string(rng: random.Random) -> str:
    alphabet = 'ab {}[]:,"\\/\n\t\x01é東🙂'
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))


def test_json_array_stream_rewrites_any_spacing_and_escapes_as_json_dumps_does() -> None:
    rng = random.Random(20240611)
    styles = [
        dict(ensure_ascii=False),
        dict(ensure_ascii=True),  # \ud83d\ude42 surrogate pairs, cut anywhere
        dict(separators=(",", ":")),
        dict(indent=2),
    ]
    for _ in range(150):
        parameters = {"value": random_json(rng)}
        written = json.dumps([{"name": "f", "parameters": parameters}], **rng.choice(styles))
        streamed, _ = replay(JsonArrayParser().stream(), random_pieces(written, rng, longest=5))
        assert streamed.tool_calls == [ParsedToolCall("f", json.dumps(parameters, ensure_ascii=False))], written


def test_json_array_number_forms_come_out_as_json_dumps_writes_them() -> None:
    text = '[{"name": "f", "parameters": {"a": 1E3, "b": -0.50, "c": 10000000000000000000000, "d": 1e-7}}]'
    parsed = assert_stream_matches_parse(JsonArrayParser(), text)
    assert parsed.tool_calls[0].arguments == '{"a": 1000.0, "b": -0.5, "c": 10000000000000000000000, "d": 1e-07}'


# ---------------------------------------------------------------------------------------------------------------
# Every parser, on text that is mostly wrong


FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "<|python_tag|>",
    "[TOOL_CALLS]",
    "[ARGS]",
    '{"name": "f", ',
    '"arguments": ',
    '"parameters": ',
    "{",
    "}",
    "[",
    "]",
    '"',
    "\\",
    ";",
    ",",
    ":",
    " ",
    "\n",
    "1",
    "x",
    "é",
    "\\u00",
]


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_garbage_never_raises_and_whole_calls_carry_valid_json(name: str) -> None:
    rng = random.Random(7)
    parser = PARSERS[name]()
    for _ in range(400):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 30)))
        parsed = parser.parse(text)
        assert parsed.tool_calls or parsed.content == text
        for parsed_call in parsed.tool_calls:
            json.loads(parsed_call.arguments)
        streamed, _ = replay(parser.stream(), random_pieces(text, rng))
        if name != "json_array":  # the others send a call only once its JSON is complete
            for streamed_call in streamed.tool_calls:
                json.loads(streamed_call.arguments)


# ---------------------------------------------------------------------------------------------------------------
# Only declared functions are called

DECLARED = ("get_weather",)


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("hermes", hermes_block("delete_all", SIMPLE)),
        ("hermes", "Sure.\n" + hermes_block("delete_all", SIMPLE) + "\n" + hermes_block("get_weather", SIMPLE)),
        ("llama3_json", '<|python_tag|>{"name": "delete_all", "parameters": {"city": "Paris"}}'),
        ("llama3_json", '{"name": "get_weather", "parameters": {}}; {"name": "delete_all", "parameters": {}}'),
        ("mistral", 'Sure. [TOOL_CALLS][{"name": "delete_all", "arguments": {"city": "Paris"}}]'),
        ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]delete_all[ARGS]{}'),
    ],
)
def test_calls_to_undeclared_functions_stay_content(name: str, text: str) -> None:
    assert assert_stream_matches_parse(PARSERS[name](DECLARED), text) == ParsedReply(text, [])
    assert PARSERS[name]().parse(text).tool_calls  # without declared names, any name is called


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("hermes", "Sure.\n" + hermes_block("get_weather", SIMPLE)),
        ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'),
        ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
    ],
)
def test_calls_to_declared_functions_are_read(name: str, text: str) -> None:
    assert assert_stream_matches_parse(PARSERS[name](DECLARED), text).tool_calls == [call("get_weather", SIMPLE)]


def test_an_undeclared_hermes_call_after_a_streamed_one_streams_as_content() -> None:
    """The first call was sent before the second showed it was not declared; the second is content."""
    second = hermes_block("delete_all", SIMPLE)
    streamed, _ = replay(HermesParser(DECLARED).stream(), [hermes_block("get_weather", SIMPLE), "\n", second])
    assert streamed == ParsedReply(second, [call("get_weather", SIMPLE)])
