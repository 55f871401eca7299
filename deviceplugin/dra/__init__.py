"""The DRA kubelet plugin: ResourceSlices, CDI specs per claim, the kubelet DRA gRPC service."""
