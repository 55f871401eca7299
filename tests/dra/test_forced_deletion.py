"""kubernetes/kubernetes#141471 on this driver, end to end with the stand-ins of the real peers: the
scheduler and claim controller (``standins.dra_scheduler``), the kubelet (``standins.dra_kubelet``: it
unprepares a pod's claims only once its containers stopped), the running DRA plugin over gRPC.

A force-deleted pod leaves the API at once; the claim controller drops its reservation and deallocates,
so the next claim may be allocated the same memory while the old pod's containers still run and its claim
is still prepared on the node. The issue reports the replacement prepared 0.42 s after the forced
deletion and the old claim unprepared 2 s later: the device prepared for two claims at once. Here Prepare
refuses the replacement while the old claim is prepared, and the kubelet's retry succeeds once it is gone.
"""
from __future__ import annotations

import pytest

from standins.dra_kubelet import PrepareError
from tests.dra.conftest import NODE, dra_config
from tests.dra.test_quota_tick_view import running_plugin


def _pod(api, scheduler, name: str) -> dict:
    """A pod with a claim from the shipped ``vllm-tp2-48gi`` template (48 GiB on each of two GPUs),
    scheduled here by the stand-in (claim created, allocated, reserved, pod bound)."""
    api.create_pod({"metadata": {"name": name, "namespace": "default"},
                    "spec": {"resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "vllm-tp2-48gi"}],
                             "containers": [{"name": "vllm", "image": "vllm",
                                             "resources": {"claims": [{"name": "gpus"}]}}]}})
    placement = scheduler.schedule(scheduler.create_claims(api.get_pod("default", name)))
    assert placement is not None and placement.node == NODE
    return api.get_pod("default", name)


def test_a_replacement_is_not_prepared_into_a_force_deleted_pods_memory(tmp_path):
    with running_plugin(dra_config(tmp_path)) as (api, daemon, scheduler, kubelet):
        old = _pod(api, scheduler, "old")
        kubelet.prepare_pod(old)
        [first] = daemon.preparer.prepared().values()
        assert sorted(first.gpus.values()) == [48 * 1024, 48 * 1024]  # both shared GPUs of the demo node

        api.delete_pod("default", "old")  # --grace-period=0 --force: gone from the API at once ...
        scheduler.release(old)  # ... so the claim controller deallocates; its containers still run
        new = _pod(api, scheduler, "new")  # the allocator sees both GPUs free: the same memory again
        with pytest.raises(PrepareError, match="already prepared for other claims is more than its"):
            kubelet.prepare_pod(new)  # gpu-0: 48 + 48 GiB prepared on a 79 GiB GPU
        assert list(daemon.preparer.prepared()) == [first.uid]  # nothing of the new claim on the node

        assert kubelet.unprepare_pod(old) == [first.uid]  # the old containers stopped at last
        kubelet.prepare_pod(new)  # the kubelet's retry of the pod's sync
        [second] = daemon.preparer.prepared().values()
        assert second.uid != first.uid and sorted(second.gpus.values()) == [48 * 1024, 48 * 1024]
