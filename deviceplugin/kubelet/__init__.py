"""``vramshare device-plugin``: the kubelet device plugin program (device plugin API v1beta1).

Its composition root (``main``), the gRPC servers and their lifecycle, Allocate's allocator, the
PodResources reconcile, GetPreferredAllocation's steering, the node's pod cache and inventory publisher.
Shares the GPU backends and the rest of ``deviceplugin/`` with the DRA plugin (``deviceplugin.dra``); the
two never import each other.
"""
