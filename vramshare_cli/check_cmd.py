"""``vramshare check``: read the cluster with the admin's kubeconfig, judge it (:mod:`vramshare_cli.checks`).

``--pre`` before an install (API, version, admission policies, node claim, DRA); without it, also what
an install should have made true. Exit status 0 when no line is ✗, 1 otherwise (for scripts).
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, TextIO

from vramshare import contract, kube
from vramshare_cli import checks, install

Obj = dict[str, Any]


_FORBIDDEN: list[str] = []  # what the last read was not allowed to see (names, for the snapshot)


def _json(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Obj | None:
    """The raw JSON of one client call; ``None`` for 404 (not there) and 403 (not ours to read: noted)."""
    from kubernetes.client.exceptions import ApiException
    try:
        resp = call(*args, _preload_content=False, _request_timeout=20, **kwargs)
    except ApiException as exc:
        if exc.status == 403:
            _FORBIDDEN.append(str(args[0]) if args and isinstance(args[0], str) else call.__name__)
            return None
        if exc.status == 404:
            return None
        raise
    return kube.decode(resp)  # type: ignore[no-any-return]


def read(api: Any, namespace: str, dra: bool, pre: bool) -> checks.Snapshot:
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException
    s = checks.Snapshot(namespace=namespace)
    _FORBIDDEN.clear()
    try:
        s.version = str(client.VersionApi(api).get_code(_request_timeout=10).git_version)
    except (ApiException, OSError, ValueError, Exception) as exc:  # noqa: BLE001 - urllib3 wraps socket errors
        s.version_error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return s
    adm = client.AdmissionregistrationV1Api(api)
    s.admission_policies = _items(_json(adm.list_validating_admission_policy))
    s.admission_bindings = _items(_json(adm.list_validating_admission_policy_binding))
    if dra:
        s.device_classes = _items(_json(client.ResourceV1Api(api).list_device_class))
    if pre:
        return s
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    s.nodes = _items(_json(core.list_node)) or []
    for name in ("vramshare-device-plugin", "vramshare-dra-plugin"):
        s.daemonsets[name] = _json(apps.read_namespaced_daemon_set, name, namespace)
    for name in ("vramshare-extender", "vramshare-scheduler", "vramshare-dra-scheduler"):
        s.deployments[name] = _json(apps.read_namespaced_deployment, name, namespace)
    for name in checks.SCHEDULERS:  # which client certificate each kube-scheduler read: its start time
        labels = ((((s.deployments.get(name) or {}).get("spec") or {}).get("selector") or {}).get("matchLabels") or {})
        if labels:
            s.scheduler_pods[name] = _items(_json(core.list_namespaced_pod, namespace=namespace, label_selector=",".join(
                f"{k}={v}" for k, v in sorted(labels.items()))))
    s.endpoints = _json(core.read_namespaced_endpoints, "vramshare-extender", namespace)
    try:
        resp = core.connect_get_namespaced_service_proxy_with_path(
            "http:vramshare-extender:metrics", namespace, "readyz", _preload_content=False, _request_timeout=10)
        s.readyz = (resp.status, kube.body(resp).decode(errors="replace"))
    except ApiException as exc:
        s.readyz = None if exc.status == 403 else (exc.status, str(exc.body or exc.reason))
    if s.readyz is not None and s.readyz[0] == 200:
        try:  # the keys the answering replica read at start (an extender older than /config: 404, skipped)
            resp = core.connect_get_namespaced_service_proxy_with_path(
                "http:vramshare-extender:metrics", namespace, "config", _preload_content=False, _request_timeout=10)
            s.extender_config = kube.decode(resp)
        except (ApiException, ValueError):
            s.extender_config = None
    for name in ("vramshare-extender-tls", "vramshare-scheduler-tls"):
        s.secrets[name] = _json(core.read_namespaced_secret, name, namespace)
    s.scheduler_config = _json(core.read_namespaced_config_map, "vramshare-scheduler-config", namespace)
    s.lease = _json(client.CoordinationV1Api(api).read_namespaced_lease, "vramshare-extender", namespace)
    if dra:  # one LIST: our driver's slices carry each DRA node's enforcement mode
        s.resource_slices = _items(_json(client.ResourceV1Api(api).list_resource_slice,
                                         field_selector=f"spec.driver={checks.NAMES.dra_driver}"))
    s.forbidden = set(_FORBIDDEN)
    s.events = _items(_json(core.list_event_for_all_namespaces, field_selector="reason=FailedCreate")) or []
    s.config_map = _json(core.read_namespaced_config_map, contract.CONFIG_MAP_NAME, namespace)
    s.config_refusals = _items(_json(core.list_event_for_all_namespaces,
                                     field_selector=f"reason={contract.EVENT_CONFIG_REFUSED}")) or []
    return s


def _items(doc: Obj | None) -> list[Obj] | None:
    return None if doc is None else list(doc.get("items") or [])


def judge(s: checks.Snapshot, dra: bool, pre: bool) -> list[checks.Line]:
    lines = checks.preinstall(s, dra, install.MIN_KUBERNETES, install.NODE_CLAIM_KUBERNETES, install.DRA_KUBERNETES)
    if s.version is not None and not pre:  # the DRA path's own lines only where DRA is served (one ✗ else)
        lines += checks.postinstall(s, dra and checks.dra_available(s, install.DRA_KUBERNETES))
    return lines


def config_file(args: argparse.Namespace) -> list[checks.Line]:
    """``--config FILE``: the file as the daemons would read it; with ``--diff``, against the cluster's
    ConfigMap (one GET with the kubeconfig), else against the defaults."""
    try:
        with open(args.config, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        return [checks.Line(checks.FAIL, f"cannot read {args.config}: {exc.strerror}")]
    if not args.diff:
        return checks.config_file(text, args.config, ns=args.namespace)
    api = kube.user_client_or_say(args.kubeconfig, "pass --kubeconfig FILE, or leave out --diff")
    with api:
        from kubernetes import client
        current = _json(client.CoreV1Api(api).read_namespaced_config_map, contract.CONFIG_MAP_NAME, args.namespace)
    where = f"{checks.CONFIG_WHERE} in {args.namespace}"
    running_text = ((current or {}).get("data") or {}).get(contract.CONFIG_FILE_KEY)
    if running_text is None:
        return [checks.Line(checks.WARN, f"no {where}: compared with the defaults")] + checks.config_file(
            text, args.config, ns=args.namespace)
    running, line = checks.parsed_config(running_text, where)
    if running is None:
        return [line] + checks.config_file(text, args.config, ns=args.namespace)
    return checks.config_file(text, args.config, running, where, args.namespace)


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    if args.diff and not args.config:
        print("vramshare check: --diff compares a file given with --config FILE", file=sys.stderr)
        return 2
    if args.config:
        lines = config_file(args)
    else:
        api = kube.user_client_or_say(args.kubeconfig, "pass --kubeconfig FILE")
        with api:
            lines = judge(read(api, args.namespace, args.dra, args.pre), args.dra, args.pre)
    for line in lines:
        print(line, file=out)
    failed = sum(line.mark == checks.FAIL for line in lines)
    if args.config:
        print(f"{args.config}: " + ("refused" if failed else "valid"), file=out)
    else:
        print(f"{len(lines)} checks: {failed} failed" + ("" if failed else ", ready"), file=out)
    return 1 if failed else 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pre", action="store_true", help="before installing: only what the cluster must offer")
    p.add_argument("--dra", action="store_true", help="also the DRA path (Kubernetes 1.36+)")
    p.add_argument("--namespace", default=install.NAMESPACE, metavar="NS", help=f"default {install.NAMESPACE}")
    p.add_argument("--kubeconfig", metavar="FILE", help="kubeconfig (default $KUBECONFIG, ~/.kube/config)")
    p.add_argument("--config", metavar="FILE",
                   help="check a config file (the ConfigMap's config.yaml) offline with the daemons' own parser, "
                        "and list the keys it sets; nothing else is checked")
    p.add_argument("--diff", action="store_true",
                   help="with --config: compare with the ConfigMap in the cluster and say which changes apply "
                        "live and which wait for a restart (and which)")
