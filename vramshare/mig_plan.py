"""The dynamic-MIG plan on the wire: one GPU instance to make, named by a kubelet device ID.

A plan is (physical GPU, profile, placement start). The extender chooses it at bind and writes it in
the pod's assignment annotation as the device ID of that placement; the device plugin advertises the
same ID under ``vramshare.io/mig-<profile>``, GetPreferredAllocation steers the kubelet to it, and
Allocate, which the kubelet calls with device IDs only, reads the plan back from the ID it was given and
makes that instance. The ID *is* the plan, so Allocate needs no pod, no API call and no local record,
and a retried or replayed Allocate names the same instance (idempotent per plan).

Form: ``<gpu-uuid>::mig-<profile>@<start>``, e.g. ``GPU-5e6f...2c34::mig-3g.40gb@4``. It never reads as
a memory-unit ID (``<gpu-uuid>::<n>``) and is at most the kubelet's 63 characters for every GPU UUID
NVML prints (``GPU-`` + 36). One encode (:func:`encode`), one parse (:func:`parse`), strict and bounded;
the lead moves them into ``vramshare.contract`` (DESIGN.md section 3) at merge.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from vramshare import contract
from vramshare.mig import MEMORY_SLOTS, Placed

SEPARATOR = "::mig-"
MAX_GPU_UUID = 48  # "GPU-" + 36 is 40; a little room, never enough to push an ID past 63
_UUID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]*")
# the profile names of vramshare.mig and NVML: <g>g.<gb>gb, optional "+me" (or other "+x" suffixes)
_PROFILE_RE = re.compile(r"[1-8]g\.[0-9]{1,4}gb(\+[a-z]{1,8})?")


class PlanError(ValueError):
    """A string that is not a dynamic-MIG placement ID; the message says what was expected."""


@dataclass(frozen=True, order=True)
class MigPlacement:
    """One GPU instance a pod is to get: its GPU, profile and placement start (memory slot)."""

    gpu_uuid: str
    profile: str
    start: int

    @property
    def placed(self) -> Placed:
        return Placed(self.start, self.profile)


def encode(plan: MigPlacement) -> str:
    """The device ID of ``plan``; raises :class:`PlanError` for what :func:`parse` refuses."""
    text = f"{plan.gpu_uuid}{SEPARATOR}{plan.profile}@{plan.start}"
    if parse(text) != plan:  # one definition of what is valid
        raise PlanError(f"{text!r} does not round-trip")
    return text


def parse(text: object) -> MigPlacement:
    """The plan a device ID names; :class:`PlanError` for anything else (a unit ID, a MIG UUID, junk)."""
    if not isinstance(text, str):
        raise PlanError(f"MIG placement ID: expected a string, got {type(text).__name__}")
    if len(text) > contract.MAX_DEVICE_ID_LEN:
        raise PlanError(f"MIG placement ID {text[:70]!r}: longer than {contract.MAX_DEVICE_ID_LEN} characters")
    gpu, sep, rest = text.partition(SEPARATOR)
    profile, at, start = rest.rpartition("@")
    if not sep or not at:
        raise PlanError(f"{text!r} is not a MIG placement ID (want <gpu-uuid>::mig-<profile>@<start>)")
    if len(gpu) > MAX_GPU_UUID or not _UUID_RE.fullmatch(gpu):
        raise PlanError(f"{text!r}: GPU UUID must be letters, digits and '-', at most {MAX_GPU_UUID} characters")
    if not _PROFILE_RE.fullmatch(profile):
        raise PlanError(f"{text!r}: {profile!r} is not a MIG profile like 3g.40gb")
    if not (start.isascii() and start.isdigit() and len(start) == 1 and int(start) < MEMORY_SLOTS):
        raise PlanError(f"{text!r}: start must be a memory slot 0..{MEMORY_SLOTS - 1}")
    return MigPlacement(gpu, profile, int(start))


def is_placement_id(text: str) -> bool:
    """Cheap test used where IDs of every kind pass (the allocator, the extender's books)."""
    return SEPARATOR in text


def try_parse(text: str) -> MigPlacement | None:
    """:func:`parse`, or None for an ID that is not a placement (an ordinary MIG UUID, a unit)."""
    if not is_placement_id(text):
        return None
    try:
        return parse(text)
    except PlanError:
        return None


__all__ = ["MigPlacement", "PlanError", "SEPARATOR", "encode", "is_placement_id", "parse", "try_parse"]
