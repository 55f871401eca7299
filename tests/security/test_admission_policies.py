"""The admission policies of deploy/daemonset/admission-policies.yaml against real pod and node objects.

Each case is an attack from issues 8 and 11 (a GPU pod on the default scheduler, a pod naming its node,
a forged assignment, a device plugin of one node writing another node's pods or anything but our
annotations) or the legitimate write it must keep allowing. The expressions come from the YAML and run
in a CEL interpreter (tests/security/admission.py).
"""
from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest
import yaml
from hypothesis import given, settings, strategies as st

from tests.extender import builders as b
from tests.security.admission import ROOT, Request, _eval as cel_eval, admit, load
from vramshare import contract

N = contract.Names()
DP = "system:serviceaccount:vramshare-system:vramshare-device-plugin"
EXT = "system:serviceaccount:vramshare-system:vramshare-extender"
USER = "alice@example.com"
CLAIM = "authentication.kubernetes.io/node-name"


def on_node(node: str) -> dict[str, list[str]]:
    return {CLAIM: [node], "authentication.kubernetes.io/node-uid": [f"uid-{node}"]}


def gpu_pod(**kw: Any) -> dict[str, Any]:
    return b.pod("llm", 8, **kw)


def with_ann(obj: dict[str, Any], **changes: str | None) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    ann = out["metadata"].setdefault("annotations", {})
    for k, v in changes.items():
        key = k if "/" in k else f"{N.domain}/{k.replace('_', '-')}"
        if v is None:
            ann.pop(key, None)
        else:
            ann[key] = v
    return out


def bound(node: str) -> dict[str, Any]:
    return b.assigned(gpu_pod(), node, [(b.uuid_of(node, 0), 8192)], 1_700_000_000_000_000_000)


# -- every policy is bound, and the names agree with the rest of deploy/ and the contract ---------
def test_every_policy_is_bound_with_deny() -> None:
    policies, bindings = load()
    assert set(policies) == set(bindings) and len(policies) == 5
    assert all(bd["spec"]["validationActions"] == ["Deny"] for bd in bindings.values())


def test_the_names_in_the_policies_are_the_deployed_ones() -> None:
    text = (ROOT / "deploy/daemonset/admission-policies.yaml").read_text()
    rbac = "".join((ROOT / f"deploy/daemonset/rbac-{x}.yaml").read_text() for x in ("device-plugin", "extender"))
    for sa in ("vramshare-device-plugin", "vramshare-extender"):
        assert f"system:serviceaccount:vramshare-system:{sa}" in text and f"name: {sa}\n" in rbac
    sched = yaml.safe_load(yaml.safe_load((ROOT / "deploy/daemonset/scheduler-config.yaml").read_text())
                           ["data"]["scheduler-config.yaml"])
    assert sched["profiles"][0]["schedulerName"] == "vramshare-scheduler"


def _user_owned(resource: str) -> list[str]:
    """The policy's ``userOwned`` variable, evaluated by CEL as the API server would for ``resource``."""
    policies, _ = load()
    spec = policies["vramshare-protect-annotations"]["spec"]
    ctx = Request("CREATE", resource, USER, bound("n1")).context()
    ctx["variables"] = {}
    for var in spec["variables"]:
        ctx["variables"][var["name"]] = cel_eval(var["expression"], ctx)
        if var["name"] == "userOwned":
            return list(ctx["variables"]["userOwned"])
    raise AssertionError("vramshare-protect-annotations has no userOwned variable")


def test_the_users_annotations_are_exactly_the_contracts_one_list() -> None:
    """Issue 17: the exempt list was spelled by hand (three names) and refused README's quota-class."""
    assert sorted(_user_owned("pods")) == sorted(N.user_annotations())
    assert _user_owned("nodes") == []
    assert not set(N.vramshare_annotations()) & set(N.user_annotations())


def test_every_annotation_of_the_contract_has_one_writer() -> None:
    """Issue 21: each ``<domain>/*`` annotation the contract names is either the users' or vramshare's,
    never both, never neither; the policies below are checked against these lists."""
    props = [p for p, v in vars(contract.Names).items() if isinstance(v, property)]
    annotations = {getattr(N, p) for p in props if getattr(N, p).startswith(f"{N.domain}/")} - {
        N.gpu_memory, N.gpu, N.mig_prefix, N.cdi_kind}  # resources, not annotations
    owners = [*N.user_annotations(), *N.vramshare_annotations(), *N.node_annotations(), *N.slice_annotations()]
    assert len(owners) == len(set(owners))
    assert annotations <= set(owners), sorted(annotations - set(owners))


def test_the_dra_plugin_writes_only_the_quota_loops_annotations() -> None:
    text = (ROOT / "deploy/daemonset/admission-policies.yaml").read_text()
    listed = "[" + ", ".join(f"'{k}'" for k in N.quota_loop_annotations()) + "]"
    assert f"variables.ourAnnotationsChanged.all(k, k in {listed})" in text


@pytest.mark.parametrize("key", N.user_annotations())
def test_users_set_change_and_remove_each_of_their_annotations(key: str) -> None:
    pod = gpu_pod()
    pod["metadata"]["annotations"] = {key: "1"}
    assert admit(Request("CREATE", "pods", USER, pod)) == []
    assert admit(Request("UPDATE", "pods", USER, with_ann(pod, **{key: "2"}), pod)) == []
    assert admit(Request("UPDATE", "pods", USER, with_ann(pod, **{key: None}), pod)) == []


def test_a_refusal_names_what_users_may_write() -> None:
    [msg] = admit(Request("CREATE", "pods", USER, with_ann(gpu_pod(), assignment="{}")))
    assert msg.endswith("users may set only " + ", ".join(N.user_annotations()))


# -- 1. GPU pods go through the vramshare scheduler ------------------------------------------------
def test_a_gpu_pod_on_the_default_scheduler_is_refused_with_the_fix() -> None:
    pod = gpu_pod()
    pod["spec"]["schedulerName"] = "default-scheduler"
    [msg] = admit(Request("CREATE", "pods", USER, pod))
    assert "vramshare-require-scheduler" in msg and '"default-scheduler"' in msg
    assert "set spec.schedulerName: vramshare-scheduler" in msg


@pytest.mark.parametrize("shape", ["limits", "requests", "init", "whole", "mig", "unset"])
def test_every_way_of_asking_for_our_resources_needs_the_scheduler(shape: str) -> None:
    pod = b.pod("p", 0, whole=1 if shape == "whole" else 0, mig={"1g.10gb": 1} if shape == "mig" else None)
    pod["spec"]["schedulerName"] = "default-scheduler"
    c = pod["spec"]["containers"][0]
    if shape in ("limits", "unset"):
        c["resources"] = {"limits": {N.gpu_memory: "4"}}
    if shape == "requests":
        c["resources"] = {"requests": {N.gpu_memory: "4"}, "limits": {"cpu": "1"}}
    if shape == "init":
        pod["spec"]["initContainers"] = [{"name": "warm", "image": "x", "resources": {"limits": {N.gpu_memory: "40"}}}]
    if shape == "unset":
        del pod["spec"]["schedulerName"]
    assert admit(Request("CREATE", "pods", USER, pod))
    pod["spec"]["schedulerName"] = "vramshare-scheduler"
    assert admit(Request("CREATE", "pods", USER, pod)) == []


def test_pods_without_our_resources_keep_any_scheduler() -> None:
    pod = b.pod("web", 0)
    pod["spec"]["schedulerName"] = "default-scheduler"
    pod["spec"]["containers"][0]["resources"] = {"limits": {"cpu": "1", "nvidia.com/gpu": "1"}}
    assert admit(Request("CREATE", "pods", USER, pod)) == []
    del pod["spec"]["containers"][0]["resources"]
    assert admit(Request("CREATE", "pods", "system:serviceaccount:kube-system:replicaset-controller", pod)) == []


def test_a_gpu_pod_naming_its_node_is_refused() -> None:
    [msg] = admit(Request("CREATE", "pods", USER, gpu_pod(node="n1")))
    assert "spec.nodeName" in msg and "bypasses the scheduler" in msg


# -- 2. the device plugin writes its own node only, and only our annotations -----------------------
def test_the_device_plugin_updates_its_own_nodes_pods() -> None:
    old = bound("n1")
    new = with_ann(old, allocation_state=contract.STATE_ALLOCATED if hasattr(contract, "STATE_ALLOCATED")
                   else "allocated", quota_mib="8192")
    assert admit(Request("UPDATE", "pods", DP, new, old, on_node("n1"))) == []


def test_the_device_plugin_of_another_node_is_refused() -> None:
    old = bound("n2")
    [msg] = admit(Request("UPDATE", "pods", DP, with_ann(old, allocation_state="allocated"), old, on_node("n1")))
    assert "of node n1 may not write pods of node \"n2\"" in msg


def test_the_device_plugin_may_not_touch_unbound_pods() -> None:
    old = gpu_pod()
    assert admit(Request("UPDATE", "pods", DP, with_ann(old, allocation_state="allocated"), old, on_node("n1")))


def test_a_device_plugin_token_without_node_claim_writes_nothing() -> None:
    old = bound("n1")
    msgs = admit(Request("UPDATE", "pods", DP, with_ann(old, allocation_state="allocated"), old, {}))
    assert any("no node claim" in m for m in msgs)


@pytest.mark.parametrize("change", ["label", "foreign-annotation", "remove-foreign", "spec", "finalizer"])
def test_the_device_plugin_changes_only_our_annotations(change: str) -> None:
    old = with_ann(bound("n1"), **{"example.com/owner": "team-a"})
    new = copy.deepcopy(old)
    if change == "label":
        new["metadata"]["labels"] = {"app": "evil"}
    elif change == "foreign-annotation":
        new["metadata"]["annotations"]["example.com/owner"] = "team-b"
    elif change == "remove-foreign":
        del new["metadata"]["annotations"]["example.com/owner"]
    elif change == "spec":
        new["spec"]["containers"][0]["image"] = "evil/miner"
    elif change == "finalizer":
        new["metadata"]["finalizers"] = ["example.com/hold"]
    [msg] = admit(Request("UPDATE", "pods", DP, new, old, on_node("n1")))
    assert "vramshare-device-plugin-node-scope" in msg and "only vramshare.io/* annotations" in msg


def test_the_device_plugin_publishes_its_own_inventory_only() -> None:
    fresh = b.gpu_node("n1", b.a100())
    old = with_ann(fresh, gpu_inventory=None)
    assert admit(Request("UPDATE", "nodes", DP, fresh, old, on_node("n1"))) == []
    assert admit(Request("UPDATE", "nodes", DP, fresh, old, on_node("n2")))
    tainted = copy.deepcopy(fresh)
    tainted["spec"] = {"taints": [{"key": "x", "effect": "NoSchedule"}]}
    old["spec"] = {}
    fresh = copy.deepcopy(fresh)
    fresh["spec"] = {}
    assert admit(Request("UPDATE", "nodes", DP, fresh, old, on_node("n1"))) == []
    assert admit(Request("UPDATE", "nodes", DP, tainted, old, on_node("n1")))


@pytest.mark.parametrize("op", ["CREATE", "DELETE"])
def test_the_device_plugin_creates_and_deletes_nothing(op: str) -> None:
    pod = bound("n1")
    obj, old = (pod, None) if op == "CREATE" else (None, pod)
    assert admit(Request(op, "pods", DP, obj, old, on_node("n1")))


# -- 3. the handshake annotations belong to the extender and the device plugins --------------------
def test_a_forged_assignment_at_creation_is_refused() -> None:
    forged = b.assigned(gpu_pod(), "", [("GPU-n1-0", 79 * 1024)], 2**62)  # assume-time far in the future
    [msg] = admit(Request("CREATE", "pods", USER, forged))
    assert "vramshare-protect-annotations" in msg and N.assignment in msg and N.assume_time in msg


@pytest.mark.parametrize("key, value", [("assignment", orjson.dumps({"c0": []}).decode()),
                                        ("assume_time", str(2**62)), ("allocation_state", "allocated"),
                                        ("assignment", None)])
def test_users_cannot_change_or_remove_handshake_annotations(key: str, value: str | None) -> None:
    old = bound("n1")
    assert admit(Request("UPDATE", "pods", USER, with_ann(old, **{key: value}), old))
    assert admit(Request("UPDATE", "pods", EXT, with_ann(old, **{key: value}), old)) == []


def test_users_write_their_own_annotations() -> None:
    pod = gpu_pod(count=2, models="NVIDIA H100 80GB HBM3", policy="binpack")
    assert admit(Request("CREATE", "pods", USER, pod)) == []
    assert admit(Request("CREATE", "pods", USER, with_ann(pod, model="org/llama@main"))) == []  # issue 23
    assert admit(Request("UPDATE", "pods", USER, with_ann(pod, policy="spread"), pod)) == []


@pytest.mark.parametrize("change", ["label", "foreign-annotation", "spec"])
def test_the_extender_changes_only_our_annotations(change: str) -> None:
    old = bound("n1")
    new = copy.deepcopy(old)
    if change == "label":
        new["metadata"]["labels"] = {"x": "y"}
    elif change == "foreign-annotation":
        new["metadata"]["annotations"]["example.com/a"] = "b"
    else:
        new["spec"]["priority"] = 10**9
    [msg] = admit(Request("UPDATE", "pods", EXT, new, old))
    assert "vramshare-extender-scope" in msg


def test_only_device_plugins_write_the_node_inventory() -> None:
    node = b.gpu_node("n1", b.a100())
    forged = b.gpu_node("n1", b.a100(), b.a100())
    assert admit(Request("UPDATE", "nodes", USER, forged, node))
    assert admit(Request("UPDATE", "nodes", EXT, forged, node))
    assert admit(Request("UPDATE", "nodes", DP, forged, node, on_node("n1"))) == []
    kubelet = with_ann(node, **{"node.alpha.kubernetes.io/ttl": "0"})
    assert admit(Request("UPDATE", "nodes", "system:node:n1", kubelet, node)) == []


KEYS = st.sampled_from([*N.user_annotations(), *N.vramshare_annotations(), f"{N.domain}/future-key", "example.com/a", "app.kubernetes.io/b"])
ANNS = st.dictionaries(KEYS, st.sampled_from(["1", "2", "x"]), max_size=6)


@settings(max_examples=150, deadline=None)
@given(old=ANNS, new=ANNS, who=st.sampled_from([USER, EXT, DP, "system:node:n1"]))
def test_annotation_writes_follow_one_rule(old: dict[str, str], new: dict[str, str], who: str) -> None:
    """Oracle: a change to a vramshare.io/* key outside the users' list is allowed to the
    extender and the device plugin only (the device plugin also only on its node, and only ours)."""
    before = bound("n1")
    before["metadata"]["annotations"] = dict(old)
    after = copy.deepcopy(before)
    after["metadata"]["annotations"] = dict(new)
    changed = {k for k in set(old) | set(new) if old.get(k) != new.get(k)}
    ours = {k for k in changed if k.startswith(f"{N.domain}/")}
    protected = ours - set(N.user_annotations())
    if who == DP:
        allowed = changed == ours
    elif who == EXT:
        allowed = changed == ours
    else:
        allowed = not protected
    got = admit(Request("UPDATE", "pods", who, after, before, on_node("n1") if who == DP else None))
    assert (got == []) == allowed, got


# -- issue 18: the managedFields entries the extender trusts are vramshare's to write --------------
def _entry(manager: str, time: str = "2026-01-01T00:00:00Z") -> dict[str, Any]:
    return {"manager": manager, "operation": "Update", "apiVersion": "v1", "time": time, "fieldsType": "FieldsV1",
            "fieldsV1": {"f:metadata": {"f:annotations": {f"f:{N.assignment}": {}}}}}


def _with_managed(obj: dict[str, Any], entries: list[dict[str, Any]]) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    out["metadata"]["managedFields"] = entries
    return out


def _forged_time(e: dict[str, Any]) -> dict[str, Any]:
    return {**e, "time": "2026-06-01T00:00:00Z"}


@pytest.mark.parametrize("entries", [
    [_forged_time(_entry("vramshare-extender")), _entry("kubectl-create")],  # rewrite our entry
    [_entry("vramshare-extender"), _entry("vramshare-device-plugin"), _entry("kubectl-create")],  # write as us
    [{}],  # reset every entry (upstream isResetManagedFields)
], ids=["rewrite", "write-as", "reset"])
def test_a_user_cannot_write_or_rewrite_our_field_managers_entries(entries: list[dict[str, Any]]) -> None:
    """On main nothing looked at managedFields, which the extender now trusts (issue 18)."""
    old = _with_managed(bound("n1"), [_entry("vramshare-extender"), _entry("kubectl-create")])
    new = _with_managed(old, [e for e in entries if e])
    msgs = admit(Request("UPDATE", "pods", USER, new, old))
    assert any("managedFields" in m for m in msgs), msgs


def test_our_writers_and_users_other_writes_keep_passing() -> None:
    old = _with_managed(bound("n1"), [_entry("vramshare-extender"), _entry("kubectl-create")])
    relabeled = _with_managed(old, [_entry("vramshare-extender"), _entry("kubectl-label")])
    relabeled["metadata"].setdefault("labels", {})["team"] = "a"
    assert admit(Request("UPDATE", "pods", USER, relabeled, old)) == []
    by_plugin = _with_managed(old, [_entry("vramshare-extender"), _entry("vramshare-device-plugin"),
                                    _entry("kubectl-create")])
    assert admit(Request("UPDATE", "pods", DP, by_plugin, old, on_node("n1"))) == []
