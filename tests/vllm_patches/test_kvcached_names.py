"""kvcached's segment name comes from the container's environment, set by the node agent at Allocate
(and in the DRA claim's CDI spec), so every process of the engine uses the same one from its first
``import vllm`` on (issue 20 item 3). kvcached's own name resolution runs here (its ``utils.py``,
0.1.6, vendored) in separate processes, as an API server and an engine core of one container."""
from __future__ import annotations

import os
import subprocess
import sys

from deviceplugin.dra.cdi import claim_spec
from deviceplugin.dra.claims import ResolvedShare, Share
from deviceplugin.inventory_file import load
from deviceplugin.kubelet.allocator import Allocator
from deviceplugin.metrics import PluginMetrics
from deviceplugin.node_state import NodeState
from deviceplugin.quota_files import QuotaFiles
from tests.deviceplugin.conftest import MEM, MIXED
from tests.vllm_patches.kvcached_pool import HERE
from vramshare import contract
from vramshare.config import Config

KVCACHED_NAME = ("import sys; sys.path.insert(0, sys.argv[1]); "
                 "from kvcached.utils import DEFAULT_IPC_NAME; print(DEFAULT_IPC_NAME)")


def kvcached_name(env: dict[str, str], new_session: bool) -> str:
    """The segment name kvcached picks in a fresh process with the container's environment."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED")}
    out = subprocess.run([sys.executable, "-c", KVCACHED_NAME, HERE], env={**clean, **env},
                         capture_output=True, text=True, check=True, timeout=120,
                         start_new_session=new_session)
    return out.stdout.strip().splitlines()[-1]


def allocate(tmp_path, ids: list[str]) -> dict[str, str]:
    gpus = load(MIXED)
    config = Config(quota_host_dir=str(tmp_path / "q"))
    allocator = Allocator(NodeState(gpus, config), QuotaFiles(config.quota_host_dir, config.quota),
                          PluginMetrics(), "gpu-1", None)
    return dict(allocator.allocate(MEM, ids).envs)


def test_allocate_names_the_segment_once_for_every_engine_process(tmp_path) -> None:
    h100 = load(MIXED)[0].uuid
    ids = [contract.unit_device_id(h100, i) for i in range(2)]
    env = allocate(tmp_path, ids)
    name = env[contract.ENV_KVCACHED_IPC_NAME]
    assert name.startswith("vramshare_") and len(name) == len("vramshare_") + 16
    # process 0 and an engine core (its own session here: kvcached's default would differ)
    assert kvcached_name(env, new_session=False) == name == kvcached_name(env, new_session=True)
    # the same IDs again (a re-Allocate) keep the name; another allocation gets its own
    assert allocate(tmp_path, ids[::-1])[contract.ENV_KVCACHED_IPC_NAME] == name
    other = [contract.unit_device_id(h100, i) for i in range(2, 4)]
    assert allocate(tmp_path, other)[contract.ENV_KVCACHED_IPC_NAME] != name


def test_without_the_name_kvcached_processes_of_one_container_disagree() -> None:
    """Why the node agent sets it: kvcached's default follows the process group."""
    assert kvcached_name({}, new_session=False) != kvcached_name({}, new_session=True)


def test_a_dra_claim_names_the_segment_in_its_cdi_spec() -> None:
    share = ResolvedShare(Share("gpu", "gpu-1", "gpu-0", None, 4096), "GPU-a", "GPU-a")
    spec, _ = claim_spec("0b7e6d1c-1111-2222-3333-444455556666", [share], Config(), None)
    assert "KVCACHED_IPC_NAME=vramshare_0b7e6d1c11112222" in spec["containerEdits"]["env"]
