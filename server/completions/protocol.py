"""/v1/completions' request body and answers (whole, and streamed)."""

from __future__ import annotations

from typing import Any, Literal, cast

from pydantic import BaseModel, field_validator
from pydantic_core import PydanticCustomError

from pagedserve.engine import SamplingParams
from pagedserve.server import fields
from pagedserve.server.chat.protocol import TOKEN_IDS_EXTRA
from pagedserve.server.protocol import (
    CompletionLogprobs,
    PromptLogprobsOut,
    SamplingRequest,
    TopLogprobs,
    Usage,
    unsupported,
)

Prompt = str | list[str] | list[int] | list[list[int]]

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint (chat runs to the context's end)


class CompletionRequest(SamplingRequest):
    REFUSED = fields.COMPLETIONS

    prompt: Prompt
    echo: bool = False
    logprobs: TopLogprobs | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's special tokens (a BOS) around a text prompt
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_of_four_forms(cls, prompt: Any) -> Any:
        """A clear message instead of pydantic's one error per member of the Prompt union."""
        if not _is_prompt(prompt):
            message = "prompt must be a string, a list of strings, token ids, or a list of token id lists"
            raise PydanticCustomError("invalid_type", message)
        if not prompt or any(isinstance(p, (str, list)) and not p for p in prompt):
            raise PydanticCustomError("empty_array", "prompt must not be empty")
        return prompt

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise unsupported("suffix (fill-in-the-middle) is not supported by this server")
        return suffix

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, best_of: int | None) -> int | None:
        if best_of not in (None, 1):
            raise unsupported("best_of is not supported; use n")
        return best_of

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt, whichever of the four OpenAI forms was sent."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [cast(str | list[int], self.prompt)]
        return cast(list[str | list[int]], self.prompt)

    @property
    def echoes_logprobs(self) -> bool:
        """echo with logprobs: the echoed prompt's tokens come with their logprobs, as OpenAI's scoring did."""
        return self.echo and self.logprobs is not None

    def sampling_params(self) -> SamplingParams:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        prompt_logprobs = self.prompt_logprobs
        if self.echoes_logprobs:
            prompt_logprobs = max(self.logprobs or 0, prompt_logprobs or 0)
        return self.build_sampling_params(max_tokens, self.logprobs, prompt_logprobs, self.output_constraint())


def _is_prompt(value: Any) -> bool:
    def token_ids(items: Any) -> bool:
        return isinstance(items, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in items)

    if isinstance(value, str) or token_ids(value):
        return True
    if not isinstance(value, list):
        return False
    return all(isinstance(p, str) for p in value) or all(map(token_ids, value))


# ---- answers -------------------------------------------------------------------------------------------


class CompletionChoice(BaseModel):
    model_config = TOKEN_IDS_EXTRA

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobsOut | None = None  # vLLM's extension, when asked for


class Completion(BaseModel):
    model_config = TOKEN_IDS_EXTRA

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # always set, except on streamed chunks without include_usage
