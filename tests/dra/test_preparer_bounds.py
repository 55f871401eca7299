"""Issue 17 item 11: sizes and names in a ResourceClaim come from another process and are bounded
where they enter Prepare: no share past its GPU, no quota path outside the quota root, and Unprepare
never removes anything outside its roots."""
from __future__ import annotations

import dataclasses
import os

import pytest

from deviceplugin.dra.checkpoint import Checkpoint
from deviceplugin.quota import writer
from tests.dra.test_preparer import Claims, claim, files_under, make, ref, share

GPU0_MIB = 79 * 1024  # the demo's shared H100: 79 whole units of 1 GiB


@pytest.mark.parametrize("results, why", [
    ([share("gpu-0", "1000Gi")], "consumes 1024000 MiB, more than its 80896 MiB"),
    ([share("gpu-0", "1e30")], "more than its 80896 MiB"),
    ([share("gpu-0", "60Gi", "s1"), share("gpu-0", "60Gi", "s2")], "add up to 122880 MiB, more than its 80896 MiB"),
    ([{"request": "whole", "driver": "gpu.vramshare.io", "pool": "gpu-node-1", "device": "gpu-1"}] * 2,
     "add up to"),  # one exclusive GPU given twice
])
def test_a_claim_larger_than_its_gpu_is_refused_with_the_reason(tmp_path, results, why):
    claims = Claims()
    c = claims.add(claim("uid-big", results))
    p = make(tmp_path, claims)
    result = p.prepare(ref(c))
    assert result.devices == () and why in result.error
    assert files_under(tmp_path / "quota", tmp_path / "cdi") == set()  # no quota file, no CDI spec
    assert "uid-big" not in p.prepared()


def test_claims_never_add_up_past_a_gpu_across_claims(tmp_path):
    """Also the node's answer to kubernetes/kubernetes#141471: a force-deleted pod's claim is deallocated in
    the API before the kubelet unprepares it (its containers may still run), and its replacement's claim is
    allocated the same memory at once. Prepare refuses the replacement until the first is unprepared (the
    kubelet retries Prepare; the pod waits in ContainerCreating), so the memory is never prepared twice."""
    claims = Claims()
    a = claims.add(claim("uid-a", [share("gpu-0", "60Gi")], pod="pod-a"))
    b = claims.add(claim("uid-b", [share("gpu-0", "60Gi")], pod="pod-b"))
    p = make(tmp_path, claims)
    assert p.prepare(ref(a)).error == ""
    refused = p.prepare(ref(b))
    assert "61440 MiB on GPU" in refused.error and "61440 MiB already prepared" in refused.error
    assert p.prepare(ref(a)).error == ""  # a claim never counts against itself (the kubelet repeats)
    assert p.unprepare(ref(a)) == "" and p.prepare(ref(b)).error == ""


@pytest.mark.parametrize("uid", ["../../..", "..", "/etc", "", "a/b", ".hidden", "x" * 300])
def test_a_reserved_for_uid_never_leaves_the_quota_root(tmp_path, uid):
    claims = Claims()
    c = claims.add(claim("uid-x", [share("gpu-0", "10Gi")], pod=uid))
    p = make(tmp_path, claims)
    result = p.prepare(ref(c))
    assert "status.reservedFor[].uid" in result.error and result.devices == ()
    assert [f for f in files_under(tmp_path) if f.endswith("quota.json")] == []


def test_unprepare_never_removes_anything_outside_its_roots(tmp_path):
    """A checkpoint entry (a host file) naming paths outside the quota and CDI roots: the entry goes,
    the paths stay."""
    claims = Claims()
    c = claims.add(claim("uid-a", [share("gpu-0", "10Gi")]))
    p = make(tmp_path, claims)
    assert p.prepare(ref(c)).error == ""
    victim = tmp_path / "precious"
    victim.mkdir()
    (victim / "quota.json").write_text("{}")
    spec = tmp_path / "elsewhere.json"
    spec.write_text("{}")
    record = p.prepared()["uid-a"]
    p.checkpoint = Checkpoint({"uid-a": dataclasses.replace(
        record, quota_dir=str(tmp_path / "quota" / ".." / "precious"), cdi_spec=str(spec))})
    assert p.unprepare(ref(c)) == ""
    assert (victim / "quota.json").exists() and spec.exists()
    assert "uid-a" not in p.prepared()


@pytest.mark.parametrize("bad", ["..", ".", "/abs", "", "a/b", "a\x00b", "-x" * 200])
def test_container_dir_takes_one_safe_component_each(bad):
    with pytest.raises(writer.UnsafePathError):
        writer.container_dir("/q", bad, "c")
    with pytest.raises(writer.UnsafePathError):
        writer.container_dir("/q", "uid", bad)
    assert writer.container_dir("/q", "0b7e2c4e-1111-2222-3333-444455556666", "vllm") == \
        "/q/0b7e2c4e-1111-2222-3333-444455556666/vllm"


def test_inside_resolves_parents_but_not_the_last_component(tmp_path):
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    (tmp_path / "out").mkdir()
    os.symlink(tmp_path / "out", root / "link")
    assert writer.inside(str(root), str(root / "a"), follow_last=False)
    assert writer.inside(str(root), str(root / "link"), follow_last=False)  # removing the link is safe
    assert not writer.inside(str(root), str(root / "link"))  # writing through it is not
    assert not writer.inside(str(root), str(root / "link" / "x"), follow_last=False)  # nor through it
    assert not writer.inside(str(root), str(root / ".." / "out"), follow_last=False)
    assert not writer.inside(str(root), str(root), follow_last=False)


def test_a_claim_placed_on_the_sleepers_credit_is_prepared_counting_them_at_their_booked_size(tmp_path):
    """Issue 23 item 5 on DRA: two 30 GiB claims sleep, their class books them at 25% (7,680 MiB) and
    keeps room for one wake, so the slice offered a 23,040 MiB credit and the scheduler placed a 40 GiB
    claim beside them. Prepare counted every claim at its grant (100 GiB on a 79 GiB GPU) and refused
    it; counting the sleepers at their booked size it fits, and it still does once one of them woke
    (the wake reserve). Nothing more is placed beside them then."""
    claims = Claims()
    sleepers = [claims.add(claim(f"uid-{n}", [share("gpu-0", "30Gi", f"s{n}")], name=f"sleeper-{n}", pod=f"pod-{n}"))
                for n in (1, 2)]
    b = claims.add(claim("uid-b", [share("gpu-0", "40Gi", "sb")], name="newcomer", pod="pod-b"))
    p = make(tmp_path, claims)
    assert all(p.prepare(ref(c)).error == "" for c in sleepers)
    assert "already prepared" in p.prepare(ref(b)).error  # nobody sleeps: the grants add up past the GPU
    [uuid] = p.prepared()["uid-1"].gpus
    p.sleeping = lambda: {("default", f"claim-sleeper-{n}", uuid): 7680 for n in (1, 2)}
    assert p.prepare(ref(b)).error == ""
    p.sleeping = lambda: {("default", "claim-sleeper-2", uuid): 7680}  # sleeper-1 woke
    c = claims.add(claim("uid-c", [share("gpu-0", "4Gi", "sc")], name="late", pod="pod-c"))
    assert "already prepared" in p.prepare(ref(c)).error
    assert p.unprepare(ref(b)) == "" and p.prepare(ref(b)).error == ""  # 30 + 7.5 + 40 GiB still fit
