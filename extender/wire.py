"""kube-scheduler's extender/v1 wire types, converted to and from plain Python data.

The Go types in ``k8s.io/kube-scheduler/extender/v1`` carry no ``json`` tags, so every key is the
capitalised Go field name (``Pod``, ``NodeNames``, ``FailedNodes``, ``Host``, ``Score``...) while the
embedded ``Pod`` and ``Node`` objects keep their ordinary lowercase Kubernetes JSON. Go's decoder matches
keys case-insensitively, so we read them the same way but always *write* the exact capitalised form that
``extender/v1/types_test.go`` pins down. Nothing here knows about GPUs: the verbs work on the dataclasses
below and this module only turns them into bytes, so the golden tests can assert the bytes exactly.
"""
from __future__ import annotations

import operator
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import orjson

from vramshare.contract import MAX_EXTENDER_PRIORITY

__all__ = [
    "WireError", "ExtenderArgs", "FilterResult", "BindingArgs", "PreemptionArgs", "NameLists",
    "decode_extender_args", "decode_binding_args", "decode_preemption_args",
    "encode_filter_result", "encode_host_priorities", "HostFragments", "encode_binding_result", "encode_preemption_result",
]

Obj = dict[str, Any]


class WireError(ValueError):
    """A request body kube-scheduler would never send; the message says which field is wrong."""


def _loads(body: bytes, what: str) -> Obj:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise WireError(f"{what}: body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise WireError(f"{what}: expected a JSON object, got {type(data).__name__}")
    return data


def _field(obj: Mapping[str, Any], key: str) -> Any:
    """``obj[key]`` matched as Go's encoding/json does: exact key first, then case-insensitively."""
    if key in obj:
        return obj[key]
    low = key.lower()
    for k, v in obj.items():
        if k.lower() == low:
            return v
    return None


def _string(obj: Mapping[str, Any], key: str, what: str) -> str:
    value = _field(obj, key)
    if not isinstance(value, str) or not value:
        raise WireError(f"{what}.{key}: expected a non-empty string, got {value!r}")
    return value


def _pod(value: Any, what: str) -> Obj:
    """A Pod in the shape the API server's validation guarantees, or :class:`WireError` naming the field.

    Only the parts the verbs walk (metadata, annotations, containers and their resources) are checked,
    so a malformed pod is refused here with a reason instead of failing deep inside a verb.
    """
    if not isinstance(value, dict) or not isinstance(value.get("metadata"), dict):
        raise WireError(f"{what}: expected a Pod object with metadata")
    ann = value["metadata"].get("annotations")
    if ann is not None and (not isinstance(ann, dict) or not all(isinstance(v, str) for v in ann.values())):
        raise WireError(f"{what}.metadata.annotations: expected a map of strings")
    spec = value.get("spec", {})
    if not isinstance(spec, dict):
        raise WireError(f"{what}.spec: expected an object")
    for key in ("containers", "initContainers"):
        items = spec.get(key)
        if items is None:
            continue
        if not isinstance(items, list):
            raise WireError(f"{what}.spec.{key}: expected a list")
        for i, c in enumerate(items):
            res = c.get("resources") if isinstance(c, dict) else None
            if not isinstance(c, dict) or not isinstance(res if res is not None else {}, dict) or any(
                    not isinstance(res.get(k, {}) or {}, dict) for k in ("limits", "requests") if res):
                raise WireError(f"{what}.spec.{key}[{i}]: expected a container with resources limits/requests maps")
    return value


# -- filter / prioritize ----------------------------------------------------------------------
@dataclass(frozen=True)
class ExtenderArgs:
    """One filter or prioritize request.

    ``node_names`` is set when the scheduler runs with ``nodeCacheCapable: true``; otherwise ``nodes``
    holds the full node objects, which a filter answer must echo back (only the fitting ones).
    Read-only, lists included: ``node_names`` may be the very list :class:`NameLists` keeps.
    """

    pod: Obj
    node_names: list[str] | None = None
    nodes: list[Obj] | None = None

    @property
    def names(self) -> list[str]:
        if self.node_names is not None:
            return self.node_names
        return [n["metadata"]["name"] for n in self.nodes or ()]

    @property
    def pod_key(self) -> str:
        meta = self.pod.get("metadata") or {}
        return f"{meta.get('namespace') or 'default'}/{meta.get('name', '')}"


def _all_strings(items: list[Any]) -> bool:
    """Every item is a ``str``: ``str.join`` checks that in C, ~5x faster than collecting the types of
    5,000 freshly decoded names (the check runs on every filter and prioritize)."""
    try:
        "".join(items)
    except TypeError:
        return False
    return True


class NameLists:
    """The last few ``NodeNames`` lists seen on the wire, by their exact bytes, decoded.

    kube-scheduler sends every node's name to filter, cycle after cycle (the same ~65 KB at 5,000
    nodes), and then to prioritize exactly the list filter answered: decoding 5,000 names again costs
    more than comparing the bytes (a ``memcmp``). A hit also hands back the very ``str`` objects of the
    last decode, so :meth:`extender.cluster.ClusterState.rows_of` matches a list by identity instead
    of comparing 5,000 strings. A memo only: an entry is the decode of its bytes, whatever came before.
    The list itself is handed out, not a copy (copying 5,000 references touches 5,000 strings: ~0.1 ms
    with cold caches, twice per cycle): like the rest of :class:`ExtenderArgs`, it is read, never changed.
    """

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self._lists: list[tuple[bytes, list[str]]] = []  # most recent first
        self._lock = threading.Lock()  # the HTTP loop and a forwarded verb may decode at once
        self.hits = self.misses = 0

    def get(self, raw: bytes) -> list[str] | None:
        """The list ``raw`` decodes to, when it was seen lately (shared: never change it)."""
        with self._lock:
            for i, (known, names) in enumerate(self._lists):
                if known == raw:
                    if i:
                        self._lists.insert(0, self._lists.pop(i))
                    self.hits += 1
                    return names
            self.misses += 1
        return None

    def put(self, raw: bytes, names: list[str]) -> None:
        """Remember that ``raw`` (a JSON array) decodes to ``names`` (the list itself: never change it)."""
        with self._lock:
            self._lists = [(raw, names)] + [e for e in self._lists if e[0] != raw][:self.size - 1]


_NAMES_MEMBER = b',"NodeNames":'


def _split_names(body: bytes, lists: NameLists) -> ExtenderArgs | None:
    """``body`` read as ``{<members>,"NodeNames":[...]}`` (Go's field order, as kube-scheduler
    marshals ExtenderArgs), its names from ``lists`` when their bytes were seen lately; None when the
    body has another shape (then :func:`decode_extender_args` parses it whole).

    Equal to parsing it whole: when ``<members>`` + ``}`` parse as a non-empty object and the tail as
    a JSON value, the body is that object with ``NodeNames`` appended last (a duplicate key earlier
    loses to it, as in orjson's and Go's decoders), so this reads the same keys and values."""
    if not body.endswith(b"}"):
        return None
    at = body.rfind(_NAMES_MEMBER)
    if at <= 0:
        return None
    raw = body[at + len(_NAMES_MEMBER):-1]
    names = lists.get(raw)
    if names is None:
        try:
            names = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(names, list) or not _all_strings(names):
            return None  # the whole-body parse names the bad field
        lists.put(raw, names)
    try:
        data = orjson.loads(body[:at] + b"}")
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not data:
        return None
    return ExtenderArgs(pod=_pod(_field(data, "Pod"), "ExtenderArgs.Pod"), node_names=names)


def decode_extender_args(body: bytes, lists: NameLists | None = None) -> ExtenderArgs:
    """Parse ``ExtenderArgs``; raises :class:`WireError` naming the bad field.

    With ``lists``, a ``NodeNames`` list whose bytes were seen lately is not decoded again
    (:class:`NameLists`); the answer is the same."""
    if lists is not None and (split := _split_names(body, lists)) is not None:
        return split
    data = _loads(body, "ExtenderArgs")
    pod = _pod(_field(data, "Pod"), "ExtenderArgs.Pod")
    names = _field(data, "NodeNames")
    raw_nodes = _field(data, "Nodes")
    if names is not None:
        if not isinstance(names, list) or not _all_strings(names):
            raise WireError("ExtenderArgs.NodeNames: expected a list of node names")
        return ExtenderArgs(pod=pod, node_names=names)
    if raw_nodes is None:
        raise WireError("ExtenderArgs: carries neither NodeNames nor Nodes")
    items = raw_nodes.get("items") if isinstance(raw_nodes, dict) else None
    if not isinstance(items, list):
        raise WireError("ExtenderArgs.Nodes: expected a NodeList with items")
    for i, node in enumerate(items):
        meta = node.get("metadata") if isinstance(node, dict) else None
        if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
            raise WireError(f"ExtenderArgs.Nodes.items[{i}]: expected a Node with metadata.name")
    return ExtenderArgs(pod=pod, nodes=items)


@dataclass
class FilterResult:
    """What filter decided: names that fit (input order), and why the others do not.

    ``unresolvable`` holds nodes that no preemption can fix (the GPU is too small, the model is wrong);
    kube-scheduler then skips them when it looks for victims.
    """

    passed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    unresolvable: dict[str, str] = field(default_factory=dict)
    error: str = ""


def encode_filter_result(result: FilterResult, args: ExtenderArgs | None, lists: NameLists | None = None) -> bytes:
    """``ExtenderFilterResult`` in the form the request used; ``NodeNames`` is always a list.

    With ``lists``, the encoded ``NodeNames`` is remembered there: kube-scheduler sends exactly that
    list to prioritize next, which then decodes it from the memo (same bytes as one ``orjson.dumps``)."""
    nodes: Obj | None = None
    if args is not None and args.nodes is not None:
        keep = set(result.passed)
        nodes = {"metadata": {}, "items": [n for n in args.nodes if n["metadata"]["name"] in keep]}
    elif lists is not None:
        names = orjson.dumps(result.passed)
        lists.put(names, result.passed)
        return b"".join((b'{"Nodes":null,"NodeNames":', names, b',"FailedNodes":', orjson.dumps(result.failed),
                         b',"FailedAndUnresolvableNodes":', orjson.dumps(result.unresolvable),
                         b',"Error":', orjson.dumps(result.error), b"}"))
    return orjson.dumps({
        "Nodes": nodes,
        "NodeNames": list(result.passed),
        "FailedNodes": result.failed,
        "FailedAndUnresolvableNodes": result.unresolvable,
        "Error": result.error,
    })


_HOST_FRAGMENTS: dict[str, tuple[bytes, ...]] = {}  # name -> '{"Host":"<name>","Score":<s>}' for s in 0..10
_FRAGMENT_LIMIT = 20_000  # names come from requests: never let them grow the cache unbounded


def _fragments(host: str) -> tuple[bytes, ...]:
    frags = _HOST_FRAGMENTS[host] = _encoded(host)
    return frags


def encode_host_priorities(scores: Sequence[tuple[str, int]]) -> bytes:
    """``HostPriorityList``: a bare JSON array of ``{"Host", "Score"}``, scores already 0..10.

    Joined from fragments encoded once per name and score: at 5,000 nodes the per-call work is two
    lookups per node, in C, and no new object per node (building 5,000 dicts for orjson, or even 5,000
    concatenated fragments, costs several times more). Scores outside 0..10 fall back to orjson.
    """
    if not scores:
        return b"[]"
    hosts, values = zip(*scores)
    if len(_HOST_FRAGMENTS) > _FRAGMENT_LIMIT:
        _HOST_FRAGMENTS.clear()
    per_host = list(map(_HOST_FRAGMENTS.get, hosts))
    if None in per_host:
        per_host = [f if f is not None else _fragments(h) for h, f in zip(hosts, per_host)]
    try:
        if min(values) < 0:  # a negative index would pick a fragment from the end
            raise IndexError
        return b"[" + b",".join(map(operator.getitem, per_host, values)) + b"]"
    except (IndexError, TypeError):
        return orjson.dumps([{"Host": h, "Score": int(v)} for h, v in scores])


_SCORE_TAILS = tuple(b"%d}" % score for score in range(MAX_EXTENDER_PRIORITY + 1))


class HostFragments:
    """``HostPriorityList`` from arrays: per input name its row in the books (-1: unknown) and its score.

    Each row's eleven entries (``{"Host":"<name>","Score":s}`` for s in 0..10) are encoded once and
    kept in an object table ``[rows, 11]``; an answer is one fancy index and one join, with no Python
    object made per node (5,000 tuples, dict lookups by freshly decoded names and fragment lists cost
    more than the scoring). A row's entries are checked against its name once per ``epoch`` of the
    books' row names (:attr:`extender.cluster.ClusterState.names_epoch`): after a node is added or
    removed, only the rows that changed hands are encoded again (one name comparison per row, not
    5,000 rows re-encoded, ~4 ms, in the next prioritize). The bytes are exactly
    :func:`encode_host_priorities`'s for the same ``(name, score)`` pairs.
    """

    def __init__(self) -> None:
        self._table = np.empty((0, MAX_EXTENDER_PRIORITY + 1), object)
        self._names = np.empty(0, object)  # the name each row's entries were encoded for (None: none yet)
        self._checked = np.zeros(0, np.int64)  # the epoch (numbered here, from 1) a row's name was last checked in
        self._epochs: dict[object, int] = {}  # the books' last few epochs, numbered from 1
        self._serial = 0
        self._lock = threading.Lock()  # the HTTP loop and a forwarded verb may encode at once

    def encode(self, names: Sequence[str], rows: np.ndarray, scores: np.ndarray, epoch: object) -> bytes:
        """The answer for ``names`` (their ``rows`` in the books of ``epoch``) scored ``scores``."""
        if not len(names):
            return b"[]"
        if int(scores.min()) < 0 or int(scores.max()) > MAX_EXTENDER_PRIORITY:
            return encode_host_priorities(list(zip(names, scores.tolist())))
        with self._lock:
            return self._encode(names, rows, scores, epoch)

    def prepare(self, names: Sequence[str], rows: np.ndarray, epoch: object) -> None:
        """Encode the entries of ``names`` (their ``rows`` in the books of ``epoch``) ahead of any
        request: once the books are in, so the first prioritize does not pay for every node."""
        if len(names):
            with self._lock:
                self._check(names, np.asarray(rows, np.int64), epoch)

    def _encode(self, names: Sequence[str], rows: np.ndarray, scores: np.ndarray, epoch: object) -> bytes:
        safe, known = self._check(names, rows, epoch)
        out = self._table[safe, scores].tolist()
        if not known.all():  # names the books do not know: encoded by name, as encode_host_priorities does
            for i in np.flatnonzero(~known).tolist():
                out[i] = _entries(names[i])[int(scores[i])]
        return b"[" + b",".join(out) + b"]"

    def _check(self, names: Sequence[str], rows: np.ndarray, epoch: object) -> tuple[np.ndarray, np.ndarray]:
        """Rows (unknown names on row 0) whose entries are now encoded for ``names``, and which are known."""
        number = self._epochs.get(epoch)
        if number is None:  # a new epoch (or one forgotten: its rows are checked again, which is safe)
            self._serial += 1
            number = self._epochs[epoch] = self._serial
            if len(self._epochs) > 8:
                self._epochs.pop(next(iter(self._epochs)))
        top = max(int(rows.max()), 0)  # row 0 stands in for unknown names below
        if top >= len(self._table):
            self._grow(max(top + 1, 2 * len(self._table)))
        known = rows >= 0
        safe = np.where(known, rows, 0)
        unchecked = known & (self._checked[safe] != number)
        if unchecked.any():  # first sight of these rows in this epoch: does each still name the same node?
            at = np.flatnonzero(unchecked)
            stale = [(i, row) for i, row, had in zip(at.tolist(), safe[at].tolist(), self._names[safe[at]].tolist())
                     if had != names[i]]
            if stale:  # encode them, a column (score) at a time: ~3x faster than row by row
                fresh = np.array([names[i] for i, _ in stale], object)
                rewrite = np.array([row for _, row in stale], np.int64)
                prefixes = [b'{"Host":' + orjson.dumps(host) + b',"Score":' for host in fresh.tolist()]
                for score, tail in enumerate(_SCORE_TAILS):
                    self._table[rewrite, score] = [prefix + tail for prefix in prefixes]
                self._names[rewrite] = fresh
            self._checked[safe[at]] = number
        return safe, known

    def _grow(self, size: int) -> None:
        table = np.empty((size, MAX_EXTENDER_PRIORITY + 1), object)
        table[:len(self._table)] = self._table
        names = np.empty(size, object)
        names[:len(self._names)] = self._names
        checked = np.zeros(size, np.int64)
        checked[:len(self._checked)] = self._checked
        self._table, self._names, self._checked = table, names, checked


def _encoded(host: str) -> tuple[bytes, ...]:
    """``{"Host":"<host>","Score":s}`` for s in 0..10."""
    prefix = b'{"Host":' + orjson.dumps(host) + b',"Score":'
    return tuple([prefix + tail for tail in _SCORE_TAILS])


def _entries(host: str) -> tuple[bytes, ...]:
    frags = _HOST_FRAGMENTS.get(host)
    return frags if frags is not None else _fragments(host)


# -- bind -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BindingArgs:
    pod_name: str
    pod_namespace: str
    pod_uid: str
    node: str

    @property
    def pod_key(self) -> str:
        return f"{self.pod_namespace}/{self.pod_name}"


def decode_binding_args(body: bytes) -> BindingArgs:
    data = _loads(body, "ExtenderBindingArgs")
    uid = _field(data, "PodUID")
    return BindingArgs(
        pod_name=_string(data, "PodName", "ExtenderBindingArgs"),
        pod_namespace=_string(data, "PodNamespace", "ExtenderBindingArgs"),
        pod_uid=uid if isinstance(uid, str) else "",
        node=_string(data, "Node", "ExtenderBindingArgs"),
    )


def encode_binding_result(error: str = "") -> bytes:
    return orjson.dumps({"Error": error})


# -- preempt ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class PreemptionArgs:
    """``ExtenderPreemptionArgs`` reduced to what we answer with: node -> victim pod UIDs."""

    pod: Obj
    victims: dict[str, list[str]]
    pdb_violations: dict[str, int]


def decode_preemption_args(body: bytes) -> PreemptionArgs:
    """Read the Meta (UID) form when present, else the full-pod form, as the scheduler sends either."""
    data = _loads(body, "ExtenderPreemptionArgs")
    pod = _pod(_field(data, "Pod"), "ExtenderPreemptionArgs.Pod")
    meta = _field(data, "NodeNameToMetaVictims")
    full = _field(data, "NodeNameToVictims")
    source, uid_of = (meta, lambda p: _field(p, "UID")) if meta is not None else (
        full, lambda p: (p.get("metadata") or {}).get("uid"))
    if not isinstance(source, dict):
        raise WireError("ExtenderPreemptionArgs: carries neither NodeNameToMetaVictims nor NodeNameToVictims")
    victims: dict[str, list[str]] = {}
    pdb: dict[str, int] = {}
    for node, v in source.items():
        if not isinstance(v, dict) or not isinstance(_field(v, "Pods") or [], list):
            raise WireError(f"ExtenderPreemptionArgs: victims of node {node!r} are not an object with Pods")
        victims[node] = [str(uid_of(p)) for p in _field(v, "Pods") or [] if isinstance(p, dict)]
        violations = _field(v, "NumPDBViolations") or 0
        if not isinstance(violations, int) or isinstance(violations, bool):
            raise WireError(f"ExtenderPreemptionArgs: NumPDBViolations of node {node!r} is not an integer")
        pdb[node] = violations
    return PreemptionArgs(pod=pod, victims=victims, pdb_violations=pdb)


def encode_preemption_result(victims: Mapping[str, Sequence[str]], pdb_violations: Mapping[str, int]) -> bytes:
    """``ExtenderPreemptionResult``: always the Meta (UID) form."""
    return orjson.dumps({"NodeNameToMetaVictims": {
        node: {"Pods": [{"UID": uid} for uid in uids], "NumPDBViolations": pdb_violations.get(node, 0)}
        for node, uids in victims.items()
    }})
