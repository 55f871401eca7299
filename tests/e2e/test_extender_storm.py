"""End to end: API server double + a real extender on loopback + a kube-scheduler-like driver.

The storm binds 200 pods of mixed sizes concurrently over 10 nodes of mixed GPUs and then checks the
ground truth, the pods' assignment annotations in the API: no GPU above its capacity, every pod that
was turned away really fits nowhere, every bound pod got the memory it asked on the node it was bound to.
"""
from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import orjson
import pytest
import urllib3

from extender import main
from standins.apiserver import PODS, ApiServerDouble
from standins.scheduler import SchedulerDriver
from tests.e2e.extender_driver import capacity_from_inventories, usage_from_annotations
from tests.extender import builders as b
from vramshare import inventory
from vramshare.config import Config, ExtenderConfig, Policy

N = b.NAMES
MIG = (("3g.40gb", 40192), ("3g.40gb", 40192))


def mixed_cluster(api: ApiServerDouble) -> list[str]:
    nodes = (
        [b.gpu_node(f"a100-{i}", *[b.a100() for _ in range(8)]) for i in range(3)]
        + [b.gpu_node(f"l4-{i}", *[b.l4() for _ in range(4)]) for i in range(3)]
        + [b.gpu_node(f"h100-{i}", b.h100(), b.h100(), b.h100(healthy=i == 0)) for i in range(2)]
        + [b.gpu_node("mixed", b.a100(mode="exclusive"), b.a100(mode="exclusive"), b.a100(), b.l4())]
        + [b.gpu_node("mig", b.a100(mig=MIG), b.a100(mig=MIG))]
    )
    for node in nodes:
        api.create_node(node)
    return [n["metadata"]["name"] for n in nodes]


def storm_pods(rng: random.Random) -> list[dict]:
    pods = []
    for i in range(190):
        gib = rng.choice([2, 4, 8, 10, 16, 20, 24, 40])
        count = 2 if gib % 2 == 0 and rng.random() < 0.15 else 1
        models = rng.choice(["L4", "H100"]) if rng.random() < 0.1 else None
        pods.append(b.pod(f"s{i}", gib * count, count=count, models=models, containers=1 + (i % 7 == 0)))
    pods += [b.pod(f"w{i}", whole=1) for i in range(5)]
    pods += [b.pod(f"m{i}", mig={"3g.40gb": 1}) for i in range(5)]
    rng.shuffle(pods)
    return pods


@pytest.fixture
def api() -> Iterator[ApiServerDouble]:
    with ApiServerDouble() as double:
        yield double


def fits_somewhere(pod: dict, gpus: dict[str, dict], used: dict[str, int]) -> bool:
    """Independent of the extender's code: could this pod's every container be placed on one node now?"""
    meta_ann = pod["metadata"].get("annotations", {})
    count = int(meta_ann.get(N.gpu_count, "1"))
    models = [m for m in meta_ann.get(N.gpu_models, "").split("|") if m]
    for node in {g["node"] for g in gpus.values()}:
        free = {u: g["capacity"] - used.get(u, 0) for u, g in gpus.items()
                if g["node"] == node and g["healthy"] and inventory.model_matches(g["model"], models)}
        ok = True
        for c in pod["spec"]["containers"]:
            lim = c["resources"].get("limits", {})
            if N.gpu_memory in lim:
                per = int(lim[N.gpu_memory]) // count * 1024
                cands = sorted((u for u in free if gpus[u]["kind"] == "shared" and free[u] >= per), key=free.get)
                kind_need, amount = count, per
            else:
                kind = "exclusive" if N.gpu in lim else "mig:3g.40gb"
                cands = [u for u in free if gpus[u]["kind"] == kind and free[u] == gpus[u]["capacity"]]
                kind_need, amount = 1, None
            if len(cands) < kind_need:
                ok = False
                break
            for u in cands[:kind_need]:
                free[u] -= amount if amount is not None else free[u]
        if ok:
            return True
    return False


def test_storm_of_200_concurrent_binds_never_overcommits(api: ApiServerDouble) -> None:
    names = mixed_cluster(api)
    pods = [api.create_pod(p) for p in storm_pods(random.Random(7))]
    # No device plugin reports here, so same-size holds would only run out their timeout: this storm
    # is about concurrent reservations (holds: tests/extender/test_actual.py, bench_hold, bench_soak).
    config = Config(extender=ExtenderConfig(policy=Policy.FGD, hold_timeout_seconds=0))
    with main.start_for_url(api.url, config) as ext:
        assert ext.wait_ready(10) and api.wait_for_watches(2)
        driver = SchedulerDriver(ext.url, names)
        try:
            with ThreadPoolExecutor(8) as pool:
                outcomes = list(pool.map(driver.schedule, pods))
        finally:
            driver.close()
        final = api.pods()
        gpus = capacity_from_inventories(api.nodes())
        used = usage_from_annotations(final)
        over = {u: (m, gpus[u]["capacity"]) for u, m in used.items() if m > gpus[u]["capacity"]}
        assert over == {}
        by_name = {p["metadata"]["name"]: p for p in final}
        placed = [o for o in outcomes if o.node]
        assert 100 < len(placed) < 200  # over-subscribed on purpose: some must be turned away
        for o in placed:
            pod = by_name[o.pod.split("/")[1]]
            assert pod["spec"]["nodeName"] == o.node
            asg = orjson.loads(pod["metadata"]["annotations"][N.assignment])
            assert {gpus[e["uuid"]]["node"] for es in asg.values() for e in es} == {o.node}
        unplaced = [by_name[o.pod.split("/")[1]] for o in outcomes if not o.node]
        assert [p["metadata"]["name"] for p in unplaced if fits_somewhere(p, gpus, used)] == []
        with ext.acct.lock:  # the extender's own view agrees with the API's truth
            mine = {u.slot.uuid: u.used for n in ext.acct.slots for u in ext.acct.state.node_usage(n) if u.used}
        assert mine == used


def test_pod_lifecycle_inspect_410_and_expiry(api: ApiServerDouble) -> None:
    names = mixed_cluster(api)
    config = Config(extender=ExtenderConfig(policy=Policy.BINPACK, assume_timeout_seconds=1.0))
    with main.start_for_url(api.url, config, expiry_interval_s=0.05) as ext:
        assert ext.wait_ready(10) and api.wait_for_watches(2)
        driver = SchedulerDriver(ext.url, names)
        http = urllib3.PoolManager()
        try:
            def inspect(node: str) -> dict:
                return orjson.loads(http.request("GET", f"{ext.url}/inspect/{node}").data)

            def wait(predicate: object, timeout: float = 10.0) -> bool:
                deadline = time.monotonic() + timeout
                while not predicate() and time.monotonic() < deadline:  # type: ignore[operator]
                    time.sleep(0.01)
                return bool(predicate())  # type: ignore[operator]

            pod = api.create_pod(b.pod("llm", 20, models="L4"))
            out = driver.schedule(pod)
            assert out.node.startswith("l4-") and out.attempts == 1
            gpu = next(g for g in inspect(out.node)["gpus"] if g["pods"])
            assert gpu["pods"] == [{"pod": "default/llm", "mib": 20480}] and gpu["freeMiB"] == 2048

            api.create_node(b.gpu_node("spare", b.l4()))  # bump the version past the pod watch's
            assert wait(lambda: "spare" in ext.acct.slots)
            api.compact()
            api.drop_watches()  # 410 Gone on resume: relist
            assert wait(lambda: (ext.app.stats.registry.get_sample_value(
                "vramshare_extender_cache_resyncs_total", {"resource": "pods"}) or 0) >= 1)
            assert wait(lambda: api.open_watches >= 2)
            api.finish_pod_deletion("default", "llm")
            assert wait(lambda: all(not g["pods"] for g in inspect(out.node)["gpus"]))

            ghost = api.create_pod(b.pod("ghost", 20, models="L4"))  # annotated, then its Binding is lost
            api.fail_next("POST", r"/pods/ghost/binding$", code=504)
            assert driver.schedule(ghost, max_attempts=1).node == ""
            api.update(PODS, "default", "ghost", lambda p: p["metadata"]["annotations"].update(
                {N.assume_time: str(time.time_ns())}))  # as another extender instance would have left it
            l4_nodes = ["l4-0", "l4-1", "l4-2", "spare"]
            assert wait(lambda: any(g["pods"] for n in l4_nodes for g in inspect(n)["gpus"]))  # assumed: held
            assert wait(lambda: not any(g["pods"] for n in l4_nodes for g in inspect(n)["gpus"]))  # expired
            assert driver.schedule(ghost).node  # and the memory is usable again
        finally:
            driver.close()
            http.clear()
