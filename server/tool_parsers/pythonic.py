"""pythonic: calls written as a Python list, `[get_weather(city="Paris"), get_time()]` (Llama 3.2 and 4,
Gemma 3 with a tool prompt). The whole reply is the list; keyword arguments with literal values only."""

from __future__ import annotations

import ast

from pagedserve.server.tool_parsers import base

PYTHONIC_EXAMPLE = "[func_name1(params_name1=params_value1"  # how such templates show the format
_LITERALS = {"true": True, "false": False, "null": None}  # JSON spellings models slip into Python


class PythonicParser(base.ToolParser):
    """The whole reply is `[name(key=value, ...), ...]`; a reply that starts any other way is content."""

    name = "pythonic"

    def parse(self, text: str) -> base.ParsedReply:
        body = text.strip()
        if not body.startswith("["):
            return base.plain_reply(text)
        return base.reply_of("", _pythonic_calls(body, self.declared), text)

    def stream(self) -> base.ToolCallStream:
        return _PythonicStream(self.declared)


def _pythonic_calls(body: str, declared: base.Declared) -> list[base.ParsedToolCall] | None:
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree, ast.List):
        return None
    return base.all_calls([_call(node, declared) for node in tree.elts])


def _call(node: ast.expr, declared: base.Declared) -> base.ParsedToolCall | None:
    if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, ast.Name | ast.Attribute):
        return None
    name = ast.unparse(node.func)  # a dotted name stays whole: "tools.search"
    if declared is not None and name not in declared:
        return None
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **spread
            return None
        value = _literal(keyword.value)
        if value is _NOT_LITERAL:
            return None
        arguments[keyword.arg] = value
    return base.ParsedToolCall(name, base.arguments_json(arguments))


_NOT_LITERAL = object()


def _literal(node: ast.expr) -> object:
    """A Python literal's value (tuples as lists), true/false/null as JSON's; _NOT_LITERAL for anything else."""
    if isinstance(node, ast.Name) and node.id in _LITERALS:
        return _LITERALS[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        items = [_literal(item) for item in node.elts]
        return _NOT_LITERAL if _NOT_LITERAL in items else items
    if isinstance(node, ast.Dict):
        if any(key is None for key in node.keys):
            return _NOT_LITERAL
        keys = [_literal(key) for key in node.keys if key is not None]
        values = [_literal(value) for value in node.values]
        if _NOT_LITERAL in keys or _NOT_LITERAL in values or not all(isinstance(k, str | int | float) for k in keys):
            return _NOT_LITERAL
        return dict(zip(keys, values, strict=True))
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return _NOT_LITERAL
    return value if isinstance(value, str | int | float | bool | None) else _NOT_LITERAL  # no sets, bytes


class _PythonicStream(base.BufferedStream):
    """Content streams as it comes once the reply's start rules out calls; a list of calls is parsed at the end
    of the reply (the model stops right after it)."""

    def __init__(self, declared: base.Declared) -> None:
        super().__init__(base.Mode.OPENING, declared)

    def _step(self, final: bool) -> bool:
        if self._mode is base.Mode.OPENING:
            head = self._buffer.lstrip()
            if head.startswith("["):
                self._mode = base.Mode.CALLS
            elif head or final:
                self._mode = base.Mode.PLAIN
            else:
                return False
            return True
        if self._mode is base.Mode.PLAIN:
            return self._send_all_as_content()
        if final:
            self._send_reply(PythonicParser(self._declared).parse(self._buffer))
            self._buffer = ""
        return False
