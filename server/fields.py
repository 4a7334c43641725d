"""Request fields that other servers define and pagedserve refuses: never silently ignored.

OpenAI's own fields and the vLLM and llama.cpp extensions that would change the output are either honoured
(fields of the request models in server/protocol.py) or listed here and refused with 400
`unsupported_parameter`, unless the value asks for nothing (null, or the neutral value listed). Fields that
change nothing in the output (`user`, `metadata`, `prompt_cache_key`, ...) are accepted, in ACCEPTED. Truly
unknown fields are ignored, as OpenAI does. The README's field table mirrors these tables.
"""

from __future__ import annotations

from typing import Any

from pydantic_core import PydanticCustomError

# field -> (values that ask for nothing besides null, what to use instead or why)
Refusal = tuple[tuple[Any, ...], str]


SHARED: dict[str, Refusal] = {
    # OpenAI
    "store": ((False,), "stored completions are not supported"),
    "moderation": ((), "moderation is not supported"),
    # vLLM
    "use_beam_search": ((False,), "beam search is not supported"),
    "length_penalty": ((1, 1.0), "length_penalty applies to beam search, which is not supported"),
    "spaces_between_special_tokens": ((True,), "only the default (true) is supported"),
    "truncate_prompt_tokens": ((), "prompts are never truncated: a prompt over the context is refused"),
    "bad_words": ((), "use logit_bias"),
    "guided_whitespace_pattern": ((), "JSON is written compactly, as json.dumps writes it"),
    "structural_tag": ((), "structural tags are not supported; use tools or response_format"),
    "priority": ((0,), "requests are served in arrival order"),
    "logits_processors": ((), "custom logits processors are not supported"),
    "return_tokens_as_token_ids": ((False,), "not supported"),
    "cache_salt": ((), "not supported: the prefix cache is shared by all requests"),
    "kv_transfer_params": ((), "disaggregated prefill is not supported"),
    "vllm_xargs": ((), "not supported"),
    "prompt_embeds": ((), "prompt embeddings are not supported"),
    "mm_processor_kwargs": ((), "only text is supported"),
    # llama.cpp
    "n_predict": ((), "use max_tokens"),
    "n_probs": ((), "use logprobs"),
    "typical_p": ((1, 1.0), "typical sampling is not supported"),
    "tfs_z": ((1, 1.0), "tail-free sampling is not supported"),
    "mirostat": ((0,), "mirostat is not supported"),
    "dynatemp_range": ((0, 0.0), "dynamic temperature is not supported"),
    "xtc_probability": ((0, 0.0), "XTC sampling is not supported"),
    "dry_multiplier": ((0, 0.0), "DRY sampling is not supported"),
    "top_n_sigma": ((-1, -1.0), "top-n-sigma sampling is not supported"),
    "repeat_last_n": ((), "penalties apply to the whole sequence"),
}

CHAT: dict[str, Refusal] = {
    **SHARED,
    "audio": ((), "only text output is supported"),
    "modalities": ((["text"],), "only text output is supported"),
    "reasoning_effort": ((), "reasoning_effort is not supported by this model"),
    "verbosity": ((), "verbosity is not supported by this model"),
    "web_search_options": ((), "web search is not supported"),
    "best_of": ((1,), "use n"),
    "chat_template": ((), "a client's chat template is not accepted: the model's own (or --chat-template's) is used"),
    "documents": ((), "not supported"),
    "include_reasoning": ((), "not supported"),
}

COMPLETIONS: dict[str, Refusal] = {
    **SHARED,
}

# Defined by OpenAI (or vLLM) and accepted: none of them changes the output.
ACCEPTED = (
    "user",
    "safety_identifier",
    "metadata",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_cache_options",
    "prediction",  # a hint for speculative decoding: the output is the same without it
    "request_id",  # pagedserve takes the X-Request-Id header instead
    "cache_prompt",  # llama.cpp's; the prefix cache is always on
    "guided_decoding_backend",  # vLLM's choice of grammar library: one serves every constraint here
)


def refuse_unsupported(data: Any, table: dict[str, Refusal]) -> None:
    """Raises unsupported_parameter for the first field of `table` in `data` that asks for something."""
    if not isinstance(data, dict):
        return
    for name, value in data.items():
        refusal = table.get(name)
        if refusal is None or value is None:
            continue
        neutral, why = refusal
        if not any(value == allowed and type(value) is type(allowed) for allowed in neutral):
            message = "{param} is not supported ({why})"
            raise PydanticCustomError("unsupported_parameter", message, {"param": name, "why": why})
