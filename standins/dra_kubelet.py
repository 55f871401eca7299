"""The kubelet's DRA side, as a stand-in for tests and ``vramshare demo --dra``.

Reproduces, in order:

- plugin registration (pkg/kubelet/pluginmanager: the reconciler's ``RegisterPlugin`` operation):
  find ``*.sock`` in the registry directory (names starting with ``.`` are ignored), dial it, call
  ``GetInfo``, validate (pkg/kubelet/cm/dra/plugin ``RegistrationHandler.ValidatePlugin``: type
  ``DRAPlugin``, a non-empty ``supported_versions`` containing a service this kubelet speaks, the
  first of ``v1.DRAPlugin`` then ``v1beta1.DRAPlugin``), then ``NotifyRegistrationStatus`` with
  the verdict; a socket that disappears unregisters the driver;
- ResourceSlice wiping (pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go ``wipeResourceSlices``): at
  kubelet start every ResourceSlice of the node is deleted (``DeleteCollection`` with field selector
  ``spec.nodeName=<node>``, all drivers: no driver is usable until it registers again), and when the
  last plugin of a driver goes, that driver's slices of the node are deleted after ``wipingDelay``
  unless it registers again first (``sync``: ``pendingWipes`` added, or cancelled when usable);
- ``PrepareResources`` (pkg/kubelet/cm/dra/manager.go): for each of the pod's claims, read the claim
  (name from ``pod.status.resourceClaimStatuses``), require the pod in ``status.reservedFor``,
  group claims by driver from the allocation results, call ``NodePrepareResources`` per driver with
  a timeout, and fail when a claim is missing from the response or carries an error (the kubelet
  retries such pods); claims already prepared are not sent again (the kubelet's claim info cache);
- ``GetResources`` (pkg/kubelet/cm/dra/manager.go, with ``ClaimInfo.cdiDevicesAsList`` of
  claiminfo.go): a container gets, for each claim it names in ``resources.claims``, only the CDI
  devices of the request it names (all of the claim's devices when it names none); a device whose
  ``request_names`` is empty goes to every container of the claim. Matching is by the exact name
  the driver answered: the kubelet never strips a ``<request>/<subrequest>`` answer, so a driver
  that forgets ``stripSubrequestNames`` (kubeletplugin/draplugin.go) gives the container no device;
- ``UnprepareResources``: once no running pod of this node references a claim, call
  ``NodeUnprepareResources`` for it and forget it.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import grpc
from kubernetes import client

from protos.dra.v1 import api_pb2 as v1
from protos.dra.v1 import api_pb2_grpc as v1_grpc
from protos.dra.v1beta1 import api_pb2 as v1beta1
from protos.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from protos.pluginregistration.v1 import api_pb2 as reg
from protos.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from vramshare import logs
from vramshare.kube import decode

log = logs.get(__name__)

KUBELET_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")  # preference order of kubelet 1.34+
PREPARE_TIMEOUT_SECONDS = 45.0  # pkg/kubelet/cm/dra: the per-call timeout for driver RPCs
WIPING_DELAY_SECONDS = 30.0  # pkg/kubelet/cm/dra manager.go: how long a gone driver's slices stay
_API = {"v1.DRAPlugin": (v1, v1_grpc), "v1beta1.DRAPlugin": (v1beta1, v1beta1_grpc)}


class PrepareError(RuntimeError):
    """The pod cannot start yet; the kubelet would retry it (the message says which claim and why)."""


@dataclass
class RegisteredPlugin:
    driver: str
    endpoint: str
    service: str
    registration_socket: str


@dataclass
class DraKubelet:
    api: client.ApiClient
    node: str
    registry_dir: str
    plugins: dict[str, RegisteredPlugin] = field(default_factory=dict)
    # claim UID -> {driver, ref, pods, devices: [(request_names, cdi_ids)]}: the kubelet's claim info cache
    prepared: dict[str, dict[str, Any]] = field(default_factory=dict)

    # driver -> time.monotonic() at which its slices are wiped (DRAPluginManager.pendingWipes)
    pending_wipes: dict[str, float] = field(default_factory=dict)

    # -- start and ResourceSlice wiping -------------------------------------------------------
    def start(self) -> int:
        """What a (re)starting kubelet does first: wipe every ResourceSlice of this node, of every
        driver (NewDRAPluginManager -> ``wipeResourceSlices(ctx, "")``); returns how many went."""
        return self.wipe_resource_slices("")

    def wipe_resource_slices(self, driver: str) -> int:
        """``wipeResourceSlices``: DeleteCollection of the node's slices, of ``driver`` only when given."""
        selector = f"spec.nodeName={self.node}" + (f",spec.driver={driver}" if driver else "")
        resp = client.ResourceV1Api(self.api).delete_collection_resource_slice(field_selector=selector,
                                                                               _preload_content=False)
        gone = len(decode(resp).get("items") or ())
        log.info("resource slices wiped", node=self.node, driver=driver or "*", count=gone)
        return gone

    def run_pending_wipes(self, now: float | None = None) -> list[str]:
        """Fire the wipes whose delay has passed (the TimedWorkerQueue); returns their drivers."""
        now = time.monotonic() if now is None else now
        due = sorted(d for d, at in self.pending_wipes.items() if at <= now)
        for driver in due:
            del self.pending_wipes[driver]
            self.wipe_resource_slices(driver)
        return due

    # -- registration -------------------------------------------------------------------------
    def sync_plugins(self, now: float | None = None) -> list[str]:
        """One reconciler pass: register new sockets, drop vanished ones; returns newly registered drivers.
        A driver left without a plugin gets a pending wipe ``WIPING_DELAY_SECONDS`` from ``now``; one
        that registers again has its pending wipe cancelled (``DRAPluginManager.sync``)."""
        now = time.monotonic() if now is None else now
        sockets = {os.path.join(self.registry_dir, n) for n in sorted(os.listdir(self.registry_dir))
                   if n.endswith(".sock") and not n.startswith(".")} if os.path.isdir(self.registry_dir) else set()
        for driver, plugin in list(self.plugins.items()):
            if plugin.registration_socket not in sockets:
                log.info("dra plugin unregistered", driver=driver)
                del self.plugins[driver]
                self.pending_wipes.setdefault(driver, now + WIPING_DELAY_SECONDS)
        known = {p.registration_socket for p in self.plugins.values()}
        added = []
        for path in sorted(sockets - known):
            plugin = self._register(path)
            if plugin is not None:
                self.plugins[plugin.driver] = plugin
                self.pending_wipes.pop(plugin.driver, None)
                added.append(plugin.driver)
        return added

    def _register(self, path: str) -> RegisteredPlugin | None:
        with grpc.insecure_channel(f"unix://{path}") as channel:
            stub = reg_grpc.RegistrationStub(channel)
            info = stub.GetInfo(reg.InfoRequest(), timeout=5)
            error = self._validate(info)
            stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=not error, error=error), timeout=5)
        if error:
            log.warning("dra plugin refused", socket=path, error=error)
            return None
        service = next(s for s in KUBELET_SERVICES if s in info.supported_versions)
        return RegisteredPlugin(info.name, info.endpoint, service, path)

    def _validate(self, info: reg.PluginInfo) -> str:
        if info.type != "DRAPlugin":
            return f"plugin type {info.type!r} is not handled by the DRA manager"
        if not info.supported_versions:
            return f"plugin {info.name}: empty list of supported gRPC services"
        if not any(s in info.supported_versions for s in KUBELET_SERVICES):
            return (f"plugin {info.name}: none of the supported services {list(info.supported_versions)} "
                    f"is supported by this kubelet ({', '.join(KUBELET_SERVICES)})")
        if info.name in self.plugins:
            return f"plugin {info.name} is already registered"
        return ""

    # -- prepare / unprepare --------------------------------------------------------------------
    def _claims_of(self, pod: Mapping[str, Any]) -> list[dict[str, Any]]:
        statuses = {s["name"]: s.get("resourceClaimName") for s in (pod.get("status") or {}).get(
            "resourceClaimStatuses") or ()}
        ns = pod["metadata"]["namespace"]
        out = []
        resource = client.ResourceV1Api(self.api)
        for pc in (pod.get("spec") or {}).get("resourceClaims") or ():
            name = pc.get("resourceClaimName") or statuses.get(pc["name"])
            if not name:
                raise PrepareError(f"pod {ns}/{pod['metadata']['name']}: claim {pc['name']} has no ResourceClaim yet")
            out.append(decode(resource.read_namespaced_resource_claim(name, ns, _preload_content=False)))
        return out

    def prepare_pod(self, pod: Mapping[str, Any]) -> dict[str, list[str]]:
        """Prepare every claim of ``pod``; returns each container's CDI names (:meth:`container_cdi`)."""
        pod_uid = pod["metadata"]["uid"]
        by_driver: dict[str, list[dict[str, Any]]] = {}
        for claim in self._claims_of(pod):
            meta = claim["metadata"]
            reserved = {r.get("uid") for r in (claim.get("status") or {}).get("reservedFor") or ()}
            if pod_uid not in reserved:
                raise PrepareError(f"claim {meta['namespace']}/{meta['name']}: pod {pod_uid} is not in reservedFor")
            if meta["uid"] in self.prepared:
                self.prepared[meta["uid"]]["pods"].add(pod_uid)
                continue
            results = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results") or ()
            for driver in dict.fromkeys(r["driver"] for r in results):
                by_driver.setdefault(driver, []).append(claim)
        for driver, claims in by_driver.items():
            plugin = self.plugins.get(driver)
            if plugin is None:
                raise PrepareError(f"DRA driver {driver} is not registered with this kubelet")
            pb, pb_grpc = _API[plugin.service]
            with grpc.insecure_channel(f"unix://{plugin.endpoint}") as channel:
                resp = pb_grpc.DRAPluginStub(channel).NodePrepareResources(pb.NodePrepareResourcesRequest(claims=[
                    pb.Claim(namespace=c["metadata"]["namespace"], name=c["metadata"]["name"], uid=c["metadata"]["uid"])
                    for c in claims]), timeout=PREPARE_TIMEOUT_SECONDS)
            for c in claims:
                uid = c["metadata"]["uid"]
                if uid not in resp.claims:
                    raise PrepareError(f"NodePrepareResources of {driver} left out claim {uid}")
                answer = resp.claims[uid]
                if answer.error:
                    raise PrepareError(f"NodePrepareResources of {driver} failed for claim {uid}: {answer.error}")
                self.prepared[uid] = {"driver": driver, "pods": {pod_uid},
                                      "ref": (c["metadata"]["namespace"], c["metadata"]["name"]),
                                      "devices": [(tuple(d.request_names), tuple(d.cdi_device_ids))
                                                  for d in answer.devices]}
        spec = pod.get("spec") or {}
        return {c["name"]: self.container_cdi(pod, c)
                for c in list(spec.get("initContainers") or ()) + list(spec.get("containers") or ())}

    def container_cdi(self, pod: Mapping[str, Any], container: Mapping[str, Any]) -> list[str]:
        """The CDI devices the runtime gets for ``container``, as ``Manager.GetResources`` builds them:
        pod claims in ``spec.resourceClaims`` order, then the container's references to each, each
        adding ``cdiDevicesAsList(claim.Request)`` (a device matches when the container names no
        request, the device names none, or its ``request_names`` contain the name exactly)."""
        statuses = {s["name"]: s.get("resourceClaimName") for s in (pod.get("status") or {}).get(
            "resourceClaimStatuses") or ()}
        ns = pod["metadata"]["namespace"]
        by_ref = {info["ref"]: info for info in self.prepared.values()}
        out: list[str] = []
        for pc in (pod.get("spec") or {}).get("resourceClaims") or ():
            name = pc.get("resourceClaimName") or statuses.get(pc["name"])
            if not name:
                continue
            for ref in (container.get("resources") or {}).get("claims") or ():
                if ref.get("name") != pc["name"]:
                    continue
                info = by_ref.get((ns, name))
                if info is None:
                    raise PrepareError(f"internal error: unable to get claim info for ResourceClaim {name}")
                request = ref.get("request") or ""
                for request_names, cdi_ids in info["devices"]:
                    if not request or not request_names or request in request_names:
                        out.extend(cdi_ids)
        return out

    def unprepare_pod(self, pod: Mapping[str, Any]) -> list[str]:
        """The pod is gone: unprepare its claims no other pod still uses; returns their UIDs."""
        pod_uid = pod["metadata"]["uid"]
        done = []
        for uid, info in list(self.prepared.items()):
            if pod_uid not in info["pods"]:
                continue
            info["pods"].discard(pod_uid)
            if info["pods"]:
                continue
            plugin = self.plugins.get(info["driver"])
            if plugin is None:
                raise PrepareError(f"DRA driver {info['driver']} is not registered; claim {uid} stays prepared")
            pb, pb_grpc = _API[plugin.service]
            ns, name = info["ref"]
            with grpc.insecure_channel(f"unix://{plugin.endpoint}") as channel:
                resp = pb_grpc.DRAPluginStub(channel).NodeUnprepareResources(pb.NodeUnprepareResourcesRequest(
                    claims=[pb.Claim(namespace=ns, name=name, uid=uid)]), timeout=PREPARE_TIMEOUT_SECONDS)
            if uid not in resp.claims or resp.claims[uid].error:
                info["pods"].add(pod_uid)
                raise PrepareError(f"NodeUnprepareResources failed for claim {uid}: "
                                   f"{resp.claims[uid].error if uid in resp.claims else 'missing from response'}")
            del self.prepared[uid]
            done.append(uid)
        return done
