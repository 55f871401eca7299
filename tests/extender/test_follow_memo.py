"""Filter's memo of the held plans (:class:`extender.held_pick.FollowMemo`) answers exactly as
:func:`extender.held_pick.follow` computed afresh (issue 21, 300 cycles/s).

A burst of same-size replicas makes filter walk the same held nodes for every pod, and each look placed
the pod on the held plan again. The memo keeps each answer per node, row version, held plans and pod
template. A property over random sequences of binds (held plans, often the same GPUs as the last pod of
that size, so the plans are shared), allocated reports, deletions, node re-inventories (health, model,
GPU count), time passing and pods of a few templates (sizes, gpu-count 2, a second container, a model
constraint, an init container): after every step, filter through the accounting's warm memo answers
exactly as the same view without a memo.
"""
from __future__ import annotations

import dataclasses
import random

import orjson
import pytest

from extender import accounting, verbs, wire
from tests.extender import builders as b
from vramshare.config import Config, ExtenderConfig, Policy

N = b.NAMES
SEC = 1_000_000_000
T0 = 1_700_000_000 * SEC
NODES = [f"n{i}" for i in range(5)]
GIBS = (4, 8, 10)


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now


def _node(rng: random.Random, name: str) -> dict:
    gpus = [rng.choice((b.l4(), b.a100(), b.a100(healthy=rng.random() > 0.2))) for _ in range(rng.randint(2, 4))]
    return b.gpu_node(name, *gpus)


def _template(rng: random.Random) -> dict:
    """The kwargs of one Deployment's pods."""
    t = {"gib": rng.choice(GIBS), "count": rng.choice((1, 1, 2)), "containers": rng.choice((1, 1, 2))}
    if rng.random() < 0.2:
        t["models"] = "A100"
    if t["containers"] == 2 and rng.random() < 0.5:
        t["side"] = rng.choice((1, 2))  # the second container asks another size: held or not, apart
    return t


def _pod(name: str, t: dict, init: bool) -> dict:
    p = b.pod(name, **{k: v for k, v in t.items() if k != "side"})
    if "side" in t:
        p["spec"]["containers"][1]["resources"]["limits"][N.gpu_memory] = str(t["side"])
    if init:  # an init container asking the same size: allocations() reads the spec's init containers
        p["spec"]["initContainers"] = [{"name": "warm", "resources": {"limits": {N.gpu_memory: str(t["gib"])}}}]
    return p


def _bind(rng: random.Random, acct: accounting.Accounting, clock: Clock, p: dict, node: str,
          sticky: dict) -> dict:
    """``p`` as the binder leaves it on ``node``: every container asking on GPUs (the last plan of
    its size there, mostly, so same-size pods share plans), assumed now."""
    slots = acct.state.slots(acct.state.row(node))
    t = p["_t"]
    count = min(t["count"], len(slots))
    key = (node, t["gib"], count)
    uuids = sticky.get(key) if rng.random() < 0.8 else None
    if uuids is None or any(u not in {s.uuid for s in slots} for u in uuids):
        uuids = [s.uuid for s in rng.sample(slots, count)]
        sticky[key] = uuids
    containers = [*p["spec"].get("initContainers", []), *p["spec"]["containers"]]
    text = orjson.dumps({c["name"]: [{"uuid": u, "mib": int(c["resources"]["limits"][N.gpu_memory]) * 1024 // count}
                                     for u in uuids] for c in containers}).decode()
    meta = p["metadata"]
    return {**p, "metadata": {**meta, "resourceVersion": str(int(meta.get("resourceVersion", "1")) + 1),
                              "annotations": {**meta["annotations"], N.assignment: text,
                                              N.assume_time: str(clock.now), N.allocation_state: "assumed"},
                              "managedFields": b.written_by_vramshare("assumed")},
            "spec": {**p["spec"], "nodeName": node}}


def _allocated(p: dict) -> dict:
    meta = p["metadata"]
    return {**p, "metadata": {**meta, "resourceVersion": str(int(meta["resourceVersion"]) + 1),
                              "annotations": {**meta["annotations"], N.allocation_state: "allocated"},
                              "managedFields": b.written_by_vramshare("allocated")},
            "status": {"phase": "Running"}}


def _answer(view: verbs.View, p: dict, names: list[str]) -> tuple:
    args = wire.decode_extender_args(orjson.dumps({"Pod": p, "Nodes": None, "NodeNames": names}))
    r = verbs.filter_pod(view, args)
    return r.passed, dict(r.failed), dict(r.unresolvable), r.error


@pytest.mark.parametrize("policy", [Policy.BINPACK, Policy.FGD])
@pytest.mark.parametrize("seed", range(8))
def test_memoised_follow_answers_as_computed_afresh(seed: int, policy: Policy) -> None:
    rng = random.Random(seed)
    clock = Clock()
    acct = accounting.Accounting(Config(extender=ExtenderConfig(
        hold_timeout_seconds=30, assume_timeout_seconds=60, policy=policy)), clock)
    for n in NODES:
        acct.apply_node("ADDED", _node(rng, n))
    templates = [(_template(rng), rng.random() < 0.2) for _ in range(4)]
    # a Deployment sharing one size with another and asking one more: the policy places what is not held
    templates.append(({**templates[0][0], "containers": 2, "side": rng.choice((1, 2))}, False))
    live: dict[str, dict] = {}  # pod name -> its last object
    sticky: dict = {}
    serial = 0
    memo_hits = 0
    for step in range(50):
        for _ in range(rng.choice((1, 2, 3))):
            roll = rng.random()
            if roll < 0.5:  # a replica of some Deployment is bound
                t, init = rng.choice(templates)
                serial += 1
                p = _pod(f"p{serial}", t, init)
                p["metadata"]["resourceVersion"] = "1"
                p["_t"] = t
                acct.apply_pod("ADDED", {k: v for k, v in p.items() if k != "_t"})
                bound = _bind(rng, acct, clock, p, rng.choice(NODES), sticky)
                live[p["metadata"]["name"]] = bound
                acct.apply_pod("MODIFIED", {k: v for k, v in bound.items() if k != "_t"})
            elif roll < 0.65 and live:  # the device plugin reports one allocated
                name = rng.choice(sorted(live))
                live[name] = _allocated(live[name])
                acct.apply_pod("MODIFIED", {k: v for k, v in live[name].items() if k != "_t"})
            elif roll < 0.75 and live:  # one is deleted
                gone = live.pop(rng.choice(sorted(live)))
                acct.apply_pod("DELETED", {k: v for k, v in gone.items() if k != "_t"})
            elif roll < 0.85:  # a node is inventoried again (health, model, GPU count)
                acct.apply_node("MODIFIED", _node(rng, rng.choice(NODES)))
            else:
                clock.now += rng.choice((1, 3, 8)) * SEC
        view = acct.view(policy)
        if view.holds is None:
            continue
        bare = dataclasses.replace(view, follows=None)
        names = list(NODES)
        rng.shuffle(names)
        for t, init in templates:  # the next replica of each Deployment, twice (the second hits)
            for _ in range(2):
                serial += 1
                p = _pod(f"q{serial}", t, init)
                before = acct.follows.hits
                got = _answer(view, p, names)
                memo_hits += acct.follows.hits - before
                assert got == _answer(bare, p, names), (seed, step, t, init)
    assert memo_hits, "the memo was never used: the property checks nothing"
