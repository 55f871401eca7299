"""``vramshare install``: every object an install needs, for ``| kubectl apply -f -``.

It renders the kustomize base in ``deploy/`` (through :mod:`vramshare_cli.kustomize`, so whatever the base
and its components say flows through unchanged) and then does the five manual steps of a kustomize
install: the image, the namespace, the mutual-TLS Secrets (made in place, or cert-manager objects),
kube-scheduler's tag from the cluster's version, and the optional paths (DRA, monitoring). The
rendering is pure (:func:`render`); reading the cluster's version and printing are the CLI's.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, TextIO

import yaml

from vramshare import __version__
from vramshare_cli import kustomize
from vramshare.errors import UsageError

Obj = dict[str, Any]

NAMESPACE = "vramshare-system"
IMAGE_NAME = "ghcr.io/vramshare/vramshare"
DEFAULT_IMAGE = f"{IMAGE_NAME}:{__version__}"
SCHEDULER_IMAGE = "registry.k8s.io/kube-scheduler"
# What the manifests need of the cluster (README, "Run it on a real cluster"; tests/test_repository.py
# keeps the README's statements equal to these):
MIN_KUBERNETES = (1, 30)  # ValidatingAdmissionPolicy v1 (admission-policies.yaml)
NODE_CLAIM_KUBERNETES = (1, 32)  # the service-account token's node-name claim (the node-scope binding)
DRA_KUBERNETES = (1, 36)  # DRA consumable capacity on by default (deploy/daemonset/dra/)
NODE_SCOPE_BINDING = "vramshare-device-plugin-node-scope"
DEFAULT_CERT_DAYS = 365
EVICT_COMPONENT = "over-limit-evict"  # deploy/components/: pods/eviction create for the node plugins
#: how to uninstall (README "Uninstall", the help, the rendered stream's header say the same): the
#: namespace takes its objects along, so the later namespaced deletes may find them gone already
UNINSTALL = "the same flags with --tls keep | kubectl delete --ignore-not-found -f -"
MAX_CERT_DAYS = 3650  # ten years: beyond that a key outlives any rotation plan (the CA gets 30 days more)
#: ``--enforcement MODE``: the components each plugin needs for it (device plugin's, then the DRA plugin's,
#: the latter only with --dra), so a node running both plugins gets the mode in both from one flag
ENFORCEMENT_COMPONENTS = {"driver": ("driver-enforcement", "dra-driver-enforcement"),
                          "mps": ("mps-enforcement", "dra-mps-enforcement")}


def deploy_dir() -> pathlib.Path:
    """The manifests: ``vramshare_cli/deploy`` (a link to the checkout's ``deploy/``, a copy in a wheel)."""
    return pathlib.Path(__file__).resolve().parent / "deploy"


@dataclass(frozen=True)
class Options:
    kubernetes_version: str  # the API server's gitVersion, e.g. v1.33.2 (its -eks-... suffix is dropped)
    image: str = DEFAULT_IMAGE
    namespace: str = NAMESPACE
    tls: str = "generate"  # generate | cert-manager | keep (upgrades: the Secrets in the cluster stay)
    cert_days: int | None = None  # validity of generated certificates (--tls generate only); None: 365 days
    dra: bool = False
    dra_gpus: tuple[str, ...] = ()
    monitoring: bool = False  # PodMonitors (prometheus-operator)
    dashboard_namespace: str | None = None  # the Grafana dashboard ConfigMap, in Grafana's namespace
    components: tuple[str, ...] = field(default_factory=tuple)  # deploy/components/<name>
    enforcement: str | None = None  # driver | mps: the opt-in enforcement components of every plugin installed
    #: the config to install in the ConfigMap vramshare-config (its text, checked first); None: the shipped
    #: defaults, which an upgrade without it puts back in place of an admin's edits
    config_text: str | None = None


def parse_version(text: str) -> tuple[int, int, int]:
    m = re.fullmatch(r"v?(\d+)\.(\d+)(?:\.(\d+))?(?:[-+].*)?", text.strip())
    if not m:
        raise UsageError(f"Kubernetes version {text!r}: expected e.g. 1.33 or v1.33.2")
    return int(m[1]), int(m[2]), int(m[3] or 0)


def scheduler_tag(version: str) -> str:
    """kube-scheduler's image tag for an API server's version: ``v1.33.2`` (vendor suffixes dropped)."""
    major, minor, patch = parse_version(version)
    return f"v{major}.{minor}.{patch}"


def components(root: pathlib.Path | None = None) -> dict[str, pathlib.Path]:
    """The opt-in kustomize Components under deploy/ (``kind: Component``), by directory name."""
    root = root or deploy_dir()
    out = {}
    for path in sorted(root.rglob("kustomization.yaml")):
        doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        if doc.get("kind") == "Component":
            out[path.parent.name] = path.parent
    return out


def render(opts: Options, tls: Callable[[str, int], list[Obj]] | None = None,
           root: pathlib.Path | None = None) -> list[Obj]:
    """The objects to apply. ``tls(namespace, days)`` makes the two Secrets (``opts.tls == "generate"``)."""
    root = root or deploy_dir()
    version = parse_version(opts.kubernetes_version)
    if version[:2] < MIN_KUBERNETES:
        raise UsageError(f"the cluster runs Kubernetes {opts.kubernetes_version}; vramshare needs "
                         f"{_v(MIN_KUBERNETES)} or newer (ValidatingAdmissionPolicy v1)")
    if opts.dra and version[:2] < DRA_KUBERNETES:
        raise UsageError(f"--dra needs Kubernetes {_v(DRA_KUBERNETES)} or newer (DRA consumable capacity); the "
                         f"cluster runs {opts.kubernetes_version}: drop --dra")
    if opts.dra_gpus and not opts.dra:
        raise UsageError("--dra-gpus applies only with --dra")
    if opts.tls not in ("generate", "cert-manager", "keep"):
        raise UsageError(f"--tls {opts.tls}: one of generate, cert-manager, keep")
    if opts.cert_days is not None and opts.tls != "generate":
        raise UsageError(f"--cert-days applies only to certificates made now (--tls generate), not --tls {opts.tls}: "
                         "drop --cert-days")
    if opts.cert_days is not None and not 1 <= opts.cert_days <= MAX_CERT_DAYS:
        raise UsageError(f"--cert-days {opts.cert_days}: choose 1 to {MAX_CERT_DAYS} days (default "
                         f"{DEFAULT_CERT_DAYS}); 'vramshare check' says when to renew")
    base = root / ("cert-manager" if opts.tls == "cert-manager" else "daemonset")
    try:
        objects = _build(base)
        if opts.dra:  # before the components, so the DRA plugin's ones find its DaemonSet
            objects += _build(root / "daemonset" / "dra")
        known = components(root)
        for name in _components(opts):
            if name not in known:
                raise UsageError(f"--component {name}: not one of {', '.join(known) or '(none in deploy/)'}")
            kustomize.apply_component(str(known[name]), objects)
        if opts.monitoring:
            objects += _build(root / "monitoring")
        if opts.dashboard_namespace:
            for obj in _build(root / "grafana"):
                obj["metadata"]["namespace"] = opts.dashboard_namespace
                objects.append(obj)
        kustomize.set_images(objects, [_image_entry(opts.image), {"name": SCHEDULER_IMAGE,
                                                                  "newTag": scheduler_tag(opts.kubernetes_version)}])
    except kustomize.KustomizeError as exc:
        raise UsageError(f"{exc}") from None
    if version[:2] < NODE_CLAIM_KUBERNETES:  # no node-name claim: the binding would refuse every plugin write
        objects = [o for o in objects if o["metadata"].get("name") != NODE_SCOPE_BINDING]
    if opts.config_text is not None:
        if opts.dra_gpus:
            raise UsageError("--dra-gpus and --config: set dra.gpus in your config file instead")
        _set_config(objects, opts.config_text, _components(opts))
    if opts.dra_gpus:
        _set_dra_gpus(objects, opts.dra_gpus)
    if opts.namespace != NAMESPACE:
        objects = [_renamed(o, NAMESPACE, opts.namespace) for o in objects]
    if opts.tls == "generate":
        if tls is None:
            raise UsageError("--tls generate needs the cryptography package: pip install cryptography, "
                             "or use --tls cert-manager")
        objects += tls(opts.namespace, opts.cert_days or DEFAULT_CERT_DAYS)
    stamp_read_at_start(objects)
    return kustomize.order(objects)


#: The pod-template annotation that rolls a Deployment when what it reads only at start changes (Helm's
#: ``checksum/config`` idiom): a hash of that content as this render holds it. Not under ``vramshare.io/``:
#: the admission policy lets no one but our service accounts write those on a pod, and the ReplicaSet
#: controller creates these pods.
CONFIG_HASH_ANNOTATION = "checksum.vramshare.io/config"
_RELOADS_ITSELF = {"vramshare-extender": ("Secret",)}  # its TLS files: re-read every 10 s (extender/tls.py)


def stamp_read_at_start(objects: list[Obj]) -> None:
    """Annotate each Deployment's pod template with a hash of the ConfigMaps and Secrets of this render it
    mounts and reads only at start, so re-applying install with a changed config or new certificates rolls
    it (one replica at a time) where it used to run stale until someone restarted it: kube-scheduler reads
    its profile and client certificate once; the extender its keys of ``vramshare-config``
    (:data:`vramshare.config.EXTENDER_READS`, not the node plugins' keys, which those reload live) and
    not its Secrets. DaemonSets are left alone: the node plugins reload their config themselves."""
    import json
    from vramshare.config import text_digest
    by_name = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o for o in objects
               if o.get("kind") in ("ConfigMap", "Secret")}
    for dep in (o for o in objects if o.get("kind") == "Deployment"):
        name, ns = dep["metadata"]["name"], dep["metadata"].get("namespace")
        spec = dep["spec"]["template"]["spec"]
        read = []
        for vol in spec.get("volumes", []):
            kind, ref = (("ConfigMap", vol["configMap"].get("name")) if "configMap" in vol else
                         ("Secret", vol["secret"].get("secretName")) if "secret" in vol else (None, None))
            obj = by_name.get((kind, ns, ref))
            if obj is None or kind in _RELOADS_ITSELF.get(name, ()):
                continue
            read.append([kind, ref, _read_at_start(name, obj)])
        if read:
            digest = text_digest(json.dumps(sorted(read), sort_keys=True))
            dep["spec"]["template"].setdefault("metadata", {}).setdefault("annotations", {})[
                CONFIG_HASH_ANNOTATION] = digest


def _read_at_start(deployment: str, obj: Obj) -> Any:
    """What ``deployment`` reads of ``obj``: the extender only its keys of the vramshare config."""
    from vramshare import config as vconfig, contract
    data = {**obj.get("data", {}), **obj.get("stringData", {})}
    if deployment == "vramshare-extender" and obj["metadata"]["name"] == contract.CONFIG_MAP_NAME:
        cfg = vconfig.parse_config(data.get(contract.CONFIG_FILE_KEY, ""))
        return vconfig.file_values(cfg, vconfig.EXTENDER_READS)
    return data


def _components(opts: Options) -> list[str]:
    """``--enforcement``'s components first (``cdi-cri`` must come after ``driver-enforcement`` to patch its
    DaemonSet too), then the ``--component`` ones, each once."""
    if opts.enforcement is not None and opts.enforcement not in ENFORCEMENT_COMPONENTS:
        raise UsageError(f"--enforcement {opts.enforcement}: one of {', '.join(ENFORCEMENT_COMPONENTS)} "
                         "(cooperative needs no component)")
    implied = ENFORCEMENT_COMPONENTS.get(opts.enforcement or "", ())[:2 if opts.dra else 1]
    return list(dict.fromkeys([*implied, *opts.components]))


def _v(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def _build(directory: pathlib.Path) -> list[Obj]:
    if not directory.is_dir():
        raise UsageError(f"{directory}: not found; vramshare install renders deploy/ of a clone "
                         "(pip install -e .), or pass --manifests DIR")
    return kustomize.build(str(directory))


def _image_entry(ref: str) -> Obj:
    name, tag, digest = kustomize.split_image(ref)
    if not name or not (tag or digest):
        raise UsageError(f"--image {ref}: name a tag or digest, e.g. my.registry/vramshare:{__version__}")
    entry: Obj = {"name": IMAGE_NAME, "newName": name}
    if digest:
        entry["digest"] = digest
    else:
        entry["newTag"] = tag
    return entry


def _set_config(objects: list[Obj], text: str, components: list[str]) -> None:
    """The admin's config as the ConfigMap's ``config.yaml``, refused (naming the key) where the node
    plugins would refuse it, so a bad file never reaches the cluster: a key out of bounds, or
    ``overLimitAction: evict`` without the component that grants the eviction right."""
    from deviceplugin.quota.rights import evicting
    from vramshare.config import ConfigError, parse_config
    try:
        cfg = parse_config(text)
    except ConfigError as exc:
        raise UsageError(f"--config: {exc}") from None
    where = evicting(cfg)
    if where and EVICT_COMPONENT not in components:
        raise UsageError(f"--config sets overLimitAction: evict ({', '.join(where)}), which needs the eviction "
                         f"right the default roles lack: add --component {EVICT_COMPONENT}")
    cm = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "vramshare-config")
    cm["data"]["config.yaml"] = text


def _set_dra_gpus(objects: list[Obj], gpus: tuple[str, ...]) -> None:
    """dra.gpus in the config ConfigMap: the GPUs the DRA plugin serves and the device plugin leaves."""
    cm = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "vramshare-config")
    text = cm["data"]["config.yaml"]
    value = "all" if gpus == ("all",) else "[" + ", ".join(f'"{g}"' for g in gpus) + "]"
    new, n = re.subn(r"(?m)^(dra:\n(?:[ ]+#.*\n)*[ ]+gpus:) \[\]$", rf"\g<1> {value}", text)
    if n != 1:
        raise UsageError("--dra-gpus: the config in deploy/daemonset/configmap.yaml has no 'dra: gpus: []' to set")
    cm["data"]["config.yaml"] = new


def _renamed(value: Any, old: str, new: str) -> Any:
    """Every mention of the namespace (metadata, subjects, service-account names in CEL, the
    extender's URL in the scheduler profile, certificate names) moved to ``new``."""
    if isinstance(value, dict):
        return {k: _renamed(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [_renamed(v, old, new) for v in value]
    if isinstance(value, str):
        return re.sub(rf"(?<![\w-]){re.escape(old)}(?![\w-])", new, value)
    return value


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the config, CEL, the scheduler profile) as readable ``|`` blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value and not any(line != line.rstrip() for line in value.splitlines()) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump(objects: list[Obj], out: TextIO, header: str = "") -> None:
    if header:
        out.write("".join(f"# {line}\n" for line in header.splitlines()))
    for obj in objects:
        out.write("---\n")
        out.write(yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=120, allow_unicode=True))


# -- the command ----------------------------------------------------------------------------------
def cluster_version(kubeconfig: str | None, timeout_s: float = 10.0) -> str:
    """The API server's gitVersion through the user's kubeconfig (GET /version), one try of ``timeout_s``."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException
    from vramshare import kube
    api = kube.user_client_or_say(kubeconfig, "pass --kubeconfig FILE, or --kubernetes-version 1.33 to render "
                                  "offline")
    host = getattr(getattr(api, "configuration", None), "host", "the API server")
    print(f"vramshare install: reading the cluster's version from {host} (--kubernetes-version skips this)",
          file=sys.stderr)  # a silent server keeps it for timeout_s: say what it waits for
    try:
        with api:
            return str(client.VersionApi(api).get_code(_request_timeout=timeout_s).git_version)
    except (ApiException, OSError, Exception) as exc:  # noqa: BLE001 - urllib3 wraps socket errors its own way
        raise UsageError(f"cannot read the cluster's version ({type(exc).__name__}: {exc}); pass "
                         "--kubernetes-version 1.33 to render offline") from None


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    config_text = None
    if args.config:  # before the API server is asked anything: a missing file fails at once
        try:
            config_text = pathlib.Path(args.config).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--config {args.config}: {getattr(exc, 'strerror', None) or exc}") from None
    version = args.kubernetes_version or cluster_version(args.kubeconfig)
    try:
        from vramshare_cli import certs

        def tls(ns: str, days: int) -> list[Obj]:
            return certs.secrets(certs.generate(ns, days), ns)
    except ImportError:
        tls = None  # type: ignore[assignment]
    opts = Options(kubernetes_version=version, image=args.image, namespace=args.namespace, tls=args.tls,
                   cert_days=args.cert_days, dra=args.dra,
                   dra_gpus=tuple(g for g in (args.dra_gpus or "").split(",") if g),
                   monitoring=args.monitoring, dashboard_namespace=args.dashboard,
                   components=tuple(args.component or ()), enforcement=args.enforcement, config_text=config_text)
    root = pathlib.Path(args.manifests) if args.manifests else None
    objects = render(opts, tls, root)
    dump(objects, out, header=f"vramshare {__version__}, Kubernetes {version}: "
                              f"vramshare install ... | kubectl apply -f -\n"
                              f"{len(objects)} objects; uninstall: {UNINSTALL}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Render deploy/ (the kustomize base, its components) with the image, namespace, mutual-TLS "
                     "Secrets, kube-scheduler's tag for the cluster's version and the chosen paths. 'vramshare "
                     "install | kubectl apply -f -' installs; 'vramshare install --tls keep ... | kubectl apply -f -' "
                     f"upgrades (the Secrets in the cluster stay); uninstall: {UNINSTALL}.")
    p.add_argument("--image", default=DEFAULT_IMAGE, metavar="REF",
                   help=f"the vramshare image, with a tag or @sha256 digest (default {DEFAULT_IMAGE})")
    p.add_argument("--namespace", default=NAMESPACE, metavar="NS", help=f"namespace (default {NAMESPACE})")
    p.add_argument("--kubernetes-version", metavar="V",
                   help="the cluster's version (e.g. 1.33.2) for kube-scheduler's tag; default: read from the "
                        "API server with the kubeconfig")
    p.add_argument("--kubeconfig", metavar="FILE", default=os.environ.get("KUBECONFIG"),
                   help="kubeconfig to read the version with (default $KUBECONFIG, ~/.kube/config)")
    p.add_argument("--tls", choices=["generate", "cert-manager", "keep"], default="generate",
                   help="the extender's mutual-TLS Secrets: generate them now (default; a new CA each run, so "
                        "restart the schedulers after re-applying), cert-manager objects, or keep the "
                        "Secrets already in the cluster (upgrades)")
    p.add_argument("--cert-days", type=int, metavar="N",
                   help=f"with --tls generate: how many days the certificates are valid (default {DEFAULT_CERT_DAYS})")
    p.add_argument("--dra", action="store_true",
                   help=f"also the DRA path (Kubernetes {_v(DRA_KUBERNETES)}+): DeviceClasses, DRA plugin, DRA scheduler")
    p.add_argument("--dra-gpus", metavar="LIST", help="with --dra: the GPUs DRA serves, 'all' or indexes/UUIDs "
                                                      "separated by commas (config dra.gpus)")
    p.add_argument("--monitoring", action="store_true",
                   help="PodMonitors and alert rules for prometheus-operator (deploy/monitoring/): every metric gets a "
                        "node label")
    p.add_argument("--dashboard", metavar="GRAFANA_NS",
                   help="the Grafana dashboard ConfigMap (sidecar label grafana_dashboard) in this namespace")
    p.add_argument("--component", action="append", metavar="NAME",
                   help="an opt-in kustomize Component under deploy/ (repeatable)")
    p.add_argument("--enforcement", choices=sorted(ENFORCEMENT_COMPONENTS),
                   help="driver: the driver-enforcement components (the device plugin's, and with --dra the DRA "
                        "plugin's) on nodes labelled vramshare.io/enforcement=driver; mps: the mps-enforcement "
                        "ones. One flag for a node running both plugins")
    p.add_argument("--config", metavar="FILE",
                   help="your config (version: v1, as in deploy/daemonset/configmap.yaml) for the ConfigMap "
                        "vramshare-config, checked first; without it the shipped defaults are installed, also "
                        "over your edits on an upgrade")
    p.add_argument("--manifests", metavar="DIR", help="the deploy/ folder to render (default: this checkout's)")
