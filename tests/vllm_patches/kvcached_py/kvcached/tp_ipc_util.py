# SPDX-License-Identifier: Apache-2.0
"""Boundary stub for kvcached's worker IPC (``kvcached/tp_ipc_util.py``): one process, no workers."""


def broadcast_kv_tensors_created(world_size, pp_rank=0, group_id=0):  # noqa: ANN001, ANN201
    raise RuntimeError("no worker IPC in the test double (world_size must be 1)")


def broadcast_map_to_kv_tensors(world_size, offsets, pp_rank=0, group_id=0):  # noqa: ANN001, ANN201
    raise RuntimeError("no worker IPC in the test double")


def broadcast_unmap_from_kv_tensors(world_size, offsets, pp_rank=0, group_id=0):  # noqa: ANN001, ANN201
    raise RuntimeError("no worker IPC in the test double")
