"""The offline API: `LLM(model=...).generate(prompts, params)` and `.chat(conversations, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.outputs import CompletionOutput, RequestOutput
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.tokenizer import Message

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, **config: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **config))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Runs all prompts together under continuous batching; outputs come back in prompt order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = list(prompts)  # type: ignore[arg-type]
        params_list = _broadcast(sampling_params, len(prompt_list))
        results: dict[str, RequestOutput] = {}
        for prompt, params in zip(prompt_list, params_list):
            request_id = str(next(self._ids))
            self.engine.add_request(request_id, prompt, params)
            results[request_id] = RequestOutput(
                request_id=request_id,
                prompt=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=self.engine.encode_prompt(prompt),
                outputs=[CompletionOutput(index=i) for i in range(params.n)],
            )
        self._run(results, use_tqdm and len(prompt_list) > 1)
        return list(results.values())

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Applies the chat template to one conversation or a list of them, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.engine.encode_chat(conv) for conv in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, results: dict[str, RequestOutput], show_progress: bool) -> None:
        pending = len(results)
        bar = tqdm(total=pending, desc="generating", unit="req", disable=not show_progress)
        try:
            while pending:
                for delta in self.engine.step():
                    output = results.get(delta.request_id)
                    if output is None:
                        continue
                    output.outputs[delta.index].extend(delta)
                    if delta.finished:
                        output.num_cached_tokens = max(output.num_cached_tokens, delta.num_cached_tokens)
                        if output.finished:
                            pending -= 1
                            bar.update(1)
        finally:
            bar.close()
            for request_id in results:
                self.engine.abort_request(request_id)  # interrupted: leave no blocks behind


def _broadcast(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling params for {count} prompts")
    return list(params)
