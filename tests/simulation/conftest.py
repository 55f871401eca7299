"""Tiny hand-written traces in the openb CSV format."""
from __future__ import annotations

from pathlib import Path

import pytest

NODES = """sn,cpu_milli,memory_mib,gpu,model
node-a,32000,262144,2,G2
node-b,32000,262144,2,T4
"""

PODS = """name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time
pod-0,4000,8192,1,400,,LS,Running,0,10,0
pod-1,4000,8192,1,400,,LS,Running,1,10,1
pod-2,8000,8192,1,1000,,LS,Running,2,10,2
pod-3,2000,4096,0,0,,BE,Running,3,10,3
pod-4,4000,8192,2,1000,T4,LS,Running,4,10,4
"""


@pytest.fixture
def trace(tmp_path: Path) -> tuple[str, str]:
    nodes, pods = tmp_path / "nodes.csv", tmp_path / "pods.csv"
    nodes.write_text(NODES)
    pods.write_text(PODS)
    return str(nodes), str(pods)
