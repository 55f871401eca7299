"""What ``vramshare check`` judges, from a snapshot of the cluster (pure: no I/O).

Each check is one :class:`Line`: ✓ (fine), ✗ (broken, with the fix; the command exits 1) or ! (works,
with a limit worth knowing). The adapter (:mod:`vramshare_cli.check_cmd`) reads the snapshot with the
admin's kubeconfig; anything it could not read is ``None`` here and judged as such.
"""
from __future__ import annotations

import base64
import datetime
import functools
from dataclasses import dataclass, field
from typing import Any, Collection

import yaml

from vramshare import config as vconfig, contract
from vramshare.contract import config_in_force, inventory as contract_inventory, slice_enforcement, slice_foreign
from vramshare.contract.config_in_force import ConfigInForce
from vramshare.inventory import InventoryError

Obj = dict[str, Any]
OK, FAIL, WARN = "✓", "✗", "!"
NAMES = contract.Names()
GPU_NODE_LABEL = "nvidia.com/gpu.present"  # NVIDIA GPU feature discovery / the GPU operator
CERT_WARN_DAYS = 30
SCHEDULERS = ("vramshare-scheduler", "vramshare-dra-scheduler")  # Deployments running kube-scheduler
SCHEDULER_CONTAINER = "kube-scheduler"
CERT_FAIL_DAYS = 7
ENFORCEMENT_WHY = {
    "driver": "driver memory limits (R615+, cgroup v2): allocations beyond a container's limit fail",
    "mps": "an MPS control daemon: a fixed per-container limit",
    "cooperative": "no driver limits (needs R615+ and cgroup v2) and no MPS daemon: the quota file is the "
                   "contract, over-limit containers get events",
}


@dataclass(frozen=True)
class Line:
    mark: str
    what: str
    fix: str = ""

    def __str__(self) -> str:
        return f"{self.mark} {self.what}" + (f" -- fix: {self.fix}" if self.fix else "")


@dataclass
class Snapshot:
    """What the adapter read. ``None``: could not be read (missing, or forbidden)."""

    version: str | None = None
    version_error: str = ""
    namespace: str = "vramshare-system"
    admission_policies: list[Obj] | None = None  # None: the API is not served
    admission_bindings: list[Obj] | None = None
    device_classes: list[Obj] | None = None  # None: resource.k8s.io/v1 not served
    resource_slices: list[Obj] | None = None  # our driver's ResourceSlices (with --dra); None: not read
    nodes: list[Obj] = field(default_factory=list)
    daemonsets: dict[str, Obj | None] = field(default_factory=dict)
    deployments: dict[str, Obj | None] = field(default_factory=dict)
    endpoints: Obj | None = None
    readyz: tuple[int, str] | None = None  # the extender's /readyz through the service proxy
    secrets: dict[str, Obj | None] = field(default_factory=dict)
    scheduler_config: Obj | None = None
    lease: Obj | None = None  # the extender replicas' Lease (vramshare-extender)
    forbidden: set[str] = field(default_factory=set)  # names (or list calls) the user may not read
    events: list[Obj] = field(default_factory=list)
    config_map: Obj | None = None  # ConfigMap vramshare-config
    config_refusals: list[Obj] = field(default_factory=list)  # node Events VramshareConfigRefused
    extender_config: Obj | None = None  # the extender's /config (through the service proxy): what it runs with
    scheduler_pods: dict[str, list[Obj] | None] = field(default_factory=dict)  # Deployment -> its pods
    now: datetime.datetime = field(default_factory=lambda: datetime.datetime.now(datetime.timezone.utc))


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.lstrip("v").split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()))


def _v(t: tuple[int, int]) -> str:
    return f"{t[0]}.{t[1]}"


def preinstall(s: Snapshot, dra: bool, minimum: tuple[int, int], node_claim: tuple[int, int],
               dra_min: tuple[int, int]) -> list[Line]:
    if s.version is None:
        return [Line(FAIL, f"API server not reachable ({s.version_error})",
                     "check the kubeconfig's current context (kubectl cluster-info)")]
    out = [Line(OK, f"API server reachable: Kubernetes {s.version}")]
    v = _minor(s.version)
    if v < minimum or s.admission_policies is None:
        out.append(Line(FAIL, f"ValidatingAdmissionPolicy v1 not available (Kubernetes {s.version})",
                        f"upgrade the control plane to {_v(minimum)} or newer"))
    else:
        out.append(Line(OK, "admission policies available (admissionregistration.k8s.io/v1)"))
    if v >= node_claim:
        out.append(Line(OK, f"service-account tokens carry the node-name claim ({_v(node_claim)}+): "
                            "each device plugin may write only its own node"))
    else:
        out.append(Line(WARN, f"no node-name claim before {_v(node_claim)}: device plugins are not node-scoped",
                        "vramshare install leaves the node-scope binding out; upgrade for node scoping"))
    if dra:
        if not dra_available(s, dra_min):
            out.append(Line(FAIL, f"DRA with consumable capacity needs Kubernetes {_v(dra_min)}+ "
                                  f"(resource.k8s.io/v1 {'not served' if s.device_classes is None else 'served'})",
                            "upgrade the control plane, or install without --dra"))
        else:
            out.append(Line(OK, f"DRA available (resource.k8s.io/v1; DRAConsumableCapacity on by default from "
                                f"{_v(dra_min)}: a control plane that turned it off leaves shared claims unplaced)"))
    return out


def dra_available(s: Snapshot, dra_min: tuple[int, int]) -> bool:
    """The cluster serves DRA with consumable capacity: without it, the DRA path's other lines would only
    repeat that one ✗ (no DeviceClasses, no DRA plugin ...)."""
    return s.version is not None and _minor(s.version) >= dra_min and s.device_classes is not None


def postinstall(s: Snapshot, dra: bool) -> list[Line]:
    out: list[Line] = [Line(WARN, f"not allowed to read {what}: what depends on it is judged as missing",
                            "run check as a cluster admin (README, 'Inspect from a laptop')")
                       for what in sorted(s.forbidden - {"vramshare-extender-tls", "vramshare-scheduler-tls"})]
    ns = s.namespace
    out += _workload(s.daemonsets.get("vramshare-device-plugin"), "DaemonSet", "vramshare-device-plugin", ns)
    dra_modes = slice_enforcement.node_modes(s.resource_slices or [], NAMES.dra_driver) if dra else {}
    running = _config_in_force(s)
    out += _nodes(s.nodes, ns, dra_only={n for n, m in dra_modes.items() if m.devices},
                  unit_mib=running.memory_unit_mib if running is not None else None)
    out += _workload(s.deployments.get("vramshare-extender"), "Deployment", "vramshare-extender", ns)
    out += _leader(s, ns)
    out += _reachable(s, ns)
    out += _certificates(s, ns)
    out += _schedulers_certificate(s, ns)
    out += _profile(s, ns)
    if dra:
        out += _workload(s.daemonsets.get("vramshare-dra-plugin"), "DaemonSet", "vramshare-dra-plugin", ns)
        out += _workload(s.deployments.get("vramshare-dra-scheduler"), "Deployment", "vramshare-dra-scheduler", ns)
        ours = sorted(c["metadata"]["name"] for c in s.device_classes or [] if "vramshare" in c["metadata"]["name"])
        out.append(Line(OK, f"DeviceClasses: {', '.join(ours)}") if ours else
                   Line(FAIL, "no vramshare DeviceClasses", "vramshare install --dra ... | kubectl apply -f -"))
        out += _dra_nodes(s, dra_modes, ns)
    out += _held_outside(s, dra)
    out += _config(s, ns)
    out += _admission(s)
    return out


def _workload(obj: Obj | None, kind: str, name: str, ns: str) -> list[Line]:
    if obj is None:
        return [Line(FAIL, f"{kind} {ns}/{name} not found", "vramshare install ... | kubectl apply -f -")]
    st = obj.get("status") or {}
    if kind == "DaemonSet":
        want, ready = int(st.get("desiredNumberScheduled") or 0), int(st.get("numberReady") or 0)
        if want == 0:
            return [Line(FAIL, f"{kind} {name}: scheduled on no node",
                         f"label GPU nodes {GPU_NODE_LABEL}=true (GPU feature discovery does) or check its nodeSelector")]
    else:
        want = int((obj.get("spec") or {}).get("replicas", 1))
        ready = int(st.get("readyReplicas") or 0)
    if kind == "Deployment" and 0 < ready < want:  # leader-elected replicas: one works, the spare is missing
        return [Line(WARN, f"{kind} {name}: {ready} of {want} ready (working, without its hot standby)",
                     f"kubectl -n {ns} describe {kind.lower()} {name}")]
    if ready < want or want == 0:
        return [Line(FAIL, f"{kind} {name}: {ready} of {want} ready",
                     f"kubectl -n {ns} describe {kind.lower()} {name}; kubectl -n {ns} logs {kind.lower()}/{name}")]
    return [Line(OK, f"{kind} {name}: {ready} of {want} ready")]


def _nodes(nodes: list[Obj], ns: str, dra_only: Collection[str] = (), unit_mib: int | None = None) -> list[Line]:
    """The device plugin's nodes; a GPU node in ``dra_only`` (its DRA plugin publishes devices) without an
    inventory, or with one of no GPU (``dra.gpus`` gave them all to DRA), is the DRA plugin's alone, judged
    by :func:`_dra_nodes` instead. ``unit_mib``: the ConfigMap's ``memoryUnitMiB``; a node that counts in
    another unit (its plugin not restarted since it changed) gives the same ask another size there."""
    gpu_nodes = [n for n in nodes if (n["metadata"].get("labels") or {}).get(GPU_NODE_LABEL) == "true"
                 or NAMES.inventory in (n["metadata"].get("annotations") or {})]
    if not gpu_nodes:
        return [Line(FAIL, f"no GPU node (label {GPU_NODE_LABEL}=true or a published inventory)",
                     "install NVIDIA GPU feature discovery or label the GPU nodes")]
    out = []
    for node in sorted(gpu_nodes, key=lambda n: n["metadata"]["name"]):
        name = node["metadata"]["name"]
        text = (node["metadata"].get("annotations") or {}).get(NAMES.inventory)
        fix = f"kubectl -n {ns} get pods -o wide --field-selector spec.nodeName={name}, then its logs"
        if not text and name in dra_only:
            continue
        if not text:
            out.append(Line(FAIL, f"node {name}: no GPU inventory published (device plugin not running there)", fix))
            continue
        try:
            inv = _inventory(text)
        except InventoryError as exc:
            out.append(Line(FAIL, f"node {name}: inventory does not parse ({exc})", fix))
            continue
        if not inv.gpus and name in dra_only:
            continue  # dra.gpus gives every GPU here to the DRA plugin: nothing for the kubelet to register
        alloc = (node.get("status") or {}).get("allocatable") or {}
        ours = {k: v for k, v in alloc.items() if k.startswith(NAMES.domain + "/") and str(v) not in ("0", "")}
        if not ours:
            out.append(Line(FAIL, f"node {name}: {len(inv.gpus)} GPU(s) published but no {NAMES.domain}/ resource "
                                  "allocatable (the kubelet has not registered the device plugin)", fix))
            continue
        if unit_mib is not None and inv.gpus and inv.unit_mib != unit_mib:
            out.append(Line(FAIL, f"node {name}: one {NAMES.gpu_memory} is {inv.unit_mib} MiB there, "
                                  f"{unit_mib} MiB in {CONFIG_WHERE} (memoryUnitMiB is read at start): the same "
                                  "ask means another size on this node",
                            f"kubectl -n {ns} delete pod -l app.kubernetes.io/name=vramshare-device-plugin "
                            f"--field-selector spec.nodeName={name} (drain its GPU pods first), and restart the "
                            "extender if it was not"))
            continue
        mode = inv.enforcement.value if inv.enforcement else None
        why = ENFORCEMENT_WHY.get(mode or "", "mode not published (an older device plugin)")
        out.append(Line(OK, f"node {name}: device plugin registered ({', '.join(f'{v} x {k}' for k, v in sorted(ours.items()))}), "
                            f"enforcement {mode or '?'}: {why}"))
    return out


def _dra_nodes(s: Snapshot, modes: dict[str, slice_enforcement.DraNodeMode], ns: str) -> list[Line]:
    """Each DRA node's pool and enforcement mode, from our driver's ResourceSlices (the DRA plugin publishes
    no inventory: the ``enforcement`` attribute of its shared devices is where its mode is)."""
    if s.resource_slices is None:
        return [Line(WARN, "ResourceSlices not read: the DRA nodes' enforcement is not checked",
                     "run check as a cluster admin (list on resourceslices.resource.k8s.io)")]
    if not modes:
        return [Line(FAIL, f"no node publishes ResourceSlices of {NAMES.dra_driver} (the DRA plugin has not "
                           "published, or runs nowhere)",
                     f"kubectl -n {ns} logs daemonset/vramshare-dra-plugin")]
    out = []
    for name, m in sorted(modes.items()):
        pool = f"node {name}: DRA plugin publishes {m.devices} device(s), {m.shared} shared"
        if m.mode is not None:
            out.append(Line(OK, f"{pool}, enforcement {m.mode.value}: {ENFORCEMENT_WHY[m.mode.value]}"))
        elif m.shared:
            out.append(Line(WARN, f"{pool}, enforcement ?: {m.text}",
                            "upgrade the DRA plugin (vramshare install --dra ... | kubectl apply -f -); until then "
                            "its mode shows only in its metrics (vramshare_enforcement_mode)"))
        else:
            out.append(Line(OK, f"{pool}: {m.text}"))
    return out


_DEPARTED_HINT = ("; on a DRA device it also counts the claims of force-deleted pods still prepared "
                  "(vramshare_dra_departed_claims; the DRA plugin's log names them): their containers are still "
                  "stopping, and it clears when the kubelet unprepares them")


def _held_outside(s: Snapshot, dra: bool) -> list[Line]:
    """GPU memory no vramshare pod holds, as the nodes publish it (the inventory's ``foreignMiB``, the DRA
    slices' ``foreignMiB`` attribute and taint): booked as used, so fewer pods fit there. A day-two
    finding, not an install fault: a ! per node with how to find the process."""
    found: dict[str, list[str]] = {}
    for name, inv in _inventories(s):
        for g in inv.gpus:
            if g.foreign_mib:
                found.setdefault(name, []).append(f"GPU {g.index} {g.foreign_mib} MiB")
    on_dra: set[str] = set()
    if dra and s.resource_slices:
        for name, devices in slice_foreign.held_outside(s.resource_slices, NAMES.dra_driver).items():
            on_dra.add(name)
            found.setdefault(name, []).extend(f"{d} {'all of it' if mib is None else f'{mib} MiB'}"
                                              for d, mib in sorted(devices.items()))
    if not found:
        return [Line(OK, "no GPU memory held outside vramshare pods")]
    return [Line(WARN, f"node {name}: GPU memory held by no vramshare pod, booked as used so fewer pods fit "
                       f"({', '.join(what)})",
                 f"on {name}, nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv names the "
                 "process: a container that outlived its pod is stuck in the driver (drain the node, then reboot "
                 f"it); a daemon that holds memory on purpose (an MPS server): raise reservedMiBPerGPU in "
                 f"{CONFIG_WHERE}" + (_DEPARTED_HINT if name in on_dra else ""))
            for name, what in sorted(found.items())]


def _leader(s: Snapshot, ns: str) -> list[Line]:
    dep = s.deployments.get("vramshare-extender")
    if dep is None or int((dep.get("spec") or {}).get("replicas", 1)) < 2:
        return []
    holder = ((s.lease or {}).get("spec") or {}).get("holderIdentity")
    if not holder:
        return [Line(FAIL, "extender replicas have no leader (Lease vramshare-extender): verbs answer 'no leader'",
                     f"kubectl -n {ns} logs deployment/vramshare-extender | grep -i lease")]
    return [Line(OK, f"extender leader: {holder} (Lease vramshare-extender); the other replica is its hot standby")]


def _reachable(s: Snapshot, ns: str) -> list[Line]:
    subsets = (s.endpoints or {}).get("subsets") or []
    if not any(sub.get("addresses") for sub in subsets):
        return [Line(FAIL, "Service vramshare-extender has no ready endpoints (kube-scheduler cannot reach it)",
                     f"kubectl -n {ns} describe deployment vramshare-extender")]
    if s.readyz is None:
        return [Line(WARN, "extender /readyz not checked through the API server's service proxy",
                     "your user needs get on services/proxy (README, 'Inspect from a laptop')")]
    code, body = s.readyz
    if code != 200:
        return [Line(FAIL, f"extender not ready through its Service: {code} {body.strip()[:120]}",
                     f"kubectl -n {ns} logs deployment/vramshare-extender")]
    return [Line(OK, "extender ready and reachable through its Service (/readyz 200)")]


def _pem_cert(secret: Obj | None, key: str) -> Any:
    from cryptography import x509
    data = ((secret or {}).get("data") or {}).get(key)
    return x509.load_pem_x509_certificate(base64.b64decode(data)) if data else None


def _certificates(s: Snapshot, ns: str) -> list[Line]:
    from cryptography import x509
    out = []
    rotate = "vramshare install --tls generate ... | kubectl apply -f - (or let cert-manager renew), then restart the schedulers"
    server_name = f"vramshare-extender.{ns}.svc"
    for secret_name, role in (("vramshare-extender-tls", "serving"), ("vramshare-scheduler-tls", "client")):
        secret = s.secrets.get(secret_name)
        if secret is None and secret_name in s.forbidden:
            out.append(Line(WARN, f"Secret {ns}/{secret_name} not checked: your user may not read it",
                            "run check as a cluster admin, or grant get on that Secret"))
            continue
        if secret is None:
            out.append(Line(FAIL, f"Secret {ns}/{secret_name} missing (the extender's mutual TLS)", rotate))
            continue
        try:
            cert, ca = _pem_cert(secret, "tls.crt"), _pem_cert(secret, "ca.crt")
        except ValueError as exc:
            out.append(Line(FAIL, f"Secret {secret_name}: tls.crt or ca.crt does not parse ({exc})", rotate))
            continue
        if cert is None or ca is None:
            out.append(Line(FAIL, f"Secret {secret_name}: tls.crt and ca.crt needed", rotate))
            continue
        days = (cert.not_valid_after_utc - s.now).days
        problems = []
        if role == "serving":
            try:
                sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
            except x509.ExtensionNotFound:
                sans = []
            if server_name not in sans:
                problems.append(f"does not name {server_name}")
        # who must trust it: the extender trusts clients by its ca.crt, kube-scheduler the server by its own
        peer = s.secrets.get("vramshare-extender-tls" if role == "client" else "vramshare-scheduler-tls") or secret
        try:
            cert.verify_directly_issued_by(_pem_cert(peer, "ca.crt") or ca)
        except Exception:  # noqa: BLE001 - any failure means "not signed by that CA"
            problems.append("not signed by the CA the extender trusts" if role == "client"
                            else "not signed by the CA kube-scheduler trusts")
        if days < 0:
            problems.append(f"expired {-days} days ago")
        if problems or days < CERT_FAIL_DAYS:
            out.append(Line(FAIL, f"{role} certificate ({secret_name}): {', '.join(problems) or f'expires in {days} days'}",
                            rotate))
        elif days < CERT_WARN_DAYS:
            out.append(Line(WARN, f"{role} certificate ({secret_name}) expires in {days} days", rotate))
        else:
            out.append(Line(OK, f"{role} certificate ({secret_name}) valid for {days} more days"))
    return out


def _schedulers_certificate(s: Snapshot, ns: str) -> list[Line]:
    """kube-scheduler reads its client certificate once, at start: a scheduler container that started
    before the certificate now in ``vramshare-scheduler-tls`` was issued still presents an earlier one,
    and stops reaching the extender when that expires (the renewed Secret says nothing of it)."""
    try:
        cert = _pem_cert(s.secrets.get("vramshare-scheduler-tls"), "tls.crt")
    except ValueError:
        return []  # _certificates says so
    if cert is None:
        return []
    issued = cert.not_valid_before_utc
    out = []
    for name in SCHEDULERS:
        pods = s.scheduler_pods.get(name)
        if not pods:
            continue
        older = sorted(p["metadata"]["name"] for p in pods
                       if (at := _started(p, SCHEDULER_CONTAINER)) is not None and at < issued)
        if older:
            ago = (s.now - issued).days
            out.append(Line(WARN, f"{len(older)} {name} pod(s) started before their client certificate "
                                  f"(vramshare-scheduler-tls) was issued {ago} day(s) ago: kube-scheduler reads it "
                                  f"once, so {', '.join(older[:3])}{' ...' if len(older) > 3 else ''} still "
                                  "present(s) an earlier one, refused once it expires "
                                  "(vramshare_extender_client_certificate_expiry_timestamp_seconds says when)",
                            f"kubectl -n {ns} rollout restart deployment/{name}"))
        else:
            out.append(Line(OK, f"{name}: every kube-scheduler started after its client certificate was issued"))
    return out


def _started(pod: Obj, container: str) -> datetime.datetime | None:
    """When ``container`` of ``pod`` last started, if it runs."""
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == container:
            return _time(((status.get("state") or {}).get("running") or {}).get("startedAt"))
    return None


def _profile(s: Snapshot, ns: str) -> list[Line]:
    out = _workload(s.deployments.get("vramshare-scheduler"), "Deployment", "vramshare-scheduler", ns)
    data = (s.scheduler_config or {}).get("data") or {}
    text = data.get("scheduler-config.yaml") or next(iter(data.values()), None)
    fix = "vramshare install ... | kubectl apply -f - (ConfigMap vramshare-scheduler-config)"
    if not text:
        return out + [Line(FAIL, "scheduler profile vramshare-scheduler not found (ConfigMap vramshare-scheduler-config)", fix)]
    try:
        doc = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        return out + [Line(FAIL, f"scheduler profile does not parse ({exc})", fix)]
    profiles = {p.get("schedulerName") for p in doc.get("profiles") or []}
    urls = [e.get("urlPrefix", "") for e in doc.get("extenders") or []]
    want = f"https://vramshare-extender.{ns}.svc:"
    if "vramshare-scheduler" not in profiles or not any(u.startswith(want) for u in urls):
        return out + [Line(FAIL, f"scheduler profile: profiles {sorted(p or '' for p in profiles)}, extenders {urls} "
                                 f"(want vramshare-scheduler calling {want}8888)", fix)]
    return out + [Line(OK, "scheduler profile vramshare-scheduler calls the extender over mutual TLS")]


def _admission(s: Snapshot) -> list[Line]:
    out = []
    ours = sorted(p["metadata"]["name"] for p in s.admission_policies or [] if p["metadata"]["name"].startswith("vramshare"))
    bound = {b.get("spec", {}).get("policyName") for b in s.admission_bindings or []}
    unbound = [p for p in ours if p not in bound]
    if not ours:
        out.append(Line(FAIL, "vramshare's admission policies are not installed",
                        "vramshare install ... | kubectl apply -f -"))
    elif unbound:
        out.append(Line(FAIL, f"admission policies without a binding: {', '.join(unbound)}",
                        "vramshare install ... | kubectl apply -f -"))
    else:
        out.append(Line(OK, f"{len(ours)} admission policies installed and bound"))
    refused = [e for e in s.events if e.get("reason") == "FailedCreate" and "ValidatingAdmissionPolicy 'vramshare"
               in (e.get("message") or "")]
    if refused:
        first = refused[0]
        obj = first.get("involvedObject") or first.get("regarding") or {}
        out.append(Line(FAIL, f"{len(refused)} pod creation(s) refused by vramshare's admission policy, e.g. "
                              f"{obj.get('kind', '')} {obj.get('namespace', '')}/{obj.get('name', '')}: "
                              f"{(first.get('message') or '').strip()[:160]}",
                        "GPU pods use schedulerName: vramshare-scheduler and set no nodeName (README, 'Security')"))
    else:
        out.append(Line(OK, "no pod creation refused by vramshare's admission policies"))
    return out


# -- the config ---------------------------------------------------------------------------------
CONFIG_WHERE = f"ConfigMap {contract.CONFIG_MAP_NAME}"


def parsed_config(text: str, where: str) -> tuple[vconfig.Config | None, Line]:
    """The daemons' own parser on ``text``: the config, or the line that names the refused key."""
    try:
        parsed = vconfig.parse_config(text)
    except vconfig.ConfigError as exc:
        return None, Line(FAIL, f"{where} is refused by the daemons' parser: {exc}",
                          "correct that key and apply again; until then the node plugins keep their last good "
                          "config, and a plugin or extender that restarts exits at start")
    return parsed, Line(OK, f"{where}: a valid config (schema {parsed.version})")


def _time(text: Any) -> datetime.datetime | None:
    try:
        return datetime.datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    except ValueError:
        return None


def _changed_at(obj: Obj) -> datetime.datetime | None:
    """When ``obj`` last changed, by its managedFields (the API server stamps every write), else its creation."""
    meta = obj.get("metadata") or {}
    times = [t for t in (_time(m.get("time")) for m in meta.get("managedFields") or []) if t is not None]
    return max(times) if times else _time(meta.get("creationTimestamp"))


def _config_in_force(s: Snapshot) -> vconfig.Config | None:
    """The ConfigMap's config as the daemons read it, ``None`` when it is missing or refused."""
    text = ((s.config_map or {}).get("data") or {}).get(contract.CONFIG_FILE_KEY)
    return parsed_config(text, CONFIG_WHERE)[0] if text is not None else None


def _config(s: Snapshot, ns: str) -> list[Line]:
    """The ConfigMap as the daemons read it, and the nodes that refused it as it is now (their Events
    ``VramshareConfigRefused``, posted after its last change: a node image older than this CLI)."""
    install_fix = "vramshare install ... | kubectl apply -f -"
    if s.config_map is None:
        return [Line(FAIL, f"{CONFIG_WHERE} not found (the node plugins and the extender mount it)", install_fix)]
    text = (s.config_map.get("data") or {}).get(contract.CONFIG_FILE_KEY)
    if text is None:
        return [Line(FAIL, f"{CONFIG_WHERE} has no {contract.CONFIG_FILE_KEY}", install_fix)]
    parsed, line = parsed_config(text, CONFIG_WHERE)
    if parsed is None:
        return [line]
    since = _changed_at(s.config_map)
    refused: dict[str, tuple[datetime.datetime, Obj]] = {}
    for event in s.config_refusals:
        if event.get("reason") != contract.EVENT_CONFIG_REFUSED:
            continue
        at = _time(event.get("lastTimestamp") or event.get("eventTime"))
        node = (event.get("involvedObject") or event.get("regarding") or {}).get("name", "?")
        if at is not None and (since is None or at >= since) and at >= refused.get(node, (at, {}))[0]:
            refused[node] = (at, event)
    out = [line, *_extender_stale(s, parsed, ns), *_nodes_behind(s, text, set(refused), since, ns)]
    if not refused:
        return out
    nodes = sorted(refused)
    latest = max(refused.values(), key=lambda hit: hit[0])[1]
    return [*out, Line(FAIL, f"{len(nodes)} node(s) refused {CONFIG_WHERE} as it is now ({', '.join(nodes[:5])}"
                             f"{', ...' if len(nodes) > 5 else ''}): {(latest.get('message') or '').strip()[:200]}",
                       f"those nodes' plugins run an image that reads this config otherwise: kubectl -n {ns} get "
                       "pods -o wide -l app.kubernetes.io/part-of=vramshare (same image everywhere), or drop the key")]


#: how long the kubelet may take to project a ConfigMap edit into a pod (its sync period plus the cache's
#: TTL: about a minute, README "Day two")
CONFIGMAP_SYNC = datetime.timedelta(seconds=90)


def _nodes_behind(s: Snapshot, text: str, refused: Collection[str], since: datetime.datetime | None,
                  ns: str) -> list[Line]:
    """Which device plugins run the ConfigMap's text as it is now (the digest each publishes in its
    inventory, :class:`vramshare.inventory.ConfigInForce`), which still run an earlier one, and which
    wait for a restart to apply some of its keys. Nodes whose plugin publishes no digest (an older image,
    a DRA-only node) are not judged; nodes that refused it are named by their Event instead."""
    digest = vconfig.text_digest(text)
    current, behind, pending = [], [], {}
    for name, said in _configs_in_force(s):
        if name.split(" ")[0] in refused:
            continue
        if said.digest != digest:
            behind.append(name)
            continue
        current.append(name)
        if said.restart_pending:
            pending[name] = said.restart_pending
    out = []
    if current and not behind:
        out.append(Line(OK, f"{len(current)} node(s) run {CONFIG_WHERE} as it is now"))
    if behind:
        young = since is not None and s.now - since < CONFIGMAP_SYNC
        shown = ", ".join(sorted(behind)[:5]) + (", ..." if len(behind) > 5 else "")
        out.append(Line(WARN, f"{len(behind)} of {len(behind) + len(current)} node(s) still run an earlier "
                              f"{CONFIG_WHERE} ({shown})" + (": it changed less than a minute ago, the kubelet "
                                                              "projects it within about one" if young else ""),
                        "run check again in a minute" if young else
                        f"kubectl -n {ns} logs of those nodes' vramshare-device-plugin (or -dra-plugin) pods "
                        "('config refused' or 'config file missing'); a pod mounting the ConfigMap with subPath "
                        "never sees updates"))
    if pending:
        keys = sorted({k for ks in pending.values() for k in ks})
        nodes = sorted(pending)
        out.append(Line(WARN, f"{len(nodes)} node(s) wait for a restart to apply {', '.join(keys[:6])}"
                              f"{', ...' if len(keys) > 6 else ''} ({', '.join(nodes[:5])}{', ...' if len(nodes) > 5 else ''})",
                        _restart_fix((vconfig.NODE_RESTART,), ns)))
    return out


def _inventories(s: Snapshot) -> list[tuple[str, contract_inventory.NodeInventory]]:
    """(node, inventory) of each node that publishes one that parses (:func:`_nodes` names the others)."""
    out = []
    for node in s.nodes:
        raw = (node["metadata"].get("annotations") or {}).get(NAMES.inventory)
        try:
            inv = _inventory(raw) if raw else None
        except InventoryError:
            continue
        if inv is not None:
            out.append((node["metadata"]["name"], inv))
    return out


@functools.lru_cache(maxsize=256)
def _inventory(text: str) -> contract_inventory.NodeInventory:
    """A node's inventory annotation, parsed once per text for the checks that read it (raises
    :class:`InventoryError`; a refusal is not remembered, and says the same each time)."""
    return contract_inventory.parse(text)


def _configs_in_force(s: Snapshot) -> list[tuple[str, ConfigInForce]]:
    """What each node plugin says it runs: the device plugin in its inventory (named by its node), the DRA
    plugin on its ResourceSlices (``<node> (DRA)``; read with ``--dra``)."""
    out = [(name, inv.config) for name, inv in _inventories(s) if inv.config is not None]
    by_node: dict[str, ConfigInForce] = {}
    for obj in s.resource_slices or []:
        raw = ((obj.get("metadata") or {}).get("annotations") or {}).get(NAMES.config_in_force)
        node = (obj.get("spec") or {}).get("nodeName")
        try:
            said = config_in_force.parse(raw) if raw and node else None
        except config_in_force.ConfigInForceError:
            continue
        if said is not None:
            by_node[f"{node} (DRA)"] = said
    return out + sorted(by_node.items())


def _extender_stale(s: Snapshot, configmap: vconfig.Config, ns: str) -> list[Line]:
    """The extender reads its keys at start: a replica started before the ConfigMap changed them still
    runs the old values (its ``/config``), so pods are placed by them until it restarts."""
    if s.extender_config is None:
        return []
    try:
        running = vconfig.config_from_dict(s.extender_config)
    except vconfig.ConfigError as exc:
        return [Line(WARN, f"the extender's /config does not read as a config ({exc})")]
    stale = [c for c in vconfig.key_changes(running, configmap) if vconfig.EXTENDER_RESTART in c.applies]
    if not stale:
        return [Line(OK, f"the extender runs with {CONFIG_WHERE}'s extender keys")]
    shown = ", ".join(f"{c.key} {c.old} (ConfigMap: {c.new})" for c in stale[:4]) + (", ..." if len(stale) > 4 else "")
    return [Line(WARN, f"the extender runs with keys read before {CONFIG_WHERE} changed them: {shown}",
                 _restart_fix((vconfig.EXTENDER_RESTART,), ns))]


def _restart_fix(applies: tuple[str, ...], ns: str) -> str:
    fixes = []
    if vconfig.NODE_RESTART in applies:
        fixes.append(f"kubectl -n {ns} rollout restart daemonset/vramshare-device-plugin (and "
                     "daemonset/vramshare-dra-plugin on the DRA path)")
    if vconfig.EXTENDER_RESTART in applies:
        fixes.append(f"kubectl -n {ns} rollout restart deployment/vramshare-extender")
    return "; ".join(fixes)


def config_file(text: str, where: str, running: vconfig.Config | None = None, running_what: str = "",
                ns: str = "vramshare-system") -> list[Line]:
    """``vramshare check --config FILE``: the daemons' verdict on a config file before it is applied, and
    each key it changes: against the defaults, or (``running``) against the ConfigMap in the cluster,
    each with when it takes effect (live on the node plugins, or at which restart)."""
    parsed, line = parsed_config(text, where)
    if parsed is None:
        return [line]
    out = [line]
    changes = vconfig.key_changes(running or vconfig.Config(), parsed)
    against = running_what if running is not None else "the defaults"
    if not changes:
        out.append(Line(OK, f"no key differs from {against}"))
    for c in changes:
        what = f"{c.key}: {c.old} -> {c.new}"
        if running is None:
            out.append(Line(OK, f"{what} (set away from the default)"))
            continue
        waits = tuple(a for a in c.applies if a != vconfig.LIVE)
        said = "; ".join(([f"applies {vconfig.LIVE}"] if vconfig.LIVE in c.applies else [])
                         + [f"waits for {w}" for w in waits])
        out.append(Line(WARN, f"{what}: {said}", _restart_fix(waits, ns)) if waits else Line(OK, f"{what}: {said}"))
    return out
