"""The ``<domain>/quota-mib`` pod annotation: the quota loop's mirror of ``quota.json`` for people and
``vramshare inspect`` (the file stays the contract for the engine; DESIGN.md section 3, "Mirrors").

``{container: [{"uuid", "mib", "state"?, "class"?, "req"?, "floor"?, "used"?, "why"?, "sleep"?, "lent"?,
"wakeS"?}]}``: the assignment's shape with each GPU's current limit (``mib``) and, optionally, the
container's warmth (``state``), its quota class, request, floor, measured use, the reason of the last
change, and the warm tier's engine state, MiB lent while asleep and last wake in seconds (issue 23).
Keys are short because it is on every pod. Unknown keys are ignored when read (it grows additively).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Sequence

from vramshare.contract._json import ContractError, dump, is_int, per_container

MAX_CHARS = 64 * 1024
MAX_CONTAINERS = 256
MAX_GPUS = 1024
MAX_TEXT = 253  # uuid, class, state; the loop cuts its reasons shorter (REASON_CHARS)
MAX_MIB = 1 << 24
MAX_SECONDS = 1e9


class QuotaMirrorError(ContractError):
    """A ``quota-mib`` annotation that cannot be read (or written); the message says what is wrong."""


@dataclass(frozen=True)
class MirrorEntry:
    """One GPU of one container as the quota loop last mirrored it. ``None`` / ``""``: not written."""

    uuid: str
    mib: int
    state: str = ""
    qclass: str = ""
    req: int | None = None
    floor: int | None = None
    used: int | None = None
    why: str = ""
    sleep: str = ""
    lent: int | None = None
    wake_s: float | None = None


#: wire key -> (field, kind); kind "mib" = integer MiB, "text" = bounded string, "seconds" = number
_KEYS: dict[str, tuple[str, str]] = {
    "state": ("state", "text"), "class": ("qclass", "text"), "req": ("req", "mib"), "floor": ("floor", "mib"),
    "used": ("used", "mib"), "why": ("why", "text"), "sleep": ("sleep", "text"), "lent": ("lent", "mib"),
    "wakeS": ("wake_s", "seconds")}
_DETAIL_KEYS = frozenset(_KEYS) - {"state"}

Mirror = dict[str, tuple[MirrorEntry, ...]]


def _valid(kind: str, value: object) -> bool:
    if kind == "mib":
        return is_int(value, 0, MAX_MIB)
    if kind == "text":
        return isinstance(value, str) and len(value) <= MAX_TEXT
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and 0 <= value <= MAX_SECONDS)


def parse(text: object) -> Mirror:
    """Every container's mirrored GPUs; raises :class:`QuotaMirrorError` saying what is wrong."""
    return per_container(text, MAX_CHARS, QuotaMirrorError, "quota-mib", MAX_CONTAINERS, MAX_TEXT, _entries)


def _entries(container: str, entries: object) -> tuple[MirrorEntry, ...]:
    where = f"quota-mib[{container!r}]"
    if not isinstance(entries, list) or len(entries) > MAX_GPUS:
        raise QuotaMirrorError(f"{where}: not a list of at most {MAX_GPUS} GPUs")
    out = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise QuotaMirrorError(f"{where}[{i}]: not an object")
        uuid, mib = e.get("uuid"), e.get("mib")
        if not (isinstance(uuid, str) and 0 < len(uuid) <= MAX_TEXT and is_int(mib, 0, MAX_MIB)):
            raise QuotaMirrorError(f"{where}[{i}]: want uuid (1 to {MAX_TEXT} characters) and mib "
                                   f"(integer 0..{MAX_MIB})")
        extra: dict[str, Any] = {}
        for key, (name, kind) in _KEYS.items():
            if key in e:
                if not _valid(kind, e[key]):
                    raise QuotaMirrorError(f"{where}[{i}]: {key} has the wrong type or range ({e[key]!r:.40})")
                extra[name] = e[key]
        out.append(MirrorEntry(uuid, mib, **extra))
    return tuple(out)


def to_doc(entry: MirrorEntry) -> dict[str, Any]:
    """One entry as written (what is not set is left out)."""
    doc: dict[str, Any] = {"uuid": entry.uuid, "mib": entry.mib}
    by_field = {name: key for key, (name, _) in _KEYS.items()}
    for f in fields(entry)[2:]:
        value = getattr(entry, f.name)
        if value is not None and value != "":
            doc[by_field[f.name]] = value
    return doc


def encode_mirror(mirror: Mapping[str, Sequence[MirrorEntry]]) -> str:
    """The annotation text of parsed entries, in the order given; what :func:`parse` refuses raises
    :class:`QuotaMirrorError` (one definition of valid)."""
    text = dump({c: [to_doc(e) for e in entries] for c, entries in mirror.items()})
    parse(text)
    return text


def encode(quotas: Mapping[str, Mapping[str, int]], states: Mapping[str, str] | None = None,
           details: Mapping[str, Mapping[str, Mapping[str, object]]] | None = None) -> str:
    """The annotation from the quota loop's view: ``quotas`` {container: {gpu uuid: limit MiB}}, ``states``
    {container: warmth}, ``details`` {container: {gpu uuid: {class, req, floor, used, why, sleep, lent,
    wakeS}}}; containers and GPUs sorted. Raises :class:`QuotaMirrorError` for a detail key it does not
    know (a typo would be dropped by every reader) or a value :func:`parse` refuses."""
    st, more = states or {}, details or {}
    mirror: dict[str, list[MirrorEntry]] = {}
    for c, gpus in sorted(quotas.items()):
        for u, mib in sorted(gpus.items()):
            extra = dict(more.get(c, {}).get(u) or {})
            unknown = set(extra) - _DETAIL_KEYS
            if unknown:
                raise QuotaMirrorError(f"quota-mib[{c!r}]: unknown detail keys {sorted(unknown)}")
            if c in st:
                extra["state"] = st[c]
            mirror.setdefault(c, []).append(MirrorEntry(u, mib, **{_KEYS[k][0]: v for k, v in extra.items()}))
        mirror.setdefault(c, [])
    return encode_mirror(mirror)
