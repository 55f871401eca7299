"""The versioned configuration file (``version: v1``), shared by the device plugin and the extender.

Mounted from the ConfigMap ``vramshare-config``. Precedence: CLI flag > environment > file > default.
Parsing is strict: an unknown key, a wrong type or a bad value raises :class:`ConfigError` naming the
key, so a caller that reloads can keep the last good config and log what it refused.
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import yaml

from vramshare import contract
from vramshare.inventory import EnforcementMode, GpuMode, NodeInventory

VERSION = "v1"
DEFAULT_IGNORED_XIDS = (13, 31, 43, 45, 68, 109)


# -- what the consumers can use (issue 18) -------------------------------------------------------
# The kubelet reads ListAndWatch with grpc-go's default receive limit (pkg/kubelet/cm/devicemanager/
# plugin/v1beta1/client.go dials without MaxCallRecvMsgSize: 4 MiB); a larger message is refused and
# the resource gets no devices. A device entry is at most DEVICE_ENTRY_BYTES on the wire (a 63-character
# ID, "Unhealthy", one NUMA node; tests/deviceplugin pins it with the real message), so one message
# carries at most MAX_DEVICES_PER_MESSAGE devices of one resource.
GRPC_MAX_RECEIVE_BYTES = 4 * 1024 * 1024
DEVICE_ENTRY_BYTES = 88
MAX_DEVICES_PER_MESSAGE = GRPC_MAX_RECEIVE_BYTES // DEVICE_ENTRY_BYTES
# The largest GPU and node the static bounds are sized for (B300: 288 GB; 8 of them on a node).
MAX_GPU_MIB = 288 * 1024
MAX_NODE_SHARED_MIB = 8 * MAX_GPU_MIB
# The smallest unit whose device list for such a node fits one message; a node beyond the envelope
# is checked exactly where its GPUs are known (:func:`node_limits`, the device plugin's start).
MIN_UNIT_MIB = -(-MAX_NODE_SHARED_MIB // MAX_DEVICES_PER_MESSAGE)
DAY_S = 86_400.0
WEEK_S = 7 * DAY_S


@dataclass(frozen=True)
class Bound:
    """Inclusive bounds of a numeric key and the consumer's reason, said when a value is refused."""

    low: float
    high: float
    why: str


#: Every numeric key, by its path with list indexes removed. ``_typed`` refuses a number not listed.
BOUNDS: dict[str, Bound] = {
    "memoryUnitMiB": Bound(MIN_UNIT_MIB, MAX_GPU_MIB, f"a node of {MAX_NODE_SHARED_MIB} MiB of shared GPUs must "
                           f"fit one ListAndWatch message of {MAX_DEVICES_PER_MESSAGE} devices (gRPC's 4 MiB "
                           f"receive limit), and a unit beyond the largest GPU is no device at all"),
    "reservedMiBPerGPU": Bound(0, MAX_GPU_MIB - MIN_UNIT_MIB, "at least one unit must stay on the GPU"),
    "health.ignoredXids": Bound(0, 2**32 - 1, "Xids are NVML event data, 32-bit"),
    "health.recoveryProbeSeconds": Bound(0.1, DAY_S, "the probe thread's wait; a day at most"),
    "health.probesToRecover": Bound(1, 1000, "good probes in a row"),
    "extender.assumeTimeoutSeconds": Bound(1, WEEK_S, "expiry of an assumed pod, in ns on a 64-bit clock"),
    "extender.workloadWindow": Bound(1, 1_000_000, "recent requests kept in memory"),
    "extender.holdTimeoutSeconds": Bound(0, 3_600, "a hold blocks binds of one size on a node; 0: none"),
    "quota.intervalSeconds": Bound(1, DAY_S, "each tick reads every tenant's use and metrics"),
    "quota.floorFraction": Bound(0, 1, "a fraction of the request"),
    "quota.ceilingFraction": Bound(1, 1024, "a multiple of the request; beyond, the GPU is the ceiling"),
    "quota.stepMiB": Bound(1, MAX_GPU_MIB, "a step beyond a GPU never moves a limit"),
    "quota.marginMiB": Bound(0, MAX_GPU_MIB, "headroom on one GPU"),
    "quota.kvPressure": Bound(0, 1, "a fraction of the KV cache"),
    "quota.peakWindowTicks": Bound(1, 100_000, "ticks of use remembered per tenant"),
    "quota.idleSeconds": Bound(0, WEEK_S, "0: never warm"),
    "quota.classes.floorFraction": Bound(0, 1, "a fraction of the request"),
    "quota.classes.ceilingFraction": Bound(0, 1024, "a multiple of the request; beyond, the GPU is the ceiling"),
    "quota.classes.floorMiB": Bound(0, MAX_NODE_SHARED_MIB, "a pod's memory on one node"),
    "quota.classes.ceilingMiB": Bound(0, MAX_NODE_SHARED_MIB, "a pod's memory on one node"),
    "quota.classes.marginMiB": Bound(0, MAX_GPU_MIB, "headroom on one GPU"),
    "quota.classes.idleSeconds": Bound(0, WEEK_S, "0: never warm"),
    "quota.classes.lendingPriority": Bound(-1_000_000, 1_000_000, "an ordering"),
    "quota.classes.sleepBookedFraction": Bound(0, 1, "a fraction of the request; 1: a sleeping pod is booked whole"),
    "quota.classes.wakeReserve": Bound(1, 64, "wakes of this class's sleeping pods one GPU keeps room for at once"),
    "quota.startupTicks": Bound(0, 100_000, "ticks a new container counts at its request while it loads"),
    "enforcement.overLimitGraceSeconds": Bound(0, WEEK_S, "how long a container may stay over its limit"),
    "warmTier.scanIntervalSeconds": Bound(1, DAY_S, "how often the node rescans its model cache"),
    "warmTier.maxCacheEntries": Bound(1, 10_000_000, "directory entries one cache scan reads before it stops"),
    "warmTier.residencyMaxSteps": Bound(0, 10, "the residency bonus in steps of the policy's 0..10 score"),
    "dynamicMig.graceSeconds": Bound(0, DAY_S, "how long an instance no container holds is kept (a restarting "
                                     "pod's survives); a day at most"),
}


class ConfigError(ValueError):
    """A config that was refused; the message names the offending key."""


class DeviceListStrategy(str, enum.Enum):
    ENVVAR = "envvar"
    CDI_CRI = "cdi-cri"
    VOLUME_MOUNTS = "volume-mounts"


class Policy(str, enum.Enum):
    """Placement policies of the extender (node score and GPU pick)."""

    FGD = "fgd"
    BINPACK = "binpack"
    SPREAD = "spread"


@dataclass(frozen=True)
class HealthConfig:
    """Xid health checking. Application Xids are ignored by default, as NVIDIA's plugin does."""

    ignored_xids: tuple[int, ...] = DEFAULT_IGNORED_XIDS
    disabled: bool = False
    recovery_probe_seconds: float = 30.0
    probes_to_recover: int = 3  # good probes in a row before an unhealthy GPU is healthy again


@dataclass(frozen=True)
class ExtenderConfig:
    policy: Policy = Policy.FGD
    assume_timeout_seconds: float = 120.0  # an assumed pod that never binds frees its memory then
    workload_window: int = 1000  # recent requests forming FGD's target workload
    # TLS with client-certificate authentication of the verbs (all three or none; PEM paths).
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    client_ca_file: str | None = None
    # A second, plain-HTTP listener serving only /metrics, /healthz and /readyz (HOST:PORT), or None.
    metrics_listen: str | None = None
    # An assumed pod blocks binds of same-size pods to its node until allocated, at most this long
    # (0: no hold; see extender/holds.py).
    hold_timeout_seconds: float = 30.0
    # /bind serves only pods of this scheduler profile (kube-scheduler's schedulerName).
    scheduler_name: str = "vramshare-scheduler"


class OverLimitAction(str, enum.Enum):
    """What the quota loop does about a container above its hard limit past the grace period."""

    EVENT = "event"  # a Warning event and the <domain>/over-limit annotation on the pod
    EVICT = "evict"  # that, and evict the pod (the Eviction API, so PodDisruptionBudgets hold)


ENFORCEMENT_AUTO = "auto"


@dataclass(frozen=True)
class WarmTierConfig:
    """Issue 23: engines that sleep and lend their memory; where models' files are. Off by default."""

    # the quota loop asks idle engines that can sleep (vLLM with --enable-sleep-mode, on CUDA) to sleep,
    # through a unix socket (contract.WARM_SOCKET_NAME) the node agent serves in each quota directory
    enabled: bool = False
    # host directory the node agent scans for model files (Hugging Face cache or <name>/<revision>) and
    # publishes in the inventory's ``models``; None: no scan
    model_cache_dir: str | None = None
    scan_interval_seconds: float = 60.0
    max_cache_entries: int = 200_000  # directory entries read per scan at most (a huge cache is cut there)
    # the extender's residency bonus is worth at most this many steps of the policy's score (fgd: 0.16
    # GPU of fragmentation each); below 1 it only breaks near-ties (bench/bench_residency.py)
    residency_max_steps: float = 0.9


@dataclass(frozen=True)
class EnforcementConfig:
    """How each container's GPU memory is fenced. ``mode`` auto picks the best the node supports;
    a named mode that the node cannot honour stops the device plugin with the reason."""

    mode: str = ENFORCEMENT_AUTO  # auto | driver | mps | cooperative
    mps_pipe_directory: str = "/run/nvidia/mps/nvidia.com/gpu/pipe"  # host, as NVIDIA's MPS daemon makes it
    mps_shm_directory: str = "/run/nvidia/mps/shm"
    over_limit_action: OverLimitAction = OverLimitAction.EVENT
    over_limit_grace_seconds: float = 60.0
    resolved: EnforcementMode | None = None  # not a file key: the mode the device plugin detected

    def requested(self) -> EnforcementMode | None:
        """The mode asked for; ``None`` for auto."""
        return None if self.mode == ENFORCEMENT_AUTO else EnforcementMode(self.mode)


DEFAULT_CLASS = "default"  # the class of the global quota keys: every pod no class selects


@dataclass(frozen=True)
class LabelExpression:
    """One ``matchExpressions`` item of a Kubernetes label selector (In, NotIn, Exists, DoesNotExist)."""

    key: str
    operator: str
    values: tuple[str, ...] = ()


@dataclass(frozen=True)
class ClassMatch:
    """One selection term of a quota class: every field given must match (AND); a class matches a
    pod when any of its terms does (OR), as ``nodeSelectorTerms`` do. An empty term matches all."""

    namespaces: tuple[str, ...] = ()
    match_labels: tuple[tuple[str, str], ...] = ()
    match_expressions: tuple[LabelExpression, ...] = ()
    priority_class_names: tuple[str, ...] = ()


@dataclass(frozen=True)
class QuotaClass:
    """A named set of quota bounds (issue 14). ``None`` fields inherit the global ``quota.*`` keys
    (the ``default`` class); at most one of each fraction / MiB pair is set."""

    name: str
    floor_fraction: float | None = None
    floor_mib: int | None = None
    ceiling_fraction: float | None = None
    ceiling_mib: int | None = None
    margin_mib: int | None = None
    idle_seconds: float | None = None  # 0: never warm
    lending_priority: int = 0  # under pressure lower lends first and is cut first; higher is kept longest
    over_limit_action: "OverLimitAction | None" = None  # None: enforcement.overLimitAction
    allow_pod_selection: bool = False  # pods may name it with the <domain>/quota-class annotation
    match: tuple[ClassMatch, ...] = ()
    # issue 23 item 5, overcommit of sleeping pods (an admin's choice; off unless set): the extender books
    # a pod of this class that sleeps at this fraction of its request (never below what it still holds),
    # while each GPU keeps room for ``wake_reserve`` of its sleepers waking at once (vramshare/overcommit.py)
    sleep_booked_fraction: float | None = None  # None: booked whole, as every pod (no overcommit)
    wake_reserve: int = 1
    # issue 23, wake ahead: the broker wakes this class's sleeping engines before their forecast next
    # request, only into memory measured free beyond the wake reserve (deviceplugin/quota/warm.py)
    wake_ahead: bool = False


@dataclass(frozen=True)
class QuotaConfig:
    """Bounds for the quota feedback loop; per-pod floors and ceilings as fractions of the request."""

    enabled: bool = True
    interval_seconds: float = 10.0
    floor_fraction: float = 0.5
    ceiling_fraction: float = 1.5
    step_mib: int = 512
    margin_mib: int = 1024  # headroom over observed use that the loop never takes from a tenant
    kv_pressure: float = 0.9  # vLLM KV-cache usage at or above this counts as memory pressure
    # Tie NVML's per-process GPU memory (host PIDs) to pods through /proc/<pid>/cgroup. Needs the
    # device plugin to run with hostPID: true (it then sees, and as root could signal, every host
    # process), so it is off by default.
    process_attribution: bool = False
    peak_window_ticks: int = 60  # ticks of use remembered: headroom reaches the window's peak
    protect_requests: bool = True  # overload: use within each request is covered before any beyond it
    share_spare: bool = True  # memory nobody asked for is split evenly as headroom
    # "forecast" (quota/headroom.py, the default since issue 19: best on the tuning containers), "learned"
    # (quota/learned.py) or "peak" (use + margin up to the window's peak)
    headroom: str = "forecast"
    # "releasing": only engines that report a releasing mode (vramshare_vllm_release_mode unmap) are
    # raised beyond their request, since only their loans come back when a reservation needs them
    # (issue 19); "any": every tenant may borrow (unsound where a cut frees nothing)
    loans: str = "releasing"
    startup_ticks: int = 30  # a new container counts at its request this many ticks (its engine starts)
    idle_seconds: float = 300.0  # no requests and flat use this long: the tenant is warm (0 = never)
    classes: tuple[QuotaClass, ...] = ()  # issue 14; every pod none selects is in the ``default`` class


QUOTA_HEADROOM_RULES = ("peak", "forecast", "learned")
QUOTA_LOAN_RULES = ("releasing", "any")


@dataclass(frozen=True)
class DraConfig:
    """The DRA kubelet plugin (``vramshare dra-plugin``). ``gpus`` decides which plugin owns a GPU:
    listed GPUs (index or UUID; ``"all"`` for every GPU) are served by DRA only and the device plugin
    leaves them out, so the two can never hand out the same GPU."""

    gpus: tuple[str, ...] = ()
    device_taints: bool = False  # withdraw unhealthy devices by taint (DRADeviceTaints) instead of removal
    cdi_root: str = "/var/run/cdi"
    state_dir: str = "/var/lib/vramshare/dra"  # the prepared-claims checkpoint
    # issue 24: on the GPUs this plugin owns that ``dynamicMig.gpus`` allows (one consent for both
    # paths), every profile at every placement is published as a partitionable device (KEP-4815).
    # "auto": publish partitionable devices and fall back to today's devices when the API server drops
    # their counters (DRAPartitionableDevices off); "off": never; "on": never fall back
    partitionable_devices: str = "auto"

    def manages(self, index: int, uuid: str) -> bool:
        return "all" in self.gpus or uuid in self.gpus or str(index) in self.gpus



@dataclass(frozen=True)
class DynamicMigConfig:
    """Dynamic MIG (issue 24): GPUs in MIG mode listed in ``gpus`` (index or UUID; ``"all"``) get GPU
    instances made for the pods that ask and destroyed ``grace_seconds`` after no container holds them.
    Off by default: an admin's partitioning is left exactly as it is. MIG mode itself is never changed."""

    gpus: tuple[str, ...] = ()
    grace_seconds: float = 60.0

    def allows(self, index: int, uuid: str) -> bool:
        return "all" in self.gpus or uuid in self.gpus or str(index) in self.gpus


@dataclass(frozen=True)
class Config:
    version: str = VERSION
    resource_domain: str = contract.DEFAULT_DOMAIN
    memory_unit_mib: int = 1024
    reserved_mib_per_gpu: int = 0
    default_gpu_mode: GpuMode = GpuMode.SHARED
    gpu_modes: Mapping[str, GpuMode] = field(default_factory=dict)  # by GPU index ("0") or UUID
    device_list_strategy: DeviceListStrategy = DeviceListStrategy.ENVVAR
    quota_host_dir: str = contract.HOST_QUOTA_ROOT
    health: HealthConfig = field(default_factory=HealthConfig)
    extender: ExtenderConfig = field(default_factory=ExtenderConfig)
    quota: QuotaConfig = field(default_factory=QuotaConfig)
    enforcement: EnforcementConfig = field(default_factory=EnforcementConfig)
    dra: DraConfig = field(default_factory=DraConfig)
    warm_tier: WarmTierConfig = field(default_factory=WarmTierConfig)
    dynamic_mig: DynamicMigConfig = field(default_factory=DynamicMigConfig)

    @property
    def names(self) -> contract.Names:
        return contract.Names(self.resource_domain)

    def dra_partitions(self, index: int, uuid: str) -> bool:
        """Does the DRA plugin publish this GPU's MIG partitions (issue 24)? The admin's one consent for
        both paths (``dynamicMig.gpus``), unless ``dra.partitionableDevices`` is off."""
        return self.dra.partitionable_devices != "off" and self.dynamic_mig.allows(index, uuid)

    def mode_for(self, index: int, uuid: str, mig_enabled: bool) -> GpuMode:
        """A GPU in MIG mode is always offered as MIG; otherwise per-GPU config, then the default."""
        if mig_enabled:
            return GpuMode.MIG
        mode = self.gpu_modes.get(uuid) or self.gpu_modes.get(str(index)) or self.default_gpu_mode
        return mode

    def with_overrides(self, **changes: Any) -> "Config":
        """Apply CLI/env overrides; ``None`` means "not set" and leaves the value alone."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


# -- parsing ---------------------------------------------------------------------------------
_TOP_KEYS = {
    "version": "version", "resourceDomain": "resource_domain", "memoryUnitMiB": "memory_unit_mib",
    "reservedMiBPerGPU": "reserved_mib_per_gpu", "defaultGpuMode": "default_gpu_mode",
    "gpuModes": "gpu_modes", "deviceListStrategy": "device_list_strategy",
    "quotaHostDir": "quota_host_dir",
    "health": "health", "extender": "extender", "quota": "quota", "enforcement": "enforcement",
    "dra": "dra", "warmTier": "warm_tier", "dynamicMig": "dynamic_mig",
}
_DYNAMIC_MIG_KEYS = {"gpus": "gpus", "graceSeconds": "grace_seconds"}
_REMOVED_KEYS = {"mpsEnforcement": "replaced by enforcement.mode: mps (which also mounts the MPS pipe and "
                                   "shared-memory directories a client needs; the old switch did not)"}
_WARM_KEYS = {"enabled": "enabled", "modelCacheDir": "model_cache_dir", "scanIntervalSeconds": "scan_interval_seconds",
              "maxCacheEntries": "max_cache_entries", "residencyMaxSteps": "residency_max_steps"}
_DRA_KEYS = {"gpus": "gpus", "deviceTaints": "device_taints", "cdiRoot": "cdi_root", "stateDir": "state_dir",
             "partitionableDevices": "partitionable_devices"}
PARTITIONABLE_MODES = ("auto", "on", "off")
_HEALTH_KEYS = {"ignoredXids": "ignored_xids", "disabled": "disabled",
                "recoveryProbeSeconds": "recovery_probe_seconds", "probesToRecover": "probes_to_recover"}
_EXTENDER_KEYS = {"policy": "policy", "assumeTimeoutSeconds": "assume_timeout_seconds",
                  "workloadWindow": "workload_window", "tlsCertFile": "tls_cert_file",
                  "tlsKeyFile": "tls_key_file", "clientCAFile": "client_ca_file",
                  "metricsListen": "metrics_listen",
                  "holdTimeoutSeconds": "hold_timeout_seconds", "schedulerName": "scheduler_name"}
_QUOTA_KEYS = {"enabled": "enabled", "intervalSeconds": "interval_seconds",
               "floorFraction": "floor_fraction", "ceilingFraction": "ceiling_fraction",
               "stepMiB": "step_mib", "marginMiB": "margin_mib", "kvPressure": "kv_pressure",
               "processAttribution": "process_attribution",
               "peakWindowTicks": "peak_window_ticks", "protectRequests": "protect_requests",
               "shareSpare": "share_spare", "idleSeconds": "idle_seconds", "classes": "classes",
               "headroom": "headroom", "loans": "loans", "startupTicks": "startup_ticks"}
_CLASS_KEYS = {k: k for k in ("name", "floorFraction", "floorMiB", "ceilingFraction", "ceilingMiB", "marginMiB",
                              "idleSeconds", "lendingPriority", "overLimitAction", "allowPodSelection", "match",
                              "sleepBookedFraction", "wakeReserve", "wakeAhead")}
_MATCH_KEYS = {"namespaces": "namespaces", "selector": "selector", "priorityClassNames": "priority_class_names"}
_SELECTOR_KEYS = {"matchLabels": "match_labels", "matchExpressions": "match_expressions"}
_EXPRESSION_KEYS = {"key": "key", "operator": "operator", "values": "values"}
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_ENFORCEMENT_KEYS = {"mode": "mode", "mpsPipeDirectory": "mps_pipe_directory",
                     "mpsShmDirectory": "mps_shm_directory", "overLimitAction": "over_limit_action",
                     "overLimitGraceSeconds": "over_limit_grace_seconds"}


_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)+$")


def _check_keys(obj: Any, allowed: Mapping[str, str], where: str) -> dict[str, Any]:
    if obj is None:
        return {}
    if not isinstance(obj, dict):
        raise ConfigError(f"{where.rstrip('.') or 'config'}: expected a mapping, got {type(obj).__name__}")
    for key in obj:
        if key not in allowed:
            raise ConfigError(f"{where}{key}: unknown key (known: {', '.join(sorted(allowed))})")
    return obj


def _typed(value: Any, kind: type, key: str) -> Any:
    """``value`` as ``kind``; a number must also be finite and within :data:`BOUNDS` for ``key``."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:
            raise ConfigError(f"{key}: {value} is too large to be a number of this kind") from None
    if not isinstance(value, kind) or (kind in (int, float) and isinstance(value, bool)):
        raise ConfigError(f"{key}: expected {kind.__name__}, got {value!r}")
    if kind in (int, float):
        _bounded(value, key)
    return value


def _bounded(value: float, key: str) -> None:
    """The one place every number is checked: finite, and within what its consumer can use."""
    bound = BOUNDS[re.sub(r"\[\d+\]", "", key)]  # quota.classes[2].floorMiB -> quota.classes.floorMiB
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}: must be a finite number between {_num(bound.low)} and {_num(bound.high)}, "
                          f"got {value!r}")
    if value < bound.low:
        raise ConfigError(f"{key}: must be >= {_num(bound.low)} ({bound.why}), got {value!r}")
    if value > bound.high:
        raise ConfigError(f"{key}: must be <= {_num(bound.high)} ({bound.why}), got {value!r}")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _scheduler_name(value: Any) -> str:
    name = _typed(value, str, "extender.schedulerName")
    if not name.strip():
        raise ConfigError("extender.schedulerName: must not be empty")
    return name


def _enum(value: Any, kind: type[enum.Enum], key: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(m.value for m in kind)  # type: ignore[attr-defined]
        raise ConfigError(f"{key}: {value!r} is not one of {allowed}") from None


def _absolute(path: str, key: str) -> str:
    if not path.startswith("/"):
        raise ConfigError(f"{key}: {path!r} must be an absolute host path")
    return path


def parse_config(text: str, environ: Mapping[str, str] | None = None) -> Config:
    """Parse and validate a v1 config document; an empty document gives the defaults.

    ``environ`` (pass ``os.environ`` from a main) applies the ``VRAMSHARE_*`` overrides of
    :data:`ENV_KEYS` on top of the file; ``None`` reads the file alone.
    """
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config is not valid YAML: {exc}") from exc
    if environ is not None:
        raw = merge_env(raw, environ)
    return config_from_dict(raw)


# -- environment overrides ---------------------------------------------------------------------
# Precedence: CLI flag > VRAMSHARE_* variable > file > default. Only these variables are read:
# other VRAMSHARE_* names mean other things (VRAMSHARE_CONFIG is the file's path, VRAMSHARE_GPU_UUIDS
# is what a container gets). Lists are comma-separated; booleans are true/false.
ENV_KEYS: dict[str, tuple[str, ...]] = {
    "VRAMSHARE_RESOURCE_DOMAIN": ("resourceDomain",),
    "VRAMSHARE_MEMORY_UNIT_MIB": ("memoryUnitMiB",),
    "VRAMSHARE_RESERVED_MIB_PER_GPU": ("reservedMiBPerGPU",),
    "VRAMSHARE_DEFAULT_GPU_MODE": ("defaultGpuMode",),
    "VRAMSHARE_DEVICE_LIST_STRATEGY": ("deviceListStrategy",),
    "VRAMSHARE_ENFORCEMENT_MODE": ("enforcement", "mode"),
    "VRAMSHARE_QUOTA_HOST_DIR": ("quotaHostDir",),
    "VRAMSHARE_HEALTH_IGNORED_XIDS": ("health", "ignoredXids"),
    "VRAMSHARE_HEALTH_DISABLED": ("health", "disabled"),
    "VRAMSHARE_EXTENDER_POLICY": ("extender", "policy"),
    "VRAMSHARE_QUOTA_ENABLED": ("quota", "enabled"),
}


def _env_value(path: tuple[str, ...], text: str) -> Any:
    def scalar(item: str) -> Any:
        try:
            return yaml.safe_load(item)
        except yaml.YAMLError:
            return item
    if path[-1] == "ignoredXids":
        return [scalar(x.strip()) for x in text.split(",") if x.strip()]
    value = scalar(text.strip())
    return text.strip() if value is None else value


def merge_env(raw: Any, environ: Mapping[str, str]) -> Any:
    """The raw file document with the set ``VRAMSHARE_*`` overrides merged in.

    Each variable is checked on its own first, so a bad one is named (``VRAMSHARE_MEMORY_UNIT_MIB:
    memoryUnitMiB: expected int, got 'lots'``) rather than blamed on the file.
    """
    merged = dict(raw) if isinstance(raw, dict) else ({} if raw is None else raw)
    if not isinstance(merged, dict):
        return merged  # config_from_dict names the problem
    for name, path in ENV_KEYS.items():
        if name not in environ:
            continue
        value = _env_value(path, environ[name])
        alone: dict[str, Any] = {path[0]: value} if len(path) == 1 else {path[0]: {path[1]: value}}
        try:
            config_from_dict(alone)
        except ConfigError as exc:
            raise ConfigError(f"{name}: {exc}") from None
        if len(path) == 1:
            merged[path[0]] = value
        else:
            section = merged.get(path[0])
            merged[path[0]] = {**(section if isinstance(section, dict) else {}), path[1]: value}
    return merged


def _extender_tls(e: Mapping[str, Any]) -> dict[str, Any]:
    """The extender's TLS files (all three or none, absolute paths) and its metrics listener."""
    out: dict[str, Any] = {}
    for key, attr in (("tlsCertFile", "tls_cert_file"), ("tlsKeyFile", "tls_key_file"),
                      ("clientCAFile", "client_ca_file")):
        value = e.get(key)
        if value is not None:
            out[attr] = _absolute(_typed(value, str, f"extender.{key}"), f"extender.{key}")
    if out and len(out) != 3:
        missing = [k for k, a in (("tlsCertFile", "tls_cert_file"), ("tlsKeyFile", "tls_key_file"),
                                  ("clientCAFile", "client_ca_file")) if a not in out]
        raise ConfigError(f"extender: TLS needs tlsCertFile, tlsKeyFile and clientCAFile; missing {', '.join(missing)}")
    listen = e.get("metricsListen")
    if listen is not None:
        listen = _typed(listen, str, "extender.metricsListen")
        host, _, port = listen.rpartition(":")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"extender.metricsListen: {listen!r} is not HOST:PORT")
        out["metrics_listen"] = listen
    return out


def config_from_dict(raw: Any) -> Config:
    for key, why in _REMOVED_KEYS.items():
        if isinstance(raw, dict) and key in raw:
            raise ConfigError(f"{key}: {why}")
    top = _check_keys(raw, _TOP_KEYS, "")
    version = top.get("version", VERSION) or VERSION
    if version != VERSION:
        raise ConfigError(f"version: unknown version {version!r} (this build reads {VERSION!r})")
    d = Config()
    domain = _typed(top.get("resourceDomain", d.resource_domain), str, "resourceDomain")
    if len(domain) > 253 or not _DNS_SUBDOMAIN.match(domain):
        raise ConfigError(f"resourceDomain: {domain!r} is not a DNS domain like vramshare.io")
    modes = {}
    raw_modes = top.get("gpuModes") or {}
    if not isinstance(raw_modes, dict):
        raise ConfigError(f"gpuModes: expected a mapping of GPU index or UUID to mode, got {raw_modes!r}")
    for k, v in raw_modes.items():
        mode = _enum(v, GpuMode, f"gpuModes.{k}")
        if mode is GpuMode.MIG:
            raise ConfigError(f"gpuModes.{k}: 'mig' follows the GPU's MIG mode and cannot be set here")
        modes[str(k)] = mode
    default_mode = _enum(top.get("defaultGpuMode", d.default_gpu_mode.value), GpuMode, "defaultGpuMode")
    if default_mode is GpuMode.MIG:
        raise ConfigError("defaultGpuMode: must be shared or exclusive")
    h = _check_keys(top.get("health"), _HEALTH_KEYS, "health.")
    xids = h.get("ignoredXids", list(DEFAULT_IGNORED_XIDS))
    if not isinstance(xids, list):
        raise ConfigError(f"health.ignoredXids: expected a list of integers, got {xids!r}")
    health = HealthConfig(
        ignored_xids=tuple(_typed(x, int, f"health.ignoredXids[{i}]") for i, x in enumerate(xids)),
        disabled=_typed(h.get("disabled", False), bool, "health.disabled"),
        recovery_probe_seconds=_typed(h.get("recoveryProbeSeconds", 30.0), float,
                                      "health.recoveryProbeSeconds"),
        probes_to_recover=_typed(h.get("probesToRecover", 3), int, "health.probesToRecover"),
    )
    e = _check_keys(top.get("extender"), _EXTENDER_KEYS, "extender.")
    ext = ExtenderConfig(
        policy=_enum(e.get("policy", d.extender.policy.value), Policy, "extender.policy"),
        assume_timeout_seconds=_typed(e.get("assumeTimeoutSeconds", d.extender.assume_timeout_seconds),
                                      float, "extender.assumeTimeoutSeconds"),
        workload_window=_typed(e.get("workloadWindow", d.extender.workload_window), int,
                               "extender.workloadWindow"),
        hold_timeout_seconds=_typed(e.get("holdTimeoutSeconds", d.extender.hold_timeout_seconds), float,
                                    "extender.holdTimeoutSeconds"),
        scheduler_name=_scheduler_name(e.get("schedulerName", d.extender.scheduler_name)),
        **_extender_tls(e),
    )
    q = _check_keys(top.get("quota"), _QUOTA_KEYS, "quota.")
    quota = QuotaConfig(
        enabled=_typed(q.get("enabled", True), bool, "quota.enabled"),
        interval_seconds=_typed(q.get("intervalSeconds", 10.0), float, "quota.intervalSeconds"),
        floor_fraction=_typed(q.get("floorFraction", 0.5), float, "quota.floorFraction"),
        ceiling_fraction=_typed(q.get("ceilingFraction", 1.5), float, "quota.ceilingFraction"),
        step_mib=_typed(q.get("stepMiB", 512), int, "quota.stepMiB"),
        margin_mib=_typed(q.get("marginMiB", 1024), int, "quota.marginMiB"),
        kv_pressure=_typed(q.get("kvPressure", 0.9), float, "quota.kvPressure"),
        process_attribution=_typed(q.get("processAttribution", False), bool, "quota.processAttribution"),
        peak_window_ticks=_typed(q.get("peakWindowTicks", 60), int, "quota.peakWindowTicks"),
        protect_requests=_typed(q.get("protectRequests", True), bool, "quota.protectRequests"),
        share_spare=_typed(q.get("shareSpare", True), bool, "quota.shareSpare"),
        idle_seconds=_typed(q.get("idleSeconds", 300.0), float, "quota.idleSeconds"),
        classes=_quota_classes(q.get("classes")),
        headroom=_typed(q.get("headroom", "forecast"), str, "quota.headroom"),
        loans=_typed(q.get("loans", "releasing"), str, "quota.loans"),
        startup_ticks=_typed(q.get("startupTicks", 30), int, "quota.startupTicks"),
    )
    if quota.loans not in QUOTA_LOAN_RULES:
        raise ConfigError(f"quota.loans: {quota.loans!r} is not one of {', '.join(QUOTA_LOAN_RULES)}")
    if quota.headroom not in QUOTA_HEADROOM_RULES:
        raise ConfigError(f"quota.headroom: {quota.headroom!r} is not one of {', '.join(QUOTA_HEADROOM_RULES)}")
    en = _check_keys(top.get("enforcement"), _ENFORCEMENT_KEYS, "enforcement.")
    modes_ok = [ENFORCEMENT_AUTO] + [m.value for m in EnforcementMode]
    mode = _typed(en.get("mode", ENFORCEMENT_AUTO), str, "enforcement.mode")
    if mode not in modes_ok:
        raise ConfigError(f"enforcement.mode: {mode!r} is not one of {', '.join(modes_ok)}")
    enforcement = EnforcementConfig(
        mode=mode,
        mps_pipe_directory=_absolute(_typed(en.get("mpsPipeDirectory", EnforcementConfig.mps_pipe_directory), str,
                                            "enforcement.mpsPipeDirectory"), "enforcement.mpsPipeDirectory"),
        mps_shm_directory=_absolute(_typed(en.get("mpsShmDirectory", EnforcementConfig.mps_shm_directory), str,
                                           "enforcement.mpsShmDirectory"), "enforcement.mpsShmDirectory"),
        over_limit_action=_enum(en.get("overLimitAction", OverLimitAction.EVENT.value), OverLimitAction,
                                "enforcement.overLimitAction"),
        over_limit_grace_seconds=_typed(en.get("overLimitGraceSeconds", 60.0), float,
                                        "enforcement.overLimitGraceSeconds"),
    )
    if quota.floor_fraction > 1 or quota.ceiling_fraction < 1:
        raise ConfigError("quota: floorFraction must be <= 1 <= ceilingFraction")
    if quota.kv_pressure > 1:
        raise ConfigError(f"quota.kvPressure: must be <= 1 (a fraction of the KV cache), got {quota.kv_pressure}")
    dra = _dra_config(top.get("dra"))
    if dra.gpus and len(contract.Names(domain).dra_driver) > 63:
        # the API server refuses a ResourceSlice whose driver is not a CSI-style driver name
        # (at most 63 characters): every DRA device of the node would be refused
        raise ConfigError(f"resourceDomain: {domain!r} is too long for DRA: the driver name "
                          f"{contract.Names(domain).dra_driver!r} must be at most 63 characters")
    return Config(
        dra=dra,
        warm_tier=_warm_config(top.get("warmTier")),
        dynamic_mig=_dynamic_mig_config(top.get("dynamicMig")),
        version=VERSION,
        resource_domain=domain,
        memory_unit_mib=_typed(top.get("memoryUnitMiB", d.memory_unit_mib), int, "memoryUnitMiB"),
        reserved_mib_per_gpu=_typed(top.get("reservedMiBPerGPU", d.reserved_mib_per_gpu), int,
                                    "reservedMiBPerGPU"),
        default_gpu_mode=default_mode,
        gpu_modes=modes,
        device_list_strategy=_enum(top.get("deviceListStrategy", d.device_list_strategy.value),
                                   DeviceListStrategy, "deviceListStrategy"),
        quota_host_dir=_absolute(_typed(top.get("quotaHostDir", d.quota_host_dir), str, "quotaHostDir"),
                                 "quotaHostDir"),
        health=health,
        extender=ext,
        quota=quota,
        enforcement=enforcement,
    )


def _strings(value: Any, key: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ConfigError(f"{key}: expected a list of strings, got {value!r}")
    out = tuple(_typed(v, str, f"{key}[{i}]") for i, v in enumerate(value))
    for i, v in enumerate(out):
        if not v:
            raise ConfigError(f"{key}[{i}]: must not be empty")
    return out


def _selector(raw: Any, where: str) -> tuple[tuple[tuple[str, str], ...], tuple[LabelExpression, ...]]:
    """A Kubernetes LabelSelector (metav1.LabelSelector), validated as the API server does."""
    sel = _check_keys(raw, _SELECTOR_KEYS, f"{where}.")
    labels = sel.get("matchLabels") or {}
    if not isinstance(labels, dict):
        raise ConfigError(f"{where}.matchLabels: expected a mapping of label to value, got {labels!r}")
    pairs = tuple(sorted((_typed(k, str, f"{where}.matchLabels"), _typed(v, str, f"{where}.matchLabels.{k}"))
                         for k, v in labels.items()))
    exprs = sel.get("matchExpressions") or []
    if not isinstance(exprs, list):
        raise ConfigError(f"{where}.matchExpressions: expected a list, got {exprs!r}")
    out = []
    for i, e in enumerate(exprs):
        at = f"{where}.matchExpressions[{i}]"
        e = _check_keys(e, _EXPRESSION_KEYS, f"{at}.")
        key = _typed(e.get("key"), str, f"{at}.key")
        op = _typed(e.get("operator"), str, f"{at}.operator")
        values = _strings(e.get("values", []), f"{at}.values")
        if op in ("In", "NotIn") and not values:
            raise ConfigError(f"{at}.values: must be non-empty for operator {op}")
        if op in ("Exists", "DoesNotExist") and values:
            raise ConfigError(f"{at}.values: must be empty for operator {op}")
        if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
            raise ConfigError(f"{at}.operator: {op!r} is not one of In, NotIn, Exists, DoesNotExist")
        out.append(LabelExpression(key, op, values))
    return pairs, tuple(out)


def _class_match(raw: Any, where: str) -> tuple[ClassMatch, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError(f"{where}: expected a list of terms (namespaces, selector, priorityClassNames), "
                          f"got {raw!r}")
    terms = []
    for i, t in enumerate(raw):
        at = f"{where}[{i}]"
        t = _check_keys(t, _MATCH_KEYS, f"{at}.")
        labels, exprs = _selector(t.get("selector"), f"{at}.selector")
        terms.append(ClassMatch(namespaces=_strings(t.get("namespaces", []), f"{at}.namespaces"),
                                match_labels=labels, match_expressions=exprs,
                                priority_class_names=_strings(t.get("priorityClassNames", []),
                                                              f"{at}.priorityClassNames")))
    return tuple(terms)


def _one_of(c: Mapping[str, Any], frac: str, mib: str, at: str) -> tuple[float | None, int | None]:
    if frac in c and mib in c:
        raise ConfigError(f"{at}.{mib}: set {frac} (of the request) or {mib} (absolute), not both")
    f = _typed(c[frac], float, f"{at}.{frac}") if frac in c else None
    m = _typed(c[mib], int, f"{at}.{mib}") if mib in c else None
    return f, m


def _quota_class(raw: Any, at: str) -> QuotaClass:
    c = _check_keys(raw, _CLASS_KEYS, f"{at}.")
    if "name" not in c:
        raise ConfigError(f"{at}.name: every class needs a name")
    name = _typed(c["name"], str, f"{at}.name")
    if len(name) > 63 or not _DNS_LABEL.match(name):
        raise ConfigError(f"{at}.name: {name!r} is not a DNS label (lower case, digits, '-', at most 63)")
    if name == DEFAULT_CLASS:
        raise ConfigError(f"{at}.name: 'default' is the class of the global quota keys "
                          f"(quota.floorFraction, ...); set those instead")
    floor_f, floor_m = _one_of(c, "floorFraction", "floorMiB", at)
    ceil_f, ceil_m = _one_of(c, "ceilingFraction", "ceilingMiB", at)
    if floor_f is not None and floor_f > 1:
        raise ConfigError(f"{at}.floorFraction: must be <= 1 (a floor above the request cannot be held), "
                          f"got {floor_f}")
    if floor_f is not None and ceil_f is not None and ceil_f < floor_f:
        raise ConfigError(f"{at}.ceilingFraction: must be >= floorFraction {floor_f}, got {ceil_f}")
    if floor_m is not None and ceil_m is not None and ceil_m < floor_m:
        raise ConfigError(f"{at}.ceilingMiB: must be >= floorMiB {floor_m}, got {ceil_m}")
    idle = c.get("idleSeconds")
    if idle is False or idle == "off":  # YAML 1.1 reads a bare off as false
        idle = 0.0
    elif idle is not None:
        idle = _typed(idle, float, f"{at}.idleSeconds")
    action = c.get("overLimitAction")
    return QuotaClass(
        name=name, floor_fraction=floor_f, floor_mib=floor_m, ceiling_fraction=ceil_f, ceiling_mib=ceil_m,
        margin_mib=_typed(c["marginMiB"], int, f"{at}.marginMiB") if "marginMiB" in c else None,
        idle_seconds=idle,
        lending_priority=_typed(c.get("lendingPriority", 0), int, f"{at}.lendingPriority"),
        over_limit_action=None if action is None else _enum(action, OverLimitAction, f"{at}.overLimitAction"),
        allow_pod_selection=_typed(c.get("allowPodSelection", False), bool, f"{at}.allowPodSelection"),
        match=_class_match(c.get("match"), f"{at}.match"),
        sleep_booked_fraction=(_typed(c["sleepBookedFraction"], float, f"{at}.sleepBookedFraction")
                               if "sleepBookedFraction" in c else None),
        wake_reserve=_typed(c.get("wakeReserve", 1), int, f"{at}.wakeReserve"),
        wake_ahead=_typed(c.get("wakeAhead", False), bool, f"{at}.wakeAhead"))


def _quota_classes(raw: Any) -> tuple[QuotaClass, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError(f"quota.classes: expected a list of classes, got {type(raw).__name__}")
    out: list[QuotaClass] = []
    for i, item in enumerate(raw):
        qc = _quota_class(item, f"quota.classes[{i}]")
        if any(o.name == qc.name for o in out):
            raise ConfigError(f"quota.classes[{i}].name: {qc.name!r} is already the name of an earlier class")
        out.append(qc)
    return tuple(out)


def _dra_config(raw: Any) -> DraConfig:
    r = _check_keys(raw, _DRA_KEYS, "dra.")
    d = DraConfig()
    mode = r.get("partitionableDevices", d.partitionable_devices)
    if mode not in PARTITIONABLE_MODES:
        raise ConfigError(f"dra.partitionableDevices: expected one of {', '.join(PARTITIONABLE_MODES)}, got {mode!r}")
    return DraConfig(
        gpus=_gpu_list(r.get("gpus", []), "dra.gpus"),
        partitionable_devices=mode,
        device_taints=_typed(r.get("deviceTaints", False), bool, "dra.deviceTaints"),
        cdi_root=_absolute(_typed(r.get("cdiRoot", d.cdi_root), str, "dra.cdiRoot"), "dra.cdiRoot"),
        state_dir=_absolute(_typed(r.get("stateDir", d.state_dir), str, "dra.stateDir"), "dra.stateDir"),
    )


def _gpu_list(raw: Any, key: str) -> tuple[str, ...]:
    """``"all"`` or a list of GPU indexes or UUIDs (as ``dra.gpus``)."""
    gpus = ["all"] if raw == "all" else raw
    if not isinstance(gpus, list) or not all(isinstance(g, (str, int)) and not isinstance(g, bool) for g in gpus):
        raise ConfigError(f"{key}: expected \"all\" or a list of GPU indexes or UUIDs, got {raw!r}")
    return tuple(str(g) for g in gpus)


def _dynamic_mig_config(raw: Any) -> DynamicMigConfig:
    r = _check_keys(raw, _DYNAMIC_MIG_KEYS, "dynamicMig.")
    d = DynamicMigConfig()
    return DynamicMigConfig(
        gpus=_gpu_list(r.get("gpus", []), "dynamicMig.gpus"),
        grace_seconds=_typed(r.get("graceSeconds", d.grace_seconds), float, "dynamicMig.graceSeconds"),
    )


def _warm_config(raw: Any) -> WarmTierConfig:
    r = _check_keys(raw, _WARM_KEYS, "warmTier.")
    d = WarmTierConfig()
    cache = r.get("modelCacheDir")
    return WarmTierConfig(
        enabled=_typed(r.get("enabled", d.enabled), bool, "warmTier.enabled"),
        model_cache_dir=None if cache is None else _absolute(_typed(cache, str, "warmTier.modelCacheDir"),
                                                             "warmTier.modelCacheDir"),
        scan_interval_seconds=_typed(r.get("scanIntervalSeconds", d.scan_interval_seconds), float,
                                     "warmTier.scanIntervalSeconds"),
        max_cache_entries=_typed(r.get("maxCacheEntries", d.max_cache_entries), int, "warmTier.maxCacheEntries"),
        residency_max_steps=_typed(r.get("residencyMaxSteps", d.residency_max_steps), float,
                                   "warmTier.residencyMaxSteps"),
    )


def node_limits(config: Config, inventory: NodeInventory) -> None:
    """The bounds only a node can check (its GPUs are known there): every shared GPU keeps at least one
    unit after ``reservedMiBPerGPU``, and the node's memory units fit one ListAndWatch message.
    Raises :class:`ConfigError` naming the key and the bound; the device plugin calls it at start."""
    units = 0
    for g in inventory.gpus:
        if g.mode is not GpuMode.SHARED:
            continue
        if g.units < 1:
            raise ConfigError(f"reservedMiBPerGPU: {config.reserved_mib_per_gpu} leaves GPU {g.index} ({g.uuid}, "
                              f"{g.memory_mib} MiB) less than one unit of memoryUnitMiB {config.memory_unit_mib}: "
                              f"it would offer no device")
        units += g.units
    if units > MAX_DEVICES_PER_MESSAGE:
        raise ConfigError(f"memoryUnitMiB: {config.memory_unit_mib} makes {units} devices on this node, more than "
                          f"the {MAX_DEVICES_PER_MESSAGE} one ListAndWatch message carries within the kubelet's "
                          f"4 MiB gRPC receive limit: use a larger unit")


#: Keys a live reload keeps at their running value (a restart applies the new one), by the file's dotted
#: key and the attribute path in :class:`Config`. The unit and the reserve: device IDs (``<gpu>::<n>``,
#: the n-th unit of this size after this reserve) already handed out would change meaning. The
#: directories: what the running plugin wrote lives there (quota files the loop maintains, CDI specs the
#: container runtime reads, the prepared-claims checkpoint, the MPS daemon found at start) and the
#: DaemonSet mounts only those host paths. The rest are read once, when the plugin builds the part
#: they configure (the health watch, the warm tier, the per-process reader): a live value would be a
#: config in force that nothing follows.
RESTART_ONLY: dict[str, tuple[str, ...]] = {
    "memoryUnitMiB": ("memory_unit_mib",), "reservedMiBPerGPU": ("reserved_mib_per_gpu",),
    "dynamicMig": ("dynamic_mig",), "quotaHostDir": ("quota_host_dir",),
    "dra.cdiRoot": ("dra", "cdi_root"), "dra.stateDir": ("dra", "state_dir"),
    "enforcement.mode": ("enforcement", "mode"), "enforcement.mpsPipeDirectory": ("enforcement", "mps_pipe_directory"),
    "enforcement.mpsShmDirectory": ("enforcement", "mps_shm_directory"),
    "health": ("health",), "quota.processAttribution": ("quota", "process_attribution"),
    "warmTier.enabled": ("warm_tier", "enabled"), "warmTier.modelCacheDir": ("warm_tier", "model_cache_dir"),
    "warmTier.scanIntervalSeconds": ("warm_tier", "scan_interval_seconds"),
    "warmTier.maxCacheEntries": ("warm_tier", "max_cache_entries")}
_RESTART_WHY = {
    "dynamicMig": "the GPUs whose MIG instances the plugin makes and destroys are fixed at its start",
    "quotaHostDir": "running containers' quota files and the quota loop are in the running directory, the "
                    "only one the DaemonSet mounts (change the manifest's hostPath with it)",
    "dra.cdiRoot": "prepared claims' CDI specs are in the running directory, the one the container runtime reads",
    "dra.stateDir": "the prepared-claims checkpoint is in the running directory",
    "enforcement.mode": "the node's fence is detected and pinned at start",
    "enforcement.mpsPipeDirectory": "the MPS daemon was found there at start and containers mount it",
    "enforcement.mpsShmDirectory": "the MPS daemon was found there at start and containers mount it",
    "health": "the GPU health watch is started with it",
    "quota.processAttribution": "the quota loop's usage readers are built with it",
    "warmTier.enabled": "the warm tier's broker and sockets are built at start",
    "warmTier.modelCacheDir": "the model cache scanner is started with it",
    "warmTier.scanIntervalSeconds": "the model cache scanner is started with it",
    "warmTier.maxCacheEntries": "the model cache scanner is started with it",
    "quota.enabled": "the quota loop is built at start only when it is on (turning it off pauses it live)",
}
_UNITS_WHY = "device IDs already handed out name units of the running value"


def _get(config: Config, path: tuple[str, ...]) -> Any:
    value: Any = config
    for attr in path:
        value = getattr(value, attr)
    return value


def _with(obj: Any, path: tuple[str, ...], value: Any) -> Any:
    """``obj`` (a frozen dataclass) with the attribute at ``path`` replaced."""
    head, *rest = path
    return dataclasses.replace(obj, **{head: _with(getattr(obj, head), tuple(rest), value) if rest else value})


def keep_restart_only(running: Config, new: Config) -> tuple[Config, list[KeyChange]]:
    """``new`` with the running value of every key a node plugin reads only at start (:func:`applies`:
    the :data:`RESTART_ONLY` keys, and ``quota.enabled`` turned on), and the changes it so refused
    (:func:`refusal` says why, for the log). The rest of the reload applies (issue 17 item 8)."""
    refused = []
    for change in key_changes(running, new):
        if NODE_RESTART in change.applies:
            refused.append(change)
            new = _with(new, change.path, _get(running, change.path))
    return new, refused


def refusal(change: KeyChange) -> str:
    """Why a live reload kept the running value of ``change``'s key (one of :func:`keep_restart_only`'s)."""
    top = next((k for k in RESTART_ONLY if _under(change.key, (k,))), change.key)
    return (f"{change.key}: {change.old} -> {change.new} refused on a live reload: "
            f"{_RESTART_WHY.get(top, _UNITS_WHY)}; restart the plugin to apply it")


#: When a changed key takes effect (:func:`key_changes`): the node plugins reload the file live except
#: the :data:`RESTART_ONLY` keys and turning ``quota.enabled`` on; the extender reads it at start only.
LIVE, NODE_RESTART, EXTENDER_RESTART = "live on the node plugins", "a node plugin restart", "an extender restart"
#: The keys the extender reads (its main and accounting), and those only it reads.
EXTENDER_READS = ("resourceDomain", "memoryUnitMiB", "extender", "warmTier.residencyMaxSteps")
_EXTENDER_ONLY = ("extender", "warmTier.residencyMaxSteps")
_SECTIONS: dict[type, Mapping[str, str]] = {}  # filled below the dataclasses' key tables


@dataclass(frozen=True)
class KeyChange:
    """One file key whose value differs between two configs, and when the new value takes effect."""

    key: str  # the file's dotted key: quota.idleSeconds
    old: Any
    new: Any
    applies: tuple[str, ...]  # LIVE or NODE_RESTART where the node plugins read it, + EXTENDER_RESTART
    path: tuple[str, ...] = ()  # the attribute path in Config: ("quota", "idle_seconds")


def _under(key: str, keys: tuple[str, ...]) -> bool:
    return any(key == k or key.startswith(k + ".") for k in keys)


def applies(key: str, old: Any = None, new: Any = None) -> tuple[str, ...]:
    """When a change of the file key ``key`` (dotted) from ``old`` to ``new`` takes effect (as
    :func:`keep_restart_only` decides on the node plugins)."""
    node: tuple[str, ...] = ()
    if not _under(key, _EXTENDER_ONLY):
        restart = _under(key, tuple(RESTART_ONLY)) or (key == "quota.enabled" and new is True and old is False)
        node = (NODE_RESTART,) if restart else (LIVE,)
    return node + ((EXTENDER_RESTART,) if _under(key, EXTENDER_READS) else ())


def _shown(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple) and value and dataclasses.is_dataclass(value[0]):
        return [getattr(v, "name", v) for v in value]  # quota classes: by name
    return value


def key_changes(old: Config, new: Config) -> list[KeyChange]:
    """The file keys whose values differ, in the file's order, each with when it applies; sections are
    walked to their leaves, a list (``quota.classes``) is one key. What an admin wants to know before
    ``kubectl apply`` (``vramshare check --config FILE``)."""
    out: list[KeyChange] = []

    def walk(a: Any, b: Any, prefix: str, at: tuple[str, ...]) -> None:
        for key, attr in _SECTIONS[type(a)].items():
            x, y = getattr(a, attr), getattr(b, attr)
            if x == y:
                continue
            if type(x) in _SECTIONS:
                walk(x, y, f"{prefix}{key}.", (*at, attr))
            else:
                out.append(KeyChange(prefix + key, _shown(x), _shown(y), applies(prefix + key, x, y), (*at, attr)))

    walk(old, new, "", ())
    return out


def file_values(config: Config, keys: tuple[str, ...]) -> dict[str, Any]:
    """``config`` as the file spells it (sections nested, the file's key names, plain JSON values), only
    under ``keys`` (dotted; a section takes all of it): what a daemon reports it runs with, which
    :func:`config_from_dict` reads back (``vramshare check`` compares it with the ConfigMap)."""
    out: dict[str, Any] = {}

    def walk(obj: Any, prefix: str, into: dict[str, Any]) -> None:
        for key, attr in _SECTIONS[type(obj)].items():
            name, value = prefix + key, getattr(obj, attr)
            if type(value) in _SECTIONS and any(k.startswith(name + ".") for k in keys) and not _under(name, keys):
                walk(value, name + ".", into.setdefault(key, {}))
            elif _under(name, keys):
                into[key] = _plain(value)

    walk(config, "", out)
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {key: _plain(getattr(value, attr)) for key, attr in _SECTIONS[type(value)].items()}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


_SECTIONS.update({Config: _TOP_KEYS, HealthConfig: _HEALTH_KEYS, ExtenderConfig: _EXTENDER_KEYS,
                  QuotaConfig: _QUOTA_KEYS, EnforcementConfig: _ENFORCEMENT_KEYS, DraConfig: _DRA_KEYS,
                  WarmTierConfig: _WARM_KEYS, DynamicMigConfig: _DYNAMIC_MIG_KEYS})


def text_digest(text: str | bytes) -> str:
    """The identity of a config file's text (sha256, 16 hex characters): what a node plugin publishes as
    the config it runs (its inventory's ``config.digest``) and ``vramshare check`` computes from the
    ConfigMap's ``config.yaml``, which the kubelet projects byte for byte."""
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()[:16]


def load_config(path: str | None, environ: Mapping[str, str] | None = None) -> Config:
    """Read a config file; ``None`` gives the defaults. Raises :class:`ConfigError` (never OSError).

    ``environ`` applies the ``VRAMSHARE_*`` overrides (see :data:`ENV_KEYS`), with or without a file.
    """
    if path is None:
        return parse_config("", environ)
    try:
        with open(path, encoding="utf-8") as fh:
            return parse_config(fh.read(), environ)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
