"""Quota parsing, GPU selection and the last-good-quota rule (pure core, no vLLM)."""
from __future__ import annotations

import json
import os

import pytest

from vllm_patches.quota import (GpuQuota, QuotaError, env_limit_mib, gpu_uuid_for_rank, parse_quota,
                                quota_path, select_gpu)
from vllm_patches.settings import from_env
from vllm_patches.watcher import QuotaTracker, QuotaWatcher


def doc(*gpus: dict, generation: int = 1) -> str:
    return json.dumps({"generation": generation, "updated": "2026-11-29T09:00:00Z", "gpus": list(gpus)})


GPU_A = {"uuid": "GPU-a", "limitMiB": 8192, "floorMiB": 4096, "ceilingMiB": 16384}
GPU_B = {"uuid": "GPU-b", "limitMiB": 2048}


def test_parse_full_document() -> None:
    parsed = parse_quota(doc(GPU_A, GPU_B, generation=7))
    assert parsed.generation == 7
    assert parsed.gpus == (GpuQuota("GPU-a", 8192, 4096, 16384), GpuQuota("GPU-b", 2048, 0, 0))


@pytest.mark.parametrize("text", [
    "", "{", "[]", "null", '{"gpus": []}', '{"gpus": {}}', '{"gpus": [1]}',
    doc({"uuid": "GPU-a"}),
    doc({"uuid": "GPU-a", "limitMiB": -1}),
    doc({"uuid": "GPU-a", "limitMiB": "8192"}),
    doc({"uuid": "GPU-a", "limitMiB": True}),
    doc({"uuid": 5, "limitMiB": 10}),
    doc({"uuid": "GPU-a", "limitMiB": 100, "floorMiB": 200}),
    doc({"uuid": "GPU-a", "limitMiB": 300, "ceilingMiB": 200}),
    json.dumps({"generation": "x", "gpus": [GPU_B]}),
    b"\xff\xfe",
])
def test_malformed_documents_raise(text: str | bytes) -> None:
    with pytest.raises(QuotaError):
        parse_quota(text)


def test_select_by_uuid_then_index() -> None:
    parsed = parse_quota(doc(GPU_A, GPU_B))
    assert select_gpu(parsed, "GPU-b").limit_mib == 2048
    assert select_gpu(parsed, "GPU-zzz") is None
    assert select_gpu(parsed, None, 1).uuid == "GPU-b"
    assert select_gpu(parsed, None, 2) is None


def test_env_helpers() -> None:
    assert env_limit_mib({}) is None
    assert env_limit_mib({"VRAMSHARE_MEMORY_LIMIT_MIB": " 20480 "}) == 20480
    for bad in ("abc", "0", "-5"):
        with pytest.raises(QuotaError):
            env_limit_mib({"VRAMSHARE_MEMORY_LIMIT_MIB": bad})
    assert gpu_uuid_for_rank({"VRAMSHARE_GPU_UUIDS": "GPU-a, GPU-b"}, 1) == "GPU-b"
    assert gpu_uuid_for_rank({}, 0) is None
    assert quota_path({}) == "/var/run/vramshare/quota.json"
    assert quota_path({"VRAMSHARE_QUOTA_FILE": "/x/q.json"}) == "/x/q.json"


def test_tracker_keeps_last_good_quota() -> None:
    tracker = QuotaTracker(start_limit_mib=4096, uuid="GPU-a")
    assert tracker.update(doc(GPU_A)) == 8192
    assert tracker.update(doc(GPU_A)) is None  # unchanged
    assert tracker.update('{"gpus": [{"uuid": "GPU-a", "limitMiB": ') is None  # half written
    assert tracker.update(doc(GPU_B)) is None  # no entry for this GPU
    assert tracker.limit_mib == 8192 and tracker.errors == 2
    assert tracker.update(doc({**GPU_A, "limitMiB": 6000})) == 6000


def write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def test_watcher_follows_the_file(tmp_path) -> None:
    path = str(tmp_path / "quota.json")
    seen: list[int] = []
    watcher = QuotaWatcher(path, QuotaTracker(1000, None), seen.append)
    assert watcher.poll_once() is None  # no file yet: keep the env limit
    write_atomic(path, doc({"uuid": "", "limitMiB": 900}))
    assert watcher.poll_once() == 900
    assert watcher.poll_once() is None  # same stamp, not re-read
    with open(path, "w") as fh:  # a broken in-place write
        fh.write("{not json")
    assert watcher.poll_once() is None
    write_atomic(path, doc({"uuid": "", "limitMiB": 1200}))
    assert watcher.poll_once() == 1200
    assert seen == [900, 1200]


def test_settings_only_with_a_quota(tmp_path) -> None:
    path = str(tmp_path / "quota.json")
    assert from_env({"VRAMSHARE_QUOTA_FILE": path}) is None
    s = from_env({"VRAMSHARE_QUOTA_FILE": path, "VRAMSHARE_MEMORY_LIMIT_MIB": "512"})
    assert s is not None and s.current_limit_mib() == 512
    write_atomic(path, doc({"uuid": "", "limitMiB": 300}))
    s = from_env({"VRAMSHARE_QUOTA_FILE": path})
    assert s is not None and s.env_limit_mib is None and s.current_limit_mib() == 300


def _warnings(caplog: pytest.LogCaptureFixture) -> list[tuple[str, dict]]:
    return [(r.getMessage(), getattr(r, "fields", {})) for r in caplog.records
            if r.levelname == "WARNING"]


def test_runtime_quota_errors_are_logged_with_their_reason(tmp_path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """Bad JSON and a deleted file keep the last good quota and say why, a deletion once."""
    path = tmp_path / "quota.json"
    path.write_text(doc({"uuid": "", "limitMiB": 512}))
    seen: list[int] = []
    watcher = QuotaWatcher(str(path), QuotaTracker(None, None), seen.append)
    assert watcher.poll_once() == 512
    caplog.set_level("INFO", logger="vllm_patches")
    path.write_text('{"gpus": [')
    assert watcher.poll_once() is None
    (event, fields), = _warnings(caplog)
    assert "keeping last good quota" in event and "not JSON" in fields["reason"]
    assert fields["limit_mib"] == 512
    caplog.clear()
    os.unlink(path)
    assert watcher.poll_once() is None and watcher.poll_once() is None
    (event, fields), = _warnings(caplog)  # once per disappearance, not once a poll
    assert "keeping last good quota" in event and fields["path"] == str(path)
    assert fields["reason"] == "No such file or directory" and fields["limit_mib"] == 512
    path.write_text(doc({"uuid": "", "limitMiB": 256}))
    assert watcher.poll_once() == 256 and seen == [512, 256]
    assert any(r.getMessage() == "quota file back" for r in caplog.records)
