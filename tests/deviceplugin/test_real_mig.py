"""Dynamic MIG's NVML reads on a real GPU: profiles, placements and existing instances, read only.

It never enables or disables MIG mode and never creates or destroys an instance (the lent test machine
forbids both, and a node agent must not do either on a GPU it does not own). On a GPU whose model
:mod:`vramshare.mig` knows, the driver's table must be ours: same profiles, same placements. Run with
``pytest -s -m gpu tests/deviceplugin/test_real_mig.py`` to see what the driver reports.
"""
from __future__ import annotations

import pytest

from deviceplugin.backend import BackendError
from deviceplugin.mig_nvml import MigNvmlError, NvmlMig
from deviceplugin.nvml_backend import NvmlBackend
from vramshare import mig

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def devices():
    backend = NvmlBackend()
    try:
        found = backend.devices()
    except BackendError as exc:
        pytest.skip(f"no usable NVIDIA GPU here: {exc}")
    yield backend, found
    backend.close()


def test_profiles_and_placements_match_the_tables(devices):
    backend, found = devices
    reader = NvmlMig(backend.nvml, backend.call)
    for gpu, handle in found:
        try:
            profiles = reader.profiles(handle, gpu.memory_mib)
        except MigNvmlError as exc:
            print(f"\n  [{gpu.index}] {gpu.model}: MIG profiles unreadable: {exc}")
            continue
        print(f"\n  [{gpu.index}] {gpu.model} ({gpu.memory_mib} MiB), MIG {'on' if gpu.mig_enabled else 'off'}:")
        for p in profiles:
            print(f"    {p.name:12} id {p.profile_id:2} slices {p.slices} count {p.instance_count} "
                  f"{p.memory_mib} MiB placements {[s for s, _ in p.placements]}:{p.placements[0][1] if p.placements else '-'}")
        model = mig.model_for(gpu.model, gpu.memory_mib)
        if model is None or not profiles:
            continue
        ours = {p.name: (p.profile_id, p.compute_slices, p.max_count, p.starts, p.memory_slots) for p in model.profiles}
        for p in profiles:
            if p.name in ours and p.placements:
                assert (p.profile_id, p.slices, p.instance_count, tuple(s for s, _ in p.placements),
                        p.placements[0][1]) == ours[p.name], p.name
        if gpu.mig_enabled:
            for inst in reader.instances(handle, profiles):
                print(f"    instance GI {inst.gi} profile id {inst.profile_id} at {inst.start}:{inst.size} "
                      f"CIs {list(inst.cis)} {inst.mig_uuid or ''}{' (busy)' if inst.busy else ''}")
