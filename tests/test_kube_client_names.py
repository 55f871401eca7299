"""Every name our code takes from the ``kubernetes`` client exists in the installed client.

Issue 17 item 13: kubernetes 37.x renamed the ResourceClaim model (``V1ResourceClaim`` is
``ResourceV1ResourceClaim`` there), and ``kubernetes.watch.Watch`` derives the model class from the
list call's return type, so the extender's DRA watch failed on every event and relisted once a
second, for ever. So: every ``client.<Name>`` our modules use and every API method they call must be
in the installed client, and no module deserializes watch events into model classes (watches go
raw, through ``iter_resp_lines``).
"""
from __future__ import annotations

import ast
import functools
import inspect
import pathlib
import re

import kubernetes
from kubernetes import client, watch

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("vramshare", "vramshare_cli", "standins", "deviceplugin", "extender", "vllm_patches", "bench")


@functools.lru_cache(maxsize=1)
def _sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8")
            for pkg in PACKAGES if (ROOT / pkg).is_dir() for p in (ROOT / pkg).rglob("*.py")}


def _client_attributes(text: str) -> set[str]:
    """``X`` of every ``client.X`` / ``client.models.X`` where ``client`` is ``kubernetes.client``."""
    tree = ast.parse(text)
    aliases = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "kubernetes"
               for a in n.names if a.name == "client"}
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            out.add(node.attr)
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                and node.value.attr == "models" and isinstance(node.value.value, ast.Name)
                and node.value.value.id in aliases):
            out.add(node.attr)
    return out


def test_every_client_name_we_use_is_in_the_installed_client():
    missing = {f"{path}: client.{name}" for path, text in _sources().items() if "kubernetes" in text
               for name in _client_attributes(text) if not hasattr(client, name) and name != "models"}
    assert missing == set(), f"kubernetes {kubernetes.__version__} lacks them"


def _api_calls(text: str) -> set[tuple[str, str]]:
    """``(Api class, method)`` for each call on an object made by ``client.<X>Api(...)``: directly
    (``client.CoreV1Api(api).read_node(...)``) or through the name it was assigned to."""
    tree = ast.parse(text)

    def api_class(node: ast.AST) -> str | None:
        if isinstance(node, ast.IfExp):  # client.X(api) if hasattr(client, "X") else None
            return api_class(node.body)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr.endswith("Api")
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "client"):
            return node.func.attr
        return None

    holders: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and api_class(node.value):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                holders[ast.unparse(target)] = api_class(node.value)  # type: ignore[assignment]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not node.attr.startswith("_"):
            cls = api_class(node.value) or holders.get(ast.unparse(node.value))
            if cls:
                out.add((cls, node.attr))
    return out


def test_every_api_method_we_call_is_in_the_installed_client():
    missing = {f"{path}: {cls}.{method}" for path, text in _sources().items() if "Api(" in text
               for cls, method in _api_calls(text) if not hasattr(getattr(client, cls, None), method)}
    assert missing == set(), f"kubernetes {kubernetes.__version__} lacks them"
    assert ("ResourceV1Api", "list_resource_claim_for_all_namespaces") in _api_calls(
        (ROOT / "extender" / "apicalls.py").read_text(encoding="utf-8"))  # the scan sees what the DRA watch uses


def test_no_watch_of_ours_deserializes_events_into_model_classes():
    """``Watch.stream`` resolves the item model from the list call's return type; with a renamed model
    that raises on every event. Our watches read raw lines (``iter_resp_lines``) instead."""
    offenders = sorted(path for path, text in _sources().items() if "standins" not in path
                       and re.search(r"\bwatch\.Watch\(|\bWatch\(\)\.stream", text))
    assert offenders == []


def test_the_model_rename_that_broke_the_watch_is_real_in_this_client():
    """The failure mode itself, pinned: if this client resolves the ResourceClaim watch model, the test
    above still guards the next rename."""
    resource = getattr(client, "ResourceV1Api", None)
    if resource is None:
        return  # a client before resource.k8s.io/v1: the DRA watch is off (extender.apicalls)
    try:
        watch.Watch().get_return_type(resource.list_resource_claim_for_all_namespaces)
    except AttributeError as exc:
        assert "V1ResourceClaim" in str(exc)
