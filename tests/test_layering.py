"""The package layering the design promises, checked on the source, lazy imports included.

Bottom to top: the core (``vramshare``, plus the generated ``protos``) imports nothing of ours above it;
the daemons (``deviceplugin``, ``extender``, ``vllm_patches``) import the core and never each other nor
anything above them; the stand-ins and the demo composed from them (``standins``) sit above the daemons;
the ``vramshare`` command's composition (``vramshare_cli``) is on top and nothing imports it. Inside
the node agent the three programs (``deviceplugin.kubelet``, ``deviceplugin.dra``, ``deviceplugin.quota``)
share the modules at ``deviceplugin/`` level; the kubelet and DRA plugins never import each other and
the shared level imports neither. No module imports a private name (``_x``) of another, and no two
modules import each other (directly or around a loop).
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: package -> layer; a module may import only from its own layer or below (same-layer daemons: never)
LAYERS = {"vramshare": 0, "protos": 0, "deviceplugin": 1, "extender": 1, "vllm_patches": 1,
          "standins": 2, "vramshare_cli": 3}
CORE = ("vramshare", "protos")
DAEMONS = ("deviceplugin", "extender", "vllm_patches")
#: the node agent's programs, each in its own subpackage
PROGRAMS = ("deviceplugin.kubelet", "deviceplugin.dra", "deviceplugin.quota")


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for pkg in LAYERS:
        for path in (ROOT / pkg).rglob("*.py") if (ROOT / pkg).is_dir() else ():
            if "__pycache__" in path.parts:
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in MODULES.items()}


def _ours(name: str) -> str | None:
    """The module of ours ``name`` (a dotted import target) lives in, else None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(name: str) -> set[str]:
    """Our modules that ``name`` imports anywhere in its file (``from a import b`` counts ``a.b`` when
    that is a module, else ``a``), plus the ones it names for ``importlib`` (a string constant that is
    exactly the dotted name of one of our modules below a package: ``vramshare_cli.main``'s command table)."""
    out: set[str] = set()
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in MODULES else node.module)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value \
                and node.value in MODULES:
            out.add(node.value)
    return {m for m in out if m in MODULES and m != name}


GRAPH = {name: _imports(name) for name in MODULES}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _top(name: str) -> str:
    return name.split(".")[0]


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_the_layout_is_what_the_layering_names():
    """The tests below check something: the packages exist, and nothing of ours lives elsewhere."""
    assert {_top(m) for m in MODULES} == set(LAYERS)
    assert all((ROOT / p.replace(".", "/") / "__init__.py").is_file() for p in PROGRAMS)
    strays = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()
                    and p.name not in LAYERS and p.name not in ("tests", "bench"))
    assert strays == [], "a new top-level package: give it a layer in LAYERS"


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


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _top(m) in CORE))
def test_the_core_imports_nothing_above_it(module):
    """Every module of the core package: no daemon, no stand-in, no CLI (not even through importlib)."""
    assert {d for d in GRAPH[module] if _top(d) not in CORE} == set()


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _top(m) in DAEMONS))
def test_no_daemon_imports_a_stand_in_the_cli_or_another_daemon(module):
    assert {d for d in GRAPH[module] if _top(d) not in CORE and _top(d) != _top(module)} == set()


@pytest.mark.parametrize("module", sorted(m for m in MODULES if LAYERS[_top(m)] >= 2))
def test_the_top_layers_import_downwards(module):
    """The stand-ins and the demo never import the CLI's composition; nothing imports upwards."""
    assert {d for d in GRAPH[module] if LAYERS[_top(d)] > LAYERS[_top(module)]} == set()


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _within(m, "deviceplugin")))
def test_the_node_programs_share_only_the_shared_level(module):
    """The kubelet plugin and the DRA plugin never import each other; the shared modules at
    ``deviceplugin/`` level (the GPU backends and their choice, devices, node state...) and the quota loop
    import neither of them."""
    own = next((p for p in PROGRAMS if _within(module, p)), None)
    plugins = [p for p in ("deviceplugin.kubelet", "deviceplugin.dra") if p != own]
    assert {d for d in GRAPH[module] if any(_within(d, p) for p in plugins)} == set()


def _is_private(attr: str) -> bool:
    return attr.startswith("_") and not attr.startswith("__")


def private_reaches(module: str) -> set[str]:
    """Private names of another of our modules that ``module`` uses: ``from a import _x`` and
    ``a._x`` (``a`` bound by ``import a``, ``import a as b`` or ``from p import a``)."""
    out: set[str] = set()
    bound: dict[str, str] = {}
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and _ours(node.module):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if sub in MODULES:
                    bound[alias.asname or alias.name] = sub
                elif _is_private(alias.name) and node.module != module:
                    out.add(sub)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _ours(alias.name) and alias.asname:  # import a.b as x: x is a.b
                    bound[alias.asname] = alias.name
                elif _ours(alias.name):  # import a.b: a is bound, a.b reached as an attribute chain
                    bound[_top(alias.name)] = _top(alias.name)
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            chain: list[str] = []
            base: ast.AST = node.value
            while isinstance(base, ast.Attribute):
                chain.insert(0, base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                target = ".".join([bound[base.id], *chain])
                if target in MODULES and target != module:
                    out.add(f"{target}.{node.attr}")
    return out


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not _top(m) == "protos"))  # protoc writes those
def test_no_module_reaches_into_another_privately(module):
    assert private_reaches(module) == set(), "make the name public where it lives, or move it where it is used"
