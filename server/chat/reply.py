"""A chat answer's objects, whole or streamed: reasoning split off, tool calls read back, content the rest."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pagedserve.engine import CompletionOutput, SequenceDelta, TokenLogprob
from pagedserve.server.chat.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
)
from pagedserve.server.context import ServingContext
from pagedserve.server.logprobs import chat_logprobs, vllm_prompt_logprobs
from pagedserve.server.protocol import ChatLogprobs, ToolCall, Usage
from pagedserve.server.reasoning import ReasoningStream, split_reasoning
from pagedserve.server.tools import ReplyStream, ToolPlan, read_reply, tool_call_object


def finish_reason_with_calls(finish_reason: str, has_calls: bool) -> str:
    """OpenAI's "tool_calls" for a reply that ended by itself with calls; "length" stays "length"."""
    return "tool_calls" if has_calls and finish_reason == "stop" else finish_reason


class ChatReply:
    """Builds the answer's objects; also the ChunkFormatter for streaming."""

    def __init__(
        self, ctx: ServingContext, body: ChatCompletionRequest, tools: ToolPlan, thinks: bool, prompt: list[int]
    ) -> None:
        self._ctx = ctx
        self._n = body.n
        self._prompt = prompt
        self._token_ids = body.return_token_ids
        self._echo = body.echoed
        self._prompt_logprobs = body.prompt_logprobs is not None
        self._tools = tools
        self._thinks = thinks  # the reply starts inside a think block the prompt opened
        self._splits_reasoning = ctx.splits_reasoning or thinks
        self._envelope = ctx.envelope("chatcmpl")
        self._streams: dict[int, ChoiceStream] = {}

    def completion(self, outputs: list[CompletionOutput], usage: Usage) -> ChatCompletion:
        choices = []
        for output in outputs:
            message = self.message(output.text, output.finish_reason)
            finish_reason = output.finish_reason
            if finish_reason is not None:
                finish_reason = finish_reason_with_calls(finish_reason, bool(message.tool_calls))
            logprobs = self._logprobs(output.logprobs)
            ids = self._ids(token_ids=output.token_ids)
            choices.append(
                ChatChoice(index=output.index, message=message, logprobs=logprobs, finish_reason=finish_reason, **ids)
            )
        prompt = outputs[0].prompt_logprobs if self._prompt_logprobs and outputs else None
        scored = None if prompt is None else vllm_prompt_logprobs(prompt, self._ctx.token_text)
        ids = self._ids(prompt_token_ids=self._prompt)
        return ChatCompletion(**self._envelope, choices=choices, usage=usage, prompt_logprobs=scored, **ids)

    def _ids(self, **token_ids: list[int]) -> dict[str, Any]:
        """Token ids as the answer's extra fields, with return_token_ids."""
        return token_ids if self._token_ids else {}

    def message(self, text: str, finish_reason: str | None) -> AssistantMessage:
        reasoning = None
        if self._splits_reasoning:
            reasoning, text = split_reasoning(text, self._thinks)
        reply = read_reply(self._tools, text, finish_reason)
        calls = [ToolCall.model_validate(tool_call_object(call)) for call in reply.tool_calls]
        content = self._echo + reply.content if reply.content is not None else (self._echo or None)
        return AssistantMessage(
            content=content, tool_calls=calls or None, reasoning_content=reasoning, reasoning=reasoning
        )

    # ---- ChunkFormatter ----------------------------------------------------------------------------

    def opening(self) -> Iterable[ChatCompletionChunk]:
        role = {"role": "assistant", "content": ""}
        chunks = [self._chunk(ChatChunkChoice(index=i, delta=role)) for i in range(self._n)]
        if self._token_ids:  # vLLM's streams: in the first chunk only
            chunks[0] = ChatCompletionChunk(**chunks[0].model_dump(), **self._ids(prompt_token_ids=self._prompt))
        if self._echo:
            chunks += [self._chunk(ChatChunkChoice(index=i, delta={"content": self._echo})) for i in range(self._n)]
        return chunks

    def on_delta(self, choice: int, delta: SequenceDelta) -> list[ChatCompletionChunk]:
        deltas = self._stream(choice).feed(delta.new_text)
        logprobs = self._logprobs(delta.new_logprobs)
        if (logprobs is not None or (self._token_ids and delta.new_token_ids)) and not deltas:
            deltas = [{"content": ""}]  # the text is held back (a possible tool call), its logprobs are not
        ids = self._ids(token_ids=delta.new_token_ids)
        chunks = [self._chunk(ChatChunkChoice(index=choice, delta=d, **ids)) for d in deltas[:1]]
        chunks += [self._chunk(ChatChunkChoice(index=choice, delta=d, **self._ids(token_ids=[]))) for d in deltas[1:]]
        if chunks:
            chunks[0].choices[0].logprobs = logprobs
        return chunks

    def on_finish(self, choice: int, finish_reason: str) -> list[ChatCompletionChunk]:
        stream = self._stream(choice)
        chunks = [self._chunk(ChatChunkChoice(index=choice, delta=d)) for d in stream.finish(finish_reason)]
        reason = finish_reason_with_calls(finish_reason, stream.num_calls > 0)
        return [*chunks, self._chunk(ChatChunkChoice(index=choice, delta={}, finish_reason=reason))]

    def on_usage(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self._envelope, choices=[], usage=usage)

    def _stream(self, choice: int) -> ChoiceStream:
        if choice not in self._streams:
            reasoning = ReasoningStream(self._thinks) if self._splits_reasoning else None
            self._streams[choice] = ChoiceStream(ReplyStream(self._tools), reasoning)
        return self._streams[choice]

    def _chunk(self, choice: ChatChunkChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self._envelope, choices=[choice])

    def _logprobs(self, items: list[TokenLogprob] | None) -> ChatLogprobs | None:
        return None if items is None else chat_logprobs(items, self._ctx.token_text)


class ChoiceStream:
    """One streamed choice: its reasoning first (when the model thinks), then its reply's content and calls."""

    def __init__(self, reply: ReplyStream, reasoning: ReasoningStream | None) -> None:
        self._reply = reply
        self._reasoning = reasoning

    @property
    def num_calls(self) -> int:
        return self._reply.num_calls

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self._reasoning is None:
            return self._reply.feed(text)
        thought, answer = self._reasoning.feed(text)
        return self._with_reasoning(thought, self._reply.feed(answer) if answer else [])

    def finish(self, finish_reason: str) -> list[dict[str, Any]]:
        if self._reasoning is None:
            return self._reply.finish(finish_reason)
        thought, answer = self._reasoning.finish()
        answered = self._reply.feed(answer) if answer else []
        return self._with_reasoning(thought, [*answered, *self._reply.finish(finish_reason)])

    @staticmethod
    def _with_reasoning(thought: str, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{"reasoning_content": thought, "reasoning": thought}, *deltas] if thought else deltas
