"""CDI specs for the MIG instances dynamic MIG makes at Allocate (``deviceListStrategy: cdi-cri``).

With cdi-cri Allocate answers ``nvidia.com/gpu=MIG-<uuid>`` and the runtime resolves it in the spec files
under the CDI roots. The node's spec (``nvidia-ctk cdi generate``, or NVIDIA's plugin's
``internal/cdi/cdi.go`` ``CreateSpecFile``) is written once, at start, for the instances that existed
then: an instance made later has no entry and its container fails at creation ("unresolvable CDI
devices"). NVIDIA's plugin never meets this (MIG changes go through mig-manager and a plugin restart);
here each made instance gets its own transient spec file in the runtime's dynamic root
(``/var/run/cdi``), written atomically (a temporary name the runtime does not read, then a rename) before
Allocate answers, and removed once the instance is gone.

The entry follows nvcdi's MIG device (``pkg/nvcdi/mig-device-edits``): the parent GPU's
``/dev/nvidia<minor>`` plus the GPU instance's and compute instance's ``nvidia-cap`` access nodes (minors
from ``/proc/driver/nvidia-caps/mig-minors``, as ``nvcaps.NewMigCaps`` reads them). The spec-level edits
(driver libraries, ``/dev/nvidiactl``, hooks) are copied from the node spec that defines the parent GPU,
because CDI applies a spec's top-level edits only when one of that spec's devices is injected.

A name some other spec already defines is left to it (two specs of one directory defining one name is a
conflict that makes it unusable: ``pkg/cdi/cache.go`` ``resolveConflict``). :meth:`MigCdi.sync` removes
every file of ours whose instance NVML no longer shows, so a crash between writing and answering, or a
reap while the plugin was down, leaves nothing a later Allocate could trip over.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Iterable, Mapping, Sequence

from deviceplugin.allocation import cdi_name
from deviceplugin.kubelet import cdi_names
from vramshare import logs

log = logs.get(__name__)

KIND = "nvidia.com/gpu"
CDI_VERSION = "0.5.0"
FILE_PREFIX = "nvidia.com-gpu_vramshare-"  # the CDI convention for transient specs: <vendor>-<class>_<id>
MIG_MINORS = "/proc/driver/nvidia-caps/mig-minors"
CAPS_DIR = "/dev/nvidia-caps"
FIX = ("mount the host's CDI root read-write at the same path into the device plugin "
       "(deploy/components/cdi-cri, or deploy/overlays/cdi-cri)")
_GPU_NODE = re.compile(r"^/dev/nvidia(\d+)$")
_DEVICE_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")  # pkg/parser ValidateDeviceName


class MigCdiError(RuntimeError):
    """The made instance cannot get a CDI entry; the message says why and what to do."""


def file_name(mig_uuid: str) -> str:
    return f"{FILE_PREFIX}{mig_uuid}.json"


def parse_mig_minors(text: str) -> dict[str, int]:
    """``gpu0/gi1/access 12`` lines -> {"gpu0/gi1/access": 12}. Pure."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1])
    return out


def instance_spec(mig_uuid: str, gpu_uuid: str, gi: int, ci: int, node_specs: Sequence[Any],
                  minors: Mapping[str, int]) -> dict[str, Any]:
    """The transient spec defining ``nvidia.com/gpu=<mig_uuid>``. Pure; :class:`MigCdiError` when no node
    spec defines the parent GPU with its ``/dev/nvidia<minor>`` (nothing to take the driver's edits from)."""
    if not _DEVICE_NAME.match(mig_uuid):  # e.g. a pre-R470 driver's MIG-GPU-<uuid>/<gi>/<ci>
        raise MigCdiError(f"MIG device {mig_uuid!r} is no valid CDI device name; use deviceListStrategy envvar")
    parent = cdi_name(gpu_uuid)
    for doc in node_specs:
        if not isinstance(doc, dict) or doc.get("kind") != KIND:
            continue
        dev = next((d for d in doc.get("devices") or [] if isinstance(d, dict) and d.get("name") == gpu_uuid), None)
        if dev is not None:
            break
    else:
        raise MigCdiError(f"no CDI spec on this node defines {parent}, the parent of made MIG device {mig_uuid}; "
                          f"{cdi_names.FIX}")
    nodes = [n for n in (dev.get("containerEdits") or {}).get("deviceNodes") or []
             if isinstance(n, dict) and _GPU_NODE.match(str(n.get("path", "")))]
    if not nodes:
        raise MigCdiError(f"{parent} has no /dev/nvidia<minor> device node in its CDI spec, so made MIG device "
                          f"{mig_uuid} would have none; {cdi_names.FIX}")
    m = _GPU_NODE.match(str(nodes[0]["path"]))
    if m is not None:  # nvcdi: the GPU instance's and compute instance's access nodes
        for key in (f"gpu{m.group(1)}/gi{gi}/access", f"gpu{m.group(1)}/gi{gi}/ci{ci}/access"):
            if key in minors:
                nodes.append({"path": f"{CAPS_DIR}/nvidia-cap{minors[key]}"})
    spec: dict[str, Any] = {"cdiVersion": CDI_VERSION, "kind": KIND,
                            "devices": [{"name": mig_uuid, "containerEdits": {"deviceNodes": nodes}}]}
    if doc.get("containerEdits"):
        spec["containerEdits"] = doc["containerEdits"]
    return spec


class MigCdi:
    """Writes and removes the transient specs in ``root`` (the runtime's dynamic CDI dir); reads every
    root to find the parent GPU's spec and names defined elsewhere."""

    def __init__(self, roots: Sequence[str], mig_minors: str = MIG_MINORS) -> None:
        if not roots:
            raise ValueError("no CDI root to write made MIG instances' specs into")
        self.roots = tuple(roots)
        self.root = self.roots[-1]  # the highest-priority root: /var/run/cdi by default
        self._mig_minors = mig_minors

    def problem(self) -> str | None:
        """Why made instances' specs cannot be written into :attr:`root` (checked at start: a plugin whose
        root is its own read-only filesystem, or not the host's directory, fails every such Allocate)."""
        probe = os.path.join(self.root, f".{FILE_PREFIX}probe-{os.getpid()}.tmp")  # not *.json: never read
        try:
            os.makedirs(self.root, exist_ok=True)
            with open(probe, "w", encoding="utf-8"):
                pass
            os.unlink(probe)
        except OSError as exc:
            return f"cannot write into {self.root}: {exc.strerror or exc}; {FIX}"
        return None

    def _others(self) -> list[Any]:
        """Every spec under the roots but ours (ours must not count as 'defined elsewhere')."""
        docs, problems = cdi_names.read_specs(self.roots, skip_prefix=FILE_PREFIX)
        for problem in problems:
            log.warning("CDI spec not readable", problem=problem)
        return docs

    def _minors(self) -> dict[str, int]:
        try:
            with open(self._mig_minors, encoding="utf-8") as fh:
                return parse_mig_minors(fh.read())
        except OSError as exc:
            log.warning("mig-minors not readable: the made instance's spec has no nvidia-cap nodes",
                        path=self._mig_minors, error=exc.strerror or str(exc))
            return {}

    def write(self, mig_uuid: str, gpu_uuid: str, gi: int, ci: int) -> str | None:
        """Make ``nvidia.com/gpu=<mig_uuid>`` resolve; the file written, or None when another spec defines it."""
        others = self._others()
        path = os.path.join(self.root, file_name(mig_uuid))
        if cdi_name(mig_uuid) in cdi_names.defined_names(others):
            _unlink(path)
            return None
        doc = instance_spec(mig_uuid, gpu_uuid, gi, ci, others, self._minors())
        tmp = f"{path}.tmp"  # not *.json: the runtime never reads a half-written spec
        try:
            os.makedirs(self.root, exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(doc, fh, indent=1)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            _unlink(tmp)
            raise MigCdiError(f"cannot write CDI spec {path} for MIG device {mig_uuid}: "
                              f"{exc.strerror or exc}; {FIX}") from None
        log.info("cdi spec written for made mig instance", mig=mig_uuid, gpu=gpu_uuid, path=path)
        return path

    def sync(self, live: Iterable[str]) -> list[str]:
        """Remove our files (and leftover temporaries) whose MIG device is not in ``live``, or that another
        spec now defines too; returns the paths removed."""
        keep = set(live)
        try:
            ours = [e for e in os.listdir(self.root) if e.startswith(FILE_PREFIX)]
        except OSError:
            return []
        defined = cdi_names.defined_names(self._others()) if ours else set()
        gone = []
        for entry in ours:
            mig_uuid = entry[len(FILE_PREFIX):].removesuffix(".tmp").removesuffix(".json")
            if entry.endswith(".json") and mig_uuid in keep and cdi_name(mig_uuid) not in defined:
                continue
            path = os.path.join(self.root, entry)
            if _unlink(path):
                gone.append(path)
                log.info("cdi spec of a gone mig instance removed", mig=mig_uuid, path=path)
        return gone


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
