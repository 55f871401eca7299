"""``vramshare inspect`` from a laptop (issue 22): through the API server's service proxy with the admin's
kubeconfig (no scheduler key anywhere), against the double's proxy route in the real server's shape."""
from __future__ import annotations

import io
import pathlib
import tomllib
import urllib.request

import pytest

from extender import inspection, main
from standins.apiserver import ApiServerDouble
from standins.apiserver.proxy import split_scheme_name_port
from tests.extender import builders as b
from tests.extender.conftest import eventually
from tests.fixtures.kubeconfig import write_kubeconfig
from vramshare_cli import main as cli

NS = "vramshare-system"


def _service(ns: str = NS) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "vramshare-extender", "namespace": ns},
            "spec": {"ports": [{"name": "https", "port": 8888, "targetPort": "https"},
                               {"name": "metrics", "port": 9402, "targetPort": "metrics"}]}}


def _endpoints(ext: main.RunningExtender, ns: str = NS) -> dict:
    assert ext.metrics_server is not None
    side = int(ext.metrics_server.url.rsplit(":", 1)[1])
    main_port = int(ext.url.rsplit(":", 1)[1])
    return {"apiVersion": "v1", "kind": "Endpoints", "metadata": {"name": "vramshare-extender", "namespace": ns},
            "subsets": [{"addresses": [{"ip": "127.0.0.1"}],
                         "ports": [{"name": "https", "port": main_port}, {"name": "metrics", "port": side}]}]}


@pytest.fixture
def cluster(tmp_path):
    with ApiServerDouble() as api:
        api.create_node(b.gpu_node("gpu-a", b.a100()))
        with main.start_for_url(api.url, metrics_at=("127.0.0.1", 0)) as ext:
            assert ext.wait_ready(10) and eventually(lambda: "gpu-a" in ext.acct.slots)
            yield api, ext, write_kubeconfig(tmp_path / "kubeconfig", api.url)


def test_inspect_through_the_service_proxy(cluster, capsys):
    api, ext, kubeconfig = cluster
    api.create(_service())
    api.create(_endpoints(ext))
    assert cli.main(["inspect", "--kubeconfig", str(kubeconfig)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].split()[:2] == ["gpu-a", "0"] and "1 node(s), 1 GPU(s)" in out
    assert api.count("GET", r"^/api/v1/namespaces/vramshare-system/services/http(:|%3A)vramshare-extender(:|%3A)metrics/proxy/inspect$") == 1
    assert cli.main(["inspect", "gpu-a", "--kubeconfig", str(kubeconfig)]) == 0
    assert cli.main(["inspect", "nope", "--kubeconfig", str(kubeconfig)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("vramshare inspect: extender: 404 node nope") and len(err.splitlines()) == 1


def test_inspect_says_what_is_missing(cluster, capsys):
    api, ext, kubeconfig = cluster
    assert cli.main(["inspect", "--kubeconfig", str(kubeconfig)]) == 2
    assert 'services "vramshare-extender" not found' in capsys.readouterr().err
    api.create(_service())
    assert cli.main(["inspect", "--kubeconfig", str(kubeconfig)]) == 2
    err = capsys.readouterr().err
    assert "503 no endpoints available for service 'vramshare-extender'" in err and "vramshare check" in err


def test_inspect_without_a_kubeconfig_says_how(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert cli.main(["inspect"]) == 2
    assert "port-forward" in capsys.readouterr().err


def test_the_proxy_route_resolves_as_kube_apiserver(cluster):
    """Port by number maps to the Service port's name; an unknown port is 503, a bad reference 400."""
    api, ext, _ = cluster
    api.create(_service())
    api.create(_endpoints(ext))
    base = f"{api.url}/api/v1/namespaces/{NS}/services"
    for ref in ("vramshare-extender:metrics", "http:vramshare-extender:9402", "vramshare-extender:9402"):
        with urllib.request.urlopen(f"{base}/{ref}/proxy/readyz") as resp:
            assert resp.status == 200
    for ref, code in (("vramshare-extender:1234", 503), ("a:b:c:d", 400), ("ftp:vramshare-extender:metrics", 400)):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{base}/{ref}/proxy/readyz")
        err.value.close()
        assert err.value.code == code


def test_split_scheme_name_port():
    assert split_scheme_name_port("svc") == ("", "svc", "")
    assert split_scheme_name_port("svc:80") == ("", "svc", "80")
    assert split_scheme_name_port("https:svc:web") == ("https", "svc", "web")
    assert split_scheme_name_port(":80") is None and split_scheme_name_port("a:b:c:d") is None


def test_kubectl_finds_the_plugin():
    scripts = tomllib.loads((pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["kubectl-vramshare"] == scripts["vramshare"] == "vramshare_cli.main:main"
