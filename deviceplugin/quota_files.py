"""Quota directories: one per allocation, written at Allocate, linked to its pod once the kubelet says whose.

Allocate does not know the pod (the kubelet never says), so the directory is keyed by the allocation:
``<quotaHostDir>/_alloc/<hash of the sorted device IDs>/``. The kubelet hands a device ID to one live
container at a time, so two live containers never share a directory, and a repeated Allocate of the
same IDs (a late re-Allocate, a plugin restart) finds the same one. The container sees it read-only at
``/var/run/vramshare``. Once PodResources shows which pod container holds those IDs, the reconciler
links ``<quotaHostDir>/<pod-uid>/<container>`` to it (a relative symlink), which is the path the quota
loop writes (:func:`deviceplugin.quota.writer.container_dir`): the loop needs no change and no guess.
Every write goes through the one atomic writer (:func:`deviceplugin.quota.writer.write_quota`).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import time
from typing import AbstractSet, Sequence

from deviceplugin.allocation import GpuShare
from deviceplugin.quota import writer
from vramshare import logs
from vramshare.config import QuotaConfig

log = logs.get(__name__)

ALLOC_DIR = "_alloc"


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

    def write_initial(self, directory: str, shares: Sequence[GpuShare]) -> str:
        """Create ``directory`` and its first ``quota.json``; return the directory (the mount source).

        A repeated Allocate of the same IDs rewrites the grant (the generation still grows), so a
        directory left by an earlier holder of the same IDs never carries its old limits."""
        writer.write_quota(directory, initial_quota(shares, self.quota))
        return directory

    # -- links, kept by the reconciler --------------------------------------------------------
    def link(self, pod_uid: str, container: str, key: str) -> bool:
        """Point ``<root>/<uid>/<container>`` at ``_alloc/<key>``; True when it changed. A real
        directory there (written by an older plugin version) is left alone."""
        path = self.container_dir(pod_uid, container)
        target = os.path.join("..", ALLOC_DIR, key) if os.sep not in container else None
        if target is None:
            return False
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
            if uid == ALLOC_DIR or not os.path.isdir(pod_dir) or os.path.islink(pod_dir):
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
