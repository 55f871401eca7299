"""Nothing but the contract parses or writes the contract's formats (issue 21).

The last round's faults came from spelling a format twice (two assignment readers with different rules,
two ``GpuQuota`` models). This scan reads every module of ours outside :mod:`vramshare.contract` and fails
on any function that

* looks up one of the formats (``names.assignment``, ``names.quota_mib``, ``names.over_limit``,
  ``names.inventory``, ``names.resident_models``, ``names.config_in_force``, ``QUOTA_FILE_NAME`` or ``"quota.json"``) or names their fields (``"limitMiB"``,
  ``"floorMiB"``, ``"ceilingMiB"``, ``"usedMiB"``, ``"unitMiB"``, ``"memoryMiB"``, or ``"uuid"`` with
  ``"mib"``) **and** decodes JSON itself (``json.loads``/``json.load``/``orjson.loads``), or
* names those fields **and** encodes JSON itself (``json.dumps``/``orjson.dumps``).

Such a function must call the format's codec instead (``vramshare.contract.<format>.parse``/``encode``).
:mod:`vramshare.inventory` keeps the inventory's model and codec (behind :mod:`vramshare.contract.inventory`).
The scanner itself is tested on the shapes main had, so it cannot silently pass.
"""
from __future__ import annotations

import ast
import pathlib
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("vramshare", "deviceplugin", "extender", "vllm_patches", "dra")
ALLOWED = ("vramshare/contract/", "vramshare/inventory.py")
FORMAT_KEYS = frozenset({"assignment", "quota_mib", "over_limit", "inventory", "resident_models", "config_in_force"})
FILE_NAMES = frozenset({"QUOTA_FILE_NAME", "quota.json"})
KEY_SUFFIXES = ("/assignment", "/quota-mib", "/over-limit", "/gpu-inventory", "/resident-models")  # a key spelled out as a string
FIELDS = frozenset({"limitMiB", "floorMiB", "ceilingMiB", "usedMiB", "unitMiB", "memoryMiB"})
LOADS = frozenset({("json", "loads"), ("json", "load"), ("orjson", "loads")})
DUMPS = frozenset({("json", "dumps"), ("json", "dump"), ("orjson", "dumps")})


def _tail(node: ast.AST) -> str:
    """The last identifier of a name or attribute chain (``self.names`` -> ``names``)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _is_names(node: ast.AST) -> bool:
    """An expression that is a :class:`~vramshare.contract.Names` by the project's spelling of it."""
    tail = _tail(node)
    return "names" in tail.lower() or tail in ("n", "N")


def offenders(source: str, where: str) -> list[str]:
    """``where:function`` for every function (or the module body) of ``source`` that parses or writes a
    contract format by hand."""
    tree = ast.parse(source)
    scopes: list[tuple[str, ast.AST]] = [("<module>", tree)]
    scopes += [(n.name, n) for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    out = []
    for name, scope in scopes:
        body = scope.body if name == "<module>" else [scope]  # type: ignore[attr-defined]
        nodes = [n for stmt in body for n in ast.walk(stmt)
                 if name != "<module>" or not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        keys = any((isinstance(n, ast.Attribute) and n.attr in FORMAT_KEYS and _is_names(n.value))
                   or (isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.endswith(KEY_SUFFIXES))
                   for n in nodes)
        files = any((isinstance(n, ast.Name) and n.id in FILE_NAMES) or (isinstance(n, ast.Attribute) and n.attr in FILE_NAMES)
                    or (isinstance(n, ast.Constant) and n.value in FILE_NAMES) for n in nodes)
        strings = {n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        fields = bool(strings & FIELDS) or {"uuid", "mib"} <= strings
        calls = {(_tail(n.func.value), n.func.attr) for n in nodes
                 if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
        if ((keys or files or fields) and calls & LOADS) or (fields and calls & DUMPS):
            out.append(f"{where}:{name}")
    return out


def _ours() -> list[pathlib.Path]:
    return sorted(p for pkg in PACKAGES if (ROOT / pkg).is_dir() for p in (ROOT / pkg).rglob("*.py")
                  if not p.relative_to(ROOT).as_posix().startswith(ALLOWED))


def test_only_the_contract_parses_or_writes_its_formats():
    found = [o for p in _ours() for o in offenders(p.read_text(encoding="utf-8"), p.relative_to(ROOT).as_posix())]
    assert found == [], ("these functions parse or write a contract format themselves; call "
                         "vramshare.contract.<format>.parse/encode instead")


#: the shapes main (d7ebb75) had, one per format and side: the scanner must find each
MAINS = {
    "assignment, extender": """
        def decode_assignment(pod, names):
            text = pod["metadata"]["annotations"].get(names.assignment)
            data = orjson.loads(text)
    """,
    "assignment, node": """
        def parse_assignment(text, container):
            data = json.loads(text)
            return [(e["uuid"], e["mib"]) for e in data[container]]
    """,
    "assignment, held pick": """
        def containers_of(text):
            return {c: [(e["uuid"], int(e["mib"])) for e in entries] for c, entries in orjson.loads(text).items()}
    """,
    "assignment, quota loop": """
        def tenants_from_pods(pods, names):
            for pod in pods:
                text = pod["metadata"]["annotations"].get(names.assignment)
                containers = sorted(json.loads(text or "null") or {})
    """,
    "assignment, writer": """
        def encode_assignment(containers):
            return json.dumps({c: [{"uuid": g.uuid, "mib": g.mib} for g in gpus] for c, gpus in containers.items()})
    """,
    "quota.json, vllm": """
        def parse_quota(text):
            doc = json.loads(text)
            limit = _int_field(doc["gpus"][0], "limitMiB")
    """,
    "quota.json, by file name": """
        def read(d):
            with open(os.path.join(d, contract.QUOTA_FILE_NAME)) as fh:
                return json.load(fh)
    """,
    "quota-mib, reader": """
        def _mirrors(acct, names):
            for key, pod in acct.pods.items():
                doc = orjson.loads(pod["metadata"]["annotations"].get(names.quota_mib))
    """,
    "quota-mib, writer": """
        class Mirror:
            def mirror(self, quotas):
                return json.dumps({c: [{"uuid": u, "mib": m} for u, m in g.items()] for c, g in quotas.items()})
    """,
    "over-limit, writer": """
        def act(self, breach):
            value = json.dumps({"container": "c", "usedMiB": breach.used_mib, "limitMiB": breach.limit_mib})
    """,
    "assignment, by a spelled-out key": """
        def plans(pod):
            return json.loads(pod["metadata"]["annotations"]["vramshare.io/assignment"])
    """,
    "assignment, through an alias of the names": """
        def trust(self, pod):
            n = self.names
            return orjson.loads(pod["metadata"]["annotations"][n.assignment])
    """,
    "inventory, reader": """
        def slots(node, names):
            return json.loads(node["metadata"]["annotations"][self.names.inventory])
    """,
}


@pytest.mark.parametrize("what", sorted(MAINS))
def test_the_scan_finds_a_format_parsed_by_hand(what):
    assert offenders(textwrap.dedent(MAINS[what]), "x.py") != []


def test_the_scan_leaves_codec_callers_and_other_json_alone():
    ok = """
        def tenants(pods, names):
            for pod in pods:
                assigned = assignment.parse(pod["metadata"]["annotations"].get(names.assignment))
        def listing(resp):
            return json.loads(resp.data).get("items")
        def publish(self, inv):
            body = json.dumps({"metadata": {"annotations": {self._key: contract_inventory.encode(inv)}}})
        def held(snap):
            return json.loads(snap.inventory_text_of_something_else)
    """
    assert offenders(textwrap.dedent(ok), "x.py") == []


def test_the_contract_imports_only_itself_the_inventory_model_and_the_standard_library():
    """The contract is the core's floor: the vLLM plugin imports it without the daemons (issue 21), and
    ``vramshare.inventory`` (the model behind :mod:`vramshare.contract.inventory`) is core too."""
    import sys
    allowed_ours = ("vramshare.contract", "vramshare.inventory")
    bad = []
    for path in sorted((ROOT / "vramshare" / "contract").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
            for mod in mods:
                top = mod.split(".")[0]
                if top in PACKAGES and not mod.startswith(allowed_ours):
                    bad.append(f"{path.name}: {mod}")
                elif top not in PACKAGES and top not in sys.stdlib_module_names and top != "__future__":
                    bad.append(f"{path.name}: {mod} (not the standard library)")
    assert bad == []
