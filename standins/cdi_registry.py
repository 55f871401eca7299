"""A stand-in for the container runtime's CDI registry (tags.cncf.io/container-device-interface ``pkg/cdi``).

What the runtime does with the CDI names the kubelet passes: read every spec under the CDI roots
(``cache.refresh``: ``*.json``/``*.yaml``; a device defined by two specs of one root is a conflict and
neither is usable; of two roots, the later one's wins, ``resolveConflict``), validate each spec
(``specs-go``/``pkg/cdi/spec.go``: a known ``cdiVersion``, ``kind`` ``vendor/class`` with the allowed characters, device names alphanumeric plus ``_.:-``, no device
without container edits, env ``KEY=VALUE``, mounts with absolute paths), then inject: the spec's
top-level edits once per spec, each named device's edits (``InjectDevices``; an unresolvable
name fails the whole injection). Tests and the demo use it to prove the names Prepare returns
resolve and to compute a container's environment.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

import yaml

KNOWN_VERSIONS = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")
_VENDOR = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_CLASS = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_-]*[A-Za-z0-9])?$")
_DEVICE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


class CdiError(ValueError):
    """An invalid spec or an unresolvable device name; the message names the file or the name."""


def validate_spec(doc: Any, where: str) -> None:
    if not isinstance(doc, dict):
        raise CdiError(f"{where}: a CDI spec must be an object")
    if doc.get("cdiVersion") not in KNOWN_VERSIONS:
        raise CdiError(f"{where}: unknown cdiVersion {doc.get('cdiVersion')!r}")
    vendor, sep, cls = str(doc.get("kind", "")).partition("/")
    if not sep or not _VENDOR.match(vendor) or not _CLASS.match(cls):
        raise CdiError(f"{where}: invalid kind {doc.get('kind')!r} (want vendor/class)")
    devices = doc.get("devices")
    if not isinstance(devices, list) or not devices:
        raise CdiError(f"{where}: a spec needs at least one device")
    names = set()
    for d in devices:
        name = d.get("name", "")
        if not _DEVICE.match(name):
            raise CdiError(f"{where}: invalid device name {name!r}")
        if name in names:
            raise CdiError(f"{where}: device {name!r} defined twice")
        names.add(name)
        if not _edits_nonempty(d.get("containerEdits")):
            raise CdiError(f"{where}: device {name!r} has no container edits")
        _validate_edits(d["containerEdits"], f"{where}: device {name!r}")
    if doc.get("containerEdits") is not None:
        _validate_edits(doc["containerEdits"], f"{where}: spec edits")


def _edits_nonempty(edits: Any) -> bool:
    return isinstance(edits, dict) and any(edits.get(k) for k in ("env", "deviceNodes", "mounts", "hooks",
                                                                     "additionalGIDs", "intelRdt", "netDevices"))


def _validate_edits(edits: Any, where: str) -> None:
    if not isinstance(edits, dict):
        raise CdiError(f"{where}: containerEdits must be an object")
    unknown = set(edits) - {"env", "deviceNodes", "mounts", "hooks", "additionalGIDs", "intelRdt", "netDevices"}
    if unknown:
        raise CdiError(f"{where}: unknown containerEdits fields {sorted(unknown)}")
    for e in edits.get("env") or ():
        if not isinstance(e, str) or not _ENV.match(e):
            raise CdiError(f"{where}: invalid env entry {e!r}")
    for m in edits.get("mounts") or ():
        if not (isinstance(m, dict) and str(m.get("hostPath", "")).startswith("/")
                and str(m.get("containerPath", "")).startswith("/")):
            raise CdiError(f"{where}: invalid mount {m!r}")


@dataclass
class Injected:
    """What a container gets from its CDI devices."""

    env: dict[str, str] = field(default_factory=dict)
    mounts: list[dict[str, Any]] = field(default_factory=list)


class Registry:
    """The specs under some CDI roots, as the runtime's cache sees them after a refresh."""

    def __init__(self, roots: Iterable[str]) -> None:
        self.devices: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {}  # qualified -> (file, spec, dev)
        self.errors: dict[str, str] = {}
        conflicts: set[str] = set()
        prio: dict[str, int] = {}
        for priority, root in enumerate(roots):  # pkg/cdi/cache.go refresh: a later root has precedence
            if not os.path.isdir(root):
                continue
            for name in sorted(os.listdir(root)):
                if not name.endswith((".json", ".yaml")):
                    continue
                path = os.path.join(root, name)
                try:
                    with open(path, encoding="utf-8") as fh:
                        doc = json.load(fh) if name.endswith(".json") else yaml.safe_load(fh)
                    validate_spec(doc, path)
                except (OSError, ValueError, yaml.YAMLError) as exc:
                    self.errors[path] = str(exc)
                    continue
                for d in doc["devices"]:
                    qualified = f"{doc['kind']}={d['name']}"
                    if qualified in self.devices and prio[qualified] == priority:  # resolveConflict
                        conflicts.add(qualified)  # dropped at the end, whatever a later root defines
                    self.devices[qualified] = (path, doc, d)  # a later root's replaces an earlier one's
                    prio[qualified] = priority
        for q in conflicts:
            del self.devices[q]
            self.errors[q] = "device defined by more than one spec"

    def inject(self, names: Iterable[str]) -> Injected:
        """Apply the edits of ``names`` (the runtime's ``InjectDevices``); any unresolved name fails."""
        out = Injected()
        seen_specs: set[str] = set()
        for name in names:
            entry = self.devices.get(name)
            if entry is None:
                raise CdiError(f"unresolvable CDI device {name!r}" + (f": {self.errors[name]}" if name in self.errors
                                                                      else ""))
            path, spec, dev = entry
            if path not in seen_specs:
                seen_specs.add(path)
                self._apply(out, spec.get("containerEdits") or {})
            self._apply(out, dev["containerEdits"])
        return out

    @staticmethod
    def _apply(out: Injected, edits: dict[str, Any]) -> None:
        for e in edits.get("env") or ():
            key, _, value = e.partition("=")
            out.env[key] = value
        out.mounts.extend(edits.get("mounts") or ())
