"""Online serving, side by side: pagedserve, `transformers serve` and llama.cpp's `llama-server` on one model.

    python -m benchmarks.compare                                     # all three, rates 1,2,4,8,inf
    python -m benchmarks.compare --servers pagedserve,llama.cpp --rates 2,inf --num-prompts 32
    python -m benchmarks.compare --num-prompts 8 --rates inf --max-output-len 16     # a smoke run

Each server in turn is started on 127.0.0.1 (its log under OUT_DIR/logs), loaded with the embedded
SmolLM2-135M-Instruct, swept over the request rates with the `server.benchmark` load generator (streamed chat
completions, greedy, ignore_eos: every request generates exactly its max_tokens), then stopped:

  pagedserve    `pagedserve serve`, float32 activations on CPU, max_num_seqs = --parallel; its projections
                multiply by the GGUF's blocks as stored (quantization `auto`).
  pagedserve-float32
                the same with `--quantization none`: every weight dequantized to float32.
  transformers  `transformers serve --continuous-batching`, float32 on CPU, on the same converted checkpoint;
                its KV cache holds --parallel full-length sequences (it has no max-sequences flag).
  llama.cpp     `llama-server -np --parallel` (continuous batching) on the GGUF file itself. The file is Q4_1:
                llama.cpp and pagedserve compute with the 4-bit weights, the others with them dequantized.

All three see the same workload (seed, lengths, prompt bodies; only the 8-word prefix that defeats prefix
caches across runs is new each run) and the same CPU threads (--threads). Each gets the environment a user
starting it by hand would give it: the one this script was started in, plus OMP_NUM_THREADS = MKL_NUM_THREADS =
--threads and HF_HUB_OFFLINE=1. OMP_WAIT_POLICY (all three use OpenMP) is left as the user set it; unset,
pagedserve gets PASSIVE (its own default, which the `engine` package sets in this process too) and the other two
none (their default); compare.json and compare.md record these variables per server. Requests go through a
small body rewriter: max_tokens is capped at --max-output-len, and `transformers serve` (which answers 422 to
fields it does not know) gets ignore_eos as a per-request generation_config whose eos_token_id is -1.

Overload (--overload-requests, 0 skips it): after its sweep, pagedserve is started once more with a short
waiting queue (--max-queue-len = --parallel) and sent --overload-requests requests at once: past what it holds
(--parallel running, --parallel waiting), it should answer 503 with Retry-After at once rather than let them
wait into client timeouts. Reported: requests completed, shed with 503 (with Retry-After or not), timeouts and
other failures, how soon the first 503 came and how long each took, and the served requests' throughput.

Memory: once each server is ready, the resident memory (RSS) of its processes (the server and its children:
pagedserve's engine core) is read from /proc and reported.

Writes OUT_DIR/compare.json (every result, the server commands and their environments, the overload run),
compare.md (the table, the figures and the overload run, also printed) and compare_throughput.png,
compare_latency.png (p50/p99 TTFT and TPOT against the request rate).

Building llama-server (without one on PATH or given with --llama-server, llama.cpp is skipped): the
llama-cpp-python source release vendors llama.cpp. It needs cmake and a C++17 compiler, and no network at
build time (the web UI is left out rather than downloaded). About 30 minutes on 2 busy cores.

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/llamacpp
    tar -xzf /tmp/llamacpp/llama_cpp_python-0.3.36.tar.gz -C /tmp/llamacpp
    cmake -S /tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp -B /tmp/llamacpp/build \\
        -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON \\
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \\
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
    nice -n 19 cmake --build /tmp/llamacpp/build --target llama-server -j2
    install -D /tmp/llamacpp/build/bin/llama-server /tmp/llama-server/bin/llama-server
    python -m benchmarks.compare --llama-server /tmp/llama-server/bin/llama-server

(With older llama-cpp-python releases, whose llama.cpp has no UI options and downloads models with libcurl,
use -DLLAMA_CURL=OFF instead of the last line of options.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx

# The environment this script was started in, read before the imports below load `engine`: engine/__init__.py
# sets OMP_WAIT_POLICY=PASSIVE in this process (pagedserve's default), which the other servers must not inherit.
USER_ENV = dict(os.environ)

from pagedserve.engine.worker.weights.checkpoint import embedded_gguf_path  # noqa: E402 (after USER_ENV)
from pagedserve.engine.worker.weights.gguf_files import dequantized_model_dir  # noqa: E402
from pagedserve.server.benchmark import BenchmarkConfig, run_benchmark_async  # noqa: E402

SERVERS = ("pagedserve", "pagedserve-float32", "transformers", "llama.cpp")
HOST = "127.0.0.1"
READY_TIMEOUT_S = 600.0  # loading, plus materializing the checkpoint on a first run
STOP_TIMEOUT_S = 20.0
TEMPLATE_TOKENS = 64  # the chat template (with its default system prompt) on top of the workload's tokens
LLAMA_BUILD_HELP = (__doc__ or "")[(__doc__ or "").index("Building llama-server") :]
Rewrite = Callable[[dict[str, Any]], None]


# ---------------------------------------------------------------------------------------------------- servers


class ManagedServer:
    """A server subprocess in its own session: Ctrl-C reaches only this script, which then stops it."""

    def __init__(self, name: str, argv: list[str], ready_url: str, log_path: Path, env: dict[str, str]) -> None:
        self.name, self.argv, self.ready_url, self.log_path, self.env = name, argv, ready_url, log_path, env
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ManagedServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:  # the child keeps its own descriptor
            self.process = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> float:
        """Seconds until ready_url answered 200; raises when the process exits or time runs out."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited while starting; its log ends:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.ready_url, timeout=5.0).status_code == 200:
                    return time.monotonic() - start
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s; its log ends:\n{self.log_tail()}")

    def resident_mib(self) -> float:
        """Resident memory of the server and its descendants, in MiB (0 if it has exited)."""
        if self.process is None or self.process.poll() is not None:
            return 0.0
        return sum(resident_kib(pid) for pid in process_tree(self.process.pid)) / 1024

    def stop(self) -> None:
        """SIGTERM to the whole process group, SIGKILL if it lingers."""
        if self.process is None or self.process.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(wait_s)
                return

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@dataclass
class ServerSpec:
    """How to start one server kind and talk to it."""

    name: str
    argv: list[str]
    ready_path: str
    port: int
    env: dict[str, str]  # the whole environment of the process (see server_env)
    model: str | None = None  # None: the first id of GET /v1/models
    rewrite: Rewrite | None = None  # extra request-body changes this server needs
    version: str = ""

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"


@dataclass
class Model:
    gguf: Path
    checkpoint: Path  # the GGUF converted to a transformers checkpoint (safetensors + tokenizer)


def process_tree(pid: int) -> list[int]:
    """pid and its living descendants (Linux: each task's children lists)."""
    tree, index = [pid], 0
    while index < len(tree):
        for task in Path(f"/proc/{tree[index]}/task").glob("*"):
            with contextlib.suppress(OSError):
                tree += [int(child) for child in (task / "children").read_text().split()]
        index += 1
    return list(dict.fromkeys(tree))


def resident_kib(pid: int) -> int:
    """VmRSS of a process in KiB; 0 for one that is gone."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def server_env(threads: int, defaults: dict[str, str] | None = None) -> dict[str, str]:
    """What a user starting the server by hand would give it: their environment (USER_ENV, not this process's,
    which importing `engine` changed), the threads pinned, and the server's own `defaults` where they set none."""
    # HF_HUB_OFFLINE: everything is local; a hub lookup would only wait on a network that may not be there.
    pinned = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    return {**(defaults or {}), **USER_ENV, **pinned}


ENV_RECORDED = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "HF_HUB_OFFLINE", "OMP_WAIT_POLICY")


def env_record(env: dict[str, str]) -> dict[str, str | None]:
    """The variables that may differ between the servers (None: unset), for the reports."""
    return {key: env.get(key) for key in ENV_RECORDED}


def env_text(record: dict[str, str | None]) -> str:
    return " ".join(f"{key}={value}" if value is not None else f"{key} unset" for key, value in record.items())


def console_script(name: str) -> str | None:
    """The venv's own script first, so the servers run on this interpreter's packages."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def slot_context(args: argparse.Namespace) -> int:
    """Tokens one sequence may need: the workload's longest request plus the chat template."""
    longest = max(BenchmarkConfig().max_model_len, args.prefix_len + args.input_len + args.max_output_len)
    return math.ceil((longest + TEMPLATE_TOKENS) / 256) * 256  # llama.cpp pads a slot to 256 tokens anyway


def pagedserve_spec(
    args: argparse.Namespace, model: Model, max_queue_len: int | None = None, float32: bool = False
) -> ServerSpec:
    """max_queue_len: by default deep enough that no request of the sweep is shed, even at rate inf.
    float32: every weight dequantized (named pagedserve-float32), not the GGUF's blocks."""
    port = free_port()
    argv = [
        console_script("pagedserve") or "pagedserve",
        "serve",
        "--host", HOST,
        "--port", str(port),
        "--dtype", "float32",
        "--device", "cpu",
        "--num-threads", str(args.threads),
        "--max-num-seqs", str(args.parallel),
        "--max-queue-len", str(max_queue_len or max(1024, args.num_prompts)),
        "--shutdown-timeout", "5",
        "--log-level", "warning",
        "--quantization", "none" if float32 else "auto",
    ]  # fmt: skip
    env = server_env(args.threads, {"OMP_WAIT_POLICY": "PASSIVE"})  # what its engine package would set anyway
    name = "pagedserve-float32" if float32 else "pagedserve"
    return ServerSpec(name, argv, "/ready", port, env=env, version=version("pagedserve"))


def transformers_checkpoint(model: Model, into: Path) -> Path:
    """The converted checkpoint as `transformers serve` loads it: it needs config.architectures, which the
    conversion leaves out, so the files are linked into a folder whose config.json names the class."""
    for source in model.checkpoint.iterdir():
        if source.name != "config.json":
            (into / source.name).symlink_to(source)
    config = json.loads((model.checkpoint / "config.json").read_text())
    config.setdefault("architectures", ["LlamaForCausalLM"])
    (into / "config.json").write_text(json.dumps(config, indent=2))
    return into


def transformers_rewrite(checkpoint: Path) -> Rewrite:
    """ignore_eos as transformers serve understands it: a generation_config with no EOS token (-1)."""
    defaults = json.loads((checkpoint / "generation_config.json").read_text())
    token_ids = {key: value for key, value in defaults.items() if key.endswith("_token_id")}
    no_eos = json.dumps({**token_ids, "eos_token_id": -1})

    def rewrite(body: dict[str, Any]) -> None:
        if body.pop("ignore_eos", False):
            body["generation_config"] = no_eos

    return rewrite


def transformers_spec(args: argparse.Namespace, model: Model, workdir: Path) -> ServerSpec | None:
    script = console_script("transformers")
    if script is None:
        print("transformers: no `transformers` command in this environment; skipped")
        return None
    checkpoint = transformers_checkpoint(model, workdir)
    port = free_port()
    page_tokens = 256  # ContinuousBatchingConfig.page_size
    # Without --cb-num-blocks it sizes the cache from the machine's RAM (most of it): give it the others' budget.
    num_blocks = math.ceil(args.parallel * slot_context(args) / page_tokens)
    argv = [
        script,
        "serve", str(checkpoint),
        "--continuous-batching",
        "--device", "cpu",
        "--dtype", "float32",
        "--cb-num-blocks", str(num_blocks),
        "--cb-max-batch-tokens", "2048",  # pagedserve's max_num_batched_tokens, llama.cpp's -b
        "--host", HOST,
        "--port", str(port),
    ]  # fmt: skip
    return ServerSpec(
        "transformers",
        argv,
        "/health",
        port,
        model=str(checkpoint),  # a server pinned to a model refuses any other name
        env=server_env(args.threads),
        rewrite=transformers_rewrite(checkpoint),
        version=version("transformers"),
    )


def llama_server_binary(args: argparse.Namespace) -> str | None:
    if args.llama_server:
        path = Path(args.llama_server).expanduser()
        return str(path) if path.is_file() and os.access(path, os.X_OK) else None
    return shutil.which("llama-server")


def llama_version(binary: str) -> str:
    try:
        done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    lines = (done.stdout + done.stderr).strip().splitlines()
    found = next((line for line in lines if line.startswith("version:")), lines[-1] if lines else "")
    return found.removeprefix("version:").strip()


def llama_spec(args: argparse.Namespace, model: Model) -> ServerSpec | None:
    binary = llama_server_binary(args)
    if binary is None:
        where = f"{args.llama_server} is not an executable file" if args.llama_server else "no llama-server on PATH"
        print(f"llama.cpp: {where}; skipped.\n\n{LLAMA_BUILD_HELP}")
        return None
    port = free_port()
    argv = [
        binary,
        "-m", str(model.gguf),
        "--host", HOST,
        "--port", str(port),
        "-np", str(args.parallel),
        "-c", str(args.parallel * slot_context(args)),  # split evenly between the slots
        "-t", str(args.threads),
        "-tb", str(args.threads),
        "--cont-batching",
        "--no-webui",
    ]  # fmt: skip
    return ServerSpec("llama.cpp", argv, "/health", port, env=server_env(args.threads), version=llama_version(binary))


def server_specs(args: argparse.Namespace, model: Model, workdir: Path) -> Iterator[ServerSpec]:
    for name in args.servers:
        spec = {
            "pagedserve": lambda: pagedserve_spec(args, model),
            "pagedserve-float32": lambda: pagedserve_spec(args, model, float32=True),
            "transformers": lambda: transformers_spec(args, model, workdir),
            "llama.cpp": lambda: llama_spec(args, model),
        }[name]()
        if spec is not None:
            yield spec


# ------------------------------------------------------------------------------------------------------- load


class RewritingTransport(httpx.AsyncBaseTransport):
    """Every JSON request body passes through `rewrite` on its way to the server."""

    def __init__(self, rewrite: Rewrite) -> None:
        # No connection cap: the client's own limits do not reach a transport passed in.
        unlimited = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self._transport = httpx.AsyncHTTPTransport(limits=unlimited)
        self._rewrite = rewrite

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.headers.get("content-type") == "application/json":
            body = json.loads(await request.aread())
            self._rewrite(body)
            headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() != "content-length"]
            request = httpx.Request("POST", request.url, headers=headers, json=body, extensions=request.extensions)
        return await self._transport.handle_async_request(request)

    async def aclose(self) -> None:
        await self._transport.aclose()


def request_rewrite(spec: ServerSpec, max_output_len: int) -> Rewrite:
    def rewrite(body: dict[str, Any]) -> None:
        if "max_tokens" in body:  # sharegpt-like lengths have a long tail; the cap keeps a run's length bounded
            body["max_tokens"] = min(int(body["max_tokens"]), max_output_len)
        if spec.rewrite is not None:
            spec.rewrite(body)

    return rewrite


def benchmark_config(
    args: argparse.Namespace, spec: ServerSpec, model: Model, rate: float, num_prompts: int
) -> BenchmarkConfig:
    return BenchmarkConfig(
        base_url=spec.base_url,
        model=spec.model,
        endpoint_type="chat",
        workload=args.workload,
        num_prompts=num_prompts,
        input_len=args.input_len,
        output_len=args.max_output_len,
        prefix_len=args.prefix_len,
        request_rate=rate,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        ignore_eos=True,
        tokenizer=str(model.checkpoint),  # one tokenizer for all: the same prompts whatever the server calls itself
        disable_tqdm=True,
    )


def run_rate(
    args: argparse.Namespace, spec: ServerSpec, model: Model, rate: float, num_prompts: int | None = None
) -> dict[str, Any]:
    config = benchmark_config(args, spec, model, rate, num_prompts or args.num_prompts)
    transport = RewritingTransport(request_rewrite(spec, args.max_output_len))
    return asyncio.run(run_benchmark_async(config, transport=transport))


@contextlib.contextmanager
def running(args: argparse.Namespace, spec: ServerSpec, title: str, log_name: str) -> Iterator[ManagedServer]:
    """Starts the server, says what runs and where it logs, and waits until it is ready (RuntimeError if never)."""
    log_path = args.out_dir / "logs" / f"{log_name}.log"
    print(f"\n== {title}: {' '.join(spec.argv)}", flush=True)
    print(f"   env: {env_text(env_record(spec.env))}\n   log: {log_path}", flush=True)
    with ManagedServer(spec.name, spec.argv, spec.base_url + spec.ready_path, log_path, spec.env) as server:
        print(f"   ready after {server.wait_ready():.1f} s", flush=True)
        yield server


def sweep(
    args: argparse.Namespace, spec: ServerSpec, model: Model, record: Callable[[dict[str, Any]], None]
) -> float | None:
    """Starts the server, runs every rate against it, stops it; failures are recorded, not raised. Returns the
    server's resident memory once ready, in MiB (None if it never was)."""
    try:
        with running(args, spec, f"{spec.name} {spec.version}", spec.name) as server:
            resident = server.resident_mib()
            print(f"   resident memory once ready: {resident:.0f} MiB", flush=True)
            for rate in args.rates:
                record(run_one_rate(args, spec, model, rate))
            return resident
    except RuntimeError as exc:  # never ready
        print(f"   {exc}", flush=True)
        record({"server": spec.name, "rate": None, "error": str(exc)})
        return None


def run_one_rate(args: argparse.Namespace, spec: ServerSpec, model: Model, rate: float) -> dict[str, Any]:
    start = time.monotonic()
    try:
        result = run_rate(args, spec, model, rate)
    except Exception as exc:  # a broken run must not cost the other rates and servers theirs
        print(f"   rate {rate:g}: failed: {type(exc).__name__}: {exc}", flush=True)
        return {"server": spec.name, "rate": rate, "error": f"{type(exc).__name__}: {exc}"}
    print(f"   {summary_line(rate, result)} (wall {time.monotonic() - start:.0f} s)", flush=True)
    return {"server": spec.name, "rate": rate, "result": result}


def summary_line(rate: float, result: dict[str, Any]) -> str:
    errors = f", errors: {result['errors']}" if result["errors"] else ""
    return (
        f"rate {rate:g}: {result['completed']} done, {result['failed']} failed, "
        f"{result['output_throughput']:.1f} out tok/s, TTFT p50 {result['ttft_ms']['median']:.0f} ms, "
        f"TPOT p50 {result['tpot_ms']['median']:.1f} ms{errors}"
    )


def overload(args: argparse.Namespace, model: Model) -> dict[str, Any]:
    """pagedserve with a short queue, sent --overload-requests requests at once; failures are recorded, not raised."""
    spec = pagedserve_spec(args, model, max_queue_len=args.parallel)
    entry: dict[str, Any] = {
        "server": spec.name,
        "requests": args.overload_requests,
        "max_num_seqs": args.parallel,
        "max_queue_len": args.parallel,
        "argv": spec.argv,
        "env": env_record(spec.env),
    }
    title = f"overload, {args.overload_requests} requests at once"
    start = time.monotonic()
    try:
        with running(args, spec, title, "pagedserve-overload"):
            result = run_rate(args, spec, model, math.inf, args.overload_requests)
    except Exception as exc:
        print(f"   failed: {type(exc).__name__}: {exc}", flush=True)
        return entry | {"error": f"{type(exc).__name__}: {exc}"}
    shed = shedding(result, args.overload_requests)
    print(f"   {overload_line(shed)} (wall {time.monotonic() - start:.0f} s)", flush=True)
    return entry | {"shed": shed, "result": result}


def shedding(result: dict[str, Any], requests: int) -> dict[str, Any]:
    """What happened to the requests of an overload run, from the load generator's result."""
    return {
        "requests": requests,
        "completed": result["completed"],
        "rejected_503": result["rejected_503"],
        "with_retry_after": result["rejected_with_retry_after"],
        "timeouts": result["timeouts"],  # the client's, and the server's own time limits (408, 504)
        "other_failures": result["failed"] - result["rejected_503"] - result["timeouts"],
        "first_503_ms": result["first_rejection_ms"],
        "rejection_ms": result["rejection_ms"],  # sent -> 503 in, per request
        "output_throughput": result["output_throughput"],  # the served requests' tokens over the whole run
        "ttft_ms": result["ttft_ms"],
        "errors": result["errors"],
    }


def overload_line(shed: dict[str, Any]) -> str:
    first = "" if shed["first_503_ms"] is None else f", first 503 after {shed['first_503_ms']:.0f} ms"
    return (
        f"{shed['completed']} done, {shed['rejected_503']} shed with 503 ({shed['with_retry_after']} with "
        f"Retry-After), {shed['timeouts']} timeouts, {shed['other_failures']} other failures{first}, "
        f"served {shed['output_throughput']:.1f} out tok/s"
    )


# ---------------------------------------------------------------------------------------------------- reports

COLUMNS = (
    "Server", "Rate (req/s)", "Done", "Failed", "Req/s", "Output tok/s",
    "TTFT p50 (ms)", "TTFT p99 (ms)", "TPOT p50 (ms)", "TPOT p99 (ms)", "Peak conc.",
)  # fmt: skip


def table_row(run: dict[str, Any]) -> list[str]:
    rate = "-" if run["rate"] is None else f"{run['rate']:g}"
    if "error" in run:
        return [run["server"], rate, f"error: {run['error'].splitlines()[0]}"] + [""] * (len(COLUMNS) - 3)
    r = run["result"]
    return [
        run["server"], rate, str(r["completed"]), str(r["failed"]),
        f"{r['request_throughput']:.2f}", f"{r['output_throughput']:.1f}",
        f"{r['ttft_ms']['median']:.0f}", f"{r['ttft_ms']['p99']:.0f}",
        f"{r['tpot_ms']['median']:.1f}", f"{r['tpot_ms']['p99']:.1f}", str(r["peak_concurrency"]),
    ]  # fmt: skip


def markdown_table(columns: tuple[str, ...], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(columns) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(columns))) + "|",
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def markdown(
    runs: list[dict[str, Any]],
    meta: dict[str, Any],
    servers: list[dict[str, Any]],
    overload_run: dict[str, Any] | None = None,
) -> str:
    lines = [
        f"Workload: {meta['workload']}, {meta['num_prompts']} prompts, max output {meta['max_output_len']} tokens "
        f"(ignore_eos), seed {meta['seed']}, max concurrency {meta['max_concurrency'] or 'unlimited'}; "
        f"--parallel {meta['parallel']}, --threads {meta['threads']}.",
        "",
        "Environment, on top of the one compare.py was started in:",
        "",
        *(f"- {server['name']}: {env_text(server['env'])}" for server in servers if "env" in server),
        "",
        *markdown_table(COLUMNS, [table_row(run) for run in runs]),
    ]
    figures = target_lines(runs, overload_run) + memory_lines(servers)
    if figures:
        lines += ["", *figures]
    if overload_run is not None:
        lines += ["", "## Overload", "", *overload_section(overload_run)]
    return "\n".join(lines) + "\n"


OVERLOAD_COLUMNS = (
    "Sent", "Done", "Shed (503)", "With Retry-After", "Timeouts", "Other failures",
    "First 503 (ms)", "503 p50 (ms)", "503 p99 (ms)", "Served output tok/s", "Served TTFT p99 (ms)",
)  # fmt: skip


def overload_section(run: dict[str, Any]) -> list[str]:
    lines = [
        f"{run['server']} with --max-num-seqs {run['max_num_seqs']} --max-queue-len {run['max_queue_len']}, sent "
        f"{run['requests']} requests at once (its log: logs/pagedserve-overload.log). Shed: answered 503; first "
        "503: from the first request sent; 503 p50/p99: each rejected request, sent to answered.",
        "",
    ]
    if "shed" not in run:
        return [*lines, f"error: {run.get('error', 'no result').splitlines()[0]}"]
    shed = run["shed"]
    first = "-" if shed["first_503_ms"] is None else f"{shed['first_503_ms']:.0f}"
    rejected = shed["rejected_503"] > 0
    row = [
        str(shed["requests"]), str(shed["completed"]), str(shed["rejected_503"]), str(shed["with_retry_after"]),
        str(shed["timeouts"]), str(shed["other_failures"]), first,
        f"{shed['rejection_ms']['median']:.0f}" if rejected else "-",
        f"{shed['rejection_ms']['p99']:.0f}" if rejected else "-",
        f"{shed['output_throughput']:.1f}", f"{shed['ttft_ms']['p99']:.0f}",
    ]  # fmt: skip
    lines += markdown_table(OVERLOAD_COLUMNS, [row])
    others = [error for error in shed["errors"] if not error.startswith("HTTP 503")]
    if others:
        lines += ["", "Other errors: " + "; ".join(others)]
    return lines


TARGETS = {"transformers": 3.0, "llama.cpp": 1.25}  # pagedserve's saturation throughput over each, at least
TPOT_P99_LIMIT = 1.5  # pagedserve's p99 TPOT over the best other's, at most


def ratio(numerator: float, denominator: float) -> str:
    return f"{numerator / denominator:.2f}x" if denominator > 0 else "n/a (nothing to divide by)"


def target_lines(runs: list[dict[str, Any]], overload_run: dict[str, Any] | None = None) -> list[str]:
    """The comparison's figures: throughput at saturation, p99 TPOT at the highest rate where all are stable,
    pagedserve's failures over the sweep and its load shedding past saturation."""
    measured = [run for run in runs if "result" in run]
    servers = list(dict.fromkeys(run["server"] for run in measured))
    if "pagedserve" not in servers:
        return []
    return [*comparison_lines(measured, servers), *pagedserve_lines(measured, overload_run)]


def comparison_lines(measured: list[dict[str, Any]], servers: list[str]) -> list[str]:
    if len(servers) < 2:
        return []
    saturation = {name: max(series(measured, name, lambda r: r["output_throughput"]).values()) for name in servers}
    lines = [
        f"- saturation throughput: pagedserve {ratio(saturation['pagedserve'], saturation[other])} {other} "
        f"(target {TARGETS.get(other, 1.0):g}x)"
        for other in servers
        if other != "pagedserve"
    ]
    stable = [
        rate
        for rate in dict.fromkeys(run["rate"] for run in measured)
        if all(run["result"]["failed"] == 0 for run in measured if run["rate"] == rate)
        and len([run for run in measured if run["rate"] == rate]) == len(servers)
    ]
    if stable:
        rate = max(stable)
        p99 = {run["server"]: run["result"]["tpot_ms"]["p99"] for run in measured if run["rate"] == rate}
        best = min(value for name, value in p99.items() if name != "pagedserve")
        lines.append(
            f"- p99 TPOT at rate {rate:g} (highest with no failures anywhere): {ratio(p99['pagedserve'], best)} the "
            f"best other (target at most {TPOT_P99_LIMIT:g}x)"
        )
    return lines


def pagedserve_lines(measured: list[dict[str, Any]], overload_run: dict[str, Any] | None) -> list[str]:
    failed = sum(run["result"]["failed"] for run in measured if run["server"] == "pagedserve")
    lines = [f"- pagedserve failed requests over the sweep: {failed}"]
    if overload_run is None:
        return lines
    if "shed" not in overload_run:
        return [*lines, f"- overload: error: {overload_run.get('error', 'no result').splitlines()[0]}"]
    shed = overload_run["shed"]
    below = "no failures" if failed == 0 else f"{failed} failed requests"
    others = f", {shed['other_failures']} other failures" if shed["other_failures"] else ""
    lines.append(
        f"- overload: {below} up to saturation; above it ({shed['requests']} requests at once, --max-queue-len "
        f"{overload_run['max_queue_len']}): {shed['rejected_503']} of {shed['requests']} shed with 503, "
        f"{shed['timeouts']} timeouts{others}"
    )
    return lines


def memory_lines(servers: list[dict[str, Any]]) -> list[str]:
    """Each server's resident memory once ready, and pagedserve's against its float32 weights."""
    resident = {server["name"]: server["resident_mib"] for server in servers if server.get("resident_mib")}
    if not resident:
        return []
    each = ", ".join(f"{name} {mib:.0f} MiB" for name, mib in resident.items())
    lines = [f"- resident memory once ready (the server and its child processes): {each}"]
    if "pagedserve" in resident and "pagedserve-float32" in resident:
        saved = resident["pagedserve-float32"] - resident["pagedserve"]
        lines.append(f"- pagedserve's blocks against its float32 weights: {saved:.0f} MiB less (target >= 400 MiB)")
    return lines


LATENCY_PANELS = (("ttft", "median"), ("ttft", "p99"), ("tpot", "median"), ("tpot", "p99"))


def percentile(metric: str, stat: str) -> Callable[[dict[str, Any]], float]:
    return lambda result: float(result[f"{metric}_ms"][stat])


def leading_digit(value: float) -> int:
    return round(value / 10 ** math.floor(math.log10(value))) if value > 0 else 0


def series(runs: list[dict[str, Any]], server: str, value: Callable[[dict[str, Any]], float]) -> dict[float, float]:
    return {run["rate"]: value(run["result"]) for run in runs if run["server"] == server and "result" in run}


def plot(runs: list[dict[str, Any]], rates: list[float], out_dir: Path) -> list[Path]:
    """Rates sit at even steps on the x axis (inf last): a log axis cannot place inf."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    servers = list(dict.fromkeys(run["server"] for run in runs if "result" in run))
    if not servers:
        return []
    ticks = [f"{rate:g}" for rate in rates]
    position = {rate: i for i, rate in enumerate(rates)}

    def draw(ax: Any, value: Callable[[dict[str, Any]], float], title: str, ylabel: str) -> None:
        for server in servers:
            points = series(runs, server, value)
            xs = sorted(points, key=position.__getitem__)
            ax.plot([position[x] for x in xs], [points[x] for x in xs], marker="o", label=server)
        ax.set_xticks(range(len(rates)), ticks)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()

    fig, ax = plt.subplots(figsize=(7, 4.5))
    draw(ax, lambda r: r["output_throughput"], "Output throughput", "tokens/s")
    throughput = out_dir / "compare_throughput.png"
    fig.tight_layout()
    fig.savefig(throughput, dpi=120)
    plt.close(fig)

    plain = matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}")
    sparse = matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}" if leading_digit(value) in (2, 3, 5) else "")
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (metric, stat) in zip(axes.flat, LATENCY_PANELS):
        label = "p50" if stat == "median" else stat
        draw(ax, percentile(metric, stat), f"{label} {metric.upper()}", "ms")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(plain)  # 2000, not 2x10^3
        ax.yaxis.set_minor_formatter(sparse)
    latency = out_dir / "compare_latency.png"
    fig.tight_layout()
    fig.savefig(latency, dpi=120)
    plt.close(fig)
    return [throughput, latency]


# ------------------------------------------------------------------------------------------------------- main


def parse_rates(text: str) -> list[float]:
    rates = sorted({float(part) for part in text.split(",") if part.strip()})
    if not rates or rates[0] <= 0:
        raise argparse.ArgumentTypeError("rates must be positive numbers or inf, comma-separated")
    return rates


def parse_servers(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = set(names) - set(SERVERS)
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(SERVERS)} (got {text!r})")
    return list(dict.fromkeys(names))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", type=parse_servers, default=",".join(SERVERS), help="(default: %(default)s)")
    parser.add_argument(
        "--rates", type=parse_rates, default="1,2,4,8,inf", help="req/s; inf: all at once (default: %(default)s)"
    )
    parser.add_argument("--num-prompts", type=int, default=64, help="per rate (default: %(default)s)")
    parser.add_argument(
        "--workload",
        choices=("sharegpt-like", "random", "shared-prefix"),
        default="sharegpt-like",
        help="(default: %(default)s)",
    )
    parser.add_argument("--max-output-len", type=int, default=256, help="max_tokens cap (default: %(default)s)")
    parser.add_argument("--input-len", type=int, default=256, help="random, shared-prefix (default: %(default)s)")
    parser.add_argument("--prefix-len", type=int, default=512, help="shared-prefix (default: %(default)s)")
    parser.add_argument("--max-concurrency", type=int, help="client-side cap on requests in flight (default: none)")
    parser.add_argument("--llama-server", help="path of a llama-server binary (default: the one on PATH)")
    parser.add_argument(
        "--parallel", type=int, default=32, help="llama.cpp -np, pagedserve max_num_seqs (default: %(default)s)"
    )
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of each server (default: %(default)s)")
    parser.add_argument(
        "--overload-requests",
        type=int,
        help="sent at once to pagedserve with --max-queue-len --parallel after its sweep; 0: skip "
        "(default: 4x --parallel, twice what it holds running and waiting)",
    )
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"), help="(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    args = parser.parse_args(argv)
    for name in ("num_prompts", "max_output_len", "input_len", "prefix_len", "parallel", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.overload_requests is None:
        args.overload_requests = 4 * args.parallel
    elif args.overload_requests < 0:
        parser.error("--overload-requests must be >= 0")
    return args


def jsonable(value: Any) -> Any:
    """inf as the string "inf": json.dumps would write Infinity, which strict JSON parsers reject."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(item) for item in value]
    return value


def stop_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so the servers are stopped on the way out."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_sigterm()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    gguf = embedded_gguf_path()
    model = Model(gguf=gguf, checkpoint=dequantized_model_dir(gguf))
    meta = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    meta |= {"gguf": str(gguf), "checkpoint": str(model.checkpoint), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    runs: list[dict[str, Any]] = []
    servers: list[dict[str, Any]] = []
    report: dict[str, Any] = {"meta": meta, "servers": servers, "runs": runs, "overload": None}
    json_path = args.out_dir / "compare.json"

    def write() -> None:  # after every run: an interrupted sweep keeps what it measured
        json_path.write_text(json.dumps(jsonable(report), indent=2, default=str))

    def record(run: dict[str, Any]) -> None:
        runs.append(run)
        write()

    try:
        with tempfile.TemporaryDirectory(prefix="compare-") as workdir:
            for spec in server_specs(args, model, Path(workdir)):
                entry = {"name": spec.name, "version": spec.version, "argv": spec.argv, "env": env_record(spec.env)}
                servers.append(entry)
                entry["resident_mib"] = sweep(args, spec, model, record)
                if spec.name == "pagedserve" and args.overload_requests:
                    report["overload"] = overload(args, model)
                    write()
    except KeyboardInterrupt:
        print("\ninterrupted: servers stopped; reporting what was measured", file=sys.stderr)
    if not runs:
        return 1
    table = markdown(runs, meta, servers, report["overload"])
    (args.out_dir / "compare.md").write_text(table)
    print("\n" + table)
    for path in [json_path, args.out_dir / "compare.md", *plot(runs, args.rates, args.out_dir)]:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
