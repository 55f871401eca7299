"""The versioned config (vramshare/config.py): defaults, every key, strictness, env and CLI overrides."""
from __future__ import annotations

import pytest

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
    ("memoryUnitMiB: 0", "memoryUnitMiB: must be >= 1"),
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
    ("quota: {floorFraction: 1.5}", "quota: floorFraction must be <= 1 <= ceilingFraction"),
    ("quota: {ceilingFraction: 0.9}", "quota: floorFraction must be <= 1 <= ceilingFraction"),
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
