"""With deviceListStrategy cdi-cri the plugin says at start which GPUs' CDI names no spec defines."""
from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import yaml

from deviceplugin.kubelet import cdi_names
from deviceplugin.kubelet.main import DevicePluginDaemon
from deviceplugin.simulated_backend import SimulatedBackend
from vramshare.config import Config, DeviceListStrategy


def _spec(kind, *names):
    return {"cdiVersion": "0.5.0", "kind": kind, "devices": [{"name": n, "containerEdits": {}} for n in names]}


def test_missing_names_the_gpus_no_spec_defines():
    specs = [_spec("nvidia.com/gpu", "0", "1", "GPU-a"), _spec("other.com/x", "GPU-b"), "junk", {"kind": 3}]
    assert cdi_names.missing(["nvidia.com/gpu=GPU-a", "nvidia.com/gpu=GPU-b"], specs) == ["nvidia.com/gpu=GPU-b"]


def test_read_specs_reads_json_and_yaml_and_reports_broken_files(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(_spec("nvidia.com/gpu", "GPU-a")))
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(_spec("nvidia.com/gpu", "GPU-b")))
    (tmp_path / "c.json").write_text("{not json")
    (tmp_path / "notes.txt").write_text("ignored")
    docs, problems = cdi_names.read_specs([str(tmp_path), str(tmp_path / "absent")])
    assert cdi_names.defined_names(docs) == {"nvidia.com/gpu=GPU-a", "nvidia.com/gpu=GPU-b"}
    assert len(problems) == 1 and "c.json" in problems[0]


@pytest.mark.parametrize("named_by_uuid", [False, True])
def test_the_daemon_logs_the_missing_names_at_start(tmp_path, caplog, named_by_uuid):
    backend = SimulatedBackend.demo()
    config = dataclasses.replace(Config(), device_list_strategy=DeviceListStrategy.CDI_CRI)
    daemon_probe = DevicePluginDaemon(backend, config, str(tmp_path / "probe"), cdi_roots=())
    uuids = [u for g in daemon_probe.state.snapshot.inventory.gpus for u in ([m.uuid for m in g.mig] or [g.uuid])]
    names = uuids if named_by_uuid else [str(i) for i in range(len(uuids))]  # nvidia-ctk's default: index
    (tmp_path / "nvidia.json").write_text(json.dumps(_spec("nvidia.com/gpu", *names)))
    daemon = DevicePluginDaemon(backend, config, str(tmp_path / "plugins"), cdi_roots=(str(tmp_path),))
    with caplog.at_level(logging.INFO):
        daemon._check_cdi_names()
    said = {r.getMessage(): getattr(r, "fields", {}) for r in caplog.records}
    if named_by_uuid:
        assert "CDI device names resolve" in said and not any("do not resolve" in m for m in said)
    else:
        (fields,) = [f for m, f in said.items() if "do not resolve" in m]
        assert fields["missing"].split(",") == [f"nvidia.com/gpu={u}" for u in uuids]
        assert "--device-name-strategy=uuid" in fields["fix"]
