"""Two extender replicas (issue 22): leader election over a coordination.k8s.io/v1 Lease as client-go's
tryAcquireOrRenew does it, against the API double's Lease in the real shape; a standby hands verbs to
the leader, so one set of books decides; a stopped leader releases the Lease and the standby goes on."""
from __future__ import annotations

import time

from kubernetes import client

from extender import leader, main
from standins.apiserver import LEASES, ApiServerDouble
from standins.scheduler import SchedulerDriver
from tests.extender import builders as b
from tests.extender.conftest import eventually
from vramshare import contract
from vramshare.kube import api_client_for

NS = "vramshare-system"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _electors(http, clocks):
    return [leader.LeaseElector(http, NS, "vramshare-extender", ident, f"https://{ident}:8888", clock=clocks[i])
            for i, ident in enumerate(("a", "b"))]


def test_one_leader_and_a_takeover_only_after_the_lease_expires():
    clocks = [Clock(), Clock()]
    with ApiServerDouble() as api, api_client_for(api.url) as http:
        a, b_ = _electors(http, clocks)
        a.step()
        b_.step()
        assert a.is_leader() and not b_.is_leader() and b_.leader_url() == "https://a:8888"
        lease = client.CoordinationV1Api(http).read_namespaced_lease("vramshare-extender", NS)  # the model parses
        assert lease.spec.holder_identity == "a" and lease.spec.lease_duration_seconds == 15
        assert lease.spec.renew_time is not None and lease.spec.acquire_time is not None
        clocks[1].t += 14  # a is silent, but its lease has not run out for b
        b_.step()
        assert not b_.is_leader()
        clocks[1].t += 2  # 16 s since b saw the record change
        b_.step()
        assert b_.is_leader()
        [obj] = api.objects(LEASES, NS)
        assert obj["spec"]["holderIdentity"] == "b" and obj["spec"]["leaseTransitions"] == 1
        assert obj["metadata"]["annotations"][leader.LEADER_URL] == "https://b:8888"
        clocks[0].t += 11  # a wakes up past its renew deadline, finds b holding a valid lease
        a.step()
        assert not a.is_leader() and a.leader_url() == "https://b:8888"


def test_a_leader_keeps_the_lease_by_renewing_and_a_lost_race_is_no_leadership():
    clocks = [Clock(), Clock()]
    with ApiServerDouble() as api, api_client_for(api.url) as http:
        a, b_ = _electors(http, clocks)
        a.step()
        for _ in range(5):
            clocks[0].t += 5
            clocks[1].t += 5
            a.step()
            b_.step()
            assert a.is_leader() and not b_.is_leader()
        api.fail_next("PUT", r"/leases/vramshare-extender$", code=409)  # another replica moved first
        clocks[0].t += 5
        a.step()
        assert a.is_leader(), "one failed renewal is within the renew deadline"
        api.fail_next("PUT", r"/leases/vramshare-extender$", code=409, times=3)
        for _ in range(3):
            clocks[0].t += 5
            a.step()
        assert not a.is_leader(), "no renewal for longer than the renew deadline: stop leading"


def _pod(name: str) -> dict:
    pod = b.pod(name, 8)
    pod["spec"]["schedulerName"] = "vramshare-scheduler"
    return pod


def test_two_replicas_one_set_of_books_and_scheduling_goes_on_when_the_leader_stops():
    fast = leader.Settings(lease_duration_s=2, renew_deadline_s=1.5, retry_period_s=0.1)
    with ApiServerDouble() as api:
        api.create_node(b.gpu_node("n1", b.l4()))
        first = main.start_for_url(api.url, elect=(NS, "first", None), election=fast)
        second = main.start_for_url(api.url, elect=(NS, "second", None), election=fast)
        try:
            assert first.wait_ready(10) and second.wait_ready(10)
            assert eventually(lambda: first.elector.is_leader() != second.elector.is_leader())
            lead, standby = (first, second) if first.elector.is_leader() else (second, first)
            assert eventually(lambda: standby.elector.leader_url() == lead.url)
            driver = SchedulerDriver(standby.url, ["n1"])  # kube-scheduler's Service picked the standby
            p1 = api.create_pod(_pod("p1"))
            assert driver.schedule(p1).node == "n1"
            assert eventually(lambda: lead.acct.pods and "default/p1" in lead.acct.pods)
            assert standby.app.stats.requests.labels("bind", "forwarded")._value.get() == 1
            t0 = time.monotonic()
            lead.stop()  # a clean stop releases the Lease
            assert eventually(lambda: standby.elector.is_leader(), timeout=10)
            gap = time.monotonic() - t0
            p2 = api.create_pod(_pod("p2"))
            assert driver.schedule(p2).node == "n1"
            ann = api.get_pod("default", "p2")["metadata"]["annotations"]
            assert contract.Names().assignment in ann
            print(f"scheduling gap after a clean leader stop: {gap:.2f} s")
            driver.close()
        finally:
            for r in (first, second):
                try:
                    r.stop()
                except Exception:  # noqa: BLE001 - already stopped
                    pass


def test_a_leader_restarted_in_its_pod_takes_its_lease_back_at_once():
    """A crashed container restarts under the same pod name (identity): no wait for the lease to run out;
    only a lost pod (a new name) costs the lease duration."""
    clocks = [Clock(), Clock(), Clock()]
    with ApiServerDouble() as api, api_client_for(api.url) as http:
        a, b_ = _electors(http, clocks)
        a.step()
        b_.step()
        restarted = leader.LeaseElector(http, NS, "vramshare-extender", "a", "https://a:8888", clock=clocks[2])
        restarted.step()
        assert restarted.is_leader() and not b_.is_leader()


def test_a_standby_follows_a_certificate_rotation_without_a_restart(tmp_path):
    """Both replicas run with mutual TLS from one Secret volume; the standby calls the leader with the
    scheduler's client certificate. `vramshare install --tls generate` makes a new CA: the leader reloads
    its files, and the standby must too, or every verb kube-scheduler's Service hands it fails with
    'leader unreachable' until it restarts (main read the standby's client context once)."""
    import dataclasses
    import ssl

    from extender import tls
    from tests.fixtures.certs import make_pki
    from tests.security.test_extender_endpoint import call
    from vramshare.config import Config

    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    old, new = make_pki(tmp_path / "old"), make_pki(tmp_path / "new")
    live = tmp_path / "live"  # the Secret volumes (serving files, and the scheduler's for the peer)
    live.mkdir()

    def mount(pki) -> None:
        for name, src in (("tls.crt", pki.server_cert), ("tls.key", pki.server_key), ("ca.crt", pki.ca),
                          ("client.crt", pki.client_cert), ("client.key", pki.client_key)):
            (live / name).write_bytes(src.read_bytes())

    mount(old)
    config = Config()
    config = config.with_overrides(extender=dataclasses.replace(
        config.extender, tls_cert_file=str(live / "tls.crt"), tls_key_file=str(live / "tls.key"),
        client_ca_file=str(live / "ca.crt")))
    fast = leader.Settings(lease_duration_s=2, renew_deadline_s=1.5, retry_period_s=0.1)

    def scheduler(pki, url: str) -> ssl.SSLSocket:
        import socket
        ctx = ssl.create_default_context(cafile=str(pki.ca))
        ctx.check_hostname = False
        ctx.load_cert_chain(str(pki.client_cert), str(pki.client_key))
        host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
        return ctx.wrap_socket(socket.create_connection((host, int(port)), timeout=10))

    body = b'{"Pod": {"metadata": {"name": "cpu-only", "namespace": "default"}, "spec": {"containers": []}}, "NodeNames": ["n1"]}'
    with ApiServerDouble() as api:
        api.create_node(b.gpu_node("n1", b.l4()))
        replicas = [main.start_for_url(api.url, config, elect=(NS, name, None), election=fast,
                                       peer_tls=tls.Reloader(tls.TlsFiles(str(live / "client.crt"), str(live / "client.key"),
                                                                          str(live / "ca.crt")),
                                                             build=tls.peer_context, check_s=0.05))
                    for name in ("first", "second")]
        try:
            for r in replicas:
                assert r.wait_ready(10)
                r.server.tls_check_s = 0.05  # 10 s by default
            assert eventually(lambda: replicas[0].elector.is_leader() != replicas[1].elector.is_leader())
            lead, standby = replicas if replicas[0].elector.is_leader() else replicas[::-1]
            assert eventually(lambda: standby.elector.leader_url() == lead.url)
            with scheduler(old, standby.url) as sock:
                status, answer = call(sock, "POST", "/filter", body)
            assert status == 200 and b'"NodeNames":["n1"]' in answer, answer
            mount(new)  # the kubelet updates both Secret volumes
            time.sleep(0.3)  # both replicas' checks pass
            with scheduler(new, standby.url) as sock:
                status, answer = call(sock, "POST", "/filter", body)
            assert status == 200 and b'"NodeNames":["n1"]' in answer, answer  # not 'leader ... unreachable'
            assert standby.app.stats.requests.labels("filter", "forwarded")._value.get() == 2
        finally:
            for r in replicas:
                r.stop()
