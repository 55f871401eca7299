"""The contract between vramshare's parts: every name and format that crosses a process boundary.

The device plugin, the extender, the quota loop and the vLLM plugin are built and released apart and
only meet through what is spelled here (DESIGN.md section 3). One module per format, each with one
``parse`` (bounded, strict, raising one error type with the reason) and one ``encode``; nothing else
parses these formats (``tests/test_contract_owns_formats.py`` fails if something does):

* :mod:`.names`: resource, annotation, environment and path names (:class:`Names`);
* :mod:`.user_annotations`: the pod annotations a user may write (:data:`USER_ANNOTATIONS`);
* :mod:`.inventory`: the node's ``gpu-inventory`` annotation; :mod:`.resident_models`: the DRA plugin's
  ``resident-models`` node annotation (the inventory's ``models`` section alone);
  :mod:`.slice_enforcement`: the DRA plugin's mode in its ResourceSlices' ``enforcement`` attribute;
  :mod:`.slice_foreign`: what it took off a shared device's capacity for foreign memory (``foreignMiB``);
  :mod:`.config_in_force`: which config text a node plugin runs (the inventory's ``config``, the DRA
  plugin's ResourceSlice annotation ``config``);
* :mod:`.assignment`: the pod's ``assignment`` annotation;
* :mod:`.quota_file`: ``quota.json``; :mod:`.quota_mib`: its mirror on the pod; :mod:`.over_limit`;
* :mod:`.model`: the ``model`` annotation; :mod:`.warm`: the warm socket's lines.

``from vramshare import contract; contract.NAME`` keeps working for every name below.
"""
from __future__ import annotations

from vramshare.contract._json import ContractError
from vramshare.contract.assignment import AssignedGpu, AssignmentError
from vramshare.contract.model import (MAX_MODEL_NAME, MAX_MODEL_REVISION, ModelRef, ModelRefError,
                                      encode_model_ref, parse_model_ref)
from vramshare.contract.names import (CONFIG_FILE_KEY, CONFIG_MAP_NAME, CONTAINER_QUOTA_DIR, DEFAULT_DOMAIN, DEVICE_PLUGIN_API_VERSION,
                                      DEVICE_PLUGIN_DIR, ENV_GPU_MEMORY_LIMIT, EVENT_CONFIG_REFUSED, ENV_GPU_MEMORY_REQUEST,
                                      ENV_GPU_UUIDS, ENV_KVCACHED_IPC_NAME, ENV_MEMORY_LIMIT_MIB,
                                      ENV_MPS_PINNED_MEM_LIMIT, ENV_MPS_PIPE_DIRECTORY, ENV_QUOTA_FILE,
                                      ENV_VISIBLE_DEVICES, FIELD_MANAGER_DEVICE_PLUGIN, FIELD_MANAGER_EXTENDER,
                                      HEALTHY, HOST_CGROUP_ROOT, HOST_QUOTA_ROOT, INVENTORY_VERSION,
                                      KUBELET_PLUGINS_DIR, KUBELET_REGISTRY_DIR, KUBELET_SOCKET_NAME,
                                      MAX_DEVICE_ID_LEN, MAX_EXTENDER_PRIORITY, METRICS_PREFIX,
                                      MIN_EXTENDER_PRIORITY, POD_RESOURCES_SOCKET, QUOTA_FILE_NAME,
                                      STATE_ALLOCATED, STATE_ASSUMED, STATE_FAILED_PREFIX, UNHEALTHY, Names,
                                      parse_unit_device_id, unit_device_id)
from vramshare.contract.quota_file import GpuQuota, QuotaFile, QuotaFileError
from vramshare.contract.user_annotations import (HANDSHAKE_ANNOTATIONS, NODE_ANNOTATIONS, QUOTA_LOOP_ANNOTATIONS,
                                                  USER_ANNOTATIONS)
from vramshare.contract.warm import (WARM_AWAKE, WARM_GRANT, WARM_HELLO, WARM_MAX_LINE, WARM_OPS, WARM_REFUSED,
                                     WARM_PREWAKE, WARM_SLEEP, WARM_SLEPT, WARM_SOCKET_NAME, WARM_VERSION, WARM_WAKE,
                                     WarmMessage, WarmMessageError, decode_warm, encode_warm)

__all__ = [
    "ContractError", "AssignedGpu", "AssignmentError", "GpuQuota", "QuotaFile", "QuotaFileError",
    "MAX_MODEL_NAME", "MAX_MODEL_REVISION", "ModelRef", "ModelRefError", "parse_model_ref", "encode_model_ref",
    "CONFIG_FILE_KEY", "CONFIG_MAP_NAME", "EVENT_CONFIG_REFUSED", "CONTAINER_QUOTA_DIR", "DEFAULT_DOMAIN", "DEVICE_PLUGIN_API_VERSION", "DEVICE_PLUGIN_DIR",
    "ENV_GPU_MEMORY_LIMIT", "ENV_GPU_MEMORY_REQUEST", "ENV_GPU_UUIDS", "ENV_KVCACHED_IPC_NAME",
    "ENV_MEMORY_LIMIT_MIB", "ENV_MPS_PINNED_MEM_LIMIT", "ENV_MPS_PIPE_DIRECTORY", "ENV_QUOTA_FILE",
    "ENV_VISIBLE_DEVICES", "FIELD_MANAGER_DEVICE_PLUGIN", "FIELD_MANAGER_EXTENDER", "HEALTHY",
    "HOST_CGROUP_ROOT", "HOST_QUOTA_ROOT", "INVENTORY_VERSION", "KUBELET_PLUGINS_DIR", "KUBELET_REGISTRY_DIR",
    "KUBELET_SOCKET_NAME", "MAX_DEVICE_ID_LEN", "MAX_EXTENDER_PRIORITY", "METRICS_PREFIX",
    "MIN_EXTENDER_PRIORITY", "POD_RESOURCES_SOCKET", "QUOTA_FILE_NAME", "STATE_ALLOCATED", "STATE_ASSUMED",
    "STATE_FAILED_PREFIX", "UNHEALTHY", "Names", "parse_unit_device_id", "unit_device_id",
    "USER_ANNOTATIONS", "HANDSHAKE_ANNOTATIONS", "QUOTA_LOOP_ANNOTATIONS", "NODE_ANNOTATIONS", "WARM_AWAKE", "WARM_GRANT", "WARM_HELLO", "WARM_MAX_LINE", "WARM_OPS",
    "WARM_PREWAKE",
    "WARM_REFUSED", "WARM_SLEEP", "WARM_SLEPT", "WARM_SOCKET_NAME", "WARM_VERSION", "WARM_WAKE",
    "WarmMessage", "WarmMessageError", "decode_warm", "encode_warm",
]
