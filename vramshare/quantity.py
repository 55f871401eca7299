"""Kubernetes resource quantities, parsed by the API server's rules, and bounded.

The grammar is ``k8s.io/apimachinery/pkg/api/resource.ParseQuantity``::

    <quantity> ::= <signedNumber><suffix>
    <suffix>   ::= Ki | Mi | Gi | Ti | Pi | Ei  |  n | u | m | "" | k | M | G | T | P | E
                 | <decimalExponent>            (e or E, then a signed integer)

ASCII digits only (the API server rejects other Unicode digits, which Python's ``int`` would accept).
Results are exact (:class:`fractions.Fraction`), so ``1k`` is 1000 and ``500m`` is 1/2. Pure: no I/O.
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Any, Callable

__all__ = ["QuantityError", "parse", "whole", "cpu_millis", "byte_count"]

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000), "": Fraction(1),
            "k": Fraction(10**3), "M": Fraction(10**6), "G": Fraction(10**9), "T": Fraction(10**12),
            "P": Fraction(10**15), "E": Fraction(10**18)}
_FORM = re.compile(r"^([+-]?)([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?$",
                   re.ASCII)
#: Longer strings are refused before any arithmetic (the API server's own limit is similar in spirit).
MAX_LENGTH = 64
#: Exponents beyond this cannot name a real resource; refusing them keeps the arithmetic small.
MAX_EXPONENT = 30


class QuantityError(ValueError):
    """A quantity the API server would not accept, or one out of the bounds the caller set."""


#: Strings read lately -> their value, per reading. A pod's few quantities ("8", "64Gi", "100m") are
#: read again at every watch event of every pod (each has a new resourceVersion): Fraction arithmetic
#: was most of that. Only successes are kept, so a refusal always names its own ``where``.
_MEMO_LIMIT = 4096
_PARSED: dict[str, Fraction] = {}
_MILLIS: dict[str, int] = {}
_BYTES: dict[str, int] = {}


def _memo(table: dict[str, Any], value: Any, where: str, read: Callable[[Any, str], Any]) -> Any:
    if type(value) is not str:
        return read(value, where)
    known = table.get(value)
    if known is None:
        known = read(value, where)
        if len(table) >= _MEMO_LIMIT:
            table.clear()
        table[value] = known
    return known


def parse(value: Any, where: str) -> Fraction:
    """``value`` (an int or a quantity string) as an exact number; :class:`QuantityError` names ``where``."""
    return _memo(_PARSED, value, where, _parse)


def _parse(value: Any, where: str) -> Fraction:
    if isinstance(value, bool):
        raise QuantityError(f"{where}: {value!r} is not a quantity")
    if isinstance(value, int):
        return Fraction(value)
    if not isinstance(value, str) or len(value) > MAX_LENGTH:
        raise QuantityError(f"{where}: {str(value)[:MAX_LENGTH]!r} is not a quantity")
    m = _FORM.match(value.strip())
    if not m:
        raise QuantityError(f"{where}: {value!r} is not a quantity (forms: 22, 1k, 500m, 16Gi, 1e3)")
    sign, number, suffix = m.group(1), m.group(2), m.group(3) or ""
    amount = Fraction(number)
    if suffix in _BINARY:
        amount *= _BINARY[suffix]
    elif suffix in _DECIMAL:
        amount *= _DECIMAL[suffix]
    else:
        exponent = int(suffix[1:])
        if abs(exponent) > MAX_EXPONENT:
            raise QuantityError(f"{where}: {value!r} has an exponent beyond ±{MAX_EXPONENT}")
        amount *= Fraction(10) ** exponent
    return -amount if sign == "-" else amount


def whole(value: Any, where: str, maximum: int) -> int:
    """An extended-resource count: a whole, non-negative number no larger than ``maximum``.

    The API server requires extended resources to be integers; ``maximum`` is the caller's bound (for
    example the most units any device offers), so a valid but absurd request such as ``9.1e15`` is
    refused here with a reason rather than overflowing arithmetic later.
    """
    amount = parse(value, where)
    if amount.denominator != 1:
        raise QuantityError(f"{where}: {value!r} is not a whole number (extended resources take whole numbers)")
    if amount < 0:
        raise QuantityError(f"{where}: {value!r} is negative")
    if amount > maximum:
        raise QuantityError(f"{where}: {value!r} is more than {maximum}, the most this resource can have")
    return int(amount)


def cpu_millis(value: Any, where: str) -> int:
    """A CPU quantity in millicores, rounded up as the scheduler's ``MilliValue`` does."""
    return _memo(_MILLIS, value, where, _cpu_millis)


def _cpu_millis(value: Any, where: str) -> int:
    amount = parse(value, where) * 1000
    if amount < 0:
        raise QuantityError(f"{where}: {value!r} is negative")
    return -(-amount.numerator // amount.denominator)


def byte_count(value: Any, where: str) -> int:
    """A memory quantity in bytes, rounded up as ``Quantity.Value`` does."""
    return _memo(_BYTES, value, where, _byte_count)


def _byte_count(value: Any, where: str) -> int:
    amount = parse(value, where)
    if amount < 0:
        raise QuantityError(f"{where}: {value!r} is negative")
    return -(-amount.numerator // amount.denominator)
