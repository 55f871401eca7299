"""The NVML per-process reader against the real driver, on a machine with an NVIDIA GPU.

Skipped with the reason when NVML or the CUDA driver library is not there. The test holds 256 MiB
of GPU memory through the CUDA driver API (ctypes, no framework needed) and checks that the reader
sees a process holding at least that much. Run: ``pytest -s -m gpu tests/quota/test_real_nvml.py``.
"""
from __future__ import annotations

import ctypes
import os

import pytest

from deviceplugin.quota.telemetry import NvmlProcessReader, TelemetryError

pytestmark = pytest.mark.gpu
HOLD_MIB = 256


@pytest.fixture
def held_memory():
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        pytest.skip(f"no CUDA driver library: {exc}")
    ctx, ptr, dev = ctypes.c_void_p(), ctypes.c_uint64(), ctypes.c_int()
    if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(dev), 0):
        pytest.skip("CUDA driver present but no usable GPU")
    assert cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev) == 0
    assert cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(HOLD_MIB << 20)) == 0
    yield
    cuda.cuMemFree_v2(ptr)
    cuda.cuCtxDestroy_v2(ctx)


def test_reader_sees_a_process_holding_memory(held_memory):
    try:
        samples = NvmlProcessReader().read_usage()
    except TelemetryError as exc:
        pytest.skip(f"NVML not usable here: {exc}")
    if not samples:  # tell "NVML hides processes here" apart from a reader bug
        import pynvml
        raw = [p for i in range(pynvml.nvmlDeviceGetCount())
               for p in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(i))
               if p.usedGpuMemory is not None]
        if not raw:
            pytest.skip("NVML lists no per-process memory here (no host PID namespace or permission)")
    for s in samples:
        print(f"  {s.gpu_uuid} pid {s.pid}{' (this test)' if s.pid == os.getpid() else ''}: "
              f"{s.used_mib} MiB, pod {s.pod_uid}, container {s.container_id}")
    assert any(s.used_mib >= HOLD_MIB and s.gpu_uuid.startswith("GPU-") for s in samples), samples
