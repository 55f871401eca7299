"""The prepared-claims checkpoint: what Prepare made for each claim, so a restart neither loses nor doubles.

Prepare records a claim as ``preparing`` with the paths it is about to write *before* writing them,
and as ``prepared`` with its CDI names after. A plugin that dies in between finds the ``preparing``
entry on restart: the kubelet repeats Prepare (it retries claims missing from a response), which
rewrites the same deterministic paths and completes the entry; an Unprepare removes exactly the
recorded paths. A claim of dynamic-MIG partitions also records each partition (GPU, profile,
placement) before its instance is made, and keeps it until Unprepare destroyed the instance: NVML's
own view plus this record is all a restarted plugin needs to neither leak nor double an instance.
Pure values and a versioned JSON codec; the preparer does the file I/O.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

VERSION = "v1"
PREPARING = "preparing"
PREPARED = "prepared"


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read; the message names the field."""


@dataclass(frozen=True)
class PreparedDevice:
    """One device of a prepare response (the kubelet's ``Device`` message, protobuf-free)."""

    request_names: tuple[str, ...]
    pool: str
    device: str
    cdi_ids: tuple[str, ...]


@dataclass(frozen=True)
class PreparedClaim:
    uid: str
    namespace: str
    name: str
    state: str
    cdi_spec: str  # absolute path of the claim's CDI spec file
    quota_dir: str | None = None
    devices: tuple[PreparedDevice, ...] = ()
    pod_uids: tuple[str, ...] = ()  # the claim's reservedFor pods: the quota loop's tenants
    pod_names: tuple[str, ...] = ()  # same order as pod_uids
    # same order as pod_uids: how many of each pod's containers naming the claim run at once, as Prepare
    # counted them for the CDI spec's share (grant // their sum); () where it did not count (an older
    # checkpoint, a mode that fences nothing per container): the fence then knows only the listed pods'
    pod_users: tuple[int, ...] = ()
    gpus: Mapping[str, int] = field(default_factory=dict)  # visible UUID -> MiB granted
    partitions: tuple[tuple[str, str, int], ...] = ()  # dynamic MIG: (GPU UUID, profile, start) made for it


@dataclass(frozen=True)
class Checkpoint:
    claims: Mapping[str, PreparedClaim] = field(default_factory=dict)

    def with_claim(self, claim: PreparedClaim) -> "Checkpoint":
        return Checkpoint({**self.claims, claim.uid: claim})

    def without(self, uid: str) -> "Checkpoint":
        return Checkpoint({k: v for k, v in self.claims.items() if k != uid})

    def partitions(self) -> set[tuple[str, str, int]]:
        """Every MIG partition a recorded claim made (or is about to make, or still has to remove)."""
        return {p for c in self.claims.values() for p in c.partitions}

    def paths(self) -> set[str]:
        """Every file and directory the recorded claims own."""
        out = set()
        for c in self.claims.values():
            out.add(c.cdi_spec)
            if c.quota_dir:
                out.add(c.quota_dir)
        return out

    def to_json(self) -> str:
        return json.dumps({"version": VERSION, "claims": {
            uid: {"namespace": c.namespace, "name": c.name, "state": c.state, "cdiSpec": c.cdi_spec,
                  "quotaDir": c.quota_dir, "podUIDs": list(c.pod_uids), "podNames": list(c.pod_names),
                  "gpus": dict(c.gpus), **({"podUsers": list(c.pod_users)} if c.pod_users else {}),
                  **({"migPartitions": [{"gpu": g, "profile": p, "start": st} for g, p, st in c.partitions]}
                     if c.partitions else {}),
                  "devices": [{"requestNames": list(d.request_names), "pool": d.pool, "device": d.device,
                               "cdiIDs": list(d.cdi_ids)} for d in c.devices]}
            for uid, c in sorted(self.claims.items())}}, sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Checkpoint":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"checkpoint is not JSON: {exc}") from exc
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise CheckpointError(f"checkpoint.version: want {VERSION!r}")
        claims = {}
        for uid, c in (data.get("claims") or {}).items():
            try:
                claims[uid] = PreparedClaim(
                    uid=uid, namespace=c["namespace"], name=c["name"], state=c["state"], cdi_spec=c["cdiSpec"],
                    quota_dir=c.get("quotaDir"), pod_uids=tuple(c.get("podUIDs") or ()),
                    pod_names=tuple(c.get("podNames") or ()), pod_users=_pod_users(c),
                    gpus={str(k): int(v) for k, v in (c.get("gpus") or {}).items()},
                    partitions=tuple((str(p["gpu"]), str(p["profile"]), int(p["start"]))
                                     for p in c.get("migPartitions") or ()),
                    devices=tuple(PreparedDevice(tuple(d["requestNames"]), d["pool"], d["device"], tuple(d["cdiIDs"]))
                                  for d in c.get("devices") or ()))
            except (KeyError, TypeError, ValueError) as exc:
                raise CheckpointError(f"checkpoint.claims[{uid}]: {exc!r}") from exc
            if claims[uid].state not in (PREPARING, PREPARED):
                raise CheckpointError(f"checkpoint.claims[{uid}].state: {claims[uid].state!r}")
        return cls(claims)


def _pod_users(c: Mapping[str, Any]) -> tuple[int, ...]:
    """``podUsers`` (added in v1, so absent from an older checkpoint: unknown, ``()``): one count per
    ``podUIDs`` entry."""
    raw = c.get("podUsers")
    if raw is None:
        return ()
    users = tuple(int(n) for n in raw) if isinstance(raw, list) else ()
    if not isinstance(raw, list) or len(users) != len(c.get("podUIDs") or ()) or any(n < 0 for n in users):
        raise ValueError(f"podUsers {list(raw)} does not give one count per podUIDs entry")
    return users


def completed(claim: PreparedClaim, devices: tuple[PreparedDevice, ...]) -> PreparedClaim:
    return replace(claim, state=PREPARED, devices=devices)

