"""Every codec of the contract (issue 21), as properties: what ``encode`` writes ``parse`` reads back
unchanged and ``encode`` writes again byte for byte; junk (random JSON and random text) is either a valid
document or refused with the codec's one error type and a reason; input past the bound is refused before
it is parsed."""
from __future__ import annotations

import json
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vramshare import contract
from vramshare.contract import assignment, inventory, model, over_limit, quota_file, quota_mib, resident_models
from vramshare.contract.config_in_force import ConfigInForce
from vramshare.departing import DepartingPod
from vramshare.inventory import EngineState, EnforcementMode, Gpu, GpuMode, MigInstance, NodeInventory, ResidentModel

SETTINGS = settings(max_examples=150, deadline=None)
names = st.text(string.ascii_letters + string.digits + "-._", min_size=1, max_size=40)
uuids = st.text(string.ascii_letters + string.digits + "-", min_size=1, max_size=40)
mib = st.integers(1, 1 << 24)


def _unique_gpus(draw_list):
    return st.lists(st.tuples(uuids, mib), min_size=1, max_size=6, unique_by=lambda t: t[0]).map(
        lambda pairs: tuple(assignment.AssignedGpu(u, m) for u, m in pairs))


assignments = st.dictionaries(names, _unique_gpus(None), max_size=5)


@st.composite
def quota_files(draw):
    gpus = []
    for u in draw(st.lists(st.text(string.printable, max_size=40), min_size=1, max_size=6, unique=True)):
        floor, limit, ceiling = sorted(draw(st.lists(st.integers(0, 1 << 24), min_size=3, max_size=3)))
        gpus.append(quota_file.GpuQuota(u, limit, floor, ceiling))
    return quota_file.QuotaFile(tuple(gpus), draw(st.integers(0, quota_file.GENERATION_MAX)),
                                draw(st.text(max_size=30)), draw(st.sampled_from(["", "hot", "warm", "waking", "cold"])),
                                draw(st.sampled_from(["", "driver", "mps", "cooperative"])))


entries = st.builds(quota_mib.MirrorEntry, uuids, st.integers(0, 1 << 24),
                    state=st.sampled_from(["", "hot", "warm", "waking", "cold"]), qclass=st.just("") | names,
                    req=st.none() | st.integers(0, 1 << 24), floor=st.none() | st.integers(0, 1 << 24),
                    used=st.none() | st.integers(0, 1 << 24), why=st.text(max_size=120),
                    sleep=st.sampled_from(["", "awake", "sleeping"]), lent=st.none() | st.integers(0, 1 << 24),
                    wake_s=st.none() | st.floats(0, 1e6, allow_nan=False))
mirrors = st.dictionaries(names, st.lists(entries, max_size=4, unique_by=lambda e: e.uuid).map(tuple), max_size=4)


over_limits = st.builds(over_limit.OverLimit, names, uuids, st.integers(0, 1 << 24), st.integers(0, 1 << 24),
                        st.integers(0, 10 * 365 * 86400))


@st.composite
def inventories(draw):
    unit = draw(st.integers(1, 4096))
    gpus = []
    for i, u in enumerate(draw(st.lists(uuids, max_size=4, unique=True))):
        mode = draw(st.sampled_from(list(GpuMode)))
        memory = draw(st.integers(0, 1 << 20))
        migs = tuple(MigInstance(f"MIG-{u}-{j}", draw(st.sampled_from(["1g.10gb", "2g.20gb", "1g.10gb+me"])),
                                 draw(st.integers(0, 1 << 20)), draw(st.none() | st.integers(0, 14)),
                                 draw(st.none() | st.integers(0, 7)), draw(st.booleans()))
                     for j in range(draw(st.integers(0, 3)))) if mode is GpuMode.MIG else ()
        gpus.append(Gpu(i, u, draw(names), memory, draw(st.none() | st.integers(-1, 7)), mode, draw(st.booleans()),
                        migs, draw(st.integers(0, memory // unit)) if mode is GpuMode.SHARED else 0,
                        foreign_mib=draw(st.integers(0, memory))))
    models = tuple(ResidentModel(f"org/m{k}", draw(st.sampled_from(["", "main", "abc123"])), draw(st.integers(0, 1 << 40)),
                                 tuple((g.uuid, draw(st.sampled_from(list(EngineState)))) for g in gpus[:2]))
                   for k in range(draw(st.integers(0, 2))))
    config = draw(st.none() | st.builds(ConfigInForce, st.from_regex(r"[0-9a-f]{16}", fullmatch=True),
                                        st.lists(st.sampled_from(["memoryUnitMiB", "dynamicMig", "dra.cdiRoot"]),
                                                 max_size=3, unique=True).map(tuple)))
    departing = tuple(DepartingPod(f"ns/{draw(names)}", f"uid-{k}", draw(st.integers(0, 1 << 40)),
                                   tuple(draw(st.lists(st.tuples(uuids, mib), min_size=1, max_size=3,
                                                       unique_by=lambda t: t[0]))))
                      for k in range(draw(st.integers(0, 2))))
    return NodeInventory(unit, tuple(gpus), enforcement=draw(st.none() | st.sampled_from(list(EnforcementMode))),
                         models=models, config=config, departing=departing)


model_refs = st.builds(contract.ModelRef, st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}(/[A-Za-z0-9][A-Za-z0-9._-]{0,20})?",
                                                       fullmatch=True).filter(lambda n: ".." not in n.split("/")),
                       st.just("") | st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,30}", fullmatch=True))
_WARM_KINDS = {"engine": names, "seq": st.integers(0, 1 << 53), "level": st.integers(0, 3), "canSleep": st.booleans(),
               "weightsBytes": st.integers(0, 1 << 53), "freedBytes": st.integers(0, 1 << 53),
               "needBytes": st.integers(0, 1 << 53), "bytes": st.integers(0, 1 << 53),
               "seconds": st.floats(0, 1e6, allow_nan=False), "reason": st.text(max_size=40),
               "state": st.sampled_from(["awake", "sleeping", "waking"]), "model": st.text(max_size=40)}
warm_messages = st.builds(lambda op, fields: contract.WarmMessage.of(op, **fields), st.sampled_from(contract.WARM_OPS),
                          st.fixed_dictionaries({}, optional=_WARM_KINDS))


#: codec name -> (encode, parse, a strategy of values, value -> what parse gives back, error type, bound)
CODECS = {
    "assignment": (assignment.encode, assignment.parse, assignments, lambda v: v, assignment.AssignmentError,
                   assignment.MAX_CHARS),
    "quota.json": (quota_file.encode, quota_file.parse, quota_files(), lambda v: v, quota_file.QuotaFileError,
                   quota_file.MAX_BYTES),
    "quota-mib": (quota_mib.encode_mirror, quota_mib.parse, mirrors, lambda v: v, quota_mib.QuotaMirrorError,
                  quota_mib.MAX_CHARS),
    "over-limit": (over_limit.encode, over_limit.parse, over_limits, lambda v: v, over_limit.OverLimitError,
                   over_limit.MAX_CHARS),
    "model": (contract.encode_model_ref, contract.parse_model_ref, model_refs, lambda v: v, contract.ModelRefError,
              model.MAX_MODEL_CHARS),
    "warm line": (contract.encode_warm, contract.decode_warm, warm_messages, lambda v: v, contract.WarmMessageError,
                  contract.WARM_MAX_LINE),
    "inventory": (inventory.encode, inventory.parse, inventories(), lambda v: v, inventory.InventoryError,
                  inventory.MAX_CHARS),
    "resident-models": (resident_models.encode, resident_models.parse, inventories().map(lambda inv: inv.models),
                        lambda v: v, resident_models.ResidentModelsError, resident_models.MAX_CHARS),
}


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_parse_reads_back_what_encode_writes(codec):
    encode, parse, values, expected, _, _ = CODECS[codec]

    @SETTINGS
    @given(values)
    def check(value):
        text = encode(value)
        parsed = parse(text)
        assert parsed == expected(value)
        assert parse(text) == parsed  # deterministic
        assert encode(parsed) == text  # encode . parse is the identity on what encode writes

    check()


json_values = st.recursive(st.none() | st.booleans() | st.integers(-(1 << 64), 1 << 64) | st.floats(allow_nan=False)
                           | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
                           max_leaves=20)


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_junk_is_a_document_or_refused_with_a_reason(codec):
    _, parse, _, _, error, _ = CODECS[codec]

    @SETTINGS
    @given(st.one_of(json_values.map(json.dumps), st.text(max_size=60), st.binary(max_size=60)))
    def check(text):
        try:
            parse(text)
        except error as exc:
            assert str(exc)
            assert isinstance(exc, ValueError)

    check()


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_input_past_the_bound_is_refused_before_parsing(codec):
    _, parse, _, _, error, bound = CODECS[codec]
    with pytest.raises(error, match=str(bound)):
        parse(" " * (bound + 1))


@pytest.mark.parametrize("text, reason", [
    ('{"c": [{"uuid": "GPU-a", "mib": 0}]}', "int 1.."),  # the extender's zero-MiB whole GPU: never written
    ('{"c": [{"uuid": "GPU-a", "mib": 1}, {"uuid": "GPU-a", "mib": 1}]}', "names a GPU twice"),
    ('{"c": []}', "no GPUs for container 'c'"),
    ('{"c": [{"uuid": "", "mib": 1}]}', "uuid"),
    ('{"c": [{"uuid": "GPU-a", "mib": 1.0}]}', "int 1.."),
    ('[]', "not an object"),
])
def test_one_assignment_rule_for_extender_and_node(text, reason):
    """Issue 21: the extender read ``mib >= 0`` with duplicates, the node ``mib > 0`` without; one rule now,
    the node's, for both sides and for the extender's own writing."""
    with pytest.raises(assignment.AssignmentError, match=reason):
        assignment.parse(text)
    from deviceplugin import assignment as handshake
    from extender import translate
    with pytest.raises(assignment.AssignmentError, match=reason):
        handshake.parse_all(text)
    pod = {"metadata": {"name": "p", "annotations": {contract.Names().assignment: text}}}
    with pytest.raises(translate.TranslateError, match=reason):
        translate.decode_assignment(pod, contract.Names())


def test_the_quota_loops_view_is_mirrored_as_read():
    text = quota_mib.encode({"vllm": {"GPU-b": 2048, "GPU-a": 1024}}, {"vllm": "warm"},
                            {"vllm": {"GPU-a": {"class": "batch", "req": 4096, "why": "cut"}}})
    assert quota_mib.parse(text) == {"vllm": (quota_mib.MirrorEntry("GPU-a", 1024, "warm", "batch", req=4096, why="cut"),
                                              quota_mib.MirrorEntry("GPU-b", 2048, "warm"))}
    with pytest.raises(quota_mib.QuotaMirrorError, match="unknown detail keys"):
        quota_mib.encode({"vllm": {"GPU-a": 1}}, details={"vllm": {"GPU-a": {"requestMiB": 1}}})


def test_the_extender_refuses_to_write_a_plan_the_node_would_refuse():
    from extender import cluster, translate
    ask = translate.ContainerAsk("c", cluster.Demand(per_gpu=0, count=1, kind=translate.EXCLUSIVE))
    with pytest.raises(assignment.AssignmentError, match="int 1.."):
        translate.encode_assignment([ask], [[("GPU-zero", 0)]])


@pytest.mark.parametrize("text, reason", [
    ('{"generation": 1, "gpus": [{"uuid": "a", "limitMiB": 5}, {"uuid": "a", "limitMiB": 5}]}', "twice"),
    ('{"generation": 1, "gpus": [{"uuid": "a", "limitMiB": "5"}]}', "limitMiB"),
    ('{"generation": 1, "gpus": [{"uuid": "a", "limitMiB": 5.5}]}', "limitMiB"),
    ('{"generation": 1, "gpus": [{"uuid": "a", "limitMiB": 5, "floorMiB": 6}]}', "floorMiB <= limitMiB"),
    ('{"generation": 9223372036854775808, "gpus": [{"uuid": "a", "limitMiB": 5}]}', "int64"),
    ('{"gpus": [{"uuid": "a", "limitMiB": 5}]}', "generation"),
    ('{"generation": 1, "gpus": []}', "non-empty"),
    ('{"generation": 1, "gpus": [{"uuid": "a", "limitMiB": NaN}]}', "NaN"),
])
def test_one_quota_file_rule_for_node_and_engine(text, reason):
    """Issue 21: the node's writer and the vLLM plugin read quota.json with one codec and one model."""
    from deviceplugin.quota import writer
    from vllm_patches import quota
    assert writer.GpuQuota is quota.GpuQuota is contract.GpuQuota
    for parse in (quota_file.parse, writer.parse_quota, quota.parse_quota):
        with pytest.raises(quota_file.QuotaFileError, match=reason):
            parse(text)


def test_every_name_of_the_old_module_is_still_there():
    for name in ("Names", "USER_ANNOTATIONS", "ModelRef", "parse_model_ref", "ModelRefError", "WarmMessage",
                 "encode_warm", "decode_warm", "WARM_OPS", "STATE_ALLOCATED", "FIELD_MANAGER_EXTENDER",
                 "QUOTA_FILE_NAME", "unit_device_id", "parse_unit_device_id", "MAX_EXTENDER_PRIORITY"):
        assert hasattr(contract, name), name


def test_the_reconciler_never_writes_an_assignment_the_contract_refuses():
    """A MIG device the backend reports at 0 MiB: that pod's report waits with the reason (on main it was
    written, and every reader refused it), the other pods' reports go on."""
    from deviceplugin.kubelet import reconcile
    from deviceplugin.devices import PluginDevice
    n = contract.Names()
    mig = n.mig("1g.10gb")
    devices = {"MIG-0": PluginDevice("MIG-0", "GPU-m", 0, True, 0), "MIG-1": PluginDevice("MIG-1", "GPU-m", 0, True, 9984)}

    def pod(name):
        return {"metadata": {"namespace": "ns", "name": name, "uid": f"uid-{name}", "annotations": {}},
                "spec": {"nodeName": "n1", "containers": [{"name": "c", "resources": {"limits": {mig: "1"}}}]}}

    held = [reconcile.Held("ns", "zero", "c", mig, ("MIG-0",)), reconcile.Held("ns", "ok", "c", mig, ("MIG-1",))]
    out = reconcile.plan(held, [pod("zero"), pod("ok")], devices, n, "n1", 1024)
    assert [p.pod.name for p in out.patches] == ["ok"]
    assert "assignment contract" in out.waiting["ns/zero"] and "int 1.." in out.waiting["ns/zero"]


def test_resident_models_spell_a_model_as_the_inventory_does_and_stay_within_the_bound():
    """The DRA plugin's report (issue 23) is the inventory's ``models`` section alone: one encoding of a
    model; a report that would pass the bound (GPU names of absurd length) loses its last models."""
    from vramshare.inventory import MAX_MODELS
    ms = tuple(ResidentModel(f"org/m{k}", "main", 1 << 30, (("GPU-" + "x" * 200, EngineState.AWAKE),) * 16)
               for k in range(MAX_MODELS))
    doc = json.loads(resident_models.encode(ms[:2]))
    assert doc["models"] == json.loads(NodeInventory(1024, models=ms[:2]).to_json())["models"]
    text = resident_models.encode(ms)
    assert len(text) <= resident_models.MAX_CHARS
    assert resident_models.parse(text) == ms[:len(resident_models.parse(text))] and len(resident_models.parse(text)) > 1


@pytest.mark.parametrize("section", [{"digest": 7}, {"digest": ""}, {"digest": "x" * 65}, {"restartPending": []},
                                     {"digest": "ab", "restartPending": "memoryUnitMiB"}, "ab", []])
def test_a_malformed_config_section_reads_as_absent_and_keeps_the_node_s_gpus(section):
    """The inventory's ``config`` informs an admin (which config text the plugin runs): one a reader cannot
    read is dropped, never the node's GPUs with it (the extender would stop placing there)."""
    import json
    inv = NodeInventory(1024, (Gpu(0, "GPU-a", "A100", 81920, 0, GpuMode.SHARED, True, (), 80),))
    doc = json.loads(inventory.encode(inv))
    doc["config"] = section
    back = inventory.parse(json.dumps(doc))
    assert back.config is None and back.gpus == inv.gpus
