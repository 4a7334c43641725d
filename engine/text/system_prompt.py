"""A system message for chat templates that refuse one (Gemma 2's raises "System role not supported"): folded into
the first user turn as Gemma 3's template folds it itself, the system text and a blank line before the user's."""

from __future__ import annotations

from typing import Any

Message = dict[str, Any]


def system_folded_into_first_user(messages: list[Message]) -> list[Message] | None:
    """`messages` with a leading system message folded into the user message after it; None where they do not
    start with that pair."""
    if len(messages) < 2 or messages[0].get("role") != "system" or messages[1].get("role") != "user":
        return None
    prefix = _text(messages[0].get("content")) + "\n\n"
    user = dict(messages[1])
    content = user.get("content")
    if isinstance(content, list):  # content parts: the system text goes first, as a part of its own
        user["content"] = [{"type": "text", "text": prefix}, *content]
    else:
        user["content"] = prefix + (content or "")
    return [user, *messages[2:]]


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""
