"""``kustomize build`` for the subset deploy/ uses, so the deploy tests check what is applied (the base
plus its components' patches) without the kustomize binary: ``resources`` (files and directories),
``components``, inline JSON 6902 ``patches`` with a kind/name target, and ``images``.
tests/deploy/test_host_access.py checks that this renders what ``kubectl kustomize`` renders wherever
kubectl is installed, and this module refuses any kustomization key it does not implement.
"""
from __future__ import annotations

import copy
import pathlib
from typing import Any

import yaml

Obj = dict[str, Any]
KNOWN = {"apiVersion", "kind", "resources", "components", "patches", "images"}


def build(directory: pathlib.Path) -> list[Obj]:
    """The objects ``kubectl kustomize <directory>`` would output (order aside)."""
    return _build(directory.resolve(), component=False)


def key(obj: Obj) -> tuple[str, str, str]:
    meta = obj.get("metadata") or {}
    return obj["kind"], meta.get("namespace", ""), meta["name"]


def _build(directory: pathlib.Path, *, component: bool, into: list[Obj] | None = None) -> list[Obj]:
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text(encoding="utf-8"))
    unknown = set(kust) - KNOWN
    assert not unknown, f"{directory}/kustomization.yaml uses {sorted(unknown)}: teach tests/deploy/kustomize.py"
    assert kust["kind"] == ("Component" if component else "Kustomization"), directory
    objs: list[Obj] = into if component and into is not None else []
    for entry in kust.get("resources", []):
        path = directory / entry
        if path.is_dir():
            objs += _build(path.resolve(), component=False)
        else:
            objs += [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]
    for entry in kust.get("components", []):
        _build((directory / entry).resolve(), component=True, into=objs)
    for patch in kust.get("patches", []):
        target = patch["target"]
        hits = [o for o in objs if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]]
        assert hits, f"{directory}: patch target {target} matches nothing"
        for obj in hits:
            for op in yaml.safe_load(patch["patch"]):
                _apply(obj, op)
    for image in kust.get("images", []):
        for obj in objs:
            for pod in _pod_specs(obj):
                for c in pod.get("containers", []) + pod.get("initContainers", []):
                    name, _, tag = c["image"].partition(":")
                    if name == image["name"]:
                        c["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
    return objs


def _pod_specs(obj: Obj) -> list[Obj]:
    spec = obj.get("spec") or {}
    template = spec.get("template") or {}
    return [template["spec"]] if "spec" in template else []


def _apply(obj: Obj, op: Obj) -> None:
    """One RFC 6902 operation (add, replace, remove) at a JSON pointer."""
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
    node: Any = obj
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if op["op"] == "remove":
        del node[int(last) if isinstance(node, list) else last]
    elif op["op"] in ("add", "replace"):
        value = copy.deepcopy(op["value"])
        if isinstance(node, list):
            node.insert(len(node) if last == "-" else int(last), value) if op["op"] == "add" else \
                node.__setitem__(int(last), value)
        else:
            assert op["op"] == "add" or last in node, f"replace of a missing {op['path']}"
            node[last] = value
    else:
        raise AssertionError(f"patch op {op['op']} not implemented")
