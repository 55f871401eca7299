"""A local stand-in for the Kubernetes API server, for tests and ``vramshare demo`` only.

Never on a production code path. The real ``kubernetes`` client runs against it unchanged::

    from kubernetes import client, watch
    from vramshare.kube import api_client_for
    from vramshare.apiserver_double import ApiServerDouble

    with ApiServerDouble() as api, api_client_for(api.url) as http:
        v1 = client.CoreV1Api(http)
        api.create_node({"metadata": {"name": "gpu-1"}})
        api.create_pod({"metadata": {"name": "p", "namespace": "default"},
                        "spec": {"containers": [{"name": "c", "image": "x"}]}})
        v1.list_namespaced_pod("default", field_selector="spec.nodeName=")
        v1.create_namespaced_pod_binding("p", "default", client.V1Binding(
            metadata=client.V1ObjectMeta(name="p"), target=client.V1ObjectReference(kind="Node", name="gpu-1")),
            _preload_content=False)  # a real server answers a Binding with a Status, as the double does
        assert api.count("POST", r"/binding$") == 1

Serves nodes, pods (+ status, binding), core and events.k8s.io Events, ConfigMaps: list/get/create/
update/patch (merge, strategic merge, JSON patch)/delete, watches with replay, 410 after ``compact()``,
bookmarks and timeouts; field selectors on name, namespace, nodeName, phase; simple label selectors.
Helpers: ``create_node/create_pod/get_pod/pods/nodes/set_pod_phase/bind_pod/delete_pod``,
``compact/drop_watches/wait_for/wait_for_watches``, ``requests/count`` and ``fail_next`` faults.
"""
from .double import ApiServerDouble
from .errors import ApiError
from .resources import CONFIGMAPS, EVENTS, EVENTS_V1, NODES, PODS, ResourceType
from .traffic import RequestRecord

__all__ = ["ApiServerDouble", "ApiError", "RequestRecord", "ResourceType", "NODES", "PODS", "EVENTS", "EVENTS_V1",
           "CONFIGMAPS"]
