"""The one bounded, strict JSON reader under every codec of the contract (no I/O)."""
from __future__ import annotations

import json
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class ContractError(ValueError):
    """A document of the contract that a codec refuses; the message says what is wrong and where."""


def load(text: object, limit: int, error: type[ContractError], what: str) -> Any:
    """``text`` (str or bytes, at most ``limit`` bytes) as JSON; raises ``error`` naming ``what``.

    Bounded before parsing so a huge annotation or file costs nothing; NaN and Infinity (which
    Python's ``json`` accepts and no other peer writes) are refused."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise error(f"{what}: not UTF-8 ({exc.reason})") from None
    if not isinstance(text, str):
        raise error(f"{what}: expected text, got {type(text).__name__}")
    if len(text) > limit:
        raise error(f"{what}: {len(text)} characters, more than {limit}")
    try:
        return _DECODER.decode(text)
    except ValueError as exc:
        raise error(f"{what}: not JSON ({exc})") from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)  # built once: json.loads(**kw) builds one per call


def dump(doc: Any, *, sort_keys: bool = False) -> str:
    """Compact JSON, keys in the order given or sorted (the writers choose their order once, here)."""
    return json.dumps(doc, separators=(",", ":"), allow_nan=False, sort_keys=sort_keys)


def is_int(value: object, lo: int, hi: int) -> bool:
    """A JSON integer (not a bool, not a float) within ``lo..hi``."""
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def per_container(text: object, limit: int, error: type[ContractError], what: str, max_containers: int,
                  max_name: int, read: Callable[[str, object], T]) -> dict[str, T]:
    """A ``{container name: ...}`` document (the assignment and its quota mirror): bounded, an object of at
    most ``max_containers`` names of 1 to ``max_name`` characters, each value read by ``read``."""
    doc = load(text, limit, error, what)
    if not isinstance(doc, dict) or len(doc) > max_containers:
        raise error(f"{what}: not an object of at most {max_containers} container names to GPU lists")
    out = {}
    for name, value in doc.items():
        if not name or len(name) > max_name:
            raise error(f"{what}[{name!r}]: container name must be 1 to {max_name} characters")
        out[name] = read(name, value)
    return out
