"""What both demos (device plugin and DRA) read from their command line the same way."""
from __future__ import annotations

from vramshare.errors import UsageError


def pod_count(asked: int | None, shapes: int) -> int:
    """``--pods``: all shapes by default; more than there are is refused, never quietly cut."""
    if asked is None:
        return shapes
    if not 1 <= asked <= shapes:
        raise UsageError(f"--pods {asked}: this demo has {shapes} pod shapes; choose 1 to {shapes}")
    return asked
