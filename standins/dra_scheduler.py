"""kube-scheduler's DRA path and the ResourceClaim controller, as a stand-in for tests and the demo.

Through the official client against any API server (the double in tests), in upstream order:

1. the resourceclaim controller (pkg/controller/resourceclaim ``handleClaim``) creates one
   ResourceClaim per ``pod.spec.resourceClaims[].resourceClaimTemplateName`` (``generateName``
   ``<pod>-<claim>-``, owned by the pod, annotation ``resource.kubernetes.io/pod-claim-name``) and
   records it in ``pod.status.resourceClaimStatuses``;
2. the DynamicResources plugin filters every node with the allocator stand-in
   (:mod:`standins.dra_allocator`), then, since DRA has no scorer for shared devices,
   kube-scheduler takes any feasible node: here the first in a seeded random order, unless the
   caller passes a ``score`` (what vramshare's extender adds);
3. PreBind writes ``status.allocation`` and adds the pod to ``status.reservedFor``, then the pod is
   bound.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kubernetes import client

from standins import dra_allocator
from vramshare.kube import decode

Obj = dict[str, Any]
POD_CLAIM_NAME_ANNOTATION = "resource.kubernetes.io/pod-claim-name"


@dataclass
class Placement:
    node: str
    claims: list[Obj]


class DraScheduler:
    def __init__(self, api: client.ApiClient, nodes: Sequence[str], seed: int = 0,
                 score: Callable[[Obj, str, list[Obj]], float] | None = None, partitionable: bool = True) -> None:
        self.core = client.CoreV1Api(api)
        self.resource = client.ResourceV1Api(api)
        self.nodes = list(nodes)
        self.rng = random.Random(seed)
        self.score = score
        self.partitionable = partitionable  # kube-scheduler's DRAPartitionableDevices gate

    def create_claims(self, pod: Obj) -> Obj:
        """The resourceclaim controller: claims from templates, recorded in the pod status."""
        ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        statuses = []
        for pc in (pod.get("spec") or {}).get("resourceClaims") or ():
            template_name = pc.get("resourceClaimTemplateName")
            if not template_name:
                continue
            template = decode(self.resource.read_namespaced_resource_claim_template(template_name, ns,
                                                                                   _preload_content=False))
            claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {
                "generateName": f"{name}-{pc['name']}-", "namespace": ns,
                "annotations": {POD_CLAIM_NAME_ANNOTATION: pc["name"]},
                "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": name, "uid": pod["metadata"]["uid"],
                                     "controller": True, "blockOwnerDeletion": True}]},
                "spec": template["spec"]["spec"]}
            created = decode(self.resource.create_namespaced_resource_claim(ns, claim, _preload_content=False))
            statuses.append({"name": pc["name"], "resourceClaimName": created["metadata"]["name"]})
        return decode(self.core.patch_namespaced_pod_status(name, ns, {"status": {"resourceClaimStatuses": statuses}},
                                                           _preload_content=False))

    def _claims(self, pod: Obj) -> list[Obj]:
        ns = pod["metadata"]["namespace"]
        names = [s["resourceClaimName"] for s in (pod.get("status") or {}).get("resourceClaimStatuses") or ()]
        return [decode(self.resource.read_namespaced_resource_claim(n, ns, _preload_content=False)) for n in names]

    def schedule(self, pod: Obj) -> Placement | None:
        """Filter, pick, allocate, reserve, bind; ``None`` when no node can take every claim."""
        claims = [c for c in self._claims(pod) if not (c.get("status") or {}).get("allocation")]
        slices = decode(self.resource.list_resource_slice(_preload_content=False))["items"]
        classes = {c["metadata"]["name"]: c for c in
                   decode(self.resource.list_device_class(_preload_content=False))["items"]}
        allocated = [c for c in decode(self.resource.list_resource_claim_for_all_namespaces(
            _preload_content=False))["items"] if (c.get("status") or {}).get("allocation")]
        order = self.nodes[:]
        self.rng.shuffle(order)
        feasible: list[tuple[str, list[Obj]]] = []
        for node in order:
            results, held = [], list(allocated)
            for claim in claims:
                alloc = dra_allocator.allocate(claim, node, slices, classes, held, partitionable=self.partitionable)
                if alloc is None:
                    break
                done = {**claim, "status": {**(claim.get("status") or {}), "allocation": alloc}}
                results.append(done)
                held.append(done)
            else:
                feasible.append((node, results))
        if not feasible:
            return None
        if self.score is not None:
            node, results = max(feasible, key=lambda f: self.score(pod, f[0], f[1]))  # type: ignore[misc]
        else:
            node, results = feasible[0]
        written = []
        for claim in results:
            claim["status"]["reservedFor"] = [{"resource": "pods", "name": pod["metadata"]["name"],
                                               "uid": pod["metadata"]["uid"]}]
            written.append(decode(self.resource.replace_namespaced_resource_claim_status(
                claim["metadata"]["name"], claim["metadata"]["namespace"], claim, _preload_content=False)))
        decode(self.core.create_namespaced_pod_binding(
            pod["metadata"]["name"], pod["metadata"]["namespace"],
            client.V1Binding(metadata=client.V1ObjectMeta(name=pod["metadata"]["name"]),
                             target=client.V1ObjectReference(kind="Node", name=node)),
            _preload_content=False))
        return Placement(node, written)

    def release(self, pod: Obj) -> None:
        """The pod is gone: the claim controller deallocates its claims (no one else reserves them)."""
        for claim in self._claims(pod):
            claim["status"] = {}
            decode(self.resource.replace_namespaced_resource_claim_status(
                claim["metadata"]["name"], claim["metadata"]["namespace"], claim, _preload_content=False))
