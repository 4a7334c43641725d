"""The offline API: `LLM(model=...).generate(prompts, params)`, `.chat(conversations, params)` and `.stream`.

It drives the same engine core as the server (engine/core/loop.py), by default in a process of its own, so its
throughput does not depend on what the program imported first; `engine_process=False` keeps the core on a
thread of this process.
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from pagedserve.engine.client.async_stream import EngineUnavailableError
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.messages import (
    AbortRequests,
    AddRequest,
    CollectStats,
    CoreFailed,
    EngineInfo,
    LogRecord,
    Ready,
    Reply,
    StepOutput,
)
from pagedserve.engine.core.process import CoreGone, connect_core
from pagedserve.engine.outputs import CompletionOutput, RequestOutput, SequenceDelta
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.structured.grammar import GrammarCompiler
from pagedserve.engine.text.text_tokenizer import TextTokenizer
from pagedserve.engine.text.tokenizer import Message, PromptTokenizer
from pagedserve.engine.validation import check_request

if TYPE_CHECKING:  # like the server's process, this one imports no torch unless the core runs on its thread
    from pagedserve.engine.core.llm_engine import EngineStats
    from pagedserve.engine.worker import LoadedModel

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, **config: Any) -> None:
        """`config`: EngineConfig's fields (engine/config.py)."""
        self._start(EngineConfig(model=model, **config))

    @classmethod
    def from_config(cls, config: EngineConfig, loaded: LoadedModel | None = None) -> LLM:
        """`loaded`: a model loaded in this process already, which keeps the core on a thread here."""
        llm = cls.__new__(cls)
        llm._start(config, loaded)
        return llm

    def _start(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self._core = connect_core(config, loaded)
        self._core.start()
        self._finalizer = weakref.finalize(self, self._core.stop)  # runs once: close(), collection or exit
        self._ids = itertools.count()
        self._closed = False
        ready = self._receive()
        if not isinstance(ready, Ready):
            raise EngineUnavailableError(f"unexpected first message from the engine core: {ready!r}")
        self.info: EngineInfo = ready.info
        self._prompts = PromptTokenizer.from_spec(ready.info.tokenizer, ready.info.trust_message_special_tokens)
        self._grammars = GrammarCompiler(self._prompts.tokenizer, ready.info.limits.vocab_size, frozenset())

    @property
    def tokenizer(self) -> TextTokenizer:
        """The model's tokenizer: encode, decode and apply_chat_template as transformers' tokenizers name them."""
        return self._prompts.tokenizer

    # ---- generation --------------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Runs all prompts together under continuous batching; outputs come back in prompt order.

        Every request is checked before any starts: bad input raises ValueError and nothing runs.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = list(prompts)  # type: ignore[arg-type]
        params_list = _broadcast(sampling_params, len(prompt_list))
        checked = [self._checked_output(str(next(self._ids)), p, sp) for p, sp in zip(prompt_list, params_list)]
        results = {output.request_id: output for output in checked}
        bar = tqdm(total=len(results), desc="generating", unit="req", disable=not (use_tqdm and len(results) > 1))
        try:
            for request_id, params in zip(results, params_list):
                self._add(request_id, results[request_id].prompt_token_ids, params)
            for delta in self._deltas({rid: len(output.outputs) for rid, output in results.items()}):
                output = results[delta.request_id]
                output.outputs[delta.index].extend(delta)
                if delta.finished:
                    output.num_cached_tokens = max(output.num_cached_tokens, delta.num_cached_tokens)
                    if output.finished:
                        bar.update(1)
        finally:
            bar.close()
        return list(results.values())

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Applies the chat template to one conversation or a list of them, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.encode_chat(conv) for conv in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm)

    def stream(self, prompt: Prompt, params: SamplingParams) -> Generator[SequenceDelta, None, None]:
        """One request's deltas as they come (its n sequences interleaved). Closing the iterator aborts it."""
        output = self._checked_output(str(next(self._ids)), prompt, params)
        self._add(output.request_id, output.prompt_token_ids, params)
        yield from self._deltas({output.request_id: params.n})

    def encode_chat(self, messages: list[Message]) -> list[int]:
        return self._prompts.encode_chat(messages)

    def stats(self, reset: bool = False) -> EngineStats:
        """The core's cumulative counters (steps, tokens, time in the model), optionally starting them anew."""
        self._core.send(CollectStats(reply_id=0, reset=reset))
        while not isinstance(reply := self._receive(), Reply):
            pass  # the last outputs of an earlier, abandoned generation
        return reply.value  # type: ignore[return-value]

    # ---- lifecycle ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Ends the engine core (a process of its own by default). Also when the LLM is collected, at exit,
        and at the end of `with LLM(...) as llm:`."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the core ----------------------------------------------------------------------------------

    def _checked_output(self, request_id: str, prompt: Prompt, params: SamplingParams) -> RequestOutput:
        """The request's empty output, once it has passed check_request (ValueError otherwise)."""
        token_ids = self._prompts.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_request(self.info.limits, token_ids, params)
        if params.structured_output is not None:
            self._grammars.check(params.structured_output)
        return RequestOutput(
            request_id=request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=token_ids,
            outputs=[CompletionOutput(index=i) for i in range(params.n)],
        )

    def _add(self, request_id: str, token_ids: list[int], params: SamplingParams) -> None:
        self._core.send(AddRequest(request_id, token_ids, params, time.monotonic()))

    def _deltas(self, sequences: dict[str, int]) -> Generator[SequenceDelta, None, None]:
        """Deltas of these requests (id -> n) until all finish; aborts what is left if the caller stops early."""
        left = dict(sequences)
        try:
            while left:
                out = self._receive()
                if not isinstance(out, StepOutput):
                    continue
                for request_id, why in out.rejected:
                    if request_id in left:
                        raise ValueError(why)
                for delta in out.deltas:
                    if delta.request_id not in left:
                        continue
                    if delta.finished:
                        left[delta.request_id] -= 1
                        if not left[delta.request_id]:
                            del left[delta.request_id]
                    yield delta
        finally:
            if left and not self._closed:
                self._core.send(AbortRequests(sorted(left)))

    def _receive(self) -> Ready | StepOutput | Reply:
        try:
            message = self._core.receive()
        except CoreGone as exc:
            self._closed = True
            raise EngineUnavailableError(str(exc)) from None
        if isinstance(message, CoreFailed):
            self._closed = True
            raise EngineUnavailableError(message.reason)
        assert not isinstance(message, LogRecord), "the transport handles log records"
        return message


def _broadcast(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling params for {count} prompts")
    return list(params)
