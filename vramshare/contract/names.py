"""The names the parts agree on: resources, annotations, environment variables and paths.

The device plugin, the extender, the quota loop and the vLLM plugin are built and released apart and
only meet through these names (DESIGN.md section 3); a rename is a protocol change. The formats under
these names have their codecs beside this module, one each (:mod:`vramshare.contract`).
"""
from __future__ import annotations

from dataclasses import dataclass

from vramshare.contract.user_annotations import (HANDSHAKE_ANNOTATIONS, NODE_ANNOTATIONS, QUOTA_LOOP_ANNOTATIONS,
                                                  SLICE_ANNOTATIONS, USER_ANNOTATIONS)

DEFAULT_DOMAIN = "vramshare.io"
INVENTORY_VERSION = "v1"


@dataclass(frozen=True)
class Names:
    """Resource and annotation names under one resource domain (configurable, default vramshare.io)."""

    domain: str = DEFAULT_DOMAIN

    # -- extended resources advertised to the kubelet
    @property
    def gpu_memory(self) -> str:
        """Memory units: one device is ``memoryUnitMiB`` of one GPU."""
        return f"{self.domain}/gpu-memory"

    @property
    def gpu(self) -> str:
        """Whole GPUs in ``exclusive`` mode."""
        return f"{self.domain}/gpu"

    def mig(self, profile: str) -> str:
        """One resource per MIG profile, e.g. ``vramshare.io/mig-1g.10gb`` (``+`` becomes ``.``)."""
        return f"{self.domain}/mig-{profile.replace('+', '.')}"

    @property
    def mig_prefix(self) -> str:
        return f"{self.domain}/mig-"

    # -- node annotation written by the device plugin
    @property
    def inventory(self) -> str:
        return f"{self.domain}/gpu-inventory"

    # -- node annotation written by the DRA plugin (issue 23): its models, no GPUs (slices have those)
    @property
    def resident_models(self) -> str:
        """Read by :mod:`vramshare.contract.resident_models`, the one codec."""
        return f"{self.domain}/resident-models"

    # -- ResourceSlice annotation written by the DRA plugin: the config it runs (the device plugin says it
    # in its inventory's ``config`` section)
    @property
    def config_in_force(self) -> str:
        """Read by :mod:`vramshare.contract.config_in_force`, the one codec (in :data:`SLICE_ANNOTATIONS`)."""
        return f"{self.domain}/{SLICE_ANNOTATIONS[0]}"

    # -- pod annotations: written by users (USER_ANNOTATIONS, below, lists every one of them)
    def user_annotations(self) -> tuple[str, ...]:
        """Every pod annotation a user may write, as full keys (``vramshare.io/gpu-count``, ...)."""
        return tuple(f"{self.domain}/{name}" for name in USER_ANNOTATIONS)

    def vramshare_annotations(self) -> tuple[str, ...]:
        """Every pod annotation only vramshare writes (handshake and quota loop), as full keys."""
        return tuple(f"{self.domain}/{name}" for name in (*HANDSHAKE_ANNOTATIONS, *QUOTA_LOOP_ANNOTATIONS))

    def quota_loop_annotations(self) -> tuple[str, ...]:
        """The pod annotations the quota loops write (the DRA plugin may write only these of ours)."""
        return tuple(f"{self.domain}/{name}" for name in QUOTA_LOOP_ANNOTATIONS)

    def node_annotations(self) -> tuple[str, ...]:
        """Every node annotation of ours (device plugins only)."""
        return tuple(f"{self.domain}/{name}" for name in NODE_ANNOTATIONS)

    def slice_annotations(self) -> tuple[str, ...]:
        """Every ResourceSlice annotation of ours (the DRA plugin, on its own slices)."""
        return tuple(f"{self.domain}/{name}" for name in SLICE_ANNOTATIONS)

    @property
    def gpu_count(self) -> str:
        return f"{self.domain}/gpu-count"

    @property
    def gpu_models(self) -> str:
        return f"{self.domain}/gpu-models"

    @property
    def isolation(self) -> str:
        """``mig``: the pod's gpu-memory ask is served by a MIG partition made for it (issue 24)."""
        return f"{self.domain}/isolation"

    @property
    def policy(self) -> str:
        """Per-pod override of the extender's scoring policy."""
        return f"{self.domain}/policy"

    @property
    def model(self) -> str:
        """The model a pod serves, ``<name>[@<revision>]`` (issue 23; user-writable, optional): read by
        :func:`parse_model_ref`, the one codec. Without it placement and the warm tier act as before."""
        return f"{self.domain}/model"

    # -- pod annotations: the extender's plan at bind, overwritten by the device plugin with what was allocated
    @property
    def assignment(self) -> str:
        return f"{self.domain}/assignment"

    @property
    def assume_time(self) -> str:
        return f"{self.domain}/assume-time"

    @property
    def allocation_state(self) -> str:
        return f"{self.domain}/allocation-state"

    @property
    def quota_mib(self) -> str:
        return f"{self.domain}/quota-mib"

    @property
    def quota_class(self) -> str:
        """A pod's choice of quota class (issue 14), honoured where the class has allowPodSelection."""
        return f"{self.domain}/quota-class"

    @property
    def over_limit(self) -> str:
        """Set by the quota loop on a pod whose container stayed above its hard limit (issue 9)."""
        return f"{self.domain}/over-limit"

    # -- DRA (resource.k8s.io/v1): the driver name and the DeviceClasses of deploy/daemonset/dra
    @property
    def dra_driver(self) -> str:
        """ResourceSlice ``spec.driver`` and the kubelet plugin name, e.g. ``gpu.vramshare.io``."""
        return f"gpu.{self.domain}"

    @property
    def cdi_kind(self) -> str:
        """CDI ``vendor/class`` of the per-claim specs: ``vramshare.io/gpu``."""
        return f"{self.domain}/gpu"

    def device_class(self, what: str) -> str:
        """DeviceClass names: ``gpu-memory.vramshare.io``, ``gpu.vramshare.io``, ``mig.vramshare.io``."""
        return f"{what}.{self.domain}"

    def is_ours(self, resource: str) -> bool:
        return resource.startswith(f"{self.domain}/")


# allocation-state values: the extender writes "assumed" with its plan at bind; the device plugin's
# reconciler writes "allocated" with the pod's actual GPUs (from the kubelet's PodResources) after admission
STATE_ASSUMED = "assumed"
STATE_ALLOCATED = "allocated"
STATE_FAILED_PREFIX = "failed: "  # no longer written: Allocate does not know its pod (kept for readers)

# Field managers (metadata.managedFields) of vramshare's writers. The extender believes an assignment
# only from these (issue 18): ``assumed`` written by the extender, ``allocated`` by the device plugin.
FIELD_MANAGER_EXTENDER = "vramshare-extender"
FIELD_MANAGER_DEVICE_PLUGIN = "vramshare-device-plugin"

# what a container gets (Allocate response)
ENV_VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
ENV_GPU_UUIDS = "VRAMSHARE_GPU_UUIDS"
ENV_MEMORY_LIMIT_MIB = "VRAMSHARE_MEMORY_LIMIT_MIB"
ENV_MPS_PINNED_MEM_LIMIT = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
ENV_MPS_PIPE_DIRECTORY = "CUDA_MPS_PIPE_DIRECTORY"
# enforcement.mode driver (issue 9): the NVIDIA container toolkit's apply-cuda-memory-limits CDI hook
# reads these exact (singular) names, whole MiB, and sets the container cgroup's soft/hard limits
ENV_GPU_MEMORY_REQUEST = "NVIDIA_GPU_MEMORY_REQUEST"
ENV_GPU_MEMORY_LIMIT = "NVIDIA_GPU_MEMORY_LIMIT"
ENV_QUOTA_FILE = "VRAMSHARE_QUOTA_FILE"
# kvcached's shared-memory segment name (read by kvcached when `import vllm` runs its hook, before any
# vLLM plugin): one per allocation, the same for every process of the container
ENV_KVCACHED_IPC_NAME = "KVCACHED_IPC_NAME"
CONTAINER_QUOTA_DIR = "/var/run/vramshare"
QUOTA_FILE_NAME = "quota.json"
HOST_QUOTA_ROOT = "/var/lib/vramshare/quota"
#: the host's cgroup v2 tree, where driver mode finds other containers' cgroups (mounted at the same path)
HOST_CGROUP_ROOT = "/sys/fs/cgroup"

# kubelet paths and protocol constants
DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
KUBELET_SOCKET_NAME = "kubelet.sock"
POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
DEVICE_PLUGIN_API_VERSION = "v1beta1"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
MAX_DEVICE_ID_LEN = 63

# kubelet DRA plugin paths (k8s.io/dynamic-resource-allocation/kubeletplugin defaults)
KUBELET_PLUGINS_DIR = "/var/lib/kubelet/plugins"  # the DRA socket lives in <dir>/<driver>/dra.sock
KUBELET_REGISTRY_DIR = "/var/lib/kubelet/plugins_registry"  # <driver>-reg.sock, watched by the kubelet

# extender protocol constants (kube-scheduler extender/v1)
MIN_EXTENDER_PRIORITY = 0
MAX_EXTENDER_PRIORITY = 10

METRICS_PREFIX = "vramshare_"

# -- the config: the ConfigMap both node plugins and the extender mount, and the node Event a node plugin
# posts when it refuses a reload of it (read back by ``vramshare check``)
CONFIG_MAP_NAME = "vramshare-config"
CONFIG_FILE_KEY = "config.yaml"
EVENT_CONFIG_REFUSED = "VramshareConfigRefused"


def unit_device_id(gpu_uuid: str, n: int) -> str:
    """Device ID of memory unit ``n`` of a GPU: ``<gpu-uuid>::<n>``, deterministic, names the GPU."""
    return f"{gpu_uuid}::{n}"


def parse_unit_device_id(device_id: str) -> tuple[str, int]:
    """Inverse of :func:`unit_device_id`; raises ``ValueError`` on anything else."""
    uuid, sep, n = device_id.rpartition("::")
    if not sep or not uuid or not n.isdigit():
        raise ValueError(f"not a memory-unit device ID: {device_id!r} (want <gpu-uuid>::<n>)")
    return uuid, int(n)
