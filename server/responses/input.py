"""/v1/responses' input items: messages, the function calls of earlier turns and their outputs, and the chat
messages they become."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from pagedserve.server.protocol import RequestBody


class InputText(RequestBody):
    """A message's text part: `input_text`, or `output_text` in an earlier assistant turn sent back."""

    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(RequestBody):
    """One message item; `type` may be left out. Other item fields (`id`, `status`) are ignored."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: list[InputText]

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        if isinstance(content, str):
            return [{"type": "input_text", "text": content}]
        if not isinstance(content, list):
            raise PydanticCustomError("invalid_type", "content must be a string or a list of text parts")
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind not in ("input_text", "output_text"):
                message = "only text content parts (input_text, output_text) are supported, got '{kind}'"
                raise PydanticCustomError("invalid_value", message, {"kind": str(kind)})
        return content

    def for_template(self) -> dict[str, Any]:
        """The {"role", "content"} dict chat templates expect; developer is OpenAI's new system."""
        text = "\n".join(part.text for part in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class FunctionCallItem(RequestBody):
    """A call the model made in an earlier turn, sent back with the conversation."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(RequestBody):
    """What the application's function returned for a call."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "\n".join(part.text for part in self.output)


InputItem = Annotated[InputMessage | FunctionCallItem | FunctionCallOutputItem, Field(discriminator="type")]


def check_outputs_answer_calls(items: list[InputItem]) -> None:
    """A function's output answers a call made earlier in the input, as OpenAI requires: a chat template would
    render an answer to nothing."""
    called: set[str] = set()
    for index, item in enumerate(items):
        if isinstance(item, FunctionCallItem):
            called.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem) and item.call_id not in called:
            message = "item {index} answers call_id '{call_id}', which no function_call item before it made"
            raise PydanticCustomError("invalid_value", message, {"index": index, "call_id": item.call_id})


def conversation_messages(
    items: list[InputMessage | FunctionCallItem | FunctionCallOutputItem],
) -> list[dict[str, Any]]:
    """Input items as chat messages: consecutive function calls are one assistant turn, outputs are tool turns."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, InputMessage):
            messages.append(item.for_template())
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
        else:
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            previous = messages[-1] if messages else None
            if previous is not None and previous["role"] == "assistant":  # the same turn's text, or calls
                previous.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    return messages
