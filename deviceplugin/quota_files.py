"""Quota directories: one per allocation, written at Allocate, linked to its pod once the kubelet says whose.

Allocate does not know the pod (the kubelet never says), so the directory is keyed by the allocation:
``<quotaHostDir>/_alloc/<hash of the sorted device IDs>/``. The kubelet hands a device ID to one live
container at a time, so two live containers never share a directory, and a repeated Allocate of the
same IDs (a late re-Allocate, a plugin restart) finds the same one. The container sees it read-only at
``/var/run/vramshare``. Once PodResources shows which pod container holds those IDs, the reconciler
links ``<quotaHostDir>/<pod-uid>/<container>`` to it (a relative symlink), which is the path the quota
loop writes (:func:`deviceplugin.quota.writer.container_dir`): the loop needs no change and no guess.
Every write goes through the one atomic writer (:func:`deviceplugin.quota.writer.write_quota`).

Because PodResources names pods and not UIDs, each Allocate also leaves a stamp (``allocated``: node
clock, nanoseconds) and the reconciler records which pod UID it attributed that very stamp to
(``owner``: "<uid> <stamp>"); a later Allocate of the same IDs makes a new stamp, which nobody owns
yet (:class:`deviceplugin.kubelet.reconcile.Allocation`). Nothing here opens anything but a regular file, or
follows a link out of the root: ``_alloc`` and its directories must be real directories, and every
UID and container name is checked by :func:`deviceplugin.quota.writer.safe_component`.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass
from typing import AbstractSet, Iterable, Sequence

from deviceplugin.allocation import GpuShare
from deviceplugin.quota import writer
from vramshare import logs
from vramshare.config import QuotaConfig

log = logs.get(__name__)

ALLOC_DIR = "_alloc"
STAMP_FILE = "allocated"  # written by Allocate: when (node clock, ns)
OWNER_FILE = "owner"  # written by the reconciler: "<pod uid> <stamp it was attributed for>"
MIG_PLAN_FILE = "mig-plan"  # written by Allocate for isolation: mig units (issue 24): "<placement ID> <MiB>"


@dataclass(frozen=True)
class Allocation:
    """What the node knows of one allocation directory (:class:`QuotaFiles`):
    ``stamp_ns``, when Allocate last wrote it (node wall clock; None unknown, e.g. an older plugin's),
    and ``owner``, the pod UID the reconciler attributed that very Allocate to ("" none yet)."""

    stamp_ns: int | None = None
    owner: str = ""
    #: isolation: mig (issue 24): the dynamic-MIG placement these memory units were served as, and its MiB
    #: (what the pod really holds: the reconciler records it, the reaper keeps its instance); "" none.
    mig_plan: str = ""
    mig_mib: int = 0


def allocation_key(device_ids: Sequence[str]) -> str:
    """Stable name of an allocation: the same IDs in any order give the same key."""
    return hashlib.sha256("\n".join(sorted(device_ids)).encode()).hexdigest()[:16]


def initial_quota(shares: Sequence[GpuShare], quota: QuotaConfig) -> writer.QuotaFile:
    """The first quota: the granted MiB per GPU; floor and ceiling are the config's fractions of it."""
    return writer.QuotaFile(gpus=tuple(
        writer.GpuQuota(uuid=s.uuid, limit_mib=s.mib, floor_mib=int(s.mib * quota.floor_fraction),
                        ceiling_mib=int(s.mib * quota.ceiling_fraction)) for s in shares))


class QuotaFiles:
    """Creates allocation directories under one host root (the config's ``quotaHostDir``) and links them."""

    def __init__(self, root: str, quota: QuotaConfig) -> None:
        self.root = root
        self.quota = quota

    def allocation_dir(self, device_ids: Sequence[str]) -> str:
        return os.path.join(self.root, ALLOC_DIR, allocation_key(device_ids))

    def container_dir(self, pod_uid: str, container: str) -> str:
        return writer.container_dir(self.root, pod_uid, container)

    def _real_dir(self, path: str, what: str) -> None:
        """``path`` is absent or a real directory (not a link, FIFO or file); else ``OSError``."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(st.st_mode):
            raise OSError(f"{what} {path} is not a directory (mode {stat.filemode(st.st_mode)}); "
                          "refusing to write through it")

    def write_initial(self, directory: str, shares: Sequence[GpuShare]) -> str:
        """Create ``directory`` and its first ``quota.json``; return the directory (the mount source).

        A repeated Allocate of the same IDs rewrites the grant (the generation still grows), so a
        directory left by an earlier holder of the same IDs never carries its old limits. ``_alloc``
        and ``directory`` must be real directories inside the root (``OSError`` otherwise: Allocate
        refuses, saying why)."""
        self._real_dir(os.path.join(self.root, ALLOC_DIR), "quota allocation root")
        self._real_dir(directory, "quota directory")
        writer.write_quota(directory, initial_quota(shares, self.quota), root=self.root)
        return directory

    def stamp(self, directory: str) -> None:
        """Record that an Allocate made ``directory`` now: a new stamp, so no earlier attribution of
        these IDs applies to this one (:meth:`allocations`)."""
        self._write_small(directory, STAMP_FILE, str(time.time_ns()))

    def record_mig_plan(self, directory: str, placement_id: str, mib: int) -> None:
        """Allocate served these memory units as the partition ``placement_id`` (``mib``): say so beside the
        stamp, so the reconciler and the reaper know it after a restart (the IDs alone name only the GPU)."""
        self._write_small(directory, MIG_PLAN_FILE, f"{placement_id} {mib}")

    @staticmethod
    def clear_mig_plan(directory: str) -> None:
        """These IDs were granted as plain units this time: an earlier partition record no longer applies."""
        try:
            os.unlink(os.path.join(directory, MIG_PLAN_FILE))
        except FileNotFoundError:
            pass

    @staticmethod
    def _write_small(directory: str, name: str, text: str) -> None:
        """Atomically replace ``<directory>/<name>`` (a link or FIFO there is replaced, never followed)."""
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
            os.chmod(tmp, 0o644)
            os.replace(tmp, os.path.join(directory, name))
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    @staticmethod
    def _read_small(directory: str, name: str) -> str | None:
        try:
            text = writer.read_regular(os.path.join(directory, name))
        except (writer.QuotaFileError, OSError):
            return None
        return None if text is None else text.strip()

    # -- who each allocation belongs to (PodResources has no UID) -------------------------------
    def allocations(self, keys: Iterable[str]) -> dict[str, Allocation]:
        """Stamp and owner of each existing allocation directory among ``keys``; an owner recorded for
        another stamp (the IDs were allocated again since) is no owner."""
        out: dict[str, Allocation] = {}
        for key in keys:
            d = os.path.join(self.root, ALLOC_DIR, key)
            if not os.path.isdir(d) or os.path.islink(d):
                continue
            stamp_text = self._read_small(d, STAMP_FILE)
            stamp = int(stamp_text) if stamp_text and stamp_text.isdigit() else None
            owner = ""
            owner_text = self._read_small(d, OWNER_FILE)
            if owner_text:
                uid, _, for_stamp = owner_text.partition(" ")
                if for_stamp == str(stamp or 0):
                    owner = uid
            plan_id, _, plan_mib = (self._read_small(d, MIG_PLAN_FILE) or "").partition(" ")
            ok = bool(plan_id) and plan_mib.isdigit()
            out[key] = Allocation(stamp, owner, plan_id if ok else "", int(plan_mib) if ok else 0)
        return out

    def attribute(self, key: str, uid: str, stamp_ns: int | None) -> None:
        """Record that the Allocate stamped ``stamp_ns`` of allocation ``key`` is pod ``uid``'s."""
        d = os.path.join(self.root, ALLOC_DIR, key)
        self._real_dir(d, "quota directory")
        self._write_small(d, OWNER_FILE, f"{writer.safe_component(uid, 'pod UID')} {stamp_ns or 0}")

    # -- links, kept by the reconciler --------------------------------------------------------
    def link(self, pod_uid: str, container: str, key: str) -> bool:
        """Point ``<root>/<uid>/<container>`` at ``_alloc/<key>``; True when it changed. A real
        directory there (written by an older plugin version) is left alone."""
        path = self.container_dir(pod_uid, container)  # UnsafePathError (a ValueError) for .., / or ""
        target = os.path.join("..", ALLOC_DIR, writer.safe_component(key, "allocation key"))
        if os.path.islink(path):
            if os.readlink(path) == target:
                return False
        elif os.path.exists(path):
            log.warning("quota directory is not a link, left alone", dir=path)
            return False
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.link-tmp"
        if os.path.lexists(tmp):
            os.unlink(tmp)
        os.symlink(target, tmp)
        os.replace(tmp, path)  # atomic: a reader sees the old link or the new one
        return True

    def prune_links(self, live: AbstractSet[tuple[str, str]]) -> int:
        """Remove links of (pod uid, container) pairs the kubelet no longer lists; returns how many."""
        removed = 0
        try:
            uids = os.listdir(self.root)
        except FileNotFoundError:
            return 0
        for uid in uids:
            pod_dir = os.path.join(self.root, uid)
            if uid in (ALLOC_DIR, "_claims") or not os.path.isdir(pod_dir) or os.path.islink(pod_dir):
                continue
            for container in os.listdir(pod_dir):
                path = os.path.join(pod_dir, container)
                if os.path.islink(path) and (uid, container) not in live:
                    os.unlink(path)
                    removed += 1
            try:
                os.rmdir(pod_dir)  # only when empty
            except OSError:
                pass
        return removed

    def link_targets(self) -> set[str]:
        """Allocation keys some ``<uid>/<container>`` link still leads to (never pruned under it)."""
        out: set[str] = set()
        for uid in _listdir(self.root):
            pod_dir = os.path.join(self.root, uid)
            if uid.startswith("_") or os.path.islink(pod_dir) or not os.path.isdir(pod_dir):
                continue
            for container in _listdir(pod_dir):
                try:
                    target = os.readlink(os.path.join(pod_dir, container))
                except OSError:
                    continue
                if os.path.dirname(target) == os.path.join("..", ALLOC_DIR):
                    out.add(os.path.basename(target))
        return out

    def prune_allocations(self, held: AbstractSet[str], min_age_s: float) -> int:
        """Remove allocation directories no container holds any more (by PodResources) and untouched for
        ``min_age_s`` (an Allocate the kubelet has not listed yet is younger); returns how many."""
        base = os.path.join(self.root, ALLOC_DIR)
        try:
            keys = os.listdir(base)
        except FileNotFoundError:
            return 0
        now, removed = time.time(), 0
        for key in keys:
            path = os.path.join(base, key)
            try:
                if key in held or now - os.stat(path).st_mtime < min_age_s:
                    continue
            except FileNotFoundError:
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
        return removed


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []
