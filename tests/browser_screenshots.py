"""Regenerates the README's screenshots of the web page: `python -m tests.browser_screenshots [FOLDER]`.

Serves the embedded model, holds a short conversation in headless Chromium, then keeps a few requests running
while the status view fills its charts. Takes a minute or two on a CPU.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import httpx

from pagedserve.engine import EngineConfig
from pagedserve.engine.config import EMBEDDED_NAME
from pagedserve.engine.worker.model_loader import load_model
from pagedserve.engine.worker.weights.checkpoint import embedded_gguf_path
from pagedserve.engine.worker.weights.gguf_files import dequantized_model_dir
from pagedserve.server import ServerSettings
from tests.browser import Browser, require_chromium
from tests.servers import running_engine, serving

FOLDER = Path(__file__).resolve().parents[1] / "docs" / "images"
QUESTIONS = ("What is the capital of France?", "Give me three short tips for writing clear Python code.")
SYSTEM = "You are a concise assistant."
LAST_REPLY = "[...document.querySelectorAll('.message.assistant')].at(-1)"
LOAD_SECONDS = 25  # how long the status view watches the background requests


def chat(browser: Browser, url: str) -> None:
    browser.goto(url)
    browser.evaluate("localStorage.clear()")
    browser.goto(url)
    browser.wait_for("document.getElementById('model').textContent.includes('context')")
    for field, value in (("system", SYSTEM), ("temperature", "0"), ("max-tokens", "160")):
        browser.fill(f"#{field}", value)
    for question in QUESTIONS:
        browser.fill("#prompt", question)
        browser.click("#send")
        browser.wait_for(f"{LAST_REPLY}?.dataset.state === 'done'", timeout=120)


def keep_busy(url: str, stop: threading.Event) -> None:
    """Streams requests that share a system prompt (prefix cache hits) until `stop` is set."""
    body = {
        "model": EMBEDDED_NAME,
        "messages": [{"role": "system", "content": SYSTEM * 8}, {"role": "user", "content": "Tell me a story."}],
        "max_tokens": 120,
        "stream": True,
    }
    while not stop.is_set():
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
            for _ in response.iter_lines():
                if stop.is_set():
                    break


def main(folder: Path) -> None:
    loaded = load_model(EngineConfig(model=str(dequantized_model_dir(embedded_gguf_path()))))
    config = EngineConfig(num_kv_blocks=512, max_num_seqs=8)
    with (
        running_engine(config, loaded) as engine,
        serving(engine, ServerSettings([EMBEDDED_NAME])) as url,
        Browser(require_chromium(), width=1100, height=720) as browser,
    ):
        chat(browser, url)
        browser.screenshot(folder / "chat.png")
        stop = threading.Event()
        workers = [threading.Thread(target=keep_busy, args=(url, stop)) for _ in range(3)]
        for worker in workers:
            worker.start()
            time.sleep(2)  # staggered, so the running count moves
        browser.click("#tab-status")
        time.sleep(LOAD_SECONDS)
        browser.screenshot(folder / "status.png")
        stop.set()
        for worker in workers:
            worker.join()
    print(f"wrote {folder / 'chat.png'} and {folder / 'status.png'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else FOLDER)
