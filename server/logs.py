"""Logging: the request log (one line per request at its end) and the `--log-format json` formatter.

In JSON, every line is one object: `time`, `level`, `logger`, then either `message` or the structured fields of
a request-log line or of uvicorn's access log. In text, each message has its control characters escaped (a
client's path or model name holding CR/LF or ESC can neither forge a log line nor drive a terminal); tracebacks
are left as they are.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from uvicorn.config import LOGGING_CONFIG
from uvicorn.logging import AccessFormatter, DefaultFormatter

from pagedserve.engine import SequenceDelta
from pagedserve.server.protocol import PromptTokensDetails, Usage

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
request_logger = logging.getLogger("pagedserve.requests")

# Unicode's control characters (C0, DEL, C1) and line/paragraph separators: everything that can end a line.
_ESCAPES = {code: f"\\x{code:02x}" for code in (*range(0x20), *range(0x7F, 0xA0))}
_ESCAPES.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t", 0x2028: "\\u2028", 0x2029: "\\u2029"})


def escape_controls(text: str) -> str:
    """`text` on one line, its control characters as backslash escapes (\\r, \\n, \\x1b, ...)."""
    return text.translate(_ESCAPES)


@dataclass
class RequestRecord:
    """One HTTP request as the request log reports it; the generation routes fill in what came out."""

    request_id: str
    method: str
    path: str
    started: float = field(default_factory=time.perf_counter)  # see received()
    status: int = 500  # what the client sees if the app fails before answering
    error_code: str | None = None  # set by the error handlers, or by a stream that ended with an error event
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_by_prompt: dict[int, int] = field(default_factory=dict)
    first_token_at: float | None = None
    finish_reasons: list[str] = field(default_factory=list)

    def received(self) -> None:
        """The request's body is in: TTFT and E2E count from here, as uploading is the client's time."""
        self.started = time.perf_counter()

    def add(self, prompt_index: int, delta: SequenceDelta) -> None:
        if delta.new_token_ids and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.completion_tokens += len(delta.new_token_ids)
        if delta.finish_reason is not None:
            self.finish_reasons.append(delta.finish_reason)
            cached = max(self.cached_by_prompt.get(prompt_index, 0), delta.num_cached_tokens)
            self.cached_by_prompt[prompt_index] = cached

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self.cached_by_prompt.values())),
        )

    def log(self) -> None:
        """Writes the request's line (call once, at its end)."""
        e2e = time.perf_counter() - self.started
        ttft = None if self.first_token_at is None else self.first_token_at - self.started
        fields = {
            "request_id": self.request_id,
            "method": self.method,
            "path": self.path,
            "status": self.status,
            "error": self.error_code,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.completion_tokens,
            "ttft_s": None if ttft is None else round(ttft, 6),
            "e2e_s": round(e2e, 6),
            "finish_reasons": self.finish_reasons,
        }
        outcome = f"{self.status}" + (f" {self.error_code}" if self.error_code else "")
        ttft_text = "-" if ttft is None else f"{ttft:.3f} s"
        request_logger.info(
            "request %s: %s %s %s, %d prompt + %d output tokens, ttft %s, e2e %.3f s, finish %s",
            *(self.request_id, self.method, self.path, outcome, self.prompt_tokens, self.completion_tokens),
            *(ttft_text, e2e, ",".join(self.finish_reasons) or "-"),
            extra={"fields": fields},
        )


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
