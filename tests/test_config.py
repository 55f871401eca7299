"""The versioned config (vramshare/config.py): defaults, every key, strictness, env and CLI overrides."""
from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from vramshare import config
from vramshare.config import Config, ConfigError, DeviceListStrategy, Policy, load_config, parse_config
from vramshare.inventory import GpuMode


def test_empty_document_and_no_file_give_the_defaults():
    assert parse_config("") == Config() == load_config(None)
    assert parse_config("version: v1\n") == Config()
    d = Config()
    assert (d.resource_domain, d.memory_unit_mib, d.reserved_mib_per_gpu) == ("vramshare.io", 1024, 0)
    assert (d.default_gpu_mode, d.device_list_strategy, d.enforcement.mode) == (
        GpuMode.SHARED, DeviceListStrategy.ENVVAR, "auto")
    assert d.health.ignored_xids == (13, 31, 43, 45, 68, 109) and d.health.probes_to_recover == 3
    assert d.extender.policy is Policy.FGD and d.quota.floor_fraction == 0.5 and d.quota.ceiling_fraction == 1.5
    assert d.names.gpu_memory == "vramshare.io/gpu-memory"


@pytest.mark.parametrize("text, attr, expected", [
    ("resourceDomain: gpu.example.com", "resource_domain", "gpu.example.com"),
    ("memoryUnitMiB: 2048", "memory_unit_mib", 2048),
    ("reservedMiBPerGPU: 1536", "reserved_mib_per_gpu", 1536),
    ("defaultGpuMode: exclusive", "default_gpu_mode", GpuMode.EXCLUSIVE),
    ("gpuModes: {0: exclusive, GPU-abc: shared}", "gpu_modes", {"0": GpuMode.EXCLUSIVE, "GPU-abc": GpuMode.SHARED}),
    ("deviceListStrategy: cdi-cri", "device_list_strategy", DeviceListStrategy.CDI_CRI),
    ("deviceListStrategy: volume-mounts", "device_list_strategy", DeviceListStrategy.VOLUME_MOUNTS),
    ("enforcement: {mode: mps}", "enforcement.mode", "mps"),
    ("enforcement: {overLimitAction: evict}", "enforcement.over_limit_action", config.OverLimitAction.EVICT),
    ("quota: {idleSeconds: 30, peakWindowTicks: 6, protectRequests: false, shareSpare: false}",
     "quota.idle_seconds", 30.0),
    ("quotaHostDir: /data/quota", "quota_host_dir", "/data/quota"),
    ("health: {ignoredXids: [13, 79]}", "health.ignored_xids", (13, 79)),
    ("health: {ignoredXids: []}", "health.ignored_xids", ()),
    ("health: {disabled: true}", "health.disabled", True),
    ("health: {recoveryProbeSeconds: 5}", "health.recovery_probe_seconds", 5.0),
    ("health: {probesToRecover: 10}", "health.probes_to_recover", 10),
    ("extender: {policy: binpack}", "extender.policy", Policy.BINPACK),
    ("extender: {assumeTimeoutSeconds: 30}", "extender.assume_timeout_seconds", 30.0),
    ("extender: {workloadWindow: 50}", "extender.workload_window", 50),
    ("extender: {holdTimeoutSeconds: 0}", "extender.hold_timeout_seconds", 0.0),
    ("extender: {holdTimeoutSeconds: 10}", "extender.hold_timeout_seconds", 10.0),
    ("extender: {schedulerName: gpu-scheduler}", "extender.scheduler_name", "gpu-scheduler"),
    ("quota: {enabled: false}", "quota.enabled", False),
    ("quota: {intervalSeconds: 2.5}", "quota.interval_seconds", 2.5),
    ("quota: {floorFraction: 0.25, ceilingFraction: 2}", "quota.floor_fraction", 0.25),
    ("quota: {floorFraction: 1, ceilingFraction: 1}", "quota.ceiling_fraction", 1.0),
    ("quota: {stepMiB: 256}", "quota.step_mib", 256),
    ("quota: {marginMiB: 0}", "quota.margin_mib", 0),
    ("quota: {kvPressure: 0.75}", "quota.kv_pressure", 0.75),
])
def test_each_key(text, attr, expected):
    value = parse_config(text)
    for part in attr.split("."):
        value = getattr(value, part)
    assert value == expected


@pytest.mark.parametrize("text, message", [
    ("version: v2", "version: unknown version 'v2'"),
    ("memoryUnitMib: 1024", "memoryUnitMib: unknown key"),
    ("health: {ignoredXid: [1]}", "health.ignoredXid: unknown key"),
    ("extender: {polcy: fgd}", "extender.polcy: unknown key"),
    ("quota: {floor: 1}", "quota.floor: unknown key"),
    ("memoryUnitMiB: '1024'", "memoryUnitMiB: expected int, got '1024'"),
    ("memoryUnitMiB: true", "memoryUnitMiB: expected int, got True"),
    ("memoryUnitMiB: 0", "memoryUnitMiB: must be >= 50"),
    ("reservedMiBPerGPU: -1", "reservedMiBPerGPU: must be >= 0"),
    ("mpsEnforcement: true", "mpsEnforcement: replaced by enforcement.mode: mps"),
    ("enforcement: {mode: hami}", "enforcement.mode: 'hami' is not one of auto, driver, mps, cooperative"),
    ("enforcement: {overLimitAction: kill}", "enforcement.overLimitAction: 'kill' is not one of event, evict"),
    ("enforcement: {mpsPipeDirectory: pipes}", "enforcement.mpsPipeDirectory: 'pipes' must be an absolute"),
    ("enforcement: {overLimitGraceSeconds: -1}", "enforcement.overLimitGraceSeconds: must be >= 0"),
    ("quota: {peakWindowTicks: 0}", "quota.peakWindowTicks: must be >= 1"),
    ("quota: {idleSeconds: -5}", "quota.idleSeconds: must be >= 0"),
    ("quota: {shareSpare: 'yes'}", "quota.shareSpare: expected bool"),
    ("defaultGpuMode: split", "defaultGpuMode: 'split' is not one of shared, exclusive, mig"),
    ("defaultGpuMode: mig", "defaultGpuMode: must be shared or exclusive"),
    ("gpuModes: [exclusive]", "gpuModes: expected a mapping"),
    ("gpuModes: {1: mig}", "gpuModes.1: 'mig' follows the GPU's MIG mode"),
    ("gpuModes: {1: whole}", "gpuModes.1: 'whole' is not one of"),
    ("deviceListStrategy: cdi", "deviceListStrategy: 'cdi' is not one of envvar, cdi-cri, volume-mounts"),
    ("resourceDomain: vramshare", "resourceDomain: 'vramshare' is not a DNS domain"),
    ("resourceDomain: vramshare.io/x", "resourceDomain: 'vramshare.io/x' is not a DNS domain"),
    ("resourceDomain: VRAMshare.io", "resourceDomain: 'VRAMshare.io' is not a DNS domain"),
    ("resourceDomain: 7", "resourceDomain: expected str"),
    ("quotaHostDir: quota", "quotaHostDir: 'quota' must be an absolute host path"),
    ("health: [1]", "health: expected a mapping, got list"),
    ("health: {ignoredXids: 13}", "health.ignoredXids: expected a list of integers"),
    ("health: {ignoredXids: [13, x]}", "health.ignoredXids[1]: expected int"),
    ("health: {ignoredXids: [-1]}", "health.ignoredXids[0]: must be >= 0"),
    ("health: {recoveryProbeSeconds: 0}", "health.recoveryProbeSeconds: must be >= 0.1"),
    ("health: {probesToRecover: 0}", "health.probesToRecover: must be >= 1"),
    ("extender: {policy: random}", "extender.policy: 'random' is not one of fgd, binpack, spread"),
    ("extender: {assumeTimeoutSeconds: 0.5}", "extender.assumeTimeoutSeconds: must be >= 1"),
    ("extender: {holdTimeoutSeconds: -1}", "extender.holdTimeoutSeconds: must be >= 0"),
    ("extender: {schedulerName: ''}", "extender.schedulerName: must not be empty"),
    ("extender: {schedulerName: 3}", "extender.schedulerName: expected str"),
    ("quota: {floorFraction: 1.5}", "quota.floorFraction: must be <= 1"),
    ("quota: {ceilingFraction: 0.9}", "quota.ceilingFraction: must be >= 1"),
    ("quota: {floorFraction: -0.1}", "quota.floorFraction: must be >= 0"),
    ("quota: {stepMiB: 0}", "quota.stepMiB: must be >= 1"),
    ("quota: {marginMiB: -1}", "quota.marginMiB: must be >= 0"),
    ("quota: {kvPressure: 1.5}", "quota.kvPressure: must be <= 1"),
    ("- a\n- b", "config: expected a mapping, got list"),
    ("memoryUnitMiB: [", "config is not valid YAML"),
])
def test_bad_config_is_refused_naming_the_key(text, message):
    with pytest.raises(ConfigError) as err:
        parse_config(text)
    assert str(err.value).startswith(message), str(err.value)


def test_load_config_reads_a_file_and_never_raises_oserror(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("version: v1\nmemoryUnitMiB: 512\n")
    assert load_config(str(path)).memory_unit_mib == 512
    with pytest.raises(ConfigError, match=r"cannot read config .*missing\.yaml"):
        load_config(str(tmp_path / "missing.yaml"))


def test_mode_for_mig_then_uuid_then_index_then_default():
    cfg = parse_config("defaultGpuMode: shared\ngpuModes: {1: exclusive, GPU-b: exclusive, GPU-c: shared}")
    assert cfg.mode_for(0, "GPU-a", mig_enabled=False) is GpuMode.SHARED
    assert cfg.mode_for(1, "GPU-a", mig_enabled=False) is GpuMode.EXCLUSIVE
    assert cfg.mode_for(0, "GPU-b", mig_enabled=False) is GpuMode.EXCLUSIVE
    assert cfg.mode_for(1, "GPU-c", mig_enabled=False) is GpuMode.SHARED  # the UUID wins over the index
    assert cfg.mode_for(1, "GPU-b", mig_enabled=True) is GpuMode.MIG


# -- precedence: CLI > env > file > default ----------------------------------------------------
FILE = "memoryUnitMiB: 512\nhealth: {disabled: false, recoveryProbeSeconds: 7}\nextender: {policy: spread}\n"


@pytest.mark.parametrize("env, attr, expected", [
    ({"VRAMSHARE_RESOURCE_DOMAIN": "gpu.example.com"}, "resource_domain", "gpu.example.com"),
    ({"VRAMSHARE_MEMORY_UNIT_MIB": "2048"}, "memory_unit_mib", 2048),
    ({"VRAMSHARE_RESERVED_MIB_PER_GPU": "100"}, "reserved_mib_per_gpu", 100),
    ({"VRAMSHARE_DEFAULT_GPU_MODE": "exclusive"}, "default_gpu_mode", GpuMode.EXCLUSIVE),
    ({"VRAMSHARE_DEVICE_LIST_STRATEGY": "cdi-cri"}, "device_list_strategy", DeviceListStrategy.CDI_CRI),
    ({"VRAMSHARE_ENFORCEMENT_MODE": "cooperative"}, "enforcement.mode", "cooperative"),
    ({"VRAMSHARE_QUOTA_HOST_DIR": "/data/q"}, "quota_host_dir", "/data/q"),
    ({"VRAMSHARE_HEALTH_IGNORED_XIDS": "13, 79"}, "health.ignored_xids", (13, 79)),
    ({"VRAMSHARE_HEALTH_IGNORED_XIDS": ""}, "health.ignored_xids", ()),
    ({"VRAMSHARE_HEALTH_DISABLED": "true"}, "health.disabled", True),
    ({"VRAMSHARE_EXTENDER_POLICY": "binpack"}, "extender.policy", Policy.BINPACK),
    ({"VRAMSHARE_QUOTA_ENABLED": "false"}, "quota.enabled", False),
])
def test_env_overrides_the_file(tmp_path, env, attr, expected):
    path = tmp_path / "config.yaml"
    path.write_text(FILE)
    value = load_config(str(path), environ=env)
    for part in attr.split("."):
        value = getattr(value, part)
    assert value == expected
    assert env.keys() <= config.ENV_KEYS.keys()


def test_env_keeps_the_rest_of_the_file_section(tmp_path):
    cfg = parse_config(FILE, environ={"VRAMSHARE_HEALTH_DISABLED": "true", "VRAMSHARE_GPU_UUIDS": "GPU-x"})
    assert (cfg.health.disabled, cfg.health.recovery_probe_seconds, cfg.memory_unit_mib) == (True, 7.0, 512)
    assert parse_config(FILE) == parse_config(FILE, environ={}) != cfg


def test_env_without_file_and_cli_over_env():
    cfg = load_config(None, environ={"VRAMSHARE_QUOTA_HOST_DIR": "/env/q"})
    assert cfg.quota_host_dir == "/env/q"
    assert cfg.with_overrides(quota_host_dir="/cli/q").quota_host_dir == "/cli/q"
    assert cfg.with_overrides(quota_host_dir=None).quota_host_dir == "/env/q"


@pytest.mark.parametrize("env, message", [
    ({"VRAMSHARE_MEMORY_UNIT_MIB": "lots"}, "VRAMSHARE_MEMORY_UNIT_MIB: memoryUnitMiB: expected int, got 'lots'"),
    ({"VRAMSHARE_ENFORCEMENT_MODE": "maybe"}, "VRAMSHARE_ENFORCEMENT_MODE: enforcement.mode: 'maybe' is not one"),
    ({"VRAMSHARE_HEALTH_IGNORED_XIDS": "13,x"}, "VRAMSHARE_HEALTH_IGNORED_XIDS: health.ignoredXids[1]: expected int"),
    ({"VRAMSHARE_EXTENDER_POLICY": "rand"}, "VRAMSHARE_EXTENDER_POLICY: extender.policy: 'rand' is not one of"),
])
def test_bad_env_is_named(env, message):
    with pytest.raises(ConfigError) as err:
        parse_config("", environ=env)
    assert str(err.value).startswith(message), str(err.value)


def test_a_bad_file_is_blamed_on_the_file_even_with_env():
    with pytest.raises(ConfigError, match="^memoryUnitMiB: expected int"):
        parse_config("memoryUnitMiB: x", environ={"VRAMSHARE_HEALTH_DISABLED": "true"})


# -- issue 18 item 3: bounds from the consumers, in one place --------------------------------------
NUMERIC_KEYS = {  # every numeric key as a document path, and a value its consumer can use
    "memoryUnitMiB": 1024, "reservedMiBPerGPU": 0, "health.recoveryProbeSeconds": 30.0,
    "health.probesToRecover": 3, "extender.assumeTimeoutSeconds": 120.0, "extender.workloadWindow": 1000,
    "extender.holdTimeoutSeconds": 30.0, "quota.intervalSeconds": 10.0, "quota.floorFraction": 0.5,
    "quota.ceilingFraction": 1.5, "quota.stepMiB": 512, "quota.marginMiB": 1024, "quota.kvPressure": 0.9,
    "quota.peakWindowTicks": 60, "quota.idleSeconds": 300.0, "enforcement.overLimitGraceSeconds": 60.0,
    "quota.startupTicks": 30, "warmTier.scanIntervalSeconds": 60.0, "warmTier.maxCacheEntries": 200000,
    "warmTier.residencyMaxSteps": 0.9, "dynamicMig.graceSeconds": 60.0,
}
CLASS_KEYS = ("floorFraction", "ceilingFraction", "floorMiB", "ceilingMiB", "marginMiB", "idleSeconds",
              "lendingPriority", "sleepBookedFraction", "wakeReserve")


def _doc(path: str, value: object) -> str:
    import yaml
    if path.startswith("quota.classes."):
        return yaml.safe_dump({"quota": {"classes": [{"name": "c", path.rsplit(".", 1)[1]: value}]}})
    if path == "health.ignoredXids":
        return yaml.safe_dump({"health": {"ignoredXids": [value]}})
    parts = path.split(".")
    return yaml.safe_dump({parts[0]: value} if len(parts) == 1 else {parts[0]: {parts[1]: value}})


ALL_NUMERIC = sorted([*NUMERIC_KEYS, "health.ignoredXids", *(f"quota.classes.{k}" for k in CLASS_KEYS)])


def test_every_numeric_key_has_bounds_from_its_consumer():
    assert set(ALL_NUMERIC) == set(config.BOUNDS)


@pytest.mark.parametrize("key", ALL_NUMERIC)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), 1e308, 2**70, 10**400])
def test_nan_infinity_and_huge_numbers_are_refused_naming_the_key_and_the_bound(key, bad):
    """On main: ``_typed`` compared with ``<`` (False for NaN) and had no upper bound, so NaN, .inf and
    1e308 were accepted (and then froze the quota loop, crashed the extender's start...)."""
    shown = key.replace("quota.classes.", "quota.classes[0].").replace("ignoredXids", "ignoredXids[0]")
    with pytest.raises(ConfigError) as err:
        parse_config(_doc(key, bad))
    bound = config.BOUNDS[key]
    assert str(err.value).startswith(f"{shown}: "), str(err.value)
    assert config._num(bound.high) in str(err.value) or "expected int" in str(err.value) or "too large" in str(err.value)


@pytest.mark.parametrize("key", ALL_NUMERIC)
def test_each_bound_is_inclusive_and_one_step_beyond_is_refused(key):
    bound = config.BOUNDS[key]
    integral = key not in {k for k in ALL_NUMERIC if "Fraction" in k or "Seconds" in k or k.endswith("Pressure")}
    for edge in (bound.low, bound.high):
        value = int(edge) if integral else float(edge)
        try:
            parse_config(_doc(key, value))
        except ConfigError as exc:  # only a cross-key rule may refuse an edge (floor <= 1 <= ceiling)
            assert "floorFraction" in str(exc) or "ceiling" in str(exc), str(exc)
    step = 1 if integral else max(1e-6, bound.high * 1e-6)
    with pytest.raises(ConfigError, match=r"must be <= "):
        parse_config(_doc(key, (int(bound.high) + 1) if integral else bound.high + step))


def test_the_unit_floor_fits_the_largest_node_in_one_list_and_watch_message():
    units = config.MAX_NODE_SHARED_MIB // config.MIN_UNIT_MIB
    assert units <= config.MAX_DEVICES_PER_MESSAGE < config.MAX_NODE_SHARED_MIB // (config.MIN_UNIT_MIB - 1)


def test_node_limits_refuse_a_reserve_that_leaves_no_unit_and_a_list_too_long():
    from vramshare.inventory import Gpu, NodeInventory
    h100 = Gpu(index=0, uuid="GPU-a", model="H100", memory_mib=81559, numa_node=0, mode=GpuMode.SHARED,
               healthy=True, units=0)
    cfg = Config(reserved_mib_per_gpu=81000)
    with pytest.raises(ConfigError, match=r"^reservedMiBPerGPU: 81000 leaves GPU 0 .*less than one unit"):
        config.node_limits(cfg, NodeInventory(unit_mib=1024, gpus=(h100,)))
    many = tuple(Gpu(index=i, uuid=f"GPU-{i}", model="X", memory_mib=200_000, numa_node=0, mode=GpuMode.SHARED,
                     healthy=True, units=200_000 // 64) for i in range(16))
    with pytest.raises(ConfigError, match=r"^memoryUnitMiB: 64 makes 50000 devices"):
        config.node_limits(Config(memory_unit_mib=64), NodeInventory(unit_mib=64, gpus=many))
    config.node_limits(Config(), NodeInventory(unit_mib=1024, gpus=(
        Gpu(index=0, uuid="GPU-a", model="H100", memory_mib=81559, numa_node=0, mode=GpuMode.SHARED,
            healthy=True, units=79),)))


def test_a_reload_keeps_the_unit_and_the_reserve_and_applies_the_rest():
    """Issue 17 item 8: device IDs name units of the running size; a live change would re-mean them."""
    running = Config()
    new = parse_config("memoryUnitMiB: 2048\nreservedMiBPerGPU: 512\nquota: {stepMiB: 256}\n")
    kept, refused = config.keep_restart_only(running, new)
    assert (kept.memory_unit_mib, kept.reserved_mib_per_gpu, kept.quota.step_mib) == (1024, 0, 256)
    assert [r.key for r in refused] == ["memoryUnitMiB", "reservedMiBPerGPU"]
    assert all("restart" in config.refusal(r) for r in refused)
    assert config.keep_restart_only(running, parse_config("quota: {stepMiB: 256}")) == (
        parse_config("quota: {stepMiB: 256}"), [])


def test_a_reload_keeps_the_directories_and_names_each_refused_key():
    """What the running plugin wrote lives in these host paths, the only ones its DaemonSet mounts."""
    running = parse_config("dra: {cdiRoot: /var/run/cdi}")
    new = parse_config("quotaHostDir: /srv/q\ndra: {cdiRoot: /etc/cdi, stateDir: /srv/s, deviceTaints: true}")
    kept, refused = config.keep_restart_only(running, new)
    assert (kept.quota_host_dir, kept.dra.cdi_root, kept.dra.state_dir) == (
        running.quota_host_dir, "/var/run/cdi", running.dra.state_dir)
    assert kept.dra.device_taints is True  # the rest of the section applies
    assert [r.key for r in refused] == ["quotaHostDir", "dra.cdiRoot", "dra.stateDir"]
    why = config.refusal(refused[1])
    assert why.startswith("dra.cdiRoot: /var/run/cdi -> /etc/cdi refused") and "container runtime" in why


# -- issue 24: the admin's switch for dynamic MIG ------------------------------------------------------
def test_dynamic_mig_is_off_unless_the_admin_lists_the_gpus():
    assert not Config().dynamic_mig.allows(0, "GPU-a")
    cfg = parse_config("dynamicMig: {gpus: [3, GPU-b], graceSeconds: 30}")
    assert cfg.dynamic_mig.allows(3, "GPU-x") and cfg.dynamic_mig.allows(0, "GPU-b")
    assert not cfg.dynamic_mig.allows(0, "GPU-a") and cfg.dynamic_mig.grace_seconds == 30.0
    assert parse_config("dynamicMig: {gpus: all}").dynamic_mig.allows(7, "GPU-z")


@pytest.mark.parametrize("doc, message", [
    ("dynamicMig: {gpus: yes}", "dynamicMig.gpus: expected"),
    ("dynamicMig: {gpus: [true]}", "dynamicMig.gpus: expected"),
    ("dynamicMig: {enable: true}", "dynamicMig.enable: unknown key"),
    ("dynamicMig: {graceSeconds: -1}", "dynamicMig.graceSeconds: must be >= 0"),
])
def test_a_bad_dynamic_mig_section_is_refused_naming_the_key(doc, message):
    with pytest.raises(ConfigError, match=f"^{message}"):
        parse_config(doc)


def test_a_reload_never_changes_which_gpus_dynamic_mig_may_cut():
    """The reaper destroys unheld instances on the GPUs listed at start: a reload that withdrew a GPU
    must not leave it in the reaper's hands while its devices vanish (nor add one Allocate cannot serve)."""
    running = parse_config("dynamicMig: {gpus: [0]}")
    kept, refused = config.keep_restart_only(running, parse_config("dynamicMig: {gpus: []}\nquota: {stepMiB: 256}"))
    assert kept.dynamic_mig.gpus == ("0",) and kept.quota.step_mib == 256
    assert [r.key for r in refused] == ["dynamicMig.gpus"] and "fixed at its start" in config.refusal(refused[0])


def test_wake_ahead_is_an_opt_in_boolean_per_quota_class():
    """Issue 23, wake ahead: ``wakeAhead`` on a class (default false); anything but a boolean is refused."""
    import yaml
    doc = {"quota": {"classes": [{"name": "warm", "wakeAhead": True}, {"name": "plain"}]}}
    got = {c.name: c.wake_ahead for c in parse_config(yaml.safe_dump(doc)).quota.classes}
    assert got == {"warm": True, "plain": False}
    with pytest.raises(ConfigError, match=r"wakeAhead"):
        parse_config(yaml.safe_dump({"quota": {"classes": [{"name": "c", "wakeAhead": "yes"}]}}))


# -- what a reload applies, key by key ----------------------------------------------------------------
_ALTERNATIVES = {  # a valid value away from the default, per file key
    "memoryUnitMiB": 2048, "reservedMiBPerGPU": 512, "quotaHostDir": "/srv/q", "defaultGpuMode": "exclusive",
    "health.ignoredXids": [13], "health.disabled": True, "quota.stepMiB": 256, "quota.enabled": False,
    "quota.processAttribution": True, "quota.idleSeconds": 60, "enforcement.mode": "cooperative",
    "enforcement.mpsShmDirectory": "/srv/shm", "dra.cdiRoot": "/etc/cdi", "dra.deviceTaints": True,
    "warmTier.enabled": True, "warmTier.residencyMaxSteps": 0.5, "dynamicMig.gpus": [0],
    "extender.policy": "binpack",
}


def _config_with(keys) -> Config:
    raw: dict = {}
    for key in keys:
        *sections, leaf = key.split(".")
        at = raw
        for s in sections:
            at = at.setdefault(s, {})
        at[leaf] = _ALTERNATIVES[key]
    return config.config_from_dict(raw)


@given(st.sets(st.sampled_from(sorted(_ALTERNATIVES))), st.sets(st.sampled_from(sorted(_ALTERNATIVES))))
def test_a_reload_applies_every_changed_key_but_those_read_at_start(before, after):
    """key_changes names exactly the keys set differently; keep_restart_only keeps the running value of
    exactly those ``applies`` says need a node plugin restart (and refuses each by name), the rest apply."""
    running, new = _config_with(before), _config_with(after)
    changes = config.key_changes(running, new)
    assert {c.key for c in changes} == before ^ after
    assert config.key_changes(new, new) == []
    kept, refused = config.keep_restart_only(running, new)
    restart = {c.key for c in changes if config.NODE_RESTART in c.applies}
    assert {c.key for c in config.key_changes(kept, new)} == restart
    assert {c.key for c in config.key_changes(running, kept)} == (before ^ after) - restart
    assert sorted(r.key for r in refused) == sorted(restart)
    assert all("restart the plugin" in config.refusal(r) for r in refused)
    for c in changes:
        extender = c.key in {"memoryUnitMiB", "extender.policy", "warmTier.residencyMaxSteps"}
        assert (config.EXTENDER_RESTART in c.applies) == extender


@given(st.sets(st.sampled_from(sorted(_ALTERNATIVES))))
def test_what_a_daemon_reports_it_runs_with_reads_back_as_the_same_keys(keys):
    """file_values (the extender's /config) read by config_from_dict gives the same value for every key
    it covers, and the defaults elsewhere."""
    cfg = _config_with(keys)
    back = config.config_from_dict(config.file_values(cfg, config.EXTENDER_READS))
    differ = {c.key for c in config.key_changes(back, cfg)}
    covered = {k for k in keys if any(k == r or k.startswith(r + ".") for r in config.EXTENDER_READS)}
    assert differ == set(keys) - covered
