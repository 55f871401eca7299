"""The three PATCH dialects the ``kubernetes`` client sends: merge, strategic merge and JSON patch.

Pure functions on plain dicts; they never mutate their inputs, because the store keeps every stored
object immutable (watch history holds references to old versions).
"""
from __future__ import annotations

import copy
from typing import Any

from .errors import ApiError, bad_request, unsupported_media_type

MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
APPLY = ("application/apply-patch+yaml", "application/apply-patch+json")


def is_apply(content_type: str) -> bool:
    """Server-side apply (handled by ``Store.apply``, not by :func:`apply_patch`)."""
    return content_type.split(";", 1)[0].strip().lower() in APPLY

# list fields that strategic merge merges by a key instead of replacing (a subset of the core/v1 schema)
MERGE_KEYS: dict[str, str] = {
    "containers": "name", "initContainers": "name", "ephemeralContainers": "name", "volumes": "name",
    "env": "name", "volumeMounts": "mountPath", "ports": "containerPort", "conditions": "type",
    "addresses": "type", "imagePullSecrets": "name", "containerStatuses": "name",
    "initContainerStatuses": "name", "ownerReferences": "uid",
}


def apply_patch(content_type: str, target: dict[str, Any], patch: Any) -> dict[str, Any]:
    """Apply ``patch`` of ``content_type`` to ``target``; a new object is returned."""
    media = content_type.split(";", 1)[0].strip().lower()
    if media == MERGE:
        if not isinstance(patch, dict):
            raise bad_request("a merge patch must be a JSON object")
        return merge_patch(target, patch)
    if media == STRATEGIC:
        if not isinstance(patch, dict):
            raise bad_request("a strategic merge patch must be a JSON object")
        return strategic_merge_patch(target, patch)
    if media == JSON_PATCH:
        if not isinstance(patch, list):
            raise bad_request("a JSON patch must be a JSON array of operations")
        return json_patch(target, patch)
    raise unsupported_media_type(content_type)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge recursively, ``null`` deletes a key, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(target: Any, patch: Any, field: str = "") -> Any:
    """Merge patch, plus lists named in MERGE_KEYS merge item-wise by key, plus ``$patch`` directives."""
    if isinstance(patch, list):
        return _merge_list(target, patch, field)
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    directive = patch.get("$patch")
    if directive == "delete":
        return None
    body = {k: v for k, v in patch.items() if not k.startswith("$")}
    if directive == "replace":
        return copy.deepcopy(body)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in body.items():
        if key.startswith("$setElementOrder/") or key.startswith("$deleteFromPrimitiveList/"):
            continue
        if value is None:
            result.pop(key, None)
            continue
        merged = strategic_merge_patch(result.get(key), value, key)
        if merged is None:
            result.pop(key, None)
        else:
            result[key] = merged
    return result


def _merge_list(target: Any, patch: list[Any], field: str) -> list[Any]:
    key = MERGE_KEYS.get(field)
    if key is None or not isinstance(target, list):
        return [copy.deepcopy(item) for item in patch if not (isinstance(item, dict) and "$patch" in item)]
    result = list(target)
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            result.append(copy.deepcopy(item))
            continue
        at = next((i for i, old in enumerate(result) if isinstance(old, dict) and old.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if at is not None:
                del result[at]
        elif at is None:
            result.append({k: copy.deepcopy(v) for k, v in item.items() if not k.startswith("$")})
        else:
            result[at] = strategic_merge_patch(result[at], item, field)
    return result


def json_patch(target: dict[str, Any], ops: list[Any]) -> dict[str, Any]:
    """RFC 6902 (add, remove, replace, move, copy, test); a failed op is a 422 like on a real server."""
    doc: Any = copy.deepcopy(target)
    for op in ops:
        if not isinstance(op, dict) or not isinstance(op.get("op"), str) or not isinstance(op.get("path"), str):
            raise bad_request(f"invalid JSON patch operation: {op!r}")
        kind, path = op["op"], op["path"]
        if kind == "add":
            doc = _add(doc, path, copy.deepcopy(_value(op)))
        elif kind == "remove":
            doc, _ = _remove(doc, path)
        elif kind == "replace":
            doc, _ = _remove(doc, path)
            doc = _add(doc, path, copy.deepcopy(_value(op)))
        elif kind == "move":
            doc, moved = _remove(doc, _from(op))
            doc = _add(doc, path, moved)
        elif kind == "copy":
            doc = _add(doc, path, copy.deepcopy(_get(doc, _from(op))))
        elif kind == "test":
            if _get(doc, path) != _value(op):
                raise _unprocessable(f"testing value {path} failed")
        else:
            raise bad_request(f"unknown JSON patch op {kind!r}")
    return doc


def _value(op: dict[str, Any]) -> Any:
    if "value" not in op:
        raise bad_request(f"JSON patch op {op['op']!r} needs a value")
    return op["value"]


def _from(op: dict[str, Any]) -> str:
    if "from" not in op:
        raise bad_request(f"JSON patch op {op['op']!r} needs 'from'")
    return str(op["from"])


def _unprocessable(message: str) -> ApiError:
    return ApiError(422, "Invalid", f"the server rejected our request due to an error in our request: {message}")


def _tokens(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise bad_request(f"JSON pointer {path!r} must start with '/'")
    return [t.replace("~1", "/").replace("~0", "~") for t in path[1:].split("/")]


def _parent(doc: Any, path: str) -> tuple[Any, str]:
    tokens = _tokens(path)
    if not tokens:
        raise _unprocessable("cannot address the whole document here")
    node = doc
    for token in tokens[:-1]:
        node = _child(node, token, path)
    return node, tokens[-1]


def _child(node: Any, token: str, path: str) -> Any:
    if isinstance(node, dict) and token in node:
        return node[token]
    if isinstance(node, list) and token.isdigit() and int(token) < len(node):
        return node[int(token)]
    raise _unprocessable(f"path {path} does not exist")


def _get(doc: Any, path: str) -> Any:
    node = doc
    for token in _tokens(path):
        node = _child(node, token, path)
    return node


def _add(doc: Any, path: str, value: Any) -> Any:
    if path == "":
        return value
    parent, last = _parent(doc, path)
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        if last == "-":
            parent.append(value)
        elif last.isdigit() and int(last) <= len(parent):
            parent.insert(int(last), value)
        else:
            raise _unprocessable(f"index {last} out of range in {path}")
    else:
        raise _unprocessable(f"path {path} does not exist")
    return doc


def _remove(doc: Any, path: str) -> tuple[Any, Any]:
    parent, last = _parent(doc, path)
    if isinstance(parent, dict) and last in parent:
        return doc, parent.pop(last)
    if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
        return doc, parent.pop(int(last))
    raise _unprocessable(f"path {path} does not exist")
