"""Every placement policy by name: ours (``policies``) and the paper's baselines (``baselines``).

Its own module so that neither of those imports the other.
"""
from __future__ import annotations

from typing import Callable

from extender.baselines import BASELINES
from extender.dra_policies import DRA
from extender.policies import OURS, Policy

REGISTRY: dict[str, Callable[[], Policy]] = {**OURS, **BASELINES, **DRA}


def get(name: str) -> Policy:
    """The policy called ``name`` (ours or a paper baseline); ValueError names the known ones."""
    try:
        return REGISTRY[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(sorted(REGISTRY))})") from None


def names() -> list[str]:
    return list(REGISTRY)
