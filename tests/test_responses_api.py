"""POST /v1/responses end to end: a real uvicorn server, the embedded model, the openai SDK and httpx."""

from __future__ import annotations

import json
import time
import typing

import httpx
import openai
import pytest
from openai.types.responses import response_create_params

from pagedserve.engine import EngineConfig
from pagedserve.engine.client.async_engine import AsyncEngine
from pagedserve.engine.client.async_stream import EngineUnavailableError
from pagedserve.engine.text.tokenizer import apply_chat_template
from pagedserve.engine.worker.model_loader import LoadedModel
from pagedserve.server import ServerSettings
from pagedserve.server.responses.protocol import RESPONSES, RESPONSES_ACCEPTED, ResponsesRequest
from tests.servers import engine_and_url
from tests.test_server_errors import assert_error

MODEL = "smol"
ALIAS = "smol-alias"
HELLO = "Say hello."
CONVERSATION = [
    {"role": "user", "content": "My name is Ada."},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello Ada!"}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is my name?"}]},
]
INSTRUCTIONS = "Answer in one short sentence."
STREAM_ORDER_HEAD = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
STREAM_ORDER_TAIL = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
# One running sequence and one waiting place: a full queue is cheap to reach.
CONFIG = EngineConfig(num_kv_blocks=128, max_num_seqs=1, max_queue_len=1)


engine, url = engine_and_url(CONFIG, ServerSettings([MODEL, ALIAS]))


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def respond(url: str, **body: object) -> httpx.Response:
    payload = {"model": MODEL, "input": HELLO, "max_output_tokens": 2, **body}
    return httpx.post(f"{url}/v1/responses", json=payload, timeout=60)


def prompt_tokens(loaded: LoadedModel, messages: list[dict[str, str]]) -> int:
    return len(loaded.tokenizer.encode(apply_chat_template(loaded.tokenizer, messages)))


def chat_answer(client: openai.OpenAI, messages: list[dict[str, str]], max_tokens: int) -> tuple[str, int]:
    """What chat completions answers greedily: the text and its token count."""
    completion = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
    assert completion.usage is not None
    return completion.choices[0].message.content or "", completion.usage.completion_tokens


# ---- every field has a status --------------------------------------------------------------------------


def test_every_openai_field_has_a_status() -> None:
    known = set(typing.get_type_hints(response_create_params.ResponseCreateParamsBase)) | {"stream"}
    honoured = set(ResponsesRequest.model_fields) - set(RESPONSES)
    unplaced = known - honoured - set(RESPONSES) - set(RESPONSES_ACCEPTED)
    assert not unplaced, f"fields with no status: {sorted(unplaced)}"
    assert not honoured & set(RESPONSES_ACCEPTED), "a field cannot be both honoured and accepted as a no-op"


# ---- answers -------------------------------------------------------------------------------------------


def test_create_with_string_input(client: openai.OpenAI, smol_loaded: LoadedModel) -> None:
    messages = [{"role": "user", "content": HELLO}]
    # The prompt's blocks cached for both answers compared: a prompt computed whole and one computed after a cached
    # prefix round differently (~1e-4 in a logprob), which can part greedy answers at a near-tie.
    chat_answer(client, messages, 1)
    raw = client.responses.with_raw_response.create(model=ALIAS, input=HELLO, max_output_tokens=24, temperature=0)
    response = raw.parse()
    assert raw.headers["x-request-id"]
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert isinstance(response.created_at, (int, float)) and response.error is None
    [message] = response.output
    assert message.type == "message" and message.id.startswith("msg_") and message.role == "assistant"
    [part] = message.content
    assert part.type == "output_text" and part.annotations == [] and part.text
    assert response.output_text == part.text
    text, output_tokens = chat_answer(client, messages, 24)
    assert part.text == text
    usage = response.usage
    assert usage is not None
    assert usage.input_tokens == prompt_tokens(smol_loaded, messages)
    assert usage.output_tokens == output_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0 and usage.input_tokens_details.cached_tokens >= 0
    expected = ("completed", None) if output_tokens < 24 else ("incomplete", "max_output_tokens")
    reason = response.incomplete_details.reason if response.incomplete_details else None
    assert (response.status, reason) == expected
    assert message.status == ("completed" if expected[0] == "completed" else "incomplete")


def test_message_list_with_instructions(client: openai.OpenAI, smol_loaded: LoadedModel) -> None:
    response = client.responses.create(
        model=MODEL, input=CONVERSATION, instructions=INSTRUCTIONS, max_output_tokens=12, temperature=0
    )
    messages = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Hello Ada!"},
        {"role": "user", "content": "What is my name?"},
    ]
    assert response.usage is not None
    assert response.usage.input_tokens == prompt_tokens(smol_loaded, messages)
    assert (response.output_text, response.usage.output_tokens) == chat_answer(client, messages, 12)
    assert response.instructions == INSTRUCTIONS and response.max_output_tokens == 12


def test_developer_and_system_roles_are_the_system_message(client: openai.OpenAI, smol_loaded: LoadedModel) -> None:
    for role in ("system", "developer"):
        items = [{"role": role, "content": INSTRUCTIONS}, {"role": "user", "content": HELLO}]
        usage = client.responses.create(model=MODEL, input=items, max_output_tokens=1).usage
        assert usage is not None
        system = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": HELLO}]
        assert usage.input_tokens == prompt_tokens(smol_loaded, system)


def test_max_output_tokens_makes_it_incomplete(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input=HELLO, max_output_tokens=3, extra_body={"ignore_eos": True})
    assert response.status == "incomplete" and response.completed_at is not None
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"
    assert response.usage is not None and response.usage.output_tokens == 3


def test_logprobs_with_include_and_top_logprobs(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL,
        input=HELLO,
        max_output_tokens=4,
        temperature=0,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    )
    part = response.output[0].content[0]
    assert part.type == "output_text" and part.logprobs is not None and response.usage is not None
    assert len(part.logprobs) == response.usage.output_tokens
    assert "".join(item.token for item in part.logprobs) == part.text
    for item in part.logprobs:
        assert len(item.top_logprobs) == 2 and item.logprob == pytest.approx(item.top_logprobs[0].logprob)
    plain = client.responses.create(model=MODEL, input=HELLO, max_output_tokens=2)
    assert plain.output[0].content[0].logprobs == []


def test_settings_are_echoed(url: str) -> None:
    body = respond(url, metadata={"k": "v"}, user="u1", tool_choice="none", parallel_tool_calls=False, top_p=0.5).json()
    assert body["metadata"] == {"k": "v"} and body["user"] == "u1" and body["tool_choice"] == "none"
    assert body["parallel_tool_calls"] is False and body["top_p"] == 0.5 and body["temperature"] == 1.0
    assert body["store"] is False and body["tools"] == [] and body["truncation"] == "disabled"
    assert body["text"] == {"format": {"type": "text"}} and body["previous_response_id"] is None


# ---- streaming -----------------------------------------------------------------------------------------


def check_stream_order(types: list[str], final: str) -> None:
    deltas = types[len(STREAM_ORDER_HEAD) : -len(STREAM_ORDER_TAIL) - 1]
    assert types[: len(STREAM_ORDER_HEAD)] == STREAM_ORDER_HEAD
    assert deltas and set(deltas) == {"response.output_text.delta"}
    assert types[-len(STREAM_ORDER_TAIL) - 1 :] == [*STREAM_ORDER_TAIL, final]


def test_streamed_create(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(
            model=MODEL, input=HELLO, max_output_tokens=5, stream=True, extra_body={"ignore_eos": True}
        )
    )
    check_stream_order([event.type for event in events], "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    created, final = events[0], events[-1]
    assert created.type == "response.created" and created.response.status == "in_progress"
    assert final.type == "response.incomplete" and created.response.id == final.response.id
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    done = events[-4]
    assert done.type == "response.output_text.done" and done.text == deltas == final.response.output_text
    assert final.response.usage is not None and final.response.usage.output_tokens == 5
    assert final.response.incomplete_details is not None


def test_sse_event_names_match_their_types(url: str) -> None:
    payload = {"model": MODEL, "input": HELLO, "max_output_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{url}/v1/responses", json=payload, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line.startswith(("event: ", "data: "))]
    names, data = lines[0::2], [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert [name.removeprefix("event: ") for name in names] == [event["type"] for event in data]
    assert "[DONE]" not in lines


def test_stream_helper(client: openai.OpenAI) -> None:
    with client.responses.stream(
        model=MODEL, input=CONVERSATION, instructions=INSTRUCTIONS, max_output_tokens=64, temperature=0
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    check_stream_order([event.type for event in events], "response.completed")
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert "".join(event.delta for event in deltas) == final.output_text
    assert deltas[-1].snapshot == final.output_text
    assert final.status == "completed" and final.incomplete_details is None
    assert final.usage is not None and final.usage.output_tokens < 64


def test_streamed_logprobs(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(
            model=MODEL, input=HELLO, max_output_tokens=3, top_logprobs=1, stream=True, extra_body={"ignore_eos": True}
        )
    )
    streamed = [item for event in events if event.type == "response.output_text.delta" for item in event.logprobs]
    assert len(streamed) == 3 and all(len(item.top_logprobs or []) == 1 for item in streamed)


# ---- refused fields and errors -------------------------------------------------------------------------

IMAGE_PART = {"type": "input_image", "image_url": "https://example.com/a.png"}


@pytest.mark.parametrize("field", sorted(RESPONSES))
def test_refused_fields_get_400(url: str, field: str) -> None:
    assert_error(respond(url, **{field: "anything"}), 400, "unsupported_parameter", field)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"conversation": "conv_123"}, "conversation"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"truncation": "auto"}, "truncation"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"prompt_cache_options": {"prewarm": True}}, "prompt_cache_options.prewarm"),
        ({"input": [{"type": "computer_call_output", "call_id": "c", "output": {}}]}, "input"),
        ({"input": [{"type": "item_reference", "id": "msg_123"}]}, "input"),
    ],
)
def test_refused_values_name_their_field(url: str, body: dict, param: str) -> None:
    message = assert_error(respond(url, **body), 400, "unsupported_parameter", param)
    if param in ("previous_response_id", "conversation", "store"):
        assert "stateless" in message and "input" in message


def test_neutral_values_and_accepted_fields_pass(url: str) -> None:
    neutral = {
        "store": False,
        "background": False,
        "truncation": "disabled",
        "tools": [],
        "tool_choice": "auto",
        "reasoning": None,
        "text": {"format": {"type": "text"}, "verbosity": "medium"},
        "include": ["reasoning.encrypted_content"],
        "metadata": {"k": "v"},
        "parallel_tool_calls": True,
    }
    accepted = {name: "x" for name in RESPONSES_ACCEPTED} | {"max_tool_calls": 2, "image": {}}
    response = respond(url, **neutral, **accepted)
    assert response.status_code == 200, response.text
    assert response.json()["output"][0]["content"][0]["logprobs"] == []  # include names nothing produced here


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"input": []}, "empty_array", "input"),
        ({"input": 3}, "invalid_type", "input"),
        ({"input": [{"role": "user", "content": [IMAGE_PART]}]}, "invalid_value", "input.0.message.content"),
        ({"input": [{"role": "tool", "content": "x"}]}, "invalid_value", "input.0.message.role"),
        ({"max_output_tokens": 0}, "invalid_value", "max_output_tokens"),
        ({"top_logprobs": 21}, "invalid_value", "top_logprobs"),
        ({"temperature": 3}, "invalid_value", "temperature"),
        ({"metadata": {"k": 1}}, "invalid_type", "metadata.k"),
    ],
)
def test_bad_requests_are_400(url: str, body: dict, code: str, param: str) -> None:
    assert_error(respond(url, **body), 400, code, param)


def test_context_limits_name_this_api_s_fields(url: str, engine: AsyncEngine) -> None:
    context = engine.limits.max_model_len
    message = assert_error(respond(url, max_output_tokens=context + 1), 400, "invalid_value", "max_output_tokens")
    assert message.startswith("max_output_tokens") and str(context) in message
    assert_error(respond(url, input="word " * (context + 8)), 400, "context_length_exceeded", "input")
    missing = httpx.post(f"{url}/v1/responses", json={"model": "nope", "input": HELLO}, timeout=60)
    assert_error(missing, 404, "model_not_found", "model")


def test_full_queue_is_503_and_a_failure_ends_streams(url: str, engine: AsyncEngine) -> None:
    long_run = {"model": MODEL, "input": HELLO, "max_output_tokens": 500, "ignore_eos": True, "stream": True}
    endpoint = f"{url}/v1/responses"
    with httpx.stream("POST", endpoint, json=long_run, timeout=60) as running:
        lines = (json.loads(line[6:]) for line in running.iter_lines() if line.startswith("data: "))
        ran = []
        while not ran or ran[-1]["type"] != "response.output_text.delta":
            ran.append(next(lines))  # until it runs: the waiting queue is then empty
        with httpx.stream("POST", endpoint, json=long_run, timeout=60) as waiting:
            assert waiting.status_code == 200  # queued: the stream is open
            refused = respond(url)
            assert_error(refused, 503, "queue_full")
            assert refused.headers["retry-after"] == "1"
            engine.fail_all(EngineUnavailableError("the engine went away"))
            waited = [json.loads(line[6:]) for line in waiting.iter_lines() if line.startswith("data: ")]
        ran += lines
    for events in (ran, waited):
        error, failed = events[-2:]
        assert (error["type"], error["code"]) == ("error", "engine_unavailable")
        assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
        assert failed["response"]["error"]["code"] == "engine_unavailable"
    partial = "".join(event["delta"] for event in ran if event["type"] == "response.output_text.delta")
    [message] = ran[-1]["response"]["output"]  # what was generated before the failure
    assert message["status"] == "incomplete" and message["content"][0]["text"] == partial
    assert respond(url).status_code == 200  # the engine itself is fine


def wait_until_idle(engine: AsyncEngine, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while engine.snapshot().num_unfinished:
        assert time.monotonic() < deadline, f"still busy: {engine.snapshot()}"
        time.sleep(0.05)


def test_a_client_that_leaves_aborts_its_request(url: str, engine: AsyncEngine) -> None:
    endless = {"model": MODEL, "input": HELLO, "max_output_tokens": 2000, "ignore_eos": True}  # minutes on a CPU
    with httpx.stream("POST", f"{url}/v1/responses", json={**endless, "stream": True}, timeout=60) as streamed:
        next(line for line in streamed.iter_lines() if "output_text.delta" in line)
    wait_until_idle(engine, 5)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/responses", json=endless, timeout=httpx.Timeout(60, read=1))
    wait_until_idle(engine, 5)
