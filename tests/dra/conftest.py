"""Shared set-up for the DRA plugin tests: the demo node's GPUs, a config giving them to DRA."""
from __future__ import annotations

import pytest

from deviceplugin import devices
from deviceplugin.simulated_backend import SimulatedBackend
from vramshare.config import Config, DraConfig, DynamicMigConfig
from vramshare.inventory import GpuMode

NODE = "gpu-node-1"


def dra_config(tmp_path, dynamic_mig: tuple[str, ...] = (), **dra) -> Config:
    """GPU 1 exclusive, the rest shared (the A100 is in MIG mode); everything served by DRA; the GPUs
    in ``dynamic_mig`` consent to dynamic MIG (``dynamicMig.gpus``)."""
    return Config(gpu_modes={"1": GpuMode.EXCLUSIVE}, quota_host_dir=str(tmp_path / "quota"),
                  dynamic_mig=DynamicMigConfig(gpus=dynamic_mig),
                  dra=DraConfig(**{"gpus": ("all",), "cdi_root": str(tmp_path / "cdi"),
                                   "state_dir": str(tmp_path / "state"), **dra}))


@pytest.fixture
def config(tmp_path) -> Config:
    return dra_config(tmp_path)


@pytest.fixture
def discovered():
    return SimulatedBackend.demo().discover()


@pytest.fixture
def inventory(discovered, config):
    return devices.build_inventory(discovered, config, dra=True)
