"""The extender verbs as kube-scheduler calls them and reads the answers (pkg/scheduler/extender.go):
preempt (below) and filter (at the end).

The request is what ``HTTPExtender.ProcessPreemption`` (pkg/scheduler/extender.go) marshals:
``ExtenderPreemptionArgs`` with Go field names and no omitempty, so the unused map is ``null``;
``NodeNameToMetaVictims`` (UIDs) when the extender is ``nodeCacheCapable``, else
``NodeNameToVictims`` with whole pods. ``send`` needs HTTP 200 and decodes the body into
``ExtenderPreemptionResult`` (field names matched case-insensitively, unknown fields ignored).
``convertToNodeNameToVictims`` then fails the call for a node the scheduler's snapshot lacks or a
victim UID that is not a pod on that node (``convertPodUIDToPod``), and ``callExtenders``
(pkg/scheduler/framework/preemption) fails it for a node with no victims ("expected at least one
victim pod on node"), since our extender is not ignorable. :func:`scheduler_reads` ports those checks.
"""
from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings, strategies as st

from extender import accounting, app, metrics
from tests.extender import builders as b
from vramshare.config import Config, Policy

T = 1_000_000_000


class SchedulerError(Exception):
    """What ProcessPreemption / callExtenders would return as an error for the pod."""


def _field(obj: dict[str, Any], name: str) -> Any:
    """encoding/json: an exact key first, else a case-insensitive match."""
    if name in obj:
        return obj[name]
    return next((v for k, v in obj.items() if k.lower() == name.lower()), None)


def scheduler_reads(status: int, body: bytes, snapshot: dict[str, set[str]]) -> dict[str, list[str]]:
    """kube-scheduler's reading of a preempt answer: ``{node: victim UIDs}`` or :class:`SchedulerError`.

    ``snapshot`` is the scheduler's NodeInfo view: node name -> UIDs of the pods on it."""
    if status != 200:  # HTTPExtender.send
        raise SchedulerError(f"Failed preempt with extender, code {status}")
    result = json.loads(body)
    out: dict[str, list[str]] = {}
    for node, meta in (_field(result, "NodeNameToMetaVictims") or {}).items():  # convertToNodeNameToVictims
        if node not in snapshot:
            raise SchedulerError(f'nodeinfo not found for node name "{node}"')
        uids = []
        for meta_pod in _field(meta or {}, "Pods") or []:
            uid = _field(meta_pod or {}, "UID")
            if uid not in snapshot[node]:  # convertPodUIDToPod
                raise SchedulerError(f"extender claims to preempt pod (UID: {uid}) on node: {node}, but the pod "
                                     "is not found on that node")
            uids.append(uid)
        out[node] = uids
    for node, uids in out.items():  # callExtenders, non-ignorable extender
        if not uids:
            raise SchedulerError(f'expected at least one victim pod on node "{node}"')
    return out


def preempt_request(pod: dict, victims: dict[str, list[dict]], node_cache_capable: bool = True) -> bytes:
    """ExtenderPreemptionArgs as Go's json.Marshal writes it (kube-scheduler's pods are whole objects)."""
    if node_cache_capable:
        meta = {n: {"Pods": [{"UID": p["metadata"]["uid"]} for p in ps], "NumPDBViolations": 0}
                for n, ps in victims.items()}
        return orjson.dumps({"Pod": pod, "NodeNameToVictims": None, "NodeNameToMetaVictims": meta})
    full = {n: {"Pods": ps, "NumPDBViolations": 0} for n, ps in victims.items()}
    return orjson.dumps({"Pod": pod, "NodeNameToVictims": full, "NodeNameToMetaVictims": None})


def test_scheduler_reads_rejects_the_shapes_kube_scheduler_rejects():
    snapshot = {"n1": {"u1"}}
    assert scheduler_reads(200, b'{"nodenametometavictims":{"n1":{"pods":[{"uid":"u1"}]}},"x":1}', snapshot) \
        == {"n1": ["u1"]}
    for body, why in [(b'{"NodeNameToMetaVictims":{"n1":{"Pods":[]}}}', "at least one victim"),
                      (b'{"NodeNameToMetaVictims":{"n9":{"Pods":[{"UID":"u1"}]}}}', "nodeinfo not found"),
                      (b'{"NodeNameToMetaVictims":{"n1":{"Pods":[{"UID":"u2"}]}}}', "not found on that node")]:
        with pytest.raises(SchedulerError, match=why):
            scheduler_reads(200, body, snapshot)
    with pytest.raises(SchedulerError, match="code 500"):
        scheduler_reads(500, b"", snapshot)


def _prio(p: dict, value: int) -> dict:
    p["spec"]["priority"] = value
    return p


@settings(max_examples=120, deadline=None)
@given(pods=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 1), st.integers(1, 22), st.integers(0, 5)),
                     max_size=10),
       gib=st.integers(1, 22), mine=st.integers(0, 6), proposals=st.lists(st.booleans(), min_size=10, max_size=10),
       cache_capable=st.booleans())
def test_every_preempt_answer_is_one_kube_scheduler_accepts(pods, gib, mine, proposals, cache_capable):
    """Any cluster, any candidate nodes (kube-scheduler may also send nodes with no victims: the
    placeholder candidates of an extender-only failure), either request form: the answer passes
    ProcessPreemption and callExtenders, and every victim has lower priority than the preemptor."""
    acct = accounting.Accounting(Config(), clock=lambda: T)
    for n in range(3):
        acct.apply_node("ADDED", b.gpu_node(f"n{n}", b.l4(), b.l4()))
    snapshot: dict[str, set[str]] = {f"n{n}": set() for n in range(3)}
    placed: list[tuple[dict, str, int]] = []
    for i, (node, gpu, size, p) in enumerate(pods):
        name = f"n{node}"
        if sum(s for nn, g, s, _ in pods[:i] if nn == node and g == gpu) + size > 22:
            continue  # kube-scheduler would not have placed it
        pod = _prio(b.pod(f"v{i}", size, uid=f"uid-{i}"), p)
        acct.apply_pod("ADDED", b.assigned(pod, name, [(b.uuid_of(name, gpu), size * 1024)], T))
        snapshot[name].add(f"uid-{i}")
        placed.append((pod, name, p))
    victims = {f"n{n}": [pod for (pod, name, p), chosen in zip(placed, proposals)
                         if name == f"n{n}" and p < mine and chosen] for n in range(3)}
    ext = app.Extender(acct, None, None, metrics.ExtenderMetrics(acct), Policy.BINPACK)  # type: ignore[arg-type]
    resp = ext.handle("POST", "/preempt", preempt_request(_prio(b.pod("big", gib), mine), victims, cache_capable))
    read = scheduler_reads(resp.status, resp.body, snapshot)
    lower = {pod["metadata"]["uid"] for pod, _, p in placed if p < mine}
    assert set(read) <= set(victims) and all(set(uids) <= lower for uids in read.values())


# -- filter, as HTTPExtender.Filter sends it and reads the answer ------------------------------------
def scheduler_reads_filter(status: int, body: bytes, sent: list[str]) -> tuple[list[str], dict[str, str]]:
    """HTTPExtender.Filter (nodeCacheCapable): ``Error`` fails the call; a ``NodeNames`` entry not in the
    input fails it ("claims a filtered node ... not found in the input node list"); FailedNodes and
    FailedAndUnresolvableNodes go to the diagnosis."""
    if status != 200:
        raise SchedulerError(f"Failed filter with extender, code {status}")
    result = json.loads(body)
    if _field(result, "Error"):
        raise SchedulerError(_field(result, "Error"))
    names = _field(result, "NodeNames")
    for name in names or []:
        if name not in sent:
            raise SchedulerError(f"extender claims a filtered node {name!r} which is not found in the input node list")
    failed = {**(_field(result, "FailedNodes") or {}), **(_field(result, "FailedAndUnresolvableNodes") or {})}
    return list(names or []), failed


@settings(max_examples=80, deadline=None)
@given(held=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 22)), max_size=8),
       sent=st.lists(st.sampled_from(["n0", "n1", "n2", "plain", "unknown"]), max_size=6),
       gib=st.integers(0, 30), count=st.integers(1, 2))
def test_every_filter_answer_is_one_kube_scheduler_accepts(held, sent, gib, count):
    """Any cluster, any node list (with nodes the extender does not know, repeated names): the
    passed names are input names, and every input node is judged (passed or failed, never both)."""
    acct = accounting.Accounting(Config(), clock=lambda: T)
    for n in range(3):
        acct.apply_node("ADDED", b.gpu_node(f"n{n}", b.l4(), b.l4()))
    acct.apply_node("ADDED", b.plain_node("plain"))
    for i, (slot, size) in enumerate(held):
        node, gpu = f"n{slot % 3}", slot // 3
        acct.apply_pod("ADDED", b.assigned(b.pod(f"h{i}", size, uid=f"uid-h{i}"), node,
                                           [(b.uuid_of(node, gpu), size * 1024)], T))
    ext = app.Extender(acct, None, None, metrics.ExtenderMetrics(acct), Policy.BINPACK)  # type: ignore[arg-type]
    body = orjson.dumps({"Pod": b.pod("p", gib, count=count), "Nodes": None, "NodeNames": sent})
    resp = ext.handle("POST", "/filter", body)
    passed, failed = scheduler_reads_filter(resp.status, resp.body, sent)
    assert not set(passed) & set(failed)
    assert set(passed) | set(failed) == set(sent)


# -- what a person reads when no node fits: kube-scheduler's FitError over our reasons ------------------
def test_fit_error_is_kube_schedulers_histogram_of_identical_reasons():
    """pkg/scheduler/framework/types.go FitError.Error: "0/<all> nodes are available: <n> <reason>, ..."
    with the entries sorted as strings; the event's note is cut at 1,024 bytes with " ..."."""
    from standins.scheduler import NOTE_LENGTH_LIMIT, failed_scheduling_note, fit_error
    msg = fit_error(5, {"a": "no GPU has 8 GiB free", "b": "no GPU has 8 GiB free", "c": "needs a model",
                        "d": "no GPU has 8 GiB free"})
    assert msg == "0/5 nodes are available: 1 needs a model, 3 no GPU has 8 GiB free."
    long = fit_error(3000, {f"n{i}": f"reason {i}" for i in range(3000)})
    note = failed_scheduling_note(long)
    assert len(note) == NOTE_LENGTH_LIMIT and note.endswith(" ...") and failed_scheduling_note(msg) == msg


@settings(max_examples=25, deadline=None)
@given(nodes=st.integers(20, 300), seed=st.integers(0, 2**16), gib=st.integers(20, 80),
       cpu_short=st.integers(0, 5))
def test_a_pod_no_node_fits_reads_as_a_few_counted_reasons_at_any_cluster_size(nodes, seed, gib, cpu_short):
    """Each node's own free amount in its reason made one entry per node: at 2,000 nodes 607 distinct
    reasons, a 37 KB PodScheduled message, and an event whose 1,024 bytes listed the emptiest nodes'
    "largest free" (the sort is by string). Now the reasons are the same sentence on every node that
    fails alike, so the message stays a few entries whatever the node count, and the event's note
    carries the count of room-short nodes and the most free anywhere."""
    import random

    from standins.scheduler import failed_scheduling_note, fit_error
    rng = random.Random(seed)
    acct = accounting.Accounting(Config(), clock=lambda: T)
    names = [f"gpu-{i:04d}" for i in range(nodes)]
    for i, name in enumerate(names):
        node = b.gpu_node(name, *[b.a100() for _ in range(4)])
        if i < cpu_short:
            node["status"]["allocatable"].update(cpu="1", memory="64Gi")
        acct.apply_node("ADDED", node)
        for g in range(4):
            held = rng.randrange(40 * 1024, 80 * 1024)
            acct.apply_pod("ADDED", b.assigned(b.pod(f"h{i}-{g}", held // 1024, uid=f"u{i}-{g}"), name,
                                               [(b.uuid_of(name, g), held)], T))
    pod = b.pod("p", gib)
    pod["spec"]["containers"][0]["resources"]["requests"] = {
        **pod["spec"]["containers"][0]["resources"].get("requests", {}), "cpu": "2"}
    ext = app.Extender(acct, None, None, metrics.ExtenderMetrics(acct), Policy.BINPACK)  # type: ignore[arg-type]
    resp = ext.handle("POST", "/filter", orjson.dumps({"Pod": pod, "Nodes": None, "NodeNames": names}))
    passed, failed = scheduler_reads_filter(resp.status, resp.body, names)
    if passed:
        return
    assert len(set(failed.values())) <= 3, sorted(set(failed.values()))
    note = failed_scheduling_note(fit_error(len(names), failed))
    assert len(note) < 400 and note.startswith(f"0/{nodes} nodes are available: ")
    room = [why for why in failed.values() if why.startswith(f"no GPU has {gib} GiB free")]
    if room:
        assert f"{len(room)} {room[0]}" in note and "the most free: " in note
