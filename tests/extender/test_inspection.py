"""``vramshare inspect`` against a running extender, and the HTTP transport's keep-alive."""
from __future__ import annotations

import http.client
import io
import urllib.parse

import orjson
import pytest

from extender import inspection, main
from standins.apiserver import ApiServerDouble
from tests.extender import builders as b
from tests.extender.conftest import Scheduler, eventually
from vramshare_cli import main as cli


def test_table_names_every_gpu_with_its_pods(double: ApiServerDouble, extender: main.RunningExtender,
                                             scheduler: Scheduler) -> None:
    double.create_node(b.gpu_node("gpu-a", b.a100(), b.l4(healthy=False)))
    pod = double.create_pod(b.pod("llama", 20))
    assert eventually(lambda: "gpu-a" in extender.acct.slots)
    assert scheduler.bind(pod, "gpu-a") == {"Error": ""}
    out = io.StringIO()
    args = cli.build_parser().parse_args(["inspect", "--extender", extender.url])
    assert inspection.run(args, out) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].split() == ["NODE", "GPU", "MODEL", "KIND", "TOTAL", "USED", "FREE", "PODS"]
    assert lines[1].split() == ["gpu-a", "0", "NVIDIA", "A100-SXM4-80GB", "shared", "80.0", "20.0", "60.0",
                                "default/llama", "(20.0)"]
    assert lines[2].split()[4:6] == ["shared", "UNHEALTHY"]
    assert lines[-1] == "1 node(s), 2 GPU(s): 20.0 of 102.0 GiB used, 82.0 GiB free (memory in GiB)"


def test_one_node_and_errors(double: ApiServerDouble, extender: main.RunningExtender,
                             capsys: pytest.CaptureFixture[str]) -> None:
    double.create_node(b.gpu_node("gpu-b", b.l4()))
    parser = cli.build_parser()
    out = io.StringIO()
    assert eventually(lambda: "gpu-b" in extender.acct.slots)
    assert inspection.run(parser.parse_args(["inspect", "gpu-b", "--extender", extender.url]), out) == 0
    assert out.getvalue().splitlines()[1].split()[:2] == ["gpu-b", "0"]
    capsys.readouterr()
    # as through the API server's proxy: one line, exit status 2 (it exited 1 here)
    assert cli.main(["inspect", "nope", "--extender", extender.url]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("vramshare inspect: extender: 404 node nope has no vramshare GPUs") and len(err.splitlines()) == 1
    assert cli.main(["inspect", "--extender", "http://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot reach the extender at http://127.0.0.1:1" in err and len(err.splitlines()) == 1


def test_requests_share_one_keep_alive_connection(extender: main.RunningExtender) -> None:
    url = urllib.parse.urlsplit(extender.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    try:
        conn.connect()
        sock = conn.sock
        for _ in range(3):
            conn.request("POST", "/filter", body=orjson.dumps({"Pod": b.pod("web"), "NodeNames": ["x"]}))
            resp = conn.getresponse()
            assert resp.version == 11 and resp.getheader("Content-Type") == "application/json"
            assert orjson.loads(resp.read())["NodeNames"] == ["x"]
        assert conn.sock is sock  # never reconnected
    finally:
        conn.close()
