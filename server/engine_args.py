"""Command-line flags for every EngineConfig field, generated from the dataclass so none is ever missing.

Flags default to "not given", so `--config X.yaml` fills the config and only the flags typed win over it.
"""

from __future__ import annotations

import argparse
import inspect
import re
import types
import typing
from dataclasses import MISSING, fields
from typing import Any

from pagedserve.engine.config import (
    ACTIVATION_DTYPES,
    DTYPES,
    MODEL_IMPLS,
    QUANTIZATIONS,
    SPECULATIVE_METHODS,
    EngineConfig,
)

CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": DTYPES,
    "attention_backend": ("auto", "triton", "cpu"),
    "load_format": ("auto", "dummy"),
    "quantization": QUANTIZATIONS,
    "activation_dtype": ACTIVATION_DTYPES,
    "model_impl": MODEL_IMPLS,
    "speculative_method": SPECULATIVE_METHODS,
}
_FIELD_COMMENT = re.compile(r"^\s+(\w+):[^#\n]*#\s*(.+)$", re.MULTILINE)


def add_engine_args(parser: argparse.ArgumentParser, exclude: frozenset[str] = frozenset()) -> None:
    group = parser.add_argument_group("engine", "EngineConfig fields; these override the --config file")
    group.add_argument("--config", metavar="YAML", help="an EngineConfig YAML file, e.g. configs/default.yaml")
    hints = typing.get_type_hints(EngineConfig)
    comments = _field_comments()
    for field in fields(EngineConfig):
        if field.name in exclude:
            continue
        default = None if field.default is MISSING else field.default
        help_text = f"{comments.get(field.name, '')} (default: {default})".strip()
        flag = "--" + field.name.replace("_", "-")
        kind = _scalar_type(hints[field.name])
        if kind is bool:
            flip = argparse.BooleanOptionalAction
            group.add_argument(flag, action=flip, default=argparse.SUPPRESS, help=help_text)
        else:
            choices = CHOICES.get(field.name)
            group.add_argument(flag, type=kind, choices=choices, default=argparse.SUPPRESS, help=help_text)


def engine_config(args: argparse.Namespace, **extra: Any) -> EngineConfig:
    """The YAML file (if any), then the flags that were given, then `extra` (None values are skipped)."""
    given = {name: getattr(args, name) for name in EngineConfig.field_names() if hasattr(args, name)}
    overrides = {k: v for k, v in {**given, **extra}.items() if v is not None}
    if args.config:
        return EngineConfig.from_yaml(args.config, **overrides)
    return EngineConfig(**overrides)


def _scalar_type(hint: Any) -> type:
    """`int | None` -> int."""
    if isinstance(hint, types.UnionType):
        return next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return hint


def _field_comments() -> dict[str, str]:
    """The trailing comment of each field in EngineConfig's source: the one place they are documented."""
    return dict(_FIELD_COMMENT.findall(inspect.getsource(EngineConfig)))
