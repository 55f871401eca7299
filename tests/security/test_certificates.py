"""The certificates an admin installs work end to end: deploy/tls/gen-certs.sh's Secrets give the
extender its serving certificate and client CA and each kube-scheduler (vramshare-scheduler and the
DRA path's vramshare-dra-scheduler) a client certificate the extender accepts, for the Service name in
its configuration's urlPrefix, mounted where its tlsConfig reads it; the cert-manager variant issues
the same Secrets."""
from __future__ import annotations

import base64
import pathlib
import shutil
import socket
import ssl
import subprocess
import threading
import urllib.parse

import pytest
import yaml

from extender.app import Response
from extender.http_server import ExtenderHTTPServer
from extender.tls import Reloader, TlsFiles

ROOT = pathlib.Path(__file__).resolve().parents[2]


class Ok:
    def handle(self, method: str, path: str, body: bytes) -> Response:
        return Response(200, b"{}")


def _secrets(tmp: pathlib.Path) -> dict[str, dict[str, pathlib.Path]]:
    out = subprocess.run([str(ROOT / "deploy/tls/gen-certs.sh"), "30"], check=True, capture_output=True,
                         timeout=60).stdout
    files: dict[str, dict[str, pathlib.Path]] = {}
    for doc in yaml.safe_load_all(out):
        if not doc:
            continue
        assert doc["type"] == "kubernetes.io/tls" and doc["metadata"]["namespace"] == "vramshare-system"
        d = tmp / doc["metadata"]["name"]
        d.mkdir()
        files[doc["metadata"]["name"]] = {}
        for key, value in doc["data"].items():
            (d / key).write_bytes(base64.b64decode(value))
            files[doc["metadata"]["name"]][key] = d / key
    return files


WORKLOAD_FILES = ("extender.yaml", "scheduler.yaml", "dra/scheduler.yaml")


def _deployments() -> list[dict]:
    return [doc for f in WORKLOAD_FILES for doc in yaml.safe_load_all((ROOT / "deploy/daemonset" / f).read_text())
            if doc and doc["kind"] == "Deployment"]


def _mounted_secret_names() -> set[str]:
    return {v["secret"]["secretName"] for d in _deployments() for v in d["spec"]["template"]["spec"]["volumes"]
            if "secret" in v}


def _schedulers() -> list[tuple[str, dict, str]]:
    """(Deployment name, its extender entry, the Secret mounted where tlsConfig reads) per kube-scheduler."""
    out = []
    for f in ("scheduler-config.yaml", "dra/scheduler.yaml"):
        for cm in yaml.safe_load_all((ROOT / "deploy/daemonset" / f).read_text()):
            if not cm or cm["kind"] != "ConfigMap":
                continue
            [extender] = yaml.safe_load(cm["data"]["scheduler-config.yaml"])["extenders"]
            [dep] = [d for d in _deployments() if any(v.get("configMap", {}).get("name") == cm["metadata"]["name"]
                                                      for v in d["spec"]["template"]["spec"]["volumes"])]
            pod = dep["spec"]["template"]["spec"]
            [container] = pod["containers"]
            volumes = {v["name"]: v for v in pod["volumes"]}
            mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
            tls = extender["tlsConfig"]
            dirs = {str(pathlib.PurePath(tls[k]).parent) for k in ("certFile", "keyFile", "caFile")}
            assert len(dirs) == 1, f"{dep['metadata']['name']}: tlsConfig files from one Secret"
            assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"], "0440 files readable"
            out.append((dep["metadata"]["name"], extender, mounts[dirs.pop()]["secret"]["secretName"]))
    return out


SCHEDULERS = _schedulers()


def test_both_schedulers_call_the_extender_over_mutual_tls() -> None:
    assert {name for name, _, _ in SCHEDULERS} == {"vramshare-scheduler", "vramshare-dra-scheduler"}
    for name, extender, secret in SCHEDULERS:
        assert extender["enableHTTPS"] is True and extender["urlPrefix"].startswith("https://"), name
        assert secret == "vramshare-scheduler-tls", name


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
@pytest.mark.parametrize("name, extender, secret", SCHEDULERS, ids=[s[0] for s in SCHEDULERS])
def test_generated_secrets_authenticate_the_scheduler_to_the_extender(tmp_path: pathlib.Path, name: str,
                                                                      extender: dict, secret: str) -> None:
    s = _secrets(tmp_path)
    assert set(s) == _mounted_secret_names() == {"vramshare-extender-tls", "vramshare-scheduler-tls"}
    ext, sched = s["vramshare-extender-tls"], s[secret]
    server = ExtenderHTTPServer(Ok(), "127.0.0.1", 0,
                                tls=Reloader(TlsFiles(str(ext["tls.crt"]), str(ext["tls.key"]), str(ext["ca.crt"]))))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02})
    thread.start()
    host = urllib.parse.urlsplit(extender["urlPrefix"]).hostname
    try:
        def post(ctx: ssl.SSLContext) -> bytes:
            with socket.create_connection(server.server_address, timeout=5) as raw:
                with ctx.wrap_socket(raw, server_hostname=host) as sock:  # verifies the Service name
                    verb = extender.get("filterVerb") or extender["prioritizeVerb"]
                    sock.sendall(b"POST /%s HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}" % verb.encode())
                    return sock.recv(4096).split(b"\r\n", 1)[0]

        client = ssl.create_default_context(cafile=str(sched["ca.crt"]))
        client.load_cert_chain(str(sched["tls.crt"]), str(sched["tls.key"]))
        assert post(client) == b"HTTP/1.1 200 OK"
        anonymous = ssl.create_default_context(cafile=str(sched["ca.crt"]))
        assert post(anonymous) == b"HTTP/1.1 403 Forbidden"
    finally:
        server.close()
        thread.join(10)
    tls = extender["tlsConfig"]
    assert extender["enableHTTPS"] is True and extender["urlPrefix"].startswith("https://")
    assert {pathlib.PurePath(tls[k]).name for k in ("certFile", "keyFile", "caFile")} == {"tls.crt", "tls.key", "ca.crt"}


def test_cert_manager_issues_the_same_secrets() -> None:
    docs = [d for d in yaml.safe_load_all((ROOT / "deploy/cert-manager/certificates.yaml").read_text()) if d]
    certs = {d["spec"]["secretName"]: d for d in docs if d["kind"] == "Certificate" and not d["spec"].get("isCA")}
    assert set(certs) == _mounted_secret_names()
    assert "server auth" in certs["vramshare-extender-tls"]["spec"]["usages"]
    assert "vramshare-extender.vramshare-system.svc" in certs["vramshare-extender-tls"]["spec"]["dnsNames"]
    assert "client auth" in certs["vramshare-scheduler-tls"]["spec"]["usages"]
    kust = yaml.safe_load((ROOT / "deploy/cert-manager/kustomization.yaml").read_text())
    assert kust["resources"] == ["../daemonset", "certificates.yaml"]
