"""``vramshare demo --dra`` runs end to end, and its DeviceClasses are the deployed ones."""
from __future__ import annotations

import argparse
import io
import pathlib

import yaml

from standins import demo_dra

DEPLOYED = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "daemonset" / "dra" / "deviceclasses.yaml"


def test_the_demo_places_prepares_and_releases():
    out = io.StringIO()
    assert demo_dra.run(argparse.Namespace(pods=6, verbose=False), out) == 0
    text = out.getvalue()
    assert text.count("container gets VRAMSHARE_MEMORY_LIMIT_MIB=") == 5
    assert "VRAMSHARE_MEMORY_LIMIT_MIB=22528" in text and "NVIDIA_VISIBLE_DEVICES=MIG-" in text
    assert "llama3-70b-fp16  1 x 150 GiB  pending" in text
    assert "CDI specs left on its node" in text


def test_demo_device_classes_are_the_deployed_ones():
    assert demo_dra.device_classes() == [d for d in yaml.safe_load_all(DEPLOYED.read_text()) if d]
