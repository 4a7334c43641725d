"""Where the server listens and how long it drains: the environment, overridden by flags, read alike by
`pagedserve serve` and by the container's HEALTHCHECK (server/settings.py run as a file), so that arguments
after the image name keep the image's settings and the check probes where the server really listens."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pagedserve.server import cli, settings

SETTINGS_FILE = Path(settings.__file__)
ENVIRONMENT = {"PAGEDSERVE_HOST": "0.0.0.0", "PAGEDSERVE_PORT": "8000", "PAGEDSERVE_SHUTDOWN_TIMEOUT": "3"}
ARGUMENT_LISTS = [
    [],
    ["--port", "8521"],
    ["--host", "127.0.0.1", "--port=8522", "--max-num-seqs", "4"],
    ["/models/x", "--shutdown-timeout", "30", "--api-key=--port"],  # the key is "--port": not a port
    ["--served-model-name", "a", "b", "--port", "8523"],
]


def serve_settings(args: list[str]) -> tuple[str, int, float]:
    parsed = cli.build_parser().parse_args(["serve", *args])
    return parsed.host, parsed.port, parsed.shutdown_timeout


@pytest.mark.parametrize("args", ARGUMENT_LISTS, ids=lambda args: " ".join(args) or "none")
def test_the_healthcheck_reads_the_settings_the_server_runs_with(args: list[str], monkeypatch) -> None:
    for name, value in ENVIRONMENT.items():
        monkeypatch.setenv(name, value)
    probe = settings.listen_settings(args, ENVIRONMENT)
    assert (probe.host, probe.port, probe.shutdown_timeout) == serve_settings(args)


def test_flags_override_the_environment_and_keep_the_rest(monkeypatch) -> None:
    for name, value in ENVIRONMENT.items():
        monkeypatch.setenv(name, value)
    assert serve_settings([]) == ("0.0.0.0", 8000, 3.0)
    assert serve_settings(["--port", "8521"]) == ("0.0.0.0", 8521, 3.0)  # the drain stays the image's 3 s
    for name in ENVIRONMENT:
        monkeypatch.delenv(name)
    assert serve_settings([]) == ("127.0.0.1", 8000, 30.0)


@pytest.mark.parametrize(
    ("name", "value", "flag"),
    [("PAGEDSERVE_PORT", "http", "--port"), ("PAGEDSERVE_SHUTDOWN_TIMEOUT", "-1", "--shutdown")],
)
def test_a_bad_variable_is_refused_like_a_bad_flag(name: str, value: str, flag: str, monkeypatch, capsys) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve"])
    assert f"argument {flag}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "args"),
    [
        (["/opt/venv/bin/python", "/opt/venv/bin/pagedserve", "serve", "--port", "1"], ["--port", "1"]),
        (["python", "-m", "pagedserve.server.cli", "serve"], []),
        (["/opt/venv/bin/python", "/opt/venv/bin/pagedserve", "bench", "serve"], None),
        (["python", "-I", "/opt/pagedserve/healthcheck.py"], None),
    ],
)
def test_a_server_process_is_known_by_its_command_line(argv: list[str], args: list[str] | None) -> None:
    assert settings.serve_arguments(argv) == args


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("0.0.0.0", "http://127.0.0.1:9/health"),
        ("::", "http://[::1]:9/health"),
        ("10.1.2.3", "http://10.1.2.3:9/health"),
    ],
)
def test_the_probe_goes_where_the_server_listens(host: str, url: str) -> None:
    assert settings.probe_url(host, 9) == url


class Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_port
    server.shutdown()


def fake_process(proc: Path, pid: int, argv: list[str], environ: dict[str, str]) -> None:
    (proc / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "cmdline").write_bytes(b"\0".join(part.encode() for part in argv) + b"\0")
    (proc / str(pid) / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in environ.items()) + b"\0")


def test_the_healthcheck_finds_the_server_and_probes_its_port(health_server: int, tmp_path: Path) -> None:
    """A server started with `--port N` after the image name, with the image's PAGEDSERVE_PORT=8000 left in its
    environment: the probe goes to N (the Dockerfile's probe went to 8000)."""
    proc = tmp_path / "proc"
    fake_process(proc, 1, ["/opt/venv/bin/python", "/opt/venv/bin/pagedserve", "serve", "--port", str(health_server)],
                 {**ENVIRONMENT, "PAGEDSERVE_HOST": "0.0.0.0"})  # fmt: skip
    fake_process(proc, 40, ["python", "-I", "/opt/pagedserve/healthcheck.py"], ENVIRONMENT)
    assert settings.main([], proc) == 0
    assert settings.main(["1"], proc) == 0


def test_the_healthcheck_fails_without_a_server(health_server: int, tmp_path: Path, capsys) -> None:
    proc = tmp_path / "proc"
    fake_process(proc, 7, ["python", "-I", "/opt/pagedserve/healthcheck.py"], ENVIRONMENT)
    assert settings.main([], proc) == 1 and "no `pagedserve serve` process" in capsys.readouterr().err
    fake_process(
        proc, 8, ["pagedserve", "serve"], {"PAGEDSERVE_PORT": str(health_server + 1 if health_server < 65535 else 1)}
    )
    assert settings.main([], proc) == 1


def test_the_healthcheck_file_runs_alone_and_quickly(health_server: int) -> None:
    """As the HEALTHCHECK runs it: by its path, isolated, with nothing of the package imported (torch would
    take seconds each probe), here against a process given by pid: this test's own, as `pagedserve serve`."""
    server = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "pagedserve", "serve", "--port", str(health_server)]
    )
    try:
        check = [sys.executable, "-I", "-X", "importtime", str(SETTINGS_FILE), str(server.pid)]
        result = subprocess.run(check, capture_output=True, text=True, timeout=30)
    finally:
        server.kill()
        server.wait()
    assert result.returncode == 0, result.stderr[-2000:]
    imported = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "|" in line]
    assert not [name for name in imported if name.split(".")[0] in ("pagedserve", "torch")], imported
