"""The certificates an admin installs work end to end: deploy/tls/gen-certs.sh's Secrets give the
extender its serving certificate and client CA and kube-scheduler a client certificate the extender
accepts, for the Service name in scheduler-config.yaml's urlPrefix; the cert-manager variant issues
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


def _mounted_secret_names() -> set[str]:
    names = set()
    for f in ("extender.yaml", "scheduler.yaml"):
        for doc in yaml.safe_load_all((ROOT / "deploy/daemonset" / f).read_text()):
            if doc and doc["kind"] == "Deployment":
                names |= {v["secret"]["secretName"] for v in doc["spec"]["template"]["spec"]["volumes"] if "secret" in v}
    return names


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_generated_secrets_authenticate_the_scheduler_to_the_extender(tmp_path: pathlib.Path) -> None:
    s = _secrets(tmp_path)
    assert set(s) == _mounted_secret_names() == {"vramshare-extender-tls", "vramshare-scheduler-tls"}
    ext, sched = s["vramshare-extender-tls"], s["vramshare-scheduler-tls"]
    server = ExtenderHTTPServer(Ok(), "127.0.0.1", 0,
                                tls=Reloader(TlsFiles(str(ext["tls.crt"]), str(ext["tls.key"]), str(ext["ca.crt"]))))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02})
    thread.start()
    config = yaml.safe_load(yaml.safe_load((ROOT / "deploy/daemonset/scheduler-config.yaml").read_text())
                            ["data"]["scheduler-config.yaml"])
    [extender] = config["extenders"]
    host = urllib.parse.urlsplit(extender["urlPrefix"]).hostname
    try:
        def post(ctx: ssl.SSLContext) -> bytes:
            with socket.create_connection(server.server_address, timeout=5) as raw:
                with ctx.wrap_socket(raw, server_hostname=host) as sock:  # verifies the Service name
                    sock.sendall(b"POST /filter HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}")
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
