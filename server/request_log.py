"""The request log: one line per HTTP request, written when it ends (formatted by server/logs.py)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from pagedserve.engine import SequenceDelta
from pagedserve.server.protocol import PromptTokensDetails, Usage

request_logger = logging.getLogger("pagedserve.requests")


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
