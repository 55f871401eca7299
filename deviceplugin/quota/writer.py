"""The quota file: its document model and the one atomic writer every part of the node uses.

The container reads ``/var/run/vramshare/quota.json`` (DESIGN.md section 3), a read-only mount of
``<quotaHostDir>/<pod-uid>/<container>/``. The device plugin writes the first version at Allocate and
the quota loop rewrites it; both go through :func:`write_quota` so there is one format and one
generation counter. Why the care:

* a reader must never see a half-written file, so we write a temporary file in the same directory
  and ``os.replace`` it over the old one (atomic on POSIX). No fsync by default: it costs 5-15 ms on
  ext4, on the Allocate path, for durability nobody needs (after a host crash the pod restarts and
  the loop rewrites the file within one interval); ``durable=True`` adds it;
* the generation must only ever grow, even across daemon restarts and between the two writers, so
  the writer takes an exclusive ``flock`` on the directory, reads the generation on disk and writes
  ``max(requested, on_disk + 1)``. A reader can then ignore any file whose generation it has seen.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from vramshare import contract, logs

log = logs.get("vramshare.quota.writer")
_LOCAL_LOCK = threading.Lock()  # flock is per open file description; this keeps threads orderly too


class QuotaFileError(ValueError):
    """A quota file that could not be parsed; the message says what is wrong with it."""


@dataclass(frozen=True)
class GpuQuota:
    """One GPU's memory quota for one container, in MiB."""

    uuid: str
    limit_mib: int
    floor_mib: int
    ceiling_mib: int

    def to_json(self) -> dict[str, Any]:
        return {"uuid": self.uuid, "limitMiB": self.limit_mib,
                "floorMiB": self.floor_mib, "ceilingMiB": self.ceiling_mib}


@dataclass(frozen=True)
class QuotaFile:
    """The whole document. ``generation`` 0 means "the next one"; ``updated`` "" means "now"."""

    gpus: tuple[GpuQuota, ...] = field(default_factory=tuple)
    generation: int = 0
    updated: str = ""  # UTC, "2026-11-29T09:20:00Z", as the device plugin's first file has it
    state: str = ""  # the tenant's phase (hot / warm / waking / cold); optional, "" = not written
    enforcement: str = ""  # the node's enforcement mode (driver / mps / cooperative); optional

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"generation": self.generation, "updated": self.updated,
                               "gpus": [g.to_json() for g in self.gpus]}
        if self.state:
            doc["state"] = self.state
        if self.enforcement:
            doc["enforcement"] = self.enforcement
        return doc

    def limits(self) -> dict[str, int]:
        """``{gpu uuid: limit MiB}``, handy for comparisons and the annotation mirror."""
        return {g.uuid: g.limit_mib for g in self.gpus}


def parse_quota(text: str) -> QuotaFile:
    """Parse a quota document; raises :class:`QuotaFileError` naming the bad field."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise QuotaFileError(f"not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise QuotaFileError("top level is not an object")
    try:
        gpus = tuple(GpuQuota(uuid=str(g["uuid"]), limit_mib=int(g["limitMiB"]),
                              floor_mib=int(g["floorMiB"]), ceiling_mib=int(g["ceilingMiB"]))
                     for g in doc["gpus"])
        return QuotaFile(gpus=gpus, generation=int(doc["generation"]), updated=str(doc["updated"]),
                         state=str(doc.get("state") or ""), enforcement=str(doc.get("enforcement") or ""))
    except (KeyError, TypeError, ValueError) as exc:
        raise QuotaFileError(f"bad or missing field: {exc!r}") from exc


def quota_path(directory: str | os.PathLike[str]) -> str:
    return os.path.join(os.fspath(directory), contract.QUOTA_FILE_NAME)


class QuotaPathError(ValueError):
    """A name from another process (a pod UID, a container or claim name) that cannot be one path
    component under the quota root (``..``, ``/``, an absolute path, empty, too long)."""


#: one component: starts with a letter or digit (so never ``.``, ``..`` or hidden), then letters,
#: digits, ``.``, ``_``, ``-``; Kubernetes UIDs, DNS labels and subdomains all fit
_COMPONENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
NAME_MAX = 255  # the longest file name Linux file systems take


def path_component(value: object, what: str) -> str:
    """``value`` if it is a safe single path component, else :class:`QuotaPathError` naming ``what``.

    The one check for every name another process puts into a quota path (the kubelet's pod UIDs and
    container names, a ResourceClaim's ``reservedFor[].uid``): none may climb out of the quota root."""
    if not isinstance(value, str) or len(value) > NAME_MAX or not _COMPONENT.match(value):
        shown = repr(value)[:80]
        raise QuotaPathError(f"{what} {shown} is not a safe path component (a letter or digit, then letters, "
                             f"digits, '.', '_', '-'; at most {NAME_MAX} characters)")
    return value


def container_dir(host_root: str, pod_uid: str, container: str) -> str:
    """``<quotaHostDir>/<pod-uid>/<container>``: the directory mounted at /var/run/vramshare.
    Raises :class:`QuotaPathError` when either name is not one safe path component."""
    return os.path.join(host_root, path_component(pod_uid, "pod UID"), path_component(container, "container"))


def inside(root: str, path: str) -> bool:
    """Is ``path`` strictly below ``root``, with every directory on the way resolved (a symlinked
    parent that points elsewhere does not count as inside)? The last component is not followed,
    so a link inside the root is inside (removing it removes the link, not its target)."""
    norm = os.path.normpath(path)
    parent = os.path.realpath(os.path.dirname(norm))
    return os.path.join(parent, os.path.basename(norm)).startswith(os.path.realpath(root) + os.sep)


def read_quota(directory: str | os.PathLike[str]) -> QuotaFile | None:
    """The quota file in ``directory``; ``None`` when there is none. Raises :class:`QuotaFileError`."""
    try:
        with open(quota_path(directory), encoding="utf-8") as fh:
            return parse_quota(fh.read())
    except FileNotFoundError:
        return None


def _generation_on_disk(directory: str) -> int:
    try:
        current = read_quota(directory)
    except QuotaFileError as exc:
        # A corrupt file cannot hold us back; the new one replaces it with a fresh generation.
        log.warning("quota file unreadable, replacing it", dir=directory, error=str(exc))
        return 0
    return current.generation if current else 0


def write_quota(directory: str | os.PathLike[str], quota: QuotaFile, *, durable: bool = False) -> QuotaFile:
    """Atomically write ``quota`` as ``<directory>/quota.json`` and return what was written.

    The generation written is ``max(quota.generation, generation on disk + 1)``, so it grows by at
    least one with every write whoever writes; an empty ``updated`` becomes the current UTC time.
    The directory is created (0755) when missing; the file is 0644 so a non-root container can read
    it. Raises ``ValueError`` for a GPU entry without floor <= limit <= ceiling (the vLLM plugin
    refuses such a file, so it must never reach the disk) and ``OSError`` when the directory cannot
    be written (the caller logs and keeps its state).
    """
    for g in quota.gpus:
        if not 0 <= g.floor_mib <= g.limit_mib <= g.ceiling_mib:
            raise ValueError(f"quota for {g.uuid}: need 0 <= floor <= limit <= ceiling, "
                             f"got {g.floor_mib}/{g.limit_mib}/{g.ceiling_mib}")
    d = os.fspath(directory)
    os.makedirs(d, mode=0o755, exist_ok=True)
    with _LOCAL_LOCK:
        dir_fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX)
            generation = max(quota.generation, _generation_on_disk(d) + 1)
            final = replace(quota, generation=generation,
                            updated=quota.updated or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            data = json.dumps(final.to_json(), separators=(",", ":"), sort_keys=True).encode()
            fd, tmp = tempfile.mkstemp(prefix=".quota.", suffix=".tmp", dir=d)
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
                    if durable:
                        fh.flush()
                        os.fsync(fh.fileno())
                os.chmod(tmp, 0o644)
                os.replace(tmp, quota_path(d))
            except BaseException:
                _unlink_quietly(tmp)
                raise
            if durable:
                os.fsync(dir_fd)  # make the rename itself durable
        finally:
            os.close(dir_fd)  # also releases the flock
    return final


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
