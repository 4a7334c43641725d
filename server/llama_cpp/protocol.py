"""llama.cpp's /completion request, with llama.cpp's defaults (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05,
n_predict -1: to the end of the context), and /apply-template's.

Fields that map exactly are honoured; those that would change the output and have no exact counterpart are refused
with 400 unsupported_parameter, like the OpenAI endpoints' (server/fields.py): repeat_penalty over the last n tokens
(only over the whole context, repeat_last_n -1), mixed token-and-text prompt sequences, multimodal prompts, logit
biases given as text, post-sampling probabilities, sampler order, slots, LoRA.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, Field, field_validator
from pydantic_core import PydanticCustomError

from pagedserve.engine import SamplingParams
from pagedserve.server import fields
from pagedserve.server.chat.protocol import ChatPrompt, Messages
from pagedserve.server.protocol import SamplingRequest, TopLogprobs, unsupported
from pagedserve.server.tools import MAX_TOOLS, ToolDefinition

BAN = -100.0  # llama.cpp's `false` bias: never sampled (OpenAI's -100 bans a token)
LlamaPrompt = str | list[int] | list[str | list[int]]

LLAMA_CPP: dict[str, fields.Refusal] = {
    name: refusal
    for name, refusal in fields.SHARED.items()
    if name not in ("n_predict", "n_probs", "repeat_last_n")  # this endpoint's own names
} | {
    "post_sampling_probs": ((False,), "probabilities are the model's, before sampling"),
    "samplers": ((), "the samplers run in one fixed order: penalties, bias, temperature, top_k, top_p, min_p"),
    "id_slot": ((-1,), "requests are not pinned to slots"),
    "n_keep": ((0,), "prompts are never truncated"),
    "n_discard": ((0,), "prompts are never truncated"),
    "n_indent": ((0,), "not supported"),
    "n_cmpl": ((1,), "use /v1/completions' n"),
    "t_max_predict_ms": ((0,), "not supported; use the request's timeout"),
    "lora": ((), "LoRA adapters are not supported"),
    "min_keep": ((0,), "not supported"),
    "dynatemp_exponent": ((1, 1.0), "dynamic temperature is not supported"),
    "dry_base": ((), "DRY sampling is not supported"),
    "dry_allowed_length": ((), "DRY sampling is not supported"),
    "dry_penalty_last_n": ((), "DRY sampling is not supported"),
    "dry_sequence_breakers": ((), "DRY sampling is not supported"),
    "xtc_threshold": ((), "XTC sampling is not supported"),
    "mirostat_tau": ((), "mirostat is not supported"),
    "mirostat_eta": ((), "mirostat is not supported"),
    "return_progress": ((False,), "not supported"),
    "timings_per_token": ((False,), "timings come with the final answer"),
}


class LlamaCompletionRequest(SamplingRequest):
    REFUSED: ClassVar[dict[str, fields.Refusal]] = LLAMA_CPP

    model: str | None = None  # type: ignore[assignment]  # llama.cpp serves one model and needs no name
    prompt: LlamaPrompt
    n_predict: int = -1
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int = -1  # -1: a random seed
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    # {"id": bias} or [[id, bias]], a bias of false bans the token
    logit_bias: dict[str, float | bool] | list[list[int | str | float | bool]] | None = None  # type: ignore[assignment]
    n_probs: TopLogprobs = 0
    return_tokens: bool = False
    response_fields: list[str] | None = None
    cache_prompt: bool = True

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts_as_llama_cpp_takes_them(cls, prompt: Any) -> Any:
        if isinstance(prompt, dict) and set(prompt) == {"prompt_string"}:
            prompt = prompt["prompt_string"]  # the object form without multimodal data is its text
        if isinstance(prompt, list):
            prompt = [p["prompt_string"] if isinstance(p, dict) and set(p) == {"prompt_string"} else p for p in prompt]
        if isinstance(prompt, dict):
            raise unsupported("a JSON object prompt with multimodal data is not supported: only text is")
        if (
            isinstance(prompt, list)
            and any(isinstance(p, int) for p in prompt)
            and not all(isinstance(p, int) and not isinstance(p, bool) for p in prompt)
        ):
            raise unsupported("a sequence mixing token ids and text is not supported: send one or the other")
        if isinstance(prompt, list) and any(isinstance(p, dict) for p in prompt):
            raise unsupported("a JSON object prompt (multimodal data) is not supported: only text is")
        if prompt in ("", []) or (isinstance(prompt, list) and any(p in ("", []) for p in prompt)):
            raise PydanticCustomError("empty_array", "prompt must not be empty")
        return prompt

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string, a token id list, or a list of those (the answer is then a list)."""
        if isinstance(self.prompt, str) or all(isinstance(p, int) for p in self.prompt):
            return [self.prompt]  # type: ignore[list-item]
        return list(self.prompt)  # type: ignore[arg-type]

    @property
    def many(self) -> bool:
        """A list of prompts (not one prompt's token ids) gets a list of answers."""
        return isinstance(self.prompt, list) and not all(isinstance(p, int) for p in self.prompt)

    def sampling_params(self) -> SamplingParams:
        if self.n_predict == 0:
            raise ValueError("n_predict 0 (evaluating the prompt only) is not supported; use n_predict >= 1")
        if self.repeat_penalty != 1.0 and self.repeat_last_n != -1:
            raise ValueError(
                "repeat_penalty applies to the whole context here: send repeat_last_n -1 with it, or use "
                "presence_penalty and frequency_penalty"
            )
        as_ours = {
            "temperature": max(self.temperature, 0.0),  # llama.cpp samples greedily at or below 0
            "top_k": max(self.top_k, 0),  # <= 0: off
            "seed": None if self.seed < 0 else self.seed,
            "repetition_penalty": self.repeat_penalty,
            "logit_bias": self._biases(),
        }
        max_tokens = None if self.n_predict < 0 else self.n_predict
        return self.model_copy(update=as_ours).build_sampling_params(
            max_tokens, self.n_probs or None, None, self.output_constraint()
        )

    def generation_settings(self, params: SamplingParams | None = None) -> dict[str, Any]:
        """llama.cpp's `generation_settings`: the options that apply (`params`: as this request's built them)."""
        return {
            "n_predict": self.n_predict,
            "seed": self.seed,
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "repeat_last_n": self.repeat_last_n,
            "repeat_penalty": self.repeat_penalty,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "stop": params.stop if params is not None else [],
            "ignore_eos": bool(self.ignore_eos),
            "stream": self.stream,
            "n_probs": self.n_probs,
            "logit_bias": [[token, bias] for token, bias in (params.logit_bias if params is not None else {}).items()],
        }

    def _biases(self) -> dict[int, float]:
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, dict) else (self.logit_bias or [])
        biases: dict[int, float] = {}
        for pair in pairs:
            token, bias = (pair[0], pair[1]) if isinstance(pair, (list, tuple)) and len(pair) == 2 else (None, None)
            if isinstance(token, str) and token.isdigit():
                token = int(token)
            if not isinstance(token, int) or isinstance(token, bool) or not isinstance(bias, (int, float)):
                raise ValueError("logit_bias takes token ids with numbers or false (a ban); text is not supported")
            biases[token] = BAN if bias is False else float(bias)
        return biases


class ApplyTemplateRequest(ChatPrompt):
    messages: Messages
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None

    def template_tools(self) -> list[dict[str, Any]] | None:
        return None if not self.tools else [tool.for_template() for tool in self.tools]


class ApplyTemplateResponse(BaseModel):
    prompt: str
