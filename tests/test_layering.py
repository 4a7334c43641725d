"""The package's rooms and their one-way doors, read from the source: every import counts, those under
TYPE_CHECKING and inside functions too (a hidden import is still a dependency a reader has to follow).

ROOMS lists the rooms from the top floor down. A module may import its own room and the rooms below it,
never one above; where DOORS names a room's door, the rooms outside it enter only through that module.
No import circle may join the package's modules. TORCH_FREE names the modules of the API process (and of the
offline API's caller side): importing them imports neither torch nor transformers. docs/architecture.md draws
the same map.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "pagedserve"

# (room, the module prefixes it holds), top floor first. A module belongs to the room of its longest prefix.
ROOMS: list[tuple[str, tuple[str, ...]]] = [
    ("face", ("pagedserve",)),
    ("server", ("pagedserve.server",)),
    ("engine face", ("pagedserve.engine", "pagedserve.engine.__main__")),
    ("client", ("pagedserve.engine.client",)),
    ("core", ("pagedserve.engine.core",)),
    ("structured", ("pagedserve.engine.structured",)),
    ("speculative", ("pagedserve.engine.speculative",)),
    ("scheduling", ("pagedserve.engine.scheduling",)),
    ("worker", ("pagedserve.engine.worker",)),
    ("text", ("pagedserve.engine.text",)),
    (
        "engine base",
        (
            "pagedserve.engine.config",
            "pagedserve.engine.outputs",
            "pagedserve.engine.sampling_params",
            "pagedserve.engine.validation",
            "pagedserve.engine.openmp_policy",
            "pagedserve.engine.child_python",
        ),
    ),
    ("kernels", ("pagedserve.kernels",)),
]
# A room with a door is entered from outside only there: the worker side is one interface to the core.
DOORS: dict[str, str] = {"worker": "pagedserve.engine.worker"}
# The API process's modules (a trailing "." takes a whole package, otherwise the one module is meant). At their
# top level they import only each other and nothing of HEAVY; inside a function they may reach further (a core on
# a thread of this process, `pagedserve bench`'s tokenizer), and TYPE_CHECKING imports cost nothing.
TORCH_FREE: tuple[str, ...] = (
    *("pagedserve", "pagedserve.server.", "pagedserve.engine", "pagedserve.engine.client."),
    *("pagedserve.engine.core", "pagedserve.engine.core.messages", "pagedserve.engine.core.process"),
    *(f"pagedserve.engine.structured{name}" for name in ("", ".grammar", ".lltokenizer", ".sandbox", ".threads")),
    *(f"pagedserve.engine.structured{name}" for name in (".sandbox_child", ".grammar_source")),
    *(f"pagedserve.engine.text{name}" for name in ("", ".tokenizer", ".text_tokenizer", ".chat_template")),
    *(f"pagedserve.engine.text{name}" for name in (".chat_tokens", ".system_prompt", ".tool_template")),
    *(f"pagedserve.engine.{name}" for name in ("config", "outputs", "sampling_params", "validation")),
    *("pagedserve.engine.openmp_policy", "pagedserve.engine.child_python"),
)
HEAVY = ("torch", "transformers", "triton")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((PACKAGE, *parts))


def package_modules() -> dict[str, Path]:
    folders = [ROOT / "engine", ROOT / "server", ROOT / "kernels"]
    modules = {PACKAGE: ROOT / "__init__.py"}
    for folder in folders:
        modules.update((module_name(path), path) for path in folder.rglob("*.py"))
    return modules


def imported_names(path: Path, module: str) -> Iterator[str]:
    """Every name an import statement in `path` imports: `from a import b` gives `a.b`, which is module `a.b`
    where that exists and otherwise the name b of module `a`."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        yield from _names(node, module, path.name == "__init__.py")


def top_level_names(path: Path, module: str) -> Iterator[str]:
    """The names imported when the module is: its body's imports, those in its classes' bodies and under its
    ifs and trys included; not those inside functions, nor under `if TYPE_CHECKING:`."""
    pending = list(ast.parse(path.read_text(), str(path)).body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            pending += node.orelse
            continue
        yield from _names(node, module, path.name == "__init__.py")
        pending += [child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt)]
        if isinstance(node, ast.Try):
            pending += [statement for handler in node.handlers for statement in handler.body]


def _names(node: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
            base = ".".join([*anchor, base] if base else anchor)
        yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets: set[str] = set()
        for name in imported_names(path, module):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def room_of(module: str) -> int:
    best, length = -1, -1
    for index, (_, prefixes) in enumerate(ROOMS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > length:
                best, length = index, len(prefix)
    return best


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_every_module_has_a_room() -> None:
    assert [m for m in package_modules() if room_of(m) < 0] == []


def test_no_import_points_up_a_floor() -> None:
    graph = import_graph()
    upward = [
        f"{source} ({ROOMS[room_of(source)][0]}) -> {target} ({ROOMS[room_of(target)][0]})"
        for source, targets in sorted(graph.items())
        for target in sorted(targets)
        if room_of(target) < room_of(source)
    ]
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("room, door", sorted(DOORS.items()))
def test_rooms_with_a_door_are_entered_there(room: str, door: str) -> None:
    inside = [name for name, _ in ROOMS].index(room)
    graph = import_graph()
    around = [
        f"{source} -> {target}"
        for source, targets in sorted(graph.items())
        if room_of(source) != inside
        for target in sorted(targets)
        if room_of(target) == inside and target != door
    ]
    assert not around, "\n".join(around)


def is_torch_free(module: str) -> bool:
    return any(module in (p, p[:-1]) or (p.endswith(".") and module.startswith(p)) for p in TORCH_FREE)


def test_the_api_process_imports_no_torch() -> None:
    """Each torch-free module imports at its top level only torch-free modules (their packages included: importing
    a.b runs a's __init__) and nothing of HEAVY; so, by induction, importing any of them imports no torch."""
    modules = package_modules()
    assert [m for m in TORCH_FREE if not m.endswith(".") and m not in modules] == []  # no stale names
    breaches: set[str] = set()
    for module in sorted(m for m in modules if is_torch_free(m)):
        for name in top_level_names(modules[module], module):
            if name.split(".")[0] in HEAVY:
                breaches.add(f"{module} -> {name}")
            while name and name not in modules:
                name = name.rpartition(".")[0]
            parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)] if name else []
            breaches.update(f"{module} -> {p}" for p in parents if p in modules and not is_torch_free(p))
    assert not breaches, "\n".join(sorted(breaches))


def test_the_torch_free_check_sees_what_loads_at_import(tmp_path: Path) -> None:
    source = tmp_path / "api.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import torch\nelse:\n    import json\n"
        "try:\n    import transformers\nexcept ImportError:\n    import yaml\n"
        "class A:\n    import jinja2\n"
        "def f():\n    import torch\n"
    )
    expected = {"typing.TYPE_CHECKING", "json", "transformers", "yaml", "jinja2"}
    assert set(top_level_names(source, "pagedserve.engine.api")) == expected


def test_no_import_circles() -> None:
    found = circles(import_graph())
    assert not found, "\n".join(" <-> ".join(c) for c in found)


def test_the_checks_see_hidden_imports(tmp_path: Path) -> None:
    """Function-local and TYPE_CHECKING imports count: a circle hidden behind them is still found."""
    source = tmp_path / "hidden.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from pagedserve.engine.core import llm_engine\n"
        "def f():\n    from ..text import tokenizer\n"
    )
    names = set(imported_names(source, "pagedserve.engine.worker.hidden"))
    assert {"pagedserve.engine.core.llm_engine", "pagedserve.engine.text.tokenizer"} <= names
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
