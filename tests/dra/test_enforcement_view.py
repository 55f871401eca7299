"""The DRA node's enforcement mode where the scheduler and admins see it (round 9, branch draview).

Item 1: the DRA plugin puts its pinned mode on each shared device of its ResourceSlices (attribute
``enforcement`` in the driver's domain), valid for the real API server's schema and our port of its
validation; a claim selects on it with CEL, and the stand-in scheduler's allocator honours it, with
upstream's CEL semantics (an attribute a device lacks is a runtime error that aborts the allocation;
``has()`` guards it; an unknown domain is an empty map).
Item 2: the extender's DRA view reads the mode from the slices and ``/inspect`` / ``vramshare inspect``
print it per DRA node; a node whose plugin predates the attribute says "mode not published".
On 0732846 no slice carried a mode: the selector failed on every node and no view showed one.

Edges only: the API server double (real ``kubernetes`` client, slice validation), the stand-in DRA
scheduler, simulated GPUs with the node's facts given as a simulated node gives them.
"""
from __future__ import annotations

import contextlib
import copy
import pathlib
import shutil
import tempfile
from typing import Any, Iterator

import kubernetes_validate
import pytest
import yaml
from hypothesis import given, settings, strategies as st

from deviceplugin import devices, enforcement
from deviceplugin.backend import DiscoveredGpu
from deviceplugin.dra import slices, validation
from deviceplugin.dra.main import DraPluginDaemon
from deviceplugin.enforcement import Chosen, NodeFacts
from deviceplugin.simulated_backend import SimulatedBackend
from extender import accounting, inspection
from extender.dra_scoring import DraCluster
from standins import dra_allocator
from standins.apiserver import ApiServerDouble, RESOURCESLICES
from standins.dra_scheduler import DraScheduler
from tests.dra.conftest import NODE, dra_config
from tests.dra.test_daemon import DRIVER, _apply_deploy
from vramshare.config import Config
from vramshare.contract import slice_enforcement
from vramshare.inventory import EnforcementMode
from vramshare.kube import api_client_for

ROOT = pathlib.Path(__file__).resolve().parents[2]
TEMPLATES = {t["metadata"]["name"]: t for t in yaml.safe_load_all(
    (ROOT / "deploy/daemonset/dra/examples/claim-templates.yaml").read_text()) if t}
NO_MPS = "no MPS control pipe"
FACTS = {EnforcementMode.DRIVER: NodeFacts("615.20.01", True, None, NO_MPS),
         EnforcementMode.MPS: NodeFacts(None, True, "no NVML", None),
         EnforcementMode.COOPERATIVE: NodeFacts(None, True, "no NVML", NO_MPS)}
SELECT_DRIVER = ('has(device.attributes["gpu.vramshare.io"].enforcement) && '
                 'device.attributes["gpu.vramshare.io"].enforcement == "driver"')
UNGUARDED = 'device.attributes["gpu.vramshare.io"].enforcement == "driver"'


def _inventory(discovered, config: Config, mode: EnforcementMode | None):
    if mode is not None:
        config = enforcement.pin(config, Chosen(mode, "test"))
    return devices.build_inventory(discovered, config, dra=True)


# -- item 1: the attribute ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", list(EnforcementMode))
def test_each_shared_device_carries_the_node_s_pinned_mode_and_only_shared_ones(discovered, config, mode):
    inv = _inventory(discovered, config, mode)
    devs = slices.desired_devices(inv, config.names, NODE, taints=False)
    shared = [d for d in devs if d.get("allowMultipleAllocations")]
    others = [d for d in devs if not d.get("allowMultipleAllocations")]
    assert shared and others  # the demo node has both (an exclusive GPU, MIG instances)
    for d in shared:
        assert d["attributes"]["enforcement"] == {"string": mode.value}
    for d in others:  # a whole GPU or a MIG instance is its own fence
        assert "enforcement" not in d["attributes"]


def test_no_mode_pinned_publishes_no_attribute(inventory, config):
    assert inventory.enforcement is None
    assert not any("enforcement" in d["attributes"] for d in
                   slices.desired_devices(inventory, config.names, NODE, taints=False))


@pytest.mark.parametrize("version", ["1.36", "1.37"])
def test_the_attribute_passes_the_api_server_s_schema_and_validation(discovered, config, version):
    inv = _inventory(discovered, config, EnforcementMode.DRIVER)
    devs = slices.desired_devices(inv, config.names, NODE, taints=True)
    ok, refused = slices.publishable(devs)
    assert refused == [] and ok == devs
    for d in devs:  # the attribute+capacity cap of one device, with room to spare
        assert len(d["attributes"]) + len(d.get("capacity") or {}) <= validation.MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE
        assert validation.device_errors(d) == []
    for obj in slices.resource_slices(NODE, "0b7e2c4e-1111-2222-3333-444455556666", devs, 3, config.names):
        kubernetes_validate.validate(obj, version, strict=True)


# -- item 1: selecting on it ----------------------------------------------------------------------------
def _claim(expression: str | None = None) -> dict:
    spec = copy.deepcopy(TEMPLATES["vllm-22gi"]["spec"]["spec"])
    if expression:
        spec["devices"]["requests"][0]["exactly"]["selectors"] = [{"cel": {"expression": expression}}]
    return {"metadata": {"name": "c", "namespace": "default", "uid": "uid-c"}, "spec": spec}


def _classes() -> dict[str, dict]:
    docs = yaml.safe_load_all((ROOT / "deploy/daemonset/dra/deviceclasses.yaml").read_text())
    return {c["metadata"]["name"]: c for c in docs if c}


def _pool(discovered, config, node: str, mode: EnforcementMode | None) -> list[dict]:
    inv = _inventory(discovered, config, mode)
    return slices.resource_slices(node, None, slices.desired_devices(inv, config.names, node, taints=False), 1,
                                  config.names)


def test_the_readme_and_the_example_select_with_the_tested_expression():
    readme = (ROOT / "README.md").read_text()
    assert SELECT_DRIVER in " ".join(readme.split())
    expr = TEMPLATES["vllm-22gi-driver"]["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"][0]
    assert " ".join(expr["cel"]["expression"].split()) == SELECT_DRIVER


@pytest.mark.parametrize("mode", list(EnforcementMode))
def test_the_allocator_honours_a_selector_on_the_mode(discovered, config, mode):
    pool = _pool(discovered, config, NODE, mode)
    classes = _classes()
    for expression in (SELECT_DRIVER, UNGUARDED):
        got = dra_allocator.allocate(_claim(expression), NODE, pool, classes, [])
        assert (got is not None) is (mode is EnforcementMode.DRIVER), (mode, expression)
    other = f'device.attributes["gpu.vramshare.io"].enforcement == "{mode.value}"'
    assert dra_allocator.allocate(_claim(other), NODE, pool, classes, []) is not None


def test_on_an_older_plugin_s_node_the_guard_skips_and_the_bare_lookup_aborts(discovered, config):
    """Upstream (CELDeviceSelector): "Any reference to an unknown field will cause an evaluation error and
    allocation to abort. A robust expression should check for the existence of attributes before
    referencing them." The README's expression does; the bare one aborts on a node without the attribute."""
    old = _pool(discovered, config, NODE, None)
    classes = _classes()
    assert dra_allocator.allocate(_claim(SELECT_DRIVER), NODE, old, classes, []) is None
    with pytest.raises(dra_allocator.AllocationError, match="no such key: enforcement"):
        dra_allocator.allocate(_claim(UNGUARDED), NODE, old, classes, [])


def test_cel_has_and_unknown_domains_as_upstream():
    dev = {"name": "d", "attributes": {"mode": {"string": "shared"}, "x.example.com/k": {"int": 1}}}
    ev = lambda e: dra_allocator.cel_eval(e, dev, DRIVER)  # noqa: E731
    assert ev('has(device.attributes["gpu.vramshare.io"].mode)') is True
    assert ev('has(device.attributes["gpu.vramshare.io"].enforcement)') is False
    assert ev('!has(device.attributes["gpu.vramshare.io"].enforcement)') is True
    assert ev('has(device.attributes["x.example.com"].k) && device.attributes["x.example.com"].k == 1') is True
    # an unknown prefix is an empty map, not an error: has() is false, a field of it is an error
    assert ev('has(device.attributes["unknown.example.com"].k)') is False
    with pytest.raises(dra_allocator.AllocationError, match="no such key: k"):
        ev('device.attributes["unknown.example.com"].k == 1')
    # has() takes a field selection only (cel-go's macro: "invalid argument to has() macro"); the stand-in
    # accepted an index or a bare name, which the API server refuses when it compiles the selector
    for bad in ('has(device.attributes["gpu.vramshare.io"])', 'has(device)', 'has(device.attributes["x"]["k"])'):
        with pytest.raises(dra_allocator.AllocationError, match="invalid argument to has"):
            ev(bad)


# -- item 1 end to end, and item 2 through the extender's view ----------------------------------------------
@contextlib.contextmanager
def _published(tmp_path, modes: dict[str, EnforcementMode | None]) -> Iterator[tuple[ApiServerDouble, Any]]:
    """One DRA plugin per node in ``modes`` publishing to the API double (a node whose mode is None runs
    an older plugin: its slices are the same without the attribute)."""
    sockets = tempfile.mkdtemp(prefix="dra", dir="/tmp")
    try:
        with ApiServerDouble() as api, api_client_for(api.url) as http:
            _apply_deploy(http)
            for node, mode in modes.items():
                api.create_node({"metadata": {"name": node}})
                backend = SimulatedBackend.demo()
                backend.enforcement_facts = FACTS[mode or EnforcementMode.COOPERATIVE]
                daemon = DraPluginDaemon(backend, dra_config(tmp_path / node), http, node,
                                         plugin_dir=f"{sockets}/{node}/plugins/{DRIVER}",
                                         registry_dir=f"{sockets}/{node}/registry")
                try:
                    assert daemon.enforcement.mode is (mode or EnforcementMode.COOPERATIVE)
                    if mode is None:
                        daemon.publisher.publish([_older(d) for d in daemon.desired_pool()[0]])
                    else:
                        daemon.publish_once()
                finally:
                    daemon.close()
            yield api, http
    finally:
        shutil.rmtree(sockets, ignore_errors=True)


def _older(device: dict) -> dict:
    dev = copy.deepcopy(device)
    dev["attributes"].pop("enforcement", None)
    return dev


MODES = {"gpu-driver": EnforcementMode.DRIVER, "gpu-mps": EnforcementMode.MPS,
         "gpu-coop": EnforcementMode.COOPERATIVE, "gpu-old": None}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_claim_selecting_driver_mode_lands_on_the_driver_node(tmp_path, seed):
    """The API server double stored every slice (it validates them as the real one does), and the stand-in
    scheduler, trying the nodes in a shuffled order, places the example template's claim on the one node
    that fences in driver mode, past the older plugin's node (skipped, not an aborted allocation)."""
    with _published(tmp_path, MODES) as (api, http):
        stored = api.objects(RESOURCESLICES)
        assert {s["spec"]["nodeName"] for s in stored} == set(MODES)
        pod = api.create_pod({"metadata": {"name": "chat", "namespace": "default"}, "spec": {
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "vllm-22gi-driver"}],
            "containers": [{"name": "vllm", "image": "vllm", "resources": {"claims": [{"name": "gpu"}]}}]}})
        scheduler = DraScheduler(http, sorted(MODES), seed=seed)
        placement = scheduler.schedule(scheduler.create_claims(pod))
        assert placement is not None and placement.node == "gpu-driver"


def test_the_extender_s_dra_view_and_inspect_show_each_dra_node_s_mode(tmp_path):
    with _published(tmp_path, MODES) as (api, _http):
        stored = api.objects(RESOURCESLICES)
    names = Config().names
    dra = DraCluster(names, 1024)
    dra.replace("ResourceSlice", stored)
    modes = dra.modes()
    assert {n: m.mode for n, m in modes.items()} == MODES
    assert modes["gpu-old"].text == slice_enforcement.NOT_PUBLISHED
    acct = accounting.Accounting(Config())
    doc = inspection.render(acct, dra=dra)
    assert doc is not None
    assert {n["name"]: n["enforcement"] for n in doc["draNodes"]} == {
        "gpu-driver": "driver", "gpu-mps": "mps", "gpu-coop": "cooperative", "gpu-old": None}
    old = next(n for n in doc["draNodes"] if n["name"] == "gpu-old")
    assert old["note"] == slice_enforcement.NOT_PUBLISHED
    one = inspection.render(acct, "gpu-driver", dra=dra)  # /inspect/<node> of a DRA-only node
    assert one is not None and one["dra"]["enforcement"] == "driver"
    assert inspection.render(acct, "elsewhere", dra=dra) is None
    table = inspection.format_table(doc)
    assert ("GPU memory enforcement (DRA plugin): gpu-coop cooperative, gpu-driver driver, gpu-mps mps, "
            f"gpu-old {slice_enforcement.NOT_PUBLISHED}") in table, table
    assert "gpu-driver driver" in inspection.format_table(one)


def test_inspect_counts_the_dra_nodes_memory_not_only_the_device_plugin_s(tmp_path):
    """A DRA-only cluster's ``vramshare inspect`` said "0 node(s), 0 GPU(s): 0.0 of 0.0 GiB used": its GPUs
    are in ResourceSlices, not in the extender's books. The DRA view's memory (slices' capacity, the
    allocated claims' consumed capacity) is now in each DRA node's entry and in a summary line."""
    from tests.extender.test_dra_scoring import claim
    with _published(tmp_path, MODES) as (api, _http):
        stored = api.objects(RESOURCESLICES)
    dra = DraCluster(Config().names, 1024)
    dra.replace("ResourceSlice", stored)
    device = next(d["name"] for s in stored if s["spec"]["nodeName"] == "gpu-driver" for d in s["spec"]["devices"]
                  if d.get("allowMultipleAllocations"))
    dra.replace("ResourceClaim", [claim("held", 22, allocated=[("gpu-driver", device, 22)])])
    doc = inspection.render(accounting.Accounting(Config()), dra=dra)
    assert doc is not None
    by = {n["name"]: n for n in doc["draNodes"]}
    assert by["gpu-driver"]["usedMiB"] == 22 * 1024 and by["gpu-coop"]["usedMiB"] == 0
    total = sum(n["totalMiB"] for n in by.values())
    assert by["gpu-driver"]["totalMiB"] > 0 and by["gpu-driver"]["freeMiB"] == by["gpu-driver"]["totalMiB"] - 22 * 1024
    table = inspection.format_table(doc)
    assert (f"{len(MODES)} DRA node(s): 22.0 of {total / 1024:.1f} GiB used, {(total - 22 * 1024) / 1024:.1f} "
            "GiB free (ResourceSlices and allocated claims)") in table, table


def test_the_view_reads_the_newest_generation_and_ignores_other_drivers(discovered, config):
    inv = _inventory(discovered, config, EnforcementMode.DRIVER)
    newer = slices.resource_slices(NODE, None, slices.desired_devices(inv, config.names, NODE, taints=False), 2,
                                   config.names)
    older = _pool(discovered, config, NODE, EnforcementMode.COOPERATIVE)  # generation 1
    for s in older:
        s["metadata"]["name"] += "-old"
    foreign = copy.deepcopy(older)
    for s in foreign:
        s["spec"]["driver"], s["spec"]["nodeName"] = "gpu.nvidia.com", "other-node"
    got = slice_enforcement.node_modes(older + newer + foreign, config.names.dra_driver)
    assert list(got) == [NODE] and got[NODE].mode is EnforcementMode.DRIVER


def test_a_node_without_shared_gpus_or_with_a_newer_mode_says_so(discovered, config):
    inv = _inventory(discovered, config, EnforcementMode.DRIVER)
    devs = slices.desired_devices(inv, config.names, NODE, taints=False)
    whole = [d for d in devs if not d.get("allowMultipleAllocations")]
    got = slice_enforcement.node_modes(slices.resource_slices(NODE, None, whole, 1, config.names), DRIVER)[NODE]
    assert got.mode is None and got.text == slice_enforcement.NO_SHARED
    weird = copy.deepcopy(devs)
    for d in weird:
        if "enforcement" in d["attributes"]:
            d["attributes"]["enforcement"] = {"string": "hardware"}
    got = slice_enforcement.node_modes(slices.resource_slices(NODE, None, weird, 1, config.names), DRIVER)[NODE]
    assert got.mode is None and "hardware" in got.text



def test_the_live_extender_s_inspect_and_the_cli_print_the_dra_modes(tmp_path, capsys):
    """Through the running extender (its DRA watch lists the slices the plugins published) and
    ``vramshare inspect --extender URL [NODE]``, as an admin reads it."""
    from extender.main import start_for_url
    from vramshare_cli import main as cli
    with _published(tmp_path, {"gpu-driver": EnforcementMode.DRIVER, "gpu-old": None}) as (api, _http):
        with start_for_url(api.url, Config(), dra=True, watch_timeout_s=2) as ext:
            assert ext.wait_ready(20)
            assert api.wait_for(lambda a: len(ext.app.dra.slices) == 2, timeout=20)
            assert cli.main(["inspect", "--extender", ext.url]) == 0
            out = capsys.readouterr().out
            assert (f"GPU memory enforcement (DRA plugin): gpu-driver driver, gpu-old "
                    f"{slice_enforcement.NOT_PUBLISHED}") in out, out
            assert cli.main(["inspect", "--extender", ext.url, "gpu-driver"]) == 0
            assert "GPU memory enforcement (DRA plugin): gpu-driver driver" in capsys.readouterr().out
            missing = ext.app.handle("GET", "/inspect/nowhere", b"")
            assert missing.status == 404


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_the_mode_read_does_not_depend_on_the_order_slices_arrive_in(data):
    """A watch delivers slices in any order, old generations beside new ones: the view reads the newest
    generation's mode whatever the order (big pools split into several slices, as published)."""
    from vramshare.config import DraConfig
    cfg = Config(dra=DraConfig(gpus=("all",)))
    many = [DiscoveredGpu(index=i, uuid=f"GPU-{i:04d}", model="X", memory_mib=8192) for i in range(150)]
    pools, want = [], {}
    for k, node in enumerate(("n1", "n2", "n3")):
        modes = data.draw(st.lists(st.sampled_from(list(EnforcementMode)), min_size=1, max_size=3), label=node)
        for gen, mode in enumerate(modes, start=1):
            inv = devices.build_inventory(many[:50 * (k + 1)], enforcement.pin(cfg, Chosen(mode, "t")), dra=True)
            objs = slices.resource_slices(node, None, slices.desired_devices(inv, cfg.names, node, taints=False),
                                          gen, cfg.names)
            for s in objs:
                s["metadata"]["name"] += f"-g{gen}"
            pools += objs
        want[node] = modes[-1]
    shuffled = data.draw(st.permutations(pools), label="order")
    got = slice_enforcement.node_modes(shuffled, cfg.names.dra_driver)
    assert {n: m.mode for n, m in got.items()} == want
    assert got["n3"].devices == got["n3"].shared == 150  # 128 + 22: its pool is two slices
