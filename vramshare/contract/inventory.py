"""The node's ``<domain>/gpu-inventory`` annotation (DESIGN.md section 3, "node inventory").

The model (:class:`vramshare.inventory.NodeInventory`) and its codec stay in :mod:`vramshare.inventory`,
which the device plugin builds from its backend; every reader and writer goes through :func:`parse` and
:func:`encode` here, so the contract has one entry per format. ``parse`` is bounded
(:data:`vramshare.inventory.MAX_CHARS`) and strict: an unknown version, a missing field or a value no GPU
can have raises :class:`InventoryError` naming the field; unknown keys are ignored (v1 grows additively).
"""
from __future__ import annotations

from vramshare.inventory import MAX_CHARS, InventoryError, NodeInventory

__all__ = ["MAX_CHARS", "InventoryError", "NodeInventory", "parse", "encode"]


def parse(text: object) -> NodeInventory:
    """The inventory from the annotation's text; raises :class:`InventoryError` saying why not."""
    if not isinstance(text, (str, bytes)):
        raise InventoryError(f"inventory is not JSON: expected text, got {type(text).__name__}")
    return NodeInventory.from_json(text)  # type: ignore[arg-type]


def encode(inv: NodeInventory) -> str:
    """The annotation's text: keys sorted, compact (the same bytes for the same inventory)."""
    return inv.to_json()
