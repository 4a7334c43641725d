"""Headless Chromium driven over the DevTools protocol, for the web page's tests (marker `browser`).

No browser-automation package: one websocket to the page's DevTools target, JSON commands on it.

Environment:
  PAGEDSERVE_CHROMIUM               the browser binary (default: the first of CHROMIUM_NAMES on PATH)
  PAGEDSERVE_REQUIRE_BROWSER_TESTS  set (by .ci/run): no Chromium fails the browser tests instead of skipping them
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, NoReturn

import httpx
import pytest
from websockets.sync.client import ClientConnection, connect

REQUIRE_ENV = "PAGEDSERVE_REQUIRE_BROWSER_TESTS"
BINARY_ENV = "PAGEDSERVE_CHROMIUM"
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
START_TIMEOUT = 30.0
FLAGS = (
    "--headless=new",
    "--remote-debugging-port=0",  # any free port: Chromium writes it to DevToolsActivePort
    "--no-sandbox",  # root and most containers cannot start its sandbox; the pages are the tests' own
    "--disable-gpu",
    "--disable-dev-shm-usage",  # containers' /dev/shm is often 64 MB
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-extensions",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--mute-audio",
)


def find_chromium() -> str | None:
    chosen = os.environ.get(BINARY_ENV)
    if chosen:
        return shutil.which(chosen)
    return next((found for name in CHROMIUM_NAMES if (found := shutil.which(name))), None)


def require_chromium() -> str:
    """The browser binary; else skips the test, or fails it where the browser tests must run (.ci/run)."""
    binary = find_chromium()
    if binary is None and os.environ.get(BINARY_ENV):
        unavailable(f"{BINARY_ENV}={os.environ[BINARY_ENV]} names no executable")
    if binary is None:
        unavailable("no Chromium found: install Debian's `chromium` package (`make setup` does where apt works)")
    return binary


def unavailable(reason: str) -> NoReturn:
    if os.environ.get(REQUIRE_ENV):
        pytest.fail(f"{reason} ({REQUIRE_ENV} is set: the browser tests must run here)")
    pytest.skip(reason)


class PageError(AssertionError):
    """JavaScript threw, or a condition never came true."""


class Browser:
    """`with Browser(binary) as browser:` one headless Chromium showing one page; its whole process group is
    killed at the end of the block."""

    def __init__(self, binary: str, width: int = 1200, height: int = 800) -> None:
        self.binary = binary
        self.size = (width, height)
        self.events: list[dict[str, Any]] = []
        self._ids = itertools.count(1)
        self._folder = Path(tempfile.mkdtemp(prefix="pagedserve-chromium-"))
        self._process: subprocess.Popen[bytes] | None = None
        self._socket: ClientConnection | None = None
        self._closing = contextlib.ExitStack()

    def __enter__(self) -> Browser:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _start(self) -> None:
        profile = self._folder / "profile"
        command = [self.binary, *FLAGS, f"--user-data-dir={profile}", "--window-size={},{}".format(*self.size)]
        with (self._folder / "chromium.log").open("wb") as log:
            # A session of its own: close() kills the renderers and helpers with the browser.
            self._process = subprocess.Popen([*command, "about:blank"], stdout=log, stderr=log, start_new_session=True)
        port = self._devtools_port(profile / "DevToolsActivePort")
        targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        page = next(target for target in targets if target["type"] == "page")
        self._socket = self._closing.enter_context(
            connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=10)
        )
        self.call("Page.enable")
        self.call("Runtime.enable")
        width, height = self.size
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def _devtools_port(self, port_file: Path) -> int:
        assert self._process is not None
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"Chromium exited ({self._process.returncode}):\n{self.log()}")
            lines = port_file.read_text().splitlines() if port_file.exists() else []
            if lines and lines[0].isdigit():
                return int(lines[0])
            time.sleep(0.05)
        raise RuntimeError(f"Chromium did not open its DevTools port in {START_TIMEOUT:.0f} s:\n{self.log()}")

    def log(self) -> str:
        path = self._folder / "chromium.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def close(self) -> None:
        self._closing.close()
        self._socket = None
        if self._process is not None:
            _kill_group(self._process)
            self._process = None
        shutil.rmtree(self._folder, ignore_errors=True)

    # ---- the protocol ----------------------------------------------------------------------------------

    def call(self, method: str, timeout: float = 30.0, **params: Any) -> dict[str, Any]:
        """Sends one command and returns its result; events that arrive meanwhile go to `events`."""
        assert self._socket is not None, "the browser is not running"
        command_id = next(self._ids)
        self._socket.send(json.dumps({"id": command_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            message = json.loads(self._socket.recv(timeout=max(0.0, deadline - time.monotonic())))
            if message.get("id") == command_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]
            if "method" in message:
                self.events.append(message)

    def goto(self, url: str) -> None:
        self.events.clear()
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'")

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        answer = self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in answer:
            details = answer["exceptionDetails"]
            raise PageError(details.get("exception", {}).get("description") or details.get("text"))
        return answer["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 15.0, interval: float = 0.05) -> Any:
        """Polls `expression` until its value is truthy; returns that value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise PageError(f"not true after {timeout} s: {expression} (page errors: {self.page_errors()})")
            time.sleep(interval)

    def page_errors(self) -> list[str]:
        """Uncaught exceptions and console errors since the last navigation."""
        errors = []
        for event in self.events:
            params = event.get("params", {})
            if event["method"] == "Runtime.exceptionThrown":
                details = params["exceptionDetails"]
                errors.append(details.get("exception", {}).get("description") or details.get("text", ""))
            elif event["method"] == "Runtime.consoleAPICalled" and params.get("type") == "error":
                errors.append(" ".join(str(arg.get("value", arg.get("description"))) for arg in params["args"]))
        return errors

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))

    # ---- the page --------------------------------------------------------------------------------------

    def fill(self, selector: str, value: str) -> None:
        """Sets a form field's value as typing would (its input and change events fire)."""
        self.evaluate(
            f"""(() => {{
                const field = document.querySelector({json.dumps(selector)});
                field.value = {json.dumps(value)};
                field.dispatchEvent(new Event("input", {{bubbles: true}}));
                field.dispatchEvent(new Event("change", {{bubbles: true}}));
            }})()"""
        )

    def click(self, selector: str) -> None:
        self.evaluate(f"document.querySelector({json.dumps(selector)}).click()")

    def text(self, selector: str) -> str:
        return self.evaluate(f"document.querySelector({json.dumps(selector)})?.textContent ?? ''")


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # its profile is thrown away: nothing to shut down cleanly
    process.wait(10)
