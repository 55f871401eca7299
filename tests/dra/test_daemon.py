"""``vramshare dra-plugin`` against the API server double: slices published before any kubelet,
health withdrawal, refusing GPUs a device plugin serves, and a pod's claim from template to CDI."""
from __future__ import annotations

import dataclasses
import pathlib
import shutil
import tempfile

import pytest
import yaml
from kubernetes import client

from deviceplugin.dra.main import DraPluginDaemon
from deviceplugin.simulated_backend import SimulatedBackend
from standins import cdi_registry
from standins.apiserver import ApiServerDouble
from standins.apiserver.resources import RESOURCECLAIMS, RESOURCESLICES
from standins.dra_kubelet import DraKubelet, PrepareError
from standins.dra_scheduler import DraScheduler
from tests.dra.conftest import NODE, dra_config
from vramshare import contract
from vramshare.inventory import NodeInventory
from vramshare.kube import api_client_for

DRA_DEPLOY = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "daemonset" / "dra"
DRIVER = "gpu.vramshare.io"


def slices_of(api: ApiServerDouble) -> list[dict]:
    return [i for i in api.objects(RESOURCESLICES) if i["spec"]["nodeName"] == NODE]


def devices_of(api: ApiServerDouble) -> dict[str, dict]:
    return {d["name"]: d for s in slices_of(api) for d in s["spec"].get("devices") or ()}


def generation(api: ApiServerDouble) -> int:
    return max(s["spec"]["pool"]["generation"] for s in slices_of(api))


@pytest.fixture
def env(tmp_path):
    sockets = tempfile.mkdtemp(prefix="dra", dir="/tmp")
    with ApiServerDouble() as api, api_client_for(api.url) as http:
        api.create_node({"metadata": {"name": NODE}})
        yield api, http, tmp_path, sockets
    shutil.rmtree(sockets, ignore_errors=True)


def start(env, backend=None, **dra) -> DraPluginDaemon:
    api, http, tmp, sockets = env
    config = dra_config(tmp, **dra)
    daemon = DraPluginDaemon(backend or SimulatedBackend.demo(), config, http, NODE,
                             plugin_dir=f"{sockets}/plugins/{DRIVER}", registry_dir=f"{sockets}/registry",
                             retry_seconds=0.05, resync_seconds=0.2)
    return daemon  # started by ``with``


def test_slices_are_published_before_any_kubelet_registers(env):
    api = env[0]
    with start(env) as daemon:
        assert api.wait_for(lambda a: len(devices_of(a)) == 7, timeout=20)
        assert not daemon.plugin.registration.registered.is_set()
        [s] = slices_of(api)
        node_uid = api.get_node(NODE)["metadata"]["uid"]
        assert s["metadata"]["ownerReferences"][0]["uid"] == node_uid
        assert s["spec"]["driver"] == DRIVER and s["spec"]["pool"]["name"] == NODE
        assert api.count("PATCH", r"/resourceslices/") >= 1


def test_publishing_retries_until_the_api_server_answers(env):
    api = env[0]
    api.fail_next("GET", r"/resourceslices", code=503, times=3)
    with start(env):
        assert api.wait_for(lambda a: len(devices_of(a)) == 7, timeout=20)
    assert api.count("GET", r"/resourceslices") >= 4


@pytest.mark.parametrize("taints", [False, True])
def test_health_withdraws_and_restores_devices(env, taints):
    api = env[0]
    backend = SimulatedBackend.demo()
    gpu0 = backend.discover()[0].uuid
    with start(env, backend, device_taints=taints):
        assert api.wait_for(lambda a: len(devices_of(a)) == 7, timeout=20)
        first = generation(api)
        backend.inject_xid(gpu0, 79)
        if taints:
            assert api.wait_for(lambda a: "taints" in devices_of(a).get("gpu-0", {}), timeout=20)
        else:
            assert api.wait_for(lambda a: "gpu-0" not in devices_of(a), timeout=20)
        assert generation(api) == first + 1
        backend.recover(gpu0)
        assert api.wait_for(lambda a: "taints" not in devices_of(a).get("gpu-0", {"taints": 1}), timeout=20)
        assert generation(api) == first + 2


def test_a_restart_continues_the_pool_generation(env):
    api = env[0]
    with start(env):
        assert api.wait_for(lambda a: len(devices_of(a)) == 7, timeout=20)
    g = generation(api)
    with start(env, gpus=("0",)):  # fewer devices after the restart: one more generation, not 1
        assert api.wait_for(lambda a: set(devices_of(a)) == {"gpu-0"}, timeout=20)
        assert generation(api) == g + 1


def test_gpus_a_device_plugin_advertises_are_refused(env):
    """A device plugin on this node (with a config that still gives it GPU 0) publishes its inventory
    annotation; the DRA plugin must neither publish GPU 0 nor prepare claims on it."""
    api, http, tmp, _ = env
    discovered = SimulatedBackend.demo().discover()
    from deviceplugin import devices
    dp_config = dataclasses.replace(dra_config(tmp), dra=dataclasses.replace(dra_config(tmp).dra, gpus=()))
    dp_inventory = devices.build_inventory(discovered[:1], dp_config)  # the device plugin holds GPU 0
    api.update(*_node_ref(), lambda n: n["metadata"].setdefault("annotations", {}).update(
        {contract.Names().inventory: dp_inventory.to_json()}))
    with start(env) as daemon:
        assert api.wait_for(lambda a: len(devices_of(a)) == 6, timeout=20)
        assert "gpu-0" not in devices_of(api) and daemon.refused == {discovered[0].uuid}
        assert "gpu-0" not in daemon.devices()
    assert NodeInventory.from_json(api.get_node(NODE)["metadata"]["annotations"][contract.Names().inventory])


def _node_ref():
    from standins.apiserver import NODES
    return NODES, None, NODE


def _apply_deploy(http) -> None:
    resource = client.ResourceV1Api(http)
    for doc in yaml.safe_load_all((DRA_DEPLOY / "deviceclasses.yaml").read_text()):
        resource.create_device_class(doc)
    for doc in yaml.safe_load_all((DRA_DEPLOY / "examples" / "claim-templates.yaml").read_text()):
        resource.create_namespaced_resource_claim_template("default", doc)


def _pod(api: ApiServerDouble, name: str, template: str) -> dict:
    return api.create_pod({"metadata": {"name": name, "namespace": "default"}, "spec": {
        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
        "containers": [{"name": "vllm", "image": "vllm", "resources": {"claims": [{"name": "gpu"}]}}]}})


def test_a_pod_claim_goes_from_template_to_container_environment(env):
    api, http, tmp, sockets = env
    _apply_deploy(http)
    with start(env) as daemon:
        assert api.wait_for(lambda a: len(devices_of(a)) == 7, timeout=20)
        scheduler = DraScheduler(http, [NODE], seed=1)
        kubelet = DraKubelet(http, NODE, f"{sockets}/registry")
        assert kubelet.sync_plugins() == [DRIVER] and daemon.plugin.registration.registered.wait(5)
        pods = []
        for i, template in enumerate(["vllm-22gi", "vllm-tp2-48gi", "mig-1g-10gb"]):
            pod = scheduler.create_claims(_pod(api, f"p{i}", template))
            placement = scheduler.schedule(pod)
            assert placement is not None and placement.node == NODE
            pods.append(api.get_pod("default", f"p{i}"))
        def container_env(pod: dict) -> dict[str, str]:
            names = kubelet.prepare_pod(pod)["vllm"]  # first: the runtime reads the specs after Prepare wrote them
            registry = cdi_registry.Registry([str(tmp / "cdi")])
            assert registry.errors == {}
            return registry.inject(names).env

        env22 = container_env(pods[0])
        assert env22[contract.ENV_MEMORY_LIMIT_MIB] == str(22 * 1024)
        tp2 = container_env(pods[1])
        assert len(set(tp2[contract.ENV_GPU_UUIDS].split(","))) == 2 and tp2[contract.ENV_MEMORY_LIMIT_MIB] == "49152"
        mig = container_env(pods[2])
        migs = {m.uuid for m in SimulatedBackend.demo().discover()[3].mig}
        assert mig[contract.ENV_GPU_UUIDS] in migs and mig[contract.ENV_VISIBLE_DEVICES] in migs
        assert len(daemon.preparer.prepared()) == 3
        # a pod whose claim does not reserve it is refused by the kubelet, as upstream
        stranger = dict(pods[0], metadata={**pods[0]["metadata"], "uid": "someone-else"})
        with pytest.raises(PrepareError, match="reservedFor"):
            kubelet.prepare_pod(stranger)
        for pod in pods:
            assert kubelet.unprepare_pod(pod)
        assert daemon.preparer.prepared() == {} and not list((tmp / "cdi").iterdir())
        claims = api.objects(RESOURCECLAIMS)
        assert len(claims) == 3 and all(c["status"]["allocation"] for c in claims)


def test_evict_without_the_eviction_right_is_refused_at_start_and_on_reload(env):
    """Issue 17 item 15: the DRA plugin's quota loop evicts only with deploy/components/over-limit-evict."""
    from deviceplugin.quota import rights
    from vramshare.config import EnforcementConfig, OverLimitAction
    api, http, tmp, sockets = env
    api.access.deny("create", "pods", "eviction")
    base = dra_config(tmp)
    evict = dataclasses.replace(base, enforcement=EnforcementConfig(over_limit_action=OverLimitAction.EVICT))
    with pytest.raises(rights.RightRefused, match="over-limit-evict"):
        DraPluginDaemon(SimulatedBackend.demo(), evict, http, NODE, plugin_dir=f"{sockets}/plugins/{DRIVER}",
                        registry_dir=f"{sockets}/registry")
    daemon = start(env)
    try:
        with pytest.raises(rights.RightRefused):
            daemon.reload(evict)
        assert daemon.state.snapshot.config.enforcement.over_limit_action is OverLimitAction.EVENT
    finally:
        daemon.close()


def test_a_reload_keeps_the_directories_prepared_claims_and_the_runtime_use(env):
    """A live reload that moves ``quotaHostDir``, ``dra.cdiRoot`` or ``dra.stateDir`` keeps the running
    ones (with a refusal logged): the quota loop scans the running quota root, the container runtime
    reads the CDI specs Prepare wrote there and the DaemonSet mounts only those host paths. Applied
    live, the next claim's spec and quota dir landed where no runtime, loop or checkpoint looks."""
    api, http, tmp, sockets = env
    _apply_deploy(http)
    with start(env) as daemon:
        assert api.wait_for(lambda a: len(devices_of(a)) == 7, timeout=20)
        running = daemon.state.snapshot.config
        moved = dataclasses.replace(running, quota_host_dir=str(tmp / "elsewhere-quota"),
                                    dra=dataclasses.replace(running.dra, cdi_root=str(tmp / "elsewhere-cdi"),
                                                            state_dir=str(tmp / "elsewhere-state")),
                                    quota=dataclasses.replace(running.quota, step_mib=256))
        daemon.reload(moved)
        now = daemon.state.snapshot.config
        assert (now.quota_host_dir, now.dra.cdi_root, now.dra.state_dir) == (
            running.quota_host_dir, running.dra.cdi_root, running.dra.state_dir)
        assert now.quota.step_mib == 256  # the rest of the reload applies
        scheduler = DraScheduler(http, [NODE], seed=1)
        kubelet = DraKubelet(http, NODE, f"{sockets}/registry")
        assert kubelet.sync_plugins() == [DRIVER] and daemon.plugin.registration.registered.wait(5)
        pod = scheduler.create_claims(_pod(api, "p0", "vllm-22gi"))
        assert scheduler.schedule(pod) is not None
        names = kubelet.prepare_pod(api.get_pod("default", "p0"))["vllm"]
        injected = cdi_registry.Registry([str(tmp / "cdi")]).inject(names)
        assert injected.env[contract.ENV_MEMORY_LIMIT_MIB] == str(22 * 1024)
        assert not (tmp / "elsewhere-cdi").exists() and not (tmp / "elsewhere-quota").exists()
        assert list((tmp / "quota").rglob("quota.json"))


def test_a_refused_reload_is_an_event_on_the_node_and_a_metric_on_the_dra_plugin_too(env):
    """The device plugin posted a ``VramshareConfigRefused`` Event and counted the refusal; the DRA plugin
    only logged it, so an admin whose DRA nodes refused a ConfigMap edit saw nothing in ``kubectl get
    events``, ``vramshare check`` or the metrics."""
    from prometheus_client import generate_latest

    from deviceplugin.config_refusal import REASON
    api, http, tmp, sockets = env
    path = tmp / "config.yaml"
    path.write_text("quota: {stepMiB: 512}\n")
    daemon = start(env)
    try:
        watcher = daemon.config_watcher(str(path), daemon.state.snapshot.config)
        path.write_text("quota: {stepMiB: lots}\n")
        assert watcher.check() is False
        [event] = api.events("default")
        assert event["reason"] == REASON and event["type"] == "Warning"
        assert event["involvedObject"]["kind"] == "Node" and event["involvedObject"]["name"] == NODE
        assert event["source"]["component"] == "vramshare-dra-plugin" and "quota.stepMiB" in event["message"]
        text = generate_latest(daemon.metrics.registry).decode()
        assert 'vramshare_dra_config_reloads_total{result="refused"} 1.0' in text
    finally:
        daemon.close()


def test_the_slices_say_which_config_text_the_dra_plugin_runs(env):
    """A DRA-only node has no inventory: its plugin says which config text it runs on its ResourceSlices
    (``vramshare check --dra`` compares it with the ConfigMap), and after an edit the new one, with the
    keys that wait for a restart; through server-side apply, the annotation follows each publish."""
    from vramshare.config import text_digest
    from vramshare.contract import config_in_force
    api, http, tmp, sockets = env
    path = tmp / "config.yaml"
    first, edited = "quota: {stepMiB: 512}\n", "quota: {stepMiB: 256}\nmemoryUnitMiB: 2048\n"
    path.write_text(first)
    daemon = start(env)
    key = daemon.state.snapshot.config.names.config_in_force

    def said() -> list:
        return [config_in_force.parse(s["metadata"].get("annotations", {}).get(key, "null")) if
                s["metadata"].get("annotations", {}).get(key) else None for s in slices_of(api)]
    watcher = daemon.config_watcher(str(path), daemon.state.snapshot.config)
    with daemon:
        assert api.wait_for(lambda a: said() and all(x is not None and x.digest == text_digest(first) for x in said()),
                            timeout=20)
        path.write_text(edited)
        assert watcher.check() is True
        assert api.wait_for(lambda a: all(x is not None and x.digest == text_digest(edited) for x in said()),
                            timeout=20)
        [pending] = {x.restart_pending for x in said()}  # the daemon started from dra_config's directories,
        assert "memoryUnitMiB" in pending and "quota.stepMiB" not in pending  # not the file's: those wait too
