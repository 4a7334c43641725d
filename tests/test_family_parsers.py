"""The tool-call formats of Phi-4-mini (`functools[...]`) and of pythonic models (Llama 3.2/4, Gemma 3:
`[name(key=value)]`), and Qwen3's thinking switch: whole replies, streams cut anywhere, and a real uvicorn
server with the openai SDK."""

from __future__ import annotations

import json

import openai
import pytest

from benchmarks.hostile_inputs import WEATHER
from pagedserve.engine import EngineConfig
from pagedserve.server import ServerSettings
from pagedserve.server.cli import build_parser
from pagedserve.server.tool_parsers import Phi4MiniJsonParser, PythonicParser, parser_for_template
from pagedserve.server.tool_parsers.base import ParsedReply
from tests.servers import served_engine
from tests.test_tool_parsers import assert_stream_matches_parse, call

MODEL = "smol"
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]

# ---- phi4_mini_json ---------------------------------------------------------------------------------------


def test_phi4_mini_calls_after_content() -> None:
    text = 'Let me look.\nfunctools[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now"}]'
    assert Phi4MiniJsonParser().parse(text) == ParsedReply(
        "Let me look.", [call("get_weather", {"city": "Paris"}), call("now", {})]
    )


def test_phi4_mini_parameters_key_and_no_content() -> None:
    text = 'functools[{"name": "f", "parameters": {"x": [1, {"y": "é"}]}}]'
    assert Phi4MiniJsonParser().parse(text) == ParsedReply(None, [call("f", {"x": [1, {"y": "é"}]})])


@pytest.mark.parametrize(
    "text",
    [
        "No tools needed.",
        'functools{"name": "f"}',  # not a list
        'functools[{"name": "f", "arguments": {"a": 1}}',  # cut short
        'functools[{"arguments": {}}]',  # no name
    ],
)
def test_phi4_mini_reply_without_well_formed_calls_is_all_content(text: str) -> None:
    assert Phi4MiniJsonParser().parse(text) == ParsedReply(text, [])


def test_phi4_mini_undeclared_function_is_content() -> None:
    text = 'functools[{"name": "rm", "arguments": {}}]'
    assert Phi4MiniJsonParser(["get_weather"]).parse(text) == ParsedReply(text, [])


PHI4_REPLIES = [
    'Sure.  functools[{"name": "get_weather", "arguments": {"city": "東京"}}]',
    'functools[{"name": "a", "arguments": {"s": "]}"}}, {"name": "b", "arguments": {}}]',
    "plain answer with func and tools but no call",
    'text functools[{"bad": 1}]',
]


@pytest.mark.parametrize("text", PHI4_REPLIES)
def test_phi4_mini_stream_matches_parse_however_the_reply_is_cut(text: str) -> None:
    assert_stream_matches_parse(Phi4MiniJsonParser(), text)


# ---- pythonic ---------------------------------------------------------------------------------------------


def test_pythonic_calls_with_literal_arguments() -> None:
    text = '[get_weather(city="Paris", days=3), search(q=\'a "b"\', tags=["x", 1.5], opts={"deep": True}, n=None)]'
    assert PythonicParser().parse(text) == ParsedReply(
        None,
        [
            call("get_weather", {"city": "Paris", "days": 3}),
            call("search", {"q": 'a "b"', "tags": ["x", 1.5], "opts": {"deep": True}, "n": None}),
        ],
    )


def test_pythonic_json_literals_dotted_names_and_no_arguments() -> None:
    text = " [tools.lookup(flag=true, other=null, neg=-2), now()]\n"
    assert PythonicParser().parse(text) == ParsedReply(
        None, [call("tools.lookup", {"flag": True, "other": None, "neg": -2}), call("now", {})]
    )


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        "[1, 2, 3]",  # a list, not of calls
        "[get_weather('Paris')]",  # positional arguments have no names
        "[get_weather(city=lookup())]",  # not a literal
        "[get_weather(city={1, 2})]",  # a set has no JSON form
        "[get_weather(**kw)]",
        "[get_weather(city='Paris')",  # cut short
        "Calling [get_weather(city='Paris')]",  # the whole reply must be the list
    ],
)
def test_pythonic_reply_without_well_formed_calls_is_all_content(text: str) -> None:
    assert PythonicParser().parse(text) == ParsedReply(text, [])


def test_pythonic_undeclared_function_is_content() -> None:
    text = "[rm(path='/')]"
    assert PythonicParser(["get_weather"]).parse(text) == ParsedReply(text, [])


PYTHONIC_REPLIES = [
    "[get_weather(city='東京'), now()]",
    '  [f(s="]),(", d={"k": [1, 2]})]',
    "Just text, [not] a call.",
    "[broken(",
]


@pytest.mark.parametrize("text", PYTHONIC_REPLIES)
def test_pythonic_stream_matches_parse_however_the_reply_is_cut(text: str) -> None:
    assert_stream_matches_parse(PythonicParser(), text)


def test_templates_pick_their_parsers() -> None:
    assert parser_for_template("{{ '<|tool|>' + message['tools'] + '<|/tool|>' }}") == "phi4_mini_json"
    assert parser_for_template("Respond as [func_name1(params_name1=params_value1, ...)]") == "pythonic"


def test_cli_accepts_the_family_parsers() -> None:
    for flags in (["--tool-call-parser", "phi4_mini_json"], ["--tool-call-parser", "pythonic"]):
        build_parser().parse_args(["serve", *flags])
    args = build_parser().parse_args(["serve", "--reasoning-parser", "qwen3"])
    assert args.reasoning_parser == "qwen3"


# ---- through a server -------------------------------------------------------------------------------------

FORCED = {
    "phi4_mini_json": 'functools[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "pythonic": "[get_weather(city='Paris')]",
}


@pytest.mark.parametrize("parser", sorted(FORCED))
def test_server_returns_the_calls_the_model_writes(smol_loaded, parser: str) -> None:
    """guided_choice makes the embedded model write the call in the format; it comes back as a tool call, whole
    and streamed, through the openai SDK."""
    settings = ServerSettings([MODEL], tool_call_parser=parser)
    with served_engine(EngineConfig(num_kv_blocks=128), smol_loaded, settings) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        body = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], max_tokens=60, temperature=0)
        extra = {"guided_choice": [FORCED[parser]]}
        message = client.chat.completions.create(**body, extra_body=extra).choices[0].message
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []] == [
            ("get_weather", {"city": "Paris"})
        ]
        chunks = list(client.chat.completions.create(**body, extra_body=extra, stream=True))
        calls = [c for chunk in chunks if chunk.choices for c in chunk.choices[0].delta.tool_calls or []]
        assert [c.function.name for c in calls if c.function and c.function.name] == ["get_weather"]
        assert json.loads("".join(c.function.arguments or "" for c in calls)) == {"city": "Paris"}


# Qwen3's switch, as its template writes it: thinking opens a think block the reply continues; enable_thinking
# false writes an empty block into the prompt, so the reply is the answer.
QWEN3_STYLE_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}"
)


def test_qwen3_reasoning_parser_follows_enable_thinking(smol_dir, tmp_path) -> None:
    from pagedserve.engine.worker.model_loader import load_model

    folder = tmp_path / "qwen3-style"
    folder.mkdir()
    for item in smol_dir.iterdir():
        (folder / item.name).symlink_to(item)
    (folder / "chat_template.jinja").unlink()
    (folder / "chat_template.jinja").write_text(QWEN3_STYLE_TEMPLATE)
    config = EngineConfig(model=str(folder), num_kv_blocks=128)
    settings = ServerSettings([MODEL], reasoning_parser="qwen3")
    with served_engine(config, load_model(config), settings) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        body = dict(model=MODEL, messages=ASK_WEATHER, max_tokens=12, temperature=0)
        thinking = client.chat.completions.create(**body).choices[0].message
        assert thinking.model_extra["reasoning_content"] and not thinking.content  # still thinking at 12 tokens
        off = {"chat_template_kwargs": {"enable_thinking": False}}
        answer = client.chat.completions.create(**body, extra_body=off).choices[0].message
        assert answer.content and not answer.model_extra.get("reasoning_content")
