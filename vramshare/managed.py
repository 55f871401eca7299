"""Who wrote a field: ``metadata.managedFields`` read as the API server records it.

Each entry names a field manager and the fields it owns as a FieldsV1 trie (``{"f:metadata":
{"f:annotations": {"f:<key>": {}}}}``; ``k8s.io/apimachinery/pkg/util/managedfields``). A field
written with an equal value by two managers is owned by both. Pure: no I/O, plain JSON in.

What this proves is bounded by who may write: a manager name is chosen by the client, and a client
that may update an object may also rewrite its managedFields (upstream ``decodeLiveOrNew``). The
admission policy (deploy/daemonset/admission-policies.yaml) is what ties our manager names and our
annotations to our service accounts; this check is the second wall, against every writer that does
not pretend to be us (kubectl annotate, a controller, a user's script).
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

__all__ = ["annotation_owners"]


def annotation_owners(obj: Mapping[str, Any], keys: Iterable[str]) -> dict[str, frozenset[str]]:
    """For each annotation ``key``, the managers that own it (empty: nobody, or no managedFields)."""
    wanted = {f"f:{k}": k for k in keys}
    out: dict[str, set[str]] = {k: set() for k in wanted.values()}
    entries = (obj.get("metadata") or {}).get("managedFields")
    for entry in entries if isinstance(entries, list) else ():
        if not isinstance(entry, dict):
            continue
        fields = entry.get("fieldsV1")
        meta = fields.get("f:metadata") if isinstance(fields, dict) else None
        annotations = meta.get("f:annotations") if isinstance(meta, dict) else None
        if not isinstance(annotations, dict):
            continue
        manager = entry.get("manager")
        if not isinstance(manager, str):
            continue
        for f_key, key in wanted.items():
            if f_key in annotations:
                out[key].add(manager)
    return {k: frozenset(v) for k, v in out.items()}
