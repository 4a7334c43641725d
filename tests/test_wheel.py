"""The wheel is what users install: build it, install it alone in a fresh virtualenv, serve from it.

The fresh venv sees the test venv's dependencies through a .pth line (no network, no editable install of
pagedserve: the test venv's editable finder only activates through its own .pth, which is not read there).
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.servers import free_port, wait_ready

ROOT = Path(__file__).resolve().parents[1]
STARTUP_SECONDS = 180

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(folder), str(ROOT)], check=True)
    (built,) = folder.glob("pagedserve-*.whl")
    return built


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Path:
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (purelib,) = venv.glob("lib/python*/site-packages")
    (purelib / "test-dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python")]
    subprocess.run([*pip, "install", "--no-deps", "-q", str(wheel)], check=True)
    return venv


def test_the_wheel_installs_one_import_root_with_every_kernel_source(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    roots = {name.split("/")[0] for name in names}
    assert roots == {"pagedserve", next(r for r in roots if r.endswith(".dist-info"))}
    sources = {Path(name).name for name in names if "/csrc/" in name}
    assert {path.name for path in (ROOT / "kernels" / "csrc").iterdir()} <= sources
    assert not any(name.startswith(("pagedserve/tests/", "pagedserve/benchmarks/")) for name in names)


def test_the_wheel_ships_the_web_page(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    web = ROOT / "server" / "web"
    assert {f"pagedserve/server/web/{path.name}" for path in web.iterdir()} <= names


def test_pip_show_lists_no_generic_top_level_package(fresh_venv: Path) -> None:
    python = str(fresh_venv / "bin" / "python")
    shown = subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "show", "-f", "pagedserve"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    files = [line.strip() for line in shown.split("Files:", 1)[1].splitlines() if line.strip()]
    assert files and all(f.startswith(("pagedserve/", "pagedserve-", "../../../bin/")) for f in files), files
    where = subprocess.run(
        [python, "-c", "import pagedserve; print(pagedserve.__file__)"],
        cwd=fresh_venv,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert where.startswith(str(fresh_venv)), where


def test_the_installed_server_runs_the_native_kernels(fresh_venv: Path, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    command = [str(fresh_venv / "bin" / "pagedserve"), "serve", "--port", str(port), "--log-format", "json"]
    command += ["--num-kv-blocks", "64", "--num-threads", "1"]
    # A cache of its own: the kernels compile from the wheel's sources, not from an earlier build's.
    env = {**os.environ, "PAGEDSERVE_KERNEL_CACHE_DIR": str(tmp_path / "kernels")}
    with log.open("w") as sink:
        server = subprocess.Popen(command, cwd=tmp_path, stdout=sink, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_ready(server, url, STARTUP_SECONDS), log.read_text()
        body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
    finally:
        server.terminate()
        server.wait(60)
    records = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    messages = [r.get("message", "") for r in records]
    assert not [m for m in messages if "native CPU kernels unavailable" in m], messages
    assert any(m.startswith("native CPU kernels ready") for m in messages), messages


def test_every_package_folder_is_listed_in_pyproject() -> None:
    """pyproject.toml lists the packages (the checkout's root is the package): a folder missing there works in an
    editable install and is absent from the wheel and the image."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {
        "pagedserve." + ".".join(init.parent.relative_to(ROOT).parts)
        for room in ("engine", "server", "kernels")
        for init in (ROOT / room).rglob("__init__.py")
    }
    assert folders - listed == set()
