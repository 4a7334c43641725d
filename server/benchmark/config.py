"""BenchmarkConfig: everything one load-generation run needs, shared by the CLI and the Python API."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

EndpointType = Literal["chat", "completions"]
Workload = Literal["random", "sharegpt-like", "shared-prefix"]

ENDPOINT_TYPES: tuple[str, ...] = ("chat", "completions")
WORKLOADS: tuple[str, ...] = ("random", "sharegpt-like", "shared-prefix")
SLO_METRICS: tuple[str, ...] = ("ttft", "tpot", "e2e")


@dataclass
class BenchmarkConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first id from GET /v1/models
    endpoint_type: EndpointType = "chat"
    workload: Workload = "random"
    num_prompts: int = 100
    input_len: int = 1024  # random: prompt tokens; shared-prefix: tokens after the shared system prompt
    output_len: int = 128  # random and shared-prefix: max_tokens
    prefix_len: int = 1024  # shared-prefix: tokens of the shared system prompt
    dataset_path: str | None = None  # a ShareGPT JSON file: replaces the generated sharegpt-like lengths
    max_model_len: int = 2048  # sharegpt-like and dataset requests are clipped/filtered to fit this
    request_rate: float = math.inf  # requests/s; inf sends them all at once
    burstiness: float = 1.0  # gamma shape of the inter-arrival times: 1 is Poisson, lower is burstier
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = True
    tokenizer: str | None = None  # None: the served model if it is a local path, else the embedded SmolLM2
    api_key: str | None = None
    goodput: dict[str, float] = field(default_factory=dict)  # SLOs in ms, keys from SLO_METRICS
    disable_tqdm: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        checks = [
            (self.endpoint_type in ENDPOINT_TYPES, "endpoint_type", f"one of {ENDPOINT_TYPES}"),
            (self.workload in WORKLOADS, "workload", f"one of {WORKLOADS}"),
            (self.num_prompts >= 1, "num_prompts", ">= 1"),
            (self.input_len >= 1, "input_len", ">= 1"),
            (self.output_len >= 1, "output_len", ">= 1"),
            (self.prefix_len >= 1, "prefix_len", ">= 1"),
            (self.max_model_len >= 8, "max_model_len", ">= 8"),
            (self.request_rate > 0, "request_rate", "> 0 (inf: all at once)"),
            (math.isfinite(self.burstiness) and self.burstiness > 0, "burstiness", "a positive number"),
            (self.max_concurrency is None or self.max_concurrency >= 1, "max_concurrency", ">= 1"),
            (set(self.goodput) <= set(SLO_METRICS), "goodput", f"keyed by {SLO_METRICS}"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

    def as_dict(self) -> dict[str, Any]:
        config = dataclasses.asdict(self)
        config.pop("api_key")  # results get shared; the key must not travel with them
        if math.isinf(self.request_rate):
            config["request_rate"] = "inf"  # strict JSON has no Infinity
        return config
