"""The quota loop: read telemetry -> policy per GPU -> write quota files -> mirror annotations.

Imperative shell around :func:`policy.rebalance`. Each tick (:meth:`QuotaLoop.run_once`) is
independent and keeps going past bad input: a failed tenant listing or usage read skips the tick
(the files on disk stay as they were, i.e. the last good quotas); a failed vLLM scrape only drops
that tenant's pressure signals; a failed write is retried next tick because the loop only records
what it managed to write. Files are written only when a limit changes, so readers are not woken
for nothing, and the generation on disk grows with each write (see ``writer``).
"""
from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol, Sequence

from deviceplugin.quota.attribution import attribute
from deviceplugin.quota.model import (Decision, GpuState, PolicyParams, Signals, Tenant, TenantKey,
                                      TenantState)
from deviceplugin.quota.policy import rebalance
from deviceplugin.quota.telemetry import SignalReader, TelemetryError, UsageReader, UsageSample
from deviceplugin.quota.writer import (GpuQuota, QuotaFile, QuotaFileError, container_dir, read_quota,
                                       write_quota)
from vramshare import logs

log = logs.get("vramshare.quota.loop")


class TenantSource(Protocol):
    """The containers holding our memory on this node (from the device plugin's allocations)."""

    def list_tenants(self) -> list[Tenant]:
        """Raises any exception on failure; the loop logs it and skips the tick."""
        ...


class QuotaMirror(Protocol):
    """Mirrors a pod's quotas into its ``vramshare.io/quota-mib`` annotation."""

    def mirror(self, key: TenantKey, quotas: Mapping[str, Mapping[str, int]]) -> None:
        """``quotas`` = {container: {gpu uuid: limit MiB}} for every tenant container of the pod."""
        ...


@dataclass
class TickReport:
    """What one tick did; tests and the bench read it, the daemon only logs."""

    decisions: list[Decision] = field(default_factory=list)
    written: list[TenantKey] = field(default_factory=list)
    skipped: str | None = None  # why the whole tick was skipped
    errors: list[str] = field(default_factory=list)


class QuotaLoop:
    def __init__(self, tenants: TenantSource, capacities: Callable[[], Mapping[str, int]],
                 usage: Sequence[UsageReader], params: PolicyParams, host_root: str,
                 signals: SignalReader | None = None, mirror: QuotaMirror | None = None) -> None:
        """``usage`` readers are tried in order (NVML first, dcgm-exporter as the fallback)."""
        self._tenants, self._capacities, self._usage = tenants, capacities, list(usage)
        self._params, self._root, self._signals, self._mirror = params, host_root, signals, mirror
        self._limits: dict[tuple[TenantKey, str], int] = {}  # what is on disk, as we wrote or read it
        self._preempt: dict[TenantKey, float] = {}  # last preemption counter per tenant
        self.last = TickReport()  # the latest tick, for the metrics collector
        self.counts: dict[str, int] = defaultdict(int)  # ticks, skipped, changes, errors, writes

    def limits(self) -> dict[tuple[TenantKey, str], int]:
        """The limits on disk as this loop knows them: ``{(tenant, gpu uuid): MiB}``."""
        return dict(self._limits)

    # -- inputs ------------------------------------------------------------------------------
    def _read_usage(self, report: TickReport) -> list[UsageSample] | None:
        for reader in self._usage:
            try:
                return reader.read_usage()
            except TelemetryError as exc:
                log.warning("usage source failed", source=reader.name, error=str(exc))
                report.errors.append(str(exc))
        return None

    def _read_signals(self, t: Tenant, report: TickReport) -> Signals:
        if self._signals is None or not t.metrics_url:
            return Signals()
        try:
            s = self._signals.read_signals(t.metrics_url)
        except TelemetryError as exc:
            log.warning("vllm metrics unreadable, no pressure signals this tick", pod=str(t.key),
                        url=t.metrics_url, error=str(exc))
            report.errors.append(str(exc))
            return Signals()
        delta = None
        if s.preemptions_total is not None:
            last = self._preempt.get(t.key)
            if last is not None:  # a counter below its last value was reset: count it from zero
                delta = int(s.preemptions_total - last if s.preemptions_total >= last else s.preemptions_total)
            self._preempt[t.key] = s.preemptions_total
        return Signals(kv_usage=s.kv_usage, waiting=s.waiting, preemptions=delta)

    def _current(self, t: Tenant, gpu: str) -> int | None:
        """The limit in force: ours, else the file Allocate wrote, else None (= the request)."""
        if (t.key, gpu) not in self._limits:
            try:
                on_disk = read_quota(container_dir(self._root, t.key.pod_uid, t.key.container))
            except (QuotaFileError, OSError) as exc:
                log.warning("quota file unreadable", pod=str(t.key), gpu=gpu, error=str(exc))
                on_disk = None
            if on_disk is not None:
                for g, mib in on_disk.limits().items():
                    self._limits.setdefault((t.key, g), mib)
        return self._limits.get((t.key, gpu))

    # -- one tick ----------------------------------------------------------------------------
    def run_once(self) -> TickReport:
        """One tick: read, decide, write. Never raises for bad input; see :class:`TickReport`."""
        report = self._tick()
        self.last = report
        self.counts["ticks"] += 1
        self.counts["skipped"] += report.skipped is not None
        self.counts["errors"] += len(report.errors)
        self.counts["writes"] += len(report.written)
        self.counts["changes"] += sum(d.changed for d in report.decisions)
        return report

    def _tick(self) -> TickReport:
        report = TickReport()
        try:
            tenants = sorted(self._tenants.list_tenants(), key=lambda t: t.key)
            capacities = dict(self._capacities())
        except Exception as exc:  # an API/cache failure must not kill the DaemonSet thread
            report.skipped = f"cannot list tenants: {exc}"
            log.error("quota tick skipped, keeping last quotas", reason=report.skipped)
            return report
        samples = self._read_usage(report)
        if samples is None:
            report.skipped = "no usage source answered"
            log.error("quota tick skipped, keeping last quotas", reason=report.skipped)
            return report
        seen = attribute(samples, tenants)
        per_gpu: dict[str, list[TenantState]] = defaultdict(list)
        for t in tenants:
            sig = self._read_signals(t, report)
            for gpu, req in t.gpus:
                per_gpu[gpu].append(TenantState(t.key, req, self._current(t, gpu),
                                                seen.used.get((t.key, gpu)), sig))
        decided: dict[tuple[TenantKey, str], Decision] = {}
        for gpu, states in sorted(per_gpu.items()):
            if gpu not in capacities:
                log.warning("GPU not in inventory, its tenants keep their quotas", gpu=gpu)
                continue
            cap = capacities[gpu] - seen.foreign.get(gpu, 0)
            for d in rebalance(GpuState(gpu, cap, tuple(states)), self._params):
                decided[(d.key, gpu)] = d
                report.decisions.append(d)
        self._write(tenants, decided, report)
        alive = {t.key for t in tenants}
        self._limits = {k: v for k, v in self._limits.items() if k[0] in alive}
        self._preempt = {k: v for k, v in self._preempt.items() if k in alive}
        return report

    def _write(self, tenants: list[Tenant], decided: Mapping[tuple[TenantKey, str], Decision],
               report: TickReport) -> None:
        changed_pods: set[str] = set()
        for t in tenants:
            ds = [decided[(t.key, g)] for g, _ in t.gpus if (t.key, g) in decided]
            if not ds or all(self._limits.get((t.key, d.gpu_uuid)) == d.limit_mib for d in ds):
                continue
            gpus = tuple(self._entry(t.key, g, req, decided.get((t.key, g))) for g, req in t.gpus)
            try:
                written = write_quota(container_dir(self._root, t.key.pod_uid, t.key.container),
                                      QuotaFile(gpus=gpus))
            except (OSError, ValueError) as exc:
                log.error("quota write failed, will retry", pod=str(t.key), error=str(exc))
                report.errors.append(str(exc))
                continue
            for d in ds:
                if self._limits.get((t.key, d.gpu_uuid)) != d.limit_mib:
                    log.info("quota changed", pod=f"{t.key.namespace}/{t.key.pod}", container=t.key.container,
                             gpu=d.gpu_uuid, old_mib=d.previous_mib, new_mib=d.limit_mib, reason=d.reason,
                             generation=written.generation)
                self._limits[(t.key, d.gpu_uuid)] = d.limit_mib
            report.written.append(t.key)
            changed_pods.add(t.key.pod_uid)
        if self._mirror is not None:
            self._mirror_pods(tenants, changed_pods, report)

    def _entry(self, key: TenantKey, gpu: str, request: int, d: Decision | None) -> GpuQuota:
        """One GPU's line of the file. A GPU skipped this tick keeps its limit (a multi-GPU file is
        rewritten whole). Floors above the limit happen only when a GPU cannot hold the floors
        (capacity lost to foreign memory); the file must still read floor <= limit <= ceiling."""
        if d is not None:
            return GpuQuota(gpu, d.limit_mib, min(d.floor_mib, d.limit_mib), d.ceiling_mib)
        limit = self._limits.get((key, gpu), request)
        return GpuQuota(gpu, limit, min(self._params.floor_of(request), limit),
                        max(self._params.ceiling_of(request), limit))

    def _mirror_pods(self, tenants: list[Tenant], pods: set[str], report: TickReport) -> None:
        for uid in sorted(pods):
            members = [t for t in tenants if t.key.pod_uid == uid]
            quotas = {t.key.container: {g: self._limits[(t.key, g)] for g, _ in t.gpus
                                        if (t.key, g) in self._limits} for t in members}
            try:
                self._mirror.mirror(members[0].key, quotas)  # type: ignore[union-attr]
            except Exception as exc:  # the file is the contract; the annotation is only a mirror
                log.warning("quota annotation not mirrored", pod=f"{members[0].key.namespace}/"
                            f"{members[0].key.pod}", error=str(exc))
                report.errors.append(str(exc))

    def run(self, stop: threading.Event, interval_seconds: float) -> None:
        """Tick every ``interval_seconds`` until ``stop`` is set (the DaemonSet's quota thread)."""
        while not stop.is_set():
            try:
                self.run_once()
            except Exception:  # never let one bad tick end the loop
                log.error("quota tick crashed, keeping last quotas", exc_info=True)
            stop.wait(interval_seconds)
