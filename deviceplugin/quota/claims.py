"""Claims: memory promised on this node to containers that are not quota tenants yet (issue 19).

The extender books a pod at its request when it binds it (``allocation-state: assumed``); the device
plugin writes its first quota file at Allocate (``<quotaHostDir>/_alloc/<key>/quota.json``, the full
request) and reports the pod ``allocated`` later. In between, the container exists but the loop's
tenant listing does not show it; memory lent to co-tenants in that gap is promised twice. So every
such container counts at its request from the moment it exists: pods bound here but not allocated
(``kube.pending_from_pods``) and quota files no tenant owns (:func:`unowned_quota_files`), the two
merged so that one container seen both ways counts once (:func:`merge_claims`).
"""
from __future__ import annotations

import os
from collections import Counter
from typing import Iterable, Sequence

from deviceplugin.quota.model import Claim
from deviceplugin.quota.writer import QuotaFileError, read_quota
from deviceplugin.quota_files import ALLOC_DIR
from vramshare import logs

log = logs.get("vramshare.quota.claims")


def unowned_quota_files(root: str, tenant_dirs: Iterable[str]) -> list[Claim]:
    """Every ``_alloc/<key>/quota.json`` under ``root`` that no tenant's directory resolves to, at
    the limits it states (Allocate writes the request). A directory left by a finished pod counts
    until the device plugin prunes it: too cautious for a while, never unsound."""
    base = os.path.join(root, ALLOC_DIR)
    try:
        keys = sorted(os.listdir(base))
    except (FileNotFoundError, NotADirectoryError):
        return []
    owned = {os.path.realpath(d) for d in tenant_dirs}
    dirs = (os.path.join(base, key) for key in keys)
    return [c for d in dirs if os.path.realpath(d) not in owned and (c := file_claim(d)) is not None]


def file_claim(d: str) -> Claim | None:
    """The claim of the quota file in ``d`` at the limits it states now; None without one (or unreadable,
    logged)."""
    try:
        q = read_quota(d)
    except (QuotaFileError, OSError) as exc:
        log.warning("quota file unreadable, not counted as a claim", dir=d, error=str(exc))
        return None
    return Claim(d, tuple((g.uuid, g.limit_mib) for g in q.gpus)) if q is not None and q.gpus else None


def merge_claims(pending: Sequence[Claim], files: Sequence[Claim]) -> list[Claim]:
    """Pending pods, plus the files that match none of them: a file with the same GPUs and MiB as a
    pending pod container is that container after Allocate (the file holds the request it was
    bound with), so it counts once."""
    left = Counter(c.gpus for c in pending)
    out = list(pending)
    for f in files:
        if left[f.gpus] > 0:
            left[f.gpus] -= 1
        else:
            out.append(f)
    return out
