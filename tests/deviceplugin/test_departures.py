"""The node reports its deleted pods that may still run (vramshare/departing.py ``Departures``, published in
the inventory's ``departing`` section by the device plugin), so an extender restarted inside their grace
books them (tests/extender/test_departing_reported.py).

Upstream's kubelet forgets a force-deleted pod at once (``GetActivePods`` omits it, kubernetes#104824): it
is gone from PodResources and its device IDs are handed out again at the next admission, while its
containers still run for the grace. Only the deletion the node's pod watch delivers says it went.
"""
from __future__ import annotations

import time

from deviceplugin.simulated_backend import SimulatedBackend
from deviceplugin.simulated_usage import UsageReplay
from standins.apiserver import PODS
from tests.deviceplugin.conftest import MIXED, NODE
from tests.extender.conftest import eventually
from tests.extender import builders as b
from vramshare import contract
from vramshare.contract import inventory as contract_inventory
from vramshare.departing import DEPARTING_MARGIN_S, MAX_DEPARTING, Departures

N = contract.Names()
T = 1_700_000_000.0


def _gone(name: str = "p", uid: str = "u1", *, state: str = "running", grace: int | None = 10,
          gpus: tuple[tuple[str, int], ...] = (("GPU-a", 20480),), node: str = NODE) -> dict:
    p = b.assigned(b.pod(name, 20, uid=uid), node, list(gpus), 0, state=contract.STATE_ALLOCATED)
    p["status"] = {"phase": "Running", "containerStatuses": [{"name": "c0", "state": {state: {}}}]}
    if grace is not None:
        p["spec"] = {**p["spec"], "terminationGracePeriodSeconds": grace}
    return p


def test_a_pod_that_may_still_run_is_reported_for_its_grace_then_forgotten() -> None:
    d = Departures(N)
    entry = d.note(_gone(gpus=(("GPU-a", 20480), ("GPU-b", 1024))), T)
    assert entry is not None and entry.pod == "default/p" and entry.uid == "u1"
    assert entry.gpus == (("GPU-a", 20480), ("GPU-b", 1024)) and entry.until_s == T + 10 + DEPARTING_MARGIN_S
    assert d.current(T + 14) == (entry,) and d.next_end_s() == entry.until_s
    assert d.current(T + 15) == () and d.next_end_s() is None


def test_what_is_not_reported() -> None:
    d = Departures(N)
    assert d.note(_gone(state="terminated"), T) is None           # the kubelet finished it
    assert d.note(_gone(node=""), T) is None                      # never on a node
    unowned = _gone()
    unowned["metadata"] = {**unowned["metadata"], "managedFields": []}
    assert d.note(unowned, T) is None                             # an assignment vramshare did not write
    bad = _gone()
    bad["metadata"]["annotations"] = {**bad["metadata"]["annotations"], N.assignment: '{"c0": []}'}
    assert d.note(bad, T) is None                                 # unreadable: nothing to book
    assert d.current(T) == ()


def test_the_report_is_bounded_latest_end_first_and_round_trips() -> None:
    d = Departures(N)
    for i in range(MAX_DEPARTING + 5):
        d.note(_gone(f"p{i}", f"u{i}", grace=i), T)
    now = d.current(T)
    assert len(now) == MAX_DEPARTING and now[0].uid == f"u{MAX_DEPARTING + 4}"
    inv = b.node_inventory(NODE, b.l4())
    import dataclasses
    text = contract_inventory.encode(dataclasses.replace(inv, departing=now))
    assert contract_inventory.parse(text).departing == now


def test_the_plugin_reports_a_force_deleted_pod_and_not_a_finished_one(api, http, start_plugin) -> None:
    """Through the API double's watch and the plugin's own publisher: the forced deletion shows in the node's
    inventory with the pod's GPUs; a graceful deletion the kubelet finished (containers terminated) does not."""
    daemon = start_plugin(api=http)
    gpu = daemon.state.snapshot.inventory.gpus[0].uuid

    def departing() -> tuple:
        text = (api.get_node(NODE)["metadata"].get("annotations") or {}).get(N.inventory)
        return contract_inventory.parse(text).departing if text else ()

    uids = {}
    for name in ("forced", "finished"):
        pod = _gone(name, gpus=((gpu, 20480),), grace=600)
        created = api.create_pod({**pod, "status": {}})  # the API server gives it its UID
        api.update(PODS, "default", name, lambda o, s=pod["status"]: o.__setitem__("status", s))
        assert created["spec"]["nodeName"] == NODE
        uids[name] = created["metadata"]["uid"]
    assert eventually(lambda: len(daemon.pods.pods()) == 2)
    api.finish_pod_deletion("default", "finished")
    api.delete_pod("default", "forced")
    assert eventually(lambda: [d.uid for d in departing()] == [uids["forced"]])
    assert departing()[0].gpus == ((gpu, 20480),) and departing()[0].pod == "default/forced"
    assert daemon.metrics.registry.get_sample_value("vramshare_deviceplugin_departing_pods_total") == 1
    time.sleep(0.3)
    assert [d.uid for d in departing()] == [uids["forced"]]


def test_a_restarted_plugin_keeps_what_its_predecessor_reported(api, http, start_plugin) -> None:
    """The report is in memory too: a plugin restarted inside a pod's grace reads the node's last inventory
    back before its first publish, which would otherwise drop the pod for the rest of its grace."""
    first = start_plugin(api=http)
    gpu = first.state.snapshot.inventory.gpus[0].uuid
    pod = _gone("forced", gpus=((gpu, 20480),), grace=600)
    created = api.create_pod({**pod, "status": {}})
    api.update(PODS, "default", "forced", lambda o: o.__setitem__("status", pod["status"]))
    assert eventually(lambda: len(first.pods.pods()) == 1)
    api.delete_pod("default", "forced")

    def departing() -> list[str]:
        text = (api.get_node(NODE)["metadata"].get("annotations") or {}).get(N.inventory)
        return [d.uid for d in contract_inventory.parse(text).departing] if text else []

    assert eventually(lambda: departing() == [created["metadata"]["uid"]])
    first.close()
    second = start_plugin(api=http, gpus=SimulatedBackend.from_file(MIXED))  # the first closed its backend
    assert [e.uid for e in second.departures.current(time.time())] == [created["metadata"]["uid"]]
    time.sleep(0.3)
    assert departing() == [created["metadata"]["uid"]]


def test_restore_keeps_only_records_not_ended() -> None:
    d = Departures(N)
    live, ended = _gone(uid="live"), _gone(uid="ended", grace=0)
    entries = (Departures(N).note(live, T), Departures(N).note(ended, T))
    assert d.restore([e for e in entries if e is not None], T + 6) == 1
    assert [e.uid for e in d.current(T + 6)] == ["live"]


def test_foreign_memory_is_published_in_whole_units_beyond_the_slack_and_beside_departing_pods(
        api, http, start_plugin) -> None:
    """The quota loop's settled foreign memory (QuotaLoop.on_foreign, vramshare/foreign.py) reaches the node's
    inventory in whole units beyond the GPU's slack. A forced deletion's departing entry does not lower it:
    subtracting an entry unbooks another process's memory whenever the entry's own is not in the figure (a
    pod deleted a moment ago, or one whose containers stopped), which the soak with stuck containers hit."""
    daemon = start_plugin(api=http)
    inv = daemon.state.snapshot.inventory
    gpu = inv.gpus[0]
    slack = gpu.memory_mib - gpu.units * inv.unit_mib

    def published() -> tuple[int, tuple]:
        text = (api.get_node(NODE)["metadata"].get("annotations") or {}).get(N.inventory)
        got = contract_inventory.parse(text) if text else None
        return (got.gpus[0].foreign_mib, got.departing) if got else (-1, ())

    daemon.on_foreign_settled({gpu.uuid: slack + 3000})  # a host process holds 3,000 MiB past the slack
    assert eventually(lambda: published()[0] == 3 * inv.unit_mib)
    assert daemon.metrics.registry.get_sample_value("vramshare_deviceplugin_foreign_memory_mib",
                                                    {"gpu": gpu.uuid}) == 3 * inv.unit_mib
    pod = _gone("forced", gpus=((gpu.uuid, 20480),), grace=600)
    api.create_pod({**pod, "status": {}})
    api.update(PODS, "default", "forced", lambda o: o.__setitem__("status", pod["status"]))
    assert eventually(lambda: len(daemon.pods.pods()) == 1)
    api.delete_pod("default", "forced")
    assert eventually(lambda: published()[1] != ())
    assert published()[0] == 3 * inv.unit_mib  # the entry books its 20 GiB; the host process's stays booked
    daemon.on_foreign_settled({})
    assert eventually(lambda: published()[0] == 0)


def test_a_restarted_plugin_keeps_the_foreign_memory_its_predecessor_reported(api, http, start_plugin) -> None:
    """The restart window: the quota loop needs two readings to settle foreign memory again, and a first
    publish without it would unbook, for those ticks, memory a stuck process still holds (the extender would
    plan a pod into it). The restarted plugin reads its predecessor's figure back with the departing pods,
    and its loop keeps it until its own readings settle: the node's annotation is never written without it."""
    first = start_plugin(api=http)
    inv = first.state.snapshot.inventory
    gpu = inv.gpus[0]
    slack = gpu.memory_mib - gpu.units * inv.unit_mib

    def published() -> int:
        text = (api.get_node(NODE)["metadata"].get("annotations") or {}).get(N.inventory)
        return contract_inventory.parse(text).gpus[0].foreign_mib if text else -1

    first.on_foreign_settled({gpu.uuid: slack + 3000})  # a host process holds 3,000 MiB past the slack
    assert eventually(lambda: published() == 3 * inv.unit_mib)
    first.close()
    before = (api.get_node(NODE)["metadata"].get("annotations") or {}).get(N.inventory)
    api.clear_requests()
    replaying = SimulatedBackend.from_file(MIXED)  # the first closed its backend; a replay runs the quota loop
    replaying.usage_replay = UsageReplay([[2000]])
    second = start_plugin(api=http, gpus=replaying)
    assert second._quota_loop is not None
    assert second.metrics.registry.get_sample_value("vramshare_deviceplugin_foreign_memory_mib",
                                                    {"gpu": gpu.uuid}) == 3 * inv.unit_mib
    time.sleep(0.5)
    assert published() == 3 * inv.unit_mib
    after = (api.get_node(NODE)["metadata"].get("annotations") or {}).get(N.inventory)
    assert after == before and api.count("PATCH", f"/api/v1/nodes/{NODE}") <= 1  # its start-up write, unchanged
