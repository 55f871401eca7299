"""``vramshare install`` (issue 22): the same objects as the kustomize base plus exactly what the manual
steps added (Secrets, image, scheduler tag, namespace), valid with ``kubernetes-validate --strict`` for
every supported Kubernetes minor, kube-scheduler's tag read from the API server, and the kustomize
subset it renders with doing what kustomize does."""
from __future__ import annotations

import datetime
import io
import ipaddress
import re
import pathlib
import shutil
import ssl

import kubernetes_validate
import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from standins.apiserver import ApiServerDouble
from vramshare.errors import UsageError
from vramshare_cli import certs, main as cli, install, kustomize

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SUPPORTED = [f"1.{m}" for m in range(install.MIN_KUBERNETES[1], install.DRA_KUBERNETES[1] + 1)]  # 1.30 .. 1.36
CRD_GROUPS = ("cert-manager.io/", "monitoring.coreos.com/")  # not in the upstream schemas: CRDs of add-ons
BASE_TAG = next(i["newTag"] for i in yaml.safe_load((DEPLOY / "daemonset/kustomization.yaml").read_text())["images"]
                if i["name"] == install.SCHEDULER_IMAGE)


def _tls(ns: str, days: int) -> list[dict]:
    return certs.secrets(certs.generate(ns, days), ns)


def _render(**kw) -> list[dict]:
    kw.setdefault("kubernetes_version", BASE_TAG)
    return install.render(install.Options(**kw), _tls)


def _by_key(objects: list[dict]) -> dict[tuple, dict]:
    """Objects by key, the config-hash stamp left out: install adds it to what kustomize builds (the last
    tests of this file pin it)."""
    out = {kustomize.key(o): _unstamped(o) for o in objects}
    assert len(out) == len(objects), "no object twice"
    return out


def _unstamped(obj: dict) -> dict:
    if obj.get("kind") != "Deployment":
        return obj
    import copy
    obj = copy.deepcopy(obj)
    meta = obj["spec"]["template"]["metadata"]
    meta.get("annotations", {}).pop(install.CONFIG_HASH_ANNOTATION, None)
    if meta.get("annotations") == {}:
        del meta["annotations"]
    return obj


def test_install_is_the_kustomize_base_plus_the_two_secrets():
    rendered = _by_key(_render())
    base = _by_key(kustomize.build(str(DEPLOY / "daemonset")))
    secrets = {k: o for k, o in rendered.items() if k not in base}
    assert sorted(k[3] for k in secrets) == ["vramshare-extender-tls", "vramshare-scheduler-tls"]
    assert all(o["kind"] == "Secret" and o["type"] == "kubernetes.io/tls" for o in secrets.values())
    assert {k: o for k, o in rendered.items() if k in base} == base


def test_install_with_cert_manager_is_the_cert_manager_overlay():
    assert _by_key(_render(tls="cert-manager")) == _by_key(kustomize.build(str(DEPLOY / "cert-manager")))


def test_install_keep_leaves_the_secrets_out_for_an_upgrade():
    assert _by_key(_render(tls="keep")) == _by_key(kustomize.build(str(DEPLOY / "daemonset")))


def test_install_with_dra_adds_the_dra_overlay_and_follows_the_clusters_version():
    rendered = _by_key(_render(tls="keep", dra=True, kubernetes_version="v1.36.3-gke.100"))
    expected = _by_key(kustomize.build(str(DEPLOY / "daemonset")) + kustomize.build(str(DEPLOY / "daemonset/dra")))
    assert rendered.keys() == expected.keys()
    images = {c["image"] for o in rendered.values() for c in kustomize._containers([o])}
    assert images == {"registry.k8s.io/kube-scheduler:v1.36.3", install.DEFAULT_IMAGE}


def test_the_image_flag_by_tag_and_by_digest():
    def images(objects):
        return {c["image"] for o in objects for c in kustomize._containers([o]) if "scheduler" not in c["image"]}
    assert images(_render(image="my.registry:5000/vs:1.2.3")) == {"my.registry:5000/vs:1.2.3"}
    assert images(_render(image="my.registry/vs@sha256:" + "a" * 64)) == {"my.registry/vs@sha256:" + "a" * 64}
    with pytest.raises(UsageError, match="name a tag or digest"):
        _render(image="my.registry/vs")


def test_another_namespace_moves_every_mention():
    objects = _render(namespace="gpu-share", dra=True, kubernetes_version="1.36.0", monitoring=True)
    text = yaml.safe_dump_all(objects)
    assert "vramshare-system" not in text
    assert "https://vramshare-extender.gpu-share.svc:8888" in text
    assert "system:serviceaccount:gpu-share:vramshare-extender" in text
    secret = next(o for o in objects if o["metadata"]["name"] == certs.EXTENDER_SECRET)
    import base64
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    assert "vramshare-extender.gpu-share.svc" in cert.extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)


@pytest.mark.parametrize("version, bound", [("1.30.4", False), ("1.31.0", False), ("1.32.0", True)])
def test_the_node_scope_binding_only_where_the_node_claim_exists(version, bound):
    names = {o["metadata"]["name"] for o in _render(kubernetes_version=version, tls="keep")}
    assert (install.NODE_SCOPE_BINDING in names) is bound


@pytest.mark.parametrize("argv, says", [
    (["--kubernetes-version", "1.29.9"], "needs 1.30 or newer"),
    (["--kubernetes-version", "1.35", "--dra"], "--dra needs Kubernetes 1.36"),
    (["--kubernetes-version", "1.36", "--dra-gpus", "all"], "--dra-gpus applies only with --dra"),
    (["--kubernetes-version", "one"], "expected e.g. 1.33"),
    (["--kubernetes-version", "1.33", "--component", "nope"], "--component nope: not one of"),
    # on main: a traceback from cryptography, and Secrets already expired (0) or valid for nothing it kept
    (["--kubernetes-version", "1.33", "--cert-days", "-5"], "--cert-days -5: choose 1 to 3650 days"),
    (["--kubernetes-version", "1.33", "--cert-days", "0"], "--cert-days 0: choose 1 to 3650 days"),
    (["--kubernetes-version", "1.33", "--tls", "keep", "--cert-days", "30"], "--cert-days applies only"),
])
def test_install_refuses_in_one_line(capsys, argv, says):
    assert cli.main(["install", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err


def _variants() -> list[tuple[str, str, list[dict]]]:
    out = [(v, "default", _render(kubernetes_version=v)) for v in SUPPORTED]
    out.append(("1.36", "dra+monitoring+dashboard+namespace",
                _render(kubernetes_version="1.36", dra=True, dra_gpus=("all",), monitoring=True,
                        dashboard_namespace="monitoring", namespace="gpu-share")))
    out.append(("1.36", "dra+enforcement-driver", _render(kubernetes_version="1.36", dra=True, enforcement="driver")))
    return out


VARIANTS = _variants()


@pytest.mark.parametrize("version, what, objects", VARIANTS, ids=[f"{v}-{w}" for v, w, _ in VARIANTS])
def test_every_rendered_object_is_valid_strict(version, what, objects):
    for obj in objects:
        if obj["apiVersion"].startswith(CRD_GROUPS):
            assert obj["kind"] in {"Issuer", "Certificate", "PodMonitor", "PrometheusRule"}
            continue
        kubernetes_validate.validate(obj, version, strict=True)


def test_the_printed_stream_parses_back_to_the_objects_and_the_config_still_loads():
    from vramshare import config
    objects = _render(kubernetes_version="1.36", dra=True, dra_gpus=("all",))
    out = io.StringIO()
    install.dump(objects, out, header="h")
    back = [d for d in yaml.safe_load_all(out.getvalue()) if d]
    assert back == objects
    cm = next(o for o in back if o["metadata"]["name"] == "vramshare-config")
    assert config.parse_config(cm["data"]["config.yaml"]).dra.gpus == ("all",)


def test_the_scheduler_tag_is_read_from_the_api_server(tmp_path, capsys):
    with ApiServerDouble(kubernetes_version="v1.34.1") as api:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "double",
            "clusters": [{"name": "double", "cluster": {"server": api.url}}],
            "users": [{"name": "admin", "user": {}}],
            "contexts": [{"name": "double", "context": {"cluster": "double", "user": "admin"}}]}))
        assert cli.main(["install", "--kubeconfig", str(kubeconfig), "--tls", "keep"]) == 0
    out = capsys.readouterr().out
    assert "image: registry.k8s.io/kube-scheduler:v1.34.1" in out and "Kubernetes v1.34.1" in out


def test_offline_without_a_version_says_which_flag(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert cli.main(["install"]) == 2
    assert "--kubernetes-version" in capsys.readouterr().err


# -- the certificates ---------------------------------------------------------------------------
def test_generated_certificates_chain_name_the_service_and_localhost():
    tls = certs.generate("vramshare-system", days=30)
    ca = x509.load_pem_x509_certificate(tls.ca)
    server = x509.load_pem_x509_certificate(tls.server.cert)
    client = x509.load_pem_x509_certificate(tls.client.cert)
    for leaf, usage in ((server, ExtendedKeyUsageOID.SERVER_AUTH), (client, ExtendedKeyUsageOID.CLIENT_AUTH)):
        leaf.verify_directly_issued_by(ca)
        assert list(leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [usage]
        assert leaf.not_valid_after_utc - datetime.datetime.now(datetime.timezone.utc) < datetime.timedelta(days=31)
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(certs.service_names("vramshare-system")) | {"localhost"} == set(sans.get_values_for_type(x509.DNSName))
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        (pathlib.Path(d) / "c").write_bytes(tls.server.cert)
        (pathlib.Path(d) / "k").write_bytes(tls.server.key)
        ctx.load_cert_chain(str(pathlib.Path(d) / "c"), str(pathlib.Path(d) / "k"))  # key matches the cert


# -- components flow through (issue 17 adds opt-in ones) ------------------------------------------
def test_a_component_under_deploy_is_offered_and_applied(tmp_path, capsys):
    shutil.copytree(DEPLOY, tmp_path / "deploy")
    comp = tmp_path / "deploy" / "components" / "privileged-enforcement"
    comp.mkdir(parents=True)
    (comp / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1alpha1", "kind": "Component",
        "patches": [{"patch": yaml.safe_dump({
            "apiVersion": "apps/v1", "kind": "DaemonSet",
            "metadata": {"name": "vramshare-device-plugin", "namespace": "vramshare-system"},
            "spec": {"template": {"spec": {"containers": [
                {"name": "device-plugin", "securityContext": {"privileged": True}}]}}}})}]}))
    assert cli.main(["install", "--kubernetes-version", "1.33", "--tls", "keep", "--manifests",
                     str(tmp_path / "deploy"), "--component", "privileged-enforcement"]) == 0
    objects = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    ds = next(o for o in objects if o["kind"] == "DaemonSet" and o["metadata"]["name"] == "vramshare-device-plugin")
    [c] = ds["spec"]["template"]["spec"]["containers"]
    assert c["securityContext"]["privileged"] is True and c["image"] == install.DEFAULT_IMAGE
    assert "readOnlyRootFilesystem" in c["securityContext"], "merged, not replaced"


@pytest.mark.parametrize("component", ["dra-driver-enforcement", "dra-mps-enforcement"])
def test_a_dra_component_applies_to_the_dra_objects(component):
    """On 0732846 components were applied before --dra added the DRA objects, so every DRA component failed:
    "patch target {... 'name': 'vramshare-dra-plugin'} matches no object"."""
    objects = _render(kubernetes_version="1.36", tls="keep", dra=True, components=(component,))
    expected = kustomize.build(str(DEPLOY / "daemonset")) + kustomize.build(str(DEPLOY / "daemonset/dra"))
    kustomize.apply_component(str(DEPLOY / "components" / component), expected)
    assert _by_key(objects).keys() == _by_key(expected).keys()
    [dra] = [o for o in objects if o["kind"] == "DaemonSet" and o["metadata"]["name"] == "vramshare-dra-plugin"]
    [want] = [o for o in expected if o["kind"] == "DaemonSet" and o["metadata"]["name"] == "vramshare-dra-plugin"]
    assert dra["spec"]["template"]["spec"].get("affinity") == want["spec"]["template"]["spec"].get("affinity")
    assert dra["spec"]["template"]["spec"]["volumes"] == want["spec"]["template"]["spec"]["volumes"]


def test_the_enforcement_flag_composes_the_components_of_the_plugins_installed(capsys):
    """Round 9: one flag for a node running both plugins (tests/deploy/test_host_access.py checks the grants)."""
    assert cli.main(["install", "--kubernetes-version", "1.36", "--tls", "keep", "--dra", "--enforcement", "driver",
                     "--component", "cdi-cri"]) == 0
    objects = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    sets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "DaemonSet"}
    assert sorted(sets) == ["vramshare-device-plugin", "vramshare-device-plugin-driver", "vramshare-dra-plugin",
                            "vramshare-dra-plugin-driver"]
    for name in ("vramshare-device-plugin", "vramshare-device-plugin-driver"):  # cdi-cri after driver-enforcement
        env = {e["name"]: e.get("value") for e in sets[name]["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["VRAMSHARE_DEVICE_LIST_STRATEGY"] == "cdi-cri"
    assert cli.main(["install", "--kubernetes-version", "1.36", "--tls", "keep", "--dra", "--enforcement", "mps"]) == 0
    objects = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    for o in objects:
        if o["kind"] == "DaemonSet":  # the MPS directories in both plugins, no variant
            assert any(v.get("hostPath", {}).get("path") == "/run/nvidia/mps"
                       for v in o["spec"]["template"]["spec"]["volumes"]), o["metadata"]["name"]
    with pytest.raises(UsageError, match="--enforcement hardware: one of driver, mps"):
        _render(enforcement="hardware")


# -- the kustomize subset ------------------------------------------------------------------------
def _write(d: pathlib.Path, name: str, doc) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(yaml.safe_dump_all(doc) if isinstance(doc, list) else yaml.safe_dump(doc))


DEPLOYMENT = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d", "namespace": "n"},
              "spec": {"template": {"spec": {"containers": [
                  {"name": "a", "image": "reg/x:1", "env": [{"name": "A", "value": "1"}], "args": ["--x"]},
                  {"name": "b", "image": "reg/y@sha256:00"}]}}}}


def test_kustomize_strategic_merge_json6902_images_and_components(tmp_path):
    _write(tmp_path / "base", "d.yaml", DEPLOYMENT)
    _write(tmp_path / "base", "kustomization.yaml", {"resources": ["d.yaml"]})
    _write(tmp_path / "comp", "kustomization.yaml", {"kind": "Component", "patches": [{"patch": yaml.safe_dump(
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d", "namespace": "n"},
         "spec": {"template": {"spec": {"containers": [
             {"name": "a", "env": [{"name": "B", "value": "2"}], "args": ["--y"]},
             {"name": "b", "$patch": "delete"}]}}}})}]})
    _write(tmp_path / "top", "kustomization.yaml", {
        "resources": ["../base"], "components": ["../comp"],
        "patches": [{"target": {"kind": "Deployment", "name": "d"},
                     "patch": yaml.safe_dump([{"op": "add", "path": "/spec/replicas", "value": 2}])}],
        "images": [{"name": "reg/x", "newName": "mine/x", "newTag": "2"}]})
    [d] = kustomize.build(str(tmp_path / "top"))
    [c] = d["spec"]["template"]["spec"]["containers"]
    assert c == {"name": "a", "image": "mine/x:2", "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
                 "args": ["--y"]}  # named lists merge by name, plain lists are replaced
    assert d["spec"]["replicas"] == 2


def test_kustomize_refuses_what_it_cannot_reproduce(tmp_path):
    _write(tmp_path / "a", "kustomization.yaml", {"resources": [], "namePrefix": "x-"})
    with pytest.raises(kustomize.KustomizeError, match="namePrefix not supported"):
        kustomize.build(str(tmp_path / "a"))
    _write(tmp_path / "b", "kustomization.yaml", {"configMapGenerator": [{"name": "c", "literals": ["a=b"]}]})
    with pytest.raises(kustomize.KustomizeError, match="disableNameSuffixHash"):
        kustomize.build(str(tmp_path / "b"))
    _write(tmp_path / "c", "kustomization.yaml", {"resources": ["missing.yaml"]})
    with pytest.raises(kustomize.KustomizeError, match="does not exist"):
        kustomize.build(str(tmp_path / "c"))


@pytest.mark.parametrize("overlay", sorted(p.parent.relative_to(DEPLOY).as_posix()
                                           for p in DEPLOY.rglob("kustomization.yaml")))
def test_every_kustomization_in_deploy_renders(overlay):
    doc = yaml.safe_load((DEPLOY / overlay / "kustomization.yaml").read_text())
    if doc.get("kind") == "Component":  # on the install it patches: the DRA path's components on deploy/daemonset/dra
        objects = kustomize.build(str(DEPLOY / "daemonset" / ("dra" if overlay.startswith("components/dra-") else "")))
        kustomize.apply_component(str(DEPLOY / overlay), objects)
    else:
        objects = kustomize.build(str(DEPLOY / overlay))
    assert objects


def test_readme_install_and_uninstall_are_what_install_prints(capsys):
    """README's install walk-through: the object count it shows is what ``vramshare install`` renders for
    that cluster (on main it said 32 of 34), and its uninstall line is the one the help and the rendered
    stream's header give (on main those said '| kubectl delete -f -', README the --tls keep and
    --ignore-not-found form)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    [argv] = re.findall(r"^\$ vramshare install (--image \S+) \| kubectl apply -f -$", readme, re.M)
    [count] = re.findall(r"^\.\.\.\s+\((\d+) objects\)$", readme, re.M)
    assert cli.main(["install", *argv.split(), "--kubernetes-version", "1.33.2"]) == 0
    out = capsys.readouterr().out
    assert len([d for d in yaml.safe_load_all(out) if d]) == int(count)
    assert f"# {count} objects; uninstall: {install.UNINSTALL}" in out
    [said] = re.findall(r"^\$ vramshare install \[same flags\] (.*)$", readme, re.M)
    assert install.UNINSTALL == f"the same flags with {said}"
    assert install.UNINSTALL in " ".join(cli.build_parser()._subparsers._group_actions[0].choices["install"]
                                         .format_help().split())


def test_the_admins_config_goes_into_the_configmap_checked_first(tmp_path, capsys):
    """An upgrade re-applies every object, the ConfigMap vramshare-config included: on main the only
    config it could carry was the shipped defaults, so re-running install put them over an admin's quota
    classes. ``--config FILE`` installs the admin's file, refused in one line where the plugins would
    refuse it."""
    example = DEPLOY / "examples" / "quota-classes" / "production-batch.yaml"
    assert cli.main(["install", "--kubernetes-version", "1.33", "--tls", "keep", "--config", str(example),
                     "--component", "over-limit-evict"]) == 0  # its batch class evicts
    objects = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    [cm] = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "vramshare-config"]
    assert cm["data"]["config.yaml"] == example.read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: v1\nquota: {classes: [{name: x, floorMiB: -4}]}\n")
    for argv, says in ((["--config", str(bad)], "--config: quota.classes[0].floorMiB: must be >= 0"),
                       (["--config", str(tmp_path / "none.yaml")], "No such file"),
                       # README's example 1 evicts batch: without the right every node plugin refuses it
                       (["--config", str(example)], "quota.classes[batch].overLimitAction), which needs the "
                                                    "eviction right the default roles lack: add --component "
                                                    "over-limit-evict"),
                       (["--kubernetes-version", "1.36", "--dra", "--dra-gpus", "all", "--config", str(example)],
                        "set dra.gpus in your config file")):
        assert cli.main(["install", "--kubernetes-version", "1.33", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1, err


def test_reading_the_clusters_version_says_so_on_stderr_and_keeps_stdout_for_kubectl(tmp_path, capsys):
    """A silent API server keeps install for its timeout: install says what it waits for (and how to
    skip it), on stderr, so `vramshare install | kubectl apply -f -` still reads only manifests."""
    from standins.apiserver import ApiServerDouble
    from tests.fixtures.kubeconfig import write_kubeconfig
    with ApiServerDouble(kubernetes_version="v1.33.2") as api:
        url = api.url
        kubeconfig = str(write_kubeconfig(tmp_path / "kubeconfig", url))
        assert cli.main(["install", "--kubeconfig", kubeconfig]) == 0
    got = capsys.readouterr()
    assert f"reading the cluster's version from {url}" in got.err and "--kubernetes-version skips" in got.err
    docs = [d for d in yaml.safe_load_all(got.out) if d]
    assert docs and all("kind" in d for d in docs)


def test_a_silent_api_server_is_asked_once_then_named_in_one_line(tmp_path):
    """An API server that accepts and never answers: the client's default (urllib3's three retries) kept
    install silent for 4 x its timeout, ~40 s. Asked once, as kubectl does, then a one-line error that
    names the skip."""
    import socket
    from tests.fixtures.kubeconfig import write_kubeconfig
    from vramshare.errors import UsageError
    from vramshare_cli.install import cluster_version
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    kubeconfig = str(write_kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{silent.getsockname()[1]}"))
    accepted: list[socket.socket] = []
    try:
        with pytest.raises(UsageError, match="--kubernetes-version 1.33 to render offline") as err:
            cluster_version(kubeconfig, timeout_s=0.3)
        assert "timed out" in str(err.value).lower()
        silent.settimeout(0.5)
        try:
            while True:
                accepted.append(silent.accept()[0])
        except socket.timeout:
            pass
        assert len(accepted) == 1, f"{len(accepted)} connections: the version read was retried"
    finally:
        for conn in accepted:
            conn.close()
        silent.close()


def _template_hashes(objects: list[dict]) -> dict[str, str | None]:
    return {o["metadata"]["name"]: (o["spec"]["template"]["metadata"].get("annotations") or {}).get(
        install.CONFIG_HASH_ANNOTATION) for o in objects if o["kind"] == "Deployment"}


def test_reinstalling_with_what_a_deployment_reads_at_start_changed_rolls_it_and_nothing_else(tmp_path):
    """The extender reads its config keys at start and kube-scheduler its profile and client certificate:
    re-applying install with a new extender.policy or new certificates left them running the old ones
    until someone restarted them. The pod template now carries a hash of what each reads at start, so
    `kubectl apply` rolls exactly those (one replica at a time); a node-only key rolls neither (the node
    plugins reload it live), nor do the extender's own certificates (it re-reads them every 10 s)."""
    shipped = (DEPLOY / "daemonset" / "configmap.yaml")
    text = yaml.safe_load(shipped.read_text())["data"]["config.yaml"]
    assert "idleSeconds" in text and "policy: fgd" in text

    def hashes(config_text: str | None = None, tls: str = "keep", **kw) -> dict[str, str | None]:
        return _template_hashes(install.render(install.Options(kubernetes_version="1.36", tls=tls,
                                                               config_text=config_text, **kw),
                                               _tls if tls == "generate" else None))
    base = hashes(dra=True)
    assert set(base) == {"vramshare-extender", "vramshare-scheduler", "vramshare-dra-scheduler"}
    assert all(base.values()) and base == hashes(dra=True)  # deterministic: an unchanged re-apply rolls nothing
    assert hashes(text, dra=True) == base  # the shipped text itself
    node_only = hashes(text.replace("idleSeconds: 300", "idleSeconds: 120"), dra=True)
    assert node_only == base
    policy = hashes(text.replace("policy: fgd", "policy: binpack"), dra=True)
    assert policy["vramshare-extender"] != base["vramshare-extender"]
    assert {k: v for k, v in policy.items() if k != "vramshare-extender"} == \
        {k: v for k, v in base.items() if k != "vramshare-extender"}
    one, two = hashes(tls="generate", dra=True), hashes(tls="generate", dra=True)  # new certificates each time
    assert one["vramshare-scheduler"] != two["vramshare-scheduler"]
    assert one["vramshare-dra-scheduler"] != two["vramshare-dra-scheduler"]
    assert one["vramshare-extender"] == two["vramshare-extender"] == base["vramshare-extender"]


def test_every_rendered_workloads_pods_pass_the_shipped_admission_policies():
    """The pods the controllers create from each rendered Deployment and DaemonSet (their templates, as
    the ReplicaSet and DaemonSet controllers submit them) are admitted by the admission policies the same
    render installs: a pod-template annotation under vramshare.io/ would be refused at every rollout."""
    from tests.security.admission import Request, admit
    objects = install.render(install.Options(kubernetes_version="1.36", tls="keep", dra=True, monitoring=True))
    workloads = [o for o in objects if o["kind"] in ("Deployment", "DaemonSet")]
    assert len(workloads) >= 5
    for w in workloads:
        controller = {"Deployment": "replicaset-controller", "DaemonSet": "daemon-set-controller"}[w["kind"]]
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {**w["spec"]["template"]["metadata"], "namespace": w["metadata"]["namespace"],
                            "name": f"{w['metadata']['name']}-x"},
               "spec": w["spec"]["template"]["spec"]}
        denied = admit(Request("CREATE", "pods", f"system:serviceaccount:kube-system:{controller}", pod))
        assert denied == [], (w["metadata"]["name"], denied)
