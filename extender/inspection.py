"""What the extender holds, per node and GPU: the ``/inspect`` JSON and the ``vramshare inspect`` table.

gpushare's ``/inspect`` taught operators to look here first when a pod stays Pending ("is there a GPU
with 20 GiB free?"), so the answer names every GPU with its total, used and free MiB and the pods on it.
Nodes whose GPUs the DRA plugin serves are listed with the enforcement mode their slices publish.
"""
from __future__ import annotations

import argparse
import ssl
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import TYPE_CHECKING, Any, TextIO

import orjson

from extender import accounting
from vramshare import contract, kube, mig, mig_plan
from vramshare.contract import quota_mib
from vramshare.contract import inventory as contract_inventory
from vramshare.inventory import InventoryError

if TYPE_CHECKING:
    from extender.dra_scoring import DraCluster
    from vramshare.contract.slice_enforcement import DraNodeMode

__all__ = ["render", "format_table", "run"]

Obj = dict[str, Any]


def _enforcement(annotation: str | None) -> str | None:
    """The node's GPU memory enforcement mode from its inventory (optional field, issue 9)."""
    try:
        mode = contract_inventory.parse(annotation).enforcement if annotation else None
    except InventoryError:
        return None
    return mode.value if mode else None


def _mirrors(acct: accounting.Accounting, names: contract.Names) -> dict[str, quota_mib.Mirror]:
    """Pod key -> its ``quota-mib`` mirror as the contract reads it; pods without one, or with one the
    codec refuses, are left out (inspect shows what it can read)."""
    out = {}
    for key, pod in acct.pods.items():
        text = ((pod.get("metadata") or {}).get("annotations") or {}).get(names.quota_mib)
        try:
            mirror = quota_mib.parse(text) if text else {}
        except quota_mib.QuotaMirrorError:
            continue
        if mirror:
            out[key] = mirror
    return out


def _states(acct: accounting.Accounting, names: contract.Names) -> dict[str, str]:
    """Pod key -> its containers' warmth from the quota loop's ``quota-mib`` mirror (issue 9)."""
    out = {}
    for key, mirror in _mirrors(acct, names).items():
        states = sorted({e.state for entries in mirror.values() for e in entries if e.state})
        if states:
            out[key] = "/".join(states)
    return out


def _tenants(mirrors: dict[str, quota_mib.Mirror]) -> dict[str, list[Obj]]:
    """GPU uuid -> its tenants (one per pod container) as the quota loop last mirrored them (issue 14):
    class, request, floor, limit, measured use (at the last change), state and the reason of it."""
    out: dict[str, list[Obj]] = {}
    for key, mirror in sorted(mirrors.items()):
        for container, entries in sorted(mirror.items()):
            for e in entries:
                out.setdefault(e.uuid, []).append({
                    "pod": key, "container": container, "class": e.qclass or "default",
                    "requestMiB": e.req, "floorMiB": e.floor, "limitMiB": e.mib,
                    "usedMiB": e.used, "state": e.state or None, "reason": e.why or None,
                    **{k: v for k, v in (("sleep", e.sleep or None), ("lentMiB", e.lent), ("wakeSeconds", e.wake_s))
                       if v is not None}})  # the warm tier (issue 23), where the engine can sleep
    return out


def _models(models: Any) -> tuple[list[Obj], dict[str, list[Obj]]]:
    """The node's resident models (issue 23): files in its cache, and engines per GPU uuid."""
    files, engines = [], {}
    for m in models or ():
        ref = f"{m.name}@{m.revision}" if m.revision else m.name
        if m.bytes:
            files.append({"model": ref, "bytes": m.bytes})
        for gpu, state in m.engines:
            engines.setdefault(gpu, []).append({"model": ref, "state": state.value})
    return files, engines


def _node(acct: accounting.Accounting, name: str) -> Obj:
    with acct.lock:  # one node at a time: consistent per node, and filter never waits for the whole walk
        files, engines = _models(acct.models.get(name))
        usage = acct.state.node_usage(name)
        mode = _enforcement(acct._annotation.get(name))  # the inventory text accounting keeps per node
        states = _states(acct, acct.names)
        tenants = _tenants(_mirrors(acct, acct.names))
    gpus: list[Obj] = []
    total = used = 0
    dynamic: set[str] = set()
    for use in usage:
        s = use.slot
        if s.mig_table:  # dynamic MIG (issue 24): the GPU counts once; only booked placements are rows
            gpu = s.uuid.partition(mig_plan.SEPARATOR)[0]
            if gpu not in dynamic:
                dynamic.add(gpu)
                total += mig.MODELS[s.mig_table].memory_mib
            if not use.used:
                continue
            total -= s.capacity
        total, used = total + s.capacity, used + use.used
        gpus.append({
            "index": s.index, "uuid": s.uuid, "model": s.model, "kind": s.kind, "healthy": s.healthy,
            "totalMiB": s.capacity, "usedMiB": use.used, "freeMiB": max(0, s.capacity - use.used),
            "pods": [{"pod": key, "mib": mib, **({"state": states[key]} if key in states else {})}
                     for key, mib in sorted(use.pods.items())],
            **({"tenants": tenants[s.uuid]} if s.uuid in tenants else {}),  # issue 14, where the loop mirrored
            **({"engines": engines[s.uuid]} if s.uuid in engines else {}),  # issue 23: models awake/asleep here
            **({"sleepCreditMiB": s.credit} if s.credit else {}),  # issue 23 item 5: totalMiB includes it
            **({"foreignMiB": s.foreign} if s.foreign else {}),  # held by no pod of ours: in usedMiB
        })
    doc = {"name": name, "totalMiB": total, "usedMiB": used, "freeMiB": max(0, total - used), "gpus": gpus}
    if mode:
        doc["enforcement"] = mode
    books = {u for use in usage for u in (use.slot.uuid, use.slot.uuid.partition(mig_plan.SEPARATOR)[0])}
    return _with_models(doc, files, engines, books)


def _with_models(doc: Obj, files: list[Obj], engines: dict[str, list[Obj]], shown: set[str]) -> Obj:
    """The node's cached model files, and the engines on GPUs not in the extender's books (``shown``: a
    GPU the DRA plugin serves is in slices, not in the inventory), one entry per engine with its GPU."""
    if files:
        doc["models"] = files
    others = [{"gpu": gpu, **e} for gpu, es in sorted(engines.items()) if gpu not in shown for e in es]
    if others:
        doc["engines"] = others
    return doc


def _models_only(acct: accounting.Accounting, name: str) -> Obj:
    """A node that reports models but has no inventory (its GPUs served by the DRA plugin, issue 23)."""
    with acct.lock:
        files, engines = _models(acct.models.get(name))
    return _with_models({"name": name, "totalMiB": 0, "usedMiB": 0, "freeMiB": 0, "gpus": []}, files, engines,
                        set())


def _dra_entry(m: DraNodeMode) -> Obj:
    """A DRA node's enforcement as its plugin publishes it in its slices (round 9): the mode, or ``None``
    and a note saying why there is none (an older plugin, no shared GPU)."""
    return {"enforcement": m.mode.value if m.mode else None, **({} if m.mode else {"note": m.text}),
            "devices": m.devices, "sharedDevices": m.shared}


def render(acct: accounting.Accounting, node: str | None = None, dra: DraCluster | None = None) -> Obj | None:
    """The whole cluster, or one node (``None`` if the extender does not know it). ``dra``: the DRA view
    (when the extender scores DRA pods), whose nodes are listed in ``draNodes`` with their mode.

    The lock is taken per node, not around the whole walk: at 5,000 nodes the walk takes most of a
    second, and an admin's ``vramshare inspect`` must not stall kube-scheduler's filter calls for it.
    """
    with acct.lock:
        names = sorted(acct.slots)
        model_nodes = sorted(n for n in acct.models if n not in acct.slots)  # DRA-served nodes (issue 23)
        unaccounted = dict(sorted(acct.unaccounted.items()))
    modes = dra.modes() if dra is not None else {}
    if node is not None:
        one = _node(acct, node) if node in names else _models_only(acct, node) if node in model_nodes else None
        if node in modes:
            one = one or {"name": node, "totalMiB": 0, "usedMiB": 0, "freeMiB": 0, "gpus": []}
            one["dra"] = _dra_entry(modes[node])
        return one
    doc: Obj = {"nodes": [_node(acct, n) for n in names], "unaccounted": unaccounted}
    if model_nodes:  # not in "nodes": no GPU of theirs is in the extender's books
        doc["modelNodes"] = [_models_only(acct, n) for n in model_nodes]
    if modes and dra is not None:  # the DRA plugin's nodes: their GPUs are in ResourceSlices, not in its books
        doc["draNodes"] = [{"name": n, **_dra_memory(dra, n), **_dra_entry(m)} for n, m in sorted(modes.items())]
    return doc


def _dra_memory(dra: DraCluster, node: str) -> Obj:
    """A DRA node's memory as the DRA view books it: its devices' capacity and what allocated claims
    consume of them, and of that used memory what no claim of ours holds (``foreignMiB``, what the plugin
    took off the published capacity: :mod:`vramshare.contract.slice_foreign`), in MiB."""
    usage = dra.state().node_usage(node)
    total = sum(u.slot.capacity for u in usage)
    used = sum(u.used for u in usage)
    free = sum(max(0, u.slot.capacity - u.used) for u in usage if u.slot.healthy)
    return {"totalMiB": total, "usedMiB": used, "freeMiB": free, "foreignMiB": sum(u.slot.foreign for u in usage)}


def _gib(mib: int) -> str:
    return f"{mib / 1024:.1f}"


def format_table(doc: Obj) -> str:
    """A fixed-width table, one row per GPU, memory in GiB."""
    nodes = doc["nodes"] if "nodes" in doc else [doc]
    header = ("NODE", "GPU", "MODEL", "KIND", "TOTAL", "USED", "FREE", "PODS")
    rows = [header]
    for n in nodes:
        for g in n["gpus"]:
            pods = ", ".join(f"{p['pod']} ({_gib(p['mib'])}{', ' + p['state'] if p.get('state') else ''})"
                             for p in g["pods"]) or "-"
            if g.get("engines"):
                pods += "; engines: " + ", ".join(f"{e['model']} {e['state']}" for e in g["engines"])
            if g.get("sleepCreditMiB"):
                pods += f"; sleep credit {_gib(g['sleepCreditMiB'])} in TOTAL"
            if g.get("foreignMiB"):
                pods += f"; {_gib(g['foreignMiB'])} of USED held outside our pods"
            kind = g["kind"] + ("" if g["healthy"] else " UNHEALTHY")
            rows.append((n["name"], str(g["index"]), g["model"], kind, _gib(g["totalMiB"]), _gib(g["usedMiB"]),
                         _gib(g["freeMiB"]), pods))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    total = sum(n["totalMiB"] for n in nodes)
    used = sum(n["usedMiB"] for n in nodes)
    lines.append(f"{len(nodes)} node(s), {sum(len(n['gpus']) for n in nodes)} GPU(s): "
                 f"{_gib(used)} of {_gib(total)} GiB used, {_gib(total - used)} GiB free (memory in GiB)")
    tenant_rows = [("NODE", "GPU", "POD/CONTAINER", "CLASS", "REQUEST", "FLOOR", "LIMIT", "USED", "STATE",
                    "ENFORCEMENT", "LAST CHANGE")]
    for n in nodes:
        for g in n["gpus"]:
            for t in g.get("tenants") or []:
                tenant_rows.append((n["name"], str(g["index"]), f"{t['pod']}/{t['container']}", str(t["class"]),
                                    *(_gib(t[k]) if isinstance(t.get(k), int) else "-"
                                      for k in ("requestMiB", "floorMiB", "limitMiB", "usedMiB")),
                                    _state(t), n.get("enforcement") or "-", t.get("reason") or "-"))
    if len(tenant_rows) > 1:
        widths = [max(len(r[i]) for r in tenant_rows) for i in range(len(tenant_rows[0]) - 1)]
        lines.append("")
        lines.extend("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in tenant_rows)
        lines.append("tenants: as the quota loop last changed them (memory in GiB; USED measured at that change)")
    for n in [*nodes, *(doc.get("modelNodes") or [])]:
        if n.get("models"):
            lines.append(f"{n['name']}: model files cached: " + ", ".join(
                f"{m['model']} ({m['bytes'] / (1 << 30):.1f} GiB)" for m in n["models"]))
        if n.get("engines"):  # on GPUs the DRA plugin serves
            lines.append(f"{n['name']}: engines on GPUs the DRA plugin serves: " + ", ".join(
                f"{e['model']} {e['state']} on {e['gpu']}" for e in n["engines"]))
    modes = {n["name"]: n["enforcement"] for n in nodes if n.get("enforcement")}
    if modes:
        lines.append("GPU memory enforcement: " + ", ".join(f"{n} {m}" for n, m in sorted(modes.items())))
    dra = doc.get("draNodes") or ([{"name": doc["name"], **doc["dra"]}] if doc.get("dra") else [])
    if doc.get("draNodes"):
        total, used, free, held = (sum(int(d.get(k) or 0) for d in dra)
                                   for k in ("totalMiB", "usedMiB", "freeMiB", "foreignMiB"))
        outside = f" ({_gib(held)} held outside our pods)" if held else ""
        lines.append(f"{len(dra)} DRA node(s): {_gib(used)} of {_gib(total)} GiB used{outside}, {_gib(free)} GiB free "
                     "(ResourceSlices and allocated claims)")
    if dra:
        lines.append("GPU memory enforcement (DRA plugin): " + ", ".join(
            f"{d['name']} {d.get('enforcement') or d.get('note') or 'mode not published'}" for d in dra))
    for pod, why in (doc.get("unaccounted") or {}).items():
        lines.append(f"warning: {pod} not accounted: {why}")
    return "\n".join(lines)


def _state(t: Obj) -> str:
    """The tenant's warmth, and its engine's warm-tier state where it can sleep (lent GiB, last wake)."""
    text = t.get("state") or "-"
    if t.get("sleep"):
        text += f" ({t['sleep']}"
        if isinstance(t.get("lentMiB"), int):
            text += f", lent {_gib(t['lentMiB'])}"
        if isinstance(t.get("wakeSeconds"), (int, float)):
            text += f", last wake {t['wakeSeconds']:.2f}s"
        text += ")"
    return text


def fetch(base_url: str, node: str | None = None, timeout: float = 10.0,
          context: ssl.SSLContext | None = None) -> Obj:
    url = base_url.rstrip("/") + "/inspect" + (f"/{urllib.parse.quote(node)}" if node else "")
    with urllib.request.urlopen(url, timeout=timeout, context=context) as resp:
        return orjson.loads(resp.read())


def client_context(cacert: str | None, cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """TLS client context for an extender that wants a client certificate (None: library defaults)."""
    if not (cacert or cert):
        return None
    ctx = ssl.create_default_context(cafile=cacert)
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx


def fetch_via_proxy(api: Any, namespace: str, service: str, node: str | None = None) -> Obj:
    """/inspect through the API server's service proxy (``services/http:<svc>:metrics/proxy/inspect``):
    the admin's own kubeconfig and RBAC (``get`` on ``services/proxy``), no key of ours on a laptop."""
    from kubernetes import client
    path = "inspect" + (f"/{urllib.parse.quote(node)}" if node else "")
    resp = client.CoreV1Api(api).connect_get_namespaced_service_proxy_with_path(
        f"http:{service}:metrics", namespace, path, _preload_content=False, _request_timeout=30)
    return kube.decode(resp)  # type: ignore[no-any-return]


def _via_proxy(args: argparse.Namespace) -> Obj:
    from kubernetes.client.exceptions import ApiException
    from vramshare import kube
    from vramshare.errors import UsageError
    ns, svc = args.namespace, args.service
    api = kube.user_client_or_say(getattr(args, "kubeconfig", None), "pass --kubeconfig FILE, or --extender URL "
                                  "(e.g. after kubectl -n vramshare-system port-forward svc/vramshare-extender 9402)")
    try:
        with api:
            return fetch_via_proxy(api, ns, svc, args.node)
    except ApiException as exc:
        if exc.status == 403:
            raise UsageError(f"the API server refused (403): your user needs 'get' on services/proxy "
                             f"(resourceNames {svc}) in {ns}; README, 'Inspect from a laptop'") from None
        detail = _detail(exc.body or b"")
        if _from_extender(exc.body or b""):  # the extender answered (an unknown node): its own words
            raise UsageError(f"extender: {exc.status} {detail}") from None
        raise UsageError(f"{exc.status} {detail or exc.reason} (service {ns}/{svc}): is vramshare installed and "
                         "the extender ready? run 'vramshare check'") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot reach the API server ({exc}); check the kubeconfig's context") from None


def _from_extender(body: bytes | str) -> bool:
    """The extender's error shape ({"error": ...}), not the API server's Status."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(doc, dict) and "error" in doc and doc.get("kind") != "Status"


def _detail(body: bytes | str) -> str:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode(errors="replace") if isinstance(body, bytes) else body
    return str(doc.get("message") or doc.get("error") or "") if isinstance(doc, dict) else ""


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """``vramshare inspect [NODE]``: through the API server's service proxy, or ``--extender URL``."""
    out = out or sys.stdout
    if not getattr(args, "extender", None):
        print(format_table(_via_proxy(args)), file=out)
        return 0
    from vramshare.errors import UsageError
    try:
        context = client_context(getattr(args, "cacert", None), getattr(args, "cert", None), getattr(args, "key", None))
    except (OSError, ssl.SSLError) as exc:
        raise UsageError(f"--cacert/--cert/--key: {exc}") from None
    try:
        doc = fetch(args.extender, args.node, context=context)
    except urllib.error.HTTPError as exc:
        with exc:
            body = exc.read()
        try:
            detail = orjson.loads(body).get("error", "")
        except orjson.JSONDecodeError:
            detail = body.decode(errors="replace")
        raise UsageError(f"extender: {exc.code} {detail}") from None  # the proxy path's words and exit status
    except (urllib.error.URLError, OSError) as exc:
        raise UsageError(f"cannot reach the extender at {args.extender} ({exc}); is it the metrics port (9402), "
                         "and does 'kubectl -n vramshare-system port-forward svc/vramshare-extender 9402' run?") from None
    print(format_table(doc), file=out)
    return 0
