"""Dynamic MIG on the DRA path (issue 24): NodePrepareResources makes the partition's GPU and compute
instance, NodeUnprepareResources destroys it, both checkpointed; the plugin killed after any NVML
change or any checkpoint/CDI write and restarted (the kubelet retrying the call) leaks and doubles
nothing. GPUs are the fake NVML with the dynamic-MIG calls (tests/fixtures/fake_nvml_mig.py)."""
from __future__ import annotations

import pytest

from deviceplugin import devices
from deviceplugin.dra import slices
from deviceplugin.dra.claims import ClaimRef
from deviceplugin.dra.preparer import ClaimPreparer, FileEffects
from deviceplugin.mig_dynamic import DynamicMig
from deviceplugin.mig_nvml import NvmlMig
from deviceplugin.nvml_backend import NvmlBackend
from tests.dra.conftest import NODE, dra_config
from tests.dra.test_preparer import Claims, claim
from tests.fixtures.fake_nvml_mig import H100_MIG, Crash, MigFakeNvml

DRIVER = "gpu.vramshare.io"
NVML_EFFECTS = ("nvmlDeviceCreateGpuInstanceWithPlacement", "nvmlGpuInstanceCreateComputeInstance",
                "nvmlComputeInstanceDestroy", "nvmlGpuInstanceDestroy")


class KilledEffects(FileEffects):
    """Files written for real; the process dies right after the n-th write took effect."""

    def __init__(self, at: int | None, count: list[int]) -> None:
        self.at, self.count = at, count  # the count survives the "restart"

    def write_file(self, path, data):
        super().write_file(path, data)
        self.count[0] += 1
        if self.at is not None and self.count[0] == self.at:
            raise Crash(f"write {self.at}")


class Node:
    """One plugin process over the fake GPU: a new one knows only NVML and the checkpoint."""

    def __init__(self, fake: MigFakeNvml, config, claims: Claims, crash_write: int | None = None,
                 writes: list[int] | None = None) -> None:
        backend = NvmlBackend(nvml=fake)
        inventory = devices.build_inventory(backend.discover(), config, dra=True)
        dynamic = slices.dynamic_models(inventory, config.dra_partitions)
        assert list(dynamic) == [H100_MIG.uuid]
        handle = fake.nvmlDeviceGetHandleByIndex(0)
        self.mig = DynamicMig(NvmlMig(fake), {H100_MIG.uuid: (handle, H100_MIG.name, H100_MIG.total_mib)})
        index = slices.device_index(inventory, dynamic)
        self.preparer = ClaimPreparer(NODE, lambda: config, lambda: index, claims,
                                      effects=KilledEffects(crash_write, writes if writes is not None else [0]),
                                      mig=self.mig)


def _result(device: str) -> dict:
    return {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}


def _layout(fake: MigFakeNvml) -> list[tuple[str, int, int]]:
    return sorted((fake.table[gi.profile_index][4].removeprefix("MIG "), gi.start, len(gi.cis))
                  for gi in fake.instances[0].values())


@pytest.fixture
def config(tmp_path):
    return dra_config(tmp_path, dynamic_mig=("all",))


def _claims() -> tuple[Claims, dict[str, ClaimRef]]:
    claims = Claims()
    refs = {}
    for uid, device in (("a", "gpu-0-mig-3g40gb-9-4"), ("b", "gpu-0-mig-1g20gb-15-0"), ("c", "gpu-0-mig-2g20gb-14-2")):
        c = claims.add(claim(uid, [_result(device)], pod=f"pod-{uid}"))
        refs[uid] = ClaimRef("default", c["metadata"]["name"], uid)
    return claims, refs


def test_prepare_makes_the_partition_and_unprepare_destroys_it(config):
    fake = MigFakeNvml()
    fake.nvmlInit()
    claims, refs = _claims()
    node = Node(fake, config, claims)
    got = node.preparer.prepare(refs["a"])
    assert got.error == "" and _layout(fake) == [("3g.40gb", 4, 1)]
    mig_uuid = fake.gpus[0].migs[0].uuid
    # the container sees the MIG device, with the profile memory the slice published (4/8 of 80 GiB)
    assert node.preparer.checkpoint.claims["a"].gpus == {mig_uuid: 40960}
    assert node.preparer.checkpoint.partitions() == {(H100_MIG.uuid, "3g.40gb", 4)}
    with open(node.preparer.checkpoint.claims["a"].cdi_spec) as fh:
        spec = fh.read()
    assert f"NVIDIA_VISIBLE_DEVICES={mig_uuid}" in spec
    # a repeated Prepare (kubelet restart) answers from the checkpoint; a restarted plugin adopts
    assert node.preparer.prepare(refs["a"]).devices == got.devices
    assert Node(fake, config, claims).preparer.prepare(refs["a"]).devices == got.devices and fake.created == 1
    # an instance with processes is never destroyed: Unprepare fails and is retried
    fake.busy.add(mig_uuid)
    assert "still has processes" in node.preparer.unprepare(refs["a"])
    assert _layout(fake) == [("3g.40gb", 4, 1)] and "a" in node.preparer.checkpoint.claims
    fake.busy.clear()
    assert node.preparer.unprepare(refs["a"]) == "" and _layout(fake) == []
    assert node.preparer.checkpoint.claims == {}


def test_a_taken_placement_or_a_second_claim_fails_with_the_reason(config):
    fake = MigFakeNvml()
    fake.nvmlInit()
    claims, refs = _claims()
    node = Node(fake, config, claims)
    assert node.preparer.prepare(refs["a"]).error == ""
    twin = claims.add(claim("t", [_result("gpu-0-mig-3g40gb-9-4")], pod="pod-t"))
    err = node.preparer.prepare(ClaimRef("default", twin["metadata"]["name"], "t")).error
    assert "already prepared for another claim" in err
    overlap = claims.add(claim("o", [_result("gpu-0-mig-1g10gb-19-5")], pod="pod-o"))
    err = node.preparer.prepare(ClaimRef("default", overlap["metadata"]["name"], "o")).error
    assert "slots 4-7 are held by 3g.40gb" in err and _layout(fake) == [("3g.40gb", 4, 1)]


def _scenario(refs):
    """Prepare a, prepare b, unprepare a, prepare c, unprepare b: c's instance alone remains."""
    return [("prepare", refs["a"]), ("prepare", refs["b"]), ("unprepare", refs["a"]), ("prepare", refs["c"]),
            ("unprepare", refs["b"])]


def _run(fake, config, claims, refs, crash_write=None):
    writes = [0]
    node, crashed, i = Node(fake, config, claims, crash_write, writes), False, 0
    steps = _scenario(refs)
    while i < len(steps):
        what, ref = steps[i]
        try:
            answer = getattr(node.preparer, what)(ref)
            assert (answer.error if what == "prepare" else answer) == ""
            i += 1
        except Crash:
            crashed = True
            node = Node(fake, config, claims, None, writes)  # a new process; the kubelet retries step i
    return node, crashed


def _final(fake, node):
    assert _layout(fake) == [("2g.20gb", 2, 1)]
    assert set(node.preparer.checkpoint.claims) == {"c"}
    assert node.preparer.checkpoint.partitions() == {(H100_MIG.uuid, "2g.20gb", 2)}
    assert fake.created == 3  # a, b, c: never one twice


@pytest.mark.parametrize("function,n", [(f, n) for f in NVML_EFFECTS[:2] for n in (1, 2, 3)] +
                         [(f, n) for f in NVML_EFFECTS[2:] for n in (1, 2)])
def test_killed_after_any_nvml_change_leaks_or_doubles_nothing(config, function, n):
    fake = MigFakeNvml()
    fake.nvmlInit()
    fake.crash_after(function, n)
    claims, refs = _claims()
    node, crashed = _run(fake, config, claims, refs)
    assert crashed
    _final(fake, node)


# 3 writes per Prepare (checkpoint "preparing", CDI spec, checkpoint "prepared"), 2 per Unprepare
@pytest.mark.parametrize("write", range(1, 14))
def test_killed_after_any_checkpoint_or_cdi_write_leaks_or_doubles_nothing(config, write):
    fake = MigFakeNvml()
    fake.nvmlInit()
    claims, refs = _claims()
    node, crashed = _run(fake, config, claims, refs, crash_write=write)
    assert crashed
    _final(fake, node)
