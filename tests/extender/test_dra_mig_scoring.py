"""The DRA scorer's MIG fragmentation term (issue 24): for a pod asking a MIG profile, among nodes with
dynamic-MIG GPUs (partitionable devices), the node whose allocator placement keeps the largest
profiles possible wins (vramshare.mig.placement_loss of the first-fit partition)."""
from __future__ import annotations

from deviceplugin import devices
from deviceplugin.backend import DiscoveredGpu
from deviceplugin.dra import slices
from extender import dra_scoring
from standins import dra_allocator
from standins.demo_dra import device_classes
from vramshare import contract, mig
from vramshare.config import Config, DraConfig, DynamicMigConfig

NAMES = contract.Names()
DRIVER = NAMES.dra_driver
H100 = mig.MODELS["H100-SXM5-80GB"]


def mig_slices(node: str) -> list[dict]:
    """One H100 in MIG mode, dynamic: its 25 partitions and its counter set."""
    cfg = Config(dra=DraConfig(gpus=("all",)), dynamic_mig=DynamicMigConfig(gpus=("all",)))
    gpus = [DiscoveredGpu(index=0, uuid=f"GPU-{node}", model="NVIDIA H100 80GB HBM3", memory_mib=81559,
                          mig_enabled=True)]
    inv = devices.build_inventory(gpus, cfg, dra=True)
    dyn = slices.dynamic_models(inv, cfg.dra_partitions)
    return slices.resource_slices(node, None, slices.desired_devices(inv, NAMES, node, taints=False, dynamic=dyn), 1,
                                  NAMES, slices.counter_sets(inv, dyn))


def mig_claim(name: str, profile: str, held: tuple[str, str] | None = None) -> dict:
    c = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
         "metadata": {"name": name, "namespace": "default"},
         "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
             "deviceClassName": NAMES.device_class("mig"),
             "selectors": [{"cel": {"expression": f'device.attributes["{DRIVER}"].profile == "{profile}"'}}]}}]}}}
    if held:
        c["status"] = {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": DRIVER, "pool": held[0], "device": held[1]}]}}}
    return c


def pod(claim_name: str) -> dict:
    return {"metadata": {"name": "p", "namespace": "default", "uid": "u"},
            "spec": {"resourceClaims": [{"name": "gpu"}], "containers": [{"name": "c", "image": "x"}]},
            "status": {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": claim_name}]}}


def cluster(held: dict[str, str], asked: str) -> dra_scoring.DraCluster:
    dra = dra_scoring.DraCluster(NAMES, 1024)
    for node in ("a", "b"):
        for s in mig_slices(node):
            dra.put("ResourceSlice", {**s, "metadata": {**s["metadata"], "name": s["metadata"]["name"]}})
    for node, device in held.items():
        dra.put("ResourceClaim", mig_claim(f"held-{node}", "x", (node, device)))
    dra.put("ResourceClaim", mig_claim("mine", asked))
    return dra


def allocator_pick(dra: dra_scoring.DraCluster, node: str, profile: str) -> str:
    """What the stand-in allocator (upstream's rules) really takes there: the scorer must predict it."""
    got = dra_allocator.allocate(mig_claim("x", profile), node, list(dra.slices.values()),
                                 {c["metadata"]["name"]: c for c in device_classes()},
                                 [c for c in dra.claims.values() if (c.get("status") or {}).get("allocation")])
    return got["devices"]["results"][0]["device"]


def test_partitions_are_not_slots():
    dra = cluster({}, "3g.40gb")
    st = dra.state()
    assert st.slots(st.row("a")) == []
    assert [len(g.devices) for g in dra._partitions["a"]] == [25]


def test_prefers_the_node_whose_placement_keeps_a_4g_possible():
    # a: 3g.40gb@4 held, so a 1g.10gb lands at slot 3 and kills 4g.40gb@0; b: 1g.10gb@6 held, the
    # next lands at 5 and 4g.40gb@0 stays creatable
    dra = cluster({"a": "gpu-0-mig-3g40gb-9-4", "b": "gpu-0-mig-1g10gb-19-6"}, "1g.10gb")
    assert allocator_pick(dra, "a", "1g.10gb") == "gpu-0-mig-1g10gb-19-3"
    assert allocator_pick(dra, "b", "1g.10gb") == "gpu-0-mig-1g10gb-19-5"
    scores = dict(dra.score(pod("mine"), ["a", "b"], "fgd"))
    assert scores["b"] == contract.MAX_EXTENDER_PRIORITY and scores["a"] < scores["b"]
    assert mig.free_starts(H100, [mig.Placed(6, "1g.10gb"), mig.Placed(5, "1g.10gb")], "4g.40gb") == [0]


def test_prefers_filling_a_used_gpu_to_keeping_an_empty_one_whole():
    # a: empty (a 3g.40gb there ends 7g.80gb); b: 3g.40gb@4 held (the 3g@0 fills it)
    dra = cluster({"b": "gpu-0-mig-3g40gb-9-4"}, "3g.40gb")
    scores = dict(dra.score(pod("mine"), ["a", "b"], "fgd"))
    assert scores["b"] > scores["a"]


def test_a_node_that_cannot_place_the_profile_scores_lowest():
    dra = cluster({"a": "gpu-0-mig-7g80gb-0-0"}, "3g.40gb")
    scores = dict(dra.score(pod("mine"), ["a", "b"], "fgd"))
    assert scores["a"] == contract.MIN_EXTENDER_PRIORITY and scores["b"] == contract.MAX_EXTENDER_PRIORITY
