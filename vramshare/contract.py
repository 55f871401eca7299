"""The names the parts agree on: resources, annotations, environment variables and paths.

The device plugin, the extender, the quota loop and the vLLM plugin are built and released apart and
only meet through these names (DESIGN.md section 3). Everything that crosses a process boundary is
spelled here once; a rename is a protocol change.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

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

    # -- pod annotations: written by users (USER_ANNOTATIONS, below, lists every one of them)
    def user_annotations(self) -> tuple[str, ...]:
        """Every pod annotation a user may write, as full keys (``vramshare.io/gpu-count``, ...)."""
        return tuple(f"{self.domain}/{name}" for name in USER_ANNOTATIONS)

    @property
    def gpu_count(self) -> str:
        return f"{self.domain}/gpu-count"

    @property
    def gpu_models(self) -> str:
        return f"{self.domain}/gpu-models"

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


#: The pod annotations users write themselves, under the domain; every other ``<domain>/*`` annotation
#: is written by vramshare only. The one list: deploy/daemonset/admission-policies.yaml exempts exactly
#: these from its protection (tests/security/test_admission_policies.py evaluates its CEL against this
#: tuple) and every one README tells users to write must be here (tests/test_readme_pod.py).
#: gpu-count, gpu-models: placement; policy: scoring override; quota-class: the pod's choice of quota
#: class (issue 14); model: the model a pod serves (issue 23, cold starts).
USER_ANNOTATIONS: tuple[str, ...] = ("gpu-count", "gpu-models", "policy", "quota-class", "model")


# -- the model annotation codec (issue 23) ------------------------------------------------------------
MAX_MODEL_NAME = 200  # Hugging Face repo ids are at most 96 chars per part; a path-like name fits
MAX_MODEL_REVISION = 128
_MODEL_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*")
_MODEL_REV_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class ModelRefError(ValueError):
    """A ``model`` annotation (or a cache directory name) that does not name a model; says what to write."""


@dataclass(frozen=True, order=True)
class ModelRef:
    """A model's identity: ``name`` (``org/name`` or a plain name) and optional ``revision`` (a commit
    hash, tag or branch). ``""`` revision means "any revision" when matched against what a node holds."""

    name: str
    revision: str = ""

    def __str__(self) -> str:
        return f"{self.name}@{self.revision}" if self.revision else self.name

    def matches(self, held: "ModelRef") -> bool:
        """Does a node's copy ``held`` serve this ask? Same name, and same revision when one is asked."""
        return self.name == held.name and (not self.revision or self.revision == held.revision)


def parse_model_ref(text: object) -> ModelRef:
    """``<name>[@<revision>]`` -> :class:`ModelRef`; raises :class:`ModelRefError` naming what is wrong.

    Names are path-like (``meta-llama/Llama-3.1-8B-Instruct``): letters, digits, ``.``, ``_``, ``-``
    in ``/``-separated parts, no ``..`` part (the name becomes a cache path on the node)."""
    if not isinstance(text, str):
        raise ModelRefError(f"model: expected a string, got {type(text).__name__}")
    name, sep, rev = text.strip().partition("@")
    if not name:
        raise ModelRefError(f"model {text!r}: empty name (want <name>[@<revision>])")
    if len(name) > MAX_MODEL_NAME or not _MODEL_NAME_RE.fullmatch(name) or ".." in name.split("/"):
        raise ModelRefError(f"model {text!r}: name must be letters, digits, '.', '_', '-' in '/'-separated "
                            f"parts, at most {MAX_MODEL_NAME} characters")
    if sep and (not rev or len(rev) > MAX_MODEL_REVISION or not _MODEL_REV_RE.fullmatch(rev)):
        raise ModelRefError(f"model {text!r}: revision after '@' must be letters, digits, '.', '_', '-', "
                            f"at most {MAX_MODEL_REVISION} characters")
    return ModelRef(name, rev)


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

# -- the warm tier's fast channel (issue 23) --------------------------------------------------------------
#: A unix stream socket the node agent listens on in each container's quota directory (the container sees
#: it at ``/var/run/vramshare/warm.sock``: connecting to a socket works on the read-only mount). One JSON
#: object per line, at most :data:`WARM_MAX_LINE` bytes, ``"v": 1``. The engine (vLLM plugin) connects and
#: says ``hello``; the agent answers ``sleep`` when the quota loop found the tenant idle; a first request
#: makes the engine send ``wake`` and wait for ``grant`` before it takes its memory back.
WARM_SOCKET_NAME = "warm.sock"
WARM_VERSION = 1
WARM_MAX_LINE = 1024
#: engine -> agent
WARM_HELLO = "hello"  # engine, canSleep, weightsBytes (what a wake brings back), state (awake | sleeping |
#                      waking: an engine reconnecting to a restarted agent), model (<name>[@<revision>], what
#                      the node reports as resident), reason when it cannot sleep
WARM_SLEPT = "slept"  # seq (of the sleep it answers), freedBytes
WARM_WAKE = "wake"  # seq (the engine's own, increasing), needBytes: a request arrived while asleep
WARM_AWAKE = "awake"  # seq (of the wake), seconds (wake latency, request arrival to serving)
WARM_REFUSED = "refused"  # seq (of the sleep), reason (busy, not supported, failed)
#: agent -> engine
WARM_SLEEP = "sleep"  # seq (the agent's, increasing), level (1)
WARM_GRANT = "grant"  # seq (of the wake), bytes: the memory is free (measured) and the quota restored
WARM_OPS = (WARM_HELLO, WARM_SLEPT, WARM_WAKE, WARM_AWAKE, WARM_REFUSED, WARM_SLEEP, WARM_GRANT)
_WARM_FIELDS: dict[str, type | tuple[type, ...]] = {
    "engine": str, "seq": int, "level": int, "canSleep": bool, "weightsBytes": int, "freedBytes": int,
    "needBytes": int, "bytes": int, "seconds": (int, float), "reason": str, "state": str, "model": str}


class WarmMessageError(ValueError):
    """A line on the warm channel that is not a message of this version; the reader drops it and logs."""


@dataclass(frozen=True)
class WarmMessage:
    op: str
    fields: tuple[tuple[str, object], ...] = ()

    def get(self, key: str, default: object = None) -> object:
        return dict(self.fields).get(key, default)

    @classmethod
    def of(cls, op: str, **fields: object) -> "WarmMessage":
        return cls(op, tuple(sorted((k, v) for k, v in fields.items() if v is not None)))


def encode_warm(msg: WarmMessage) -> bytes:
    """One line (``\n`` ended); raises :class:`WarmMessageError` for what :func:`decode_warm` refuses."""
    line = json.dumps({"v": WARM_VERSION, "op": msg.op, **dict(msg.fields)}, separators=(",", ":"))
    decode_warm(line)  # one definition of what is valid
    return (line + "\n").encode()


def decode_warm(line: str | bytes) -> WarmMessage:
    """A message from one line; unknown fields are ignored (additive within v1), bad ones refused."""
    if len(line) > WARM_MAX_LINE:
        raise WarmMessageError(f"warm message longer than {WARM_MAX_LINE} bytes")
    try:
        doc = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise WarmMessageError(f"warm message is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("v") != WARM_VERSION:
        raise WarmMessageError(f"warm message: want an object with \"v\": {WARM_VERSION}")
    op = doc.get("op")
    if op not in WARM_OPS:
        raise WarmMessageError(f"warm message: unknown op {op!r}")
    fields = {}
    for key, kind in _WARM_FIELDS.items():
        if key not in doc:
            continue
        value = doc[key]
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise WarmMessageError(f"warm message {op}: {key} has the wrong type ({value!r})")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not 0 <= value <= 1 << 53:
            raise WarmMessageError(f"warm message {op}: {key} out of range ({value!r})")
        fields[key] = value
    return WarmMessage.of(op, **fields)


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


def unit_device_id(gpu_uuid: str, n: int) -> str:
    """Device ID of memory unit ``n`` of a GPU: ``<gpu-uuid>::<n>``, deterministic, names the GPU."""
    return f"{gpu_uuid}::{n}"


def parse_unit_device_id(device_id: str) -> tuple[str, int]:
    """Inverse of :func:`unit_device_id`; raises ``ValueError`` on anything else."""
    uuid, sep, n = device_id.rpartition("::")
    if not sep or not uuid or not n.isdigit():
        raise ValueError(f"not a memory-unit device ID: {device_id!r} (want <gpu-uuid>::<n>)")
    return uuid, int(n)
