"""Which way this node fences each container's GPU memory, and what Allocate adds for it.

Three modes (``vramshare.inventory.EnforcementMode``), best first:

* ``driver``: NVIDIA driver R615+ on cgroup v2, non-MIG GPUs. Every container's cgroup has a soft
  limit (its guaranteed share) and a hard limit (allocations beyond it fail). Allocate sets the
  container toolkit's ``NVIDIA_GPU_MEMORY_REQUEST`` / ``NVIDIA_GPU_MEMORY_LIMIT`` (whole MiB; its
  ``apply-cuda-memory-limits`` CDI hook applies them when the container is created); the quota loop
  then moves the limits with ``nvmlDeviceSetMemoryLimits_v1`` and reads ``currentUsed``.
* ``mps``: an MPS control daemon (NVIDIA's ``mps-control-daemon``) runs on the node. Allocate sets
  ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` per container and, as NVIDIA's device plugin does
  (``internal/plugin/mps.go``, ``updateReponse``), ``CUDA_MPS_PIPE_DIRECTORY`` with the pipe
  directory and the daemon's shared memory (``/dev/shm``) mounted. The limit is fixed at start.
* ``cooperative``: nothing fences. The quota file is the contract (the vLLM plugin obeys it) and the
  quota loop reports or evicts a container whose use stays above its limit.

:func:`choose` is pure: the facts the probe found in, a mode or :class:`EnforcementRefused` out. A
mode asked for by name that the node cannot honour is refused with the reason, never downgraded.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from vramshare import contract, logs
from vramshare.config import Config, EnforcementConfig
from vramshare.inventory import EnforcementMode, GpuMode

log = logs.get("vramshare.enforcement")

MIN_DRIVER_MAJOR = 615
#: What driver mode needs from the host, beyond the NVIDIA runtime's NVML (deploy/components/
#: driver-enforcement grants exactly this to the device plugin, components/dra-driver-enforcement to the
#: DRA plugin; tests/deploy/test_host_access.py checks both against these):
#: the host's cgroup v2 tree, to find other containers' cgroups (``nvml_limits.CgroupFinder``), read-only
#: at the same path; and the capability the driver checks for ``nvmlDeviceSetMemoryLimits_v1``, which
#: NVIDIA documents as privileged (the kernel module's administrator check is CAP_SYS_ADMIN, as for
#: NVML's other root-only calls). Nothing else: no privileged mode, no host PID namespace.
HOST_CGROUP_ROOT = contract.HOST_CGROUP_ROOT
DRIVER_CAPABILITY = "SYS_ADMIN"
CAP_BITS = {"SYS_ADMIN": 21}  # linux/capability.h
#: the node label that opts a node into the driver-enforcement DaemonSet variant
DRIVER_NODE_LABEL = ("vramshare.io/enforcement", "driver")
_DRIVER_VARIANT_HINT = ("run the driver-enforcement variant on this node: 'vramshare install --enforcement driver' "
                        "(deploy/components/driver-enforcement; the DRA plugin's: dra-driver-enforcement) and the "
                        f"node label {DRIVER_NODE_LABEL[0]}={DRIVER_NODE_LABEL[1]}")
MPS_CONTAINER_PIPE_DIR = "/mps/pipe"  # where a client finds the daemon's pipes
MPS_CONTAINER_SHM_DIR = "/dev/shm"  # the MPS server's shared memory, as NVIDIA mounts it
MPS_CONTROL_PIPE = "control"  # nvidia-cuda-mps-control creates this named pipe in its pipe directory


class EnforcementRefused(RuntimeError):
    """The mode asked for cannot be honoured on this node; ``str()`` says why."""


@dataclass(frozen=True)
class NodeFacts:
    """What the probe found. A ``*_problem`` of ``None`` means that requirement is met."""

    driver_version: str | None = None  # "615.12.01"; None when NVML is not there (simulated node)
    cgroup_v2: bool = False
    memory_limits_problem: str | None = "not probed"  # NVML memory limits unusable: why
    mps_problem: str | None = "not probed"  # no MPS control daemon to talk to: why
    host_access_problem: str | None = None  # the plugin lacks the host cgroups or the privilege: why

    def driver_problem(self) -> str | None:
        """Why ``driver`` mode is impossible here, or ``None``."""
        if self.driver_version is None:
            return "no NVIDIA driver (NVML not available)"
        try:
            major = int(self.driver_version.split(".")[0])
        except ValueError:
            return f"driver version {self.driver_version!r} unreadable"
        if major < MIN_DRIVER_MAJOR:
            return f"driver {self.driver_version} is older than R{MIN_DRIVER_MAJOR} (no per-cgroup memory limits)"
        if not self.cgroup_v2:
            return "the node runs cgroup v1; driver memory limits need cgroup v2"
        return self.host_access_problem or self.memory_limits_problem


@dataclass(frozen=True)
class Chosen:
    """The node's mode and the one line saying why (logged, shown by metrics and inspect)."""

    mode: EnforcementMode
    reason: str
    #: the better modes auto passed over, each with why (the metric vramshare_enforcement_unavailable)
    skipped: tuple[tuple[EnforcementMode, str], ...] = ()


def choose(requested: EnforcementMode | None, facts: NodeFacts) -> Chosen:
    """The mode to run: ``requested`` if the node honours it, else :class:`EnforcementRefused`;
    ``None`` (auto) takes the best the node supports: driver, then mps, then cooperative."""
    driver, mps = facts.driver_problem(), facts.mps_problem
    if requested is EnforcementMode.DRIVER:
        if driver:
            raise EnforcementRefused(f"enforcement.mode driver refused: {driver}")
        return Chosen(EnforcementMode.DRIVER, f"asked for; driver {facts.driver_version}, cgroup v2")
    if requested is EnforcementMode.MPS:
        if mps:
            raise EnforcementRefused(f"enforcement.mode mps refused: {mps}")
        return Chosen(EnforcementMode.MPS, "asked for; MPS control daemon answers")
    if requested is EnforcementMode.COOPERATIVE:
        return Chosen(EnforcementMode.COOPERATIVE, "asked for")
    if driver is None:
        return Chosen(EnforcementMode.DRIVER, f"auto: driver {facts.driver_version} with cgroup v2")
    if mps is None:
        return Chosen(EnforcementMode.MPS, f"auto: no driver limits ({driver}); MPS control daemon found",
                      ((EnforcementMode.DRIVER, driver),))
    return Chosen(EnforcementMode.COOPERATIVE, f"auto: no driver limits ({driver}); no MPS ({mps})",
                  ((EnforcementMode.DRIVER, driver), (EnforcementMode.MPS, mps)))


# -- the probe (adapter) --------------------------------------------------------------------------
def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def probe(nvml: Any | None, cfg: EnforcementConfig, *, cgroup_root: str = HOST_CGROUP_ROOT,
          shared_uuids: Sequence[str] = (), proc_status: str = "/proc/self/status") -> NodeFacts:
    """Read the facts :func:`choose` needs. ``nvml`` is pynvml (initialised) or ``None`` (no GPU).

    The memory-limit probe reads the limits of the cgroup root on each shared GPU and writes the same
    values back (a no-op that needs the privilege the loop will need), so a driver without the call
    (FunctionNotFound), a MIG GPU or vGPU (NotSupported) or a missing privilege (NoPermission) is
    found at start rather than at the first quota move. Before it, :func:`host_access_problem` checks
    what the deployment must grant (the capability, the host cgroup tree): an unprivileged install
    answers with the reason and the fix rather than advertising a mode whose first move would fail.
    """
    cgroup_v2 = os.path.exists(os.path.join(cgroup_root, "cgroup.controllers"))
    mps = _mps_problem(cfg)
    if nvml is None:
        return NodeFacts(None, cgroup_v2, "no NVML", mps)
    try:
        version = _text(nvml.nvmlSystemGetDriverVersion())
    except Exception as exc:  # noqa: BLE001 - any NVML failure means "no driver facts"
        return NodeFacts(None, cgroup_v2, f"driver version unreadable: {exc}", mps)
    host = host_access_problem(cgroup_root, proc_status)
    return NodeFacts(version, cgroup_v2, _limits_problem(nvml, shared_uuids), mps, host)


def _capabilities(proc_status: str) -> int | None:
    """The effective capability set of this process (``CapEff`` of /proc/self/status), or None."""
    try:
        with open(proc_status, encoding="ascii") as fh:
            for line in fh:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        return None
    return None


def host_access_problem(cgroup_root: str = HOST_CGROUP_ROOT, proc_status: str = "/proc/self/status") -> str | None:
    """Why this process cannot fence other containers in driver mode as deployed, or ``None``: it lacks
    :data:`DRIVER_CAPABILITY`, or ``cgroup_root`` shows its own cgroup namespace instead of the host's
    tree (no ``kubepods*`` cgroup: the host cgroup filesystem is not mounted there)."""
    caps = _capabilities(proc_status)
    bit = CAP_BITS[DRIVER_CAPABILITY]
    if caps is None or not caps >> bit & 1:
        return (f"this container lacks CAP_{DRIVER_CAPABILITY}, which nvmlDeviceSetMemoryLimits_v1 needs "
                f"(NVIDIA documents it as privileged): {_DRIVER_VARIANT_HINT}")
    try:
        tops = os.listdir(cgroup_root)
    except OSError as exc:
        return f"cannot read {cgroup_root}: {exc}: {_DRIVER_VARIANT_HINT}"
    if not any(name.startswith("kubepods") for name in tops):
        return (f"{cgroup_root} holds no kubepods cgroup, so it is this container's own cgroup namespace, not "
                f"the host's cgroup tree the fence searches: {_DRIVER_VARIANT_HINT}")
    return None


def _limits_problem(nvml: Any, shared_uuids: Sequence[str]) -> str | None:
    if not hasattr(nvml, "nvmlDeviceGetMemoryLimits_v1"):
        return "nvidia-ml-py has no nvmlDeviceGetMemoryLimits_v1 (needs 13.615 or newer)"
    if not shared_uuids:
        return "no shared GPU to fence"
    call = "nvmlDeviceGetHandleByUUID"
    for uuid in shared_uuids:
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
            now = nvml.c_nvmlGetMemoryLimits_v1_t(nameSpace=b"/")
            call = "nvmlDeviceGetMemoryLimits_v1"
            nvml.nvmlDeviceGetMemoryLimits_v1(handle, now)
            call = "nvmlDeviceSetMemoryLimits_v1"
            nvml.nvmlDeviceSetMemoryLimits_v1(handle, nvml.c_nvmlSetMemoryLimits_v1_t(
                nameSpace=b"/", softLimit=now.softLimit, hardLimit=now.hardLimit))
        except Exception as exc:  # noqa: BLE001 - pynvml raises NVMLError_* subclasses
            hint = " (the device plugin must run privileged)" if "NoPermission" in type(exc).__name__ else ""
            return f"{call} on {uuid}: {type(exc).__name__}: {_text(exc)}{hint}"
    return None


def _mps_problem(cfg: EnforcementConfig) -> str | None:
    pipe = os.path.join(cfg.mps_pipe_directory, MPS_CONTROL_PIPE)
    if not os.path.exists(pipe):
        return f"no MPS control pipe at {pipe}"
    if not os.path.isdir(cfg.mps_shm_directory):
        return f"no MPS shared-memory directory {cfg.mps_shm_directory}"
    return None


# -- what Allocate adds ---------------------------------------------------------------------------
class GpuShare(Protocol):
    """``allocation.GpuShare``: read-only here (a Protocol, so allocation can import this module)."""

    @property
    def mib(self) -> int: ...

    @property
    def mig(self) -> bool: ...


@dataclass(frozen=True)
class ContainerFence:
    """Env and mounts one container gets for the node's mode (merged into its ContainerSpec)."""

    envs: dict[str, str]
    mounts: tuple[tuple[str, str, bool], ...] = ()


def container_fence(shares: Sequence[GpuShare], cfg: EnforcementConfig, users: int = 1) -> ContainerFence:
    """What the node's mode (``cfg.resolved``, pinned by the daemon at start) adds to a container.

    Request = the container's reservation, limit = its first quota (the same at Allocate). In ``driver``
    mode MIG instances get nothing: the driver's per-cgroup limits cover non-MIG GPUs only (R615 notes).

    The toolkit's variables hold one MiB figure for the container's GPUs; when its GPUs carry
    different shares the largest is set and the quota loop narrows each GPU at its first tick.

    ``users``: how many containers get these variables at once (a DRA claim's CDI spec is injected into
    every container naming the claim). Both fences hold one container (driver: its cgroup; MPS: each
    client), so each gets ``mib // users``: together they hold at most the grant.
    """
    mode = cfg.resolved
    n = max(1, users)
    whole = [s for s in shares if not s.mig]  # driver limits are for non-MIG GPUs; a MIG instance is its own fence
    if mode is EnforcementMode.DRIVER and whole:
        mib = str(max(s.mib for s in whole) // n)
        return ContainerFence({contract.ENV_GPU_MEMORY_REQUEST: mib, contract.ENV_GPU_MEMORY_LIMIT: mib})
    if mode is EnforcementMode.MPS and shares:
        return ContainerFence(
            {contract.ENV_MPS_PINNED_MEM_LIMIT: ",".join(f"{i}={s.mib // n}M" for i, s in enumerate(shares)),
             contract.ENV_MPS_PIPE_DIRECTORY: MPS_CONTAINER_PIPE_DIR},
            ((MPS_CONTAINER_PIPE_DIR, cfg.mps_pipe_directory, False),
             (MPS_CONTAINER_SHM_DIR, cfg.mps_shm_directory, False)))
    return ContainerFence({})


# -- the daemon's side --------------------------------------------------------------------------
def detect(backend: Any, config: Config, discovered: Sequence[Any]) -> Chosen:
    """Probe the node behind ``backend`` and choose; raises :class:`EnforcementRefused`.

    A backend may carry its own ``enforcement_facts`` (the simulated one does, so a simulated node
    can stand for a driver node); otherwise the NVML backend's module is probed, and a node without
    NVML has no driver facts at all.
    """
    facts = getattr(backend, "enforcement_facts", None)  # a simulated node says what it stands for
    if facts is None:
        shared = [d.uuid for d in discovered
                  if config.mode_for(d.index, d.uuid, d.mig_enabled) is GpuMode.SHARED]
        nvml = getattr(backend, "nvml", None) if getattr(backend, "name", "") == "nvml" else None
        facts = probe(nvml, config.enforcement, shared_uuids=shared)
    chosen = choose(config.enforcement.requested(), facts)
    log.info("gpu memory enforcement", mode=chosen.mode.value, reason=chosen.reason,
             driver=facts.driver_version or "none", cgroup_v2=facts.cgroup_v2)
    if facts.host_access_problem and facts.driver_version is not None and chosen.mode is not EnforcementMode.DRIVER:
        log.warning("driver enforcement not advertised: the plugin lacks what it needs from the host",
                    mode=chosen.mode.value, reason=facts.host_access_problem)
    return chosen


def pin(config: Config, chosen: Chosen) -> Config:
    """``config`` with the detected mode in force (Allocate and the inventory read it from there)."""
    if config.enforcement.requested() not in (None, chosen.mode):
        log.warning("enforcement.mode changed in the config; it takes effect at the next restart",
                    running=chosen.mode.value, asked=config.enforcement.mode)
    return dataclasses.replace(config, enforcement=dataclasses.replace(config.enforcement, resolved=chosen.mode))
