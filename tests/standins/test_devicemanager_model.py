"""The kubelet stand-in's device manager model behaves as manager.go does where it decides device IDs:
only healthy, unallocated IDs; the plugin's preference is a hint intersected with what is available;
no preference call when not advertised; init-container devices reused by app containers; a container with
cached devices is not allocated again; an Allocate error leaks nothing; the checkpoint survives a kubelet
restart; and admission is in creation-time order with ties in random order."""
from __future__ import annotations

import random

import pytest

from standins.devicemanager import AdmissionError, DeviceManager, FnEndpoint
from standins.kubelet import admission_order

R = "vramshare.io/gpu-memory"


class Plugin:
    def __init__(self, prefer: list[str] | None = None, fail: bool = False) -> None:
        self.prefer, self.fail = prefer, fail
        self.preferred_calls: list[tuple[list[str], list[str], int]] = []
        self.allocated: list[list[str]] = []

    def endpoint(self, advertised: bool = True) -> FnEndpoint:
        return FnEndpoint(self._preferred, self._allocate, preferred_available=advertised)

    def _preferred(self, available, must, size):
        self.preferred_calls.append((list(available), list(must), size))
        return list(self.prefer or [])

    def _allocate(self, ids):
        if self.fail:
            raise RuntimeError("nope")
        self.allocated.append(list(ids))
        return {"ids": list(ids)}


def pod(name: str, n: int, init: int = 0, second: int = 0, sidecar: bool = False) -> dict:
    spec = {"containers": [{"name": "c", "resources": {"limits": {R: str(n)}}}]}
    if init:
        spec["initContainers"] = [{"name": "init", "resources": {"limits": {R: str(init)}},
                                   **({"restartPolicy": "Always"} if sidecar else {})}]
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}",
                         "creationTimestamp": f"2026-11-30T12:00:{second:02d}Z"}, "spec": spec}


def manager(plugin: Plugin, healthy: int = 8, unhealthy: int = 0, advertised: bool = True) -> DeviceManager:
    dm = DeviceManager(random.Random(1))
    dm.register(R, plugin.endpoint(advertised))
    dm.update_devices(R, [(f"g::{i}", True) for i in range(healthy)]
                      + [(f"g::{healthy + i}", False) for i in range(unhealthy)])
    return dm


def held(dm: DeviceManager, name: str, container: str = "c") -> set[str]:
    return set(dm.holdings()[("ns", name)][container][R])


def test_the_preference_is_a_hint_over_healthy_unallocated_ids_only():
    plugin = Plugin(prefer=["g::9", "g::1", "g::0"])  # g::9 is unhealthy: ignored
    dm = manager(plugin, healthy=8, unhealthy=2)
    dm.admit(pod("a", 2))
    available, must, size = plugin.preferred_calls[0]
    assert (len(available), must, size) == (8, [], 2)
    assert held(dm, "a") == {"g::0", "g::1"}
    with pytest.raises(AdmissionError, match="requested number of devices unavailable"):
        dm.admit(pod("b", 7))
    assert "uid-b" not in dm.pods and dm.allocated_devices[R] == {"g::0", "g::1"}  # nothing leaked


def test_no_preference_call_when_the_plugin_did_not_advertise_it():
    plugin = Plugin()
    dm = manager(plugin, advertised=False)
    dm.admit(pod("a", 3))
    assert plugin.preferred_calls == [] and len(held(dm, "a")) == 3


def test_init_devices_are_reused_by_the_app_container_and_a_sidecar_keeps_its_own():
    plugin = Plugin()
    dm = manager(plugin)
    dm.admit(pod("a", 3, init=2))
    assert held(dm, "a", "init") <= held(dm, "a")
    _, must, size = plugin.preferred_calls[-1]
    assert len(must) == 2 and size == 3  # mustInclude = the reused devices
    dm.admit(pod("s", 2, init=1, sidecar=True))
    assert not held(dm, "s", "init") & held(dm, "s")


def test_a_container_with_cached_devices_is_not_allocated_again_and_a_changed_count_fails():
    plugin = Plugin()
    dm = manager(plugin)
    p = pod("a", 2)
    dm.admit(p)
    dm.admit(p)
    assert len(plugin.allocated) == 1
    changed = pod("a", 3)
    with pytest.raises(AdmissionError, match="changed request"):
        dm.allocate(changed, changed["spec"]["containers"][0])


def test_an_allocate_error_fails_the_pod_and_frees_what_it_picked():
    dm = manager(Plugin(fail=True))
    with pytest.raises(AdmissionError, match="Allocate failed"):
        dm.admit(pod("a", 2))
    assert dm.allocated_devices.get(R, set()) == set() and dm.holdings() == {}


def test_a_late_re_allocate_calls_the_plugin_again():
    plugin = Plugin()
    dm = manager(plugin)
    dm.admit(pod("a", 2))
    dm.lose_container("uid-a", "c")
    dm.reallocate("uid-a")
    assert len(plugin.allocated) == 2 and len(held(dm, "a")) == 2


def test_the_checkpoint_survives_a_kubelet_restart():
    dm = manager(Plugin())
    dm.admit(pod("a", 2))
    before = held(dm, "a")
    dm.restore(dm.checkpoint())
    assert held(dm, "a") == before and dm.endpoints == {}
    [(ns, name, [(c, entries)])] = dm.pod_resources()  # one entry per device ID (no topology here)
    assert (ns, name, c) == ("ns", "a", "c") and sorted(entries) == [(R, d, None) for d in sorted(before)]


def test_admission_is_by_creation_second_with_ties_in_random_order():
    pods = [pod("late", 1, second=5), pod("x", 1, second=1), pod("y", 1, second=1), pod("z", 1, second=1)]
    orders = {tuple(p["metadata"]["name"] for p in admission_order(pods, random.Random(s))) for s in range(30)}
    assert all(o[-1] == "late" for o in orders)
    assert len(orders) > 1  # ties come in more than one order


def test_a_force_deleted_pod_leaves_pod_resources_and_its_ids_go_to_the_next_admission():
    """Upstream's kubelet drops a force-deleted pod from its pod manager at once (``HandlePodRemoves``), so
    ``GetActivePods`` omits it while its containers still stop (the WARNING on ``GetActivePods``,
    kubernetes#104824): ``List`` no longer names it and ``UpdateAllocatedDevices`` frees its IDs for the
    next admission. What bench/soak_nodes.py does to a force-deleted pod's kubelet."""
    plugin = Plugin()
    dm = manager(plugin, healthy=4)
    dm.admit(pod("old", 4))
    assert held(dm, "old") == {"g::0", "g::1", "g::2", "g::3"}
    dm.remove_pod("uid-old")                    # the API forgot it; its containers may still run
    assert [name for _, name, _ in dm.pod_resources()] == []
    dm.admit(pod("new", 4, second=1))           # would fail if the old pod still held its IDs
    assert held(dm, "new") == {"g::0", "g::1", "g::2", "g::3"}
