"""Quota classes (issue 14): the config keys and every refusal path, class resolution, and the loop
using them (bounds, lending rank, idle handling, over-limit action, live reload, a removed class)."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deviceplugin.assignment import AssignedGpu
from deviceplugin.kubelet.reconcile import Holding, Owner
from deviceplugin.quota.classes import DEFAULT, PodMeta, resolve, term_matches, terms
from deviceplugin.quota.kube import ApiQuotaMirror, pod_meta, tenants_from_holdings
from deviceplugin.quota.loop import LoopSettings, QuotaLoop
from deviceplugin.quota.model import PolicyParams, Tenant, TenantKey
from deviceplugin.quota.telemetry import UsageSample
from vramshare import contract
from vramshare.config import ClassMatch, ConfigError, LabelExpression, OverLimitAction, QuotaClass, parse_config
from vramshare.inventory import EnforcementMode

TWO = """
version: v1
quota:
  marginMiB: 0
  stepMiB: 1
  loans: any  # lending mechanics: issue 19's loan rule is tested apart
  classes:
  - name: production
    floorFraction: 1.0
    ceilingFraction: 1.5
    lendingPriority: 100
    match:
    - namespaces: [prod]
    - priorityClassNames: [inference-critical]
  - name: batch
    floorMiB: 4096
    ceilingFraction: 3
    lendingPriority: -10
    idleSeconds: off
    overLimitAction: evict
    allowPodSelection: true
    match:
    - selector:
        matchLabels: {team: eval}
        matchExpressions:
        - {key: tier, operator: NotIn, values: [gold]}
"""


def test_a_two_class_config_parses():
    q = parse_config(TWO).quota
    prod, batch = q.classes
    assert (prod.name, prod.floor_fraction, prod.ceiling_fraction, prod.lending_priority) == \
        ("production", 1.0, 1.5, 100)
    assert prod.match == (ClassMatch(namespaces=("prod",)), ClassMatch(priority_class_names=("inference-critical",)))
    assert (batch.floor_mib, batch.idle_seconds, batch.over_limit_action, batch.allow_pod_selection) == \
        (4096, 0.0, OverLimitAction.EVICT, True)
    assert batch.match[0].match_labels == (("team", "eval"),)
    assert batch.match[0].match_expressions == (LabelExpression("tier", "NotIn", ("gold",)),)
    assert parse_config("").quota.classes == ()  # old configs: every pod is in the default class


def _one(cls: str) -> str:
    return f"quota:\n  classes:\n  - {cls}\n"


@pytest.mark.parametrize("text, message", [
    ("quota: {classes: {name: a}}", r"quota.classes: expected a list"),
    (_one("{floorFraction: 0.5}"), r"quota.classes\[0\].name: every class needs a name"),
    (_one("{name: Prod}"), r"quota.classes\[0\].name: 'Prod' is not a DNS label"),
    (_one("{name: default}"), r"quota.classes\[0\].name: 'default' is the class of the global quota keys"),
    ("quota:\n  classes:\n  - {name: a}\n  - {name: a}\n", r"quota.classes\[1\].name: 'a' is already"),
    (_one("{name: a, floor: 0.5}"), r"quota.classes\[0\].floor: unknown key"),
    (_one("{name: a, floorFraction: 0.5, floorMiB: 100}"), r"quota.classes\[0\].floorMiB: set floorFraction"),
    (_one("{name: a, floorFraction: 1.5}"), r"quota.classes\[0\].floorFraction: must be <= 1"),
    (_one("{name: a, floorFraction: -0.1}"), r"quota.classes\[0\].floorFraction: must be >= 0"),
    (_one("{name: a, floorFraction: half}"), r"quota.classes\[0\].floorFraction: expected float"),
    (_one("{name: a, floorFraction: 0.8, ceilingFraction: 0.5}"), r"quota.classes\[0\].ceilingFraction: must be >="),
    (_one("{name: a, floorMiB: 8000, ceilingMiB: 4000}"), r"quota.classes\[0\].ceilingMiB: must be >= floorMiB"),
    (_one("{name: a, ceilingFraction: 1, ceilingMiB: 4000}"), r"quota.classes\[0\].ceilingMiB: set ceilingFraction"),
    (_one("{name: a, marginMiB: -1}"), r"quota.classes\[0\].marginMiB: must be >= 0"),
    (_one("{name: a, idleSeconds: soon}"), r"quota.classes\[0\].idleSeconds: expected float"),
    (_one("{name: a, lendingPriority: high}"), r"quota.classes\[0\].lendingPriority: expected int"),
    (_one("{name: a, overLimitAction: kill}"), r"quota.classes\[0\].overLimitAction: 'kill' is not one of"),
    (_one("{name: a, allowPodSelection: 'yes'}"), r"quota.classes\[0\].allowPodSelection: expected bool"),
    (_one("{name: a, match: {namespaces: [x]}}"), r"quota.classes\[0\].match: expected a list of terms"),
    (_one("{name: a, match: [{namespace: x}]}"), r"quota.classes\[0\].match\[0\].namespace: unknown key"),
    (_one("{name: a, match: [{namespaces: x}]}"), r"quota.classes\[0\].match\[0\].namespaces: expected a list"),
    (_one("{name: a, match: [{namespaces: ['']}]}"), r"quota.classes\[0\].match\[0\].namespaces\[0\]: must not"),
    (_one("{name: a, match: [{priorityClassNames: [1]}]}"),
     r"quota.classes\[0\].match\[0\].priorityClassNames\[0\]: expected str"),
    (_one("{name: a, match: [{selector: {labels: {}}}]}"), r"quota.classes\[0\].match\[0\].selector.labels: unknown"),
    (_one("{name: a, match: [{selector: {matchLabels: [a]}}]}"),
     r"quota.classes\[0\].match\[0\].selector.matchLabels: expected a mapping"),
    (_one("{name: a, match: [{selector: {matchLabels: {on: true}}}]}"),
     r"quota.classes\[0\].match\[0\].selector.matchLabels"),
    (_one("{name: a, match: [{selector: {matchExpressions: [{key: t, operator: Has, values: [x]}]}}]}"),
     r"quota.classes\[0\].match\[0\].selector.matchExpressions\[0\].operator: 'Has' is not one of"),
    (_one("{name: a, match: [{selector: {matchExpressions: [{key: t, operator: In}]}}]}"),
     r"matchExpressions\[0\].values: must be non-empty for operator In"),
    (_one("{name: a, match: [{selector: {matchExpressions: [{key: t, operator: Exists, values: [x]}]}}]}"),
     r"matchExpressions\[0\].values: must be empty for operator Exists"),
    (_one("{name: a, match: [{selector: {matchExpressions: [{operator: Exists}]}}]}"),
     r"matchExpressions\[0\].key: expected str"),
])
def test_every_bad_class_is_refused_naming_the_key(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(text)


# -- resolution ---------------------------------------------------------------------------------
CLASSES = parse_config(TWO).quota.classes


@pytest.mark.parametrize("pod, want, via", [
    (PodMeta.of("prod"), "production", "match"),
    (PodMeta.of("dev", priority_class="inference-critical"), "production", "match"),
    (PodMeta.of("dev", {"team": "eval"}), "batch", "match"),
    (PodMeta.of("dev", {"team": "eval", "tier": "gold"}), "default", "default"),  # NotIn gold
    (PodMeta.of("prod", {"team": "eval"}), "production", "match"),  # list order: production first
    (PodMeta.of("prod", requested_class="batch"), "batch", "annotation"),  # batch allows pod selection
    (PodMeta.of("dev", {"team": "eval"}, requested_class="production"), "batch", "match"),  # not allowed
    (PodMeta.of("dev", requested_class="nope"), "default", "default"),
    (PodMeta.of("prod", requested_class="default"), "default", "annotation"),
    (PodMeta.of("dev"), "default", "default"),
])
def test_first_match_in_the_documented_order(pod, want, via):
    res = resolve(pod, CLASSES)
    assert (res.qclass.name, res.via) == (want, via)
    if pod.requested_class in ("production", "nope"):
        assert res.note  # an ignored annotation says why


labels = st.dictionaries(st.sampled_from(["a", "b", "c"]), st.sampled_from(["1", "2"]), max_size=3)
exprs = st.lists(st.builds(lambda k, op, v: LabelExpression(k, op, tuple(v) if op in ("In", "NotIn") else ()),
                           st.sampled_from(["a", "b", "c"]), st.sampled_from(["In", "NotIn", "Exists", "DoesNotExist"]),
                           st.lists(st.sampled_from(["1", "2"]), min_size=1, max_size=2)), max_size=3)


@settings(max_examples=300, deadline=None)
@given(labels, labels, exprs)
def test_label_selectors_mean_what_kubernetes_says(pod_labels, match_labels, expressions):
    """A selector is the AND of its matchLabels and its expressions, each with apimachinery's meaning."""
    term = ClassMatch(match_labels=tuple(sorted(match_labels.items())), match_expressions=tuple(expressions))
    want = all(pod_labels.get(k) == v for k, v in match_labels.items())
    for e in expressions:
        has = e.key in pod_labels
        want &= {"In": has and pod_labels.get(e.key) in e.values, "NotIn": not has or pod_labels[e.key] not in e.values,
                 "Exists": has, "DoesNotExist": not has}[e.operator]
    assert term_matches(term, PodMeta.of("ns", pod_labels)) is want


def test_the_tenant_source_carries_what_selection_reads():
    names = contract.Names(contract.DEFAULT_DOMAIN)
    pod = {"metadata": {"namespace": "prod", "name": "p", "uid": "u", "labels": {"team": "eval"},
                        "annotations": {names.allocation_state: contract.STATE_ALLOCATED,
                                        names.assignment: json.dumps({"vllm": [{"uuid": "GPU-0", "mib": 8192}]}),
                                        names.quota_class: "batch"}},
           "spec": {"priorityClassName": "inference-critical"}, "status": {"phase": "Running"}}
    assert pod_meta(pod, names) == PodMeta.of("prod", {"team": "eval"}, "inference-critical", "batch")
    held = Holding(Owner("u", "prod", "p", "vllm"), (AssignedGpu("GPU-0", 8192),))
    (t,) = tenants_from_holdings([held], [pod], names)
    assert t.meta == pod_meta(pod, names)


# -- the loop -------------------------------------------------------------------------------------
PROD = TenantKey("prod", "chat", "vllm", pod_uid="u-prod")
BATCH = TenantKey("dev", "eval", "vllm", pod_uid="u-batch")


class Source:
    """Tenants and their use (the loop's two inputs at the edge)."""

    name = "fake"

    def __init__(self, used):
        self.used = used
        self.tenants = [Tenant(PROD, (("GPU-0", 40960),), meta=PodMeta.of("prod")),
                        Tenant(BATCH, (("GPU-0", 40960),), meta=PodMeta.of("dev", {"team": "eval"}))]

    def list_tenants(self):
        return self.tenants

    def read_usage(self):
        return [UsageSample("GPU-0", self.used[k], pod_uid=k.pod_uid) for k in (PROD, BATCH)]


class Actor:
    def __init__(self):
        self.acts = []

    def act(self, breach, action):
        self.acts.append((breach.key, action))


def _loop(tmp_path, text, used, **kw):
    cfg = parse_config(text)
    src = Source(used)
    loop = QuotaLoop(src, lambda: {"GPU-0": 81920}, [src], PolicyParams.from_config(cfg.quota), str(tmp_path),
                     settings=LoopSettings.from_config(cfg.quota, cfg.enforcement), **kw)
    return loop, src


def _limits(report):
    return {d.key: d for d in report.decisions}


def test_each_tenant_gets_its_class_bounds_and_inspect_view(tmp_path):
    loop, src = _loop(tmp_path, TWO, {PROD: 40960, BATCH: 40960})
    d = _limits(loop.run_once())
    assert d[PROD].floor_mib == 40960 and d[BATCH].floor_mib == 4096  # class bounds: floorFraction 1, floorMiB
    assert d[BATCH].ceiling_mib == 3 * 40960 and d[PROD].ceiling_mib == 61440
    assert loop.classes() == {PROD: "production", BATCH: "batch"}
    view = loop.views()[(BATCH, "GPU-0")]
    assert (view.qclass, view.request_mib, view.floor_mib, view.used_mib) == ("batch", 40960, 4096, 40960)


def test_per_class_over_limit_action_and_idle_handling(tmp_path):
    text = TWO + "enforcement:\n  overLimitGraceSeconds: 0\n"
    now = [0.0]
    actor = Actor()
    loop, src = _loop(tmp_path, text, {PROD: 1000, BATCH: 1000}, actor=actor, clock=lambda: now[0],
                      mode=EnforcementMode.COOPERATIVE)
    loop.run_once()
    src.used = {k: loop.limits()[(k, "GPU-0")] + 5000 for k in (PROD, BATCH)}
    now[0] = 10
    loop.run_once()
    assert sorted(actor.acts) == sorted([(PROD, OverLimitAction.EVENT), (BATCH, OverLimitAction.EVICT)])


def test_a_reload_adding_a_class_moves_tenants_and_an_invalid_one_is_refused(tmp_path, caplog):
    from deviceplugin.config_watch import ConfigWatcher
    path = tmp_path / "config.yaml"
    path.write_text("version: v1\n")
    cfg = parse_config(path.read_text())
    loop, src = _loop(tmp_path / "q", "version: v1\n", {PROD: 1000, BATCH: 1000})
    watcher = ConfigWatcher(str(path), lambda c: loop.reconfigure(c.quota, c.enforcement), initial=cfg)
    loop.run_once()
    assert loop.classes() == {PROD: "default", BATCH: "default"}
    path.write_text(TWO)
    assert watcher.check(force="test")
    loop.run_once()
    assert loop.classes() == {PROD: "production", BATCH: "batch"}
    before = loop.settings
    path.write_text(TWO.replace("floorMiB: 4096", "floorMiB: -4"))
    with caplog.at_level("WARNING"):
        assert not watcher.check(force="test")
    assert loop.settings == before
    refused = [r for r in caplog.records if "keeping the last good config" in r.getMessage()]
    assert refused and "quota.classes[1].floorMiB" in str(refused[0].__dict__)


def test_a_tenant_whose_class_disappears_keeps_its_limits_until_the_next_valid_config(tmp_path):
    from deviceplugin.config_watch import ConfigWatcher
    path = tmp_path / "config.yaml"
    path.write_text(TWO)
    cfg = parse_config(TWO)
    loop, src = _loop(tmp_path / "q", TWO, {PROD: 2000, BATCH: 30000})
    watcher = ConfigWatcher(str(path), lambda c: loop.reconfigure(c.quota, c.enforcement), initial=cfg)
    for _ in range(3):
        loop.run_once()
    held = loop.limits()[(BATCH, "GPU-0")]
    # the batch class is removed; the default class (floor 0.5, ceiling 1.5) would move it
    without_batch = TWO[:TWO.index("  - name: batch")]
    path.write_text(without_batch)
    assert watcher.check(force="test")
    # production at its limit (it wants more), batch nearly idle: any class would shrink batch now
    src.used = {PROD: loop.limits()[(PROD, "GPU-0")], BATCH: 2000}
    for _ in range(3):
        d = _limits(loop.run_once())
        assert d[BATCH].limit_mib == held and "class 'batch' removed" in d[BATCH].reason
    assert loop.views()[(BATCH, "GPU-0")].qclass == "batch"
    # the next valid config: it is resolved again (the default class now) and moves
    path.write_text(without_batch + "  marginMiB: 512\n")
    assert watcher.check(force="test")
    d = _limits(loop.run_once())
    assert loop.classes()[BATCH] == "default" and d[BATCH].limit_mib != held


def test_the_mirror_carries_class_request_floor_use_and_reason(tmp_path):
    class V1:
        def patch_namespaced_pod(self, name, ns, body, **kw):
            self.body = body

    v1 = V1()
    names = contract.Names(contract.DEFAULT_DOMAIN)
    loop, src = _loop(tmp_path, TWO, {PROD: 20000, BATCH: 1000}, mirror=ApiQuotaMirror(v1, names))
    loop.run_once()
    doc = json.loads(v1.body["metadata"]["annotations"][names.quota_mib])
    (entry,) = doc["vllm"]
    assert set(entry) == {"uuid", "mib", "state", "class", "req", "floor", "used", "why"}
    assert entry["class"] in ("production", "batch") and entry["req"] == 40960 and len(entry["why"]) <= 120


def test_default_class_is_todays_behaviour():
    assert DEFAULT == QuotaClass("default", allow_pod_selection=True)
    s = LoopSettings.from_config(parse_config("quota: {floorFraction: 0.3, marginMiB: 7}").quota)
    t = s.default_terms()
    assert (t.floor_of(1000), t.ceiling_of(1000), t.margin_mib, t.lending_priority) == (300, 1500, 7, 0)


def test_a_class_fraction_of_zero_means_zero_not_unset():
    """``floorFraction: 0``: a class its tenants may be cut to nothing in; ``ceilingFraction: 0`` (the floor
    inherited): never raised beyond that floor. A fraction of 0 is a value, not an omitted key."""
    q = parse_config("""
quota:
  floorFraction: 0.5
  classes:
  - {name: scavenger, floorFraction: 0, ceilingFraction: 2}
  - {name: pinned, ceilingFraction: 0}
""").quota
    base = LoopSettings.from_config(q).default_terms()
    scavenger, pinned = (terms(c, base) for c in q.classes)
    assert (scavenger.floor_of(1000), scavenger.ceiling_of(1000)) == (0, 2000)
    assert (pinned.floor_of(1000), pinned.ceiling_of(1000)) == (500, 500)


def test_metrics_carry_the_class(tmp_path):
    from deviceplugin.quota.service import QuotaCollector
    loop, src = _loop(tmp_path, TWO.replace("marginMiB: 0", "marginMiB: 1024"), {PROD: 40960, BATCH: 1000})
    loop.run_once()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for m in QuotaCollector(loop).collect()
               for s in m.samples}
    base = (("gpu", "GPU-0"), ("tenant_container", "vllm"), ("tenant_namespace", "dev"), ("tenant_pod", "eval"))
    batch = tuple(sorted(base + (("class", "batch"),)))
    assert samples[("vramshare_quota_floor_mib", batch)] == 4096
    assert samples[("vramshare_quota_request_mib", batch)] == 40960
    assert samples[("vramshare_quota_used_mib", batch)] == 1000
    assert ("vramshare_quota_limit_mib", batch) in samples
    assert samples[("vramshare_quota_gpu_capacity_mib", (("gpu", "GPU-0"),))] == 81920
    by_class = {k[1]: v for k, v in samples.items() if k[0] == "vramshare_quota_class_changes_total"}
    assert set(by_class) <= {(("class", "batch"),), (("class", "production"),)}
    assert sum(by_class.values()) == loop.counts["changes"] >= 1


def test_idle_handling_follows_the_class(tmp_path):
    """Global idleSeconds 10; batch says off: after a quiet minute production is warm, batch is not."""
    from deviceplugin.quota.model import Phase
    from deviceplugin.quota.telemetry import VllmSample

    class Quiet:
        def read_signals(self, url):
            return VllmSample(running=0, waiting=0)

    now = [0.0]
    loop, src = _loop(tmp_path, TWO.replace("  stepMiB: 1\n", "  stepMiB: 1\n  idleSeconds: 10\n"),
                      {PROD: 5000, BATCH: 5000}, signals=Quiet(), clock=lambda: now[0])
    src.tenants = [Tenant(t.key, t.gpus, metrics_url=f"http://{t.key.pod}", meta=t.meta) for t in src.tenants]
    for t in range(0, 70, 10):
        now[0] = float(t)
        loop.run_once()
    assert loop.phases() == {PROD: Phase.WARM, BATCH: Phase.HOT}


def test_dra_tenants_carry_pod_metadata_too():
    from deviceplugin.dra.checkpoint import PREPARED, PreparedClaim
    from deviceplugin.dra.tenants import tenants_from_claims
    names = contract.Names(contract.DEFAULT_DOMAIN)
    pod = {"metadata": {"name": "p", "namespace": "prod", "uid": "u1", "labels": {"team": "eval"},
                        "annotations": {names.quota_class: "batch"}}, "spec": {"priorityClassName": "hi"}}
    claim = PreparedClaim(uid="cu", namespace="prod", name="c", state=PREPARED, cdi_spec="vramshare.io/gpu=c",
                          pod_uids=("u1",), gpus={"GPU-0": 8192})
    (t,) = tenants_from_claims([claim], [pod], names)
    assert t.meta == PodMeta.of("prod", {"team": "eval"}, "hi", "batch")
    assert resolve(t.meta, CLASSES).qclass.name == "batch"


def test_the_quota_file_takes_the_class_floor_and_ceiling_even_when_the_limit_stays(tmp_path):
    """Allocate writes the default class's floor and ceiling (it cannot know the pod); the loop's first
    tick rewrites them with the class's, which the vLLM plugin reads, though the limit did not move."""
    from deviceplugin.quota.writer import GpuQuota, QuotaFile, container_dir, read_quota, write_quota
    for key in (PROD, BATCH):
        write_quota(container_dir(str(tmp_path), key.pod_uid, key.container),
                    QuotaFile(gpus=(GpuQuota("GPU-0", 40960, 20480, 61440),)))
    loop, src = _loop(tmp_path, TWO, {PROD: 30000, BATCH: 30000})
    report = loop.run_once()
    assert all(not d.changed for d in report.decisions)
    prod = read_quota(container_dir(str(tmp_path), PROD.pod_uid, PROD.container))
    batch = read_quota(container_dir(str(tmp_path), BATCH.pod_uid, BATCH.container))
    assert prod.gpus == (GpuQuota("GPU-0", 40960, 40960, 61440),) and prod.generation == 2
    assert batch.gpus == (GpuQuota("GPU-0", 40960, 4096, 3 * 40960),)
    assert loop.run_once().written == []  # and not again
