"""The residency term for DRA pods (issue 23 item 3): on main the extender's DRA prioritize
(:mod:`extender.dra_scoring`) knew slices and claims only, so a pod whose claims use vramshare's
DeviceClasses got no bonus on a node that holds its model, and no DRA node reported one.

Here: the DRA node's ``resident-models`` annotation (what the DRA plugin writes) reaches the DRA
prioritize through the extender's node watch; the bonus is the device plugin path's term with its bound
(it reorders only nodes the policy rates within a step, never lifts a node that does not fit); a
junk annotation on the node or the pod is a hint only (last good kept, never a refusal); a node that
runs both plugins has one picture; ``vramshare inspect`` shows a DRA node's models.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import orjson
from hypothesis import given, settings, strategies as st
from kubernetes import client

from extender import accounting, inspection
from extender.main import start_for_url
from extender.placement import ask_for, rank_rows
from standins.apiserver import ApiServerDouble
from tests.extender import builders as b
from tests.extender.test_dra_scoring import claim, cluster_with, node_slices, pod
from vramshare import contract
from vramshare.config import Config, Policy
from vramshare.contract import resident_models
from vramshare.inventory import EngineState, ResidentModel
from vramshare.kube import api_client_for

NAMES = contract.Names()
LLAMA = ResidentModel("meta-llama/Llama-3.1-8B", "abc", 16 << 30)
ASLEEP = dataclasses.replace(LLAMA, bytes=100 << 30, engines=(("GPU-x", EngineState.SLEEPING),))  # full bonus


def named(claim_name: str, model: str | None) -> dict:
    out = pod(claim_name)
    if model is not None:
        out["metadata"]["annotations"] = {NAMES.model: model}
    return out


def dra_node(name: str, text: str | None) -> dict:
    """A Node with no inventory (its GPUs are in slices) and, unless None, a ``resident-models`` text."""
    ann = {} if text is None else {NAMES.resident_models: text}
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "annotations": ann}}


@contextlib.contextmanager
def live_dra_extender(slices: Sequence[dict], claims: Sequence[dict], names: Sequence[str]) -> Iterator[
        tuple[ApiServerDouble, Any, Callable[[dict], dict[str, int]]]]:
    """The live extender (fgd, DRA on) over the API server double holding ``slices`` and ``claims``, once
    its DRA watch has them: ``(api, extender, scores)``, ``scores(pod)`` = its prioritize over ``names``
    through the HTTP handler."""
    with ApiServerDouble() as api, api_client_for(api.url) as http:
        resource = client.ResourceV1Api(http)
        for s in slices:
            resource.create_resource_slice(s)
        for c in claims:
            resource.create_namespaced_resource_claim("default", c)
        with start_for_url(api.url, Config(), policy=Policy.FGD, dra=True, watch_timeout_s=2) as ext:
            assert ext.wait_ready(20)
            assert api.wait_for(lambda a: len(ext.app.dra.claims) == len(claims)
                                and len(ext.app.dra.slices) == len(slices), timeout=20)

            def scores(p: dict) -> dict[str, int]:
                body = orjson.dumps({"Pod": p, "Nodes": None, "NodeNames": list(names)})
                return {h["Host"]: h["Score"] for h in json.loads(ext.app.handle("POST", "/prioritize", body).body)}
            yield api, ext, scores


def test_a_dra_pod_naming_its_model_prefers_the_node_that_holds_it():
    """Through the live extender: slices and claims by its DRA watch, the Node's resident-models by its
    node watch, prioritize over HTTP's handler."""
    slices = [s for node in ("n1", "n2") for s in node_slices(node, 1)]
    with live_dra_extender(slices, [claim("mine", 16)], ["n1", "n2"]) as (api, ext, scores):
        plain = scores(named("mine", None))
        second = min(plain, key=plain.get)  # equal nodes: the stable tie order puts this one second
        assert plain[second] < 10
        for n in ("n1", "n2"):
            api.create_node(dra_node(n, resident_models.encode([LLAMA] if n == second else [])))
        assert api.wait_for(lambda a: second in ext.app.acct.models, timeout=20)
        got = scores(named("mine", "meta-llama/Llama-3.1-8B"))
        assert got[second] == 10 and min(got.values()) < 10, got
        assert scores(named("mine", None)) == plain, "a pod that names no model: as before"
        assert scores(named("mine", "meta-llama/Llama-3.1-8B@other")) == plain, "another revision"
        assert scores(named("mine", "../nope")) == plain, "a bad model annotation is ignored"
        assert ext.app.acct.slots == {}, "a DRA node's models book no GPU"


def _cluster(used: list[int], holders: list[bool]) -> tuple:
    """Nodes n0.. with one H100 each, ``used[i]`` GiB held by an allocated claim, the model on
    ``holders``; the pod's own 16 GiB claim."""
    objs = []
    for i, u in enumerate(used):
        objs += node_slices(f"n{i}", 1)
        if u:
            objs.append(claim(f"held{i}", u, allocated=[(f"n{i}", "gpu-0", u)]))
    dra = cluster_with(*objs, claim("mine", 16))
    models = {f"n{i}": (ASLEEP,) for i, h in enumerate(holders) if h}
    return dra, models


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0, 8, 16, 30, 40, 60, 70, 79]), st.booleans()), min_size=2, max_size=6))
def test_the_bonus_never_flips_a_fit_order(nodes):
    """The shape of tests/coldstart/test_residency_extender.py's bound test, over random DRA clusters: a
    node the policy rates a whole step worse never wins by the bonus, one that does not fit scores 0,
    and among the best-rated nodes one that holds the model wins."""
    used, holders = [u for u, _ in nodes], [h for _, h in nodes]
    dra, models = _cluster(used, holders)
    names = [f"n{i}" for i in range(len(nodes))]
    ask = named("mine", "meta-llama/Llama-3.1-8B")
    plain = dict(dra.score(ask, names, "fgd"))
    got = dict(dra.score(ask, names, "fgd", models))
    fits = [n for n in names if plain[n] > 0]
    assert all(got[n] == 0 for n in names if n not in fits), "the bonus lifted a node that does not fit"
    if not fits:
        return
    st_ = dra.state()
    raw = dict(zip(fits, rank_rows(ask_for(st_, dra.demands(ask), np.array([st_.row(n) for n in fits])), "dra-fgd")))
    best = max(raw.values())
    winner = max(got, key=got.get)
    assert raw[winner] == best, f"the bonus made {winner} (raw {raw[winner]}) beat a node rated {best}"
    tops = [n for n in fits if raw[n] == best]
    if any(holders[names.index(n)] for n in tops):
        assert holders[names.index(winner)], "among the best-rated nodes the one with the model wins"
    for a in fits:
        for c in fits:
            if raw[a] >= raw[c] + 1:
                assert got[a] >= got[c], (a, c, raw, got)
    assert dict(dra.score(ask, names, "fgd", models, residency_max_steps=0)) == plain, "residencyMaxSteps 0: off"


def test_junk_is_a_hint_only_the_last_good_report_stays():
    acct = accounting.Accounting(Config())
    acct.apply_node("ADDED", dra_node("n1", resident_models.encode([LLAMA])))
    assert acct.models == {"n1": (LLAMA,)}
    for junk in ("not json", '{"version":"v9","models":[]}', '{"version":"v1"}', "[]", "x" * 100_000):
        acct.apply_node("MODIFIED", dra_node("n1", junk))
        assert acct.models == {"n1": (LLAMA,)}, junk
    acct.apply_node("ADDED", dra_node("n2", "garbage"))  # junk from the start: nothing, and no error
    assert "n2" not in acct.models
    entries = json.dumps({"version": "v1", "models": [{"name": "../x"}, 7, {"name": "ok", "bytes": -1},
                                                      {"name": "good", "revision": "r", "bytes": 5}]})
    acct.apply_node("MODIFIED", dra_node("n2", entries))  # bad entries dropped, not the report
    assert acct.models["n2"] == (ResidentModel("good", "r", 5),)
    dra, _ = _cluster([0, 0], [False, False])
    scores = dra.score(named("mine", "good@r"), ["n0", "n1", "n2"], "fgd", acct.models)
    assert dict(scores)["n0"] > 0 and dict(scores)["n1"] > 0, "junk kept no node from being scored"
    acct.apply_node("MODIFIED", dra_node("n1", None))  # the report withdrawn
    acct.apply_node("DELETED", dra_node("n2", None))
    assert acct.models == {}


def test_a_node_that_runs_both_plugins_has_one_picture():
    """``dra.gpus`` splits its GPUs: the device plugin's inventory (its GPU booked, its engine) and the
    DRA plugin's resident-models (the same cache files, its own GPU's engine) are one report."""
    mine = dataclasses.replace(LLAMA, engines=((b.uuid_of("n1", 0), EngineState.AWAKE),))
    theirs = dataclasses.replace(LLAMA, engines=(("GPU-dra-1", EngineState.SLEEPING),))
    node = b.gpu_node("n1", b.a100(), annotation=dataclasses.replace(
        b.node_inventory("n1", b.a100()), models=(mine,)).to_json())
    node["metadata"]["annotations"][NAMES.resident_models] = resident_models.encode(
        [theirs, ResidentModel("org/other", "", 1 << 30)])
    acct = accounting.Accounting(Config())
    acct.apply_node("ADDED", node)
    [merged, other] = acct.models["n1"]
    assert merged == dataclasses.replace(LLAMA, engines=mine.engines + theirs.engines)
    assert other == ResidentModel("org/other", "", 1 << 30)
    assert [s.uuid for s in acct.slots["n1"]] == [b.uuid_of("n1", 0)], "only the device plugin's GPU is booked"
    doc = inspection.render(acct)
    [n1] = doc["nodes"]
    assert n1["gpus"][0]["engines"] == [{"model": "meta-llama/Llama-3.1-8B@abc", "state": "awake"}]
    assert n1["engines"] == [{"gpu": "GPU-dra-1", "model": "meta-llama/Llama-3.1-8B@abc", "state": "sleeping"}]


def test_inspect_shows_a_dra_nodes_models():
    acct = accounting.Accounting(Config())
    acct.apply_node("ADDED", b.gpu_node("dp", b.a100()))
    acct.apply_node("ADDED", dra_node("dra", resident_models.encode([ASLEEP])))
    doc = inspection.render(acct)
    assert [n["name"] for n in doc["nodes"]] == ["dp"], "a DRA node has no GPU in the extender's books"
    [dra] = doc["modelNodes"]
    assert dra["models"] == [{"model": "meta-llama/Llama-3.1-8B@abc", "bytes": 100 << 30}]
    assert dra["engines"] == [{"gpu": "GPU-x", "model": "meta-llama/Llama-3.1-8B@abc", "state": "sleeping"}]
    assert inspection.render(acct, "dra") == dra
    table = inspection.format_table(doc)
    assert "dra: model files cached: meta-llama/Llama-3.1-8B@abc (100.0 GiB)" in table
    assert "dra: engines on GPUs the DRA plugin serves: meta-llama/Llama-3.1-8B@abc sleeping on GPU-x" in table
    assert "1 node(s), 1 GPU(s)" in table
