"""NVML discovery against the fake pynvml: fixtures of real boards, and every NVML error path."""
from __future__ import annotations

import pynvml
import pytest

from deviceplugin import sysfs
from deviceplugin.backend import BackendError, DiscoveredMig, GpuBackend
from deviceplugin.nvml_backend import NO_DRIVER, NvmlBackend
from tests.fixtures import fake_nvml
from vramshare.config import parse_config
from tests.fixtures.fake_nvml import A100_80GB_MIG, H100_80GB, H200_141GB, FakeNvml

A100_MIGS = (
    DiscoveredMig(uuid=A100_80GB_MIG.migs[0].uuid, profile="3g.40gb", memory_mib=40192, gi=2, ci=0),
    DiscoveredMig(uuid=A100_80GB_MIG.migs[1].uuid, profile="2g.20gb", memory_mib=19968, gi=3, ci=0),
    DiscoveredMig(uuid=A100_80GB_MIG.migs[2].uuid, profile="1g.10gb", memory_mib=9728, gi=9, ci=0),
)


@pytest.fixture
def sysfs_root(tmp_path):
    return fake_nvml.make_sysfs(tmp_path, {"0000:18:00.0": "0", "0000:9a:00.0": "1", "0000:4e:00.0": "-1"})


def backend(*gpus, root="/nonexistent", **kw) -> tuple[NvmlBackend, FakeNvml]:
    fake = FakeNvml(list(gpus))
    return NvmlBackend(nvml=fake, sysfs_root=root, clock=fake.clock, **kw), fake


@pytest.mark.parametrize("spec, model, memory, reserved, numa, bus, mig_enabled, migs", [
    (H100_80GB, "NVIDIA H100 80GB HBM3", 81559, 542, 0, "00000000:18:00.0", False, ()),
    (H200_141GB, "NVIDIA H200", 143771, 608, 1, "00000000:9A:00.0", False, ()),
    (A100_80GB_MIG, "NVIDIA A100-SXM4-80GB", 81920, 512, None, "00000000:4E:00.0", True, A100_MIGS),
], ids=["h100", "h200", "a100-mig"])
def test_discover_reads_each_board(sysfs_root, spec, model, memory, reserved, numa, bus, mig_enabled, migs):
    nvml, _ = backend(spec, root=sysfs_root)
    [gpu] = nvml.discover()
    assert (gpu.index, gpu.uuid, gpu.model) == (0, spec.uuid, model)
    assert (gpu.memory_mib, gpu.reserved_mib, gpu.numa_node, gpu.pci_bus_id) == (memory, reserved, numa, bus)
    assert (gpu.mig_enabled, gpu.mig) == (mig_enabled, migs)


def test_discover_keeps_nvml_order_and_is_a_gpu_backend(sysfs_root):
    nvml, _ = backend(H100_80GB, H200_141GB, A100_80GB_MIG, root=sysfs_root)
    assert isinstance(nvml, GpuBackend)
    assert [(g.index, g.uuid) for g in nvml.discover()] == [
        (0, H100_80GB.uuid), (1, H200_141GB.uuid), (2, A100_80GB_MIG.uuid)]


@pytest.mark.parametrize("error, message", [
    (pynvml.NVMLError_LibraryNotFound, NO_DRIVER),
    (pynvml.NVMLError_DriverNotLoaded, "NVML: the NVIDIA kernel driver is not loaded; run on a GPU node"),
    (pynvml.NVMLError_NoPermission, "NVML: no permission to open /dev/nvidia*"),
    (pynvml.NVMLError_LibRmVersionMismatch, "NVML: libnvidia-ml.so does not match the loaded kernel driver"),
    (pynvml.NVMLError_Unknown, "NVML: init failed: Unknown Error"),
], ids=lambda v: getattr(v, "__name__", None))
def test_init_failure_is_one_clear_line_and_is_retried(error, message):
    nvml, fake = backend(H100_80GB)
    fake.fail("nvmlInit", error)
    with pytest.raises(BackendError) as err:
        nvml.discover()
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert isinstance(err.value.__cause__, error)
    assert [g.uuid for g in nvml.discover()] == [H100_80GB.uuid]  # the driver came up meanwhile
    assert nvml.errors[("nvmlInit", error.__name__)] == 1


def test_no_driver_message_is_the_documented_one():
    assert NO_DRIVER == ("NVML: no NVIDIA driver found (libnvidia-ml.so.1 not loadable); run on a GPU "
                         "node with the NVIDIA driver or use --backend simulated")


@pytest.mark.parametrize("error", [pynvml.NVMLError_FunctionNotFound, pynvml.NVMLError_NotSupported,
                                   pynvml.NVMLError_ArgumentVersionMismatch], ids=lambda e: e.__name__)
def test_memory_v1_fallback_when_v2_is_missing(error):
    nvml, fake = backend(H100_80GB)
    fake.fail("nvmlDeviceGetMemoryInfo_v2", error)
    [gpu] = nvml.discover()
    assert (gpu.memory_mib, gpu.reserved_mib) == (81559, 0)
    assert "nvmlDeviceGetMemoryInfo" in fake.calls


def test_memory_v1_when_pynvml_has_no_v2():
    nvml, fake = backend(H200_141GB)
    del fake.nvmlMemory_v2
    [gpu] = nvml.discover()
    assert (gpu.memory_mib, gpu.reserved_mib) == (143771, 0)
    assert "nvmlDeviceGetMemoryInfo_v2" not in fake.calls


@pytest.mark.parametrize("function, what", [
    ("nvmlDeviceGetHandleByIndex", "handle"),
    ("nvmlDeviceGetUUID", "uuid"),
    ("nvmlDeviceGetName", "name"),
    ("nvmlDeviceGetMemoryInfo_v2", "memory"),
    ("nvmlDeviceGetPciInfo", "PCI info"),
    ("nvmlDeviceGetMigMode", "MIG mode"),
    ("nvmlDeviceGetMigDeviceHandleByIndex", "MIG devices"),
    ("nvmlDeviceGetComputeInstanceId", "MIG devices"),
])
def test_a_failing_read_names_the_gpu_and_the_read(function, what):
    nvml, fake = backend(H100_80GB, A100_80GB_MIG)
    fake.fail(function, pynvml.NVMLError_Unknown, uuid=None if function == "nvmlDeviceGetHandleByIndex"
              else A100_80GB_MIG.uuid)
    with pytest.raises(BackendError) as err:
        nvml.discover()
    uuid = "?" if what in ("handle", "uuid") else A100_80GB_MIG.uuid
    index = 0 if what == "handle" else 1
    assert str(err.value) == f"NVML: GPU {index} ({uuid}): reading {what} failed: Unknown Error"


def test_lost_gpu_fails_discovery_with_its_name():
    nvml, fake = backend(H100_80GB, H200_141GB)
    fake.lose(H200_141GB.uuid)
    with pytest.raises(BackendError, match=r"GPU 1 \(\?\): reading uuid failed: GPU is lost"):
        nvml.discover()


def test_count_failure():
    nvml, fake = backend(H100_80GB)
    fake.fail("nvmlDeviceGetCount", pynvml.NVMLError_Unknown)
    with pytest.raises(BackendError, match="NVML: cannot count GPUs: Unknown Error"):
        nvml.discover()


def test_gpu_without_mig_support_is_not_mig():
    spec = fake_nvml.GpuSpec(uuid="GPU-00000000-0000-0000-0000-000000000001", name="Tesla T4",
                             total_mib=15360, reserved_mib=0, bus_id="00000000:01:00.0", mig_mode=None)
    nvml, _ = backend(spec)
    assert nvml.discover()[0].mig_enabled is False


@pytest.mark.parametrize("function", ["nvmlDeviceGetGpuInstanceById", "nvmlGpuInstanceGetInfo"])
def test_mig_profile_from_attributes_when_gi_is_unreadable(function):
    nvml, fake = backend(A100_80GB_MIG)
    fake.fail(function, pynvml.NVMLError_NoPermission, times=None)
    assert nvml.discover()[0].mig == A100_MIGS
    assert "nvmlDeviceGetAttributes" in fake.calls


def test_mig_profile_built_from_slices_when_profile_info_has_no_name():
    nameless = {k: (pid, slices, mem, "") for k, (pid, slices, mem, _n) in fake_nvml.A100_PROFILES.items()}
    fake = FakeNvml([A100_80GB_MIG], profiles=nameless)
    assert NvmlBackend(nvml=fake).discover()[0].mig == A100_MIGS


def test_numa_from_sysfs_with_normalised_bus_id(tmp_path):
    root = fake_nvml.make_sysfs(tmp_path, {"0000:9a:00.0": "3"})
    nvml, _ = backend(H200_141GB, root=root)  # NVML says 00000000:9A:00.0
    assert nvml.discover()[0].numa_node == 3


@pytest.mark.parametrize("content", ["-1", "garbage"])
def test_numa_unknown_is_none(tmp_path, content):
    nvml, _ = backend(H100_80GB, root=fake_nvml.make_sysfs(tmp_path, {"0000:18:00.0": content}))
    assert nvml.discover()[0].numa_node is None


def test_errors_are_counted_and_reported_but_timeouts_are_not():
    seen = []
    nvml, fake = backend(H100_80GB, on_nvml_error=lambda fn, kind: seen.append((fn, kind)))
    fake.fail("nvmlDeviceGetMemoryInfo_v2", pynvml.NVMLError_FunctionNotFound)
    nvml.discover()
    with pytest.raises(pynvml.NVMLError_Timeout):
        nvml.call("nvmlEventSetWait", "event-set", 10)
    assert seen == [("nvmlDeviceGetMemoryInfo", "NVMLError_FunctionNotFound")]
    assert nvml.errors_total == 1


def test_close_shuts_nvml_down_once_and_only_if_started():
    nvml, fake = backend(H100_80GB)
    nvml.close()
    assert "nvmlShutdown" not in fake.calls
    nvml.discover()
    nvml.close()
    nvml.close()
    assert fake.calls.count("nvmlShutdown") == 1 and fake.initialized is False


@pytest.mark.parametrize("bus_id, expected", [
    ("00000000:3B:00.0", "0000:3b:00.0"),
    ("0000:3b:00.0", "0000:3b:00.0"),
    ("00000001:AF:1F.7", "0001:af:1f.7"),
    ("3b:00.0", "0000:3b:00.0"),
])
def test_bus_id_normalisation(bus_id, expected):
    assert sysfs.normalize_bus_id(bus_id) == expected


@pytest.mark.parametrize("bus_id", ["", "3b:00", "zz:00.0", "100000000:3b:00.0", "0000:3b:00.8"])
def test_bad_bus_ids_are_refused(bus_id):
    with pytest.raises(sysfs.SysfsError, match="PCI bus id"):
        sysfs.normalize_bus_id(bus_id)


def test_probe_cadence_comes_from_the_health_config():
    cfg = parse_config("health: {recoveryProbeSeconds: 7, probesToRecover: 5}").health
    nvml = NvmlBackend.from_config(cfg, nvml=FakeNvml([H100_80GB]))
    assert (nvml.probe_seconds, nvml.probes_to_recover) == (7.0, 5)
