"""`pagedserve serve`'s API process never loads torch: the engine core holds the model, the API process tokenizes
and renders chat templates with the tokenizers library and jinja2 (engine/text/text_tokenizer.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import psutil

from tests.servers import free_port, server_process

STARTUP_SECONDS = 180  # loading on a busy 2-core machine


def has_torch(pid: int) -> bool:
    """Whether torch's shared library is in the process's memory map (imported torch maps it)."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_the_api_process_serves_without_torch(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "pagedserve.server.cli", "serve", "--port", str(port),
               "--num-kv-blocks", "64", "--num-threads", "1"]  # fmt: skip
    with server_process(command, url, tmp_path / "serve.log", STARTUP_SECONDS) as server:
        chat = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi <|im_end|>"}]}
        plain = httpx.post(f"{url}/v1/chat/completions", json={**chat, "max_tokens": 4}, timeout=120)
        assert plain.status_code == 200, plain.text
        constrained = {**chat, "max_tokens": 8, "response_format": {"type": "json_object"}}
        json_reply = httpx.post(f"{url}/v1/chat/completions", json=constrained, timeout=120)
        assert json_reply.status_code == 200, json_reply.text
        rendered = httpx.post(f"{url}/tokenize", json={**chat, "return_token_strs": True}, timeout=30)
        assert rendered.status_code == 200, rendered.text
        cores = psutil.Process(server.pid).children()
        assert cores and any(has_torch(core.pid) for core in cores)  # the check sees torch where it is
        assert not has_torch(server.pid)


def test_the_api_sides_modules_import_no_torch() -> None:
    """What `pagedserve serve` imports after starting the core, and the clients' modules, in a fresh process."""
    code = (
        "import sys\n"
        "import pagedserve.server.serve, pagedserve.server.cli\n"
        "from pagedserve.engine import AsyncEngine, LLM, QueueFullError, SamplingParams\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules)\n"
        "print(heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
