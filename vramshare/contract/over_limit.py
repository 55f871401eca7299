"""The ``<domain>/over-limit`` pod annotation (issue 9): set by the quota loop on a pod whose container
stayed above its hard limit past the grace period, beside a Warning event.

``{"container", "gpu", "usedMiB", "limitMiB", "seconds"}``: which container, on which GPU, what it used,
what it was allowed, and for how long (whole seconds). Unknown keys are ignored when read.
"""
from __future__ import annotations

from dataclasses import dataclass

from vramshare.contract._json import ContractError, dump, is_int, load

MAX_CHARS = 4096
MAX_TEXT = 253
MAX_MIB = 1 << 24
MAX_SECONDS = 10 * 365 * 86400


class OverLimitError(ContractError):
    """An ``over-limit`` annotation that cannot be read (or written); the message says what is wrong."""


@dataclass(frozen=True)
class OverLimit:
    container: str
    gpu: str
    used_mib: int
    limit_mib: int
    seconds: int


def parse(text: object) -> OverLimit:
    """The report; raises :class:`OverLimitError` naming the bad field."""
    doc = load(text, MAX_CHARS, OverLimitError, "over-limit")
    if not isinstance(doc, dict):
        raise OverLimitError("over-limit: not an object")
    for key in ("container", "gpu"):
        value = doc.get(key)
        if not isinstance(value, str) or not 0 < len(value) <= MAX_TEXT:
            raise OverLimitError(f"over-limit: {key} must be a string of 1 to {MAX_TEXT} characters")
    for key, hi in (("usedMiB", MAX_MIB), ("limitMiB", MAX_MIB), ("seconds", MAX_SECONDS)):
        if not is_int(doc.get(key), 0, hi):
            raise OverLimitError(f"over-limit: {key} must be an integer 0..{hi}, got {doc.get(key)!r:.40}")
    return OverLimit(doc["container"], doc["gpu"], doc["usedMiB"], doc["limitMiB"], doc["seconds"])


def encode(report: OverLimit) -> str:
    """The annotation text; raises :class:`OverLimitError` for what :func:`parse` refuses."""
    text = dump({"container": report.container, "gpu": report.gpu, "usedMiB": report.used_mib,
                 "limitMiB": report.limit_mib, "seconds": report.seconds})
    parse(text)
    return text
