"""The object store: every object, the global resourceVersion counter and a bounded change history.

One re-entrant lock guards it all and one condition wakes watches, so concurrent clients see the
linearizable behaviour of etcd-backed storage. Stored objects are never mutated in place: every write
stores a fresh deep copy, so the history can hand old versions to slow watches without copying.
"""
from __future__ import annotations

import copy
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from deviceplugin.dra.validation import drop_disabled_partitionable_fields, validate_resource_slice

from . import errors, managedfields
from .patches import apply_patch
from .resources import PODS, RESOURCESLICES, ResourceType
from .selectors import Selector

Obj = dict[str, Any]
Key = tuple[ResourceType, str, str]  # (type, namespace or "", name)


@dataclass(frozen=True)
class Change:
    """One committed write, as a watch sees it; ``old`` lets a filtered watch see objects leave."""

    rv: int
    type: str  # ADDED, MODIFIED, DELETED
    rtype: ResourceType
    obj: Obj
    old: Obj | None


def now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class Store:
    """Objects keyed by (type, namespace, name), with the write semantics of the real API server."""

    def __init__(self, history_limit: int = 10_000) -> None:
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self._objects: dict[Key, Obj] = {}
        self._rv = 1  # never "0": to a watch, resourceVersion "0" means "any", not "from the start"
        self._history: deque[Change] = deque()
        self._history_limit = history_limit
        self._compacted_rv = self._rv  # every change with rv > this is still in the history
        self.partitionable_devices = True  # the DRAPartitionableDevices feature gate (on since 1.36)

    # -- reads -------------------------------------------------------------------------------------
    @property
    def resource_version(self) -> int:
        with self.lock:
            return self._rv

    def get(self, rtype: ResourceType, namespace: str | None, name: str) -> Obj:
        with self.lock:
            obj = self._objects.get(_key(rtype, namespace, name))
            if obj is None:
                raise errors.not_found(rtype.plural, name)
            return obj

    def find(self, rtype: ResourceType, namespace: str | None, name: str) -> Obj | None:
        with self.lock:
            return self._objects.get(_key(rtype, namespace, name))

    def list_objects(self, rtype: ResourceType, namespace: str | None,
                     selector: Selector | None = None) -> tuple[list[Obj], int]:
        """Matching objects sorted by (namespace, name), and the resourceVersion they are current at."""
        with self.lock:
            items = [obj for (t, ns, _), obj in sorted(self._objects.items(), key=lambda kv: kv[0][1:])
                     if t == rtype and (namespace is None or ns == namespace)
                     and (selector is None or selector.matches(obj))]
            return items, self._rv

    def changes_after(self, rv: int) -> list[Change]:
        """Every change after ``rv``; 410 Expired when the history no longer reaches back that far."""
        with self.lock:
            if rv < self._compacted_rv:
                raise errors.expired(f"too old resource version: {rv} ({self._compacted_rv})")
            return [c for c in self._history if c.rv > rv]

    def compact(self) -> None:
        """Forget the history, as etcd compaction does: watches from older versions get 410."""
        with self.lock:
            self._history.clear()
            self._compacted_rv = self._rv

    # -- writes ------------------------------------------------------------------------------------
    def create(self, rtype: ResourceType, namespace: str | None, obj: Obj, *, keep_status: bool = False,
               dry_run: bool = False, manager: str | None = None) -> Obj:
        """POST: fill in server-owned metadata; 409 AlreadyExists when the name is taken.

        ``manager`` (the HTTP path's field manager) records managedFields as the real server does;
        ``None`` (Python-side set-up) keeps whatever managedFields the object carries."""
        if not isinstance(obj, dict):
            raise errors.bad_request(f"a {rtype.kind} must be a JSON object")
        new = copy.deepcopy(obj)
        meta = new.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise errors.bad_request("metadata must be an object")
        if rtype.namespaced:
            ns = meta.get("namespace") or namespace
            if namespace is not None and meta.get("namespace") not in (None, "", namespace):
                raise errors.bad_request("the namespace of the provided object does not match the namespace "
                                         "sent on the request")
            if not ns:
                raise errors.bad_request(f"{rtype.plural} must be created in a namespace")
            meta["namespace"] = ns
        with self.lock:
            if not meta.get("name"):
                if not meta.get("generateName"):
                    raise errors.invalid(rtype.plural, "", "metadata.name: Required value: name or generateName "
                                                           "is required")
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            name = meta["name"]
            key = _key(rtype, meta.get("namespace"), name)
            if key in self._objects:
                raise errors.already_exists(rtype.plural, name)
            new["kind"], new["apiVersion"] = rtype.kind, rtype.api_version
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = now_rfc3339()
            for server_owned in ("deletionTimestamp", "deletionGracePeriodSeconds"):
                meta.pop(server_owned, None)
            if rtype is PODS:
                _default_pod(new, keep_status)
            if manager is not None:
                new = managedfields.update(None, new, manager, rtype.api_version)
            _validate(rtype, new, None, self.partitionable_devices)
            if dry_run:
                meta["resourceVersion"] = str(self._rv)
                return new
            return self._commit(rtype, key, new, None, "ADDED")

    def update(self, rtype: ResourceType, namespace: str | None, name: str, obj: Obj,
               subresource: str | None = None, *, dry_run: bool = False, manager: str | None = None) -> Obj:
        """PUT: a stale ``metadata.resourceVersion`` is a 409 Conflict."""
        if not isinstance(obj, dict):
            raise errors.bad_request(f"a {rtype.kind} must be a JSON object")
        with self.lock:
            old = self.get(rtype, namespace, name)
            return self._replace(rtype, old, copy.deepcopy(obj), subresource, dry_run, manager)

    def patch(self, rtype: ResourceType, namespace: str | None, name: str, content_type: str, body: Any,
              subresource: str | None = None, *, dry_run: bool = False, manager: str | None = None) -> Obj:
        """PATCH: a patch that names a resourceVersion other than the current one is a 409 Conflict."""
        with self.lock:
            old = self.get(rtype, namespace, name)
            candidate = apply_patch(content_type, old, body)
            if not isinstance(candidate, dict):
                raise errors.bad_request("the patch did not produce an object")
            return self._replace(rtype, old, copy.deepcopy(candidate), subresource, dry_run, manager)

    def apply(self, rtype: ResourceType, namespace: str | None, name: str, body: Any, field_manager: str | None,
              subresource: str | None = None, *, dry_run: bool = False, force: bool = False) -> tuple[Obj, bool]:
        """PATCH with ``application/apply-patch+yaml`` (server-side apply); returns (object, created).

        As the real server: ``fieldManager`` is required, a missing object is created from the applied
        configuration, and the applied object's kind, name and namespace must match the URL. The applied
        configuration merges into the live object and the applier's fields are recorded
        (:mod:`.managedfields`: conflicts with other managers are a 409 unless ``force``).
        """
        if not field_manager:
            raise errors.bad_request("PATCH with application/apply-patch+yaml requires the fieldManager "
                                     "query parameter")
        if not isinstance(body, dict):
            raise errors.bad_request("an apply configuration must be an object")
        if body.get("kind") not in (None, rtype.kind) or body.get("apiVersion") not in (None, rtype.api_version):
            raise errors.bad_request(f"apply: {body.get('apiVersion')}/{body.get('kind')} does not match "
                                     f"{rtype.api_version}/{rtype.kind}")
        meta = body.get("metadata") or {}
        if meta.get("name") not in (None, name):
            raise errors.bad_request(f"the name of the object ({meta.get('name')}) does not match the name on "
                                     f"the URL ({name})")
        with self.lock:
            if isinstance(meta.get("managedFields"), list):
                raise errors.bad_request("metadata.managedFields must be nil in an apply configuration")
            if self.find(rtype, namespace, name) is None:
                if subresource is not None:
                    raise errors.not_found(rtype.plural, name)
                created = copy.deepcopy(body)
                created.setdefault("metadata", {})["name"] = name
                created = managedfields.apply({}, created, field_manager, force, rtype.api_version,
                                              rtype.plural, name)
                return self.create(rtype, namespace, created, dry_run=dry_run), True
            old = self.get(rtype, namespace, name)
            applied = copy.deepcopy(body)  # a resourceVersion in it is a precondition (409 when stale)
            if subresource == "status":
                applied = {"status": body.get("status") or {}}
            new = managedfields.apply(old, applied, field_manager, force, rtype.api_version, rtype.plural, name,
                                      subresource)
            return self._replace(rtype, old, new, subresource, dry_run), False

    def mutate(self, rtype: ResourceType, namespace: str | None, name: str, change: Callable[[Obj], None],
               manager: str | None = None) -> Obj:
        """Python-side write (test set-up, the demo's kubelet role): ``change`` edits a private copy;
        with ``manager`` the write is recorded in managedFields as that manager's Update."""
        with self.lock:
            old = self.get(rtype, namespace, name)
            new = copy.deepcopy(old)
            change(new)
            if manager is not None:
                new = managedfields.update(old, new, manager, rtype.api_version)
            return self._commit(rtype, _key(rtype, namespace, name), new, old, "MODIFIED")

    def delete(self, rtype: ResourceType, namespace: str | None, name: str, *, grace_seconds: int | None = None,
               precondition_uid: str | None = None, precondition_rv: str | None = None,
               graceful: bool = False, dry_run: bool = False) -> Obj:
        """DELETE; with ``graceful`` a bound pod only gets a deletionTimestamp (a kubelet finishes it)."""
        with self.lock:
            old = self.get(rtype, namespace, name)
            meta = old["metadata"]
            if precondition_uid and precondition_uid != meta["uid"]:
                raise errors.conflict(rtype.plural, name, f"Precondition failed: UID in precondition: "
                                                          f"{precondition_uid}, UID in object meta: {meta['uid']}")
            if precondition_rv and precondition_rv != meta["resourceVersion"]:
                raise errors.stale(rtype.plural, name)
            if dry_run:
                return old
            key = _key(rtype, namespace, name)
            bound = rtype is PODS and bool((old.get("spec") or {}).get("nodeName"))
            if graceful and bound and grace_seconds != 0 and not meta.get("deletionTimestamp"):
                def mark(obj: Obj) -> None:
                    obj["metadata"]["deletionTimestamp"] = now_rfc3339()
                    grace = grace_seconds if grace_seconds is not None else obj["spec"].get(
                        "terminationGracePeriodSeconds", 30)
                    obj["metadata"]["deletionGracePeriodSeconds"] = grace
                return self.mutate(rtype, namespace, name, mark)
            del self._objects[key]
            gone = copy.deepcopy(old)
            return self._commit(rtype, key, gone, old, "DELETED", store=False)

    def bind(self, namespace: str, name: str, binding: Obj) -> None:
        """POST pods/{name}/binding: set spec.nodeName once; a second binding is a 409 Conflict."""
        if not isinstance(binding, dict):
            raise errors.bad_request("a Binding must be a JSON object")
        target = (binding.get("target") or {}).get("name")
        with self.lock:
            pod = self.find(PODS, namespace, name)
            if pod is None:
                raise errors.not_found("pods", name)
            if not target:
                raise errors.invalid("bindings", name, "target.name: Required value")
            bmeta = binding.get("metadata") or {}
            node = (pod.get("spec") or {}).get("nodeName")
            uid = pod["metadata"]["uid"]
            if bmeta.get("uid") and bmeta["uid"] != uid:
                raise errors.conflict("pods/binding", name, f"Precondition failed: UID in precondition: "
                                                            f"{bmeta['uid']}, UID in object meta: {uid}")
            if node:
                raise errors.conflict("pods/binding", name, f'pod {name} is already assigned to node "{node}"')
            if pod["metadata"].get("deletionTimestamp"):
                raise errors.conflict("pods/binding", name, f"pod {name} is being deleted, cannot be assigned "
                                                            "to a host")

            def assign(obj: Obj) -> None:
                obj.setdefault("spec", {})["nodeName"] = target
                annotations = bmeta.get("annotations") or {}
                if annotations:
                    obj["metadata"].setdefault("annotations", {}).update(annotations)
                conditions = [c for c in obj.setdefault("status", {}).get("conditions") or []
                              if c.get("type") != "PodScheduled"]
                conditions.append({"type": "PodScheduled", "status": "True",
                                   "lastTransitionTime": now_rfc3339()})
                obj["status"]["conditions"] = conditions
            self.mutate(PODS, namespace, name, assign)

    # -- internals ---------------------------------------------------------------------------------
    def _replace(self, rtype: ResourceType, old: Obj, new: Obj, subresource: str | None, dry_run: bool,
                 manager: str | None = None) -> Obj:
        ometa, name = old["metadata"], old["metadata"]["name"]
        nmeta = new.get("metadata")
        if not isinstance(nmeta, dict):
            nmeta = new["metadata"] = {}
        if nmeta.get("resourceVersion") not in (None, "", ometa["resourceVersion"]):
            raise errors.stale(rtype.plural, name)
        if nmeta.get("name", name) != name:
            raise errors.bad_request(f"the name of the object ({nmeta.get('name')}) does not match the name on "
                                     f"the URL ({name})")
        if rtype.namespaced and nmeta.get("namespace", ometa["namespace"]) != ometa["namespace"]:
            raise errors.bad_request("the namespace of the provided object does not match the namespace sent "
                                     "on the request")
        for server_owned in ("name", "namespace", "uid", "creationTimestamp", "deletionTimestamp",
                             "deletionGracePeriodSeconds", "generateName"):
            if server_owned in ometa:
                nmeta[server_owned] = ometa[server_owned]
            else:
                nmeta.pop(server_owned, None)
        new["kind"], new["apiVersion"] = rtype.kind, rtype.api_version
        if subresource == "status":
            # as ResetObjectMetaForStatus: a status write changes status only
            new = {**copy.deepcopy(old), "status": new.get("status") or {}}
        elif "status" in rtype.subresources:
            new["status"] = copy.deepcopy(old.get("status") or {})
            if rtype is PODS:
                _check_pod_spec_change(old, new)
        if manager is not None:  # an apply recorded its fields before
            new = managedfields.update(old, new, manager, rtype.api_version, subresource)
        nmeta = new["metadata"]
        nmeta["resourceVersion"] = ometa["resourceVersion"]
        _validate(rtype, new, old, self.partitionable_devices)
        if new == old or dry_run:
            return old if new == old else new  # a no-op write bumps nothing and wakes no watch
        return self._commit(rtype, _key(rtype, ometa.get("namespace"), name), new, old, "MODIFIED")

    def _commit(self, rtype: ResourceType, key: Key, new: Obj, old: Obj | None, kind: str,
                store: bool = True) -> Obj:
        self._rv += 1
        new["metadata"]["resourceVersion"] = str(self._rv)
        if store:
            self._objects[key] = new
        self._history.append(Change(self._rv, kind, rtype, new, old))
        while len(self._history) > self._history_limit:
            self._compacted_rv = self._history.popleft().rv
        self.changed.notify_all()
        return new


def _key(rtype: ResourceType, namespace: str | None, name: str) -> Key:
    return (rtype, (namespace or "") if rtype.namespaced else "", name)


def _validate(rtype: ResourceType, new: Obj, old: Obj | None, partitionable: bool = True) -> None:
    """The API server's validation of the kinds our daemons write where it refuses more than the
    schema: ResourceSlices (pkg/apis/resource/validation ``ValidateResourceSlice[Update]``, ported in
    :mod:`deviceplugin.dra.validation`); a refusal is a 422 naming every field error. Before it, the
    strategy drops the fields of a disabled DRAPartitionableDevices gate (``PrepareForCreate/Update``)."""
    if rtype is RESOURCESLICES:
        drop_disabled_partitionable_fields(new, old, partitionable)
        found = validate_resource_slice(new, old)
        if found:
            raise errors.invalid_fields(rtype.kind, "resource.k8s.io", new["metadata"]["name"], found)


def _default_pod(pod: Obj, keep_status: bool) -> None:
    """Validate the one thing every pod needs and fill in the defaults a real server would."""
    spec = pod.get("spec")
    name = pod["metadata"]["name"]
    if not isinstance(spec, dict):
        raise errors.invalid("pods", name, "spec: Required value")
    containers = spec.get("containers")
    if not isinstance(containers, list) or not containers:
        raise errors.invalid("pods", name, "spec.containers: Required value")
    if any(not isinstance(c, dict) or not c.get("name") for c in containers):
        raise errors.invalid("pods", name, "spec.containers[].name: Required value")
    for field, default in (("schedulerName", "default-scheduler"), ("restartPolicy", "Always"),
                           ("terminationGracePeriodSeconds", 30), ("dnsPolicy", "ClusterFirst")):
        spec.setdefault(field, default)
    given = pod.get("status")
    status: Obj = given if keep_status and isinstance(given, dict) else {}
    status.setdefault("phase", "Pending")
    pod["status"] = status


_MUTABLE_POD_SPEC = ("activeDeadlineSeconds", "tolerations")


def _check_pod_spec_change(old: Obj, new: Obj) -> None:
    """Pods are nearly immutable (a real server allows images, deadline, tolerations); nodeName only via Binding."""
    def comparable(spec: Any) -> Any:
        spec = copy.deepcopy(spec or {})
        for field in _MUTABLE_POD_SPEC:
            spec.pop(field, None)
        for group in ("containers", "initContainers"):
            for container in spec.get(group) or []:
                if isinstance(container, dict):
                    container.pop("image", None)
        return spec
    if comparable(old.get("spec")) != comparable(new.get("spec")):
        raise errors.invalid("pods", old["metadata"]["name"], "spec: Forbidden: pod updates may not change "
                                                              "fields other than `spec.containers[*].image`, "
                                                              "`spec.activeDeadlineSeconds` or `spec.tolerations`")
