"""vLLM's tests/entrypoints/openai chat suite (test_chat.py, test_chat_echo.py, test_return_token_ids.py,
test_completion_with_function_calling.py, test_tokenization.py), through the openai SDK; usage and templates
checked against transformers instead of vLLM's model."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pagedserve.engine.worker.model_loader import LoadedModel
from tests.peers.conftest import MODEL, post

ASK = [{"role": "system", "content": "you are a helpful assistant"}, {"role": "user", "content": "what is 1+1?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "description": "Get the current weather in a given location",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city to find the weather for"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}


@pytest.mark.parametrize(("top_logprobs", "size"), [(None, None), (0, 0), (5, 5)])
def test_logprobs(client: openai.OpenAI, top_logprobs: int | None, size: int | None) -> None:
    logprobs = top_logprobs is not None
    choice = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_completion_tokens=5,
        temperature=0.0,
        logprobs=logprobs,
        top_logprobs=top_logprobs,  # type: ignore[arg-type]
    ).choices[0]
    if size is None:
        assert choice.logprobs is None
    else:
        assert choice.logprobs is not None and choice.logprobs.content
        assert len(choice.logprobs.content[0].top_logprobs) == size


def test_too_many_logprobs_and_the_server_carries_on(client: openai.OpenAI) -> None:
    for stream in (True, False):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=ASK, logprobs=True, top_logprobs=30, stream=stream)  # type: ignore[arg-type]
    assert client.chat.completions.create(model=MODEL, messages=ASK, max_completion_tokens=4).choices[0].message  # type: ignore[arg-type]


@pytest.mark.parametrize("prompt_logprobs", [1, 0, -1, None])
def test_prompt_logprobs(client: openai.OpenAI, prompt_logprobs: int | None) -> None:
    ask: dict = {"model": MODEL, "messages": ASK, "max_completion_tokens": 2}
    if prompt_logprobs is not None:
        ask["extra_body"] = {"prompt_logprobs": prompt_logprobs}
    if prompt_logprobs is not None and prompt_logprobs < 0:
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(**ask)
        return
    scored = getattr(client.chat.completions.create(**ask), "prompt_logprobs", None)
    assert (scored is None) == (prompt_logprobs is None) and (scored is None or len(scored) > 0)


def test_more_than_one_prompt_logprob(client: openai.OpenAI) -> None:
    ask: dict = {"model": MODEL, "messages": ASK, "max_completion_tokens": 2}
    one = client.chat.completions.create(**ask, extra_body={"prompt_logprobs": 1}).prompt_logprobs  # type: ignore[attr-defined]
    two = client.chat.completions.create(**ask, extra_body={"prompt_logprobs": 2}).prompt_logprobs  # type: ignore[attr-defined]
    assert 1 <= len(one[3]) <= 2 and 2 <= len(two[3]) <= 3  # the top k and the prompt's own token when not in it


def test_single_chat_session(client: openai.OpenAI, smol_loaded: LoadedModel) -> None:
    answer = client.chat.completions.create(
        model=MODEL, messages=ASK, max_completion_tokens=5, logprobs=True, top_logprobs=5
    )  # type: ignore[arg-type]
    n_prompt = len(smol_loaded.tokenizer.apply_chat_template(ASK, add_generation_prompt=True, return_dict=False))
    assert answer.usage is not None and answer.usage.prompt_tokens == n_prompt
    assert answer.usage.completion_tokens + n_prompt == answer.usage.total_tokens
    message = answer.choices[0].message
    assert message.role == "assistant" and message.content is not None
    follow_up = [*ASK, {"role": "assistant", "content": message.content}, {"role": "user", "content": "in json"}]
    assert client.chat.completions.create(model=MODEL, messages=follow_up, max_completion_tokens=5).choices  # type: ignore[arg-type]


def test_streaming_matches_the_whole_answer(client: openai.OpenAI) -> None:
    ask = {"model": MODEL, "messages": ASK, "max_completion_tokens": 10, "temperature": 0.0}
    whole = client.chat.completions.create(**ask).choices[0]  # type: ignore[call-overload]
    chunks = list(client.chat.completions.create(**ask, stream=True))  # type: ignore[call-overload]
    assert sum(chunk.choices[0].finish_reason is not None for chunk in chunks) == 1
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == whole.message.content


def test_stream_options(client: openai.OpenAI) -> None:
    ask = {"model": MODEL, "messages": ASK, "max_completion_tokens": 10, "temperature": 0.0}
    assert all(
        c.usage is None
        for c in client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": False})
    )  # type: ignore[call-overload]
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))  # type: ignore[call-overload]
    assert all(chunk.usage is None for chunk in chunks[:-1]) and chunks[-1].choices == []
    final = chunks[-1].usage
    assert final.completion_tokens > 0 and final.total_tokens == final.prompt_tokens + final.completion_tokens
    for options in ({"include_usage": None}, {"include_usage": True}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(**ask, stream=False, stream_options=options)  # type: ignore[call-overload]
    continuous = {"include_usage": True, "continuous_usage_stats": True}
    counts = [
        chunk.usage.completion_tokens
        for chunk in client.chat.completions.create(
            **ask, stream=True, stream_options=continuous, extra_body={"min_tokens": 10}
        )  # type: ignore[call-overload]
    ]
    assert counts == sorted(counts) and counts[-1] == 10


def test_structured_outputs(client: openai.OpenAI) -> None:
    choices = ["Python", "Java", "JavaScript", "C++", "C#", "PHP", "TypeScript", "Ruby", "Swift", "Kotlin"]
    ask = [{"role": "user", "content": "The best language for type-safe systems programming is "}]
    picked = client.chat.completions.create(
        model=MODEL,
        messages=ask,
        max_completion_tokens=10,
        extra_body={"structured_outputs": {"choice": choices}},  # type: ignore[arg-type]
    )
    assert picked.choices[0].message.content in choices
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}}, "required": ["name"]}
    shaped = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give a name as JSON"}],  # type: ignore[list-item]
        max_completion_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )
    assert "name" in json.loads(shaped.choices[0].message.content or "")


def test_chat_echo(client: openai.OpenAI) -> None:
    """test_chat_echo.py: with echo, a reply to a final assistant message starts with it; a user's is not echoed."""
    started = [*ASK, {"role": "assistant", "content": "The answer is"}]
    flags = {"echo": True, "add_generation_prompt": False, "continue_final_message": True}
    answer = client.chat.completions.create(model=MODEL, messages=started, max_completion_tokens=4, extra_body=flags)  # type: ignore[arg-type]
    assert (answer.choices[0].message.content or "").startswith("The answer is")
    plain = client.chat.completions.create(
        model=MODEL, messages=ASK, max_completion_tokens=4, extra_body={"echo": True}
    )  # type: ignore[arg-type]
    assert not (plain.choices[0].message.content or "").startswith("what is 1+1?")


def test_return_token_ids_in_chat(client: openai.OpenAI, smol_loaded: LoadedModel) -> None:
    emoji = [{"role": "system", "content": "You like emojis."}, {"role": "user", "content": "Repeat: I love cats 🐱"}]
    answer = client.chat.completions.create(
        model=MODEL, messages=emoji, max_completion_tokens=20, extra_body={"return_token_ids": True}
    )  # type: ignore[arg-type]
    prompt_text = smol_loaded.tokenizer.decode(answer.model_extra["prompt_token_ids"])  # type: ignore[index]
    assert "You like emojis." in prompt_text and "I love cats 🐱" in prompt_text
    assert smol_loaded.tokenizer.decode(answer.choices[0].model_extra["token_ids"])  # type: ignore[index]
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=emoji, max_completion_tokens=20, stream=True, extra_body={"return_token_ids": True}
        )
    )  # type: ignore[arg-type]
    assert smol_loaded.tokenizer.decode(chunks[0].model_extra["prompt_token_ids"]) == prompt_text  # type: ignore[index]
    assert all("prompt_token_ids" not in chunk.model_dump() for chunk in chunks[1:])


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice(client: openai.OpenAI, stream: bool) -> None:
    """test_completion_with_function_calling.py: a named tool is called with arguments matching its schema."""
    ask = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the weather like in Dallas, Texas?"}],
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_current_weather"}},
        "max_completion_tokens": 60,
        "temperature": 0,
    }
    if stream:
        arguments = ""
        for chunk in client.chat.completions.create(**ask, stream=True):  # type: ignore[call-overload]
            for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                assert call.function is not None
                arguments += call.function.arguments or ""
    else:
        calls = client.chat.completions.create(**ask).choices[0].message.tool_calls  # type: ignore[call-overload]
        assert calls and calls[0].function.name == "get_current_weather"  # type: ignore[union-attr]
        arguments = calls[0].function.arguments  # type: ignore[union-attr]
    assert set(json.loads(arguments)) == {"city", "unit"}


def test_tool_choice_required_and_none(client: openai.OpenAI) -> None:
    ask = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER],
        "max_completion_tokens": 60,
        "temperature": 0,
    }
    required = client.chat.completions.create(**ask, tool_choice="required").choices[0]  # type: ignore[call-overload]
    assert required.finish_reason == "tool_calls" and required.message.tool_calls
    none = client.chat.completions.create(**ask, tool_choice="none").choices[0]  # type: ignore[call-overload]
    assert none.message.tool_calls is None and none.message.content


def test_tokenize_detokenize_and_tokenizer_info(url: str, smol_loaded: LoadedModel) -> None:
    """test_tokenization.py (the flag combinations are in tests/test_tokenize_endpoints.py)."""
    prompt = "This is a test prompt. vllm1"
    tokens = smol_loaded.tokenizer.encode(prompt, add_special_tokens=False)
    assert post(url, "/detokenize", model=MODEL, tokens=tokens).json()["prompt"] == prompt
    info = httpx.get(f"{url}/tokenizer_info", timeout=60).json()
    assert isinstance(info["tokenizer_class"], str) and info["tokenizer_class"]
    for field, kind in {
        "eos_token": str,
        "chat_template": str,
        "model_max_length": int,
        "added_tokens_decoder": dict,
    }.items():
        assert info.get(field) is None or isinstance(info[field], kind), field
    tokenized = post(url, "/tokenize", model=MODEL, prompt="Hello world!").json()
    assert info["model_max_length"] >= tokenized["max_model_len"]
