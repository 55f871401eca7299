"""The per-container quota directory and its first ``quota.json``, written at Allocate.

The container sees ``<quotaHostDir>/<pod-uid>/<container>/`` read-only at ``/var/run/vramshare``; the
quota loop rewrites ``quota.json`` there later. The device plugin writes the first version so the
file exists before the container starts, through the one atomic writer the loop uses too
(:func:`deviceplugin.quota.writer.write_quota`), so there is one format and one generation counter.
"""
from __future__ import annotations

import hashlib
import os
from typing import Sequence

from deviceplugin.allocation import GpuShare
from deviceplugin.quota import writer
from vramshare.config import QuotaConfig


def initial_quota(shares: Sequence[GpuShare], quota: QuotaConfig) -> writer.QuotaFile:
    """The first quota: the granted MiB per GPU; floor and ceiling are the config's fractions of it."""
    return writer.QuotaFile(gpus=tuple(
        writer.GpuQuota(uuid=s.uuid, limit_mib=s.mib, floor_mib=int(s.mib * quota.floor_fraction),
                        ceiling_mib=int(s.mib * quota.ceiling_fraction)) for s in shares))


class QuotaFiles:
    """Creates quota directories under one host root (the config's ``quotaHostDir``)."""

    def __init__(self, root: str, quota: QuotaConfig) -> None:
        self.root = root
        self.quota = quota

    def container_dir(self, pod_uid: str, container: str) -> str:
        return writer.container_dir(self.root, pod_uid, container)

    def unmatched_dir(self, device_ids: Sequence[str]) -> str:
        """No pod identity (standalone): a directory named by the device IDs, stable for a restart."""
        digest = hashlib.sha256("\n".join(sorted(device_ids)).encode()).hexdigest()[:16]
        return os.path.join(self.root, "_unmatched", digest)

    def write_initial(self, directory: str, shares: Sequence[GpuShare]) -> str:
        """Create ``directory`` and its first ``quota.json``; return the directory (the mount source)."""
        writer.write_quota(directory, initial_quota(shares, self.quota))
        return directory
