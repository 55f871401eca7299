"""Driver memory limits on a real GPU: read the driver version, then Get/SetMemoryLimits on a test
cgroup, and print what happened (issue 9). Skips with the reason where there is no GPU, the driver is
older than R615, the node runs cgroup v1, or the test may not create a cgroup.

Run on a GPU node, as root: ``pytest -s -m gpu tests/deviceplugin/test_real_memory_limits.py``.
"""
from __future__ import annotations

import dataclasses
import os
import uuid

import pytest

from deviceplugin import enforcement
from deviceplugin.nvml_limits import LimitError, NvmlMemoryLimits
from vramshare.config import EnforcementConfig

pytestmark = pytest.mark.gpu
CGROUP_ROOT = "/sys/fs/cgroup"


@pytest.fixture
def nvml():
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        pytest.skip(f"no usable NVIDIA driver here: {exc}")
    yield pynvml
    pynvml.nvmlShutdown()


@pytest.fixture
def test_cgroup():
    if not os.path.exists(os.path.join(CGROUP_ROOT, "cgroup.controllers")):
        pytest.skip("cgroup v1 node: driver memory limits need cgroup v2")
    name = f"vramshare-test-{uuid.uuid4().hex[:8]}"
    path = os.path.join(CGROUP_ROOT, name)
    try:
        os.mkdir(path)
    except OSError as exc:
        pytest.skip(f"cannot create a test cgroup under {CGROUP_ROOT}: {exc}")
    yield "/" + name
    os.rmdir(path)


def test_driver_memory_limits_on_a_test_cgroup(nvml, test_cgroup):
    version = nvml.nvmlSystemGetDriverVersion()
    version = version.decode() if isinstance(version, bytes) else version
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    gpu = nvml.nvmlDeviceGetUUID(handle)
    gpu = gpu.decode() if isinstance(gpu, bytes) else gpu
    facts = enforcement.probe(nvml, EnforcementConfig(), shared_uuids=[gpu])
    print(f"\n  driver {version}, GPU {gpu}, cgroup v2 {facts.cgroup_v2}, driver mode: "
          f"{facts.driver_problem() or 'available'}, host access: {facts.host_access_problem or 'granted'}")
    if facts.host_access_problem and "kubepods" in facts.host_access_problem:
        # A GPU machine outside Kubernetes has no kubepods cgroup; this test fences a cgroup of its own.
        facts = dataclasses.replace(facts, host_access_problem=None)
    if facts.driver_problem():
        pytest.skip(f"driver mode not available: {facts.driver_problem()}")
    limits = NvmlMemoryLimits(nvml)
    before = limits.get(gpu, test_cgroup)
    print(f"  {test_cgroup} before: soft {before.soft_mib} MiB, hard {before.hard_mib} MiB, used {before.used_mib} MiB")
    try:
        limits.set(gpu, test_cgroup, 1024, 2048)
    except LimitError as exc:
        pytest.fail(f"SetMemoryLimits refused on an R615 driver: {exc}")
    after = limits.get(gpu, test_cgroup)
    print(f"  {test_cgroup} after set 1024/2048: soft {after.soft_mib} MiB, hard {after.hard_mib} MiB, "
          f"used {after.used_mib} MiB")
    assert (after.soft_mib, after.hard_mib) == (1024, 2048)
