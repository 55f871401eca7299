"""The DRA plugin under node scoping (deploy/daemonset/dra/admission-policies.yaml and policy 2 of
deploy/daemonset/admission-policies.yaml), against the objects it really writes.

The slices come from ``deviceplugin.dra.slices`` (what ``SlicePublisher`` applies), the pods from the
extender's builders. Each attack is a write a compromised GPU node's DRA plugin could make with its
cluster-wide RBAC: another node's slices (create, update, delete), another driver's, a pool named
after another node (its newer generation would hide that node's devices), a slice for every node, the
handshake annotations on a pod, another node's pods. Upstream's rule for kubelets is the oracle
(NodeRestriction ``admitResourceSlice``: the slice's nodeName is the requesting node's).
"""
from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from hypothesis import given, settings, strategies as st

from deviceplugin import devices
from deviceplugin.dra import slices
from deviceplugin.simulated_backend import SimulatedBackend
from tests.security.admission import ROOT, Request, admit, load
from tests.security.test_admission_policies import DP, USER, bound, on_node, with_ann
from vramshare import config, contract

N = contract.Names()
DRA = "system:serviceaccount:vramshare-system:vramshare-dra-plugin"
POLICY = "vramshare-dra-plugin-node-scope"


def node_slices(node: str, generation: int = 1) -> list[dict[str, Any]]:
    """The ResourceSlices the DRA plugin of ``node`` publishes for the demo GPUs."""
    cfg = config.Config(dra=config.DraConfig(gpus=("all",)))
    inv = devices.build_inventory(SimulatedBackend.demo().discover(), cfg, frozenset(), dra=True)
    devs = slices.desired_devices(inv, cfg.names, node, taints=False)
    return slices.resource_slices(node, f"uid-{node}", devs, generation, cfg.names)


def one_slice(node: str = "n1") -> dict[str, Any]:
    return node_slices(node)[0]


# -- the policy is installed with the DRA path and names what the rest of dra/ names --------------
def test_the_policy_is_bound_and_covers_every_slice_write_the_rbac_grants() -> None:
    policies, bindings = load()
    assert bindings[POLICY]["spec"]["validationActions"] == ["Deny"]
    kust = yaml.safe_load((ROOT / "deploy/daemonset/dra/kustomization.yaml").read_text())
    assert "admission-policies.yaml" in kust["resources"]
    [rule] = policies[POLICY]["spec"]["matchConstraints"]["resourceRules"]
    rbac = [d for d in yaml.safe_load_all((ROOT / "deploy/daemonset/dra/rbac-dra-plugin.yaml").read_text())
            if d and d["kind"] == "ClusterRole"][0]
    verbs = {v for r in rbac["rules"] if "resourceslices" in r["resources"] for v in r["verbs"]}
    op = {"create": "CREATE", "patch": "UPDATE", "update": "UPDATE", "delete": "DELETE", "deletecollection": "DELETE"}
    assert {op[v] for v in verbs if v in op} <= set(rule["operations"])
    assert rule["apiGroups"] == ["resource.k8s.io"] and rule["resources"] == ["resourceslices"]
    sa = [d for d in yaml.safe_load_all((ROOT / "deploy/daemonset/dra/rbac-dra-plugin.yaml").read_text())
          if d and d["kind"] == "ServiceAccount"][0]
    assert DRA == f"system:serviceaccount:{sa['metadata']['namespace']}:{sa['metadata']['name']}"
    assert f"'{N.dra_driver}'" in str(policies[POLICY]["spec"]["validations"])


# -- its own node's pool: everything the publisher does is admitted ------------------------------
def test_the_plugin_publishes_updates_and_withdraws_its_own_pool() -> None:
    for s in node_slices("n1"):
        assert admit(Request("CREATE", "resourceslices", DRA, s, None, on_node("n1"))) == []
        newer = copy.deepcopy(s)
        newer["spec"]["pool"]["generation"] += 1
        assert admit(Request("UPDATE", "resourceslices", DRA, newer, s, on_node("n1"))) == []
        said = copy.deepcopy(newer)  # the config text it runs, on its slices (contract.config_in_force)
        said["metadata"]["annotations"] = {N.config_in_force: '{"digest":"0123456789abcdef","restartPending":[]}'}
        assert admit(Request("UPDATE", "resourceslices", DRA, said, newer, on_node("n1"))) == []
        assert admit(Request("DELETE", "resourceslices", DRA, None, s, on_node("n1"))) == []


# -- attacks ------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["CREATE", "UPDATE", "DELETE"])
def test_the_plugin_of_another_node_is_refused(op: str) -> None:
    theirs = one_slice("n2")
    obj, old = {"CREATE": (theirs, None), "UPDATE": (theirs, theirs), "DELETE": (None, theirs)}[op]
    [msg] = admit(Request(op, "resourceslices", DRA, obj, old, on_node("n1")))
    assert POLICY in msg and 'of node n1 may not write ResourceSlices of node "n2"' in msg


def test_a_pool_named_after_another_node_is_refused() -> None:
    """Same nodeName, pool "n2" with a huge generation: kube-scheduler would keep only this
    generation of pool n2 and drop node n2's real slices."""
    forged = one_slice("n1")
    forged["spec"]["pool"] = {"name": "n2", "generation": 2**40, "resourceSliceCount": 1}
    [msg] = admit(Request("CREATE", "resourceslices", DRA, forged, None, on_node("n1")))
    assert "may write only the pool named n1" in msg


def test_another_drivers_slice_is_refused() -> None:
    forged = one_slice("n1")
    forged["spec"]["driver"] = "gpu.nvidia.com"
    [msg] = admit(Request("CREATE", "resourceslices", DRA, forged, None, on_node("n1")))
    assert "only ResourceSlices of driver gpu.vramshare.io" in msg
    assert admit(Request("DELETE", "resourceslices", DRA, None, forged, on_node("n1")))


@pytest.mark.parametrize("scope", [{"allNodes": True}, {"nodeSelector": {"nodeSelectorTerms": [{}]}}])
def test_a_slice_for_other_nodes_is_refused(scope: dict[str, Any]) -> None:
    forged = one_slice("n1")
    del forged["spec"]["nodeName"]
    forged["spec"].update(scope)
    [msg] = admit(Request("CREATE", "resourceslices", DRA, forged, None, on_node("n1")))
    assert "may not write ResourceSlices of no node" in msg


def test_moving_a_slice_to_its_node_is_refused() -> None:
    """nodeName is immutable by validation; the policy checks the old object too, as NodeRestriction's
    node authorizer does for updates."""
    theirs = one_slice("n2")
    moved = copy.deepcopy(theirs)
    moved["spec"]["nodeName"] = "n1"
    assert admit(Request("UPDATE", "resourceslices", DRA, moved, theirs, on_node("n1")))


def test_a_token_without_node_claim_writes_no_slice() -> None:
    [msg] = admit(Request("CREATE", "resourceslices", DRA, one_slice("n1"), None, {}))
    assert "no node claim" in msg


def test_other_writers_of_slices_are_not_this_policys_business() -> None:
    """Other drivers' plugins, and admins, are outside its match condition."""
    theirs = one_slice("n2")
    theirs["spec"]["driver"] = "gpu.nvidia.com"
    assert admit(Request("CREATE", "resourceslices", "system:serviceaccount:nvidia:dra-driver", theirs)) == []
    assert admit(Request("DELETE", "resourceslices", USER, None, one_slice("n1"))) == []


NODES = st.sampled_from(["n1", "n2", ""])


@settings(max_examples=200, deadline=None)
@given(op=st.sampled_from(["CREATE", "UPDATE", "DELETE"]), node=NODES, old_node=NODES, pool=NODES,
       driver=st.sampled_from([N.dra_driver, "gpu.nvidia.com"]), claim=st.sampled_from(["n1", "n2", None]))
def test_slice_writes_follow_node_restriction(op: str, node: str, old_node: str, pool: str, driver: str,
                                              claim: str | None) -> None:
    """Oracle (NodeRestriction admitResourceSlice, plus driver and pool): admitted iff the token has a
    node claim and every slice the request touches is that node's, of our driver, in that node's pool."""
    def make(n: str) -> dict[str, Any]:
        s = one_slice("n1")
        s["spec"]["driver"], s["spec"]["pool"]["name"] = driver, pool
        if n:
            s["spec"]["nodeName"] = n
        else:
            del s["spec"]["nodeName"]
            s["spec"]["allNodes"] = True
        return s
    obj = make(node) if op != "DELETE" else None
    old = make(old_node if op == "UPDATE" else node) if op != "CREATE" else None
    touched = [s for s in (obj, old) if s is not None]
    allowed = claim is not None and all(s["spec"].get("nodeName") == claim and s["spec"]["driver"] == N.dra_driver
                                        and s["spec"]["pool"]["name"] == claim for s in touched)
    got = admit(Request(op, "resourceslices", DRA, obj, old, on_node(claim) if claim else {}))
    assert (got == []) == allowed, got


# -- its pod writes: the quota loop's two annotations, on its node's pods --------------------------
def test_the_plugin_mirrors_quotas_on_its_nodes_pods() -> None:
    old = bound("n1")
    new = with_ann(old, quota_mib='{"c0":[{"uuid":"GPU-n1-0","mib":8192}]}', over_limit='{"container":"c0"}')
    assert admit(Request("UPDATE", "pods", DRA, new, old, on_node("n1"))) == []


def test_the_plugin_of_another_node_may_not_write_its_pods() -> None:
    old = bound("n2")
    msgs = admit(Request("UPDATE", "pods", DRA, with_ann(old, quota_mib="{}"), old, on_node("n1")))
    assert any('DRA plugin of node n1 may not write pods of node "n2"' in m for m in msgs)


@pytest.mark.parametrize("key", ["assignment", "allocation_state", "assume_time"])
def test_the_plugin_may_not_touch_the_handshake_annotations(key: str) -> None:
    old = bound("n1")
    [msg] = admit(Request("UPDATE", "pods", DRA, with_ann(old, **{key: "forged"}), old, on_node("n1")))
    assert "may change only vramshare.io/quota-mib and vramshare.io/over-limit" in msg


@pytest.mark.parametrize("op", ["CREATE", "DELETE"])
def test_the_plugin_creates_and_deletes_no_pod(op: str) -> None:
    pod = bound("n1")
    assert admit(Request(op, "pods", DRA, pod if op == "CREATE" else None, pod if op == "DELETE" else None,
                         on_node("n1")))


def test_the_plugin_writes_no_node_inventory() -> None:
    from tests.extender import builders as b
    node = b.gpu_node("n1", b.a100())
    forged = b.gpu_node("n1", b.a100(), b.a100())
    msgs = admit(Request("UPDATE", "nodes", DRA, forged, node, on_node("n1")))
    assert any("may change only vramshare.io/resident-models of a node, not vramshare.io/gpu-inventory" in m
               for m in msgs), msgs
    assert admit(Request("UPDATE", "nodes", DP, forged, node, on_node("n1"))) == []


# -- its node write (issue 23): the resident-models annotation of its own Node, nothing else -------
def _models_node(node: str = "n1", text: str | None = None) -> dict[str, Any]:
    from tests.extender import builders as b
    from vramshare.contract import resident_models
    from vramshare.inventory import ResidentModel
    obj = b.gpu_node(node, b.a100())
    return with_ann(obj, resident_models=text if text is not None else resident_models.encode(
        (ResidentModel("org/llama", "main", 16 << 30),)))


def test_the_plugin_publishes_its_nodes_resident_models() -> None:
    """What ``NodeAnnotationPublisher`` patches (its first write creates the key, later ones change it)."""
    fresh = _models_node()
    bare = with_ann(fresh, resident_models=None)
    assert admit(Request("UPDATE", "nodes", DRA, fresh, bare, on_node("n1"))) == []
    assert admit(Request("UPDATE", "nodes", DRA, _models_node(text='{"version":"v1","models":[]}'), fresh,
                         on_node("n1"))) == []
    assert admit(Request("UPDATE", "nodes", DRA, bare, fresh, on_node("n1"))) == []  # removed (residency off)


def test_the_plugin_may_not_write_another_nodes_models_nor_anything_else_of_its_node() -> None:
    fresh, bare = _models_node("n2"), with_ann(_models_node("n2"), resident_models=None)
    [msg] = admit(Request("UPDATE", "nodes", DRA, fresh, bare, on_node("n1")))
    assert 'DRA plugin of node n1 may not write nodes of node "n2"' in msg
    mine = _models_node()
    for change in ({"quota_mib": "{}"}, {"example.com/x": "y"}):
        assert admit(Request("UPDATE", "nodes", DRA, with_ann(mine, **change), mine, on_node("n1")))
    labeled = copy.deepcopy(mine)
    labeled["metadata"]["labels"] = {"x": "y"}
    assert admit(Request("UPDATE", "nodes", DRA, labeled, mine, on_node("n1")))
    assert admit(Request("UPDATE", "nodes", DRA, mine, with_ann(mine, resident_models=None), None)), \
        "a token without the node claim writes nothing"


def test_users_and_the_extender_may_not_forge_resident_models() -> None:
    from tests.security.test_admission_policies import EXT
    fresh, bare = _models_node(), with_ann(_models_node(), resident_models=None)
    for who in (USER, EXT):
        msgs = admit(Request("UPDATE", "nodes", who, fresh, bare))
        assert any("vramshare-protect-annotations" in m for m in msgs), (who, msgs)


def test_the_plugin_may_not_put_resident_models_on_a_pod() -> None:
    old = bound("n1")
    [msg] = admit(Request("UPDATE", "pods", DRA, with_ann(old, resident_models="{}"), old, on_node("n1")))
    assert "may change only vramshare.io/quota-mib and vramshare.io/over-limit of a pod" in msg

