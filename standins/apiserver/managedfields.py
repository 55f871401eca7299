"""``metadata.managedFields``: which field manager last wrote each field, as the real API server records it.

Upstream: ``k8s.io/apimachinery/pkg/util/managedfields/internal`` (``fieldmanager.go`` FieldManager.Update
and Apply, ``decodeLiveOrNew``, ``isResetManagedFields``; ``stripmeta.go`` the fields never tracked;
``managedfieldsupdater.go`` the time stamp and dropping empty entries; ``managedfields.go``
``sortEncodedManagedFields``) over ``sigs.k8s.io/structured-merge-diff`` (the ownership rules), and
``k8s.io/apiserver/pkg/endpoints/handlers`` (``managerOrUserAgent``: the ``fieldManager`` query
parameter, else the User-Agent up to its first ``/``). What the double reproduces:

* an entry per (manager, operation, subresource): ``{"manager", "operation": "Update"|"Apply",
  "apiVersion", "time", "fieldsType": "FieldsV1", "fieldsV1": {"f:metadata": {"f:annotations":
  {".": {}, "f:<key>": {}}}}, "subresource"?}``; a map field a manager created carries ``"."``;
* Update (create, PUT, merge/strategic/JSON patch): the writer takes every field it added or changed,
  every other manager loses them, a removed field leaves every set; entries left empty are dropped;
* Apply: the applier owns exactly the leaves of its configuration (no ``"."``); a field another manager owns whose
  value the apply would change is a 409 conflict unless ``force=true`` (then it moves); fields it
  applied before and no longer applies are removed unless another manager owns them;
* a write on the main resource may set ``managedFields`` itself (upstream allows it on purpose; ``[]``
  or ``[{}]`` resets them); a subresource write cannot;
* a Binding is written by the pod registry straight to storage (``setPodHostAndAnnotations``): no entry.

Simplification, said where it matters: lists are atomic here (upstream merges associative lists such
as ``containers`` by key, from the OpenAPI schema the double does not have). Annotations and labels,
the fields vramshare reads ownership of, are maps in both.
"""
from __future__ import annotations

import copy
import time
from typing import Any, Iterable

from . import errors

Obj = dict[str, Any]
Path = tuple[str, ...]
DOT = "."
# stripmeta.go: never tracked.
_STRIPPED_TOP = ("apiVersion", "kind")
_STRIPPED_META = ("name", "namespace", "creationTimestamp", "selfLink", "uid", "clusterName", "generation",
                  "managedFields", "resourceVersion")
# Maps (granular, keyed by arbitrary strings) rather than structs: a manager that creates one owns ".".
_MAPS = {("metadata", "annotations"), ("metadata", "labels"), ("spec", "nodeSelector")}


def manager_of(field_manager: str | None, user_agent: str | None) -> str:
    """handlers.managerOrUserAgent: the ``fieldManager`` parameter, else the User-Agent's product."""
    if field_manager:
        return field_manager
    agent = (user_agent or "").split("/", 1)[0]
    return agent[:128]


def fields(obj: Any, prefix: Path = ()) -> dict[Path, Any]:
    """Every tracked path of ``obj`` (maps and leaves; lists are leaves), with its value."""
    out: dict[Path, Any] = {}
    if not isinstance(obj, dict):
        return out
    for key, value in obj.items():
        if not prefix and key in _STRIPPED_TOP:
            continue
        if prefix == ("metadata",) and key in _STRIPPED_META:
            continue
        path = prefix + (key,)
        if isinstance(value, dict):
            if path in _MAPS:
                out[path + (DOT,)] = None  # the map itself
            out.update(fields(value, path))
        else:
            out[path] = value
    return out


def encode(paths: Iterable[Path]) -> Obj:
    """A set of paths as FieldsV1 (``f:<name>`` per element, ``"."`` for the map itself)."""
    root: Obj = {}
    for path in sorted(paths):
        node = root
        for element in path:
            key = DOT if element == DOT else f"f:{element}"
            node = node.setdefault(key, {})
    return root


def decode(fields_v1: Any, prefix: Path = ()) -> set[Path]:
    """FieldsV1 back to paths (the leaves of the trie, ``"."`` included)."""
    out: set[Path] = set()
    if not isinstance(fields_v1, dict):
        return out
    for key, child in fields_v1.items():
        if key == DOT:
            out.add(prefix + (DOT,))
            continue
        if not isinstance(key, str) or not key.startswith("f:"):
            continue  # k:/v:/i: elements of lists, which the double keeps atomic
        path = prefix + (key[2:],)
        below = decode(child, path)
        out.update(below or {path})
    return out


def owner(obj: Obj, path: Path) -> str | None:
    """The manager that owns ``path`` in ``obj``'s managedFields, or None."""
    for entry in (obj.get("metadata") or {}).get("managedFields") or []:
        if isinstance(entry, dict) and path in decode(entry.get("fieldsV1")):
            return entry.get("manager")
    return None


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _entries(raw: Any) -> list[Obj] | None:
    """Decoded managedFields, or None when they do not decode (upstream then uses the live ones)."""
    if not isinstance(raw, list):
        return None
    out = []
    for e in raw:
        if not isinstance(e, dict) or e.get("operation") not in ("Apply", "Update") or \
                e.get("fieldsType", "FieldsV1") != "FieldsV1" or not isinstance(e.get("manager", ""), str):
            return None
        out.append(copy.deepcopy(e))
    return out


def _is_reset(raw: Any) -> bool:
    return isinstance(raw, list) and (raw == [] or raw == [{}])


def _key(e: Obj) -> tuple[str, str, str]:
    return (e.get("manager", ""), e.get("operation", ""), e.get("subresource", ""))


def _finish(entries: list[Obj]) -> list[Obj] | None:
    """Drop empty entries and sort as ``sortEncodedManagedFields`` does (operation, time, manager...)."""
    kept = [e for e in entries if decode(e.get("fieldsV1"))]
    kept.sort(key=lambda e: (e.get("operation", ""), e.get("time", ""), e.get("manager", ""),
                             e.get("apiVersion", ""), e.get("subresource", "")))
    return kept or None


def _store(obj: Obj, entries: list[Obj] | None) -> Obj:
    meta = obj.setdefault("metadata", {})
    if entries:
        meta["managedFields"] = entries
    else:
        meta.pop("managedFields", None)
    return obj


def update(live: Obj | None, new: Obj, manager: str, api_version: str, subresource: str | None = None) -> Obj:
    """FieldManager.Update: ``new`` (the merged object) with its managedFields as the server records them."""
    new_meta = new.get("metadata") if isinstance(new.get("metadata"), dict) else {}
    raw_new = new_meta.get("managedFields")
    live_entries = _entries(((live or {}).get("metadata") or {}).get("managedFields")) or []
    if subresource:
        entries = live_entries  # decodeLiveOrNew(ignoreManagedFieldsFromRequestObject)
    elif _is_reset(raw_new):
        entries = []
    else:
        given = _entries(raw_new)
        entries = given if given else live_entries
    new_meta.pop("managedFields", None)
    before, after = fields(live or {}), fields(new)
    changed = {p for p, v in after.items() if p not in before or before[p] != v}
    removed = set(before) - set(after)
    mine_key = (manager, "Update", subresource or "")
    mine = next((e for e in entries if _key(e) == mine_key), None)
    for e in entries:
        if e is mine:
            continue
        owned = decode(e.get("fieldsV1"))
        if owned & (changed | removed):
            e["fieldsV1"] = encode(owned - changed - removed)
    owned_before = decode(mine.get("fieldsV1")) if mine else set()
    owned = (owned_before | changed) - removed
    if mine is None and owned:
        mine = {"manager": manager, "operation": "Update", "apiVersion": api_version}
        if subresource:
            mine["subresource"] = subresource
        entries.append(mine)
    if mine is not None:
        if owned != owned_before or changed & owned_before:
            mine["time"] = _now()
        mine.update(fieldsType="FieldsV1", fieldsV1=encode(owned), apiVersion=api_version)
    return _store(new, _finish(entries))


def apply(live: Obj, applied: Obj, manager: str, force: bool, api_version: str, plural: str, name: str,
          subresource: str | None = None) -> Obj:
    """FieldManager.Apply: merge ``applied`` into ``live`` and record the applier's set; 409 on conflicts."""
    entries = _entries((live.get("metadata") or {}).get("managedFields")) or []
    mine_key = (manager, "Apply", subresource or "")
    mine = next((e for e in entries if _key(e) == mine_key), None)
    # ToFieldSet of an applied configuration: its leaves (no "." for the maps it names)
    applied_fields = {p: v for p, v in fields(applied).items() if p[-1] != DOT}
    live_fields = fields(live)
    conflicts: dict[str, list[Path]] = {}
    for e in entries:
        if e is mine:
            continue
        for p in decode(e.get("fieldsV1")) & set(applied_fields):
            if p in live_fields and live_fields[p] != applied_fields[p]:
                conflicts.setdefault(e.get("manager", ""), []).append(p)
    if conflicts and not force:
        described = "; ".join(f'conflict with "{m}": .{".".join(p)}' for m, ps in sorted(conflicts.items())
                              for p in sorted(ps))
        count = sum(len(ps) for ps in conflicts.values())
        raise errors.ApiError(409, "Conflict", f"Apply failed with {count} conflict{'s' if count > 1 else ''}: "
                                               f"{described}", {"name": name, "kind": plural})
    taken = set(applied_fields)
    for e in entries:
        if e is not mine:
            owned = decode(e.get("fieldsV1"))
            if owned & taken:
                e["fieldsV1"] = encode(owned - {p for p in owned & taken
                                                 if p in live_fields and live_fields[p] != applied_fields[p]
                                                 or p not in live_fields})
    merged = _merge(live, applied)
    previously = decode(mine.get("fieldsV1")) if mine else set()
    others = set().union(*(decode(e.get("fieldsV1")) for e in entries if e is not mine)) if entries else set()
    for p in sorted(previously - taken - others, key=len, reverse=True):
        _remove(merged, p)
    if mine is None:
        mine = {"manager": manager, "operation": "Apply", "apiVersion": api_version}
        if subresource:
            mine["subresource"] = subresource
        entries.append(mine)
    if taken != previously or any(live_fields.get(p) != v for p, v in applied_fields.items()) or "time" not in mine:
        mine["time"] = _now()  # a no-op apply changes nothing, its time stamp included
    mine.update(fieldsType="FieldsV1", fieldsV1=encode(taken), apiVersion=api_version)
    return _store(merged, _finish(entries))


def _merge(live: Any, applied: Any) -> Any:
    """The applied configuration over the live object: maps merge, lists and scalars replace."""
    if not isinstance(live, dict) or not isinstance(applied, dict):
        return copy.deepcopy(applied)
    out = copy.deepcopy(live)
    for key, value in applied.items():
        out[key] = _merge(live.get(key), value)
    return out


def _remove(obj: Obj, path: Path) -> None:
    if path and path[-1] == DOT:
        return
    node: Any = obj
    for element in path[:-1]:
        node = node.get(element) if isinstance(node, dict) else None
        if node is None:
            return
    if isinstance(node, dict):
        node.pop(path[-1], None)
