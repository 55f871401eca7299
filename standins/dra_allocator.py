"""A stand-in for kube-scheduler's structured DRA allocator, for tests and ``vramshare demo --dra`` only.

What it reproduces (k8s.io/dynamic-resource-allocation/structured, internal/experimental):

- candidate devices come from the node's pools; a pool counts only when every slice of its newest
  generation is present (``pools_experimental.go: GatherPools`` marks others incomplete and skips);
- devices with a ``NoSchedule``/``NoExecute`` taint are skipped (no tolerations in this stand-in);
- a request's DeviceClass selectors, then its own selectors, must hold (CEL; see :func:`cel_eval`);
- a device with ``allowMultipleAllocations`` is shared by amount: the consumed capacity is the
  request rounded by the device's ``requestPolicy`` (``calculateConsumedCapacity`` /
  ``roundUpRange``: below min -> min, else min + ceil((req - min) / step) * step; no request ->
  ``requestPolicy.default``, else the whole capacity), refused when it breaks the policy
  (``violatesPolicy``: above max, or not min + k*step) or when, added to what allocated claims and
  this claim's earlier results consume, it passes the capacity (``cmpRequestOverCapacity``); each
  share gets a fresh ``shareID``. Any other device is allocated at most once;
- ``matchAttribute`` / ``distinctAttribute`` constraints hold over the requests they name, by
  depth-first search with backtracking over requests and their counts (``allocator.allocateOne``),
  devices tried in pool and slice order;
- partitionable devices (KEP-4815, ``allocateDevice`` -> ``checkAvailableCounters`` /
  ``deallocateCountersForDevice``): a pool's counters are its slices' ``sharedCounters`` minus what
  the devices of allocated claims consume (possibly below zero); a device that ``consumesCounters``
  is allocatable only if, with the counters of the devices this allocation already picked and its
  own, *every* counter of the pool stays within what is available (so an over-consumed counter
  blocks the whole pool's partitions); backtracking gives the counters back. Without the
  ``DRAPartitionableDevices`` gate such devices are never allocated. A pool whose devices name a
  counter set or counter it lacks, or with two counter sets of one name, is invalid
  (``getAndValidateCounterSets`` / ``validateDeviceCounterConsumption``): none of its devices is.

Not reproduced: prioritized lists (firstAvailable), admin access, device taints' tolerations,
binding conditions, shared (``allowMultipleAllocations``) devices that also consume counters, and
CEL beyond the subset our DeviceClasses use. Like the real allocator there is **no scoring**: a
caller picks among feasible nodes itself.
"""
from __future__ import annotations

import re
import uuid as uuidlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

from kubernetes.utils import parse_quantity

from deviceplugin.dra.validation import pool_counter_errors

Obj = dict[str, Any]
MiB = 1024 * 1024


class AllocationError(ValueError):
    """A claim or class the stand-in cannot evaluate (bad CEL, unknown class): fatal, as upstream."""


# -- a CEL subset: enough for DeviceClass/request selectors over device.driver/attributes/capacity ----
_TOKEN = re.compile(r'\s*(?:(?P<str>"(?:[^"\\]|\\.)*")|(?P<num>\d+)|(?P<op>==|!=|<=|>=|&&|\|\||[<>!().\[\]])|'
                    r'(?P<id>[A-Za-z_][A-Za-z0-9_]*))')


def _tokens(text: str) -> list[tuple[str, Any]]:
    out, pos = [], 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise AllocationError(f"CEL (stand-in subset): cannot read {text[pos:]!r}")
        pos = m.end()
        if m["str"] is not None:
            out.append(("lit", m["str"][1:-1].replace('\\"', '"')))
        elif m["num"] is not None:
            out.append(("lit", int(m["num"])))
        elif m["op"] is not None:
            out.append(("op", m["op"]))
        else:
            word = m["id"]
            out.append(("lit", word == "true") if word in ("true", "false") else ("id", word))
    return out


class _Missing(Exception):
    """CEL's "no such key": an error value, absorbed by ``false && _`` and ``true || _``."""


class _Parser:
    def __init__(self, text: str, env: Mapping[str, Any]) -> None:
        self.toks, self.i, self.env, self.text = _tokens(text), 0, env, text

    def peek(self) -> tuple[str, Any] | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, op: str | None = None) -> tuple[str, Any]:
        tok = self.peek()
        if tok is None or (op is not None and tok != ("op", op)):
            raise AllocationError(f"CEL (stand-in subset): expected {op or 'more'} in {self.text!r}")
        self.i += 1
        return tok

    def parse(self) -> Any:
        value = self._lazy(self.or_)
        if self.peek() is not None:
            raise AllocationError(f"CEL (stand-in subset): trailing {self.peek()} in {self.text!r}")
        if isinstance(value, _Missing):
            raise value
        return value

    def _lazy(self, parse: Callable[[], Any]) -> Any:
        try:
            return parse()
        except _Missing as exc:
            return exc

    def or_(self) -> Any:
        left = self._lazy(self.and_)
        while self.peek() == ("op", "||"):
            self.take()
            right = self._lazy(self.and_)
            left = True if left is True or right is True else (left if isinstance(left, _Missing) else right)
        if isinstance(left, _Missing):
            raise left
        return left

    def and_(self) -> Any:
        left = self._lazy(self.cmp)
        while self.peek() == ("op", "&&"):
            self.take()
            right = self._lazy(self.cmp)
            left = False if left is False or right is False else (left if isinstance(left, _Missing) else right)
        if isinstance(left, _Missing):
            raise left
        return left

    def cmp(self) -> Any:
        left = self._lazy(self.unary)  # parse both sides before raising, so parsing stays in step
        tok = self.peek()
        if tok and tok[0] == "op" and tok[1] in ("==", "!=", "<", "<=", ">", ">="):
            self.take()
            right = self._lazy(self.unary)
            for side in (left, right):
                if isinstance(side, _Missing):
                    raise side
            ops: dict[str, Callable[[Any, Any], bool]] = {
                "==": lambda a, b: a == b, "!=": lambda a, b: a != b, "<": lambda a, b: a < b,
                "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, ">=": lambda a, b: a >= b}
            return ops[tok[1]](left, right)
        if isinstance(left, _Missing):
            raise left
        return left

    def unary(self) -> Any:
        if self.peek() == ("op", "!"):
            self.take()
            return not self.unary()
        if self.peek() == ("op", "("):
            self.take()
            value = self.or_()
            self.take(")")
            return value
        if self.peek() == ("id", "has") and self.toks[self.i + 1:self.i + 2] == [("op", "(")]:
            self.take()  # the has() macro: is the last field of the path there? (never an error itself)
            self.take("(")
            start = self.i
            present = not isinstance(self._lazy(self.unary), _Missing)
            # cel-go's macro takes a field selection ``e.f`` only: an index or a bare name does not compile
            if self.i - start < 3 or self.toks[self.i - 2] != ("op", "."):
                raise AllocationError(f"CEL: invalid argument to has() macro in {self.text!r}")
            self.take(")")
            return present
        kind, value = self.take()
        if kind == "lit":
            return value
        if kind != "id" or value not in self.env:
            raise AllocationError(f"CEL (stand-in subset): unknown name {value!r} in {self.text!r}")
        current, missing = self.env[value], None
        while self.peek() in (("op", "."), ("op", "[")):  # read the whole path, even past a missing key
            if self.take()[1] == ".":
                key = self.take()[1]
            else:
                key = self.take()[1]
                self.take("]")
            if missing is None and (not isinstance(current, Mapping) or key not in current):
                missing = _Missing(f"no such key: {key}")
            current = current[key] if missing is None else None
        if missing is not None:
            raise missing
        return current


class _Domains(dict):  # type: ignore[type-arg]
    """``device.attributes`` / ``device.capacity``: an unknown domain is an empty map, not an error
    (CELDeviceSelector: "If an unknown prefix is used as a lookup ... an empty map will be returned")."""

    def __contains__(self, key: object) -> bool:
        return True

    def __missing__(self, key: str) -> dict[str, Any]:
        return {}


def cel_eval(expression: str, device: Obj, driver: str) -> bool:
    """Evaluate a selector over ``device`` as the scheduler's CEL environment shows it.

    ``device.attributes[domain][name]`` and ``device.capacity[domain][name]``, where unqualified
    names belong to the driver's domain (an unknown domain is an empty map); ``device.driver``;
    ``device.allowMultipleAllocations``. A missing key is a runtime error (fatal for the allocation)
    unless short-circuited away or asked with the ``has()`` macro.
    """
    def by_domain(entries: Mapping[str, Any], value: Callable[[Any], Any]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for name, v in entries.items():
            domain, _, ident = name.rpartition("/")
            out.setdefault(domain or driver, {})[ident] = value(v)
        return out

    attrs = _Domains(by_domain(device.get("attributes") or {}, lambda a: next(iter(a.values()))))
    caps = _Domains(by_domain(device.get("capacity") or {}, lambda c: int(parse_quantity(c["value"]))))
    env = {"device": {"driver": driver, "attributes": attrs, "capacity": caps,
                      "allowMultipleAllocations": bool(device.get("allowMultipleAllocations"))}}
    try:
        result = _Parser(expression, env).parse()
    except _Missing as exc:
        raise AllocationError(f"CEL runtime error in {expression!r}: {exc}") from None
    if not isinstance(result, bool):
        raise AllocationError(f"CEL {expression!r} is not a boolean")
    return result


# -- consumable capacity (consumable_capacity.go) ------------------------------------------------------
def _q(value: Any) -> int:
    return int(parse_quantity(value))


def consumed_capacity(requested: int | None, capacity: Obj) -> int:
    """``calculateConsumedCapacity``: the amount a request consumes under the device's request policy."""
    policy = capacity.get("requestPolicy")
    if requested is None:
        if policy and policy.get("default") is not None:
            return _q(policy["default"])
        return _q(capacity["value"])
    if not policy:
        return requested
    rng = policy.get("validRange")
    if rng and rng.get("min") is not None:  # roundUpRange
        low = _q(rng["min"])
        if requested < low:
            return low
        if rng.get("step") is None:
            return requested
        step = _q(rng["step"])
        n = -(-(requested - low) // step)
        return low + n * step
    values = [_q(v) for v in policy.get("validValues") or ()]
    if values:  # roundUpValidValues
        return next((v for v in values if requested <= v), requested)
    return requested


def violates_policy(consumed: int, capacity: Obj) -> bool:
    """``violatesPolicy``: above validRange.max, off the step grid, or not one of validValues."""
    policy = capacity.get("requestPolicy")
    if not policy:
        return False
    if policy.get("default") is not None and consumed == _q(policy["default"]):
        return False
    rng = policy.get("validRange")
    if rng:
        if rng.get("max") is not None and consumed > _q(rng["max"]):
            return True
        if rng.get("step") is not None and (consumed - _q(rng["min"])) % _q(rng["step"]) != 0:
            return True
        return False
    values = [_q(v) for v in policy.get("validValues") or ()]
    return bool(values) and consumed not in values


def quantity(n: int) -> str:
    """Bytes as the API would print them (binary suffix when exact)."""
    for suffix, size in (("Gi", 1024 ** 3), ("Mi", MiB), ("Ki", 1024)):
        if n and n % size == 0:
            return f"{n // size}{suffix}"
    return str(n)


# -- the allocator ----------------------------------------------------------------------------------
Counters = dict[str, dict[str, Any]]  # counter set -> counter -> amount (a Decimal)


@dataclass(frozen=True)
class Candidate:
    driver: str
    pool: str
    device: Obj

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.driver, self.pool, self.device["name"])

    @property
    def shared(self) -> bool:
        return bool(self.device.get("allowMultipleAllocations"))

    def attribute(self, name: str) -> Any:
        """A constraint's attribute: fully qualified, or unqualified in the driver's domain."""
        attrs = self.device.get("attributes") or {}
        domain, _, ident = name.rpartition("/")
        for key in ((ident,) if domain == self.driver else ()) + (name,):
            if key in attrs:
                return next(iter(attrs[key].values()))
        return None


def counters_of(device: Obj) -> Counters:
    """A device's ``consumesCounters`` as amounts."""
    return {c["counterSet"]: {n: parse_quantity(v["value"]) for n, v in (c.get("counters") or {}).items()}
            for c in device.get("consumesCounters") or ()}


def pool_counters(slices: Iterable[Obj], node: str) -> dict[tuple[str, str], Counters]:
    """Per complete, valid pool of the node: its counter sets as amounts (what nothing consumed yet)."""
    out: dict[tuple[str, str], Counters] = {}
    for (driver, pool), current in _current_pools(slices, node).items():
        out[(driver, pool)] = {cs["name"]: {n: parse_quantity(v["value"]) for n, v in (cs.get("counters") or {}).items()}
                               for m in current for cs in m["spec"].get("sharedCounters") or ()}
    return out


def _current_pools(slices: Iterable[Obj], node: str) -> dict[tuple[str, str], list[Obj]]:
    """The node's pools: newest generation, complete and valid only (pools_experimental.go GatherPools)."""
    pools: dict[tuple[str, str], list[Obj]] = {}
    for s in slices:
        spec = s.get("spec") or {}
        if spec.get("nodeName") != node:
            continue
        pools.setdefault((spec["driver"], spec["pool"]["name"]), []).append(s)
    out: dict[tuple[str, str], list[Obj]] = {}
    for (driver, pool), members in sorted(pools.items()):
        newest = max(int(m["spec"]["pool"].get("generation", 0)) for m in members)
        current = sorted((m for m in members if int(m["spec"]["pool"].get("generation", 0)) == newest),
                         key=lambda m: m["metadata"]["name"])
        if len(current) != int(current[0]["spec"]["pool"].get("resourceSliceCount", 1)):
            continue  # incomplete pool: the allocator waits for the driver to finish publishing
        if pool_counter_errors(current):
            continue  # invalid pool: no device of it is allocatable
        out[(driver, pool)] = current
    return out


def complete_pools(slices: Iterable[Obj], node: str) -> list[Candidate]:
    """Devices of the node's complete, valid pools, newest generation only, in pool then slice order."""
    out = []
    for (driver, pool), current in _current_pools(slices, node).items():
        for m in current:
            for d in m["spec"].get("devices") or ():
                if any(t.get("effect") in ("NoSchedule", "NoExecute") for t in d.get("taints") or ()):
                    continue
                out.append(Candidate(driver, pool, d))
    return out


def in_use(claims: Iterable[Obj]) -> tuple[set[tuple[str, str, str]], dict[tuple[str, str, str], int]]:
    """Devices held whole by allocated claims, and memory consumed per shared device (bytes)."""
    whole: set[tuple[str, str, str]] = set()
    consumed: dict[tuple[str, str, str], int] = {}
    for c in claims:
        alloc = (c.get("status") or {}).get("allocation") or {}
        for r in (alloc.get("devices") or {}).get("results") or ():
            key = (r["driver"], r["pool"], r["device"])
            if r.get("shareID"):
                mem = (r.get("consumedCapacity") or {}).get("memory")
                consumed[key] = consumed.get(key, 0) + (_q(mem) if mem is not None else 0)
            else:
                whole.add(key)
    return whole, consumed


@dataclass(frozen=True)
class _Slot:
    request: Obj
    selectors: tuple[str, ...]
    memory: int | None


def _slots(claim: Obj, classes: Mapping[str, Obj]) -> list[_Slot]:
    out = []
    for req in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or ():
        exactly = req.get("exactly")
        if exactly is None:
            raise AllocationError(f"request {req.get('name')}: only 'exactly' requests are supported by the stand-in")
        cls = classes.get(exactly.get("deviceClassName", ""))
        if cls is None:
            raise AllocationError(f"request {req.get('name')}: DeviceClass {exactly.get('deviceClassName')!r} "
                                  "not found")
        selectors = tuple(s["cel"]["expression"] for s in (cls.get("spec") or {}).get("selectors") or ()) + \
            tuple(s["cel"]["expression"] for s in exactly.get("selectors") or ())
        mem = ((exactly.get("capacity") or {}).get("requests") or {}).get("memory")
        if exactly.get("allocationMode", "ExactCount") != "ExactCount":
            raise AllocationError(f"request {req.get('name')}: allocationMode All is not supported by the stand-in")
        for _ in range(int(exactly.get("count", 1))):
            out.append(_Slot(req, selectors, _q(mem) if mem is not None else None))
    return out


def available_counters(slices: Sequence[Obj], node: str, whole: set[tuple[str, str, str]]
                       ) -> dict[tuple[str, str], Counters]:
    """checkAvailableCounters' first half: each pool's counter sets minus what the devices allocated
    to other claims consume (never clamped: below zero means none left)."""
    avail = pool_counters(slices, node)
    for c in complete_pools(slices, node):
        if c.key not in whole or (c.driver, c.pool) not in avail:
            continue
        for cs, counters in counters_of(c.device).items():
            have = avail[(c.driver, c.pool)].get(cs)
            for name, amount in counters.items():
                if have is not None and name in have:  # validation guarantees it; skipped otherwise
                    have[name] -= amount
    return avail


def counters_fit(available: Counters, picked: Sequence[Counters]) -> bool:
    """checkAvailableCounters' second half: with every device picked so far in this pool (the last one
    the candidate), no counter of the pool is consumed past what is available."""
    for cs, counters in available.items():
        for name, have in counters.items():
            if have < sum((p.get(cs, {}).get(name, 0) for p in picked), parse_quantity("0")):
                return False
    return True


def allocate(claim: Obj, node: str, slices: Sequence[Obj], classes: Mapping[str, Obj],
             allocated: Sequence[Obj], new_share_id: Callable[[], str] = lambda: str(uuidlib.uuid4()),
             partitionable: bool = True) -> Obj | None:
    """The allocation of ``claim`` on ``node`` (``status.allocation``), or ``None`` when it does not fit.

    ``partitionable``: kube-scheduler's DRAPartitionableDevices gate (devices that consume counters are
    never allocated without it)."""
    slots = _slots(claim, classes)
    candidates = complete_pools(slices, node)
    whole, consumed = in_use(allocated)
    counters = available_counters(slices, node, whole)
    constraints = ((claim.get("spec") or {}).get("devices") or {}).get("constraints") or ()
    chosen: list[tuple[_Slot, Candidate, int | None]] = []

    def fits(slot: _Slot, cand: Candidate) -> int | None | bool:
        if not all(cel_eval(expr, cand.device, cand.driver) for expr in slot.selectors):
            return False
        if not cand.shared:
            if slot.memory is not None and "memory" not in (cand.device.get("capacity") or {}):
                return False
            taken = cand.key in whole or any(c.key == cand.key for _, c, _ in chosen)
            if taken:
                return False
            if cand.device.get("consumesCounters"):
                if not partitionable:
                    return False
                picked = [counters_of(c.device) for _, c, _ in chosen if (c.driver, c.pool) == (cand.driver, cand.pool)]
                if not counters_fit(counters.get((cand.driver, cand.pool), {}), picked + [counters_of(cand.device)]):
                    return False
            return None
        cap = (cand.device.get("capacity") or {}).get("memory")
        if cap is None:
            return False
        amount = consumed_capacity(slot.memory, cap)
        if violates_policy(amount, cap):
            return False
        mine = sum(m or 0 for _, c, m in chosen if c.key == cand.key)
        if consumed.get(cand.key, 0) + mine + amount > _q(cap["value"]):
            return False
        return amount

    def constraints_hold() -> bool:
        for con in constraints:
            names = set(con.get("requests") or ()) or {s.request["name"] for s, _, _ in chosen}
            picked = [c for s, c, _ in chosen if s.request["name"] in names]
            if "matchAttribute" in con:
                values = [c.attribute(con["matchAttribute"]) for c in picked]
                if any(v is None for v in values) or len(set(map(repr, values))) > 1:
                    return False
            if "distinctAttribute" in con:
                values = [c.attribute(con["distinctAttribute"]) for c in picked]
                if any(v is None for v in values) or len(set(map(repr, values))) != len(values):
                    return False
        return True

    def search(i: int) -> bool:  # allocateOne: depth first, backtracking
        if i == len(slots):
            return True
        for cand in candidates:
            amount = fits(slots[i], cand)
            if amount is False:
                continue
            chosen.append((slots[i], cand, amount))  # type: ignore[arg-type]
            if constraints_hold() and search(i + 1):
                return True
            chosen.pop()
        return False

    if not search(0):
        return None
    results = []
    for slot, cand, amount in chosen:
        r: Obj = {"request": slot.request["name"], "driver": cand.driver, "pool": cand.pool,
                  "device": cand.device["name"]}
        if cand.shared:
            r["shareID"] = new_share_id()
            r["consumedCapacity"] = {"memory": quantity(int(amount or 0))}
        results.append(r)
    return {"devices": {"results": results},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [node]}]}]}}
