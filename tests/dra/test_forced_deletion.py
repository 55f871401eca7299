"""kubernetes/kubernetes#141471 on this driver, end to end with the stand-ins of the real peers: the
scheduler and claim controller (``standins.dra_scheduler``), the kubelet (``standins.dra_kubelet``: it
unprepares a pod's claims only once its containers stopped), the running DRA plugin over gRPC.

A force-deleted pod leaves the API at once; the claim controller drops its reservation and deallocates,
so the next claim may be allocated the same memory while the old pod's containers still run and its claim
is still prepared on the node. The issue reports the replacement prepared 0.42 s after the forced
deletion and the old claim unprepared 2 s later: the device prepared for two claims at once.

Two answers here: the plugin sees the pod leave (its pod watch) and takes the claim's grant off the
devices' published capacity until the kubelet unprepares it, so the allocator places nothing there; and
should a claim be allocated there before that lands, Prepare refuses it while the old claim is prepared
(the kubelet retries), so the memory is never prepared twice.
"""
from __future__ import annotations

import dataclasses

import pytest

from standins.dra_kubelet import PrepareError
from tests.dra.conftest import NODE, dra_config
from tests.dra.test_daemon import devices_of
from tests.dra.test_quota_tick_view import running_plugin

GIB = 1024


def _pod(api, scheduler, name: str):
    """A pod with a claim from the shipped ``vllm-tp2-48gi`` template (48 GiB on each of two GPUs), its
    claim created by the stand-in controller, and where it was scheduled (None: it fits nowhere)."""
    api.create_pod({"metadata": {"name": name, "namespace": "default"},
                    "spec": {"resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "vllm-tp2-48gi"}],
                             "containers": [{"name": "vllm", "image": "vllm",
                                             "resources": {"claims": [{"name": "gpus"}]}}]}})
    placement = scheduler.schedule(scheduler.create_claims(api.get_pod("default", name)))
    return api.get_pod("default", name), placement


def _capacity(api) -> dict[str, str]:
    return {n: d["capacity"]["memory"]["value"] for n, d in devices_of(api).items() if d.get("allowMultipleAllocations")}


def test_the_grant_of_a_force_deleted_pods_claim_stays_booked_until_unprepared(tmp_path):
    with running_plugin(dra_config(tmp_path)) as (api, daemon, scheduler, kubelet):
        full = _capacity(api)
        assert full == {"gpu-0": f"{79 * GIB}Mi", "gpu-2": f"{140 * GIB}Mi"}
        old, where = _pod(api, scheduler, "old")
        assert where is not None and where.node == NODE
        kubelet.prepare_pod(old)
        assert _capacity(api) == full  # a running claim is the allocator's to book: nothing taken off

        api.delete_pod("default", "old")  # --grace-period=0 --force: gone from the API at once ...
        scheduler.release(old)  # ... so the claim controller deallocates it; its containers still run
        held = {"gpu-0": f"{31 * GIB}Mi", "gpu-2": f"{92 * GIB}Mi"}
        assert api.wait_for(lambda a: _capacity(a) == held, timeout=20), _capacity(api)
        assert daemon.metrics.registry.get_sample_value("vramshare_dra_foreign_memory_mib",
                                                        {"gpu": daemon.state.snapshot.inventory.gpus[0].uuid}) == 48 * GIB
        new, where = _pod(api, scheduler, "new")
        assert where is None  # 31 GiB offered on gpu-0: the same 48 GiB are not handed out again

        kubelet.unprepare_pod(old)  # its containers stopped at last
        assert api.wait_for(lambda a: _capacity(a) == full, timeout=20), _capacity(api)
        placement = scheduler.schedule(api.get_pod("default", "new"))  # kube-scheduler retries the pod
        assert placement is not None
        kubelet.prepare_pod(api.get_pod("default", "new"))
        [claim] = daemon.preparer.prepared().values()
        assert sorted(claim.gpus.values()) == [48 * GIB, 48 * GIB]


def test_a_replacement_allocated_before_the_report_lands_is_not_prepared_into_that_memory(tmp_path):
    """The race the report cannot always win (the issue's replacement was allocated within half a second),
    here without the report (the quota loop, and with it the plugin's pod watch, off): Prepare refuses."""
    config = dra_config(tmp_path)
    config = dataclasses.replace(config, quota=dataclasses.replace(config.quota, enabled=False))
    with running_plugin(config) as (api, daemon, scheduler, kubelet):
        old, _ = _pod(api, scheduler, "old")
        kubelet.prepare_pod(old)
        [first] = daemon.preparer.prepared().values()
        api.delete_pod("default", "old")
        scheduler.release(old)
        new, where = _pod(api, scheduler, "new")  # the allocator sees both GPUs free: the same memory again
        assert where is not None
        with pytest.raises(PrepareError, match="already prepared for other claims is more than its"):
            kubelet.prepare_pod(new)  # gpu-0: 48 + 48 GiB prepared on a 79 GiB GPU
        assert list(daemon.preparer.prepared()) == [first.uid]  # nothing of the new claim on the node
        assert kubelet.unprepare_pod(old) == [first.uid]
        kubelet.prepare_pod(new)  # the kubelet's retry of the pod's sync
        [second] = daemon.preparer.prepared().values()
        assert second.uid != first.uid and sorted(second.gpus.values()) == [48 * GIB, 48 * GIB]
