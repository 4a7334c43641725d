"""Logging: the `--log-format json` formatter, text escaping, and the logging set-up (the request log's lines
are written by server/request_log.py).

In JSON, every line is one object: `time`, `level`, `logger`, then either `message` or the structured fields of
a request-log line or of uvicorn's access log. In text, each message has its control characters escaped (a
client's path or model name holding CR/LF or ESC can neither forge a log line nor drive a terminal); tracebacks
are left as they are.
"""

from __future__ import annotations

import copy
import json
import logging
from datetime import datetime, timezone
from typing import Any

from uvicorn.config import LOGGING_CONFIG
from uvicorn.logging import AccessFormatter, DefaultFormatter

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Unicode's control characters (C0, DEL, C1) and line/paragraph separators: everything that can end a line.
_ESCAPES = {code: f"\\x{code:02x}" for code in (*range(0x20), *range(0x7F, 0xA0))}
_ESCAPES.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t", 0x2028: "\\u2028", 0x2029: "\\u2029"})


def escape_controls(text: str) -> str:
    """`text` on one line, its control characters as backslash escapes (\\r, \\n, \\x1b, ...)."""
    return text.translate(_ESCAPES)


class JsonFormatter(logging.Formatter):
    _ACCESS_FIELDS = ("client", "method", "path", "http_version", "status")  # uvicorn's access-log arguments

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        elif record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == 5:
            entry.update(zip(self._ACCESS_FIELDS, record.args))
        else:
            entry["message"] = record.getMessage()
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def _escaped(record: logging.LogRecord) -> logging.LogRecord:
    """A copy of a formatted record whose message and string arguments are escaped (uvicorn's access formatter
    builds its line from the arguments; its coloured messages are re-rendered from them)."""
    clone = copy.copy(record)
    clone.message = escape_controls(record.message)
    if isinstance(record.args, tuple):
        clone.args = tuple(escape_controls(arg) if isinstance(arg, str) else arg for arg in record.args)
    return clone


class TextFormatter(logging.Formatter):
    """`--log-format text`: the message escaped, the traceback (added after formatMessage) as it is."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return super().formatMessage(_escaped(record))


class EscapingDefaultFormatter(DefaultFormatter):
    def formatMessage(self, record: logging.LogRecord) -> str:
        return super().formatMessage(_escaped(record))


class EscapingAccessFormatter(AccessFormatter):
    def formatMessage(self, record: logging.LogRecord) -> str:
        return super().formatMessage(_escaped(record))


def uvicorn_text_logging() -> dict[str, Any]:
    """uvicorn's own text logging config, with its formatters escaping like ours. uvicorn quotes the path in
    its access line already, but not every message it logs (nor every version) does."""
    config = copy.deepcopy(LOGGING_CONFIG)
    config["formatters"]["default"]["()"] = EscapingDefaultFormatter
    config["formatters"]["access"]["()"] = EscapingAccessFormatter
    return config


def configure_logging(level: str, log_format: str = "text") -> None:
    """In JSON, the root logger's only handler is ours (uvicorn's loggers propagate to it: log_config=None)."""
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
        logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    else:
        handler.setFormatter(TextFormatter(TEXT_FORMAT))
        logging.basicConfig(level=level.upper(), handlers=[handler])
