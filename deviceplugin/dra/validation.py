"""The API server's ResourceSlice validation, ported: what a ``resource.k8s.io/v1`` slice must be.

A slice the API server refuses takes every device in it off the node, so the publisher checks each
device before it publishes (an invalid one is left out with the reason logged, never the others)
and the API server double enforces the same rules where ResourceSlices are stored.

Ported from kubernetes ``pkg/apis/resource/validation/validation.go``: ``ValidateResourceSlice`` /
``ValidateResourceSliceUpdate`` -> ``validateResourceSliceSpec`` (driver, pool, exactly one node
selection, devices or sharedCounters, the device count limits), ``validateDevice`` (name, the
attribute+capacity limit, ``validateDeviceAttribute``, ``validateQualifiedName``, capacities with
``validateMultiAllocatableDeviceCapacity`` / ``validateSingleAllocatableDeviceCapacity`` ->
``validateRequestPolicy`` -> ``validateRequestPolicyValidValues`` / ``validateRequestPolicyRange``
(+ ``validateRequestPolicyRangeStep`` on the integer path), taints), with the limits of
``pkg/apis/resource/types.go``. Messages are ``field.Error`` strings (``<path>: Invalid value: ...``).
Partitionable devices (KEP-4815, feature gate ``DRAPartitionableDevices``): ``validateCounterSet``,
``validateDeviceCounterConsumption`` (``validateCounterName`` = a DNS label, ``validateDeviceCounter``:
any parsed quantity) with the ``validateSet`` / ``validateMap`` size short-circuits; the gate's field
dropping on write (``pkg/registry/resource/resourceslice/strategy.go``
``dropDisabledDRAPartitionableDevicesFields``: a server without the gate silently clears
``sharedCounters`` and ``consumesCounters``); and the pool-level checks the allocator applies
(``structured`` pools: ``getAndValidateCounterSets``, ``validateDeviceCounterConsumption``: a device
naming an unknown counter set or counter makes the whole pool unallocatable).
Not ported (this plugin never writes them): per-device node selection beyond its mutual exclusion,
binding conditions, node-allocatable mappings, list-typed attributes, ``partitionTypeAttribute``.
Pure: dicts in, a list of error strings out.
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Any, Mapping

from vramshare import quantity

# pkg/apis/resource/types.go
RESOURCE_SLICE_MAX_DEVICES = 128
RESOURCE_SLICE_MAX_DEVICES_WITH_ADVANCED_FEATURES = 64  # taints, consumesCounters or list attributes
MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE = 32
DEVICE_MAX_DOMAIN_LENGTH = 63
DEVICE_MAX_ID_LENGTH = 32
DEVICE_ATTRIBUTE_MAX_VALUE_LENGTH = 64
DEVICE_TAINTS_MAX_LENGTH = 4  # 4 in 1.33/1.34 (raised later): the strictest served version
POOL_NAME_MAX_LENGTH = 253
CAPACITY_REQUEST_POLICY_DISCRETE_MAX_OPTIONS = 10
# KEP-4815 partitionable devices (staging/src/k8s.io/api/resource/v1/types.go)
RESOURCE_SLICE_MAX_COUNTER_SETS = 8  # spec.sharedCounters of one slice
RESOURCE_SLICE_MAX_COUNTERS_PER_COUNTER_SET = 32
RESOURCE_SLICE_MAX_DEVICE_COUNTER_CONSUMPTIONS_PER_DEVICE = 2  # device.consumesCounters
RESOURCE_SLICE_MAX_COUNTERS_PER_DEVICE_COUNTER_CONSUMPTION = 32
MAX_INT64 = 2**63 - 1

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
                     r"(-(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(\.(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*)?"
                     r"(\+[0-9a-zA-Z-]+(\.[0-9a-zA-Z-]+)*)?$")
_TAINT_EFFECTS = ("NoSchedule", "NoExecute")
_ATTRIBUTE_KINDS = ("bool", "int", "string", "version")
_LIST_KINDS = ("bools", "ints", "strings", "versions")

Errors = list[str]


# -- field.Error shapes ----------------------------------------------------------------------------
def _show(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else str(value)


def invalid(path: str, value: Any, detail: str) -> str:
    return f"{path}: Invalid value: {_show(value)}: {detail}"


def required(path: str, detail: str = "") -> str:
    return f"{path}: Required value" + (f": {detail}" if detail else "")


def forbidden(path: str, detail: str) -> str:
    return f"{path}: Forbidden: {detail}"


def too_long(path: str, limit: int) -> str:
    return f"{path}: Too long: may not be more than {limit} bytes"


def too_many(path: str, count: int, limit: int) -> str:
    return f"{path}: Too many: {count}: must have at most {limit} items"


def duplicate(path: str, value: Any) -> str:
    return f"{path}: Duplicate value: {_show(value)}"


# -- names ------------------------------------------------------------------------------------------
def dns_label(name: Any, path: str) -> Errors:
    if not isinstance(name, str) or len(name) > 63 or not _DNS_LABEL.match(name):
        return [invalid(path, name, "a lowercase RFC 1123 label must consist of lower case alphanumeric characters "
                                    "or '-', and must start and end with an alphanumeric character")]
    return []


def dns_subdomain(name: Any, path: str) -> Errors:
    if not isinstance(name, str) or len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        return [invalid(path, name, "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric "
                                    "characters, '-' or '.', and must start and end with an alphanumeric character")]
    return []


def driver_name(name: Any, path: str) -> Errors:
    """corevalidation.ValidateCSIDriverName (what validateDriverName reuses)."""
    if not name:
        return [required(path)]
    if not isinstance(name, str):
        return [invalid(path, name, "must be a string")]
    if len(name) > 63:
        return [too_long(path, 63)]
    return dns_subdomain(name.lower(), path)


def _pool_name(name: Any, path: str) -> Errors:
    if not name:
        return [required(path)]
    if not isinstance(name, str):
        return [invalid(path, name, "must be a string")]
    out = [too_long(path, POOL_NAME_MAX_LENGTH)] if len(name) > POOL_NAME_MAX_LENGTH else []
    for part in name.split("/"):
        out += dns_subdomain(part, path)
    return out


def _c_identifier(part: str, path: str) -> Errors:
    out = [too_long(path, DEVICE_MAX_ID_LENGTH)] if len(part) > DEVICE_MAX_ID_LENGTH else []
    if not _C_IDENTIFIER.match(part):
        out.append(invalid(path, part, "a valid C identifier must start with alphabetic character or '_', "
                                       "followed by a string of alphanumeric characters or '_'"))
    return out


def qualified_name(name: Any, path: str) -> Errors:
    """validateQualifiedName: ``<C identifier>`` or ``<driver-like domain>/<C identifier>``."""
    if not isinstance(name, str):
        return [invalid(path, name, "must be a string")]
    parts = name.split("/")
    if len(parts) == 1:
        return _c_identifier(parts[0], path)
    if len(parts) == 2:
        out = [invalid(path, "", "the domain must not be empty")] if not parts[0] else driver_name(parts[0], path)
        out += [invalid(path, "", "the name must not be empty")] if not parts[1] else _c_identifier(parts[1], path)
        return out
    return [invalid(path, name, "must not contain more than one slash")]


def _label_key(key: Any, path: str) -> Errors:
    """A taint key: a qualified label key (``[prefix/]name``, name <= 63, prefix a DNS subdomain)."""
    if not isinstance(key, str) or not key:
        return [required(path)]
    prefix, _, name = key.rpartition("/")
    out = dns_subdomain(prefix, path) if prefix else []
    if not name or len(name) > 63 or not _LABEL_VALUE.match(name):
        out.append(invalid(path, key, "name part must consist of alphanumeric characters, '-', '_' or '.', "
                                      "and must start and end with an alphanumeric character"))
    return out


# -- quantities -------------------------------------------------------------------------------------
def _quantity(value: Any, path: str) -> tuple[Fraction | None, Errors]:
    try:
        return quantity.parse(value, path), []
    except quantity.QuantityError as exc:
        return None, [invalid(path, value, f"quantities must match the regular expression: {exc}")]


def canonical(q: Fraction, like: Any) -> str:
    """Quantity.String() for whole binary amounts (``81920Mi`` reads ``80Gi``): the largest binary
    suffix that keeps the number whole, when ``like`` was written with one; else the plain number."""
    if q.denominator != 1 or not (isinstance(like, str) and like.endswith("i")):
        return str(q.numerator) if q.denominator == 1 else str(float(q))
    n, suffix = q.numerator, ""
    for s in ("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"):
        if n == 0 or n % 1024:
            break
        n, suffix = n // 1024, s
    return f"{n}{suffix}"


def _int_value(q: Fraction) -> int:
    """Quantity.Value(): rounded up to a whole number."""
    return -(-q.numerator // q.denominator)


def _int64_range(q: Fraction, path: str) -> Errors:
    """validateInt64Range: the integer path only holds in [0, MaxInt64]."""
    if q < 0:
        return [invalid(path, str(q), "must be greater than or equal to 0")]
    if q > MAX_INT64:
        return [invalid(path, str(q), "must not be larger than 9223372036854775807")]
    return []


def request_policy_range(default: Fraction, capacity: Fraction, rng: Mapping[str, Any], path: str,
                         raw: Mapping[str, Any]) -> Errors:
    """validateRequestPolicyRange (the integer path: no fractional quantities in our slices)."""
    if rng.get("min") is None:
        return [required(f"{path}.min", "required when validRange is defined")]
    out: Errors = []
    lo, errs = _quantity(rng["min"], f"{path}.min")
    out += errs
    hi, errs = _quantity(rng["max"], f"{path}.max") if rng.get("max") is not None else (None, [])
    out += errs
    step, errs = _quantity(rng["step"], f"{path}.step") if rng.get("step") is not None else (None, [])
    out += errs
    if lo is None or errs or (rng.get("max") is not None and hi is None):
        return out
    cap = canonical(capacity, raw["value"])
    if lo > capacity:
        out.append(invalid(f"{path}.min", rng["min"], f"min is larger than capacity value: {cap}"))
    if default < lo:
        out.append(invalid(f"{path}.default", raw["default"], f"default is less than min: {rng['min']}"))
    if hi is not None:
        if lo > hi:
            out.append(invalid(f"{path}.max", rng["min"], f"min is larger than max: {rng['max']}"))
        if hi > capacity:
            out.append(invalid(f"{path}.max", rng["max"], f"max is larger than capacity value: {cap}"))
        if default > hi:
            out.append(invalid(f"{path}.default", raw["default"], f"default is more than max: {rng['max']}"))
    if step is not None:
        if step <= 0:
            out.append(invalid(f"{path}.step", rng["step"], "must be greater than zero"))
            return out
        if lo + step > capacity:
            out.append(invalid(f"{path}.step", rng["step"], f"one step {canonical(lo + step, rng['min'])} is "
                                                            f"larger than capacity value: {cap}"))
        unsafe = [e for name, q in (("default", default), ("min", lo), ("max", hi), ("step", step)) if q is not None
                  for e in _int64_range(q, f"{path}.{name}")]
        if unsafe:
            return out + unsafe
        for value, shown in ((default, raw["default"]),) + (((hi, rng["max"]),) if hi is not None else ()):
            if (_int_value(value) - _int_value(lo)) % _int_value(step) != 0:  # validateRequestPolicyRangeStep
                out.append(invalid(f"{path}.step", shown, f"value is not a multiple of a given step ({rng['step']}) "
                                                          f"from ({rng['min']})"))
    return out


def request_policy(capacity: Fraction, raw: Mapping[str, Any], path: str) -> Errors:
    """validateRequestPolicy + validateValidRequestValues."""
    policy = raw.get("requestPolicy") or {}
    values, rng = policy.get("validValues") or [], policy.get("validRange")
    if values and rng is not None:
        return [forbidden(path, 'exactly one policy can be specified, cannot specify "validValues" and '
                                '"validRange" at the same time')]
    if not values and rng is None:
        return []
    which = "validValues" if values else "validRange"
    if policy.get("default") is None:
        return [required(f"{path}.default", f"required when {which} is defined")]
    default, errs = _quantity(policy["default"], f"{path}.default")
    if default is None:
        return errs
    if rng is not None:
        return request_policy_range(default, capacity, rng, f"{path}.validRange",
                                    {"value": raw.get("value"), "default": policy["default"]})
    vpath = f"{path}.validValues"
    if len(values) > CAPACITY_REQUEST_POLICY_DISCRETE_MAX_OPTIONS:
        return [too_many(vpath, len(values), CAPACITY_REQUEST_POLICY_DISCRETE_MAX_OPTIONS)]
    out: Errors = []
    parsed: list[Fraction] = []
    for i, v in enumerate(values):
        q, errs = _quantity(v, f"{vpath}[{i}]")
        out += errs
        if q is not None:
            parsed.append(q)
    for i in range(len(parsed) - 1):
        if parsed[i] > parsed[i + 1]:
            out.append(invalid(f"{vpath}[{i + 1}]", values[i + 1], "values must be sorted in ascending order"))
    seen: set[int] = set()
    for i, q in enumerate(parsed):
        if q > capacity:
            out.append(invalid(f"{vpath}[{i}]", values[i], "option is larger than capacity value: "
                                                           f"{canonical(capacity, raw.get('value'))}"))
        if _int_value(q) in seen:
            out.append(duplicate(f"{vpath}[{i}]", str(_int_value(q))))
        seen.add(_int_value(q))
    if default not in parsed:
        out.append(invalid(vpath, policy["default"], "default value is not valid according to the requestPolicy"))
    return out


# -- devices ------------------------------------------------------------------------------------------
def _attribute(attr: Any, path: str) -> Errors:
    """validateDeviceAttribute: exactly one value; strings and versions at most 64 bytes."""
    if not isinstance(attr, Mapping):
        return [invalid(path, "", "exactly one value must be specified")]
    given = [k for k in _ATTRIBUTE_KINDS + _LIST_KINDS if attr.get(k) is not None]
    out: Errors = []
    for k in given:
        v = attr[k]
        if k in _LIST_KINDS and not v:
            out.append(invalid(f"{path}.{k}", "[]", "must not be empty if specified"))
        items = v if k in _LIST_KINDS and isinstance(v, list) else [v]
        for item in items:
            if k in ("string", "strings", "version", "versions"):
                if not isinstance(item, str):
                    out.append(invalid(f"{path}.{k}", item, "must be a string"))
                    continue
                if k.startswith("version") and not _SEMVER.match(item):
                    out.append(invalid(f"{path}.{k}", item, "must be a string compatible with semver.org spec 2.0.0"))
                if len(item) > DEVICE_ATTRIBUTE_MAX_VALUE_LENGTH:
                    out.append(too_long(f"{path}.{k}", DEVICE_ATTRIBUTE_MAX_VALUE_LENGTH))
            elif k.startswith("int") and (isinstance(item, bool) or not isinstance(item, int)
                                           or not -2**63 <= item <= MAX_INT64):
                out.append(invalid(f"{path}.{k}", item, "must be a 64-bit integer"))
            elif k.startswith("bool") and not isinstance(item, bool):
                out.append(invalid(f"{path}.{k}", item, "must be a boolean"))
    if len(given) != 1:
        out.append(invalid(path, "", "exactly one value must be specified"))
    return out


def _taint(taint: Any, path: str) -> Errors:
    if not isinstance(taint, Mapping):
        return [invalid(path, taint, "must be an object")]
    out = _label_key(taint.get("key"), f"{path}.key")
    value = taint.get("value", "")
    if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
        out.append(invalid(f"{path}.value", value, "a valid label must be an empty string or consist of "
                                                   "alphanumeric characters, '-', '_' or '.'"))
    effect = taint.get("effect")
    if not effect:
        out.append(required(f"{path}.effect"))
    elif effect not in _TAINT_EFFECTS:
        out.append(f'{path}.effect: Unsupported value: {_show(effect)}: supported values: '
                   + ", ".join(f'"{e}"' for e in _TAINT_EFFECTS))
    return out


def validate_device(device: Any, path: str, old: Mapping[str, Any] | None = None,
                    per_device_node_selection: bool = False) -> Errors:
    """validateDevice for one ``spec.devices[]`` entry."""
    if not isinstance(device, Mapping):
        return [invalid(path, device, "must be an object")]
    out = dns_label(device.get("name"), f"{path}.name")
    attrs, caps = device.get("attributes") or {}, device.get("capacity") or {}
    if not isinstance(attrs, Mapping) or not isinstance(caps, Mapping):
        return out + [invalid(path, "", "attributes and capacity must be maps")]
    if len(attrs) + len(caps) > MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE:
        out.append(invalid(path, len(attrs) + len(caps), "the total number of attributes and capacities must not "
                                                         f"exceed {MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE}"))
    for key in sorted(attrs, key=str):
        out += qualified_name(key, f"{path}.attributes")
        out += _attribute(attrs[key], f"{path}.attributes[{key}]")
    multiple = device.get("allowMultipleAllocations") is True
    if old is None or (old.get("capacity") or {}) != caps:  # unchanged capacity is not revalidated
        for key in sorted(caps, key=str):
            cpath = f"{path}.capacity[{key}]"
            out += qualified_name(key, f"{path}.capacity")
            cap = caps[key]
            if not isinstance(cap, Mapping):
                out.append(invalid(cpath, cap, "must be an object"))
                continue
            value, errs = _quantity(cap.get("value"), f"{cpath}.value")
            out += errs
            if cap.get("requestPolicy") is None:
                continue
            if not multiple:
                out.append(forbidden(f"{cpath}.requestPolicy", "allowMultipleAllocations must be true"))
            elif value is not None:
                out += request_policy(value, cap, f"{cpath}.requestPolicy")
    taints = device.get("taints") or []
    if old is None or (old.get("taints") or []) != taints:
        if len(taints) > DEVICE_TAINTS_MAX_LENGTH:
            out.append(too_many(f"{path}.taints", len(taints), DEVICE_TAINTS_MAX_LENGTH))
        else:
            for i, t in enumerate(taints):
                out += _taint(t, f"{path}.taints[{i}]")
    out += _validate_set(device.get("consumesCounters"), RESOURCE_SLICE_MAX_DEVICE_COUNTER_CONSUMPTIONS_PER_DEVICE,
                         validate_device_counter_consumption, lambda c: c.get("counterSet") if isinstance(c, Mapping)
                         else None, f"{path}.consumesCounters")
    if not per_device_node_selection and any(device.get(k) is not None for k in ("nodeName", "nodeSelector",
                                                                                  "allNodes")):
        out.append(invalid(path, "null", "`nodeName`, `nodeSelector` and `allNodes` can only be set if "
                                         "`perDeviceNodeSelection` is set to true in the ResourceSlice spec"))
    return out


def _advanced(devices: list[Any]) -> bool:
    """haveDeviceTaints || haveConsumesCounters || haveListAttributes."""
    for d in devices:
        if not isinstance(d, Mapping):
            continue
        if d.get("taints") or d.get("consumesCounters"):
            return True
        if any(isinstance(a, Mapping) and any(a.get(k) is not None for k in _LIST_KINDS)
               for a in (d.get("attributes") or {}).values()):
            return True
    return False


def max_devices(devices: list[Any]) -> int:
    return RESOURCE_SLICE_MAX_DEVICES_WITH_ADVANCED_FEATURES if _advanced(devices) else RESOURCE_SLICE_MAX_DEVICES


def validate_resource_slice(obj: Mapping[str, Any], old: Mapping[str, Any] | None = None) -> Errors:
    """ValidateResourceSlice (``old`` None) / ValidateResourceSliceUpdate; ``[]`` when the server accepts it."""
    meta = obj.get("metadata") or {}
    out = dns_subdomain(meta["name"], "metadata.name") if meta.get("name") else []
    spec = obj.get("spec")
    if not isinstance(spec, Mapping):
        return out + [required("spec")]
    old_spec = (old or {}).get("spec") or {} if old is not None else None
    out += driver_name(spec.get("driver"), "spec.driver")
    pool = spec.get("pool") or {}
    out += _pool_name(pool.get("name"), "spec.pool.name")
    count, generation = pool.get("resourceSliceCount", 0), pool.get("generation", 0)
    if not isinstance(count, int) or count <= 0:
        out.append(invalid("spec.pool.resourceSliceCount", count, "must be greater than zero"))
    if not isinstance(generation, int) or generation < 0:
        out.append(invalid("spec.pool.generation", generation, "must be greater than or equal to zero"))
    if old_spec is not None:
        for field, new, was in (("spec.pool.name", pool.get("name"), (old_spec.get("pool") or {}).get("name")),
                                ("spec.driver", spec.get("driver"), old_spec.get("driver")),
                                ("spec.nodeName", spec.get("nodeName"), old_spec.get("nodeName"))):
            if new != was:
                out.append(invalid(field, new, "field is immutable"))
    selected = []
    if spec.get("nodeName") is not None:
        if spec["nodeName"]:
            selected.append("`nodeName`")
            out += dns_subdomain(spec["nodeName"], "spec.nodeName")
        else:
            out.append(invalid("spec.nodeName", "", "must be either unset or set to a non-empty string"))
    if spec.get("nodeSelector") is not None:
        selected.append("`nodeSelector`")
        if len((spec["nodeSelector"] or {}).get("nodeSelectorTerms") or []) != 1:
            out.append(invalid("spec.nodeSelector.nodeSelectorTerms", "", "must have exactly one node selector term"))
    for flag in ("allNodes", "perDeviceNodeSelection"):
        if spec.get(flag) is not None:
            if spec[flag] is True:
                selected.append(f"`{flag}`")
            else:
                out.append(invalid(f"spec.{flag}", spec[flag], "must be either unset or set to true"))
    which = "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required"
    if not selected:
        out.append(required("spec", which))
    elif len(selected) > 1:
        out.append(invalid("spec", "{" + ", ".join(selected) + "}", which + ", but multiple fields are set"))
    devices = spec.get("devices")
    if spec.get("sharedCounters") is not None and devices is not None:
        out.append(invalid("spec", "", "only one of `sharedCounters` or `devices` is allowed"))
    devices = list(devices or [])
    limit = max_devices(devices)
    if len(devices) > limit:  # validateSet: the size check short-circuits
        out.append(too_many("spec.devices", len(devices), limit))
    else:
        olds = {d.get("name"): d for d in (old_spec or {}).get("devices") or () if isinstance(d, Mapping)}
        seen: set[Any] = set()
        for i, d in enumerate(devices):
            name = d.get("name") if isinstance(d, Mapping) else None
            out += validate_device(d, f"spec.devices[{i}]", olds.get(name), spec.get("perDeviceNodeSelection") is True)
            if name in seen:
                out.append(duplicate(f"spec.devices[{i}]", name))
            seen.add(name)
    out += _validate_set(spec.get("sharedCounters"), RESOURCE_SLICE_MAX_COUNTER_SETS, validate_counter_set,
                         lambda c: c.get("name") if isinstance(c, Mapping) else None, "spec.sharedCounters")
    return out


# -- partitionable devices (KEP-4815) ---------------------------------------------------------------
def _validate_set(items: Any, limit: int, check: Any, key: Any, path: str) -> Errors:
    """validateSet: too many short-circuits; each item checked; a repeated key is a duplicate."""
    if items is None:
        return []
    if not isinstance(items, list):
        return [invalid(path, items, "must be a list")]
    if len(items) > limit:
        return [too_many(path, len(items), limit)]
    out: Errors = []
    seen: set[Any] = set()
    for i, item in enumerate(items):
        out += check(item, f"{path}[{i}]")
        k = key(item)
        if k in seen:
            out.append(duplicate(f"{path}[{i}]", k))
        seen.add(k)
    return out


def _counters(counters: Any, limit: int, path: str) -> Errors:
    """validateMap with validateCounterName keys (DNS labels, checked on the map's path as upstream
    does) and validateDeviceCounter items (``{value: <quantity>}``: any quantity that parses)."""
    if not isinstance(counters, Mapping):
        return [invalid(path, counters, "must be a map")]
    if len(counters) > limit:  # maxSize short-circuits
        return [too_many(path, len(counters), limit)]
    out: Errors = []
    for name in sorted(counters, key=str):
        out += dns_label(name, path)
        counter = counters[name]
        if not isinstance(counter, Mapping) or counter.get("value") is None:
            out.append(required(f"{path}[{name}].value"))
        else:
            out += _quantity(counter["value"], f"{path}[{name}].value")[1]
    return out


def validate_counter_set(counter_set: Any, path: str) -> Errors:
    """validateCounterSet: a DNS-label name and 1..32 counters."""
    return _named_counters(counter_set, path, "name", RESOURCE_SLICE_MAX_COUNTERS_PER_COUNTER_SET)


def validate_device_counter_consumption(consumption: Any, path: str) -> Errors:
    """validateDeviceCounterConsumption: a DNS-label counterSet and 1..32 counters."""
    return _named_counters(consumption, path, "counterSet", RESOURCE_SLICE_MAX_COUNTERS_PER_DEVICE_COUNTER_CONSUMPTION)


def _named_counters(obj: Any, path: str, name_key: str, limit: int) -> Errors:
    """What both upstream functions check: ``name_key`` a required DNS label, ``counters`` required
    and at most ``limit``."""
    if not isinstance(obj, Mapping):
        return [invalid(path, obj, "must be an object")]
    name = obj.get(name_key)
    out = [required(f"{path}.{name_key}")] if not name else dns_label(name, f"{path}.{name_key}")
    counters = obj.get("counters")
    if not counters:
        out.append(required(f"{path}.counters"))
    else:
        out += _counters(counters, limit, f"{path}.counters")
    return out


def partitionable_in_use(obj: Mapping[str, Any] | None) -> bool:
    """strategy.go draPartitionableDevicesFeatureInUse."""
    spec = (obj or {}).get("spec") or {}
    if spec.get("sharedCounters") or spec.get("perDeviceNodeSelection") is not None:
        return True
    return any(isinstance(d, Mapping) and (d.get("consumesCounters") or any(d.get(k) is not None for k in
                                                                          ("nodeName", "nodeSelector", "allNodes")))
               for d in spec.get("devices") or ())


def drop_disabled_partitionable_fields(new: dict[str, Any], old: Mapping[str, Any] | None, enabled: bool) -> None:
    """strategy.go dropDisabledDRAPartitionableDevicesFields: without the DRAPartitionableDevices gate
    (and unless the stored object already uses the fields) the server clears them and stores the rest,
    silently: a slice's devices then consume no counters at all."""
    if enabled or partitionable_in_use(old):
        return
    spec = new.get("spec") or {}
    spec.pop("sharedCounters", None)
    spec.pop("perDeviceNodeSelection", None)
    for d in spec.get("devices") or ():
        if isinstance(d, dict):
            for k in ("consumesCounters", "nodeName", "nodeSelector", "allNodes"):
                d.pop(k, None)


def pool_counter_errors(slices: list[Mapping[str, Any]]) -> Errors:
    """A pool's cross-slice counter checks (structured pools ``getAndValidateCounterSets`` then
    ``validateDeviceCounterConsumption``); upstream stops at the first, which marks the pool invalid."""
    sets: dict[str, Mapping[str, Any]] = {}
    for s in slices:
        for cs in (s.get("spec") or {}).get("sharedCounters") or ():
            if cs.get("name") in sets:
                return [f"duplicate counter set name {cs.get('name')}"]
            sets[cs.get("name")] = cs.get("counters") or {}
    for s in slices:
        for d in (s.get("spec") or {}).get("devices") or ():
            for c in d.get("consumesCounters") or ():
                found = sets.get(c.get("counterSet"))
                if found is None:
                    return [f"counter set {c.get('counterSet')} not found"]
                for name in c.get("counters") or {}:
                    if name not in found:
                        return [f"counter {name} not found in counter set {c.get('counterSet')}"]
    return []


def device_errors(device: Mapping[str, Any]) -> Errors:
    """A device's own errors, as it would be checked in a slice of its own (what the publisher filters by)."""
    return validate_device(device, "device", None)
