"""The node's ``<domain>/resident-models`` annotation (issue 23 item 3, on GPUs the DRA plugin serves).

The device plugin reports the models its node can start fast in its ``gpu-inventory``'s ``models``
section; the DRA plugin publishes no inventory (its GPUs are in ResourceSlices, and an inventory would
make the extender book them twice), so it writes this annotation: ``{"version": "v1", "models": [...]}``,
the ``models`` list spelled exactly as the inventory spells it (:func:`vramshare.inventory.models_to_list`,
:func:`vramshare.inventory.models_from_list`: one encoding of a model, read leniently, bounded to
:data:`vramshare.inventory.MAX_MODELS`). A node that runs both plugins has both reports; readers merge
them (:func:`vramshare.inventory.merge_models`).

``parse`` is bounded (:data:`MAX_CHARS`) and strict on the envelope (not JSON, not an object, another
version, no ``models`` list: :class:`ResidentModelsError` saying why); entries that are not well formed
are dropped, as in the inventory. The report is a placement hint: a reader that cannot read it scores
the node as one that holds nothing, it never refuses the node.
"""
from __future__ import annotations

from typing import Iterable

from vramshare.contract._json import ContractError, dump, load
from vramshare.inventory import MAX_MODELS, ResidentModel, models_from_list, models_to_list

VERSION = "v1"
#: 64 models with a few engines each is ~20 KB; an annotation this size is still far below the API
#: server's 256 KiB for all of a node's annotations together (the inventory shares that budget)
MAX_CHARS = 64 * 1024

__all__ = ["MAX_CHARS", "VERSION", "ResidentModelsError", "parse", "encode"]


class ResidentModelsError(ContractError):
    """A ``resident-models`` annotation that cannot be read; the message says what is wrong."""


def parse(text: object) -> tuple[ResidentModel, ...]:
    """The models the annotation reports; raises :class:`ResidentModelsError` naming what is wrong."""
    doc = load(text, MAX_CHARS, ResidentModelsError, "resident-models")
    if not isinstance(doc, dict):
        raise ResidentModelsError("resident-models: expected a JSON object")
    version = doc.get("version")
    if version != VERSION:
        raise ResidentModelsError(f"resident-models.version: unknown version {version!r} (want {VERSION!r})")
    if not isinstance(doc.get("models"), list):
        raise ResidentModelsError("resident-models.models: expected a list")
    return models_from_list(doc["models"])


def encode(models: Iterable[ResidentModel]) -> str:
    """The annotation's text (keys sorted, compact: the same bytes for the same models). Past
    :data:`MAX_CHARS` (GPU names of absurd length) the last models are left out until it fits."""
    kept = list(models)[:MAX_MODELS]
    while True:
        text = dump({"version": VERSION, "models": models_to_list(kept)}, sort_keys=True)
        if len(text) <= MAX_CHARS or not kept:
            return text
        kept.pop()
