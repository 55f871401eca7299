"""NodePrepareResources / NodeUnprepareResources for one claim, protobuf-free, checkpointed.

Order of a Prepare (each step survives a crash after it):

1. a claim already ``prepared`` in the checkpoint, whose CDI spec is still there, is answered from
   it (the kubelet repeats Prepare after its own restarts; no API call, no file written twice);
2. the claim is read from the API server and its UID checked (a recreated claim of the same name
   is not the one the kubelet means), as the kubeletplugin helper does before calling a driver;
3. the claim is recorded ``preparing`` with the deterministic paths it will own;
4. the quota file and the CDI spec are written (atomically, overwriting a half-done earlier try);
5. the claim is recorded ``prepared`` with its CDI names.

A claim of dynamic-MIG partitions (issue 24) records them in step 3 and, between steps 3 and 4, has
:class:`deviceplugin.mig_dynamic.DynamicMig` make each one's GPU and compute instance (serialized
per GPU, idempotent: an instance already at the placement is adopted, so a retried Prepare after a
crash at any point makes none twice); the container gets the MIG device's UUID.

Unprepare marks the entry ``preparing`` again, removes exactly the recorded paths, destroys the
recorded partitions' instances (never one with processes: the error goes back to the kubelet, which
retries), then the entry; an unknown claim is already done.
File effects go through :class:`FileEffects`, the one edge tests may replace to crash at any step.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Protocol, Sequence

from deviceplugin.allocation import GpuShare
from deviceplugin.dra import cdi
from deviceplugin.dra.checkpoint import (PREPARED, PREPARING, Checkpoint, CheckpointError, PreparedClaim,
                                         PreparedDevice, completed)
from deviceplugin.dra.claims import ClaimError, ClaimRef, device_capacity_mib, our_shares, resolve
from deviceplugin.dra.slices import DeviceRef
from deviceplugin.mig_dynamic import DynamicMig, MigError, MigPlan
from deviceplugin.quota import writer
from deviceplugin.quota_files import QuotaFiles
from vramshare import logs, podspec
from vramshare.config import Config
from vramshare.inventory import EnforcementMode

log = logs.get(__name__)

CHECKPOINT_FILE = "prepared-claims.json"
ClaimReader = Callable[[str, str], Mapping[str, Any]]  # (namespace, name) -> ResourceClaim dict
PodReader = Callable[[str, str], Mapping[str, Any]]  # (namespace, name) -> Pod dict; LookupError when unreadable
# the modes whose fence holds each container alone (a cgroup, an MPS client): a claim's is split among its users
_PER_CONTAINER_FENCES = (EnforcementMode.DRIVER, EnforcementMode.MPS)


def tenant_container(claim_name: str) -> str:
    """The quota loop's "container" of a claim tenant: the claim, as ``claim-<name>``."""
    return f"claim-{claim_name}"


class Effects(Protocol):
    """The file system, as Prepare and Unprepare use it."""

    def write_file(self, path: str, data: bytes) -> None: ...
    def remove_file(self, path: str) -> None: ...
    def write_quota(self, directory: str, shares: Sequence[GpuShare], config: Config) -> None: ...
    def remove_dir(self, path: str) -> None: ...


class FileEffects:
    """Atomic writes (temp file + rename + fsync of the directory), idempotent removals."""

    def write_file(self, path: str, data: bytes) -> None:
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def remove_file(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def write_quota(self, directory: str, shares: Sequence[GpuShare], config: Config) -> None:
        QuotaFiles(config.quota_host_dir, config.quota).write_initial(directory, shares)

    def remove_dir(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)


@dataclass(frozen=True)
class PrepareResult:
    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


class ClaimPreparer:
    """Prepares and unprepares claims of one node; thread-safe (the kubelet may call concurrently)."""

    def __init__(self, node: str, config: Callable[[], Config], devices: Callable[[], Mapping[str, DeviceRef]],
                 read_claim: ClaimReader, effects: Effects | None = None, mig: DynamicMig | None = None,
                 read_pod: PodReader | None = None) -> None:
        self.node = node
        self._read_pod = read_pod  # the claim's pods, read where the fence is per container
        self.mig = mig  # makes and destroys dynamic-MIG partitions; None where NVML cannot
        self._config = config
        self._devices = devices
        self._read_claim = read_claim
        # issue 23 item 5: per (namespace, tenant container, GPU uuid), what a sleeping claim of an
        # overcommit class is booked at (the warm broker's view, set where the warm tier runs): the room
        # check counts it at that, as the scheduler's books did when it placed a claim on its credit
        self.sleeping: Callable[[], Mapping[tuple[str, str, str], int]] = dict
        self.on_unprepared: Callable[[], None] | None = None  # told after a claim's record is gone
        self.effects = effects or FileEffects()
        self._lock = threading.Lock()
        self.checkpoint_path = os.path.join(config().dra.state_dir, CHECKPOINT_FILE)
        self.checkpoint = self._load()

    def _load(self) -> Checkpoint:
        try:
            with open(self.checkpoint_path, encoding="utf-8") as fh:
                cp = Checkpoint.from_json(fh.read())
        except FileNotFoundError:
            return Checkpoint()
        except (OSError, CheckpointError) as exc:
            # Refuse to start on an unreadable checkpoint: guessing would lose or double claims.
            raise CheckpointError(f"cannot read {self.checkpoint_path}: {exc}") from exc
        unfinished = sorted(uid for uid, c in cp.claims.items() if c.state == PREPARING)
        log.info("checkpoint loaded", claims=len(cp.claims), unfinished=",".join(unfinished))
        return cp

    def _save(self, cp: Checkpoint) -> None:
        self.effects.write_file(self.checkpoint_path, cp.to_json().encode())
        self.checkpoint = cp

    def paths_for(self, uid: str, config: Config, name: str = "", pods: Sequence[str] = ()) -> tuple[str, str]:
        """The CDI spec file and quota directory a claim owns, fixed by the claim, so a retry overwrites.

        A claim of one pod gets the quota loop's layout, ``<quotaHostDir>/<pod-uid>/claim-<name>``
        (the tenant "container" is the claim), so the loop rewrites the very file the container
        mounts; a claim shared by several pods keeps ``<quotaHostDir>/_claims/<claim-uid>``."""
        spec = os.path.join(config.dra.cdi_root, cdi.spec_file_name(config.names.cdi_kind, uid))
        if len(pods) == 1 and pods[0] and name:
            return spec, writer.container_dir(config.quota_host_dir, pods[0], tenant_container(name))
        return spec, os.path.join(config.quota_host_dir, "_claims", uid)

    # -- Prepare ----------------------------------------------------------------------------------
    def prepare(self, ref: ClaimRef) -> PrepareResult:
        with self._lock:
            done = self.checkpoint.claims.get(ref.uid)
            if done is not None and done.state == PREPARED and (not done.devices or os.path.exists(done.cdi_spec)):
                return PrepareResult(done.devices)
            # else: not prepared, half prepared, or prepared before a reboot emptied /var/run/cdi (a
            # tmpfs) while the checkpoint survived: (re)build it
            try:
                return PrepareResult(self._prepare(ref))
            except ClaimError as exc:
                log.warning("claim not prepared", claim=f"{ref.namespace}/{ref.name}", uid=ref.uid, error=str(exc))
                return PrepareResult(error=str(exc))

    def _prepare(self, ref: ClaimRef) -> tuple[PreparedDevice, ...]:
        where = f"claim {ref.namespace}/{ref.name}"
        try:
            claim = self._read_claim(ref.namespace, ref.name)
        except LookupError as exc:
            raise ClaimError(f"{where}: cannot read it from the API server: {exc}") from exc
        uid = (claim.get("metadata") or {}).get("uid")
        if uid != ref.uid:
            raise ClaimError(f"{where}: UID is {uid}, the kubelet asked for {ref.uid} (claim was recreated)")
        config = self._config()
        known = self._devices()
        shares = resolve(our_shares(claim, config.names.dra_driver, self.node), known, where, config.memory_unit_mib)
        reserved = [r for r in (claim.get("status") or {}).get("reservedFor") or () if r.get("resource") == "pods"]
        pods = tuple(r.get("uid", "") for r in reserved)
        try:  # every name that becomes a path component comes from another process: one component each
            writer.safe_component(ref.uid, f"{where}: claim UID")
            writer.safe_component(tenant_container(ref.name), f"{where}: claim name")
            for uid in pods:
                writer.safe_component(uid, f"{where}: status.reservedFor[].uid")
            spec_path, quota_dir = self.paths_for(ref.uid, config, ref.name, pods)
        except writer.UnsafePathError as exc:
            raise ClaimError(str(exc)) from None
        per_pod = self._users(ref, reserved, config, where) if shares else ()
        users = max(1, sum(per_pod))
        plans = self._plans(ref.uid, shares, known, where)
        gpu = cdi.gpu_shares([s for s in shares if known[s.share.device].partition is None])
        self._check_room(ref.uid, gpu, known, config.memory_unit_mib, where)
        record = PreparedClaim(uid=ref.uid, namespace=ref.namespace, name=ref.name, state=PREPARING,
                               cdi_spec=spec_path, quota_dir=quota_dir if shares else None, pod_uids=pods,
                               pod_names=tuple(r.get("name", "") for r in reserved), pod_users=per_pod,
                               gpus={g.uuid: g.mib for g in gpu},
                               partitions=tuple((p.gpu_uuid, p.profile, p.start) for p in plans.values()))
        self._save(self.checkpoint.with_claim(record))
        if plans:
            shares = self._make(shares, plans, where)
            gpu = cdi.gpu_shares(shares)
            record = replace(record, gpus={g.uuid: g.mib for g in gpu})
        devices: list[PreparedDevice] = []
        if shares:
            self.effects.write_quota(quota_dir, gpu, config)
            doc, extra = cdi.claim_spec(ref.uid, shares, config, quota_dir, users)
            self.effects.write_file(spec_path, json.dumps(doc, indent=1, sort_keys=True).encode())
            kind = config.names.cdi_kind
            for n, s in enumerate(shares):
                ids = (cdi.qualified(kind, cdi.device_name(ref.uid, n)),) + extra
                devices.append(PreparedDevice((s.share.request,), s.share.pool, s.share.device, ids))
        self._save(self.checkpoint.with_claim(completed(record, tuple(devices))))
        log.info("claim prepared", claim=f"{ref.namespace}/{ref.name}", uid=ref.uid,
                 gpus=",".join(f"{u}:{m}MiB" for u, m in record.gpus.items()), pods=",".join(pods))
        return tuple(devices)

    def _users(self, ref: ClaimRef, reserved: Sequence[Mapping[str, Any]], config: Config,
               where: str) -> tuple[int, ...]:
        """Per pod it is reserved for, how many containers naming the claim run at once
        (:func:`vramshare.podspec.claim_users`): the CDI spec is injected into each, and in driver and MPS
        modes each is fenced alone, so each is fenced at its share of their sum. Recorded per pod: the
        driver fence keeps that share for each container of a pod the pod cache does not show (yet), which
        only the checkpoint says. Other modes fence nothing per container: no read, ``()``. A pod that
        cannot be read refuses the Prepare (the kubelet retries), as an unreadable claim does: fencing each
        at the whole grant could let them hold a multiple of it."""
        if config.enforcement.resolved not in _PER_CONTAINER_FENCES or self._read_pod is None:
            return ()
        n: list[int] = []
        for r in reserved:
            name, uid = str(r.get("name") or ""), r.get("uid")
            try:
                pod = self._read_pod(ref.namespace, name)
            except LookupError as exc:
                raise ClaimError(f"{where}: cannot read its pod {ref.namespace}/{name} to count the containers "
                                 f"naming it: {exc}") from exc
            if (pod.get("metadata") or {}).get("uid") != uid:
                raise ClaimError(f"{where}: pod {ref.namespace}/{name} is not the one it is reserved for "
                                 f"(UID {uid}): recreated")
            n.append(podspec.claim_users(pod, ref.name))
        return tuple(n)

    def _plans(self, uid: str, shares: Sequence[Any], known: Mapping[str, DeviceRef],
               where: str) -> dict[int, MigPlan]:
        """The partitions among a claim's results (by result index); refused when this node cannot make
        them or another prepared claim holds one (the allocator's counters forbid it; a stale or
        forged allocation must not share an instance)."""
        plans = {}
        for n, s in enumerate(shares):
            part = known[s.share.device].partition
            if part is not None:
                plans[n] = MigPlan(known[s.share.device].gpu.uuid, part.profile.name, part.start)
        if plans and self.mig is None:
            raise ClaimError(f"{where}: device {shares[next(iter(plans))].share.device} is a dynamic-MIG partition "
                             "and this node cannot make MIG instances (no NVML)")
        held = {p for other, c in self.checkpoint.claims.items() if other != uid for p in c.partitions}
        for n, plan in plans.items():
            if (plan.gpu_uuid, plan.profile, plan.start) in held:
                raise ClaimError(f"{where}: partition {shares[n].share.device} is already prepared for another claim")
        return plans

    def _make(self, shares: Sequence[Any], plans: Mapping[int, MigPlan], where: str) -> tuple[Any, ...]:
        """Each partition's instance, made or adopted; the shares then name the MIG devices."""
        assert self.mig is not None
        out = list(shares)
        for n, plan in plans.items():
            try:
                made = self.mig.ensure(plan)
            except MigError as exc:
                raise ClaimError(f"{where}: {exc}") from exc
            out[n] = replace(out[n], uuid=made.mig_uuid)
            log.info("mig partition ready", claim=where, gpu=plan.gpu_uuid, profile=plan.profile, start=plan.start,
                     mig=made.mig_uuid, adopted=made.adopted)
        return tuple(out)

    def _check_room(self, uid: str, gpu: Sequence[GpuShare], known: Mapping[str, DeviceRef], unit_mib: int,
                    where: str) -> None:
        """Refuse a claim that would take a GPU past its memory together with the claims already
        prepared here (the allocation comes from another process; the quota files must stay honest).
        A sleeping claim of an overcommit class counts at what it is booked at (:attr:`sleeping`): the
        scheduler placed this claim on the sleep credit the slice offered, and it stays preparable
        after a sleeper woke, while the awake and the booked fit (the wake reserve's promise)."""
        capacity = {r.uuid: device_capacity_mib(r, unit_mib) for r in known.values()}
        booked = self.sleeping()
        held: dict[str, int] = {}
        for other, c in self.checkpoint.claims.items():
            if other != uid:
                container = tenant_container(c.name)
                for u, m in c.gpus.items():
                    held[u] = held.get(u, 0) + min(m, booked.get((c.namespace, container, u), m))
        for g in gpu:
            if g.uuid in capacity and held.get(g.uuid, 0) + g.mib > capacity[g.uuid]:
                raise ClaimError(f"{where}: {g.mib} MiB on GPU {g.uuid} with {held.get(g.uuid, 0)} MiB already "
                                 f"prepared for other claims is more than its {capacity[g.uuid]} MiB")

    # -- Unprepare --------------------------------------------------------------------------------
    def unprepare(self, ref: ClaimRef) -> str:
        """Remove what Prepare made; ``""`` on success (also for a claim never prepared here)."""
        with self._lock:
            record = self.checkpoint.claims.get(ref.uid)
            if record is None:
                return ""
            if record.state == PREPARED:
                # back to "preparing" first: should we die while removing, a repeated Prepare redoes
                # the files instead of answering from an entry whose files are gone
                self._save(self.checkpoint.with_claim(replace(record, state=PREPARING)))
            config = self._config()
            # the checkpoint is a file on the host: remove only what lies inside our own roots
            if writer.inside(config.dra.cdi_root, record.cdi_spec, follow_last=False):
                self.effects.remove_file(record.cdi_spec)
            else:
                log.error("not removing a CDI spec outside the CDI root", claim=f"{ref.namespace}/{ref.name}",
                          uid=ref.uid, path=record.cdi_spec)
            if record.quota_dir and writer.inside(config.quota_host_dir, record.quota_dir, follow_last=False):
                self.effects.remove_dir(record.quota_dir)
            elif record.quota_dir:
                log.error("not removing a quota directory outside the quota root",
                          claim=f"{ref.namespace}/{ref.name}", uid=ref.uid, path=record.quota_dir)
            for gpu_uuid, profile, start in record.partitions:
                if self.mig is None:
                    return (f"claim {ref.namespace}/{ref.name}: its MIG partitions cannot be removed: this node "
                            "cannot reach NVML")
                try:
                    self.mig.release(MigPlan(gpu_uuid, profile, start))
                except MigError as exc:  # the record stays: the kubelet retries Unprepare
                    log.warning("claim not unprepared", claim=f"{ref.namespace}/{ref.name}", uid=ref.uid,
                                error=str(exc))
                    return f"claim {ref.namespace}/{ref.name}: {exc}"
            self._save(self.checkpoint.without(ref.uid))
            log.info("claim unprepared", claim=f"{ref.namespace}/{ref.name}", uid=ref.uid)
        if self.on_unprepared is not None:
            self.on_unprepared()
        return ""

    def prepared(self) -> Mapping[str, PreparedClaim]:
        return self.checkpoint.claims
