"""Checks on the JSON schemas requests bring (response formats, tools' parameters) before anything walks them.

- Nesting depth: at most MAX_SCHEMA_DEPTH levels of objects and arrays. Copying, closing and compiling a schema
  walk it recursively (the grammar library stops near 120 levels), so deeper ones are refused up front; the
  limit leaves room for the levels tool_choice and reasoning wrap around a schema.
- `$ref` loops with no way out (`{"$ref": "#"}`, a -> b -> a, an object that requires itself): no finite value
  matches them, and the grammar library would compile them to an empty grammar, whose output is not JSON.
Both are checked iteratively: a schema deep enough to matter must not exhaust Python's stack here either.
"""

from __future__ import annotations

import itertools
import re
import urllib.parse
from typing import Any

MAX_SCHEMA_DEPTH = 64  # levels of JSON objects and arrays, the schema's own outermost one included

_JSON_STRING = re.compile(r'"(?:[^"\\]+|\\.)*"')
_BRACKETS = re.compile(r"[\[\]{}]")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def check_schema(schema: object) -> None:
    """ValueError when the schema nests too deep or loops through $refs that no finite value gets through."""
    if nesting_depth(schema) > MAX_SCHEMA_DEPTH:
        raise ValueError(_too_deep())
    loop = endless_ref(schema)
    if loop is not None:
        message = f"the schema's $ref {loop!r} loops back with no way out: no finite value matches the schema"
        raise ValueError(message)


def check_schema_text(text: str) -> None:
    """ValueError when a schema given as JSON text nests too deep (before anything parses it)."""
    if text_nesting_depth(text) > MAX_SCHEMA_DEPTH:
        raise ValueError(_too_deep())


def _too_deep() -> str:
    return f"schemas may nest at most {MAX_SCHEMA_DEPTH} levels of objects and arrays (the nesting depth limit)"


def nesting_depth(value: object) -> int:
    """Levels of dicts and lists; counting stops past the limit."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth > MAX_SCHEMA_DEPTH:
            break
        stack += [(child, depth + 1) for child in children]
    return deepest


def text_nesting_depth(text: str) -> int:
    """Levels of objects and arrays in JSON text, its strings skipped."""
    steps = (_STEP[bracket] for bracket in _BRACKETS.findall(_JSON_STRING.sub("", text)))
    return max(itertools.accumulate(steps), default=0)


# ---- $ref loops ----------------------------------------------------------------------------------------


def endless_ref(root: object) -> str | None:
    """A $ref the root cannot do without whose loop no finite value gets through; None when there is none.

    Only what a finite value cannot avoid counts: every `allOf` part, the `$ref`, one branch of each `anyOf` and
    `oneOf`, the required properties of an object-only schema, the first `minItems` items of an array-only one.
    Whatever else makes a schema unsatisfiable is left to the grammar library.
    """
    if not isinstance(root, dict):
        return None
    graph = _NeedsGraph(root)
    finite = graph.finite()
    if finite[0]:
        return None
    return next((ref for ref, target in graph.refs if not finite[target]), None)


class _NeedsGraph:
    """Schemas as nodes that need all of their needs, `anyOf`/`oneOf` groups as nodes that need one branch; a
    node is finite once what it waits on is (propagated from the nodes that need nothing, in linear time)."""

    def __init__(self, root: dict[str, Any]) -> None:
        self._root = root
        self._ids: dict[int, int] = {}  # id() of a schema dict -> its node
        self._todo: list[dict[str, Any]] = []
        self.waiting: list[int] = []  # per node: how many more of its children must be finite
        self.parents: list[list[int]] = []  # per node: the nodes waiting on it
        self.refs: list[tuple[str, int]] = []  # each local $ref, and the node it points at
        self._node(root)
        while self._todo:
            self._expand(self._todo.pop())

    def finite(self) -> list[bool]:
        finite = [False] * len(self.waiting)
        waiting = list(self.waiting)
        ready = [node for node, count in enumerate(waiting) if count == 0]
        while ready:
            node = ready.pop()
            finite[node] = True
            for parent in self.parents[node]:
                waiting[parent] -= 1
                if waiting[parent] == 0:
                    ready.append(parent)
        return finite

    def _new(self, waiting: int) -> int:
        self.waiting.append(waiting)
        self.parents.append([])
        return len(self.waiting) - 1

    def _node(self, schema: dict[str, Any]) -> int:
        if id(schema) not in self._ids:
            self._ids[id(schema)] = self._new(0)
            self._todo.append(schema)
        return self._ids[id(schema)]

    def _expand(self, schema: dict[str, Any]) -> None:
        node = self._ids[id(schema)]
        every, groups = _needs(schema)
        ref = schema.get("$ref")
        target = resolve_ref(self._root, ref) if isinstance(ref, str) else None
        if isinstance(target, dict):
            self.refs.append((str(ref), self._node(target)))
            every.append(target)
        for child in every:
            if isinstance(child, dict):  # true, false and odd values need nothing here
                self.parents[self._node(child)].append(node)
                self.waiting[node] += 1
        for group in groups:
            branches = [branch for branch in group if isinstance(branch, dict)]
            if len(branches) < len(group):
                continue  # a boolean branch: taken as a way out
            choice = self._new(1)
            for branch in branches:
                self.parents[self._node(branch)].append(choice)
            self.parents[choice].append(node)
            self.waiting[node] += 1


def _needs(schema: dict[str, Any]) -> tuple[list[object], list[list[object]]]:
    """What a finite value of `schema` cannot do without, $ref aside: all of the first list, and one branch of
    each group in the second."""
    every = list(_as_list(schema.get("allOf")))
    only = _only_type(schema)
    properties = schema.get("properties")
    if only == "object" and isinstance(properties, dict):
        required = [name for name in _as_list(schema.get("required")) if isinstance(name, str)]
        every += [properties[name] for name in required if name in properties]
    elif only == "array":
        every += _required_items(schema)
    groups = [_as_list(schema.get(key)) for key in ("anyOf", "oneOf")]
    return every, [group for group in groups if group]


def _required_items(schema: dict[str, Any]) -> list[object]:
    """The item schemas the first `minItems` items must match (2020-12's prefixItems, or draft 7's item list)."""
    least = schema.get("minItems")
    if not isinstance(least, int) or isinstance(least, bool) or least <= 0:
        return []
    prefix, rest = schema.get("prefixItems"), schema.get("items")
    if not isinstance(prefix, list) and isinstance(rest, list):
        prefix, rest = rest, schema.get("additionalItems")
    prefix = prefix if isinstance(prefix, list) else []
    return prefix[:least] + ([rest] if len(prefix) < least and rest is not None else [])


def _only_type(schema: dict[str, Any]) -> str | None:
    kind = schema.get("type")
    if isinstance(kind, list) and len(kind) == 1:
        kind = kind[0]
    return kind if isinstance(kind, str) else None


def _as_list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


def resolve_ref(root: object, ref: str) -> object:
    """What a local $ref ('#', '#/$defs/a', a JSON pointer) points at in `root`; None for other refs (anchors,
    other documents) and for places that do not exist."""
    if not ref.startswith("#"):
        return None
    pointer = urllib.parse.unquote(ref[1:])
    if not pointer:
        return root
    if not pointer.startswith("/"):
        return None
    node = root
    for token in pointer[1:].split("/"):
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isascii() and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return None
    return node
