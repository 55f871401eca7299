"""The DRA plugin over a real GPU (NVML, read-only): the node's real GPUs as valid ResourceSlices and a
prepared claim whose CDI spec names the real GPU. Skipped with the reason where NVML does not start."""
from __future__ import annotations

import kubernetes_validate
import pytest

from deviceplugin import devices
from deviceplugin.backend import BackendError
from deviceplugin.dra import slices
from deviceplugin.nvml_backend import NvmlBackend
from standins import cdi_registry
from tests.dra.conftest import NODE, dra_config
from tests.dra.test_preparer import Claims, claim, ref, share
from vramshare import contract

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def discovered():
    backend = NvmlBackend()
    try:
        gpus = backend.discover()
    except BackendError as exc:
        pytest.skip(f"no usable NVIDIA GPU here: {exc}")
    backend.close()
    return gpus


def test_real_gpus_publish_valid_slices_and_prepare(discovered, tmp_path):
    from deviceplugin.dra.preparer import ClaimPreparer
    config = dra_config(tmp_path)
    inv = devices.build_inventory(discovered, config, dra=True)
    devs = slices.desired_devices(inv, config.names, NODE, taints=False)
    assert devs, "NVML reports GPUs but none is published"
    for obj in slices.resource_slices(NODE, None, devs, 1, config.names):
        for version in ("1.36", "1.37"):
            kubernetes_validate.validate(obj, version, strict=True)
    shared = [d for d in devs if d.get("allowMultipleAllocations")]
    if not shared:
        pytest.skip("no GPU in shared mode on this node")
    claims = Claims()
    c = claims.add(claim("uid-real", [share(shared[0]["name"], "1Gi")]))
    p = ClaimPreparer(NODE, lambda: config, lambda: slices.device_index(inv), claims)
    result = p.prepare(ref(c))
    assert result.error == ""
    env = cdi_registry.Registry([config.dra.cdi_root]).inject(result.devices[0].cdi_ids).env
    assert env[contract.ENV_VISIBLE_DEVICES] == shared[0]["attributes"]["uuid"]["string"]
    assert p.unprepare(ref(c)) == ""
