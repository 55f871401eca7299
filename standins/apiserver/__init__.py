"""A local stand-in for the Kubernetes API server, for tests and ``vramshare demo`` only.

Never on a production code path. The real ``kubernetes`` client runs against it unchanged::

    from kubernetes import client, watch
    from vramshare.kube import api_client_for
    from standins.apiserver import ApiServerDouble

    with ApiServerDouble() as api, api_client_for(api.url) as http:
        v1 = client.CoreV1Api(http)
        api.create_node({"metadata": {"name": "gpu-1"}})
        api.create_pod({"metadata": {"name": "p", "namespace": "default"},
                        "spec": {"containers": [{"name": "c", "image": "x"}]}})
        v1.list_namespaced_pod("default", field_selector="spec.nodeName=")
        # A Binding is answered with a Status (as a real server does), which the client cannot
        # deserialize as V1Binding: post it unpreloaded, read it, release the connection.
        resp = v1.create_namespaced_pod_binding("p", "default", client.V1Binding(
            metadata=client.V1ObjectMeta(name="p"), target=client.V1ObjectReference(kind="Node", name="gpu-1")),
            _preload_content=False)
        resp.data; resp.release_conn()
        assert api.count("POST", r"/binding$") == 1

Serves ``GET /version``, the service proxy (``services/[scheme:]name[:port]/proxy/...``, to the
Service's Endpoints), nodes (+status), pods (+status, +binding), namespaced ``bindings``, core and events.k8s.io
Events, ConfigMaps, Namespaces, Secrets, Services, Endpoints, apps/v1 Deployments and DaemonSets,
ValidatingAdmissionPolicies (+Bindings), coordination.k8s.io Leases, and resource.k8s.io/v1 ResourceSlices, ResourceClaims (+status),
ResourceClaimTemplates and DeviceClasses: list (limit/continue), get, create (generateName, dryRun),
update, patch (merge, strategic merge, JSON patch, server-side apply with one field manager per
object), delete (preconditions; optional graceful deletion of bound pods), with 409 Conflict on
stale resourceVersions and Status bodies for every error. Watches replay from a resourceVersion,
answer 410 Expired after ``compact()`` (or past ``history_limit``), send bookmarks, honour
timeoutSeconds, and show objects entering/leaving a field selector as ADDED/DELETED.

Python side (``ApiServerDouble``): ``start/stop/restart/url``; ``create_node/create_pod/get_node/get_pod/
objects/nodes/pods/events/delete_pod (forced)/finish_pod_deletion (the kubelet ends a pod)/delete_node/
set_pod_phase/bind_pod/update/resource_version``;
``compact/drop_watches(abrupt)/send_bookmarks/open_watches/wait_for/wait_for_watches``;
``requests/count/clear_requests``; ``fail_next(verb, path_regex, code, times, after_commit)/clear_faults``.
"""
from .double import ApiServerDouble
from .errors import ApiError
from .resources import (CONFIGMAPS, DAEMONSETS, DEPLOYMENTS, DEVICECLASSES, ENDPOINTS, EVENTS, EVENTS_V1, LEASES,
                        NAMESPACES, NODES, PODS, RESOURCECLAIMS, RESOURCECLAIMTEMPLATES, RESOURCESLICES, SECRETS,
                        SERVICES, VALIDATINGADMISSIONPOLICIES, VALIDATINGADMISSIONPOLICYBINDINGS, ResourceType)
from .traffic import RequestRecord

__all__ = ["ApiServerDouble", "ApiError", "RequestRecord", "ResourceType", "NODES", "PODS", "EVENTS", "EVENTS_V1",
           "CONFIGMAPS", "RESOURCESLICES", "RESOURCECLAIMS", "RESOURCECLAIMTEMPLATES", "DEVICECLASSES", "NAMESPACES",
           "SECRETS", "SERVICES", "ENDPOINTS", "DEPLOYMENTS", "DAEMONSETS", "VALIDATINGADMISSIONPOLICIES",
           "VALIDATINGADMISSIONPOLICYBINDINGS", "LEASES"]
