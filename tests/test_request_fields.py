"""Every field OpenAI (and vLLM, llama.cpp) define for chat and completions is honoured, accepted as changing
nothing, or refused with 400 unsupported_parameter: never silently ignored."""

from __future__ import annotations

import typing
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from pagedserve.engine import EngineConfig
from pagedserve.engine.text.tokenizer import apply_chat_template
from pagedserve.engine.worker.model_loader import LoadedModel
from pagedserve.server import ServerSettings, fields
from pagedserve.server.chat.protocol import ChatCompletionRequest
from pagedserve.server.completions.protocol import CompletionRequest
from tests.servers import served_engine
from tests.test_server_errors import assert_error

MODEL = "smol"
HELLO = [{"role": "user", "content": "Hi"}]
# vLLM's extensions to the two request bodies (its entrypoints/openai protocol), as users send them.
VLLM_CHAT = [
    "best_of",
    "use_beam_search",
    "top_k",
    "min_p",
    "repetition_penalty",
    "length_penalty",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    "prompt_logprobs",
    "allowed_token_ids",
    "bad_words",
    "echo",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "documents",
    "chat_template",
    "chat_template_kwargs",
    "mm_processor_kwargs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structural_tag",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "structured_outputs",
    "priority",
    "request_id",
    "logits_processors",
    "return_tokens_as_token_ids",
    "return_token_ids",
    "cache_salt",
    "kv_transfer_params",
    "vllm_xargs",
]
VLLM_COMPLETIONS = [
    "use_beam_search",
    "top_k",
    "min_p",
    "repetition_penalty",
    "length_penalty",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    "allowed_token_ids",
    "prompt_logprobs",
    "add_special_tokens",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structural_tag",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "structured_outputs",
    "priority",
    "request_id",
    "logits_processors",
    "return_tokens_as_token_ids",
    "return_token_ids",
    "cache_salt",
    "kv_transfer_params",
    "vllm_xargs",
    "prompt_embeds",
]
LLAMA_CPP = ["json_schema", "grammar", "n_predict", "n_probs", "typical_p", "tfs_z", "mirostat", "cache_prompt"]


def openai_fields(params: type) -> set[str]:
    return set(typing.get_type_hints(params)) | {"stream"}


@pytest.mark.parametrize(
    ("model", "refused", "known"),
    [
        (ChatCompletionRequest, fields.CHAT, openai_fields(chat_create_params.CompletionCreateParamsBase)),
        (CompletionRequest, fields.COMPLETIONS, openai_fields(completion_create_params.CompletionCreateParamsBase)),
        (ChatCompletionRequest, fields.CHAT, set(VLLM_CHAT) | set(LLAMA_CPP)),
        (CompletionRequest, fields.COMPLETIONS, set(VLLM_COMPLETIONS) | set(LLAMA_CPP)),
    ],
    ids=["openai chat", "openai completions", "vllm and llama.cpp chat", "vllm and llama.cpp completions"],
)
def test_every_known_field_has_a_status(model: type, refused: dict, known: set[str]) -> None:
    honoured = set(model.model_fields)  # type: ignore[attr-defined]
    unplaced = known - honoured - set(refused) - set(fields.ACCEPTED)
    assert not unplaced, f"fields with no status: {sorted(unplaced)}"
    assert not honoured & set(refused), "a field cannot be both honoured and refused"


@pytest.fixture(scope="module")
def url(smol_loaded: LoadedModel) -> Iterator[str]:
    with served_engine(EngineConfig(num_kv_blocks=64), smol_loaded, ServerSettings([MODEL])) as url:
        yield url


def chat(url: str, **body: object) -> httpx.Response:
    payload = {"model": MODEL, "messages": HELLO, "max_tokens": 2, **body}
    return httpx.post(f"{url}/v1/chat/completions", json=payload, timeout=60)


def complete(url: str, **body: object) -> httpx.Response:
    payload = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **body}
    return httpx.post(f"{url}/v1/completions", json=payload, timeout=60)


@pytest.mark.parametrize(
    ("send", "field"),
    [(chat, field) for field in sorted(fields.CHAT)] + [(complete, field) for field in sorted(fields.COMPLETIONS)],
    ids=lambda value: getattr(value, "__name__", value),
)
def test_refused_fields_get_400(url: str, send: Callable[..., httpx.Response], field: str) -> None:
    assert_error(send(url, **{field: "anything"}), 400, "unsupported_parameter", field)


def test_neutral_values_and_accepted_fields_pass(url: str) -> None:
    neutral = {"store": False, "modalities": ["text"], "echo": False, "priority": 0, "use_beam_search": False}
    accepted = {name: "x" for name in fields.ACCEPTED if name != "metadata"} | {"metadata": {"k": "v"}}
    assert chat(url, **neutral, **accepted).status_code == 200
    assert complete(url, add_special_tokens=True, length_penalty=1.0, typical_p=1.0).status_code == 200


def test_add_generation_prompt_and_continue_final_message(url: str, smol_loaded: LoadedModel) -> None:
    tokenizer = smol_loaded.tokenizer
    opened = chat(url).json()["usage"]["prompt_tokens"]
    closed = chat(url, add_generation_prompt=False).json()["usage"]["prompt_tokens"]
    assert closed == len(tokenizer.encode(apply_chat_template(tokenizer, HELLO, add_generation_prompt=False)))
    assert closed < opened
    started = [*HELLO, {"role": "assistant", "content": "The capital of France is"}]
    reply = chat(url, messages=started, add_generation_prompt=False, continue_final_message=True).json()
    text = apply_chat_template(tokenizer, started, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("The capital of France is")
    assert reply["usage"]["prompt_tokens"] == len(tokenizer.encode(text))
    assert_error(
        chat(url, messages=started, continue_final_message=True), 400, "invalid_value", "continue_final_message"
    )
    assert_error(
        chat(url, add_generation_prompt=False, continue_final_message=True),
        400,
        "invalid_value",
        "continue_final_message",
    )


def test_skip_special_tokens_and_include_stop_str_in_output(url: str) -> None:
    forced = {"logit_bias": {"2": 100}, "ignore_eos": True, "max_tokens": 2, "temperature": 0}  # 2: <|im_end|>
    assert "<|im_end|>" not in complete(url, **forced).json()["choices"][0]["text"]
    assert complete(url, skip_special_tokens=False, **forced).json()["choices"][0]["text"] == "<|im_end|>" * 2
    free = complete(url, prompt="One, two, three, four,", max_tokens=8, temperature=0).json()["choices"][0]["text"]
    stop = free.strip().split()[1]
    kept = complete(
        url, prompt="One, two, three, four,", max_tokens=8, temperature=0, stop=[stop], include_stop_str_in_output=True
    )
    assert kept.json()["choices"][0]["text"].endswith(stop)


def test_models_retrieve(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model" and card.owned_by == "pagedserve"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("org/not-served")
    assert missing.value.body["code"] == "model_not_found"  # type: ignore[index]
