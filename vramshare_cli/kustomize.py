"""The subset of kustomize that ``deploy/`` uses, so ``vramshare install`` renders the kustomize base
itself (GitOps users keep ``kubectl apply -k``; both give the same objects, tests/deploy/test_install.py).

Supported, with kustomize's meaning (sigs.k8s.io/kustomize, api/types/kustomization.go):
``resources`` (files and directories), ``components`` (``kind: Component`` directories, applied after
the resources, before the including kustomization's own transformers), ``images`` (name, newName,
newTag, digest on containers and initContainers), ``configMapGenerator`` (files, literals; with
``disableNameSuffixHash``: kustomize's hash suffix is not reproduced), ``generatorOptions``,
``patches`` / ``patchesStrategicMerge`` (strategic merge: maps merge, lists of objects merge by
``name`` -- the merge key of containers, volumes, env and volumeMounts -- other lists are replaced,
``$patch: delete`` removes; JSON 6902 with a ``target``: add, replace, remove). Any other field is
refused by name, so a kustomization that grows a feature this file lacks fails its test instead of
rendering something else than ``kubectl kustomize``.
"""
from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

__all__ = ["KustomizeError", "build", "apply_component", "set_images", "split_image", "order"]

Obj = dict[str, Any]
_KINDS = {"Kustomization", "Component"}
_SUPPORTED = {"apiVersion", "kind", "resources", "components", "images", "configMapGenerator",
              "generatorOptions", "patches", "patchesStrategicMerge", "metadata"}


class KustomizeError(ValueError):
    """A kustomization this renderer cannot reproduce exactly, or a broken one."""


@dataclass
class _Result:
    objects: list[Obj] = field(default_factory=list)


def _load_yaml_docs(path: str) -> list[Obj]:
    try:
        with open(path, encoding="utf-8") as fh:
            return [d for d in yaml.safe_load_all(fh) if d is not None]
    except (OSError, yaml.YAMLError) as exc:
        raise KustomizeError(f"{path}: {exc}") from None


def _kustomization(directory: str) -> tuple[str, Obj]:
    for name in ("kustomization.yaml", "kustomization.yml", "Kustomization"):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            docs = _load_yaml_docs(path)
            if len(docs) != 1 or not isinstance(docs[0], dict):
                raise KustomizeError(f"{path}: expected one mapping")
            return path, docs[0]
    raise KustomizeError(f"{directory}: no kustomization.yaml")


def build(directory: str) -> list[Obj]:
    """The objects ``kubectl kustomize <directory>`` prints (in :func:`order`)."""
    return order(_build(os.path.abspath(directory), want_component=False, seen=()))


def _build(directory: str, want_component: bool, seen: tuple[str, ...],
           into: list[Obj] | None = None) -> list[Obj]:
    if directory in seen:
        raise KustomizeError(f"{directory}: kustomizations include each other ({' -> '.join(seen)})")
    path, k = _kustomization(directory)
    kind = k.get("kind", "Kustomization")
    if kind not in _KINDS:
        raise KustomizeError(f"{path}: kind {kind!r} is not Kustomization or Component")
    if (kind == "Component") != want_component:
        raise KustomizeError(f"{path}: a {kind} cannot be listed under "
                             f"{'components' if want_component else 'resources'}")
    unknown = sorted(set(k) - _SUPPORTED)
    if unknown:
        raise KustomizeError(f"{path}: {', '.join(unknown)} not supported by vramshare's renderer "
                             "(vramshare_cli/kustomize.py); extend it so install and apply -k stay equal")
    seen = seen + (directory,)
    objects: list[Obj] = [] if into is None else into  # a component transforms what it is applied to
    for entry in k.get("resources") or []:
        target = os.path.normpath(os.path.join(directory, entry))
        if os.path.isdir(target):
            objects.extend(_build(target, want_component=False, seen=seen))
        elif os.path.isfile(target):
            objects.extend(copy.deepcopy(_load_yaml_docs(target)))
        else:
            raise KustomizeError(f"{path}: resource {entry} does not exist")
    objects.extend(_generate(directory, k))
    for entry in k.get("components") or []:
        target = os.path.normpath(os.path.join(directory, entry))
        if not os.path.isdir(target):
            raise KustomizeError(f"{path}: component {entry} is not a directory")
        _build(target, want_component=True, seen=seen, into=objects)
    for patch in _patches(directory, k):
        patch(objects)
    for image in k.get("images") or []:
        _set_image(objects, image)
    _check_unique(objects, path)
    return objects


def apply_component(directory: str, objects: list[Obj]) -> None:
    """Apply the Component at ``directory`` to ``objects`` as an overlay's ``components:`` would."""
    _build(os.path.abspath(directory), want_component=True, seen=(), into=objects)


def set_images(objects: list[Obj], images: list[Obj]) -> None:
    """An overlay's ``images:`` transformer."""
    for image in images:
        _set_image(objects, image)


# -- generators ---------------------------------------------------------------------------------
def _generate(directory: str, k: Obj) -> list[Obj]:
    out = []
    defaults = k.get("generatorOptions") or {}
    for gen in k.get("configMapGenerator") or []:
        opts = {**defaults, **(gen.get("options") or {})}
        extra = sorted(set(gen) - {"name", "namespace", "files", "literals", "options", "behavior"})
        if extra or gen.get("behavior", "create") != "create":
            raise KustomizeError(f"configMapGenerator {gen.get('name')}: {extra or 'behavior'} not supported")
        if not opts.get("disableNameSuffixHash"):
            raise KustomizeError(f"configMapGenerator {gen.get('name')}: set options.disableNameSuffixHash "
                                 "(kustomize's name hash is not reproduced here)")
        data: dict[str, str] = {}
        for spec in gen.get("files") or []:
            key, _, rel = spec.partition("=") if "=" in spec else (os.path.basename(spec), "", spec)
            with open(os.path.join(directory, rel), encoding="utf-8") as fh:
                data[key] = fh.read()
        for spec in gen.get("literals") or []:
            key, _, value = spec.partition("=")
            data[key] = value
        meta: Obj = {"name": gen["name"]}
        if gen.get("namespace"):
            meta["namespace"] = gen["namespace"]
        for what in ("labels", "annotations"):
            if opts.get(what):
                meta[what] = dict(opts[what])
        out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data})
    return out


# -- patches ------------------------------------------------------------------------------------
def _patches(directory: str, k: Obj) -> list[Any]:
    out = []
    entries = list(k.get("patches") or []) + [{"path": p} for p in k.get("patchesStrategicMerge") or []]
    for entry in entries:
        if isinstance(entry, str):
            entry = {"path": entry}
        text = entry.get("patch")
        if text is None:
            with open(os.path.join(directory, entry["path"]), encoding="utf-8") as fh:
                text = fh.read()
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
        target = entry.get("target")
        for doc in docs:
            if isinstance(doc, list):
                if not target:
                    raise KustomizeError(f"{directory}: a JSON 6902 patch needs a target")
                out.append(lambda objs, ops=doc, t=target: _json6902(objs, t, ops))
            elif isinstance(doc, dict):
                out.append(lambda objs, p=doc, t=target: _smp_all(objs, t, p))
            else:
                raise KustomizeError(f"{directory}: a patch must be a mapping or a list of operations")
    return out


def _matches(obj: Obj, target: Obj) -> bool:
    meta = obj.get("metadata") or {}
    group, _, version = obj.get("apiVersion", "").rpartition("/")
    checks = {"kind": obj.get("kind"), "name": meta.get("name"), "namespace": meta.get("namespace"),
              "group": group, "version": version}
    for key, want in target.items():
        if key in checks:
            if not re.fullmatch(str(want), str(checks[key] or "")):
                return False
        elif key == "labelSelector":
            labels = meta.get("labels") or {}
            for term in str(want).split(","):
                name, _, value = term.partition("=")
                if labels.get(name.strip()) != value.strip():
                    return False
        else:
            raise KustomizeError(f"patch target {key!r} not supported")
    return True


def _smp_all(objects: list[Obj], target: Obj | None, patch: Obj) -> None:
    if target is None:
        meta = patch.get("metadata") or {}
        target = {"kind": patch.get("kind"), "name": meta.get("name")}
        if meta.get("namespace"):
            target["namespace"] = meta["namespace"]
    hits = [i for i, o in enumerate(objects) if _matches(o, target)]
    if not hits:
        raise KustomizeError(f"patch target {target} matches no object")
    for i in hits:
        if patch.get("$patch") == "delete":
            objects[i] = {}
        else:
            body = {k: v for k, v in patch.items() if k not in ("apiVersion", "kind")}
            if target is not None and "metadata" in body:  # a targeted patch does not rename what it hits
                body["metadata"] = {k: v for k, v in body["metadata"].items() if k not in ("name", "namespace")}
            objects[i] = strategic_merge(objects[i], body)
    objects[:] = [o for o in objects if o]


def strategic_merge(base: Any, patch: Any) -> Any:
    """kustomize's strategic merge for the shapes deploy/ patches (see the module docstring)."""
    if isinstance(patch, dict) and isinstance(base, dict):
        out = dict(base)
        for key, value in patch.items():
            if key.startswith("$"):
                continue
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value)
            else:
                out[key] = _strip_directives(value)
        return out
    if isinstance(patch, list) and isinstance(base, list) and _named(base) and _named(patch):
        out = list(base)
        for item in patch:
            at = next((i for i, b in enumerate(out) if b.get("name") == item.get("name")), None)
            if item.get("$patch") == "delete":
                if at is not None:
                    out.pop(at)
            elif at is None:
                out.append(_strip_directives(item))
            else:
                out[at] = strategic_merge(out[at], item)
        return out
    return _strip_directives(copy.deepcopy(patch))


def _named(items: list[Any]) -> bool:
    return all(isinstance(i, dict) and "name" in i for i in items)


def _strip_directives(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_directives(v) for k, v in value.items() if not k.startswith("$")}
    if isinstance(value, list):
        return [_strip_directives(v) for v in value]
    return value


def _json6902(objects: list[Obj], target: Obj, ops: list[Obj]) -> None:
    hits = [o for o in objects if _matches(o, target)]
    if not hits:
        raise KustomizeError(f"patch target {target} matches no object")
    for obj in hits:
        for op in ops:
            _apply_op(obj, op)


def _apply_op(obj: Obj, op: Obj) -> None:
    parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
    parent: Any = obj
    for p in parts[:-1]:
        parent = parent[int(p)] if isinstance(parent, list) else parent[p]
    last = parts[-1]
    kind = op["op"]
    if kind not in ("add", "replace", "remove"):
        raise KustomizeError(f"JSON 6902 op {kind!r} not supported")
    if isinstance(parent, list):
        index = len(parent) if last == "-" else int(last)
        if kind == "add":
            parent.insert(index, copy.deepcopy(op["value"]))
        elif kind == "replace":
            parent[index] = copy.deepcopy(op["value"])
        else:
            parent.pop(index)
    else:
        if kind == "remove" or (kind == "replace" and last not in parent):
            if last not in parent:
                raise KustomizeError(f"JSON 6902 {kind} {op['path']}: no such field")
        if kind == "remove":
            del parent[last]
        else:
            parent[last] = copy.deepcopy(op["value"])


# -- images -------------------------------------------------------------------------------------
def split_image(ref: str) -> tuple[str, str | None, str | None]:
    """``name[:tag][@digest]`` -> (name, tag, digest); a registry port is not a tag."""
    name, _, digest = ref.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    tag = None
    if colon > slash:
        name, tag = name[:colon], name[colon + 1:]
    return name, tag, digest or None


def _set_image(objects: list[Obj], image: Obj) -> None:
    for container in _containers(objects):
        name, tag, digest = split_image(container.get("image", ""))
        if name != image["name"]:
            continue
        name = image.get("newName", name)
        if image.get("digest"):
            tag, digest = None, image["digest"]
        elif image.get("newTag"):
            tag, digest = image["newTag"], None
        container["image"] = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")


def _containers(objects: list[Obj]) -> list[Obj]:
    out = []
    for obj in objects:
        spec = (obj.get("spec") or {})
        pod = ((spec.get("template") or {}).get("spec")) or (spec if obj.get("kind") == "Pod" else {})
        for key in ("initContainers", "containers"):
            out.extend(pod.get(key) or [])
    return out


# -- output -------------------------------------------------------------------------------------
def key(obj: Obj) -> tuple[str, str, str, str]:
    meta = obj.get("metadata") or {}
    return obj.get("apiVersion", ""), obj.get("kind", ""), meta.get("namespace") or "", meta.get("name", "")


def _check_unique(objects: list[Obj], where: str) -> None:
    seen: set[tuple[str, str, str, str]] = set()
    for obj in objects:
        k = key(obj)
        if k in seen:
            raise KustomizeError(f"{where}: {k[1]} {k[2]}/{k[3]} is defined twice")
        seen.add(k)


# kustomize's "legacy" order (api/resource/ordering, orderFirst / orderLast): what must exist first
# (namespaces, accounts, config) goes first, admission last so it cannot refuse the install itself.
_FIRST = ["Namespace", "ResourceQuota", "StorageClass", "CustomResourceDefinition", "ServiceAccount",
          "PodSecurityPolicy", "Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding", "ConfigMap", "Secret",
          "Endpoints", "Service", "LimitRange", "PriorityClass", "PersistentVolume", "PersistentVolumeClaim",
          "Deployment", "StatefulSet", "CronJob", "PodDisruptionBudget"]
_LAST = ["MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"]


def order(objects: list[Obj]) -> list[Obj]:
    def rank(obj: Obj) -> tuple[int, str, str, str]:
        kind = obj.get("kind", "")
        r = _FIRST.index(kind) if kind in _FIRST else (len(_FIRST) + 1 + _LAST.index(kind) if kind in _LAST
                                                        else len(_FIRST))
        meta = obj.get("metadata") or {}
        return r, f"{obj.get('apiVersion')}/{kind}", meta.get("namespace") or "", meta.get("name", "")
    return sorted(objects, key=rank)
