"""The device plugin against configs its consumers cannot use (issue 18 item 3, issue 17 item 8):
refused at start naming the key, and a live reload that would re-mean device IDs keeps them."""
from __future__ import annotations

import logging

import pytest

from deviceplugin.kubelet.main import DevicePluginDaemon
from deviceplugin.kubelet.server import list_response
from deviceplugin.simulated_backend import SimulatedBackend
from vramshare import config as vconfig
from vramshare.config import Config, ConfigError
from vramshare.inventory import GpuMode


def test_a_reserve_that_leaves_the_gpu_no_unit_stops_the_start_with_the_reason(tmp_path):
    """On main the plugin started and advertised 0 devices for the GPU."""
    with pytest.raises(ConfigError, match=r"^reservedMiBPerGPU: 81000 leaves GPU .*less than one unit"):
        DevicePluginDaemon(SimulatedBackend.demo(), Config(reserved_mib_per_gpu=81000), str(tmp_path))


def test_a_unit_whose_device_list_exceeds_one_message_stops_the_start(tmp_path):
    """memoryUnitMiB 1 on an 80 GiB GPU: ~80,000 devices, a ListAndWatch message larger than the
    kubelet's 4 MiB gRPC receive limit (the resource would get no devices at all)."""
    with pytest.raises(ConfigError, match=r"^memoryUnitMiB: 1 makes \d+ devices on this node"):
        DevicePluginDaemon(SimulatedBackend.demo(), Config(memory_unit_mib=1), str(tmp_path))


def test_a_live_change_of_the_unit_or_the_reserve_is_refused_and_the_rest_applies(tmp_path, caplog):
    daemon = DevicePluginDaemon(SimulatedBackend.demo(), Config(), str(tmp_path))
    try:
        before = daemon.state.snapshot.devices
        new = vconfig.parse_config("memoryUnitMiB: 2048\nreservedMiBPerGPU: 1024\nquota: {stepMiB: 256}\n")
        with caplog.at_level(logging.WARNING):
            daemon.reload(new)
        snap = daemon.state.snapshot
        assert snap.devices == before  # the IDs still mean what they meant
        assert (snap.config.memory_unit_mib, snap.config.reserved_mib_per_gpu) == (1024, 0)
        assert snap.config.quota.step_mib == 256  # the rest of the reload applied
        reasons = [getattr(r, "fields", {}).get("reason", "") for r in caplog.records]
        assert any(r.startswith("memoryUnitMiB: 1024 -> 2048 refused") for r in reasons), reasons
        assert any(r.startswith("reservedMiBPerGPU: 0 -> 1024 refused") for r in reasons), reasons
    finally:
        daemon.close()


def test_the_device_entry_bound_holds_for_the_worst_device_the_plugin_can_advertise():
    """DEVICE_ENTRY_BYTES is what one device costs on the wire at most: a 63-character ID (the
    kubelet's limit), health Unhealthy, one NUMA node with the largest ID; so MAX_DEVICES_PER_MESSAGE
    of them fit the 4 MiB the kubelet's gRPC client receives."""
    from deviceplugin.devices import PluginDevice
    worst = PluginDevice("G" * 63, "GPU-x", 2**31 - 1, False, 1024)
    one = list_response((worst,)).ByteSize()
    assert one <= vconfig.DEVICE_ENTRY_BYTES
    full = list_response((worst,) * vconfig.MAX_DEVICES_PER_MESSAGE).ByteSize()
    assert full <= vconfig.GRPC_MAX_RECEIVE_BYTES
    assert GpuMode.SHARED  # (the resource these devices are: gpu-memory units)
