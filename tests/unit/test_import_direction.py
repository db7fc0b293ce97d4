"""Imports run one way: supervisor -> worker, scanner -> child -> engine and the core modules.

Every module under cyclone/ is parsed (never imported) and each of its imports, function-local
and relative ones included, is checked against what its layer may not import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "cyclone"

# The packages above the engine; a module of the engine (cyclone/engine, cyclone/sql, the
# client side in cyclone/clients, the modules at cyclone/'s top) may import none of them.
PROCESS_SIDE = ("supervisor", "worker", "scanner", "child", "cli", "status")
FORBIDDEN = {
    "supervisor": ("cli", "status"),
    "worker": ("supervisor", "scanner", "cli", "status"),
    "scanner": ("supervisor", "worker", "cli", "status"),
    "child": ("supervisor", "worker", "scanner", "cli", "status"),
}


def layer(path: Path) -> str | None:
    """The layer a module belongs to, by where it sits; None: the top (cli, status)."""
    parts = path.relative_to(PACKAGE).parts
    if len(parts) == 1 or parts[0] in ("engine", "sql", "clients"):
        return "engine"
    if parts[0] in FORBIDDEN:
        return parts[0]
    return None


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(source: str, name: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, module) of every import in `source`; `from cyclone import x` names cyclone.x."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_package else name.split(".")[:-1]
                up = here[: len(here) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            if base == "cyclone":  # the names are subpackages: `from cyclone import worker`
                found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, base))
    return found


def violations(path: Path, source: str) -> list[str]:
    own = layer(path)
    if own is None:
        return []
    banned = PROCESS_SIDE if own == "engine" else FORBIDDEN[own]
    name = module_name(path)
    bad = []
    for line, target in imported(source, name, path.name == "__init__.py"):
        parts = target.split(".")
        if len(parts) > 1 and parts[0] == "cyclone" and parts[1] in banned:
            bad.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {own} imports {target}")
    return sorted(set(bad))


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_imports_against_the_direction() -> None:
    bad = [v for path in modules() for v in violations(path, path.read_text())]
    assert not bad, "imports against supervisor -> worker, scanner -> child -> engine:\n" + (
        "\n".join(bad)
    )


def test_every_layer_is_there_to_be_checked() -> None:
    seen = {layer(path) for path in modules()}
    assert {"engine", "supervisor", "worker", "scanner", "child"} <= seen
    # The client side is checked as the engine's layer (issue 27, item 20).
    clients = sorted((PACKAGE / "clients").glob("*.py"))
    assert len(clients) >= 5 and {layer(path) for path in clients} == {"engine"}


@pytest.mark.parametrize(
    ("where", "source"),
    [
        ("worker/loop.py", "from cyclone.supervisor import channel\n"),
        ("scanner/process.py", "from cyclone.worker.process import Wakeup\n"),
        ("worker/keeper.py", "import cyclone.scanner.base\n"),
        ("child/channel.py", "from cyclone import supervisor\n"),
        ("child/process.py", "def f():\n    from ..worker import loop\n"),
        ("engine/steps.py", "from cyclone.child.lease import lease_trust\n"),
        ("sql/__init__.py", "from .. import cli\n"),
        ("runner.py", "from cyclone.worker import Worker\n"),
        ("supervisor/arbiter.py", "from cyclone.cli.common import redact\n"),
        ("clients/client.py", "from cyclone.cli.common import Session\n"),
        ("clients/waiting.py", "def f():\n    from cyclone.supervisor import metrics\n"),
        ("clients/calls.py", "from ..worker import Worker\n"),
    ],
)
def test_an_import_against_the_direction_is_caught(where: str, source: str) -> None:
    assert len(violations(PACKAGE / where, source)) == 1


@pytest.mark.parametrize(
    ("where", "source"),
    [
        ("supervisor/supervisor.py", "from cyclone.worker import Worker\n"),
        ("worker/loop.py", "from cyclone.child import channel\nfrom cyclone import engine\n"),
        ("scanner/process.py", "from .base import Sweep\n"),
        ("child/process.py", "from cyclone.states import ErrorKind\n"),
        ("cli/reference.py", "from cyclone.supervisor.__main__ import build_parser\n"),
    ],
)
def test_an_import_along_the_direction_passes(where: str, source: str) -> None:
    assert violations(PACKAGE / where, source) == []


def engine_imports() -> dict[str, set[str]]:
    """Each module of cyclone/engine and the engine modules it imports (function-local too)."""
    graph: dict[str, set[str]] = {}
    for path in sorted((PACKAGE / "engine").glob("*.py")):
        name = module_name(path)
        found = imported(path.read_text(), name, path.name == "__init__.py")
        graph[name] = {
            target for _, target in found
            if target.startswith("cyclone.engine.") and target != name
        }  # fmt: skip
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles among `graph`'s modules (the package's own __init__ left out: it
    re-exports, and nothing below imports it)."""
    found, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            found.append([*path[path.index(node):], node])
            return
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            if nxt != "cyclone.engine":
                visit(nxt, [*path, node])
        done.add(node)

    for node in sorted(graph):
        if node != "cyclone.engine":
            visit(node, [])
    return found


def test_the_engine_modules_import_one_way() -> None:
    """Issue 27, item 19: advance.py and runs.py imported each other (runs at the top, advance
    in a function), as graphs.py and schedules.py did: no cycle, function-local imports too."""
    assert cycles(engine_imports()) == []
    assert "cyclone.engine.advance" not in engine_imports()["cyclone.engine.runs"]


def test_a_cycle_is_caught() -> None:
    graph = {"cyclone.engine.a": {"cyclone.engine.b"}, "cyclone.engine.b": {"cyclone.engine.a"}}
    assert cycles(graph) == [["cyclone.engine.a", "cyclone.engine.b", "cyclone.engine.a"]]
