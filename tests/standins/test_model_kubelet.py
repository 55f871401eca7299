"""The soak's model kubelet (bench/soak_harness.py ``KubeletSim``) knows a pod by its UID, as a kubelet
does: a pod deleted and recreated under its name between two of its steps is the old UID removed (its
devices freed, ``devicemanager.ManagerImpl.UpdateAllocatedDevices``) and a new UID added
(``kubelet/config/config.go podStorage.merge`` keys pods by UID), and what it writes for a pod never lands
on a successor of that name (the device plugin's patch carries the resourceVersion it read: 409).

Until round 14 it keyed pods by name: the successor inherited the old pod's devices, was never admitted
nor reported, and the model soak counted GPUs "mismatched after settle" (5 on seed 7) that were the
stand-in's, not the extender's."""
from __future__ import annotations

from typing import Any, Callable

import orjson
import pytest

from bench.bench_soak import pod_obj
from bench.soak_harness import KubeletSim
from standins.apiserver import PODS, ApiServerDouble
from vramshare import contract

N = contract.Names()
UNIT = 1024
NODE = "node-00"


def _plan(api: ApiServerDouble, name: str, gpu: str, gib: int) -> dict[str, Any]:
    """Bind ``name`` to the node with the extender's plan on ``gpu`` (as the extender's bind writes it)."""
    def assumed(pod: dict[str, Any]) -> None:
        ann = pod["metadata"].setdefault("annotations", {})
        ann[N.assignment] = orjson.dumps({"vllm": [{"uuid": gpu, "mib": gib * UNIT}]}).decode()
        ann[N.allocation_state] = contract.STATE_ASSUMED
    api.update(PODS, "default", name, assumed, manager=contract.FIELD_MANAGER_EXTENDER)
    return api.bind_pod("default", name, NODE)


def _kubelet(api: Any, units: int = 8) -> KubeletSim:
    return KubeletSim(api, {NODE: {"G0": units, "G1": units}}, UNIT, (0.0, 0.0), seed=1)


def _ann(api: ApiServerDouble, name: str) -> dict[str, str]:
    return api.get_pod("default", name)["metadata"].get("annotations") or {}


def test_a_pod_recreated_under_its_name_between_two_steps_frees_the_old_devices_and_is_admitted(
        double: ApiServerDouble) -> None:
    kubelet = _kubelet(double)
    double.create_pod(pod_obj("p", 4, 1))
    _plan(double, "p", "G0", 4)
    kubelet.step()
    assert kubelet.reality_mib() == {"G0": 4 * UNIT, "G1": 0}
    double.finish_pod_deletion("default", "p")  # the kubelet stopped it; the name is free
    new = double.create_pod(pod_obj("p", 4, 1))  # a StatefulSet's replacement, before the kubelet's next look
    _plan(double, "p", "G1", 4)
    kubelet.step()
    assert kubelet.reality_mib() == {"G0": 0, "G1": 4 * UNIT}  # the old UID's devices are free, the new holds its own
    assert kubelet.pending_admissions() == 0
    ann = _ann(double, "p")
    assert ann[N.allocation_state] == contract.STATE_ALLOCATED  # the successor was admitted and reported
    assert orjson.loads(ann[N.assignment]) == {"vllm": [{"uuid": "G1", "mib": 4 * UNIT}]}
    assert double.get_pod("default", "p")["metadata"]["uid"] == new["metadata"]["uid"]


class _ReplacedAfterList:
    """The API as the kubelet sees it when a pod is deleted and recreated under its name between the
    kubelet's List and its write for that pod (the soak's churn does it at any moment)."""

    def __init__(self, api: ApiServerDouble, name: str) -> None:
        self.api, self.name, self.armed = api, name, True

    def pods(self) -> list[dict[str, Any]]:
        listed = self.api.pods()
        if self.armed:
            self.armed = False
            self.api.finish_pod_deletion("default", self.name)
            self.api.create_pod(pod_obj(self.name, 4, 1))
        return listed

    def update(self, *args: Any, **kwargs: Any) -> Any:
        return self.api.update(*args, **kwargs)

    def __getattr__(self, attr: str) -> Callable[..., Any]:
        return getattr(self.api, attr)


@pytest.mark.parametrize("units", [8, 1], ids=["admitted", "admission-fails"])
def test_what_the_kubelet_writes_for_a_pod_never_lands_on_its_successor(double: ApiServerDouble, units: int) -> None:
    double.create_pod(pod_obj("p", 4, 1))
    _plan(double, "p", "G0", 4)
    kubelet = _kubelet(_ReplacedAfterList(double, "p"), units)
    kubelet.step()  # admits (or fails) the pod it listed, which is gone by the time it writes
    succ = double.get_pod("default", "p")
    assert not succ["spec"].get("nodeName")
    assert (succ.get("status") or {}).get("phase") == "Pending"  # not Failed by its predecessor's admission
    assert N.allocation_state not in (succ["metadata"].get("annotations") or {})  # nor reported with its GPUs
    kubelet.step()
    assert kubelet.reality_mib() == {"G0": 0, "G1": 0}  # the predecessor is gone: nothing held
