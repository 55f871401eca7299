"""The package layering the design promises, checked on the source: the shared core imports no daemon
and no stand-in, no daemon imports a stand-in, and no two modules import each other (directly or
around a loop), lazy imports included."""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("vramshare", "deviceplugin", "extender", "vllm_patches", "dra")
CORE = ("vramshare.contract", "vramshare.config", "vramshare.inventory", "vramshare.podspec",
        "vramshare.quantity", "vramshare.logs", "vramshare.kube")


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py") if (ROOT / pkg).is_dir() else ():
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """Our modules that ``name`` imports anywhere in its file (``from a import b`` counts ``a.b`` when
    that is a module, else ``a``)."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in MODULES else node.module)
    return {m for m in out if m in MODULES and m != name}


GRAPH = {name: _imports(name) for name in MODULES}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def test_no_import_cycles():
    # Package __init__ files that only re-export are edges of convenience, not of design.
    graph = {n: {m for m in deps if not _is_package(m)} for n, deps in GRAPH.items() if not _is_package(n)}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep] if dep in path else [node, dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert cycles == []


@pytest.mark.parametrize("module", [m for m in CORE if m in MODULES])
def test_the_shared_core_imports_no_daemon_and_no_stand_in(module):
    bad = {d for d in GRAPH[module] if not d.startswith("vramshare.") or d.startswith("standins")}
    assert bad == set()


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.split(".")[0] in ("deviceplugin", "extender", "vllm_patches", "dra")))
def test_no_daemon_imports_a_stand_in(module):
    assert {d for d in GRAPH[module] if d.startswith("standins") or d == "vramshare_cli.main"} == set()
