"""The real extender (``extender.main.start``) with TLS from its config, against the API server double.

The issue's attack: an unauthenticated ``/bind`` bound a kube-system pod. Now a caller without the
scheduler's client certificate is refused before the verb runs, the scheduler's own calls are answered,
and Prometheus reads /metrics on the separate plain listener, which serves nothing else.
"""
from __future__ import annotations

import ssl
import urllib.error
import urllib.request
from pathlib import Path

import orjson
import pytest

from extender import main
from standins.apiserver import ApiServerDouble
from tests.extender import builders as b
from tests.fixtures.certs import make_pki
from vramshare.config import ConfigError, parse_config


def _open(url: str, ctx: ssl.SSLContext | None, data: bytes | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=5, context=ctx) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return int(exc.code), exc.read()


def test_the_extender_serves_verbs_to_the_scheduler_only(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    config = parse_config(f"version: v1\nextender:\n  tlsCertFile: {pki.server_cert}\n"
                          f"  tlsKeyFile: {pki.server_key}\n  clientCAFile: {pki.ca}\n")
    anonymous = ssl.create_default_context(cafile=str(pki.ca))
    scheduler = ssl.create_default_context(cafile=str(pki.ca))
    scheduler.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    with ApiServerDouble() as api:
        api.create_node(b.gpu_node("n1", b.l4()))
        pod = b.pod("victim", 4, namespace="kube-system")
        api.create_pod(pod)
        with main.start_for_url(api.url, config, metrics_at=("127.0.0.1", 0)) as ext:
            assert ext.url.startswith("https://") and ext.wait_ready(10)
            args = orjson.dumps({"PodName": "victim", "PodNamespace": "kube-system",
                                 "PodUID": pod["metadata"]["uid"], "Node": "n1"})
            status, body = _open(ext.url + "/bind", anonymous, args)
            assert status == 403 and b"client certificate" in body
            assert not api.get_pod("kube-system", "victim")["spec"].get("nodeName")
            filt = orjson.dumps({"Pod": pod, "NodeNames": ["n1"]})
            status, body = _open(ext.url + "/filter", scheduler, filt)
            assert status == 200 and orjson.loads(body)["NodeNames"] == ["n1"]
            assert _open(ext.url + "/inspect", anonymous)[0] == 403
            assert _open(ext.url + "/readyz", anonymous)[0] == 200
            assert ext.metrics_server is not None
            side = ext.metrics_server.url
            assert _open(side + "/metrics", None)[0] == 200
            # read-only /inspect on the plain port: what `vramshare inspect` reaches through the API
            # server's service proxy (the admin's RBAC) without any scheduler key (issue 22)
            assert _open(side + "/inspect", None)[0] == 200 and _open(side + "/inspect/n1", None)[0] == 200
            assert _open(side + "/inspect/n1/x", None)[0] == 404
            assert _open(side + "/bind", None, args)[0] == 404


@pytest.mark.parametrize("text, key", [
    ("extender:\n  tlsCertFile: /a.crt\n", "missing tlsKeyFile, clientCAFile"),
    ("extender:\n  tlsCertFile: a.crt\n  tlsKeyFile: /k\n  clientCAFile: /c\n", "extender.tlsCertFile"),
    ("extender:\n  metricsListen: nope\n", "extender.metricsListen"),
])
def test_tls_config_is_validated(text: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        parse_config("version: v1\n" + text)


def test_vramshare_inspect_presents_a_client_certificate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from vramshare_cli import main as cli
    from extender import inspection
    pki = make_pki(tmp_path)
    config = parse_config(f"version: v1\nextender:\n  tlsCertFile: {pki.server_cert}\n"
                          f"  tlsKeyFile: {pki.server_key}\n  clientCAFile: {pki.ca}\n")
    with ApiServerDouble() as api:
        api.create_node(b.gpu_node("n1", b.l4()))
        with main.start_for_url(api.url, config) as ext:
            assert ext.wait_ready(10)
            ok = cli.build_parser().parse_args(["inspect", "--extender", ext.url, "--cacert", str(pki.ca),
                                                "--cert", str(pki.client_cert), "--key", str(pki.client_key)])
            assert inspection.run(ok) == 0 and "n1" in capsys.readouterr().out
            assert cli.main(["inspect", "--extender", ext.url, "--cacert", str(pki.ca)]) == 2  # no client cert
            assert "403" in capsys.readouterr().err


def test_plain_http_is_warned_about_unless_on_loopback(caplog: pytest.LogCaptureFixture) -> None:
    with ApiServerDouble() as api:
        with main.start_for_url(api.url, host="127.0.0.1"):
            pass
    assert not [r for r in caplog.records if "without TLS" in r.getMessage()]  # the demo, the tests
    # Which hosts count as loopback (binding a public address in a test is not an option here).
    assert all(main._loopback(h) for h in ("127.0.0.1", "::1", "localhost"))  # noqa: SLF001
    assert not any(main._loopback(h) for h in ("0.0.0.0", "::", "10.0.0.7", "extender.svc"))  # noqa: SLF001
