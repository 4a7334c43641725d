"""One response as it is generated: its output items, and the Response objects and stream events built from
them (the order of the events: responses/handler.py)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pagedserve.engine import CompletionOutput, SamplingParams, SequenceDelta, TokenLogprob
from pagedserve.server.context import ServingContext
from pagedserve.server.errors import APIError
from pagedserve.server.logprobs import chat_logprobs
from pagedserve.server.protocol import ChatTokenLogprob, Usage
from pagedserve.server.responses.output import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    FunctionCallOut,
    IncompleteDetails,
    InputTokensDetails,
    ItemStatus,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    ResponseError,
    ResponseObject,
    ResponseUsage,
    Status,
    StreamEvent,
    TextConfigOut,
    TextDeltaEvent,
    TextDoneEvent,
)
from pagedserve.server.responses.protocol import ResponsesRequest
from pagedserve.server.tools import ReplyStream, ToolPlan, new_call_id, read_reply

_STATUS: dict[str, Status] = {"stop": "completed", "length": "incomplete", "abort": "cancelled"}
_ITEM_STATUS: dict[Status, ItemStatus] = {"in_progress": "in_progress", "completed": "completed"}


def response_usage(usage: Usage) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens),
        output_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
    )


@dataclass
class MessageItem:
    id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    text: str = ""
    logprobs: list[ChatTokenLogprob] = field(default_factory=list)

    def part(self) -> OutputText:
        return OutputText(text=self.text, logprobs=self.logprobs)

    def output(self, status: ItemStatus, content: list[OutputText] | None = None) -> OutputMessage:
        return OutputMessage(id=self.id, status=status, content=[self.part()] if content is None else content)


@dataclass
class CallItem:
    name: str
    call_id: str = field(default_factory=new_call_id)
    id: str = field(default_factory=lambda: f"fc_{uuid.uuid4().hex}")
    arguments: str = ""

    def output(self, status: ItemStatus) -> FunctionCallOut:
        return FunctionCallOut(
            id=self.id, call_id=self.call_id, name=self.name, arguments=self.arguments, status=status
        )


Item = MessageItem | CallItem
EventSpec = tuple[type[StreamEvent], str, dict[str, Any]]  # an event's model, type and fields


class ResponseReply:
    """One response as it is generated: its output items so far, and the objects and events built from them."""

    def __init__(self, ctx: ServingContext, body: ResponsesRequest, params: SamplingParams, tools: ToolPlan) -> None:
        self._ctx = ctx
        self._body = body
        self._params = params
        self._tools = tools
        self._stream = ReplyStream(tools)
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.items: list[Item] = []
        self._open: Item | None = None  # the item the stream is writing
        self._calls: dict[int, CallItem] = {}  # by the stream's call index
        self.finish_reason: str | None = None

    # ---- whole answers -----------------------------------------------------------------------------

    def complete(self, output: CompletionOutput, usage: Usage) -> ResponseObject:
        """The whole answer, from a collected output."""
        self.finish_reason = output.finish_reason
        reply = read_reply(self._tools, output.text, output.finish_reason)
        if reply.content is not None or not reply.tool_calls:
            self.items.append(MessageItem(text=reply.content or "", logprobs=self._logprobs(output.logprobs)))
        self.items += [CallItem(call.name, arguments=call.arguments) for call in reply.tool_calls]
        return self.finished(usage)

    def finished(self, usage: Usage) -> ResponseObject:
        status = _STATUS.get(self.finish_reason or "stop", "completed")
        return self.response(status, self.outputs(status), response_usage(usage))

    def failed(self, error: APIError) -> ResponseObject:
        """What was generated before the failure stays in the output."""
        failure = ResponseError(code=error.code, message=error.message)
        return self.response("failed", self.outputs("failed"), error=failure)

    def outputs(self, status: Status) -> list[OutputItem]:
        item_status = _ITEM_STATUS.get(status, "incomplete")
        return [item.output(item_status) for item in self.items]

    def response(
        self,
        status: Status,
        output: list[OutputItem] | None = None,
        usage: ResponseUsage | None = None,
        error: ResponseError | None = None,
    ) -> ResponseObject:
        body, params = self._body, self._params
        length_limited = status == "incomplete" and self.finish_reason == "length"
        text_format = body.text.format if body.text is not None and body.text.format is not None else None
        return ResponseObject(
            id=self.id,
            created_at=self.created_at,
            completed_at=int(time.time()) if status in ("completed", "incomplete") else None,
            status=status,
            error=error,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if length_limited else None,
            model=self._ctx.model_name,
            output=output or [],
            usage=usage,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_logprobs=body.top_logprobs,
            metadata=body.metadata or {},
            parallel_tool_calls=body.parallel_tool_calls,
            tool_choice=body.tool_choice if isinstance(body.tool_choice, str) else body.tool_choice.model_dump(),
            tools=[tool.model_dump(exclude_none=True) for tool in body.tools],
            text=TextConfigOut(
                format={"type": "text"} if text_format is None else text_format.model_dump(exclude_none=True)
            ),
            user=body.user,
        )

    # ---- streamed answers --------------------------------------------------------------------------

    def opening(self) -> list[EventSpec]:
        """A plain answer opens its message at once; one that may call tools, when its first text comes."""
        return [] if self._tools.calls_tools else self._open_message()

    def on_delta(self, delta: SequenceDelta) -> list[EventSpec]:
        self.finish_reason = delta.finish_reason or self.finish_reason
        logprobs = self._logprobs(delta.new_logprobs)
        chat_deltas = self._stream.feed(delta.new_text)
        if delta.finished:
            chat_deltas += self._stream.finish(delta.finish_reason)
        if logprobs and isinstance(self._open, MessageItem) and not any("content" in d for d in chat_deltas):
            chat_deltas.append({"content": ""})  # a token with no text yet still brings its logprobs
        specs: list[EventSpec] = []
        for chat_delta in chat_deltas:
            specs += self._apply(chat_delta, logprobs if "content" in chat_delta else [])
            if "content" in chat_delta:
                logprobs = []  # once, with the first text
        return specs

    def closing(self) -> list[EventSpec]:
        return self._close_open()

    def _apply(self, chat_delta: dict[str, Any], logprobs: list[ChatTokenLogprob]) -> list[EventSpec]:
        if "content" in chat_delta:
            specs = [] if isinstance(self._open, MessageItem) else [*self._close_open(), *self._open_message()]
            message = self._open
            assert isinstance(message, MessageItem)
            message.text += chat_delta["content"]
            message.logprobs += logprobs
            fields = {**self._where(message), "delta": chat_delta["content"], "logprobs": logprobs}
            return [*specs, (TextDeltaEvent, "response.output_text.delta", fields)]
        [call] = chat_delta["tool_calls"]
        function = call.get("function", {})
        if "id" in call:  # a new call: its name first
            specs = self._close_open()
            item = CallItem(function["name"], call_id=call["id"])
            self._calls[call["index"]] = item
            self._open = item
            self.items.append(item)
            added = {"output_index": len(self.items) - 1, "item": item.output("in_progress")}
            specs.append((OutputItemEvent, "response.output_item.added", added))
            return specs
        item = self._calls[call["index"]]
        item.arguments += function.get("arguments", "")
        fields = {"item_id": item.id, "output_index": self.items.index(item), "delta": function.get("arguments", "")}
        return [(ArgumentsDeltaEvent, "response.function_call_arguments.delta", fields)]

    def _open_message(self) -> list[EventSpec]:
        message = MessageItem()
        self.items.append(message)
        self._open = message
        added = {"output_index": len(self.items) - 1, "item": message.output("in_progress", [])}
        part = {**self._where(message), "part": OutputText(text="")}
        return [
            (OutputItemEvent, "response.output_item.added", added),
            (ContentPartEvent, "response.content_part.added", part),
        ]

    def _close_open(self) -> list[EventSpec]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.items.index(item)
        done = {"output_index": index, "item": item.output("completed")}
        if isinstance(item, CallItem):
            arguments = {"item_id": item.id, "output_index": index, "name": item.name, "arguments": item.arguments}
            return [
                (ArgumentsDoneEvent, "response.function_call_arguments.done", arguments),
                (OutputItemEvent, "response.output_item.done", done),
            ]
        where = self._where(item)
        return [
            (TextDoneEvent, "response.output_text.done", {**where, "text": item.text, "logprobs": item.logprobs}),
            (ContentPartEvent, "response.content_part.done", {**where, "part": item.part()}),
            (OutputItemEvent, "response.output_item.done", done),
        ]

    def _where(self, message: MessageItem) -> dict[str, Any]:
        return {"item_id": message.id, "output_index": self.items.index(message), "content_index": 0}

    def _logprobs(self, items: list[TokenLogprob] | None) -> list[ChatTokenLogprob]:
        return [] if items is None else chat_logprobs(items, self._ctx.token_text).content
