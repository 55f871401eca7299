"""Do the CDI device names Allocate will hand out resolve on this node? Checked once at start.

With ``deviceListStrategy: cdi-cri`` a container's GPUs reach the runtime as CDI names
(``nvidia.com/gpu=<uuid>``), which the runtime looks up in the spec files under the CDI roots. NVIDIA's
``nvidia-ctk cdi generate`` names devices by index unless told ``--device-name-strategy=uuid``; then
every container of this node would fail at creation ("unresolvable CDI devices"), long after the pod
was scheduled. Saying so at start, with the names that are missing, turns that into a log line an
admin can act on. Reading follows the runtime's cache (``pkg/cdi/cache.go``): ``*.json`` and ``*.yaml``
in each root, a spec that does not parse is skipped.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterable, Sequence

import yaml

#: The roots the container runtimes read by default (``pkg/cdi``: DefaultStaticDir, DefaultDynamicDir).
DEFAULT_ROOTS = ("/etc/cdi", "/var/run/cdi")
FIX = "generate them with: nvidia-ctk cdi generate --device-name-strategy=uuid --output=/var/run/cdi/nvidia.yaml"


def defined_names(specs: Iterable[Any]) -> set[str]:
    """Every fully qualified name (``vendor/class=device``) the specs define. Pure."""
    names: set[str] = set()
    for doc in specs:
        if not isinstance(doc, dict) or not isinstance(doc.get("kind"), str):
            continue
        for dev in doc.get("devices") or []:
            if isinstance(dev, dict) and isinstance(dev.get("name"), str):
                names.add(f"{doc['kind']}={dev['name']}")
    return names


def missing(wanted: Iterable[str], specs: Iterable[Any]) -> list[str]:
    """The names of ``wanted`` no spec defines, in order. Pure."""
    have = defined_names(specs)
    return [n for n in wanted if n not in have]


def read_specs(roots: Sequence[str] = DEFAULT_ROOTS, skip_prefix: str = "") -> tuple[list[Any], list[str]]:
    """The spec documents under ``roots`` (less files named ``skip_prefix...``), and one line per file
    that could not be read."""
    docs: list[Any] = []
    problems: list[str] = []
    for root in roots:
        try:
            entries = sorted(os.listdir(root))
        except OSError:
            continue
        for entry in entries:
            if not entry.endswith((".json", ".yaml", ".yml")) or (skip_prefix and entry.startswith(skip_prefix)):
                continue
            path = os.path.join(root, entry)
            try:
                with open(path, encoding="utf-8") as fh:
                    docs.append(json.load(fh) if entry.endswith(".json") else yaml.safe_load(fh))
            except (OSError, ValueError, yaml.YAMLError) as exc:
                problems.append(f"{path}: {type(exc).__name__}: {exc}")
    return docs, problems
