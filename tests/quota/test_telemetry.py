"""NVML per-process reader and PID -> pod attribution through /proc/<pid>/cgroup."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from deviceplugin.quota.telemetry import (NvmlProcessReader, TelemetryError, UsageReader, UsageSample,
                                          parse_cgroup)

UID = "1b2c3d4e-5f60-4a0c-9d7e-0123456789ab"
CID = "a" * 64
V1 = f"12:memory:/kubepods/burstable/pod{UID}/{CID}\n11:cpu,cpuacct:/kubepods/burstable/pod{UID}/{CID}\n"
V2 = ("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + UID.replace("-", "_")
      + f".slice/cri-containerd-{CID}.scope\n")


def test_parse_cgroup_v1_and_v2():
    assert parse_cgroup(V1) == (UID, CID)
    assert parse_cgroup(V2) == (UID, CID)
    assert parse_cgroup("0::/system.slice/nvidia-persistenced.service\n") == (None, None)
    assert parse_cgroup(f"0::/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice\n") == (UID, None)


class NVMLError_GpuIsLost(Exception):  # named like pynvml's generated error classes
    pass


@dataclass
class Proc:
    pid: int
    usedGpuMemory: int | None


class FakeNvml:
    """The few pynvml functions the reader calls; GPUs are {uuid: [Proc]}."""

    def __init__(self, gpus: dict[str, list[Proc]]) -> None:
        self.gpus, self.inits, self.lost = gpus, 0, False

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        if self.lost:
            raise NVMLError_GpuIsLost("GPU is lost")
        return list(self.gpus)[i]

    def nvmlDeviceGetUUID(self, h: str) -> bytes:
        return h.encode()

    def nvmlDeviceGetComputeRunningProcesses(self, h: str) -> list[Proc]:
        return self.gpus[h]


@pytest.fixture
def proc_root(tmp_path):
    for pid, text in {100: V1, 200: V2, 300: "0::/system.slice/host.service\n"}.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cgroup").write_text(text)
    return tmp_path


def test_nvml_reader_attributes_processes_to_pods(proc_root):
    nv = FakeNvml({"GPU-a": [Proc(100, 3 << 30), Proc(300, 512 << 20), Proc(999, 1 << 30)],
                   "GPU-b": [Proc(200, 5 << 30), Proc(200, None)]})
    reader = NvmlProcessReader(nv, proc_root=str(proc_root))
    assert isinstance(reader, UsageReader)
    assert reader.read_usage() == [
        UsageSample("GPU-a", 3072, pod_uid=UID, container_id=CID, pid=100),
        UsageSample("GPU-a", 512, pid=300),  # a host process: foreign memory, still counted
        UsageSample("GPU-a", 1024, pid=999),  # exited before we read its cgroup
        UsageSample("GPU-b", 5120, pod_uid=UID, container_id=CID, pid=200),
    ]


def test_nvml_errors_become_telemetry_errors_and_reinit(proc_root):
    nv = FakeNvml({"GPU-a": [Proc(100, 1 << 30)]})
    reader = NvmlProcessReader(nv, proc_root=str(proc_root))
    reader.read_usage()
    nv.lost = True
    with pytest.raises(TelemetryError, match="NVMLError_GpuIsLost"):
        reader.read_usage()
    nv.lost = False
    assert reader.read_usage()[0].used_mib == 1024
    assert nv.inits == 2


def test_missing_library_is_a_telemetry_error():
    class NoLib:
        def nvmlInit(self):
            raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    with pytest.raises(TelemetryError, match="libnvidia-ml"):
        NvmlProcessReader(NoLib()).read_usage()
