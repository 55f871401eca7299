"""The node the dynamic-MIG plugin tests share: an H100 and an A100 that dynamic MIG may partition
(one admin-made 3g.40gb instance at start), and the placement IDs on it."""
from __future__ import annotations

import dataclasses

from vramshare import mig_plan
from vramshare.config import Config, DynamicMigConfig
from vramshare.mig_plan import MigPlacement

A100 = "GPU-5e6f7081-92a3-44b5-86d7-e8f90a1b2c34"
H100 = "GPU-aaaa"
NODE = {"gpus": [
    {"model": "NVIDIA H100 80GB HBM3", "memoryMiB": 81559, "numaNode": 0, "uuid": H100},
    {"model": "NVIDIA A100-SXM4-80GB", "memoryMiB": 81920, "numaNode": 1, "uuid": A100, "mig": ["3g.40gb"]}]}


def pid(profile: str, start: int) -> str:
    """The placement ID of ``profile`` at ``start`` on the A100."""
    return mig_plan.encode(MigPlacement(A100, profile, start))


def with_dynamic_mig(config: Config) -> Config:
    """``config`` with dynamic MIG on for the A100 (GPU index 1), made instances kept 600 s."""
    return dataclasses.replace(config, dynamic_mig=DynamicMigConfig(gpus=("1",), grace_seconds=600.0))
