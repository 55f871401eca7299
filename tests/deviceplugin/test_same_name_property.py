"""Property (issue 17 item 2): a pod deleted and recreated under its name, again and again, never has a
record, a quota link or an allocation attributed to another incarnation's UID, whatever the order of events.

PodResources names pods, not UIDs (``server_v1.go List``). Each seed draws a StatefulSet-like history of
one name: incarnations created, admitted after a random delay, deleted gracefully (the API keeps the pod
with a ``deletionTimestamp`` until the kubelet has stopped it, then the next one is made) or forcibly
(the API forgets it at once, the next one is made while the kubelet still runs the old one, so List
names the pod twice), the kubelet handing out a device an earlier incarnation held (the same allocation
key, a new Allocate stamp); the node clock off the API server's by up to 4 s; the plugin's pod cache
behind the API by a random lag each round; PodResources down for some rounds; the order of List's
entries shuffled. An incarnation either lives longer than twice the clock-skew allowance or is seen by one round while
listed and cached (the reconciler runs right after each Allocate); within that window an allocation no
round ever saw cannot be told from the new pod's by a name and clocks (the note says so). The reconcile core (:func:`deviceplugin.kubelet.reconcile.plan`) runs with what the node
persists (stamps, owners) and the API server's confirmation of new attributions
(:func:`deviceplugin.kubelet.reconcile.drop_unconfirmed`, as :class:`deviceplugin.kubelet.reconcile_loop.Reconciler`
does). After every round: every link, owner record and patch names the incarnation that made the
allocation; at the end the last incarnation is linked and recorded with its own GPU.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

import pytest

from deviceplugin.kubelet import reconcile
from deviceplugin.devices import PluginDevice
from deviceplugin.quota_files import Allocation, allocation_key
from vramshare import contract

NAMES = contract.Names()
MEM = NAMES.gpu_memory
DEVICES = {d.id: d for d in [PluginDevice("GPU-a::0", "GPU-a", 0, True, 1024), PluginDevice("GPU-a::1", "GPU-a", 0, True, 1024),
                             PluginDevice("GPU-b::0", "GPU-b", 1, True, 1024)]}
SEEDS = range(int(os.environ.get("VRAMSHARE_PROPERTY_SEEDS", "60")))


@dataclass
class Incarnation:
    uid: str
    created: float  # API clock
    admitted: float  # API clock; the Allocate's stamp is this on the node clock
    deleted: float  # the API sets deletionTimestamp (graceful) or forgets the pod (force)
    gone_from_api: float
    terminated: float  # the kubelet stops listing it
    device: str


def rfc3339(t: float) -> str:
    import time
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def history(rng: random.Random) -> list[Incarnation]:
    out: list[Incarnation] = []
    t = 1_800_000_000.0 + rng.random()
    n = rng.randint(2, 5)
    for i in range(n):
        created = t
        admitted = created + rng.uniform(0.05, 1.0)
        device = rng.choice(sorted(DEVICES))
        if out and admitted < out[-1].terminated and device == out[-1].device:
            device = next(d for d in sorted(DEVICES) if d != out[-1].device)  # still held by the old one
        # either it lives longer than twice the allowed clock skew, or a round sees it while it is
        # listed and cached (the reconciler runs right after every Allocate): see ``forced``
        deleted = admitted + (rng.uniform(12, 30) if rng.random() < 0.5 else rng.uniform(0.5, 10))
        terminated = deleted + rng.uniform(0, 3)
        graceful = rng.random() < 0.5
        gone = terminated if graceful else deleted
        if i == n - 1:  # the last one stays
            deleted = gone = terminated = float("inf")
        out.append(Incarnation(f"uid-{i}", created, admitted, deleted, gone, terminated, device))
        t = gone + rng.uniform(0, 0.5)  # the StatefulSet makes the next one once the name is free
    return out


def api_pod(inc: Incarnation, at: float) -> dict:
    meta = {"name": "web-0", "namespace": "default", "uid": inc.uid, "resourceVersion": "1",
            "creationTimestamp": rfc3339(inc.created), "annotations": {
                NAMES.allocation_state: contract.STATE_ASSUMED,
                NAMES.assignment: json.dumps({"c": [{"uuid": "GPU-a", "mib": 1024}]})}}
    if at >= inc.deleted:
        meta["deletionTimestamp"] = rfc3339(inc.deleted)
    return {"metadata": meta, "spec": {"nodeName": "n1", "containers": [
        {"name": "c", "resources": {"limits": {MEM: "1"}}}]}}


def api_at(incs: list[Incarnation], at: float) -> list[dict]:
    return [api_pod(i, at) for i in incs if i.created <= at < i.gone_from_api]


@pytest.mark.parametrize("seed", SEEDS)
def test_no_record_link_or_owner_crosses_incarnations(seed: int) -> None:
    rng = random.Random(seed)
    incs = history(rng)
    skew = rng.uniform(-4, 4)  # node clock - API clock
    end = incs[-1].admitted + rng.uniform(5, 20)
    forced = {i.admitted + 0.2 for i in incs if i.deleted - i.admitted < 12}  # fresh cache, PodResources up
    rounds = sorted([rng.uniform(incs[0].created, end) for _ in range(rng.randint(20, 60))] + list(forced))
    allocs: dict[str, Allocation] = {}
    stamped: dict[str, str] = {}  # allocation key -> uid of the incarnation whose Allocate made the stamp
    done = 0
    by_uid = {i.uid: i for i in incs}
    for t in rounds + [end + 100]:
        final = t > end or t in forced
        while done < len(incs) and incs[done].admitted <= t:  # Allocates up to now, in order
            inc = incs[done]
            key = allocation_key([inc.device])
            allocs[key] = Allocation(int((inc.admitted + skew) * 1e9), "")
            stamped[key] = inc.uid
            done += 1
        if not final and rng.random() < 0.15:
            continue  # PodResources down: nothing is read, nothing changes
        listed = [i for i in incs if i.admitted <= t < i.terminated]
        rng.shuffle(listed)
        held = [reconcile.Held("default", "web-0", "c", MEM, (i.device,), n) for n, i in enumerate(listed)]
        lag = 0.0 if final else rng.choice([0.0, rng.uniform(0, 1.5), rng.uniform(0, 6)])
        plan = reconcile.plan(held, api_at(incs, t - lag), DEVICES, NAMES, "n1", 1024, dict(allocs))
        now = [p["metadata"]["uid"] for p in api_at(incs, t)]
        reconcile.drop_unconfirmed(plan, {uid: "not the API's" for uid, _ in plan.attributions.values()
                                          if uid not in now})
        where = f"seed {seed} t={t - incs[0].created:.2f} skew={skew:.2f} lag={lag:.2f}"
        for key, (uid, stamp) in plan.attributions.items():
            assert stamped[key] == uid, f"{where}: allocation of {stamped[key]} attributed to {uid}"
            allocs[key] = Allocation(stamp, uid)
        for (uid, _), key in plan.links.items():
            assert stamped.get(key) == uid, f"{where}: {uid} linked to {stamped.get(key)}'s allocation"
        for patch in plan.patches:
            gpu = DEVICES[by_uid[patch.pod.uid].device].gpu_uuid
            assert json.loads(patch.assignment) == {"c": [{"uuid": gpu, "mib": 1024}]}, \
                f"{where}: {patch.pod.uid} recorded with another incarnation's GPU"
        if t > end and not [i for i in incs[:-1] if i.terminated > t]:
            last = incs[-1]
            assert plan.links == {(last.uid, "c"): allocation_key([last.device])}, where
            gpu = DEVICES[last.device].gpu_uuid
            assert plan.patches and json.loads(plan.patches[0].assignment) == {"c": [{"uuid": gpu, "mib": 1024}]} \
                or gpu == "GPU-a", f"{where}: the last incarnation is not recorded"
