"""One CDI spec per prepared claim: what the container runtime injects for the claim's devices.

Prepare returns fully qualified CDI names (``vramshare.io/gpu=<claim-uid>-<n>``); the runtime looks
them up in the spec files under the CDI root (``/var/run/cdi``) and applies the edits. The claim-wide
edits (DESIGN.md section 3: ``NVIDIA_VISIBLE_DEVICES``, ``VRAMSHARE_GPU_UUIDS``,
``VRAMSHARE_MEMORY_LIMIT_MIB``, ``VRAMSHARE_QUOTA_FILE``, the enforcement variables, the read-only
quota mount) sit in the spec's top-level ``containerEdits``, which CDI applies once whenever any
device of the spec is injected; each device carries one variable naming its share, because CDI
refuses devices without edits. The variables come from the device plugin's own
:func:`deviceplugin.allocation.container_spec`, so both paths give a container the same contract.
Pure: the spec is a dict; the preparer writes it.

The fence (``enforcement.container_fence`` of the mode the daemon pinned at start) is in the same
claim-wide edits, as Allocate adds it for the same grant: in ``driver`` mode
``NVIDIA_GPU_MEMORY_REQUEST``/``_LIMIT``, which the NVIDIA container toolkit's
``apply-cuda-memory-limits`` CDI hook reads from the final container spec (env from every CDI spec
injected, nvidia-container-toolkit PR #2075); in ``mps`` mode ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``,
``CUDA_MPS_PIPE_DIRECTORY`` and the pipe and ``/dev/shm`` bind mounts ``rw, nosuid, nodev``, the shape
of NVIDIA's DRA driver (k8s-dra-driver-gpu ``cmd/gpu-kubelet-plugin/sharing.go``,
``MpsControlDaemon.GetCDIContainerEdits``, which puts them in the claim's CDI spec too). In
``cooperative`` mode nothing is added: the spec is the one cooperative-only plugins wrote.
"""
from __future__ import annotations

import re
from typing import Any, Sequence

from deviceplugin.allocation import GpuShare, container_spec
from deviceplugin.dra.claims import ResolvedShare
from vramshare.config import Config

#: CDI spec version: env, mounts and spec-level edits need 0.3.0; 0.5.0 is what current runtimes read
CDI_VERSION = "0.5.0"
ENV_DRA_SHARE_PREFIX = "VRAMSHARE_DRA_SHARE_"
_CDI_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")

Obj = dict[str, Any]


def device_name(claim_uid: str, n: int) -> str:
    """The CDI device name of a claim's n-th result: unique per claim, stable across restarts."""
    name = f"{claim_uid}-{n}"
    if not _CDI_NAME.match(name):
        raise ValueError(f"claim UID {claim_uid!r} does not make a valid CDI device name")
    return name


def qualified(kind: str, name: str) -> str:
    """``vendor/class=name``, the form Prepare returns and the runtime resolves."""
    return f"{kind}={name}"


def spec_file_name(kind: str, claim_uid: str) -> str:
    """``vramshare.io-gpu_<claim-uid>.json``: the CDI convention for transient, per-claim specs."""
    return f"{kind.replace('/', '-')}_{claim_uid}.json"


def gpu_shares(shares: Sequence[ResolvedShare]) -> tuple[GpuShare, ...]:
    """Memory per visible UUID, in order of first appearance (two shares of one GPU add up)."""
    mib: dict[str, int] = {}
    for s in shares:
        mib[s.uuid] = mib.get(s.uuid, 0) + s.share.mib
    return tuple(GpuShare(u, m) for u, m in mib.items())


def claim_spec(claim_uid: str, shares: Sequence[ResolvedShare], config: Config,
               quota_host_dir: str | None, users: int = 1) -> tuple[Obj, tuple[str, ...]]:
    """The CDI spec of a claim and the extra CDI names the runtime also needs (``cdi-cri`` strategy).
    ``users``: how many containers naming the claim run at once; the fence holds each at its share.

    Returns ``(spec, extra_qualified_names)``; the claim's own device names are
    ``device_name(claim_uid, n)`` for n over ``shares``.
    """
    kind = config.names.cdi_kind
    spec = container_spec(gpu_shares(shares), config, quota_host_dir, claim_uid.replace("-", "")[:16], users)
    edits: Obj = {"env": [f"{k}={v}" for k, v in sorted(spec.envs.items())]}
    if spec.mounts:
        edits["mounts"] = [{"hostPath": host, "containerPath": path,
                            "options": ["ro" if ro else "rw", "nosuid", "nodev", "bind"]}
                           for path, host, ro in spec.mounts]
    devices = []
    for n, s in enumerate(shares):
        share = f"{s.share.pool}/{s.share.device}:{s.uuid}:{s.share.mib}" + (
            f":{s.share.share_id}" if s.share.share_id else "")
        devices.append({"name": device_name(claim_uid, n),
                        "containerEdits": {"env": [f"{ENV_DRA_SHARE_PREFIX}{n}={share}"]}})
    doc = {"cdiVersion": CDI_VERSION, "kind": kind, "devices": devices, "containerEdits": edits}
    return doc, tuple(spec.cdi_devices)

