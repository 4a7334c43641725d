"""Runs a shell command line in a network namespace of its own, beside stand-in replicas, and reports what a
client of the balancer saw, as JSON on stdout. `python -m tests.loadbalancer_netns PORT,... COMMAND` under
`unshare --net`: the README's balancer example binds fixed ports (8000-8002, 8404), which no other server of
the host can take there.

The replicas answer /ready 200 and any other GET with `{"replica": PORT}`. The report: `answers`, the replica of
each of four requests through the balancer on 127.0.0.1:8000; `stats`, the stats page's status on :8404;
`exit`, the command's exit status if it ended; `log`, its output's tail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

BALANCER = "http://127.0.0.1:8000"
STATS = "http://127.0.0.1:8404/stats"
PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"])


class Replica(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"" if self.path == "/ready" else json.dumps({"replica": self.server.server_port}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read()
    except OSError as exc:
        return getattr(exc, "code", 0), b""


def main(ports: list[int], command: str) -> dict[str, object]:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True, env={**os.environ, "PATH": PATH})
    for port in ports:
        server = ThreadingHTTPServer(("127.0.0.1", port), Replica)
        threading.Thread(target=server.serve_forever, daemon=True).start()
    root = Path(__file__).resolve().parents[1]
    log = root / ".pytest_cache" / "readme-balancer.log"
    log.parent.mkdir(exist_ok=True)
    with log.open("w") as sink:
        balancer = subprocess.Popen(
            ["bash", "-c", command], cwd=root, env={**os.environ, "PATH": PATH}, stdout=sink, stderr=subprocess.STDOUT
        )
    report: dict[str, object] = {"answers": [], "stats": 0, "exit": None}
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and balancer.poll() is None:
            status, _ = get(STATS)
            if status == 200 and get(f"{STATS};csv")[1].count(b",UP,") >= len(ports):
                report["stats"] = status
                break
            time.sleep(0.2)
        for _ in range(4):
            status, body = get(f"{BALANCER}/v1/models")
            report["answers"].append(json.loads(body)["replica"] if status == 200 else status)  # type: ignore[union-attr]
    finally:
        report["exit"] = balancer.poll()
        balancer.terminate()
        balancer.wait(10)
    report["log"] = log.read_text()[-2000:]
    return report


if __name__ == "__main__":
    print(json.dumps(main([int(p) for p in sys.argv[1].split(",")], sys.argv[2])))
