"""The atomic quota.json writer: format, monotonic generation, no torn or stray files."""
from __future__ import annotations

import json
import re
import os
import stat

import pytest

from deviceplugin.quota.writer import (GpuQuota, QuotaFile, QuotaFileError, container_dir, parse_quota,
                                       read_quota, write_quota)

Q = QuotaFile(gpus=(GpuQuota("GPU-a", 20480, 10240, 30720),))


def test_writes_the_contract_format(tmp_path):
    written = write_quota(tmp_path, QuotaFile(gpus=Q.gpus, updated="2026-11-29T09:00:00Z"))
    doc = json.loads((tmp_path / "quota.json").read_text())
    assert doc == {"generation": 1, "updated": "2026-11-29T09:00:00Z",
                   "gpus": [{"uuid": "GPU-a", "limitMiB": 20480, "floorMiB": 10240, "ceilingMiB": 30720}]}
    assert written.generation == 1
    assert stat.S_IMODE(os.stat(tmp_path / "quota.json").st_mode) == 0o644


def test_generation_grows_with_every_write_even_when_asked_for_less(tmp_path):
    gens = [write_quota(tmp_path, Q).generation for _ in range(3)]
    assert gens == [1, 2, 3]
    assert write_quota(tmp_path, QuotaFile(gpus=Q.gpus, generation=2)).generation == 4
    assert write_quota(tmp_path, QuotaFile(gpus=Q.gpus, generation=10)).generation == 10
    assert read_quota(tmp_path).generation == 10


def test_updated_defaults_to_utc_now(tmp_path):
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", write_quota(tmp_path, Q).updated)


def test_a_quota_outside_its_bounds_never_reaches_the_disk(tmp_path):
    with pytest.raises(ValueError, match="GPU-a"):
        write_quota(tmp_path, QuotaFile(gpus=(GpuQuota("GPU-a", 9000, 10240, 30720),)))
    assert read_quota(tmp_path) is None


def test_no_temporary_files_are_left_behind(tmp_path):
    for _ in range(3):
        write_quota(tmp_path, Q)
    assert sorted(os.listdir(tmp_path)) == ["quota.json"]


def test_creates_the_container_directory(tmp_path):
    d = container_dir(str(tmp_path), "uid-1", "vllm")
    write_quota(d, Q)
    assert read_quota(d).limits() == {"GPU-a": 20480}


def test_a_corrupt_file_is_replaced_with_a_fresh_generation(tmp_path):
    (tmp_path / "quota.json").write_text("{not json")
    assert write_quota(tmp_path, Q).generation == 1
    assert read_quota(tmp_path).gpus == Q.gpus


def test_read_quota_missing_is_none_and_bad_fields_are_named(tmp_path):
    assert read_quota(tmp_path) is None
    with pytest.raises(QuotaFileError, match="limitMiB"):
        parse_quota('{"generation": 1, "updated": 0, "gpus": [{"uuid": "x"}]}')


def test_unwritable_directory_raises_oserror(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError):
        write_quota(blocker / "sub", Q)


@pytest.mark.parametrize("bad", ["", ".", "..", "../x", "/abs", "a/b", "a\0b", "x" * 254, None, 7])
def test_safe_component_refuses_what_would_leave_its_directory(bad):
    """Issue 17 item 11: pod UIDs, container and claim names never climb out of the quota root."""
    from deviceplugin.quota.writer import UnsafePathError, container_dir, safe_component
    with pytest.raises(UnsafePathError):
        safe_component(bad, "pod UID")
    if isinstance(bad, str):
        with pytest.raises(UnsafePathError):
            container_dir("/q", bad, "c")


def test_safe_component_keeps_uids_and_names():
    from deviceplugin.quota.writer import container_dir, safe_component
    assert safe_component("0f8e3a52-1b7c-4c1e-9d2a-5b0e6c7d8e9f", "pod UID") == "0f8e3a52-1b7c-4c1e-9d2a-5b0e6c7d8e9f"
    assert container_dir("/q", "uid-1", "claim-gpu") == "/q/uid-1/claim-gpu"
