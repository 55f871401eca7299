"""What a pod asks of vramshare, read from its Kubernetes JSON (a plain dict, as the API sends it).

Shared by the extender (filter/bind) and the device plugin (matching a pod at Allocate), so both read a
pod the same way. Pure: no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from vramshare import contract, quantity
from vramshare.config import Policy

#: The most devices of one resource a container may ask: far beyond any node (1 PiB of 1 GiB units), low
#: enough that no arithmetic on it overflows. Callers bound requests by the cluster's real GPUs.
MAX_DEVICES = 1 << 20
#: The most GPUs one container's memory may be spread over (annotation gpu-count).
MAX_GPU_COUNT = 64


ISOLATION_MIG = "mig"  # the one isolation served today: a MIG partition made for the pod (issue 24)


class PodSpecError(ValueError):
    """A pod whose vramshare request cannot be served as written; the message says what to change."""


@dataclass(frozen=True)
class ContainerDemand:
    """One container's ask. ``units`` of gpu-memory are split evenly over ``gpu_count`` GPUs."""

    container: str
    units: int = 0  # vramshare.io/gpu-memory devices
    gpu_count: int = 1  # distinct GPUs the units are spread over (pod annotation gpu-count)
    whole_gpus: int = 0  # vramshare.io/gpu
    mig: tuple[tuple[str, int], ...] = ()  # (profile, count) for vramshare.io/mig-<profile>
    restartable: bool = False  # an init container with restartPolicy Always (a sidecar)

    @property
    def units_per_gpu(self) -> int:
        return self.units // self.gpu_count if self.units else 0

    @property
    def empty(self) -> bool:
        return not (self.units or self.whole_gpus or self.mig)


@dataclass(frozen=True)
class PodDemand:
    namespace: str
    name: str
    uid: str
    containers: tuple[ContainerDemand, ...]
    models: tuple[str, ...] = ()  # allowed GPU model substrings (gpu-models annotation), empty = any
    policy: str | None = None  # per-pod policy override annotation
    #: ``spec.initContainers`` in order, sidecars (``restartable``) included; ``containers`` are the app
    #: containers only. How the two combine is the kubelet's rule: see :func:`effective_requests`.
    init_containers: tuple[ContainerDemand, ...] = ()
    #: The model it serves (annotation ``model``, issue 23): a placement hint only. A value that does not
    #: parse leaves ``model`` None (scheduling as without it) and says why in ``model_error`` to log.
    model: contract.ModelRef | None = None
    model_error: str | None = None
    #: Annotation ``isolation`` (issue 24): :data:`ISOLATION_MIG` serves every gpu-memory ask of the pod as
    #: a dynamic-MIG partition of the smallest profile that holds it; None: shared memory, as always.
    isolation: str | None = None

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def total_units(self) -> int:
        return sum(c.units for c in self.containers)


def _quantity(value: Any, where: str, maximum: int = MAX_DEVICES) -> int:
    """A whole, non-negative count read by the Kubernetes quantity rules (``1k`` is 1000)."""
    try:
        return quantity.whole(value, where, maximum)
    except quantity.QuantityError as exc:
        raise PodSpecError(str(exc)) from None


def _resources(container: Mapping[str, Any]) -> dict[str, Any]:
    res = container.get("resources") or {}
    # For extended resources requests must equal limits; limits alone imply requests.
    merged = dict(res.get("limits") or {})
    merged.update(res.get("requests") or {})
    return merged


def pod_demand(pod: Mapping[str, Any], names: contract.Names) -> PodDemand:
    """Read a pod's vramshare demand. Raises :class:`PodSpecError` for requests that cannot be met."""
    meta = pod.get("metadata") or {}
    ann = meta.get("annotations") or {}
    ns, name = meta.get("namespace", "default"), meta.get("name", "")
    count_raw = ann.get(names.gpu_count)
    gpu_count = 1
    if count_raw is not None:
        gpu_count = _quantity(count_raw, f"annotation {names.gpu_count}", MAX_GPU_COUNT)
        if gpu_count < 1:
            raise PodSpecError(f"annotation {names.gpu_count}: must be at least 1, got {count_raw!r}")
    spec = pod.get("spec") or {}
    containers = [_container_demand(c, names, gpu_count) for c in spec.get("containers") or []]
    inits = [_container_demand(c, names, gpu_count) for c in spec.get("initContainers") or []]
    if all(c.empty for c in containers + inits) and wants_gpu(pod, names):
        # The kubelet calls no Allocate for 0 devices, so the container would start with no GPU of ours,
        # and under the NVIDIA runtime with an image's NVIDIA_VISIBLE_DEVICES=all (CUDA images set it)
        # with every GPU of the node, unfenced: never a pod to place.
        listed = sorted({r for c in (spec.get("containers") or []) + (spec.get("initContainers") or [])
                         for r in _resources(c) if names.is_ours(r)})
        raise PodSpecError(f"asks 0 {' and '.join(listed)}: ask at least 1, or remove the {names.domain} "
                           "resources to run without a GPU")
    models = tuple(p.strip() for p in str(ann.get(names.gpu_models, "")).split("|") if p.strip())
    model, model_error = pod_model(ann, names)
    isolation = pod_isolation(ann, names, gpu_count)
    return PodDemand(ns, name, meta.get("uid", ""), tuple(containers), models, pod_policy(ann, names),
                     tuple(c for c in inits if not c.empty), model, model_error, isolation)


def pod_policy(annotations: Mapping[str, Any], names: contract.Names) -> str | None:
    """The pod's ``policy`` annotation as the extender reads it (trimmed, lower case), None when absent. A
    value that names no policy is a :class:`PodSpecError`: the user asked for a placement, and a typo
    silently placed by the cluster's policy would never tell them."""
    raw = annotations.get(names.policy)
    if raw is None:
        return None
    known = [p.value for p in Policy]
    if str(raw).strip().lower() not in known:
        raise PodSpecError(f"annotation {names.policy}: {str(raw)[:64]!r} is not a placement policy "
                           f"({', '.join(known)}): correct it or remove the annotation")
    return str(raw)


def pod_isolation(annotations: Mapping[str, Any], names: contract.Names, gpu_count: int) -> str | None:
    """The pod's ``isolation`` annotation: None when absent, else :data:`ISOLATION_MIG`. Any other value,
    or ``mig`` with ``gpu-count`` above 1 (one partition serves one container's memory on one GPU), is a
    :class:`PodSpecError`: a pod that asked to be isolated must never be placed as if it had not."""
    raw = annotations.get(names.isolation)
    if raw is None:
        return None
    if raw != ISOLATION_MIG:
        raise PodSpecError(f"annotation {names.isolation}: {str(raw)[:64]!r} is not an isolation vramshare "
                           f"serves (want {ISOLATION_MIG!r})")
    if gpu_count > 1:
        raise PodSpecError(f"annotation {names.isolation}: {ISOLATION_MIG!r} serves each container's "
                           f"{names.gpu_memory} with one MIG partition on one GPU; drop {names.gpu_count} "
                           f"or ask {names.mig_prefix}<profile> devices")
    return raw


def pod_model(annotations: Mapping[str, Any], names: contract.Names) -> tuple[contract.ModelRef | None, str | None]:
    """The pod's ``model`` annotation: ``(ref, None)``, ``(None, None)`` when absent, ``(None, why)`` when
    it does not parse (a hint that is wrong must not keep a pod from running: it is ignored and logged)."""
    raw = annotations.get(names.model)
    if raw is None:
        return None, None
    try:
        return contract.parse_model_ref(raw), None
    except contract.ModelRefError as exc:
        return None, str(exc)


def _container_demand(c: Mapping[str, Any], names: contract.Names, gpu_count: int) -> ContainerDemand:
    cname = c.get("name", "")
    units = whole = 0
    mig: list[tuple[str, int]] = []
    for res, qty in _resources(c).items():
        if not names.is_ours(res):
            continue
        n = _quantity(qty, f"container {cname}: {res}")
        if res == names.gpu_memory:
            units = n
        elif res == names.gpu:
            whole = n
        elif res.startswith(names.mig_prefix):
            mig.append((res[len(names.mig_prefix):], n))
    if units and units % gpu_count:
        raise PodSpecError(f"container {cname}: {units} units of {names.gpu_memory} do not split evenly "
                           f"over {gpu_count} GPUs ({names.gpu_count}); use a multiple of {gpu_count}")
    return ContainerDemand(cname, units, gpu_count if units else 1, whole, tuple(sorted(mig)),
                           c.get("restartPolicy") == "Always")


def wants_gpu(pod: Mapping[str, Any], names: contract.Names) -> bool:
    """Does any container (init containers included) ask for one of our resources? (kube-scheduler's
    ``IsInterested``, for our names, which also reads init containers.)"""
    spec = pod.get("spec") or {}
    for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        if any(names.is_ours(r) for r in _resources(c)):
            return True
    return False


def claim_refs(pod: Mapping[str, Any]) -> dict[str, str]:
    """The pod's name of each ResourceClaim it uses (``spec.resourceClaims[].name``, what a container's
    ``resources.claims[].name`` says) -> the claim's name, in spec order: a direct
    ``resourceClaimName``, or the one the claim controller made from a template
    (``status.resourceClaimStatuses``; absent until it did, and for a template it decided needs none)."""
    made = {s.get("name"): s.get("resourceClaimName")
            for s in (pod.get("status") or {}).get("resourceClaimStatuses") or () if isinstance(s, Mapping)}
    out: dict[str, str] = {}
    for pc in (pod.get("spec") or {}).get("resourceClaims") or ():
        if isinstance(pc, Mapping) and isinstance(pc.get("name"), str):
            name = pc.get("resourceClaimName") or made.get(pc["name"])
            if name:
                out[pc["name"]] = str(name)
    return out


def claim_names(pod: Mapping[str, Any]) -> list[str]:
    """The ResourceClaims a pod uses, in ``spec.resourceClaims`` order (:func:`claim_refs`)."""
    return list(claim_refs(pod).values())


def claim_containers(pod: Mapping[str, Any], claim: str) -> set[str]:
    """The containers (init containers too) that name the ResourceClaim ``claim`` in
    ``resources.claims``: the ones its devices are injected into."""
    local = {k for k, v in claim_refs(pod).items() if v == claim}
    spec = pod.get("spec") or {}
    return {str(c.get("name")) for c in (spec.get("containers") or []) + (spec.get("initContainers") or [])
            if isinstance(c, Mapping) and any(isinstance(r, Mapping) and r.get("name") in local
                                              for r in ((c.get("resources") or {}).get("claims") or ()))}


def run_once_init_containers(pod: Mapping[str, Any]) -> set[str]:
    """The pod's ordinary init containers (no ``restartPolicy: Always``): each runs alone beside the
    sidecars started before it and ends before the next container starts (the kubelet's order,
    ``kuberuntime_container.go`` ``computeInitContainerActions``), unlike a sidecar, which stays."""
    return {str(c.get("name")) for c in (pod.get("spec") or {}).get("initContainers") or ()
            if isinstance(c, Mapping) and c.get("restartPolicy") != "Always"}


def claim_users(pod: Mapping[str, Any], claim: str) -> int:
    """How many containers naming the ResourceClaim ``claim`` run at once, at most: the kubelet's order,
    counted as :func:`effective_requests` counts resources (sidecars beside everything after them, an
    ordinary init container alone with the sidecars before it). Each gets the claim's devices, and a
    fence per container (driver cgroup limits, MPS client limits) holds each at its share."""
    local = {k for k, v in claim_refs(pod).items() if v == claim}

    def names_it(c: Mapping[str, Any]) -> dict[str, int]:
        claims = (c.get("resources") or {}).get("claims") or ()  # the overhead's pseudo-container has none
        return {"n": int(any(isinstance(r, Mapping) and r.get("name") in local for r in claims))}
    return effective_requests(pod, names_it).get("n", 0)


def container_requests(container: Mapping[str, Any]) -> dict[str, Any]:
    """A container's requests as the API server defaults them: a limit without a request is the request."""
    return _resources(container)


def effective_requests(pod: Mapping[str, Any],
                       amounts: Callable[[Mapping[str, Any]], Mapping[str, int]]) -> dict[str, int]:
    """What the pod as a whole needs of each resource, counted the way the kubelet and kube-scheduler
    count it (``k8s.io/component-helpers/resource.PodRequests``, ``AggregateContainerRequests``):

    * app containers add up;
    * a restartable init container (a sidecar, ``restartPolicy: Always``) runs beside everything that
      starts after it, so it adds to the app containers' sum and to every later init container;
    * an ordinary init container runs alone (beside the sidecars started before it): the pod needs the
      largest of those, or the app sum, whichever is larger;
    * ``spec.overhead`` (RuntimeClass overhead) is added on top.

    ``amounts`` reads one container (e.g. GPU units, or CPU millicores and memory bytes).
    """
    spec = pod.get("spec") or {}
    total: dict[str, int] = {}
    for c in spec.get("containers") or []:
        _add(total, amounts(c))
    sidecars: dict[str, int] = {}
    init_peak: dict[str, int] = {}
    for c in spec.get("initContainers") or []:
        own = dict(amounts(c))
        if c.get("restartPolicy") == "Always":
            _add(total, own)
            _add(sidecars, own)
            running = dict(sidecars)
        else:
            running = dict(own)
            _add(running, sidecars)
        for key, value in running.items():
            init_peak[key] = max(init_peak.get(key, 0), value)
    for key, value in init_peak.items():
        total[key] = max(total.get(key, 0), value)
    overhead = spec.get("overhead")
    if overhead:
        _add(total, amounts({"name": "overhead", "resources": {"requests": overhead}}))
    return total


def _add(into: dict[str, int], more: Mapping[str, int]) -> None:
    for key, value in more.items():
        into[key] = into.get(key, 0) + value
