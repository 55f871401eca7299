"""The NVML backend against the real driver, read-only, on a machine that has an NVIDIA GPU.

Skipped with the reason when NVML does not initialise (no driver, no GPU). Run it on a GPU node with
``pytest -s -m gpu tests/deviceplugin/test_real_gpu.py`` to see the report it prints: one line per
GPU with memory, reserved memory, NUMA node and MIG instances, and a few seconds of health watching.
"""
from __future__ import annotations

import re
import threading

import pytest

from deviceplugin import health
from deviceplugin.backend import BackendError, HealthEvent
from deviceplugin.nvml_backend import NvmlBackend

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nvml():
    backend = NvmlBackend()
    try:
        backend.discover()
    except BackendError as exc:
        pytest.skip(f"no usable NVIDIA GPU here: {exc}")
    yield backend
    backend.close()


def test_discover_reports_sane_gpus(nvml):
    gpus = nvml.discover()
    print(f"\n{len(gpus)} GPU(s), NVML errors so far: {nvml.errors_total}")
    assert gpus, "NVML initialised but reports no GPU"
    for gpu in gpus:
        print(f"  [{gpu.index}] {gpu.uuid} {gpu.model}: {gpu.memory_mib} MiB total, "
              f"{gpu.reserved_mib} MiB reserved, NUMA {gpu.numa_node}, PCI {gpu.pci_bus_id}, "
              f"MIG {'on' if gpu.mig_enabled else 'off'}")
        for mig in gpu.mig:
            print(f"      {mig.uuid} {mig.profile} {mig.memory_mib} MiB gi={mig.gi} ci={mig.ci}")
        assert re.match(r"^GPU-[0-9a-f-]{36}$", gpu.uuid)
        assert gpu.memory_mib > 1024 and 0 <= gpu.reserved_mib < gpu.memory_mib
        assert gpu.numa_node is None or gpu.numa_node >= 0
        assert sum(m.memory_mib for m in gpu.mig) <= gpu.memory_mib
    assert [g.index for g in gpus] == list(range(len(gpus)))


def test_health_watch_starts_and_stops(nvml):
    """Register events and wait once (5 s); a healthy GPU reports nothing, stop ends the watch."""
    events: list[HealthEvent] = []
    stop = threading.Event()
    watcher = threading.Thread(target=nvml.watch_health, args=(stop, events.append, health.DEFAULT_IGNORED_XIDS))
    watcher.start()
    stop.set()
    watcher.join(30)
    assert not watcher.is_alive()
    print(f"\nhealth events while watching: {events or 'none'}")
    assert all(not e.healthy for e in events)
