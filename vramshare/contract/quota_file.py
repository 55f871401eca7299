"""``quota.json``: ``{"generation", "updated", "gpus": [{"uuid", "limitMiB", "floorMiB", "ceilingMiB"}]}``
with optional ``state`` and ``enforcement`` (DESIGN.md section 3).

One model for both sides: the node agent writes it (``deviceplugin.quota.writer``, atomically, one
generation counter) and the vLLM plugin reads it (``vllm_patches.quota``). The one rule, strict because
the numbers size a memory allocation (a limit nobody can read is ignored, never guessed):

* ``generation`` an integer ``0..2**63-1`` (an int64 on every reader) and at least one GPU, each GPU
  once, sizes integers in MiB (no bool, no float, no string) with ``0 <= floor <= limit`` and
  ``limit <= ceiling`` where a ceiling is written;
* ``floorMiB`` and ``ceilingMiB`` may be left out by a writer that only knows a limit (tests, benches,
  a person): floor 0, ceiling 0 meaning "none written". The node agent always writes all three with
  ``floor <= limit <= ceiling`` (:func:`encode` insists on it);
* ``updated``, ``state`` and ``enforcement`` are strings when present; unknown keys are ignored
  (the format grows additively).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vramshare.contract._json import ContractError, dump, is_int, load

GENERATION_MAX = 2**63 - 1  # readers hold the generation in an int64 (Go, C, numpy): never more
MAX_BYTES = 1 << 20  # a quota file is a few hundred bytes; never read an unbounded one
MAX_GPUS = 1024
MAX_MIB = 1 << 24  # 16 TiB, as the inventory bounds memory
MAX_TEXT = 256  # uuid, updated, state, enforcement


class QuotaFileError(ContractError):
    """A quota document that could not be parsed (or written); the message says what is wrong."""


@dataclass(frozen=True)
class GpuQuota:
    """One GPU's memory quota for one container, in MiB. ``ceiling_mib`` 0: none written."""

    uuid: str
    limit_mib: int
    floor_mib: int = 0
    ceiling_mib: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"uuid": self.uuid, "limitMiB": self.limit_mib,
                "floorMiB": self.floor_mib, "ceilingMiB": self.ceiling_mib}


@dataclass(frozen=True)
class QuotaFile:
    """The whole document. ``generation`` 0 means "the next one" to the writer; ``updated`` "" "now"."""

    gpus: tuple[GpuQuota, ...] = field(default_factory=tuple)
    generation: int = 0
    updated: str = ""  # UTC, "2026-11-29T09:20:00Z"
    state: str = ""  # the tenant's phase (hot / warm / waking / cold); optional, "" = not written
    enforcement: str = ""  # the node's enforcement mode (driver / mps / cooperative); optional

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"generation": self.generation, "updated": self.updated,
                               "gpus": [g.to_json() for g in self.gpus]}
        if self.state:
            doc["state"] = self.state
        if self.enforcement:
            doc["enforcement"] = self.enforcement
        return doc

    def limits(self) -> dict[str, int]:
        """``{gpu uuid: limit MiB}``, handy for comparisons and the annotation mirror."""
        return {g.uuid: g.limit_mib for g in self.gpus}


def parse(text: object) -> QuotaFile:
    """A quota document from its text (str or bytes); raises :class:`QuotaFileError` naming the field."""
    doc = load(text, MAX_BYTES, QuotaFileError, "quota file")
    if not isinstance(doc, dict):
        raise QuotaFileError("quota file: top level is not an object")
    generation = doc.get("generation")
    if not is_int(generation, 0, GENERATION_MAX):
        raise QuotaFileError(f"quota file: generation must be an integer 0..{GENERATION_MAX} (an int64), "
                             f"got {generation!r:.40}")
    raw = doc.get("gpus")
    if not isinstance(raw, list) or not raw or len(raw) > MAX_GPUS:
        raise QuotaFileError(f"quota file: gpus must be a non-empty list of at most {MAX_GPUS}")
    gpus = tuple(_gpu(i, e) for i, e in enumerate(raw))
    if len({g.uuid for g in gpus}) != len(gpus):
        raise QuotaFileError("quota file: gpus names a GPU twice")
    return QuotaFile(gpus, generation, _text(doc, "updated"), _text(doc, "state"), _text(doc, "enforcement"))


def _text(doc: dict[str, Any], key: str) -> str:
    value = doc.get(key, "")
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise QuotaFileError(f"quota file: {key} must be a string of at most {MAX_TEXT} characters")
    return value


def _gpu(i: int, e: object) -> GpuQuota:
    where = f"quota file: gpus[{i}]"
    if not isinstance(e, dict):
        raise QuotaFileError(f"{where}: not an object")
    uuid = e.get("uuid")
    if not isinstance(uuid, str) or len(uuid) > MAX_TEXT:
        raise QuotaFileError(f"{where}: uuid must be a string of at most {MAX_TEXT} characters")
    sizes = []
    for key, default in (("limitMiB", None), ("floorMiB", 0), ("ceilingMiB", 0)):
        value = e.get(key, default)
        if not is_int(value, 0, MAX_MIB):
            raise QuotaFileError(f"{where}: {key} must be an integer 0..{MAX_MIB} MiB, got {value!r:.40}")
        sizes.append(value)
    limit, floor, ceiling = sizes
    if floor > limit or (ceiling and limit > ceiling):
        raise QuotaFileError(f"{where} ({uuid}): need floorMiB <= limitMiB <= ceilingMiB, "
                             f"got {floor}/{limit}/{ceiling}")
    return GpuQuota(uuid, limit, floor, ceiling)


def encode(quota: QuotaFile) -> str:
    """The file's text (keys sorted, compact); raises :class:`QuotaFileError` for a document
    :func:`parse` refuses or a GPU without ``0 <= floor <= limit <= ceiling`` (the node's writers
    always know all three)."""
    for g in quota.gpus:
        if not 0 <= g.floor_mib <= g.limit_mib <= g.ceiling_mib:
            raise QuotaFileError(f"quota for {g.uuid}: need 0 <= floor <= limit <= ceiling, "
                                 f"got {g.floor_mib}/{g.limit_mib}/{g.ceiling_mib}")
    text = dump(quota.to_json(), sort_keys=True)
    parse(text)
    return text
