"""Where the weights are, on GPUs the DRA driver serves (issue 23 item 3).

On main the DRA plugin ran the warm tier but published no models: a pod whose claims use vramshare's
DeviceClasses got no residency term, whatever its node held. Through the whole DRA plugin
(:class:`DraPluginDaemon` on the simulated backend with replayed use), the API server double, the
stand-in DRA scheduler and kubelet, and on the engine's side the vLLM plugin's warm tier over its socket
(the rig of tests/dra/test_warm_tier_dra.py):

* the files in ``warmTier.modelCacheDir`` reach the node's ``resident-models`` annotation, and an engine
  asleep on a claim's GPU reaches it at once (the warm broker's ``on_engines``), then awake, then gone;
* the DRA plugin writes no ``gpu-inventory`` (the extender would book its GPUs beside the slices);
* the extender's node watch reads what the plugin wrote (``Accounting.apply_node`` on the API server's
  Node object) and keeps it as that node's models.
"""
from __future__ import annotations

import dataclasses
import os

import pytest

from deviceplugin.quota.warm import Sleep
from extender import accounting
from standins.apiserver import ApiServerDouble
from standins.dra_scheduler import DraScheduler
from tests.dra.conftest import NODE, dra_config
from tests.dra.test_quota_tick_view import _cached, _ip, running_plugin
from tests.dra.test_warm_tier_dra import Plugin, wait
from tests.test_warm_e2e import Metrics, page
from vramshare import contract
from vramshare.config import Config, WarmTierConfig
from vramshare.contract import resident_models
from vramshare.inventory import EngineState, ResidentModel

NAMES = contract.Names()
MODEL = "org/llama"
REV = "0123456789abcdef0123456789abcdef01234567"
WEIGHTS = 3000


def _cache(root) -> str:
    """A Hugging Face cache holding ``org/llama`` (a 3000-byte weight file and its config)."""
    base = root / "models--org--llama"
    snap = base / "snapshots" / REV
    snap.mkdir(parents=True)
    (base / "blobs").mkdir()
    for name, size in (("model.safetensors", WEIGHTS), ("config.json", 10)):
        blob = base / "blobs" / name
        blob.write_bytes(b"x" * size)
        os.symlink(os.path.relpath(blob, snap), snap / name)
    return str(root)


def _published(api: ApiServerDouble) -> tuple[ResidentModel, ...] | None:
    """The node's ``resident-models`` as the contract reads it; None while there is none."""
    text = ((api.get_node(NODE) or {}).get("metadata", {}).get("annotations") or {}).get(NAMES.resident_models)
    return None if text is None else resident_models.parse(text)


@pytest.fixture
def node(tmp_path):
    """The DRA plugin with the warm tier on and a model cache, its quota loop ticking every 0.2 s."""
    config = dra_config(tmp_path)
    config = dataclasses.replace(
        config, warm_tier=WarmTierConfig(enabled=True, model_cache_dir=_cache(tmp_path / "hf")),
        quota=dataclasses.replace(config.quota, interval_seconds=0.2, idle_seconds=1.0, startup_ticks=0))
    metrics = Metrics()
    try:
        with running_plugin(config, 2000) as (api, daemon, scheduler, kubelet):
            yield api, daemon, scheduler, kubelet, metrics
    finally:
        metrics.close()


def _serving_pod(api: ApiServerDouble, scheduler: DraScheduler, metrics: Metrics) -> dict:
    """A vLLM pod naming its model, with a 22 GiB shared claim, scheduled here, idle by its metrics."""
    metrics.pages["metrics"] = page(lambda: 0, 0, 0.0)
    api.create_pod({"metadata": {"name": "chat", "namespace": "default",
                                 "annotations": {"prometheus.io/port": str(metrics.port),
                                                 NAMES.model: f"{MODEL}@{REV}"}},
                    "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "vllm-22gi"}],
                             "containers": [{"name": "vllm", "image": "vllm",
                                             "resources": {"claims": [{"name": "gpu"}]}}]}})
    placement = scheduler.schedule(scheduler.create_claims(api.get_pod("default", "chat")))
    assert placement is not None and placement.node == NODE
    _ip(api, "chat", "127.0.0.1")
    return api.get_pod("default", "chat")


def test_the_dra_plugin_publishes_cached_files_and_a_sleeping_engine(node):
    api, daemon, scheduler, kubelet, metrics = node
    files = ResidentModel(MODEL, REV, WEIGHTS + 10)
    assert wait(lambda: _published(api) == (files,)), f"no resident-models on the node: {_published(api)}"
    annotations = api.get_node(NODE)["metadata"].get("annotations") or {}
    assert NAMES.inventory not in annotations, "the DRA plugin published an inventory the extender would book"

    pod = _serving_pod(api, scheduler, metrics)
    kubelet.prepare_pod(pod)
    _cached(daemon, api, "chat")
    loop, broker = daemon._quota_loop, daemon.warm
    assert wait(lambda: len(loop.tenants_now) == 1)
    [tenant] = loop.tenants_now
    [gpu] = [g for g, _ in tenant.gpus]
    quota_dir = loop.quota_dir(tenant)
    assert wait(lambda: os.path.exists(os.path.join(quota_dir, contract.WARM_SOCKET_NAME)))
    plugin = Plugin(quota_dir)
    try:
        assert wait(lambda: tenant.key in broker.views() and broker.views()[tenant.key].state is Sleep.SLEEPING)
        # the engine's sleep reaches the node at once: the reporter's own round is 5 s, the wait shorter
        asleep = dataclasses.replace(files, engines=((gpu, EngineState.SLEEPING),))
        assert wait(lambda: _published(api) == (asleep,), timeout=4.0), _published(api)

        acct = accounting.Accounting(Config())  # the extender's node watch, on the object the plugin wrote
        acct.apply_node("ADDED", api.get_node(NODE))
        assert acct.models == {NODE: (asleep,)} and NODE not in acct.slots, "models, and no GPU booked"

        plugin.tier.before_request()  # a request wakes it: the report says awake
        awake = dataclasses.replace(files, engines=((gpu, EngineState.AWAKE),))
        assert wait(lambda: _published(api) == (awake,), timeout=4.0), _published(api)
    finally:
        plugin.close()
    api.delete_pod("default", "chat")
    kubelet.unprepare_pod(pod)
    assert wait(lambda: _published(api) == (files,), timeout=8.0), "the gone engine stayed in the report"


def test_a_report_an_earlier_run_left_is_removed_when_residency_is_off(tmp_path):
    """The warm tier and the model cache turned off: an earlier run's ``resident-models`` stayed on the
    Node, and the extender kept scoring a model the node no longer reports (round 8's caveat). The plugin
    now takes the key off at start; the other annotations stay."""
    stale = resident_models.encode((ResidentModel(MODEL, REV, WEIGHTS),))
    with running_plugin(dra_config(tmp_path), 2000, {NAMES.resident_models: stale, "keep": "me"}) as (api, *_):
        assert wait(lambda: _published(api) is None), _published(api)
        assert api.get_node(NODE)["metadata"]["annotations"]["keep"] == "me"
