"""MIG geometry: which GPU instances a GPU model offers, where they may sit, and what a placement costs.

A GPU in MIG mode is cut along two axes: 7 compute slices and 8 memory slots (eighths of its memory).
NVML names each GPU-instance profile (``nvmlDeviceGetGpuInstanceProfileInfo``: ``sliceCount``,
``instanceCount``, ``memorySizeMB``) and its legal placements (``nvmlDeviceGetGpuInstancePossiblePlacements``:
``{start, size}`` in memory slots, whatever is already created). ``nvidia-smi mig -lgipp`` prints the same
table, e.g. on an A100 40GB ``MIG 1g.5gb {0,1,2,3,4,5,6}:1``, ``MIG 2g.10gb {0,2,4}:2``, ``MIG 3g.20gb
{0,4}:4``, ``MIG 4g.20gb {0}:4``, ``MIG 7g.40gb {0}:8``.

The tables below are those of NVIDIA's MIG user guide ("Supported MIG Profiles", sections A100 PCIe/SXM4
40GB, A100 80GB, H100 80GB, H200 141GB; docs.nvidia.com/datacenter/tesla/mig-user-guide): profile IDs as
``nvidia-smi mig -lgip`` prints them, instance counts and placements as ``-lgipp`` prints them. Memory is the
profile's share of the card's memory in eighths (the GB label is NVIDIA's rounded figure; a real GPU's
``memorySizeMB`` is a few percent less and comes from NVML where there is a GPU).

Pure: no NVML, no I/O. The simulated backend, the device plugin's dynamic-MIG path, the extender's scoring
and the MIG replay all read these tables and these rules, so there is one answer to "may this go there".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

COMPUTE_SLICES = 7
MEMORY_SLOTS = 8

# NVML_GPU_INSTANCE_PROFILE_* indices (what nvmlDeviceGetGpuInstanceProfileInfo takes).
NVML_1_SLICE, NVML_2_SLICE, NVML_3_SLICE, NVML_4_SLICE, NVML_7_SLICE = 0x0, 0x1, 0x2, 0x3, 0x4
NVML_1_SLICE_REV1, NVML_1_SLICE_REV2 = 0x7, 0x9


@dataclass(frozen=True)
class MigProfile:
    """One GPU-instance profile of one GPU model."""

    name: str               # "3g.40gb": compute slices "g", memory label "gb", optional "+me"
    profile_id: int         # NVML's info.id, as `nvidia-smi mig -lgip` prints it
    nvml_index: int         # NVML_GPU_INSTANCE_PROFILE_* (the argument of GetGpuInstanceProfileInfo)
    compute_slices: int     # info.sliceCount
    memory_slots: int       # placement size, in eighths of the GPU's memory
    memory_mib: int         # label memory (memory_slots eighths of the card)
    max_count: int          # info.instanceCount on an empty GPU
    starts: tuple[int, ...]  # legal placement starts (memory slots)
    media: bool = False     # "+me": the GPU's one set of media engines goes with it

    @property
    def label(self) -> str:
        return self.name


@dataclass(frozen=True)
class MigModel:
    """A MIG-capable GPU model: its memory and its profile table."""

    name: str
    memory_mib: int
    profiles: tuple[MigProfile, ...]

    def profile(self, name: str) -> MigProfile:
        for p in self.profiles:
            if p.name == name:
                return p
        raise KeyError(f"{self.name} has no MIG profile {name!r} (it has {', '.join(self.names)})")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.profiles)


def _table(model: str, gib: int, labels: Mapping[str, str]) -> MigModel:
    """The A100/H100/H200 family shape (identical geometry; labels and memory differ).

    ``labels`` names each geometric profile for this card: one1 (1 compute, 1 slot), one2 (1 compute,
    2 slots: A100 40GB 1g.10gb, 80GB cards 1g.20gb, H200 1g.35gb), two, three, four, seven.
    """
    mib = gib * 1024
    eighth = mib // MEMORY_SLOTS
    rows = (  # key, nvidia-smi ID, NVML index, compute, slots, max, starts, media
        ("one1", 19, NVML_1_SLICE, 1, 1, 7, (0, 1, 2, 3, 4, 5, 6), False),
        ("one1me", 20, NVML_1_SLICE_REV1, 1, 1, 1, (0, 1, 2, 3, 4, 5, 6), True),
        ("one2", 15, NVML_1_SLICE_REV2, 1, 2, 4, (0, 2, 4, 6), False),
        ("two", 14, NVML_2_SLICE, 2, 2, 3, (0, 2, 4), False),
        ("three", 9, NVML_3_SLICE, 3, 4, 2, (0, 4), False),
        ("four", 5, NVML_4_SLICE, 4, 4, 1, (0,), False),
        ("seven", 0, NVML_7_SLICE, 7, 8, 1, (0,), False),
    )
    profiles = []
    for key, pid, index, compute, slots, count, starts, media in rows:
        name = labels[key.removesuffix("me")] + ("+me" if media else "")
        profiles.append(MigProfile(name, pid, index, compute, slots, slots * eighth, count, starts, media))
    return MigModel(model, mib, tuple(profiles))


#: The four cards the simulated backend and the replay model (NVIDIA MIG user guide, "Supported MIG Profiles").
MODELS: dict[str, MigModel] = {m.name: m for m in (
    _table("A100-SXM4-40GB", 40, {"one1": "1g.5gb", "one2": "1g.10gb", "two": "2g.10gb", "three": "3g.20gb",
                                  "four": "4g.20gb", "seven": "7g.40gb"}),
    _table("A100-SXM4-80GB", 80, {"one1": "1g.10gb", "one2": "1g.20gb", "two": "2g.20gb", "three": "3g.40gb",
                                  "four": "4g.40gb", "seven": "7g.80gb"}),
    _table("H100-SXM5-80GB", 80, {"one1": "1g.10gb", "one2": "1g.20gb", "two": "2g.20gb", "three": "3g.40gb",
                                  "four": "4g.40gb", "seven": "7g.80gb"}),
    _table("H200-SXM5-141GB", 141, {"one1": "1g.18gb", "one2": "1g.35gb", "two": "2g.35gb", "three": "3g.71gb",
                                    "four": "4g.71gb", "seven": "7g.141gb"}),
)}


def model_for(device_name: str, memory_mib: int) -> MigModel | None:
    """The table for an NVML device name (``NVIDIA A100-SXM4-80GB``, ``NVIDIA H200``); None if unknown.

    The memory tells the A100's two sizes apart (the PCIe names carry no size).
    """
    upper = device_name.upper()
    if "H200" in upper:
        return MODELS["H200-SXM5-141GB"]
    if "H100" in upper:
        return MODELS["H100-SXM5-80GB"]
    if "A100" in upper:
        return MODELS["A100-SXM4-80GB" if memory_mib > 48 * 1024 else "A100-SXM4-40GB"]
    return None


@dataclass(frozen=True, order=True)
class Placed:
    """A GPU instance that exists (or is planned) on one GPU: its profile and its placement start."""

    start: int
    profile: str


def _span(p: MigProfile, start: int) -> range:
    return range(start, start + p.memory_slots)


def check_layout(model: MigModel, placed: Iterable[Placed]) -> list[str]:
    """Why a set of instances cannot coexist on one GPU of ``model`` (empty when it can)."""
    problems: list[str] = []
    used: set[int] = set()
    compute = 0
    counts: dict[str, int] = {}
    media = 0
    for inst in sorted(placed):
        try:
            p = model.profile(inst.profile)
        except KeyError as exc:
            problems.append(str(exc.args[0]))
            continue
        if inst.start not in p.starts:
            problems.append(f"{p.name} cannot start at slot {inst.start} (legal: {list(p.starts)})")
        span = set(_span(p, inst.start))
        if span & used:
            problems.append(f"{p.name}@{inst.start} overlaps slots {sorted(span & used)}")
        used |= span
        compute += p.compute_slices
        counts[p.name] = counts.get(p.name, 0) + 1
        media += p.media
        if counts[p.name] > p.max_count:
            problems.append(f"more than {p.max_count} {p.name}")
    if compute > COMPUTE_SLICES:
        problems.append(f"{compute} compute slices > {COMPUTE_SLICES}")
    if media > 1:
        problems.append("more than one +me instance")
    return problems


def free_starts(model: MigModel, placed: Sequence[Placed], profile: str) -> list[int]:
    """Where one more ``profile`` could be created beside ``placed`` (NVML's possible placements, minus
    those that overlap what exists, minus all when the count, compute or media limit is reached)."""
    p = model.profile(profile)
    used: set[int] = set()
    compute = count = media = 0
    for inst in placed:
        q = model.profile(inst.profile)
        used.update(_span(q, inst.start))
        compute += q.compute_slices
        count += q.name == p.name
        media += q.media
    if count >= p.max_count or compute + p.compute_slices > COMPUTE_SLICES or (p.media and media):
        return []
    return [s for s in p.starts if used.isdisjoint(_span(p, s))]


def creatable(model: MigModel, placed: Sequence[Placed]) -> dict[str, int]:
    """How many of each profile could still be created, each counted alone (the GPU's remaining
    capacity per profile, as ``nvmlDeviceGetGpuInstanceRemainingCapacity`` reports it)."""
    out: dict[str, int] = {}
    for p in model.profiles:
        layout = list(placed)
        n = 0
        while True:
            starts = free_starts(model, layout, p.name)
            if not starts:
                break
            layout.append(Placed(starts[0], p.name))
            n += 1
        out[p.name] = n
    return out


def smallest_fitting(model: MigModel, memory_mib: int) -> MigProfile | None:
    """The profile a memory request maps to: least memory that holds it, then fewest compute slices.

    ``+me`` profiles are never chosen for a plain memory request (they hold the GPU's only media engines).
    """
    fits = [p for p in model.profiles if not p.media and p.memory_mib >= memory_mib]
    return min(fits, key=lambda p: (p.memory_slots, p.compute_slices), default=None)


def potential(model: MigModel, placed: Sequence[Placed], weights: Mapping[str, float]) -> float:
    """What a GPU can still offer the expected workload: sum over profiles of (its share of requests) x
    (instances of it still creatable) x (its size in memory slots). A placement that lowers this less
    keeps more of the GPU usable for the requests to come (the MIG analogue of FGD's fragmentation)."""
    left = creatable(model, placed)
    return sum(w * left.get(name, 0) * model.profile(name).memory_slots
               for name, w in weights.items() if name in left)


def placement_loss(model: MigModel, placed: Sequence[Placed], profile: str, start: int,
                   weights: Mapping[str, float]) -> float:
    """How much ``potential`` one more ``profile``@``start`` costs this GPU (lower is better)."""
    return potential(model, placed, weights) - potential(model, [*placed, Placed(start, profile)], weights)


def maximal_layouts(model: MigModel, with_media: bool = False) -> list[tuple[Placed, ...]]:
    """Every layout to which no further instance can be added: the static partitionings an admin can
    choose from (``nvidia-smi mig -cgi`` combinations)."""
    profiles = [p for p in model.profiles if with_media or not p.media]
    seen: set[tuple[Placed, ...]] = set()
    out: list[tuple[Placed, ...]] = []

    def grow(layout: tuple[Placed, ...]) -> None:
        grown = False
        for p in profiles:
            for s in free_starts(model, layout, p.name):
                grown = True
                nxt = tuple(sorted((*layout, Placed(s, p.name))))
                if nxt not in seen:
                    seen.add(nxt)
                    grow(nxt)
        if not grown and layout not in out:
            out.append(layout)

    grow(())
    return sorted(set(out))


def layout_name(layout: Iterable[Placed]) -> str:
    """``3g.40gb@0+2g.20gb@4+1g.10gb@6``: a layout in one line, by start."""
    return "+".join(f"{p.profile}@{p.start}" for p in sorted(layout)) or "(empty)"


def fit_layout(model: MigModel, profiles: Sequence[str]) -> list[Placed] | None:
    """Starts for ``profiles`` (as an admin lists them, e.g. ``nvidia-smi mig -cgi 3g.40gb,2g.20gb``) that
    check_layout accepts, the first found trying starts in order; None when no placement holds them all.

    First-free-start is not enough: on an 80 GB card ``3g.40gb,2g.20gb,1g.10gb,1g.10gb`` fits only with
    the 3g at slot 4 (the 1g profiles cannot start at slot 7)."""
    order = sorted(profiles, key=lambda n: -model.profile(n).memory_slots)

    def place(i: int, layout: list[Placed]) -> list[Placed] | None:
        if i == len(order):
            return layout
        for s in free_starts(model, layout, order[i]):
            found = place(i + 1, [*layout, Placed(s, order[i])])
            if found is not None:
                return found
        return None

    return place(0, [])


def open_placements(model: MigModel, existing: Sequence[Placed], planned: Sequence[Placed]) -> set[Placed]:
    """The placements a new plan may take beside ``existing`` instances (what NVML shows) and ``planned``
    ones (chosen for pods, maybe not created yet): every free start of every profile, plus each existing
    instance no plan holds (a plan at its very placement adopts it). The books of the extender block
    every other placement, so two plans never overlap, whether or not their instances exist yet."""
    layout = list(dict.fromkeys([*existing, *planned]))
    out = {Placed(s, p.name) for p in model.profiles for s in free_starts(model, layout, p.name)}
    return out | (set(existing) - set(planned))


def all_placements(model: MigModel) -> list[Placed]:
    """Every profile at every legal start (what a GPU could ever offer; NVIDIA's DRA driver advertises
    exactly this set as partitionable devices)."""
    return [Placed(s, p.name) for p in model.profiles for s in p.starts]


def model_of_profiles(device_name: str, memory_mib: int) -> MigModel | None:
    """:func:`model_for`, also for the table names themselves (``A100-SXM4-80GB``) as inventories carry."""
    return MODELS.get(device_name) or model_for(device_name, memory_mib)


__all__ = [
    "COMPUTE_SLICES", "MEMORY_SLOTS", "MODELS", "MigModel", "MigProfile", "Placed", "all_placements",
    "check_layout", "creatable", "fit_layout", "free_starts", "model_of_profiles", "open_placements", "layout_name", "maximal_layouts", "model_for", "placement_loss", "potential",
    "smallest_fitting",
]
