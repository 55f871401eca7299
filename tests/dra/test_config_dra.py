"""The ``dra`` config section: strict keys, who owns which GPU."""
from __future__ import annotations

import pytest

from vramshare.config import ConfigError, DraConfig, parse_config


def test_dra_section_parses_and_defaults():
    c = parse_config("version: v1\ndra:\n  gpus: [0, GPU-abc]\n  deviceTaints: true\n  cdiRoot: /etc/cdi\n")
    assert c.dra == DraConfig(gpus=("0", "GPU-abc"), device_taints=True, cdi_root="/etc/cdi")
    assert c.dra.manages(0, "GPU-x") and c.dra.manages(5, "GPU-abc") and not c.dra.manages(1, "GPU-y")
    assert parse_config("dra:\n  gpus: all\n").dra.manages(7, "anything")
    assert parse_config("").dra.gpus == () and not parse_config("").dra.manages(0, "GPU-0")


@pytest.mark.parametrize("text, key", [
    ("dra:\n  gpu: [0]\n", "dra.gpu"),
    ("dra:\n  gpus: 3\n", "dra.gpus"),
    ("dra:\n  gpus: [true]\n", "dra.gpus"),
    ("dra:\n  deviceTaints: yes please\n", "dra.deviceTaints"),
    ("dra:\n  cdiRoot: relative/dir\n", "dra.cdiRoot"),
    ("dra: [1]\n", "dra"),
])
def test_bad_dra_config_names_the_key(text, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_config(text)


def test_dynamic_mig_keys():
    """Issue 24: one consent for both paths (``dynamicMig.gpus``); DRA publishes partitionable devices
    on the GPUs it owns that the consent names, unless ``dra.partitionableDevices`` is off."""
    c = parse_config("dra:\n  gpus: all\ndynamicMig:\n  gpus: [3, GPU-m]\n")
    assert c.dynamic_mig.gpus == ("3", "GPU-m") and c.dra.partitionable_devices == "auto"
    allowed = c.dra_partitions
    assert allowed(3, "GPU-x") and allowed(0, "GPU-m") and not allowed(0, "GPU-x")
    assert not parse_config("dynamicMig:\n  gpus: all\ndra:\n  partitionableDevices: 'off'\n").dra_partitions(0, "GPU-0")
    assert not parse_config("").dra_partitions(0, "GPU-0")
    with pytest.raises(ConfigError, match=r"dra\.partitionableDevices"):
        parse_config("dra:\n  partitionableDevices: maybe\n")
    with pytest.raises(ConfigError, match=r"dra\.dynamicMig"):  # the old second list is refused by name
        parse_config("dra:\n  dynamicMig: [3]\n")
