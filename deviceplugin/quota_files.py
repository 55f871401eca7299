"""The per-container quota directory and its first ``quota.json``, written at Allocate.

The container sees ``<quotaHostDir>/<pod-uid>/<container>/`` read-only at ``/var/run/vramshare``; the
quota loop rewrites ``quota.json`` there later. The device plugin writes the first version so the
file exists before the container starts. Writes are atomic (temp file + rename in the same
directory): a reader never sees half a file.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from typing import Sequence

from deviceplugin.allocation import GpuShare
from vramshare import contract
from vramshare.config import QuotaConfig


def quota_document(shares: Sequence[GpuShare], quota: QuotaConfig, generation: int = 1,
                   now: float | None = None) -> dict[str, object]:
    """The DESIGN.md quota schema; floor and ceiling are fractions of the granted MiB."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if now is None else now))
    return {
        "generation": generation,
        "updated": stamp,
        "gpus": [{"uuid": s.uuid, "limitMiB": s.mib, "floorMiB": int(s.mib * quota.floor_fraction),
                  "ceilingMiB": int(s.mib * quota.ceiling_fraction)} for s in shares],
    }


def write_atomically(path: str, text: str) -> None:
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=".quota-", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


class QuotaFiles:
    """Creates quota directories under one host root (the config's ``quotaHostDir``)."""

    def __init__(self, root: str, quota: QuotaConfig) -> None:
        self.root = root
        self.quota = quota

    def container_dir(self, pod_uid: str, container: str) -> str:
        return os.path.join(self.root, pod_uid, container)

    def unmatched_dir(self, device_ids: Sequence[str]) -> str:
        """No pod identity (standalone): a directory named by the device IDs, stable for a restart."""
        digest = hashlib.sha256("\n".join(sorted(device_ids)).encode()).hexdigest()[:16]
        return os.path.join(self.root, "_unmatched", digest)

    def write_initial(self, directory: str, shares: Sequence[GpuShare]) -> str:
        """Create ``directory`` and its first ``quota.json``; return the directory (the mount source)."""
        os.makedirs(directory, mode=0o755, exist_ok=True)
        doc = quota_document(shares, self.quota)
        write_atomically(os.path.join(directory, contract.QUOTA_FILE_NAME), json.dumps(doc, indent=2) + "\n")
        return directory
