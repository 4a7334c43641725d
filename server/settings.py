"""Where `pagedserve serve` listens and how long it drains: settings from the environment that the command line
overrides, read by the server and by the container's HEALTHCHECK alike.

    PAGEDSERVE_HOST              --host              (default 127.0.0.1)
    PAGEDSERVE_PORT              --port              (default 8000)
    PAGEDSERVE_SHUTDOWN_TIMEOUT  --shutdown-timeout  (default 30 s)

The image sets the variables, so arguments after its name (`docker run IMAGE --port 8521`) keep the other
settings. Run as a file (`python -I settings.py`), this module is the HEALTHCHECK: it finds the running
`pagedserve serve` process, reads its settings from its environment and arguments as the server did, and
probes /health where the server really listens. The standard library only: importing the package would load
torch, seconds of CPU every probe.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

HOST_ENV = "PAGEDSERVE_HOST"
PORT_ENV = "PAGEDSERVE_PORT"
SHUTDOWN_TIMEOUT_ENV = "PAGEDSERVE_SHUTDOWN_TIMEOUT"
PROBE_TIMEOUT_SECONDS = 4.0  # under the HEALTHCHECK's own 5 s
# The HTTP door's limits (server/http_protocol.py), here so that the command line is built without importing it.
DEFAULT_HEADER_TIMEOUT = 10.0  # seconds
DEFAULT_BODY_TIMEOUT = 10.0  # seconds
DEFAULT_MAX_CONNECTIONS = 1024


def positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    """An argparse type: a finite number > 0."""

    def parse(text: str) -> float:
        value = kind(text)
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its error messages
    return parse


def port_number(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number (0-65535), got {text}")
    return value


def add_listen_args(group: argparse._ActionsContainer, environ: Mapping[str, str] = os.environ) -> None:
    """--host, --port and --shutdown-timeout, each defaulting to its variable in `environ` (argparse converts
    and checks a default given as text like a value on the command line)."""
    group.add_argument(
        "--host",
        default=environ.get(HOST_ENV, "127.0.0.1"),
        help=f"127.0.0.1 or 0.0.0.0 for every interface (default: ${HOST_ENV}, else 127.0.0.1)",
    )
    group.add_argument(
        "--port", type=port_number, default=environ.get(PORT_ENV, "8000"), help=f"(default: ${PORT_ENV}, else 8000)"
    )
    group.add_argument(
        "--shutdown-timeout",
        type=positive(float),
        default=environ.get(SHUTDOWN_TIMEOUT_ENV, "30"),
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, how long requests in flight may run on before they are aborted "
        f"(default: ${SHUTDOWN_TIMEOUT_ENV}, else 30)",
    )


def listen_settings(args: list[str], environ: Mapping[str, str]) -> argparse.Namespace:
    """host, port and shutdown_timeout of a `pagedserve serve` with these arguments and this environment; the
    other arguments are left alone."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_listen_args(parser, environ)
    return parser.parse_known_args(args)[0]


def probe_url(host: str, port: int) -> str:
    """/health on the address a server bound to `host` answers on from inside its host (or container)."""
    local = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{local}]:{port}/health" if ":" in local else f"http://{local}:{port}/health"


def serve_arguments(argv: list[str]) -> list[str] | None:
    """The arguments after `serve` in a process's argv when it runs `pagedserve serve` (the console script or
    `python -m pagedserve.server.cli`), else None."""
    for i, part in enumerate(argv[:-1]):
        if (Path(part).name == "pagedserve" or part == "pagedserve.server.cli") and argv[i + 1] == "serve":
            return argv[i + 2 :]
    return None


def server_settings(process: Path) -> tuple[list[str], dict[str, str]] | None:
    """(arguments after `serve`, environment) of the process at `process` (/proc/PID) if it runs `pagedserve
    serve`, else None (also when it is gone or another user's)."""
    try:
        args = serve_arguments(_nul_separated(process / "cmdline"))
        if args is None:
            return None
        pairs = (item.partition("=") for item in _nul_separated(process / "environ"))
        return args, {name: value for name, _, value in pairs}
    except OSError:
        return None


def running_servers(proc: Path = Path("/proc")) -> Iterator[tuple[list[str], dict[str, str]]]:
    """server_settings() of each `pagedserve serve` process this user can see, oldest (lowest pid) first: in a
    container, the server, whatever init runs above it."""
    for pid in sorted(int(entry.name) for entry in proc.iterdir() if entry.name.isdigit()):
        found = server_settings(proc / str(pid))
        if found is not None:
            yield found


def _nul_separated(path: Path) -> list[str]:
    return [part.decode(errors="replace") for part in path.read_bytes().split(b"\0") if part]


def probe(args: list[str], environ: Mapping[str, str]) -> str | None:
    """None when /health of the server with these settings answers 200, else why not."""
    try:
        settings = listen_settings(args, environ)
    except SystemExit:  # settings the server itself would have refused to start with
        return f"invalid settings: {args}"
    url = probe_url(settings.host, settings.port)
    try:
        with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_SECONDS) as response:
            return None if response.status == 200 else f"{url}: {response.status}"
    except OSError as exc:
        return f"{url}: {exc}"


def main(argv: list[str], proc: Path = Path("/proc")) -> int:
    """The HEALTHCHECK: `settings.py [PID]` exits 0 when /health of the server (process PID, else the first
    `pagedserve serve` found) answers 200, else 1 with the reason on stderr."""
    found = server_settings(proc / argv[0]) if argv else next(running_servers(proc), None)
    why = "no `pagedserve serve` process found" if found is None else probe(*found)
    if why is not None:
        print(why, file=sys.stderr)
    return 0 if why is None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
