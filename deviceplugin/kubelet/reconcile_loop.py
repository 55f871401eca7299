"""The reconciler's shell: PodResources + the pod cache in, pod patches and quota links out.

Runs once at start, *before* the plugin's gRPC servers register with the kubelet (so a restarted
plugin first learns what the kubelet already handed out), then every ``interval`` seconds and soon
after each Allocate. The decisions are :func:`deviceplugin.kubelet.reconcile.plan`'s; this module only does
the I/O and says what happened. Without PodResources (no socket configured, or it does not answer)
it refuses to guess: the pods keep the extender's plan as ``assumed``, the metric
``vramshare_deviceplugin_pod_resources_up`` is 0 and the log says why. While it is down Allocate
grants only what the books will still be right about (:attr:`Reconciler.recording` is False, see
:mod:`deviceplugin.kubelet.allocator`).

PodResources lists one entry per device ID; :func:`deviceplugin.kubelet.reconcile.plan` groups them. It has no
pod UID: the stamps and owners of the allocation directories (:meth:`QuotaFiles.allocations`) decide
whose a listed allocation is, and each new attribution is recorded (:meth:`QuotaFiles.attribute`).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

from deviceplugin import quota_files
from deviceplugin.kubelet import reconcile
from deviceplugin.kubelet.kube_adapter import Conflict, DirectoryError, Gone
from deviceplugin.kubelet.podresources import PodResourcesError
from deviceplugin.metrics import PluginMetrics
from deviceplugin.node_state import NodeState
from deviceplugin.quota_files import QuotaFiles
from vramshare import logs

log = logs.get(__name__)

DEBOUNCE_S = 0.05  # after an Allocate the kubelet records the devices a moment later
FOLLOW_UP_S, FOLLOW_UPS = 0.2, 5  # re-rounds while a just-allocated pod is still mid-admission
ALLOC_DIR_TTL_S = 600.0
UNCONFIRMED = "cannot confirm"  # an allocation directory nobody holds is removed after this long untouched


class HeldSource(Protocol):
    def list(self) -> list[reconcile.Held]: ...


class PodView(Protocol):
    def pods(self) -> list[Mapping[str, Any]]: ...

    def written(self, pod: Mapping[str, Any]) -> None: ...


class Patcher(Protocol):
    def apply(self, patch: reconcile.Patch) -> Mapping[str, Any]: ...

    def uid_of(self, namespace: str, name: str) -> str | None: ...


@dataclass
class Round:
    """What one reconcile round did (tests, the bench and the logs read it)."""

    pod_resources: bool = False
    patched: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    waiting: dict[str, str] = field(default_factory=dict)
    in_sync: int = 0
    links: int = 0


class Reconciler:
    """``kubelet`` None: no PodResources socket; ``pods``/``patcher`` None: standalone (links only
    need pods, so without an API server nothing is linked and nothing is patched)."""

    def __init__(self, state: NodeState, node: str, quota: QuotaFiles, metrics: PluginMetrics,
                 kubelet: HeldSource | None, pods: PodView | None, patcher: Patcher | None) -> None:
        self._state, self._node, self._quota, self._metrics = state, node, quota, metrics
        self._kubelet, self._pods, self._patcher = kubelet, pods, patcher
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._owners: dict[str, reconcile.Owner] = {}
        self._holdings: tuple[reconcile.Holding, ...] = ()  # swapped whole: read without the round's lock
        self._said_unavailable = False
        self._up = False  # the last round had PodResources' answer
        self._warned: set[str] = set()
        self.alloc_dir_ttl_s = ALLOC_DIR_TTL_S
        self.rounds = 0
        self.on_held: Callable[[list[reconcile.Held]], None] | None = None  # dynamic MIG's reaper

    def owners(self) -> dict[str, reconcile.Owner]:
        """Allocation key (quota directory name under ``_alloc``) -> the pod container holding it."""
        with self._lock:
            return dict(self._owners)

    def holdings(self) -> tuple[reconcile.Holding, ...]:
        """The pod containers that held all their devices in the last round that read PodResources (kept
        while it is down): the quota loop's tenants (issue 21). Never waits for a round in progress."""
        return self._holdings

    @property
    def recording(self) -> bool:
        """Whether the last round read PodResources (the actual GPUs of each pod get recorded)."""
        return self._up

    def wake(self) -> None:
        self._wake.set()

    def run_once(self) -> Round:
        out = Round()
        with self._lock:
            self._round(out)
            self.rounds += 1
        return out

    def _round(self, out: Round) -> None:
        if self._kubelet is None:
            self._unavailable("no PodResources socket configured")
            return
        try:
            held = self._kubelet.list()
        except PodResourcesError as exc:
            self._unavailable(str(exc))
            return
        self._up = True
        out.pod_resources = True
        if self.on_held is not None:
            self.on_held(held)
        if self._said_unavailable:
            log.info("PodResources answers again, reconciling")
            self._said_unavailable = False
        snap = self._state.snapshot
        devices = {d.id: d for devs in snap.devices.values() for d in devs}
        pods = self._pods.pods() if self._pods is not None else []
        keys = {quota_files.allocation_key(ids) for e in reconcile.group(held).values() for ids in e.values()}
        plan = reconcile.plan(held, pods, devices, snap.config.names, self._node, snap.inventory.unit_mib,
                              self._quota.allocations(keys))
        self._confirm(plan)
        for key, (uid, stamp) in sorted(plan.attributions.items()):
            try:
                self._quota.attribute(key, uid, stamp)
            except (OSError, ValueError) as exc:
                log.warning("cannot record whose allocation this is", pod_uid=uid, allocation=key, error=str(exc))
        out.waiting, out.in_sync = plan.waiting, plan.in_sync
        for key, why in sorted(plan.waiting.items()):
            if why != reconcile.NOT_CACHED and "admission in progress" not in why and f"{key}\0{why}" not in self._warned:
                self._warned.add(f"{key}\0{why}")
                (log.warning if reconcile.REFUSED in why else log.info)("pod not reconciled", pod=key, reason=why)
        for key, hidden in plan.unlisted.items():
            if key in self._warned:
                continue
            self._warned.add(key)
            log.warning("init container holds devices PodResources does not list; the books cannot count "
                        "them", pod=key, devices=hidden)
        self._owners = dict(plan.owners)
        out.links = self._link(plan)
        self._holdings = tuple(plan.holdings)  # after the links: a tenant's quota directory resolves
        for patch in plan.patches if self._patcher is not None else ():
            self._apply(patch, out)
        self._metrics.reconciled("error" if out.failed else "ok", True)

    def _confirm(self, plan: reconcile.Plan) -> None:
        """Before a new allocation is tied to a pod UID for good, ask the API server whose the name is
        *now* (the cache may still show a pod deleted and recreated since; PodResources has no UID).
        A UID the API no longer has under that name gets nothing this round: no record, link or patch."""
        if self._patcher is None or not plan.attributions:
            return
        wrong: dict[str, str] = {}
        for key, (uid, _) in sorted(plan.attributions.items()):
            owner = plan.owners.get(key)
            if owner is None or uid in wrong:
                continue
            try:
                now = self._patcher.uid_of(owner.namespace, owner.pod)
            except DirectoryError as exc:
                wrong[uid] = f"{UNCONFIRMED} pod UID {uid} with the API server ({exc}); next round retries"
                continue
            if now != uid:
                wrong[uid] = (f"the API server has {owner.namespace}/{owner.pod} as {now or 'nothing'}, not {uid} "
                              "(the pod cache is behind a delete and re-create); next round decides again")
        if not wrong:
            return
        reconcile.drop_unconfirmed(plan, wrong)
        for why in sorted(set(wrong.values())):
            log.warning("allocation not tied to a pod yet", reason=why)

    def _apply(self, patch: reconcile.Patch, out: Round) -> None:
        key = patch.pod.key
        try:
            written = self._patcher.apply(patch)  # type: ignore[union-attr]
        except (Conflict, Gone) as exc:  # the cache is behind: the next round plans from the new version
            self._metrics.patched("conflict" if isinstance(exc, Conflict) else "gone")
            out.failed[key] = str(exc)
            log.info("pod changed before its assignment was recorded, next round retries", pod=key,
                     error=str(exc))
            return
        except DirectoryError as exc:
            self._metrics.patched("error")
            out.failed[key] = str(exc)
            log.warning("cannot record pod's actual GPUs, next round retries", pod=key, error=str(exc))
            return
        self._metrics.patched("ok")
        if self._pods is not None:
            self._pods.written(written)
        out.patched.append(key)
        log.info("recorded pod's actual GPUs", pod=key, assignment=patch.assignment, state=patch.state)

    def _link(self, plan: reconcile.Plan) -> int:
        changed = 0
        for (uid, container), key in sorted(plan.links.items()):
            if not uid:
                continue
            try:
                changed += self._quota.link(uid, container, key)
            except (OSError, ValueError) as exc:  # ValueError: a UID or name that would leave the root
                log.warning("cannot link quota directory", pod_uid=uid, container=container, error=str(exc))
        try:
            # links first, then directories, and never a directory a link still leads to: a link whose
            # pod the cache has not seen (or not confirmed) stays, and so does what it points at
            if not any(why == reconcile.NOT_CACHED or why.startswith(UNCONFIRMED) for why in plan.waiting.values()):
                self._quota.prune_links(set(plan.links))
            gone = self._quota.prune_allocations(plan.held_keys | self._quota.link_targets(), self.alloc_dir_ttl_s)
            if gone:
                log.info("removed quota directories no container holds", count=gone)
        except OSError as exc:
            log.warning("cannot prune quota directories", error=str(exc))
        return changed

    def _unavailable(self, why: str) -> None:
        self._up = False
        self._metrics.reconciled("unavailable", False)
        if not self._said_unavailable:
            log.warning("PodResources unavailable: pods keep the extender's plan (assumed), nothing is guessed; "
                        "Allocate still grants exactly the GPUs its device IDs name", reason=why)
            self._said_unavailable = True

    def run(self, stop: threading.Event, interval_s: float) -> None:
        """Body of the ``reconcile`` thread: a round every ``interval_s`` and soon after each Allocate."""
        follow_ups = 0
        while not stop.is_set():
            woken = self._wake.wait(FOLLOW_UP_S if follow_ups else interval_s)
            if woken:
                self._wake.clear()
                stop.wait(DEBOUNCE_S)
                follow_ups = FOLLOW_UPS
            if stop.is_set():
                return
            try:
                out = self.run_once()
            except Exception as exc:  # noqa: BLE001 - a bad round must not end the thread
                self._metrics.reconciled("error", False)
                log.error("reconcile round failed", error=f"{type(exc).__name__}: {exc}", exc_info=True)
                continue
            # after an Allocate the pod may still be mid-admission: look again soon, a few times, so the
            # extender's per-signature hold ends promptly
            follow_ups = follow_ups - 1 if follow_ups and (out.waiting or out.failed) else 0
