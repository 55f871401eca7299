"""Day two of an install (issue 22): the certificates `vramshare install` makes verify through a
port-forward (localhost) with the scheduler's client certificate, and an upgrade (a new extender on the
same cluster) keeps every running pod's books."""
from __future__ import annotations

import ssl
import urllib.request

from extender import inspection, main
from standins.apiserver import ApiServerDouble
from standins.scheduler import SchedulerDriver
from tests.extender import builders as b
from tests.extender.conftest import eventually
from vramshare.config import parse_config
from vramshare_cli import certs


def test_generated_certificates_verify_through_a_port_forward(tmp_path):
    tls = certs.generate("vramshare-system", days=30)
    files = {"server.crt": tls.server.cert, "server.key": tls.server.key, "ca.crt": tls.ca,
             "client.crt": tls.client.cert, "client.key": tls.client.key}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    config = parse_config(f"version: v1\nextender:\n  tlsCertFile: {tmp_path / 'server.crt'}\n"
                          f"  tlsKeyFile: {tmp_path / 'server.key'}\n  clientCAFile: {tmp_path / 'ca.crt'}\n")
    with ApiServerDouble() as api:
        api.create_node(b.gpu_node("n1", b.l4()))
        with main.start_for_url(api.url, config) as ext:
            assert ext.wait_ready(10)
            port = ext.url.rsplit(":", 1)[1]
            ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))  # hostname checked
            ctx.load_cert_chain(str(tmp_path / "client.crt"), str(tmp_path / "client.key"))
            for host in ("localhost", "127.0.0.1"):  # what `kubectl port-forward` gives a laptop
                doc = inspection.fetch(f"https://{host}:{port}", context=ctx)
                assert [n["name"] for n in doc["nodes"]] == ["n1"]


def test_an_upgrade_keeps_every_running_pods_books():
    """The state lives in the API server: a new extender (the upgraded Deployment's pod) rebuilds the
    same per-GPU usage from the assignments before it answers."""
    with ApiServerDouble() as api:
        api.create_node(b.gpu_node("n1", b.a100(), b.a100()))
        with main.start_for_url(api.url) as old:
            assert old.wait_ready(10) and eventually(lambda: "n1" in old.acct.slots)
            driver = SchedulerDriver(old.url, ["n1"])
            for i, gib in enumerate((20, 30, 40)):
                pod = b.pod(f"p{i}", gib)
                pod["spec"]["schedulerName"] = "vramshare-scheduler"
                assert driver.schedule(api.create_pod(pod)).node == "n1"
                api.set_pod_phase("default", f"p{i}", "Running")
            driver.close()
            assert eventually(lambda: len(old.acct.pods) == 3)
            before = inspection.render(old.acct, "n1")
        with main.start_for_url(api.url) as new:
            assert new.wait_ready(10) and eventually(lambda: len(new.acct.pods) == 3)
            after = inspection.render(new.acct, "n1")
    assert before is not None and after == before and before["usedMiB"] == 90 * 1024
