"""llama.cpp's tools/server/tests/unit/test_completion.py and test_tokenize.py, for /completion, /tokenize and
/detokenize (their model-specific texts checked against our model's greedy output instead)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pagedserve.engine.worker.model_loader import LoadedModel
from tests.peers.conftest import MODEL, post

PROMPT = "I believe the meaning of life is"


def stream_events(url: str, **body: object) -> list[dict]:
    events = []
    with httpx.stream("POST", f"{url}/completion", json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            assert "[DONE]" not in line  # llama.cpp's /completion stream ends with its stop event
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
    return events


@pytest.mark.parametrize("return_tokens", [False, True])
def test_completion(url: str, smol_loaded: LoadedModel, return_tokens: bool) -> None:
    body = post(url, "/completion", prompt=PROMPT, n_predict=8, return_tokens=return_tokens).json()
    n_prompt = len(smol_loaded.tokenizer.encode(PROMPT))
    assert body["timings"]["prompt_n"] + body["timings"]["cache_n"] == body["tokens_evaluated"] == n_prompt
    assert body["timings"]["predicted_n"] == body["tokens_predicted"] == 8
    assert body["truncated"] is False and isinstance(body["has_new_line"], bool)
    assert body["stop"] is True and body["stop_type"] == "limit" and body["stopping_word"] == ""
    assert body["content"] and body["generation_settings"]["n_predict"] == 8
    if return_tokens:
        assert len(body["tokens"]) == 8 and smol_loaded.tokenizer.decode(body["tokens"]) == body["content"]
    else:
        assert body["tokens"] == []


def test_completion_stream_and_the_same_answer_whole(url: str) -> None:
    ask = {"prompt": PROMPT, "n_predict": 8, "seed": 42}
    events = stream_events(url, **ask)
    *partials, final = events
    assert all(e["stop"] is False and len(e["tokens"]) > 0 for e in partials)
    assert final["stop"] is True and final["stop_type"] == "limit" and final["timings"]["predicted_n"] == 8
    assert final["generation_settings"]["n_predict"] == 8 and final["generation_settings"]["seed"] == 42
    whole = post(url, "/completion", **ask).json()
    assert "".join(e["content"] for e in events) == whole["content"]


def test_completion_with_openai_library(client: openai.OpenAI) -> None:
    answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8)
    assert answer.system_fingerprint and answer.choices[0].finish_reason == "length" and answer.choices[0].text
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)


def test_same_seed_same_answer_different_seed_different_answer(url: str) -> None:
    same = {
        post(url, "/completion", prompt=PROMPT, n_predict=8, seed=42, temperature=1.0).json()["content"]
        for _ in range(3)
    }
    assert len(same) == 1
    different = {
        post(url, "/completion", prompt=PROMPT, n_predict=8, seed=s, temperature=1.0).json()["content"]
        for s in range(4)
    }
    assert len(different) > 1


def test_prompt_over_the_context_is_400(url: str) -> None:
    assert post(url, "/completion", prompt=PROMPT * 2000, n_predict=4).status_code == 400


def test_token_and_batch_prompts(url: str) -> None:
    tokens = post(url, "/tokenize", content=PROMPT, add_special=True).json()["tokens"]
    greedy = {"temperature": 0.0, "n_predict": 6}
    single = post(url, "/completion", prompt=tokens, **greedy).json()
    assert isinstance(single["content"], str)
    batch = post(url, "/completion", prompt=[tokens, tokens], **greedy).json()
    assert isinstance(batch, list) and len(batch) == 2 and batch[0]["content"] == batch[1]["content"]
    mixed = post(url, "/completion", prompt=[tokens, PROMPT], **greedy).json()
    assert [answer["index"] for answer in mixed] == [0, 1] and mixed[0]["content"] == mixed[1]["content"]
    json_prompt = post(url, "/completion", prompt={"prompt_string": PROMPT}, **greedy)
    assert json_prompt.status_code == 200 and json_prompt.json()["content"] == single["content"]
    media = post(url, "/completion", prompt={"prompt_string": PROMPT, "multimodal_data": ["AAAA"]})
    assert media.status_code == 400


def test_response_fields(url: str) -> None:
    fields = ["content", "generation_settings/n_predict", "prompt"]
    body = post(url, "/completion", prompt=PROMPT, n_predict=8, response_fields=fields).json()
    assert set(body) == set(fields) and body["generation_settings/n_predict"] == 8 and body["prompt"] == PROMPT


@pytest.mark.parametrize("stream", [False, True])
def test_n_probs(url: str, stream: bool) -> None:
    ask = {"prompt": PROMPT, "n_probs": 10, "temperature": 0.0, "n_predict": 5}
    if stream:
        probabilities = [p for e in stream_events(url, **ask) if not e["stop"] for p in e["completion_probabilities"]]
    else:
        probabilities = post(url, "/completion", **ask).json()["completion_probabilities"]
    assert len(probabilities) == 5
    for token in probabilities:
        assert token["id"] >= 0 and isinstance(token["token"], str) and token["logprob"] <= 0.0
        assert isinstance(token["bytes"], list) and len(token["top_logprobs"]) == 10
        assert token["top_logprobs"][0]["id"] == token["id"]  # greedy: the sampled token is the top one


@pytest.mark.parametrize("openai_style", [False, True])
def test_logit_bias(url: str, openai_style: bool) -> None:
    exclude = ["the", "The", "a", "is", "to", "and", "of", "I", "it", "be"]
    tokens = post(url, "/tokenize", content=" " + " ".join(exclude) + " ").json()["tokens"]
    bias: object = {str(t): -100 for t in tokens} if openai_style else [[t, False] for t in tokens]
    body = post(url, "/completion", prompt="What is the best book", n_predict=32, temperature=0.0, logit_bias=bias)
    assert body.status_code == 200
    assert not set(post(url, "/tokenize", content=body.json()["content"]).json()["tokens"]) & set(tokens)


def test_refused_options_say_why(url: str) -> None:
    for field, value in [("mirostat", 2), ("post_sampling_probs", True), ("n_keep", 5), ("repeat_penalty", 1.2)]:
        answer = post(url, "/completion", prompt=PROMPT, n_predict=2, **{field: value})
        assert answer.status_code == 400 and answer.json()["error"]["message"], field
    whole_context = post(url, "/completion", prompt=PROMPT, n_predict=2, repeat_penalty=1.2, repeat_last_n=-1)
    assert whole_context.status_code == 200


def test_tokenize_detokenize(url: str) -> None:
    content = "What is the capital of France ?"
    tokens = post(url, "/tokenize", content=content).json()["tokens"]
    assert len(tokens) > 5
    assert post(url, "/detokenize", tokens=tokens).json()["content"].strip() == content


def test_tokenize_with_pieces(url: str) -> None:
    pieces = post(url, "/tokenize", content="This is a test string with unicode 媽 and emoji 🤗", with_pieces=True)
    for token in pieces.json()["tokens"]:
        assert token["id"] >= 0 and len(token["piece"]) > 0
