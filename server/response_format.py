"""Request fields that constrain the output, in the shapes OpenAI, vLLM and llama.cpp define them.

Each is turned into the engine's StructuredOutput here, so the protocol models only declare the fields:
- OpenAI: `response_format` {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema",
  "strict"}} (llama.cpp's {"type": "json_object", "schema": ...} too);
- vLLM: `structured_outputs` {"json" | "regex" | "choice" | "grammar" | "json_object"} and the older
  `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`;
- llama.cpp: top-level `json_schema` and `grammar` (GBNF).
A request names at most one constraint; malformed ones raise FieldError (400) naming the field. Whether the
grammar library compiles a constraint is checked by the engine at the door (400 with the library's reason,
named after the field by `naming_constraint_errors`).

JSON schemas (here and in tools' parameters) are checked first (server/schema_checks.py): their nesting depth,
and $ref loops no finite value gets through.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.engine import StructuredOutput
from pagedserve.server.errors import APIError, FieldError
from pagedserve.server.schema_checks import check_schema, check_schema_text

# `schema` and `json` are BaseModel attributes' names: the fields take them as aliases.
_ALIASED = ConfigDict(extra="ignore", populate_by_name=True)


class JsonSchemaFormat(BaseModel):
    model_config = _ALIASED

    name: str = "response"
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None  # constraints are always strict: the output matches the schema
    description: str | None = None


class ResponseFormat(BaseModel):
    model_config = _ALIASED

    type: str
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # llama.cpp's json_object with a schema

    def constraint(self) -> StructuredOutput | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return json_constraint(self.schema_)
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.schema_ is None:
                raise ValueError("response_format json_schema needs a 'json_schema' object with the schema")
            return schema_constraint(self.json_schema.schema_)
        raise ValueError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {self.type!r}")


class VllmStructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` object: one of its constraint fields."""

    model_config = _ALIASED

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def named(self) -> str | None:
        """The field that names the constraint."""
        given: list[tuple[str, object]] = [("json", self.json_), ("regex", self.regex), ("choice", self.choice)]
        given.append(("grammar", self.grammar))
        given.append(("json_object", self.json_object or None))
        return next((name for name, value in given if value is not None), None)

    def constraint(self) -> StructuredOutput | None:
        return constraints_given(
            {
                "json": (schema_constraint, self.json_),
                "regex": (StructuredOutput.regex, self.regex),
                "choice": (StructuredOutput.choice, self.choice),
                "grammar": (StructuredOutput.grammar, self.grammar),
                "json_object": (lambda _: StructuredOutput.json_object(), self.json_object or None),
            },
            "structured_outputs",
        )


# What turns a field's value into a constraint, and the value (None: the field names no constraint).
Named = tuple[Callable[[Any], StructuredOutput | None], Any]


def constraints_given(fields: dict[str, Named], where: str | None = None) -> StructuredOutput | None:
    """The one constraint the fields name (None if none). FieldError naming the field when one is malformed,
    or when several are named."""
    named = {}
    for field, (build, value) in fields.items():
        if value is None:
            continue
        try:
            constraint = build(value)
        except FieldError:
            raise
        except ValueError as exc:
            raise FieldError(str(exc), f"{where}.{field}" if where else field) from None
        if constraint is not None:
            named[field] = constraint
    if len(named) > 1:
        names = sorted(named)
        message = f"{where or 'the request'} may name one output constraint, got {', '.join(names)}"
        raise FieldError(message, where or names[-1])
    return next(iter(named.values()), None)


def json_constraint(schema: dict[str, Any] | bool | None) -> StructuredOutput:
    """A JSON schema's constraint; any JSON object without one (OpenAI's and llama.cpp's json_object)."""
    return StructuredOutput.json_object() if schema is None else schema_constraint(schema)


def schema_constraint(schema: dict[str, Any] | bool | str) -> StructuredOutput:
    """A JSON schema's constraint; `true` and `false` are schemas too. ValueError when it nests too deep or
    admits no finite value (server/schema_checks.py)."""
    if isinstance(schema, bool):
        return StructuredOutput.json_schema("true" if schema else "false")
    value: Any = schema
    if isinstance(schema, str):
        check_schema_text(schema)
        try:
            value = json.loads(schema)
        except ValueError:
            return StructuredOutput.json_schema(schema)  # its message says what is wrong
    check_schema(value)
    return StructuredOutput.json_schema(value)


# The fields that name output constraints, as SamplingRequest.output_constraint reads them.
CONSTRAINT_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "json_schema",
    "grammar",
)
# The engine's grammar compiler's messages: a constraint it cannot read, or one too complex to compile (it crashed
# or outran the compiler's limits).
_COMPILE_ERROR = re.compile(r"^(invalid \w+ constraint: |the \w+ constraint is too complex: )")


def constraint_field(body: BaseModel) -> str | None:
    """The field a request's output constraint comes from (constraints_given allows one)."""
    return next(filter(None, (_naming(name, getattr(body, name, None)) for name in CONSTRAINT_FIELDS)), None)


def _naming(name: str, value: object) -> str | None:
    """`name`, or its part that names the constraint, when its value names one."""
    if isinstance(value, VllmStructuredOutputs):
        part = value.named()
        return None if part is None else f"{name}.{part}"
    if value is None or (isinstance(value, ResponseFormat) and value.type == "text"):
        return None
    return name


@contextlib.contextmanager
def naming_constraint_errors(param: str | None) -> Iterator[None]:
    """The engine's compile errors name no field (it never saw the request's fields): they name `param`, the
    field the constraint came from."""
    try:
        yield
    except APIError as error:
        if param is not None and _COMPILE_ERROR.match(error.message):
            error.param = param
        raise
