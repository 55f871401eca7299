"""Which pod an Allocate serves (pure): node, state and size filters, assume order, multi-container pods,
and reading the extender's assignment."""
from __future__ import annotations

import json

import pytest

from deviceplugin import handshake
from vramshare import contract

NAMES = contract.Names()
MEM = NAMES.gpu_memory


def pod(name: str, containers: dict[str, int], assume: int | str | None = 100, node: str = "gpu-1",
        state: str | None = "assumed", phase: str = "Pending", resource: str = MEM, **meta: object) -> dict:
    ann = {}
    if assume is not None:
        ann[NAMES.assume_time] = str(assume)
    if state is not None:
        ann[NAMES.allocation_state] = state
    ann[NAMES.assignment] = json.dumps({c: [{"uuid": "GPU-a", "mib": n * 1024}] for c, n in containers.items()})
    return {
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}", "annotations": ann,
                     "resourceVersion": "7", **meta},
        "spec": {"nodeName": node, "containers": [
            {"name": c, "resources": {"limits": {resource: str(n)}}} for c, n in containers.items()]},
        "status": {"phase": phase},
    }


def match(pods: list[dict], size: int, served: set = frozenset(), resource: str = MEM) -> handshake.Match | None:
    return handshake.find_match(pods, NAMES, "gpu-1", resource, size, served)


def test_the_oldest_assumed_pod_of_the_right_size_wins():
    pods = [pod("late", {"c": 4}, assume=300), pod("early", {"c": 4}, assume=200), pod("other", {"c": 8}, assume=1)]
    m = match(pods, 4)
    assert (m.pod.key, m.container, m.assume_time, m.pod.resource_version) == ("default/early", "c", 200, "7")
    assert m.completes_pod


@pytest.mark.parametrize("other", [
    pod("p", {"c": 4}, node="gpu-2"),
    pod("p", {"c": 4}, state="allocated"),
    pod("p", {"c": 4}, state=None),
    pod("p", {"c": 4}, phase="Running"),
    pod("p", {"c": 4}, assume=None),
    pod("p", {"c": 4}, assume="yesterday"),
    pod("p", {"c": 4}, deletionTimestamp="2026-01-01T00:00:00Z"),
    pod("p", {"c": 5}),
    pod("p", {"c": 4}, resource="vramshare.io/gpu"),
], ids=["other-node", "allocated", "no-state", "running", "no-assume-time", "bad-assume-time", "deleting",
        "other-size", "other-resource"])
def test_pods_that_do_not_qualify(other):
    assert match([other], 4) is None


def test_a_two_container_pod_is_served_container_by_container():
    p = pod("two", {"a": 2, "b": 2})
    first = match([p], 2)
    assert (first.container, first.completes_pod) == ("a", False)
    second = match([p], 2, {("uid-two", "a", MEM)})
    assert (second.container, second.completes_pod) == ("b", True)
    assert match([p], 2, {("uid-two", "a", MEM), ("uid-two", "b", MEM)}) is None


def test_containers_of_different_sizes_match_by_their_own_request():
    p = pod("mixed", {"small": 1, "big": 6})
    assert match([p], 6).container == "big"
    assert match([p], 1).container == "small"


def test_mig_and_whole_gpu_requests_are_counted_per_resource():
    mig = pod("m", {"c": 1}, resource="vramshare.io/mig-1g.10gb")
    assert match([mig], 1, resource="vramshare.io/mig-1g.10gb").container == "c"
    assert match([mig], 1, resource="vramshare.io/mig-2g.20gb") is None
    whole = pod("w", {"c": 2}, resource="vramshare.io/gpu")
    assert match([whole], 2, resource="vramshare.io/gpu").completes_pod


def test_parse_assignment():
    text = json.dumps({"c": [{"uuid": "GPU-a", "mib": 4096}, {"uuid": "GPU-b", "mib": 4096}]})
    assert handshake.parse_assignment(text, "c") == (handshake.AssignedGpu("GPU-a", 4096),
                                                     handshake.AssignedGpu("GPU-b", 4096))


@pytest.mark.parametrize("text, message", [
    (None, "no assignment annotation"),
    ("{", "not JSON"),
    (json.dumps({"other": []}), "no GPUs for container 'c'"),
    (json.dumps({"c": [{"uuid": "GPU-a"}]}), "want"),
    (json.dumps({"c": [{"uuid": "GPU-a", "mib": True}]}), "want"),
    (json.dumps({"c": [{"uuid": "GPU-a", "mib": 1}, {"uuid": "GPU-a", "mib": 1}]}), "names a GPU twice"),
], ids=["missing", "not-json", "no-container", "no-mib", "bool-mib", "duplicate"])
def test_bad_assignments_say_what_is_wrong(text, message):
    with pytest.raises(handshake.AssignmentError, match=message):
        handshake.parse_assignment(text, "c")
