"""Minimal valid object bodies for the API server double tests."""
from __future__ import annotations

from typing import Any

from kubernetes import client


def pod_body(name: str, namespace: str = "default", **meta: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": namespace, **meta},
            "spec": {"containers": [{"name": "main", "image": "vllm"}]}}


def node_body(name: str, **meta: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, **meta}}


def binding(pod: str, node: str) -> client.V1Binding:
    return client.V1Binding(metadata=client.V1ObjectMeta(name=pod),
                            target=client.V1ObjectReference(kind="Node", name=node))


def bind(v1: client.CoreV1Api, pod: str, node: str, namespace: str = "default") -> int:
    """POST a Binding the way production code must: unpreloaded (the answer is a Status), read, released."""
    response = v1.create_namespaced_pod_binding(pod, namespace, binding(pod, node), _preload_content=False)
    try:
        response.data  # noqa: B018 - reading it is what lets the connection go back to the pool
        return int(response.status)
    finally:
        response.release_conn()
