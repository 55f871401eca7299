"""Prepare/Unprepare: CDI specs that resolve, idempotence, restart mid-prepare, exact removal."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from deviceplugin import devices
from deviceplugin.dra import cdi, slices
from deviceplugin.dra.checkpoint import PREPARED, PREPARING, Checkpoint, CheckpointError, PreparedClaim
from deviceplugin.dra.claims import ClaimRef
from deviceplugin.dra.preparer import ClaimPreparer, FileEffects
from deviceplugin.simulated_backend import SimulatedBackend
from standins import cdi_registry
from tests.dra.conftest import NODE, dra_config
from vramshare import contract

DRIVER = "gpu.vramshare.io"


def claim(uid: str, results: list[dict], name: str | None = None, pod: str = "pod-uid-1") -> dict:
    return {"metadata": {"namespace": "default", "name": name or f"claim-{uid}", "uid": uid},
            "status": {"allocation": {"devices": {"results": results}},
                       "reservedFor": [{"resource": "pods", "name": "p", "uid": pod}]}}


def share(device: str, mem: str = "22Gi", share_id: str = "1b4e28ba-2fa1-11d2-883f-0016d3cca427",
          request: str = "gpu") -> dict:
    return {"request": request, "driver": DRIVER, "pool": NODE, "device": device, "shareID": share_id,
            "consumedCapacity": {"memory": mem}}


class Claims:
    """The API server's claims, as the preparer reads them (a dict; LookupError when absent)."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict] = {}
        self.reads = 0

    def add(self, c: dict) -> dict:
        self.objects[(c["metadata"]["namespace"], c["metadata"]["name"])] = c
        return c

    def __call__(self, namespace: str, name: str) -> dict:
        self.reads += 1
        if (namespace, name) not in self.objects:
            raise LookupError("404 Not Found")
        return self.objects[(namespace, name)]


class Crash(Exception):
    pass


class CrashingEffects(FileEffects):
    """The file-system edge, dying at the n-th effect (as a SIGKILL between two writes would)."""

    def __init__(self, at: int | None) -> None:
        self.at, self.count = at, 0

    def _step(self) -> None:
        self.count += 1
        if self.at is not None and self.count == self.at:
            raise Crash(f"killed at effect {self.at}")

    def write_file(self, path, data):
        self._step()
        super().write_file(path, data)

    def remove_file(self, path):
        self._step()
        super().remove_file(path)

    def write_quota(self, directory, shares, config):
        self._step()
        super().write_quota(directory, shares, config)

    def remove_dir(self, path):
        self._step()
        super().remove_dir(path)


def make(tmp_path, claims: Claims, effects=None, unhealthy=frozenset(), **dra) -> ClaimPreparer:
    config = dra_config(tmp_path, **dra)
    inv = devices.build_inventory(SimulatedBackend.demo().discover(), config, unhealthy, dra=True)
    return ClaimPreparer(NODE, lambda: config, lambda: slices.device_index(inv), claims, effects)


def files_under(*roots) -> set[str]:
    out = set()
    for root in roots:
        for d, _, names in os.walk(root):
            out.update(os.path.join(d, n) for n in names)
    return out


def ref(c: dict) -> ClaimRef:
    m = c["metadata"]
    return ClaimRef(m["namespace"], m["name"], m["uid"])


def test_prepare_writes_a_valid_cdi_spec_whose_names_resolve(tmp_path):
    claims = Claims()
    c = claims.add(claim("uid-a", [share("gpu-0", "22Gi")]))
    p = make(tmp_path, claims)
    result = p.prepare(ref(c))
    assert result.error == ""
    [dev] = result.devices
    assert (dev.pool, dev.device, dev.request_names) == (NODE, "gpu-0", ("gpu",))
    assert dev.cdi_ids == ("vramshare.io/gpu=uid-a-0",)
    registry = cdi_registry.Registry([str(tmp_path / "cdi")])
    assert registry.errors == {}
    injected = registry.inject(dev.cdi_ids)
    gpu0 = SimulatedBackend.demo().discover()[0].uuid
    assert injected.env[contract.ENV_VISIBLE_DEVICES] == gpu0
    assert injected.env[contract.ENV_GPU_UUIDS] == gpu0
    assert injected.env[contract.ENV_MEMORY_LIMIT_MIB] == str(22 * 1024)
    assert injected.env[contract.ENV_QUOTA_FILE] == "/var/run/vramshare/quota.json"
    [mount] = injected.mounts
    assert mount["containerPath"] == contract.CONTAINER_QUOTA_DIR and "ro" in mount["options"]
    # a claim of one pod: the quota loop's layout <root>/<pod-uid>/claim-<claim name>, mounted by CDI
    quota_dir = tmp_path / "quota" / "pod-uid-1" / "claim-claim-uid-a"
    assert mount["hostPath"] == str(quota_dir)
    quota = json.loads((quota_dir / "quota.json").read_text())
    assert quota["gpus"][0]["uuid"] == gpu0 and quota["gpus"][0]["limitMiB"] == 22 * 1024
    assert p.prepared()["uid-a"].pod_uids == ("pod-uid-1",)


def test_two_gpus_one_claim_and_whole_devices(tmp_path):
    claims = Claims()
    gpus = SimulatedBackend.demo().discover()
    c = claims.add(claim("uid-tp", [share("gpu-0", "48Gi", "s1"), share("gpu-2", "48Gi", "s2"),
                                    {"request": "whole", "driver": DRIVER, "pool": NODE, "device": "gpu-1"}]))
    result = make(tmp_path, claims).prepare(ref(c))
    assert result.error == "" and len(result.devices) == 3
    env = cdi_registry.Registry([str(tmp_path / "cdi")]).inject(
        [i for d in result.devices for i in d.cdi_ids]).env
    assert env[contract.ENV_GPU_UUIDS] == ",".join([gpus[0].uuid, gpus[2].uuid, gpus[1].uuid])
    assert env[contract.ENV_MEMORY_LIMIT_MIB] == f"{48 * 1024},{48 * 1024},{gpus[1].memory_mib}"
    assert env["VRAMSHARE_DRA_SHARE_0"].startswith(f"{NODE}/gpu-0:{gpus[0].uuid}:49152:s1")


def test_results_of_other_drivers_and_pools_are_not_ours(tmp_path):
    claims = Claims()
    c = claims.add(claim("uid-o", [dict(share("gpu-0"), driver="gpu.nvidia.com"), dict(share("gpu-0"), pool="other")]))
    result = make(tmp_path, claims).prepare(ref(c))
    assert result == type(result)(devices=(), error="")
    assert files_under(tmp_path / "cdi") == set()


@pytest.mark.parametrize("results, why", [
    ([share("gpu-9")], "not a device of this node"),
    ([dict(share("gpu-0"), shareID=None)], "without shareID"),
    ([share("gpu-0", "lots")], "not a quantity"),
])
def test_bad_allocations_are_refused_with_a_reason_and_write_nothing(tmp_path, results, why):
    claims = Claims()
    c = claims.add(claim("uid-bad", results))
    result = make(tmp_path, claims).prepare(ref(c))
    assert why in result.error and result.devices == ()
    assert files_under(tmp_path / "cdi", tmp_path / "quota") == set()


def test_unhealthy_device_and_recreated_claim_are_refused(tmp_path):
    claims = Claims()
    gpu0 = SimulatedBackend.demo().discover()[0].uuid
    c = claims.add(claim("uid-u", [share("gpu-0")]))
    assert "unhealthy" in make(tmp_path, claims, unhealthy=frozenset({gpu0})).prepare(ref(c)).error
    stale = ClaimRef("default", "claim-uid-u", "uid-older")
    assert "recreated" in make(tmp_path / "2", claims).prepare(stale).error
    assert "cannot read" in make(tmp_path / "3", claims).prepare(ClaimRef("default", "nope", "x")).error


def test_prepare_is_idempotent_and_survives_a_restart_without_rereading(tmp_path):
    claims = Claims()
    c = claims.add(claim("uid-i", [share("gpu-0")]))
    first = make(tmp_path, claims).prepare(ref(c))
    reads = claims.reads
    again = make(tmp_path, claims)  # a restarted plugin: the checkpoint answers
    assert again.prepare(ref(c)) == first and again.prepare(ref(c)) == first
    assert claims.reads == reads
    assert len(files_under(tmp_path / "cdi")) == 1


def test_unprepare_removes_exactly_what_prepare_made(tmp_path):
    claims = Claims()
    (tmp_path / "cdi").mkdir()
    foreign = tmp_path / "cdi" / "nvidia.com-gpu.json"
    foreign.write_text("{}")
    before = files_under(tmp_path)
    a = claims.add(claim("uid-1", [share("gpu-0", "8Gi")]))
    b = claims.add(claim("uid-2", [share("gpu-0", "8Gi", "other-share")]))
    p = make(tmp_path, claims)
    p.prepare(ref(a))
    p.prepare(ref(b))
    assert p.unprepare(ref(a)) == ""
    registry = cdi_registry.Registry([str(tmp_path / "cdi")])
    assert "vramshare.io/gpu=uid-2-0" in registry.devices and "vramshare.io/gpu=uid-1-0" not in registry.devices
    assert p.unprepare(ref(b)) == "" and p.unprepare(ref(b)) == ""  # twice: already done
    after = files_under(tmp_path) - {os.path.join(tmp_path, "state", "prepared-claims.json")}
    assert after == before and foreign.exists()
    assert not os.path.exists(tmp_path / "quota" / "pod-uid-1" / "claim-claim-uid-1")


@pytest.mark.parametrize("crash_at", [1, 2, 3, 4])
def test_a_restart_at_any_step_of_prepare_neither_loses_nor_doubles(tmp_path, crash_at):
    """Effects of a prepare: 1 checkpoint(preparing), 2 quota file, 3 CDI spec, 4 checkpoint(prepared)."""
    claims = Claims()
    c = claims.add(claim("uid-r", [share("gpu-0")]))
    with pytest.raises(Crash):
        make(tmp_path, claims, CrashingEffects(crash_at)).prepare(ref(c))
    restarted = make(tmp_path, claims)
    state = restarted.prepared().get("uid-r")
    assert (state is None) == (crash_at == 1) and (state is None or state.state == PREPARING)
    result = restarted.prepare(ref(c))  # the kubelet retries the claim
    assert result.error == "" and restarted.prepared()["uid-r"].state == PREPARED
    assert len(files_under(tmp_path / "cdi")) == 1 and len(files_under(tmp_path / "quota")) == 1
    assert restarted.unprepare(ref(c)) == ""
    assert files_under(tmp_path / "cdi", tmp_path / "quota") == set()


@pytest.mark.parametrize("crash_at", [1, 2, 3, 4])
def test_a_restart_during_unprepare_finishes_on_the_retry(tmp_path, crash_at):
    claims = Claims()
    c = claims.add(claim("uid-x", [share("gpu-0")]))
    make(tmp_path, claims).prepare(ref(c))
    with pytest.raises(Crash):
        make(tmp_path, claims, CrashingEffects(crash_at)).unprepare(ref(c))
    restarted = make(tmp_path, claims)
    if crash_at > 1:  # died mid-removal: a repeated Prepare must rebuild, not answer from the checkpoint
        assert restarted.prepared()["uid-x"].state == PREPARING
        assert restarted.prepare(ref(c)).error == "" and len(files_under(tmp_path / "cdi")) == 1
    assert restarted.unprepare(ref(c)) == "" and restarted.prepared() == {}
    assert files_under(tmp_path / "cdi", tmp_path / "quota") == set()


OPS = st.lists(st.tuples(st.sampled_from(["prepare", "unprepare"]), st.integers(0, 3),
                         st.one_of(st.none(), st.integers(1, 4))), max_size=25)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(OPS)
def test_any_sequence_with_crashes_keeps_files_equal_to_the_checkpoint(tmp_path_factory, ops):
    """Whatever order and wherever the plugin dies, the files on disk are exactly the recorded ones,
    and after every claim is unprepared nothing of ours is left."""
    tmp = tmp_path_factory.mktemp("seq")
    claims = Claims()
    cs = [claims.add(claim(f"uid-{i}", [share(["gpu-0", "gpu-2"][i % 2], f"{i + 1}Gi", f"s{i}")])) for i in range(4)]
    prepared: set[str] = set()
    for op, i, crash in ops:
        p = make(tmp, claims, CrashingEffects(crash))
        try:
            if op == "prepare":
                assert p.prepare(ref(cs[i])).error == ""
                prepared.add(cs[i]["metadata"]["uid"])
            else:
                assert p.unprepare(ref(cs[i])) == ""
                prepared.discard(cs[i]["metadata"]["uid"])
        except Crash:
            pass
        fresh = make(tmp, claims)
        recorded = fresh.checkpoint
        on_disk = {f for f in files_under(tmp / "cdi")} | {os.path.dirname(f) for f in files_under(tmp / "quota")}
        assert on_disk <= recorded.paths(), "a file nobody will ever remove"
        done = {u for u, c in recorded.claims.items() if c.state == PREPARED}
        assert prepared <= set(recorded.claims), "a prepared claim was lost"
        for uid in done:  # what a repeated Prepare would answer from the checkpoint must exist
            assert os.path.exists(recorded.claims[uid].cdi_spec), f"{uid} recorded prepared, its CDI spec is gone"
            assert os.path.exists(os.path.join(recorded.claims[uid].quota_dir, "quota.json"))
    final = make(tmp, claims)
    for c in cs:
        assert final.unprepare(ref(c)) == ""
    assert files_under(tmp / "cdi", tmp / "quota") == set() and final.prepared() == {}


def test_checkpoint_round_trips_and_refuses_garbage(tmp_path):
    claims = Claims()
    c = claims.add(claim("uid-c", [share("gpu-0")]))
    p = make(tmp_path, claims)
    p.prepare(ref(c))
    assert Checkpoint.from_json(p.checkpoint.to_json()) == p.checkpoint
    (tmp_path / "state" / "prepared-claims.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        make(tmp_path, claims)


def test_cdi_device_names_follow_the_cdi_rules():
    assert cdi.device_name("0b7e2c4e-aaaa-bbbb-cccc-444455556666", 3) == "0b7e2c4e-aaaa-bbbb-cccc-444455556666-3"
    with pytest.raises(ValueError):
        cdi.device_name("bad/uid", 0)
    assert cdi.spec_file_name("vramshare.io/gpu", "u") == "vramshare.io-gpu_u.json"


def test_the_cdi_registry_standin_rejects_what_runtimes_reject(tmp_path):
    good = {"cdiVersion": "0.5.0", "kind": "vramshare.io/gpu",
            "devices": [{"name": "a", "containerEdits": {"env": ["A=1"]}}]}
    cdi_registry.validate_spec(good, "x")
    for bad in ({**good, "cdiVersion": "9.9.9"}, {**good, "kind": "nokind"},
                {**good, "devices": [{"name": "a", "containerEdits": {}}]},
                {**good, "devices": [{"name": "-a", "containerEdits": {"env": ["A=1"]}}]},
                {**good, "devices": [{"name": "a", "containerEdits": {"env": ["no equals"]}}]}):
        with pytest.raises(cdi_registry.CdiError):
            cdi_registry.validate_spec(bad, "x")
    (tmp_path / "one.json").write_text(json.dumps(good))
    (tmp_path / "two.json").write_text(json.dumps(good))
    registry = cdi_registry.Registry([str(tmp_path)])
    with pytest.raises(cdi_registry.CdiError, match="more than one spec"):
        registry.inject(["vramshare.io/gpu=a"])


def test_the_quota_loop_rewrites_the_file_a_prepared_claim_mounts(tmp_path):
    """Tenants come from prepared claims (pod from reservedFor); the loop moves memory between them
    and writes exactly the file the claim's CDI spec mounts into the container."""
    from deviceplugin.dra.tenants import tenants_from_claims
    from deviceplugin.quota.loop import LoopSettings, QuotaLoop
    from deviceplugin.quota.policy import PolicyParams
    from deviceplugin.quota.scrape import VllmSample
    from deviceplugin.quota.telemetry import UsageSample
    from deviceplugin.quota.writer import read_quota

    claims = Claims()
    hot = claims.add(claim("uid-hot", [share("gpu-0", "20Gi", "s1")], pod="pod-hot"))
    idle = claims.add(claim("uid-idle", [share("gpu-0", "20Gi", "s2")], pod="pod-idle"))
    shared_claim = claims.add(claim("uid-s", [share("gpu-2", "4Gi", "s3")], pod="pod-s"))
    shared_claim["status"]["reservedFor"].append({"resource": "pods", "name": "p2", "uid": "pod-s2"})
    p = make(tmp_path, claims)
    for c in (hot, idle, shared_claim):
        assert p.prepare(ref(c)).error == ""
    pods = [{"metadata": {"name": "p", "uid": "pod-hot", "annotations": {"prometheus.io/port": "8000"}},
             "status": {"podIP": "10.0.0.1"}},
            {"metadata": {"name": "pod-idle", "uid": "pod-idle"}},
            {"metadata": {"name": "p2", "uid": "pod-s2"}}]
    tenants = tenants_from_claims(p.prepared().values(), pods)
    assert [(t.key.pod_uid, t.key.container) for t in tenants] == [  # a claim of two pods is no tenant
        ("pod-hot", "claim-claim-uid-hot"), ("pod-idle", "claim-claim-uid-idle")]
    # a claim whose pod left the node's pods (deleted, or done) has departed: no tenant
    assert [t.key.pod_uid for t in tenants_from_claims(p.prepared().values(), pods[:1])] == ["pod-hot"]
    done = [pods[0], {"metadata": {"uid": "pod-idle"}, "status": {"phase": "Succeeded"}}]
    assert [t.key.pod_uid for t in tenants_from_claims(p.prepared().values(), done)] == ["pod-hot"]
    gpu0 = SimulatedBackend.demo().discover()[0].uuid
    assert tenants[0].gpus == ((gpu0, 20 * 1024),) and tenants[0].metrics_url == "http://10.0.0.1:8000/metrics"

    class Source:
        def list_tenants(self):
            return tenants_from_claims(p.prepared().values(), pods)

    class Usage:
        name = "fake"

        def read_usage(self):
            return [UsageSample(gpu0, 20000, pod_uid="pod-hot"), UsageSample(gpu0, 4000, pod_uid="pod-idle")]

    class Signals:
        def read_signals(self, url):
            return VllmSample(kv_usage=0.97, waiting=2, preemptions_total=5, release_mode="unmap")  # lendable

    mount = cdi_registry.Registry([str(tmp_path / "cdi")]).inject(
        list(p.prepared()["uid-hot"].devices[0].cdi_ids)).mounts[0]["hostPath"]
    before = read_quota(mount)
    loop = QuotaLoop(Source(), lambda: {gpu0: 40 * 1024}, [Usage()], PolicyParams(), str(tmp_path / "quota"),
                     signals=Signals(), settings=LoopSettings(PolicyParams(), startup_ticks=0))  # not newcomers
    for _ in range(3):
        loop.run_once()
    after = read_quota(mount)
    assert after.generation > before.generation and after.gpus[0].limit_mib > before.gpus[0].limit_mib


def test_after_a_reboot_emptied_the_cdi_root_prepare_rebuilds_the_spec(tmp_path):
    """/var/run/cdi is a tmpfs, the checkpoint is not: a repeated Prepare must not answer with names
    whose spec is gone."""
    import shutil
    claims = Claims()
    c = claims.add(claim("uid-boot", [share("gpu-0")]))
    first = make(tmp_path, claims).prepare(ref(c))
    shutil.rmtree(tmp_path / "cdi")
    again = make(tmp_path, claims).prepare(ref(c))
    assert again == first
    assert set(first.devices[0].cdi_ids) <= set(cdi_registry.Registry([str(tmp_path / "cdi")]).devices)


def test_the_checkpoint_s_per_pod_users_are_additive_and_an_older_checkpoint_still_loads():
    """``podUsers`` (how many containers of each pod Prepare counted for the CDI share) came after v1's
    first release: written only when counted, read back equal; a checkpoint without it loads with none
    (the fence then counts as before); one count per ``podUIDs`` entry or the checkpoint is refused."""
    rec = PreparedClaim(uid="u1", namespace="ns", name="c", state=PREPARED, cdi_spec="/cdi/x.json",
                        pod_uids=("p1", "p2"), pod_names=("a", "b"), pod_users=(1, 2), gpus={"GPU-0": 2048})
    text = Checkpoint({"u1": rec}).to_json()
    assert json.loads(text)["claims"]["u1"]["podUsers"] == [1, 2]
    assert Checkpoint.from_json(text).claims["u1"] == rec
    older = json.loads(text)
    del older["claims"]["u1"]["podUsers"]
    assert Checkpoint.from_json(json.dumps(older)).claims["u1"].pod_users == ()
    assert "podUsers" not in Checkpoint({"u1": dataclasses.replace(rec, pod_users=())}).to_json()
    for bad in ([1], [1, -1], "12", [1, "x"]):
        older["claims"]["u1"]["podUsers"] = bad
        with pytest.raises(CheckpointError, match="podUsers|invalid literal"):
            Checkpoint.from_json(json.dumps(older))
