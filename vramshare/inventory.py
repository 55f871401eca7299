"""The GPU inventory of one node: what the device plugin discovered and the extender schedules on.

Pure data, no I/O. The device plugin builds it from a backend (NVML or simulated) plus the config,
publishes it as the node annotation ``<domain>/gpu-inventory``; the extender reads it back. The JSON
form is the contract (DESIGN.md section 3) and is versioned.

Version skew (a device plugin one release newer or older than the extender, issue 11): changes
within ``v1`` are additive. A reader ignores keys it does not know (a newer writer's) and derives the
ones an older writer did not publish: a shared GPU without ``units`` offers
``floor(memoryMiB / unitMiB)`` units, never 0 (which would read as a full GPU). A change old readers
cannot ignore needs a new version, which they refuse with a reason naming it (the extender then keeps
the node's last good inventory). Every number is bounded: a value no GPU can have is refused, not
scheduled on.
"""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Iterator, Mapping

from vramshare import contract
from vramshare.contract import assignment, config_in_force
from vramshare.contract._json import load
from vramshare.contract.config_in_force import ConfigInForce
from vramshare.departing import MAX_DEPARTING, MAX_POD_KEY, DepartingPod


class GpuMode(str, enum.Enum):
    """How a GPU is offered: split into memory units, whole, or as its MIG instances."""

    SHARED = "shared"
    EXCLUSIVE = "exclusive"
    MIG = "mig"


class EnforcementMode(str, enum.Enum):
    """How a node fences each container's GPU memory (issue 9), detected by the device plugin at start."""

    DRIVER = "driver"  # R615+ memory limits per cgroup (NVML), moved live by the quota loop
    MPS = "mps"  # an MPS control daemon enforces CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, fixed at start
    COOPERATIVE = "cooperative"  # nothing fences: the quota file, plus over-limit detection


class InventoryError(contract.ContractError):
    """An inventory annotation or file that cannot be read; the message names the bad field."""


@dataclass(frozen=True)
class MigInstance:
    """One MIG device (GPU instance + compute instance) of a GPU in MIG mode."""

    uuid: str
    profile: str  # e.g. "1g.10gb"
    memory_mib: int
    gi: int | None = None
    ci: int | None = None
    healthy: bool = True
    start: int | None = None  # placement start, published for dynamic-MIG GPUs (additive)


@dataclass(frozen=True)
class DynamicMig:
    """A GPU in MIG mode whose admin allows dynamic MIG (issue 24; optional, additive within v1).

    ``table`` names the profile table (:data:`vramshare.mig.MODELS`); ``instances`` are the GPU
    instances NVML shows, ``(profile, placement start)``; ``free`` is, per profile, the starts where
    one more could be created now (NVML's possible placements minus what the instances take);
    ``isolation``: the node's device plugin serves ``isolation: mig`` memory asks here (it offers the GPU's
    memory units and finds each one's plan at Allocate), so the extender may plan them on it."""

    table: str
    instances: tuple[tuple[str, int], ...] = ()
    free: tuple[tuple[str, tuple[int, ...]], ...] = ()
    isolation: bool = False


@dataclass(frozen=True)
class Gpu:
    """One physical GPU as the scheduler needs to know it."""

    index: int
    uuid: str
    model: str
    memory_mib: int
    numa_node: int | None = None
    mode: GpuMode = GpuMode.SHARED
    healthy: bool = True
    mig: tuple[MigInstance, ...] = ()
    units: int = 0  # gpu-memory devices this GPU offers (0 unless mode is shared)
    dynamic_mig: DynamicMig | None = None  # set when instances may be made for pods (mode is mig)
    # issue 23 item 5: memory sleeping pods of overcommit classes lend to the books beyond their reserve
    # (vramshare/overcommit.py); offered as extra units, optional (absent: 0, what older readers assume)
    sleep_credit_mib: int = 0
    # memory on this GPU that no pod of ours holds, settled and in whole units (vramshare.foreign);
    # optional (absent: 0, what older readers assume); the extender books it, the kubelet's units stay
    foreign_mib: int = 0

    def with_health(self, healthy: bool) -> "Gpu":
        return replace(self, healthy=healthy)


class EngineState(str, enum.Enum):
    """A vLLM engine of a model on one GPU of the node (issue 23): serving, or asleep in host RAM."""

    AWAKE = "awake"
    SLEEPING = "sleeping"


@dataclass(frozen=True)
class ResidentModel:
    """A model the node can start fast (issue 23): its files in the host cache (``bytes``, 0 when only an
    engine is known) and the engines that hold it, ``(gpu uuid, state)``. A sleeping engine serves only
    its own pod, which wakes in place; new replicas profit from the files."""

    name: str
    revision: str = ""
    bytes: int = 0
    engines: tuple[tuple[str, EngineState], ...] = ()

    @property
    def ref(self) -> contract.ModelRef:
        return contract.ModelRef(self.name, self.revision)


#: bounds of the ``models`` section: a node reports at most this many (largest first), the annotation
#: stays small (~64 x 300 bytes); a reader drops what is past them
MAX_MODELS = 64
MAX_ENGINES_PER_MODEL = 16
MAX_MODEL_BYTES = 1 << 50  # 1 PiB: no model's files are larger


@dataclass(frozen=True)
class NodeInventory:
    """All GPUs of one node plus the memory unit they are sliced in."""

    unit_mib: int
    gpus: tuple[Gpu, ...] = field(default_factory=tuple)
    version: str = contract.INVENTORY_VERSION
    enforcement: EnforcementMode | None = None  # optional: absent from older publishers
    models: tuple[ResidentModel, ...] = ()  # optional (issue 23): absent from older publishers
    config: ConfigInForce | None = None  # optional: absent from older publishers and config-less runs
    # optional: deleted pods whose containers may still run here (vramshare.departing), latest end first
    departing: tuple[DepartingPod, ...] = ()

    def gpu(self, uuid: str) -> Gpu | None:
        return next((g for g in self.gpus if g.uuid == uuid), None)

    def capacity_mib(self, gpu: Gpu) -> int:
        """Memory of a shared GPU in whole units: what the quota loop divides among the awake."""
        return gpu.units * self.unit_mib

    def credit_units(self, gpu: Gpu) -> int:
        """Extra units a shared GPU offers for its sleep credit (issue 23 item 5; whole units)."""
        return gpu.sleep_credit_mib // self.unit_mib if gpu.mode is GpuMode.SHARED else 0

    def bookable_mib(self, gpu: Gpu) -> int:
        """What the extender books a shared GPU against: its units plus the sleep credit's units (what
        the kubelet can hand out, :func:`deviceplugin.devices.resource_devices` advertises both)."""
        return (gpu.units + self.credit_units(gpu)) * self.unit_mib

    def booked_foreign_mib(self, gpu: Gpu) -> int:
        """What the extender books a shared GPU's foreign memory at (:mod:`vramshare.foreign`): whole units,
        at most :meth:`bookable_mib`; counted as used beside the pods, so no pod is planned into it."""
        if gpu.mode is not GpuMode.SHARED:
            return 0
        return min(self.bookable_mib(gpu), -(-gpu.foreign_mib // self.unit_mib) * self.unit_mib)

    # -- the annotation codec -------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(inventory_to_dict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "NodeInventory":
        """Bounded (:data:`MAX_CHARS`) and strict; readers call it as :func:`vramshare.contract.inventory.parse`."""
        return inventory_from_dict(load(text, MAX_CHARS, InventoryError, "inventory"))


def inventory_to_dict(inv: NodeInventory) -> dict[str, Any]:
    doc = _inventory_doc(inv)
    if inv.enforcement is not None:
        doc["enforcement"] = inv.enforcement.value
    if inv.models:
        doc["models"] = models_to_list(inv.models)
    if inv.config is not None:
        doc["config"] = config_in_force.to_doc(inv.config)
    if inv.departing:
        doc["departing"] = [{"pod": d.pod, "uid": d.uid, "until": d.until_s,
                             "gpus": [{"uuid": g, "mib": mib} for g, mib in d.gpus]}
                            for d in inv.departing[:MAX_DEPARTING]]
    return doc


def models_to_list(models: Iterable[ResidentModel]) -> list[dict[str, Any]]:
    """The ``models`` section as JSON values, within the bounds (the inventory's and the DRA plugin's
    ``resident-models`` annotation write it alike: :mod:`vramshare.contract.resident_models`)."""
    return [{"name": m.name, "revision": m.revision, "bytes": m.bytes,
             "engines": [{"gpu": g, "state": st.value} for g, st in m.engines[:MAX_ENGINES_PER_MODEL]]}
            for m in list(models)[:MAX_MODELS]]


def merge_models(*reports: Iterable[ResidentModel]) -> tuple[ResidentModel, ...]:
    """One node's reports as one (a node that runs both plugins publishes two, issue 23: each with the
    same cache files and the engines of its own GPUs): per model the largest ``bytes`` and every engine
    once; engines first, then the largest files, within :data:`MAX_MODELS`."""
    by_ref: dict[tuple[str, str], ResidentModel] = {}
    for report in reports:
        for m in report:
            key = (m.name, m.revision)
            old = by_ref.get(key)
            if old is None:
                by_ref[key] = m
                continue
            engines = old.engines + tuple(e for e in m.engines if e not in old.engines)
            by_ref[key] = replace(old, bytes=max(old.bytes, m.bytes), engines=engines[:MAX_ENGINES_PER_MODEL])
    out = sorted(by_ref.values(), key=lambda m: (not m.engines, -m.bytes, m.name, m.revision))
    return tuple(out[:MAX_MODELS])


def models_from_list(raw: Any) -> tuple[ResidentModel, ...]:
    """The optional ``models`` section, read leniently: it is a placement hint, so an entry that is not
    well formed is dropped (not the node's inventory), and entries past :data:`MAX_MODELS` are ignored."""
    if not isinstance(raw, list):
        return ()
    out: list[ResidentModel] = []
    for m in raw[:MAX_MODELS]:
        if not isinstance(m, dict):
            continue
        try:
            ref = contract.parse_model_ref(m.get("name"))
            rev = m.get("revision") or ""
            if rev:
                ref = contract.parse_model_ref(f"{ref.name}@{rev}")
        except contract.ModelRefError:
            continue
        size = m.get("bytes", 0)
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_MODEL_BYTES:
            continue
        engines = []
        for e in (m.get("engines") or [])[:MAX_ENGINES_PER_MODEL] if isinstance(m.get("engines"), list) else ():
            try:
                if isinstance(e, dict) and isinstance(e.get("gpu"), str):
                    engines.append((e["gpu"], EngineState(e.get("state"))))
            except ValueError:
                continue
        out.append(ResidentModel(ref.name, ref.revision, size, tuple(engines)))
    return tuple(out)


def _inventory_doc(inv: NodeInventory) -> dict[str, Any]:
    return {
        "version": inv.version,
        "unitMiB": inv.unit_mib,
        "gpus": [
            {
                "index": g.index,
                "uuid": g.uuid,
                "model": g.model,
                "memoryMiB": g.memory_mib,
                "numaNode": g.numa_node,
                "mode": g.mode.value,
                "healthy": g.healthy,
                "units": g.units,
                **({"sleepCreditMiB": g.sleep_credit_mib} if g.sleep_credit_mib else {}),
                **({"foreignMiB": g.foreign_mib} if g.foreign_mib else {}),
                "mig": [
                    {"uuid": m.uuid, "profile": m.profile, "memoryMiB": m.memory_mib,
                     "gi": m.gi, "ci": m.ci, "healthy": m.healthy,
                     **({"start": m.start} if m.start is not None else {})}
                    for m in g.mig
                ],
                **({"dynamicMig": _dynamic_doc(g.dynamic_mig)} if g.dynamic_mig is not None else {}),
            }
            for g in inv.gpus
        ],
    }


def _dynamic_doc(d: DynamicMig) -> dict[str, Any]:
    return {"table": d.table, "instances": [{"profile": p, "start": s} for p, s in d.instances],
            "free": {p: list(starts) for p, starts in d.free}, **({"isolation": True} if d.isolation else {})}


_MIG_SLOTS = 8  # memory slots of a MIG GPU (vramshare.mig.MEMORY_SLOTS; inventory stays free of it)
_MAX_PROFILES = 16


def _dynamic_from(raw: Any, where: str) -> DynamicMig | None:
    """The optional ``dynamicMig`` of a GPU, strict: a publisher that writes it writes it right."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise InventoryError(f"{where}: expected an object")
    table = _need(raw, "table", str, where)
    if len(table) > 64:
        raise InventoryError(f"{where}.table: longer than 64 characters")
    inst = raw.get("instances") or []
    if not isinstance(inst, list) or len(inst) > _MIG_SLOTS:
        raise InventoryError(f"{where}.instances: expected a list of at most {_MIG_SLOTS} instances")
    instances = [(_need(i, "profile", str, iw), _int(i, "start", iw, 0, _MIG_SLOTS - 1))
                 for iw, i in _objects(inst, f"{where}.instances")]
    free_raw = raw.get("free") or {}
    if not isinstance(free_raw, dict) or len(free_raw) > _MAX_PROFILES:
        raise InventoryError(f"{where}.free: expected an object of at most {_MAX_PROFILES} profiles")
    free = []
    for p, starts in sorted(free_raw.items()):
        if (not isinstance(starts, list) or len(starts) > _MIG_SLOTS
                or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < _MIG_SLOTS for x in starts)):
            raise InventoryError(f"{where}.free.{p}: expected a list of memory slots 0..{_MIG_SLOTS - 1}")
        free.append((p, tuple(starts)))
    isolation = raw.get("isolation", False)
    if not isinstance(isolation, bool):
        raise InventoryError(f"{where}.isolation: expected true or false")
    return DynamicMig(table, tuple(instances), tuple(free), isolation)


MAX_CHARS = 256 * 1024  # an annotation value can be no longer (the API server's limit for all of them)
MAX_MIB = 1 << 24  # 16 TiB: more memory than any GPU (or unit) has; larger values are corrupt
MAX_GPUS = 1024
_MISSING = object()


def _int(obj: Mapping[str, Any], key: str, where: str, lo: int, hi: int, default: Any = _MISSING) -> Any:
    """An integer field in ``[lo, hi]`` (JSON numbers like 1e30 or 2.0 and booleans are refused)."""
    if key not in obj or (obj[key] is None and default is not _MISSING):
        if default is _MISSING:
            raise InventoryError(f"{where}: missing key {key!r}")
        return default
    value = obj[key]
    if not isinstance(value, int) or isinstance(value, bool):
        raise InventoryError(f"{where}.{key}: expected an integer, got {value!r}")
    if not lo <= value <= hi:
        raise InventoryError(f"{where}.{key}: {value} is outside [{lo}, {hi}]")
    return value


def _objects(items: list[Any], where: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each item of a JSON list that must hold objects, with its place (``where[i]``) for errors."""
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise InventoryError(f"{where}[{i}]: expected an object")
        yield f"{where}[{i}]", item


def _bool(obj: Mapping[str, Any], key: str, where: str) -> bool:
    value = obj.get(key, True)
    if not isinstance(value, bool):
        raise InventoryError(f"{where}.{key}: expected true or false, got {value!r}")
    return value


def _need(obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in obj:
        raise InventoryError(f"{where}: missing key {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InventoryError(f"{where}.{key}: expected {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def inventory_from_dict(data: Any) -> NodeInventory:
    if not isinstance(data, dict):
        raise InventoryError("inventory: expected a JSON object")
    version = data.get("version", contract.INVENTORY_VERSION)
    if version != contract.INVENTORY_VERSION:
        raise InventoryError(f"inventory.version: unknown version {version!r} (want {contract.INVENTORY_VERSION!r})")
    unit = _int(data, "unitMiB", "inventory", 1, MAX_MIB)
    raw_gpus = _need(data, "gpus", list, "inventory")
    if len(raw_gpus) > MAX_GPUS:
        raise InventoryError(f"inventory.gpus: {len(raw_gpus)} GPUs, more than {MAX_GPUS}")
    gpus = []
    for where, g in _objects(raw_gpus, "inventory.gpus"):
        try:
            mode = GpuMode(g.get("mode", GpuMode.SHARED.value))
        except ValueError as exc:
            raise InventoryError(f"{where}.mode: {exc}") from exc
        numa = _int(g, "numaNode", where, -1, 1 << 16, default=None)
        raw_mig = g.get("mig") or []
        if not isinstance(raw_mig, list) or len(raw_mig) > 64:
            raise InventoryError(f"{where}.mig: expected a list of at most 64 MIG devices")
        migs = []
        for mw, m in _objects(raw_mig, f"{where}.mig"):
            migs.append(MigInstance(
                uuid=_need(m, "uuid", str, mw), profile=_need(m, "profile", str, mw),
                memory_mib=_int(m, "memoryMiB", mw, 0, MAX_MIB), gi=_int(m, "gi", mw, 0, 1 << 16, default=None),
                ci=_int(m, "ci", mw, 0, 1 << 16, default=None), healthy=_bool(m, "healthy", mw),
                start=_int(m, "start", mw, 0, _MIG_SLOTS - 1, default=None),
            ))
        memory = _int(g, "memoryMiB", where, 0, MAX_MIB)
        # An older writer may not publish units: derive them, never read a shared GPU as 0 units.
        derived = units_for(memory, 0, unit) if mode is GpuMode.SHARED else 0
        gpus.append(Gpu(
            index=_int(g, "index", where, 0, MAX_GPUS), uuid=_need(g, "uuid", str, where),
            model=_need(g, "model", str, where), memory_mib=memory,
            numa_node=numa, mode=mode, healthy=_bool(g, "healthy", where), mig=tuple(migs),
            units=_int(g, "units", where, 0, memory // unit, default=derived),
            dynamic_mig=_dynamic_from(g.get("dynamicMig"), f"{where}.dynamicMig") if mode is GpuMode.MIG else None,
            sleep_credit_mib=_int(g, "sleepCreditMiB", where, 0, MAX_MIB, default=0),
            foreign_mib=_int(g, "foreignMiB", where, 0, memory, default=0),
        ))
    enforcement = None
    if data.get("enforcement") is not None:
        try:
            enforcement = EnforcementMode(data["enforcement"])
        except ValueError:  # a newer publisher's mode: unknown here, which is what absent means
            enforcement = None
    return NodeInventory(unit_mib=unit, gpus=tuple(gpus), version=version, enforcement=enforcement,
                         models=models_from_list(data.get("models")),
                         config=config_in_force.from_doc(data.get("config")),  # read leniently: it informs
                         departing=_departing_from(data.get("departing")))


def _departing_from(raw: Any) -> tuple[DepartingPod, ...]:
    """The optional ``departing`` section, strictly: it books memory, so a malformed entry refuses the
    inventory (the reader keeps the node's last good one) rather than booking a guess. The extender
    books only the entries' GPUs (or MIG slots) that the node has."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_DEPARTING:
        raise InventoryError(f"inventory.departing: expected a list of at most {MAX_DEPARTING} pods")
    out = []
    for where, d in _objects(raw, "inventory.departing"):
        pod, uid = _need(d, "pod", str, where), _need(d, "uid", str, where)
        if not 0 < len(pod) <= MAX_POD_KEY or "/" not in pod or not 0 < len(uid) <= assignment.MAX_UUID:
            raise InventoryError(f"{where}: want pod \"<namespace>/<name>\" and a uid, got {pod!r:.80} {uid!r:.80}")
        entries = _need(d, "gpus", list, where)
        if not entries or len(entries) > MAX_GPUS:
            raise InventoryError(f"{where}.gpus: expected 1 to {MAX_GPUS} GPUs")
        held = []
        for gw, g in _objects(entries, f"{where}.gpus"):
            uuid = _need(g, "uuid", str, gw)
            if not 0 < len(uuid) <= assignment.MAX_UUID:
                raise InventoryError(f"{gw}.uuid: want 1 to {assignment.MAX_UUID} characters, got {uuid!r:.80}")
            held.append((uuid, _int(g, "mib", gw, 1, MAX_MIB)))
        if len({u for u, _ in held}) != len(held):
            raise InventoryError(f"{where}.gpus: names a GPU twice")
        out.append(DepartingPod(pod, uid, _int(d, "until", where, 0, 1 << 40), tuple(held)))
    return tuple(out)


def units_for(memory_mib: int, reserved_mib: int, unit_mib: int) -> int:
    """Memory units a shared GPU offers: ``floor((memoryMiB - reservedMiBPerGPU) / memoryUnitMiB)``."""
    return max(0, (memory_mib - reserved_mib) // unit_mib)


def model_matches(model: str, patterns: Iterable[str]) -> bool:
    """GPU model constraint (pod annotation ``gpu-models: "A|B"``): substring match, empty = any."""
    pats = [p.strip() for p in patterns if p.strip()]
    return not pats or any(p.lower() in model.lower() for p in pats)
