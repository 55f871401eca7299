"""Which config a node plugin runs (day two: "has my ConfigMap edit landed on every node?").

``{"digest": "<16 hex>", "restartPending": ["memoryUnitMiB", ...]}``: the digest of the config file text
the plugin last accepted (:func:`vramshare.config.text_digest`, which ``vramshare check`` computes from the
ConfigMap) and the keys of it that wait for the plugin's restart. The device plugin writes it as its
inventory's ``config`` section; the DRA plugin as the ``<domain>/config`` annotation of its
ResourceSlices. It informs an admin, so a reader takes a malformed one as absent (:func:`from_doc`), never
the node's GPUs with it; :func:`parse` is the strict form for the annotation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vramshare.contract._json import ContractError, dump, load

MAX_CHARS = 4096
MAX_DIGEST_CHARS = 64
MAX_PENDING_KEYS = 32
MAX_KEY_CHARS = 128


class ConfigInForceError(ContractError):
    """A ``config`` report that cannot be read; the message says what is wrong."""


@dataclass(frozen=True)
class ConfigInForce:
    digest: str
    restart_pending: tuple[str, ...] = ()


def to_doc(c: ConfigInForce) -> dict[str, Any]:
    """As JSON values, within the bounds (the inventory's section and the annotation alike)."""
    return {"digest": c.digest, "restartPending": [k for k in c.restart_pending[:MAX_PENDING_KEYS]
                                                    if len(k) <= MAX_KEY_CHARS]}


def from_doc(raw: Any) -> ConfigInForce | None:
    """The report from JSON values, or None where it is not well formed."""
    if not isinstance(raw, dict):
        return None
    digest, pending = raw.get("digest"), raw.get("restartPending", [])
    if not isinstance(digest, str) or not 0 < len(digest) <= MAX_DIGEST_CHARS or not isinstance(pending, list):
        return None
    return ConfigInForce(digest, tuple(k for k in pending[:MAX_PENDING_KEYS]
                                       if isinstance(k, str) and len(k) <= MAX_KEY_CHARS))


def parse(text: object) -> ConfigInForce:
    """The annotation's report; raises :class:`ConfigInForceError` saying why not."""
    found = from_doc(load(text, MAX_CHARS, ConfigInForceError, "config"))
    if found is None:
        raise ConfigInForceError(f"config: expected {{\"digest\": 1 to {MAX_DIGEST_CHARS} characters, "
                                 "\"restartPending\": [keys]}")
    return found


def encode(c: ConfigInForce) -> str:
    return dump(to_doc(c))
