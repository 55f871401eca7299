"""Prioritize for DRA pods: the per-GPU view from ResourceSlices and allocated claims, live via watches."""
from __future__ import annotations

import contextlib
import dataclasses
import json
from typing import Iterator

import orjson
from kubernetes import client

from deviceplugin import devices
from deviceplugin.backend import DiscoveredGpu
from deviceplugin.dra import slices
from extender import dra_scoring
from extender.main import start_for_url
from standins.apiserver import ApiServerDouble
from standins.apiserver.resources import RESOURCECLAIMS
from vramshare import contract
from vramshare.config import Config, DraConfig, Policy
from vramshare.kube import api_client_for

NAMES = contract.Names()
DRIVER = NAMES.dra_driver
H100 = 81920


def node_slices(node: str, n_gpus: int) -> list[dict]:
    cfg = Config(dra=DraConfig(gpus=("all",)))
    gpus = [DiscoveredGpu(index=i, uuid=f"GPU-{node}-{i}", model="NVIDIA H100", memory_mib=H100) for i in range(n_gpus)]
    inv = devices.build_inventory(gpus, cfg, dra=True)
    return slices.resource_slices(node, None, slices.desired_devices(inv, NAMES, node, taints=False), 1, NAMES)


def claim(name: str, gib: int, count: int = 1, allocated: list[tuple[str, str, int]] | None = None) -> dict:
    c = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
         "metadata": {"name": name, "namespace": "default"},
         "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
             "deviceClassName": NAMES.device_class("gpu-memory"), "count": count,
             "capacity": {"requests": {"memory": f"{gib}Gi"}}}}]}}}
    if allocated:
        c["status"] = {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": DRIVER, "pool": node, "device": dev, "shareID": f"s-{name}-{i}",
             "consumedCapacity": {"memory": f"{g}Gi"}} for i, (node, dev, g) in enumerate(allocated)]}}}
    return c


def pod(claim_name: str) -> dict:
    return {"metadata": {"name": "p", "namespace": "default", "uid": "u"},
            "spec": {"resourceClaims": [{"name": "gpu"}], "containers": [{"name": "c", "image": "x"}]},
            "status": {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": claim_name}]}}


def cluster_with(*objs: dict) -> dra_scoring.DraCluster:
    dra = dra_scoring.DraCluster(NAMES, 1024)
    for o in objs:
        dra.put(o["kind"], o)
    return dra


def test_demands_come_from_the_pods_unallocated_claims_of_our_classes():
    dra = cluster_with(claim("mine", 22), claim("tp", 48, count=2))
    assert dra.demands(pod("mine"))[0].per_gpu == 22 * 1024
    [tp] = dra.demands(pod("tp"))
    assert (tp.per_gpu, tp.count) == (48 * 1024, 2)
    other = claim("nv", 10)
    other["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = "gpu.nvidia.com"
    dra.put("ResourceClaim", other)
    assert not dra.handles(pod("nv")) and not dra.handles(pod("absent"))
    assert dra_scoring.scores_for(dra, pod("nv"), ["a"], "fgd") is None  # not ours: the usual path


def test_allocated_claims_charge_their_gpus_and_foreign_slices_are_ignored():
    foreign = dict(node_slices("n9", 1)[0])
    foreign["spec"] = {**foreign["spec"], "driver": "gpu.nvidia.com"}
    dra = cluster_with(*node_slices("n1", 2), foreign, claim("held", 60, allocated=[("n1", "gpu-0", 60)]))
    st = dra.state()
    assert st.row("n9") is None
    assert [u.used for u in st.node_usage("n1")] == [60 * 1024, 0]


def test_binpack_prefers_the_node_with_the_used_gpu_and_a_full_node_scores_zero():
    dra = cluster_with(*node_slices("n1", 1), *node_slices("n2", 1), *node_slices("n3", 1),
                       claim("held", 40, allocated=[("n1", "gpu-0", 40)]),
                       claim("full", 75, allocated=[("n3", "gpu-0", 75)]),
                       claim("mine", 16))
    scores = dict(dra.score(pod("mine"), ["n1", "n2", "n3", "unknown"], "binpack"))
    assert scores["n1"] == 10 and scores["n2"] < 10 and scores["n3"] == 0 and scores["unknown"] == 0


def test_a_tainted_gpu_is_not_scored_as_free():
    s = node_slices("n1", 1)[0]
    s["spec"]["devices"][0]["taints"] = [slices.unhealthy_taint(NAMES)]
    dra = cluster_with(s, *node_slices("n2", 1), claim("mine", 16))
    scores = dict(dra.score(pod("mine"), ["n1", "n2"], "fgd"))
    assert scores["n1"] == 0 and scores["n2"] == 10


def test_the_live_extender_scores_dra_pods_from_its_watches():
    with ApiServerDouble() as api, api_client_for(api.url) as http:
        resource = client.ResourceV1Api(http)
        for node in ("n1", "n2"):
            for s in node_slices(node, 1):
                resource.create_resource_slice(s)
        held = resource.create_namespaced_resource_claim("default", claim("held", 40))
        body = resource.api_client.sanitize_for_serialization(held)
        body["status"] = claim("x", 40, allocated=[("n1", "gpu-0", 40)])["status"]
        resource.replace_namespaced_resource_claim_status("held", "default", body)
        resource.create_namespaced_resource_claim("default", claim("mine", 16))
        with start_for_url(api.url, Config(), policy=Policy.BINPACK, dra=True, watch_timeout_s=2) as ext:
            assert ext.app.dra is not None
            assert ext.wait_ready(20)  # no verb is answered before the node and pod lists are in
            assert api.wait_for(lambda a: len(ext.app.dra.claims) == 2 and len(ext.app.dra.slices) == 2, timeout=20)
            req = orjson.dumps({"Pod": pod("mine"), "Nodes": None, "NodeNames": ["n1", "n2"]})
            resp = ext.app.handle("POST", "/prioritize", req)
            scores = {h["Host"]: h["Score"] for h in json.loads(resp.body)}
            assert scores["n1"] == 10 and scores["n2"] < 10
            plain = orjson.dumps({"Pod": {"metadata": {"name": "q", "namespace": "default"},
                                          "spec": {"containers": [{"name": "c"}]}}, "Nodes": None, "NodeNames": ["n1"]})
            assert json.loads(ext.app.handle("POST", "/prioritize", plain).body) == [{"Host": "n1", "Score": 0}]


from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.integers(1, 30), st.booleans()), max_size=25))
def test_claims_applied_in_place_equal_a_fresh_build(ops):
    """Claim events update the built state in place; it must always equal a build from scratch."""
    live = cluster_with(*node_slices("n1", 2), *node_slices("n2", 2))
    live.state()
    for i, gpu, gib, deleted in ops:
        node, dev = ("n1", "n2")[gpu // 2], f"gpu-{gpu % 2}"
        live.put("ResourceClaim", claim(f"c{i}", gib, allocated=[(node, dev, gib)]), deleted=deleted)
        fresh = cluster_with(*live.slices.values(), *live.claims.values())
        for n in ("n1", "n2"):
            assert [u.used for u in live.state().node_usage(n)] == [u.used for u in fresh.state().node_usage(n)]


def _lists(api: ApiServerDouble, plural: str) -> int:
    """LIST requests (not watches) the double answered for ``plural``."""
    return len([r for r in api.requests("GET", rf"/{plural}$") if "watch=" not in r.query])


def _allocated(resource: client.ResourceV1Api, name: str, gib: int, node: str = "n1") -> None:
    made = resource.create_namespaced_resource_claim("default", claim(name, gib))
    body = resource.api_client.sanitize_for_serialization(made)
    body["status"] = claim(name, gib, allocated=[(node, "gpu-0", gib)])["status"]
    resource.replace_namespaced_resource_claim_status(name, "default", body)


def test_the_dra_watch_follows_events_with_the_installed_client_and_lists_once():
    """Issue 17 item 13: with kubernetes 37.x (``ResourceV1ResourceClaim``, no ``V1ResourceClaim``)
    every watch event failed to deserialize and the watch relisted every claim once a second, for ever."""
    with ApiServerDouble() as api, api_client_for(api.url) as http:
        resource = client.ResourceV1Api(http)
        for s in node_slices("n1", 1):
            resource.create_resource_slice(s)
        dra = dra_scoring.DraCluster(NAMES, 1024)
        watcher = dra_scoring.DraWatch(http, dra, timeout_s=30)
        watcher.start()
        try:
            assert api.wait_for(lambda a: len(dra.slices) == 1 and a.open_watches >= 2, timeout=20)
            for i in range(3):  # arrive by watch events only
                _allocated(resource, f"c{i}", 10)
            assert api.wait_for(lambda a: len(dra.claims) == 3 and all(
                (c.get("status") or {}).get("allocation") for c in dra.claims.values()), timeout=20)
            assert [u.used for u in dra.state().node_usage("n1")] == [30 * 1024]
            resource.delete_namespaced_resource_claim("c0", "default", _preload_content=False).release_conn()
            assert api.wait_for(lambda a: "default/c0" not in dra.claims, timeout=20)
            assert (_lists(api, "resourceclaims"), _lists(api, "resourceslices")) == (1, 1)
        finally:
            watcher.stop()


@contextlib.contextmanager
def _watching_one_claim() -> Iterator[tuple[ApiServerDouble, dra_scoring.DraCluster]]:
    """A DraWatch over one node's slices and one claim ``default/held`` of 40 GiB, once both watches run."""
    with ApiServerDouble() as api, api_client_for(api.url) as http:
        resource = client.ResourceV1Api(http)
        for s in node_slices("n1", 1):
            resource.create_resource_slice(s)
        _allocated(resource, "held", 40)
        dra = dra_scoring.DraCluster(NAMES, 1024)
        watcher = dra_scoring.DraWatch(http, dra, timeout_s=30, backoff_s=0.05)
        watcher.start()
        try:
            assert api.wait_for(lambda a: "default/held" in dra.claims and a.open_watches >= 2, timeout=20)
            yield api, dra
        finally:
            watcher.stop()


def test_a_relist_drops_what_was_deleted_while_the_watch_was_down():
    """Issue 17 item 9: DraWatch never dropped objects deleted during an outage, so a deleted claim
    stayed charged. A list is the whole truth: it replaces the view."""
    with _watching_one_claim() as (api, dra):
        assert [u.used for u in dra.state().node_usage("n1")] == [40 * 1024]
        api.stop()  # the outage: the claim goes and the history with it
        api.delete(RESOURCECLAIMS, "default", "held")
        api.compact()
        api.start()
        assert api.wait_for(lambda a: "default/held" not in dra.claims, timeout=20)
        assert [u.used for u in dra.state().node_usage("n1")] == [0]


def test_a_transient_404_after_the_first_list_keeps_watching_and_drops_what_was_deleted_meanwhile():
    """Issue 21: a 403/404 met on a relist (an API server upgrade, an RBAC edit) ended the DRA watch for
    good while prioritize kept scoring from its view: a claim deleted after that stayed charged for ever.
    Only before the first list does a 403/404 mean "no DRA here"; later it is an outage like others."""
    with _watching_one_claim() as (api, dra):
        api.fail_next("GET", r"/resourceclaims$", 404, times=2)  # the group is gone for a moment
        api.compact()
        api.drop_watches()  # the claim watch resumes into the 404s, then relists
        api.delete(RESOURCECLAIMS, "default", "held")
        assert api.wait_for(lambda a: "default/held" not in dra.claims, timeout=20)
        assert [u.used for u in dra.state().node_usage("n1")] == [0]


def test_foreign_memory_a_slice_took_off_is_booked_and_older_claims_stay_charged():
    """A DRA plugin publishes a shared GPU's capacity less the memory no claim of ours holds and names
    that memory in ``foreignMiB`` (vramshare.contract.slice_foreign): the view books it as used beside the
    claims, as on the device plugin's GPUs, so a claim allocated before that memory appeared is still
    charged (before: it no longer fit the smaller capacity, was dropped as unaccounted, and the GPU
    scored as having its memory free)."""
    cfg = Config(dra=DraConfig(gpus=("all",)))
    gpus = [DiscoveredGpu(index=i, uuid=f"GPU-n1-{i}", model="NVIDIA H100", memory_mib=H100) for i in range(1)]
    inv = devices.build_inventory(gpus, cfg, dra=True)
    held = dataclasses.replace(inv, gpus=(dataclasses.replace(inv.gpus[0], foreign_mib=40 * 1024),))
    n1 = slices.resource_slices("n1", None, slices.desired_devices(held, NAMES, "n1", taints=False), 2, NAMES)
    assert n1[0]["spec"]["devices"][0]["capacity"]["memory"]["value"] == f"{40 * 1024}Mi"
    dra = cluster_with(*n1, *node_slices("n2", 1), claim("old", 60, allocated=[("n1", "gpu-0", 60)]),
                       claim("mine", 16))
    [u] = dra.state().node_usage("n1")
    assert (u.slot.capacity, u.slot.foreign, u.used) == (80 * 1024, 40 * 1024, 100 * 1024)  # over: takes nothing
    assert not dra._unaccounted
    scores = dict(dra.score(pod("mine"), ["n1", "n2"], "binpack"))
    assert scores["n1"] == 0 and scores["n2"] > 0


def test_inspect_shows_a_dra_nodes_foreign_memory_and_never_negative_free():
    """``vramshare inspect`` on a DRA node with memory held outside: the foreign MiB is part of USED and
    named; free is what claims can still take (0 on a GPU that is over, not negative)."""
    from extender import accounting, inspection
    cfg = Config(dra=DraConfig(gpus=("all",)))
    gpus = [DiscoveredGpu(index=i, uuid=f"GPU-n1-{i}", model="NVIDIA H100", memory_mib=H100) for i in range(2)]
    inv = devices.build_inventory(gpus, cfg, dra=True)
    held = dataclasses.replace(inv, gpus=(dataclasses.replace(inv.gpus[0], foreign_mib=40 * 1024), inv.gpus[1]))
    n1 = slices.resource_slices("n1", None, slices.desired_devices(held, NAMES, "n1", taints=False), 2, NAMES)
    dra = cluster_with(*n1, claim("old", 60, allocated=[("n1", "gpu-0", 60)]))
    doc = inspection.render(accounting.Accounting(Config()), dra=dra)
    assert doc is not None
    [n] = doc["draNodes"]
    assert (n["totalMiB"], n["usedMiB"], n["foreignMiB"], n["freeMiB"]) == (160 * 1024, 100 * 1024, 40 * 1024,
                                                                              80 * 1024)
    assert "1 DRA node(s): 100.0 of 160.0 GiB used (40.0 held outside our pods), 80.0 GiB free" in \
        inspection.format_table(doc)
