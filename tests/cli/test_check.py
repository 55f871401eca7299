"""``vramshare check`` against the API double (issue 22): a healthy install passes with exit 0, and each
broken cluster gets its ✗ line with the fix and exit 1."""
from __future__ import annotations

import base64
import contextlib
import dataclasses
import datetime
from typing import Iterator

import pytest

from extender import main as extender_main
from standins.apiserver import ApiServerDouble
from standins.apiserver.resources import BY_KIND
from tests.extender import builders as b
from tests.fixtures.kubeconfig import write_kubeconfig
from vramshare_cli import certs, main as cli, install

NS = install.NAMESPACE


def _installed(api: ApiServerDouble, ext: extender_main.RunningExtender, version: str, dra: bool = False,
               tls=None) -> None:
    """What `vramshare install | kubectl apply -f -` leaves, with the controllers' statuses."""
    objects = install.render(install.Options(kubernetes_version=version, dra=dra),
                             tls or (lambda ns, days: certs.secrets(certs.generate(ns, days), ns)))
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) not in BY_KIND:
            continue  # RBAC, NetworkPolicies...: the double does not serve them; check does not read them
        if obj["kind"] == "DaemonSet":
            obj["status"] = {"desiredNumberScheduled": 1, "numberReady": 1}
        if obj["kind"] == "Deployment":
            obj["status"] = {"readyReplicas": obj["spec"].get("replicas", 1)}
        api.create(obj)
    side = int(ext.metrics_server.url.rsplit(":", 1)[1])
    api.create({"apiVersion": "v1", "kind": "Endpoints", "metadata": {"name": "vramshare-extender", "namespace": NS},
                "subsets": [{"addresses": [{"ip": "127.0.0.1"}], "ports": [{"name": "metrics", "port": side}]}]})
    api.create({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": "vramshare-extender", "namespace": NS},
                "spec": {"holderIdentity": "vramshare-extender-7d9-abc", "leaseDurationSeconds": 15}})
    node = b.gpu_node("gpu-a", b.a100())
    node["metadata"]["labels"] = {"nvidia.com/gpu.present": "true"}
    api.create_node(node)


@pytest.fixture
def cluster(tmp_path):
    with ApiServerDouble(kubernetes_version="v1.33.2") as api:
        with extender_main.start_for_url(api.url, metrics_at=("127.0.0.1", 0)) as ext:
            assert ext.wait_ready(10)
            yield api, ext, str(write_kubeconfig(tmp_path / "kubeconfig", api.url))


def _check(capsys, kubeconfig: str, *flags: str) -> tuple[int, list[str]]:
    rc = cli.main(["check", "--kubeconfig", kubeconfig, *flags])
    lines = capsys.readouterr().out.strip().splitlines()
    assert all(line[0] in "✓✗!" for line in lines[:-1]), lines
    return rc, lines


def test_a_healthy_install_passes(cluster, capsys):
    api, ext, kubeconfig = cluster
    _installed(api, ext, "v1.33.2")
    rc, lines = _check(capsys, kubeconfig)
    assert rc == 0, "\n".join(lines)
    text = "\n".join(lines)
    for want in ("✓ API server reachable: Kubernetes v1.33.2", "✓ node gpu-a: device plugin registered",
                 "enforcement ?", "✓ extender ready and reachable", "✓ serving certificate (vramshare-extender-tls) "
                 "valid for 364 more days", "✓ scheduler profile vramshare-scheduler", "admission policies installed and bound",
                 "✓ Deployment vramshare-extender: 2 of 2 ready",
                 "✓ extender leader: vramshare-extender-7d9-abc (Lease vramshare-extender)"):
        assert want in text, text
    assert lines[-1].endswith("0 failed, ready")


def test_pre_install_on_a_fresh_cluster(cluster, capsys):
    _api, _ext, kubeconfig = cluster
    rc, lines = _check(capsys, kubeconfig, "--pre")
    assert rc == 0 and len(lines) == 4, lines


def test_unreachable_api_server(tmp_path, capsys):
    kubeconfig = str(write_kubeconfig(tmp_path / "k", "http://127.0.0.1:1"))
    rc, lines = _check(capsys, kubeconfig, "--pre")
    assert rc == 1 and lines[0].startswith("✗ API server not reachable") and "fix: check the kubeconfig" in lines[0]


def _expired(ns: str, days: int) -> list[dict]:
    tls = certs.generate(ns, days=1, now=datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=40))
    return certs.secrets(tls, ns)


BROKEN = {
    "old version": ("v1.29.4", {}, ["✗ ValidatingAdmissionPolicy v1 not available (Kubernetes v1.29.4) -- fix: upgrade"]),
    "no node claim": ("v1.31.0", {}, ["! no node-name claim before 1.32"]),
    "dra too old": ("v1.35.0", {"flags": ["--dra"]}, ["✗ DRA with consumable capacity needs Kubernetes 1.36+"]),
    "node without plugin": ("v1.33.2", {"node": "bare"}, ["✗ node gpu-b: no GPU inventory published",
                                                          "fix: kubectl -n vramshare-system get pods -o wide --field-selector spec.nodeName=gpu-b"]),
    "extender down": ("v1.33.2", {"extender_ready": 0}, ["✗ Deployment vramshare-extender: 0 of 2 ready -- fix: kubectl"]),
    "no endpoints": ("v1.33.2", {"endpoints": False}, ["✗ Service vramshare-extender has no ready endpoints"]),
    "expired certificates": ("v1.33.2", {"tls": _expired}, ["✗ serving certificate (vramshare-extender-tls): expired",
                                                            "fix: vramshare install --tls generate"]),
    "no profile": ("v1.33.2", {"profile": False}, ["✗ scheduler profile vramshare-scheduler not found"]),
    "no standby": ("v1.33.2", {"extender_ready": 1}, ["! Deployment vramshare-extender: 1 of 2 ready (working, "
                                                      "without its hot standby)"]),
    "no leader": ("v1.33.2", {"leader": False}, ["✗ extender replicas have no leader"]),
    "refused pods": ("v1.33.2", {"refused": True}, ["✗ 1 pod creation(s) refused by vramshare's admission policy",
                                                    "fix: GPU pods use schedulerName: vramshare-scheduler"]),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_each_broken_cluster_gets_its_line(tmp_path, capsys, case):
    version, how, wants = BROKEN[case]
    with ApiServerDouble(kubernetes_version=version) as api, \
            extender_main.start_for_url(api.url, metrics_at=("127.0.0.1", 0)) as ext:
        assert ext.wait_ready(10)
        kubeconfig = str(write_kubeconfig(tmp_path / "kubeconfig", api.url))
        if version >= "v1.30":
            _installed(api, ext, version, tls=how.get("tls"))
        if how.get("node") == "bare":
            api.create_node({"metadata": {"name": "gpu-b", "labels": {"nvidia.com/gpu.present": "true"}}})
        if "extender_ready" in how:
            api.update(BY_KIND[("apps/v1", "Deployment")], NS, "vramshare-extender",
                       lambda d: d["status"].update(readyReplicas=how["extender_ready"]))
        if how.get("endpoints") is False:
            api.update(BY_KIND[("v1", "Endpoints")], NS, "vramshare-extender", lambda e: e.update(subsets=[]))
        if how.get("leader") is False:
            api.update(BY_KIND[("coordination.k8s.io/v1", "Lease")], NS, "vramshare-extender",
                       lambda lease: lease["spec"].update(holderIdentity=""))
        if how.get("profile") is False:
            api.update(BY_KIND[("v1", "ConfigMap")], NS, "vramshare-scheduler-config",
                       lambda c: c.update(data={}))
        if how.get("refused"):
            api.create({"apiVersion": "v1", "kind": "Event", "metadata": {"name": "rs.1", "namespace": "team"},
                        "reason": "FailedCreate", "type": "Warning",
                        "involvedObject": {"kind": "ReplicaSet", "namespace": "team", "name": "llm-7d9"},
                        "message": "Error creating: pods \"llm-7d9-x\" is forbidden: ValidatingAdmissionPolicy "
                                   "'vramshare-gpu-pods-use-vramshare-scheduler' with binding ... denied request"})
        rc, lines = _check(capsys, kubeconfig, *how.get("flags", []), *(["--pre"] if version < "v1.30" else []))
    text = "\n".join(lines)
    for want in wants:
        assert want in text, text
    assert rc == (0 if all(w.startswith("!") for w in wants if w[0] in "✓✗!") else 1), text


def test_a_secret_the_user_may_not_read_is_said_so(cluster, capsys):
    api, ext, kubeconfig = cluster
    _installed(api, ext, "v1.33.2")
    api.fail_next("GET", r"/secrets/vramshare-extender-tls$", code=403)
    rc, lines = _check(capsys, kubeconfig)
    text = "\n".join(lines)
    assert "! Secret vramshare-system/vramshare-extender-tls not checked: your user may not read it" in text
    assert rc == 0, text


# -- round 9 (draview): the DRA nodes' enforcement mode, read from their ResourceSlices ------------------
@contextlib.contextmanager
def _dra_cluster(tmp_path) -> Iterator[tuple[ApiServerDouble, str]]:
    """A 1.36 cluster where ``vramshare install --dra`` was applied, its extender running: (api, kubeconfig)."""
    with ApiServerDouble(kubernetes_version="v1.36.1") as api, \
            extender_main.start_for_url(api.url, metrics_at=("127.0.0.1", 0)) as ext:
        assert ext.wait_ready(10)
        kubeconfig = str(write_kubeconfig(tmp_path / "kubeconfig", api.url))
        _installed(api, ext, "v1.36.1", dra=True)
        yield api, kubeconfig


def _dra_node(api: ApiServerDouble, node: str, mode, inventory: str | None = None, runs: str | None = None,
              foreign: dict[int, int] | None = None, taints: bool = False) -> None:
    """A GPU node served by the DRA plugin only (no inventory, or ``inventory``), its pool published with
    ``mode`` pinned (``None``: an older plugin, whose slices carry no mode), saying it runs the config text
    ``runs`` (None: says nothing), with ``foreign`` MiB (per GPU index) held outside its claims."""
    from deviceplugin import devices, enforcement
    from deviceplugin.dra import slices
    from deviceplugin.simulated_backend import SimulatedBackend
    from vramshare.config import Config, DraConfig
    config = Config(dra=DraConfig(gpus=("all",)))
    if mode is not None:
        config = enforcement.pin(config, enforcement.Chosen(mode, "test"))
    inv = devices.build_inventory(SimulatedBackend.demo().discover(), config, dra=True)
    if foreign:
        import dataclasses
        inv = dataclasses.replace(inv, gpus=tuple(dataclasses.replace(g, foreign_mib=foreign.get(g.index, 0))
                                                  for g in inv.gpus))
    meta = {"name": node, "labels": {"nvidia.com/gpu.present": "true"}}
    if inventory is not None:
        meta["annotations"] = {config.names.inventory: inventory}
    api.create_node({"metadata": meta})
    from vramshare.config import text_digest
    from vramshare.contract import config_in_force
    notes = {config.names.config_in_force: config_in_force.encode(config_in_force.ConfigInForce(text_digest(runs)))
             } if runs is not None else None
    for obj in slices.resource_slices(node, None, slices.desired_devices(inv, config.names, node, taints=taints), 1,
                                      config.names, annotations=notes):
        api.create(obj)  # the double validates each slice as the API server does


def test_check_dra_prints_each_dra_node_s_mode_from_one_list_of_slices(tmp_path, capsys):
    """On 0732846 a DRA-only node showed its mode nowhere but its metrics (and its missing inventory was a ✗);
    now ``check --dra`` reads the slices (one LIST) and prints each DRA node's mode with the same why as the
    device plugin's, and "mode not published" for an older plugin (a !, with the fix)."""
    from vramshare.inventory import EnforcementMode, NodeInventory
    from vramshare_cli import checks
    with _dra_cluster(tmp_path) as (api, kubeconfig):
        _dra_node(api, "gpu-dra", EnforcementMode.DRIVER)
        # the device plugin runs there too, its inventory empty: dra.gpus gave every GPU to DRA
        _dra_node(api, "gpu-dra-coop", EnforcementMode.COOPERATIVE,
                  NodeInventory(1024, enforcement=EnforcementMode.COOPERATIVE).to_json())
        _dra_node(api, "gpu-dra-old", None)
        before = api.count("GET", "resourceslices")
        rc, lines = _check(capsys, kubeconfig, "--dra")
        assert api.count("GET", "resourceslices") - before == 1
    text = "\n".join(lines)
    assert (f"✓ node gpu-dra: DRA plugin publishes 7 device(s), 3 shared, enforcement driver: "
            f"{checks.ENFORCEMENT_WHY['driver']}") in text, text
    assert f"enforcement cooperative: {checks.ENFORCEMENT_WHY['cooperative']}" in text, text
    assert ("! node gpu-dra-old: DRA plugin publishes 7 device(s), 3 shared, enforcement ?: mode not published "
            "(an older DRA plugin) -- fix: ") in text, text
    assert "✗ node gpu-dra" not in text, text  # a DRA-only node's missing or empty inventory: not a failure
    assert rc == 0, text


def test_check_names_the_nodes_whose_gpu_memory_is_held_outside_vramshare_pods(tmp_path, capsys):
    """Day two: memory no vramshare pod holds (a container stuck in the driver past its pod, a host
    process, an MPS server) is booked as used, so fewer pods fit; ``check`` names the node and GPU from
    what the nodes publish (the inventory's foreignMiB, a DRA device's foreignMiB attribute or its taint),
    with how to find the process. A finding (!), not a failure."""
    from vramshare.contract import inventory as contract_inventory
    from vramshare.inventory import EnforcementMode
    with _dra_cluster(tmp_path) as (api, kubeconfig):
        rc, lines = _check(capsys, kubeconfig, "--dra")
        assert "✓ no GPU memory held outside vramshare pods" in lines, lines
        _dra_node(api, "gpu-dra", EnforcementMode.DRIVER, foreign={0: 3072, 2: 143360}, taints=True)
        text = api.get_node("gpu-a")["metadata"]["annotations"][b.NAMES.inventory]
        inv = contract_inventory.parse(text)
        held = dataclasses.replace(inv, gpus=(dataclasses.replace(inv.gpus[0], foreign_mib=2048),) + inv.gpus[1:])
        api.update(BY_KIND[("v1", "Node")], None, "gpu-a", lambda n: n["metadata"]["annotations"].update(
            {b.NAMES.inventory: contract_inventory.encode(held)}))
        rc, lines = _check(capsys, kubeconfig, "--dra")
    text = "\n".join(lines)
    assert ("! node gpu-a: GPU memory held by no vramshare pod, booked as used so fewer pods fit (GPU 0 2048 MiB) "
            "-- fix: on gpu-a, nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv") in text, text
    assert "! node gpu-dra: GPU memory held by no vramshare pod, booked as used so fewer pods fit (gpu-0 3072 MiB, " \
           "gpu-2 all of it)" in text, text
    assert "raise reservedMiBPerGPU in ConfigMap vramshare-config" in text
    [kubelet_node] = [x for x in lines if x.startswith("! node gpu-a:")]
    [dra_node] = [x for x in lines if x.startswith("! node gpu-dra:")]
    assert "force-deleted pods" in dra_node and "force-deleted pods" not in kubelet_node  # only claims linger so
    assert rc == 0, text


def test_check_dra_without_any_slice_says_so(capsys, tmp_path):
    with _dra_cluster(tmp_path) as (api, kubeconfig):
        rc, lines = _check(capsys, kubeconfig, "--dra")
    text = "\n".join(lines)
    assert "✗ no node publishes ResourceSlices of gpu.vramshare.io" in text, text
    assert rc == 1


# -- the config: as the daemons read it, the nodes that refused it, and a file before it is applied ------
def _set_config(api: ApiServerDouble, text: str) -> None:
    api.update(BY_KIND[("v1", "ConfigMap")], NS, "vramshare-config", lambda c: c.update(data={"config.yaml": text}))


def _refused_by(api: ApiServerDouble, node: str, when: str, message: str) -> None:
    """The Event a node plugin posts (deviceplugin.config_refusal), as the API server stores it."""
    api.create({"apiVersion": "v1", "kind": "Event", "metadata": {"name": f"{node}.{when[-3:-1]}", "namespace": "default"},
                "type": "Warning", "reason": "VramshareConfigRefused", "message": message,
                "involvedObject": {"kind": "Node", "name": node, "uid": node, "apiVersion": "v1"},
                "source": {"component": "vramshare-device-plugin", "host": node},
                "firstTimestamp": when, "lastTimestamp": when, "count": 1})


def test_the_configmap_is_judged_by_the_daemons_parser(cluster, capsys):
    """A ConfigMap edit the node plugins refuse used to pass check: they kept their last good config, and
    the next plugin or extender restart exited at start."""
    api, ext, kubeconfig = cluster
    _installed(api, ext, "v1.33.2")
    rc, lines = _check(capsys, kubeconfig)
    assert rc == 0 and "✓ ConfigMap vramshare-config: a valid config (schema v1)" in lines, lines
    _set_config(api, "version: v1\nquota: {stepMiB: lots}\n")
    rc, lines = _check(capsys, kubeconfig)
    text = "\n".join(lines)
    assert rc == 1 and "✗ ConfigMap vramshare-config is refused by the daemons' parser: quota.stepMiB: expected int" \
        in text and "a plugin or extender that restarts exits at start" in text, text


def test_nodes_that_refused_the_configmap_as_it_is_now_are_named(cluster, capsys):
    """A node whose plugin refused the current ConfigMap (an older image that does not know a key) is a
    ✗ naming it; a refusal from before the ConfigMap's last change is history, not a line."""
    api, ext, kubeconfig = cluster
    _installed(api, ext, "v1.33.2")
    _refused_by(api, "gpu-old", "2020-01-01T00:00:00Z", "config refused: quota.stepMiB: expected int")
    rc, lines = _check(capsys, kubeconfig)
    assert rc == 0 and not any("refused ConfigMap" in line for line in lines), lines
    later = (datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=5)).strftime("%Y-%m-%dT%H:%M:%SZ")
    _refused_by(api, "gpu-a", later, "config /etc/vramshare/config.yaml refused, the last good config stays in "
                                      "force: warmTier.wakeAhead: unknown key")
    rc, lines = _check(capsys, kubeconfig)
    text = "\n".join(lines)
    assert rc == 1 and "✗ 1 node(s) refused ConfigMap vramshare-config as it is now (gpu-a): " in text, text
    assert "warmTier.wakeAhead: unknown key" in text and "gpu-old" not in text


def test_a_config_file_before_it_is_applied(tmp_path, capsys):
    """Offline, like promtool check config: the daemons' verdict and the keys the file sets."""
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text("quota: {idleSeconds: 120}\nmemoryUnitMiB: 2048\n")
    bad.write_text("quota: {idleSecond: 120}\n")
    assert cli.main(["check", "--config", str(good)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"✓ {good}: a valid config (schema v1)"
    assert "✓ memoryUnitMiB: 1024 -> 2048 (set away from the default)" in lines and lines[-1] == f"{good}: valid"
    assert cli.main(["check", "--config", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "✗" in out and "quota.idleSecond: unknown key" in out and out.strip().endswith(f"{bad}: refused")
    assert cli.main(["check", "--diff"]) == 2 and "--config FILE" in capsys.readouterr().err


def test_a_config_file_against_the_cluster_says_what_applies_live_and_what_waits(cluster, capsys, tmp_path):
    api, ext, kubeconfig = cluster
    _installed(api, ext, "v1.33.2")
    _set_config(api, "version: v1\nquota: {idleSeconds: 300}\n")
    new = tmp_path / "new.yaml"
    new.write_text("version: v1\nquota: {idleSeconds: 120}\nmemoryUnitMiB: 2048\nextender: {policy: binpack}\n")
    rc = cli.main(["check", "--kubeconfig", kubeconfig, "--config", str(new), "--diff"])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 0, lines
    assert "✓ quota.idleSeconds: 300.0 -> 120.0: applies live on the node plugins" in lines
    [unit] = [line for line in lines if line.startswith("! memoryUnitMiB: 1024 -> 2048: waits for a node plugin "
                                                        "restart; waits for an extender restart")]
    assert f"kubectl -n {NS} rollout restart daemonset/vramshare-device-plugin" in unit
    assert f"kubectl -n {NS} rollout restart deployment/vramshare-extender" in unit
    assert any(line.startswith("! extender.policy: fgd -> binpack: waits for an extender restart") for line in lines)


def test_a_node_counting_in_another_unit_than_the_configmap_is_named(cluster, capsys):
    """memoryUnitMiB is read at start: a device plugin not restarted since the ConfigMap changed it
    advertises units of the old size, so one ask means two sizes across the cluster."""
    api, ext, kubeconfig = cluster
    _installed(api, ext, "v1.33.2")
    old = b.gpu_node("gpu-old", b.a100(), unit_mib=2048)
    old["metadata"]["labels"] = {"nvidia.com/gpu.present": "true"}
    api.create_node(old)
    rc, lines = _check(capsys, kubeconfig)
    text = "\n".join(lines)
    assert rc == 1 and ("✗ node gpu-old: one vramshare.io/gpu-memory is 2048 MiB there, 1024 MiB in ConfigMap "
                        "vramshare-config") in text, text
    assert "✓ node gpu-a: device plugin registered" in text


def test_an_extender_that_read_the_configmap_before_it_changed_is_named(cluster, capsys):
    """The extender reads its keys at start: after an edit of extender.policy or memoryUnitMiB it places
    pods by the old values until it restarts. check reads what it runs with (/config, through the
    service proxy) and says so, with the rollout command."""
    api, ext, kubeconfig = cluster
    _installed(api, ext, "v1.33.2")
    rc, lines = _check(capsys, kubeconfig)
    assert "✓ the extender runs with ConfigMap vramshare-config's extender keys" in lines, lines
    _set_config(api, "version: v1\nextender: {policy: binpack}\nquota: {stepMiB: 256}\n")
    rc, lines = _check(capsys, kubeconfig)
    [stale] = [line for line in lines if "the extender runs with keys read before" in line]
    assert stale.startswith("! ") and "extender.policy fgd (ConfigMap: binpack)" in stale and "quota" not in stale
    assert f"kubectl -n {NS} rollout restart deployment/vramshare-extender" in stale and rc == 0


def test_dra_on_a_cluster_without_it_is_one_line_not_five(tmp_path, capsys):
    """Below 1.36 --dra printed the version ✗ and then a ✗ for each thing the DRA path installs, all
    caused by it; the one line says what to do."""
    with ApiServerDouble(kubernetes_version="v1.35.0") as api, \
            extender_main.start_for_url(api.url, metrics_at=("127.0.0.1", 0)) as ext:
        assert ext.wait_ready(10)
        _installed(api, ext, "v1.35.0")
        rc, lines = _check(capsys, str(write_kubeconfig(tmp_path / "kubeconfig", api.url)), "--dra")
    failed = [line for line in lines if line.startswith("✗")]
    assert rc == 1 and len(failed) == 1 and "DRA with consumable capacity needs Kubernetes 1.36+" in failed[0], lines


def _node_running(api: ApiServerDouble, name: str, text: str | None, pending: tuple[str, ...] = ()) -> None:
    """A GPU node whose device plugin publishes the config text it runs (its inventory's ``config``)."""
    import dataclasses
    from vramshare import contract
    from vramshare.config import text_digest
    from vramshare.contract import inventory as contract_inventory
    from vramshare.contract.config_in_force import ConfigInForce
    node = b.gpu_node(name, b.a100())
    node["metadata"]["labels"] = {"nvidia.com/gpu.present": "true"}
    key = contract.Names().inventory
    inv = contract_inventory.parse(node["metadata"]["annotations"][key])
    config = ConfigInForce(text_digest(text), pending) if text is not None else None
    node["metadata"]["annotations"][key] = contract_inventory.encode(dataclasses.replace(inv, config=config))
    api.create_node(node)


def test_which_nodes_run_the_configmap_as_it_is_now(cluster, capsys):
    """Day two: "has my edit landed on every node?" Each device plugin publishes the digest of the config
    text it runs; check compares it with the ConfigMap's: nodes still on an earlier text are named (the
    kubelet projects an edit within about a minute; past that, their logs), and nodes that took it but
    wait for a restart to apply a key say which. A plugin that publishes no digest is not judged."""
    api, ext, kubeconfig = cluster
    _installed(api, ext, "v1.33.2")
    text = "version: v1\nquota: {idleSeconds: 120}\n"
    _set_config(api, text)
    _node_running(api, "gpu-b", text)
    _node_running(api, "gpu-c", text)
    rc, lines = _check(capsys, kubeconfig)
    assert rc == 0 and "✓ 2 node(s) run ConfigMap vramshare-config as it is now" in lines, lines
    edited = "version: v1\nquota: {idleSeconds: 60}\nmemoryUnitMiB: 2048\n"
    _set_config(api, edited)
    rc, lines = _check(capsys, kubeconfig)
    [behind] = [line for line in lines if "still run an earlier" in line]
    assert behind.startswith("! 2 of 2 node(s) still run an earlier ConfigMap vramshare-config (gpu-b, gpu-c): "
                             "it changed less than a minute ago") and "run check again in a minute" in behind
    api.delete_node("gpu-c")
    _node_running(api, "gpu-c", edited, pending=("memoryUnitMiB",))
    rc, lines = _check(capsys, kubeconfig)
    text_out = "\n".join(lines)
    assert "! 1 of 2 node(s) still run an earlier ConfigMap vramshare-config (gpu-b)" in text_out, text_out
    [waits] = [line for line in lines if "wait for a restart" in line]
    assert waits.startswith("! 1 node(s) wait for a restart to apply memoryUnitMiB (gpu-c)")
    assert f"kubectl -n {NS} rollout restart daemonset/vramshare-device-plugin" in waits
    assert not any("gpu-a" in line and "earlier" in line for line in lines)  # publishes no digest: not judged


def test_check_dra_says_which_dra_plugins_run_the_configmap_as_it_is_now(tmp_path, capsys):
    """The DRA plugin says which config text it runs on its ResourceSlices (``<domain>/config``): a
    DRA-only node has no inventory to carry it. ``check --dra`` reads it from the same one LIST."""
    from vramshare.inventory import EnforcementMode
    with _dra_cluster(tmp_path) as (api, kubeconfig):
        text = "version: v1\nquota: {idleSeconds: 120}\n"
        _set_config(api, text)
        _dra_node(api, "gpu-new", EnforcementMode.DRIVER, runs=text)
        _dra_node(api, "gpu-old", EnforcementMode.DRIVER, runs="version: v1\n")
        _dra_node(api, "gpu-quiet", EnforcementMode.DRIVER)  # an older DRA plugin: says nothing
        rc, lines = _check(capsys, kubeconfig, "--dra")
    out = "\n".join(lines)
    assert "! 1 of 2 node(s) still run an earlier ConfigMap vramshare-config (gpu-old (DRA))" in out, out
    assert "gpu-quiet" not in out.split("earlier")[1].split("\n")[0] and rc == 0


# -- round 12: kube-scheduler reads its client certificate once ---------------------------------------
def _with_status(name: str, started: datetime.datetime) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": {"app.kubernetes.io/name": "vramshare-scheduler"}},
            "spec": {"containers": [{"name": "kube-scheduler", "image": "registry.k8s.io/kube-scheduler:v1.33.2"}]},
            "status": {"phase": "Running", "containerStatuses": [{
                "name": "kube-scheduler", "ready": True, "restartCount": 0, "image": "kube-scheduler", "imageID": "",
                "state": {"running": {"startedAt": started.strftime("%Y-%m-%dT%H:%M:%SZ")}}}]}}


def test_a_scheduler_started_before_its_certificate_was_renewed_is_named(cluster, capsys):
    """cert-manager renewed the Secret 10 days ago; one replica restarted since, the other still presents
    the certificate it read at start (a ! line naming it, with the restart); once both restarted: ✓."""
    api, ext, kubeconfig = cluster
    now = datetime.datetime.now(datetime.timezone.utc)
    renewed = now - datetime.timedelta(days=10)
    _installed(api, ext, "v1.33.2", tls=lambda ns, days: certs.secrets(certs.generate(ns, days, now=renewed), ns))
    api.create(_with_status("vramshare-scheduler-6f8-old", renewed - datetime.timedelta(days=40)))
    api.create(_with_status("vramshare-scheduler-6f8-new", now - datetime.timedelta(days=2)))
    rc, lines = _check(capsys, kubeconfig)
    text = "\n".join(lines)
    assert ("! 1 vramshare-scheduler pod(s) started before their client certificate (vramshare-scheduler-tls) "
            "was issued 10 day(s) ago") in text, text
    assert "vramshare-scheduler-6f8-old still present(s) an earlier one" in text
    assert "fix: kubectl -n vramshare-system rollout restart deployment/vramshare-scheduler" in text
    assert "6f8-new" not in text and rc == 0, text
    api.delete_pod(NS, "vramshare-scheduler-6f8-old")
    rc, lines = _check(capsys, kubeconfig)
    assert "✓ vramshare-scheduler: every kube-scheduler started after its client certificate was issued" in lines
