"""The API server's service proxy: ``/api/v1/namespaces/<ns>/services/[scheme:]<name>[:port]/proxy/<path>``.

What ``kubectl get --raw .../proxy/...`` and the client's ``connect_get_namespaced_service_proxy_with_path``
reach. Resolution follows kube-apiserver's ``REST.ResourceLocation`` (pkg/registry/core/service/storage/
storage.go): ``SplitSchemeNamePort`` (k8s.io/apimachinery/pkg/util/net), a port number is mapped to the
Service port's name, then the Endpoints of the Service give an address with a port of that name; every
failure is a 503 ServiceUnavailable with the upstream message. HTTPS backends are not verified, as the
real proxy transport does not verify them. The double does no authorization (the real one asks RBAC
for ``get`` on ``services/proxy``).
"""
from __future__ import annotations

import http.client
import re
import ssl
import urllib.parse
from typing import Any

from . import errors
from .errors import ApiError
from .resources import ENDPOINTS, SERVICES
from .store import Store

PATH = re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/services/(?P<ref>[^/]+)/proxy(?P<rest>/.*)?$")


def split_scheme_name_port(ref: str) -> tuple[str, str, str] | None:
    """``[scheme:]name[:port]`` -> (scheme, name, port); None when invalid (SplitSchemeNamePort)."""
    parts = ref.split(":")
    if len(parts) == 1:
        scheme, name, port = "", parts[0], ""
    elif len(parts) == 2:
        scheme, name, port = "", parts[0], parts[1]
    elif len(parts) == 3:
        scheme, name, port = parts
    else:
        return None
    if not name or scheme not in ("", "http", "https"):
        return None
    return scheme, name, port


def resolve(store: Store, namespace: str, ref: str) -> tuple[str, str, int]:
    """(scheme, host, port) of one endpoint of the Service ``ref`` names."""
    parsed = split_scheme_name_port(ref)
    if parsed is None:
        raise errors.bad_request(f"invalid service request {ref!r}")
    scheme, name, port = parsed
    service = store.find(SERVICES, namespace, name)
    if service is None:
        raise errors.not_found("services", name)
    if port.isdigit():
        named = [p.get("name", "") for p in (service.get("spec") or {}).get("ports") or [] if p.get("port") == int(port)]
        if not named:
            raise ApiError(503, "ServiceUnavailable", f"no service port {port} found for service {name!r}")
        port = named[0]
    eps = store.find(ENDPOINTS, namespace, name)
    subsets = (eps or {}).get("subsets") or []
    if not subsets:
        raise ApiError(503, "ServiceUnavailable", f"no endpoints available for service {name!r}")
    for subset in subsets:
        for p in subset.get("ports") or []:
            if p.get("name", "") == port and subset.get("addresses"):
                return scheme or "http", subset["addresses"][0]["ip"], int(p["port"])
    raise ApiError(503, "ServiceUnavailable", f"no endpoints available for service {ref!r}")


def forward(store: Store, verb: str, path: str, query: str, body: bytes,
            headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    # the client escapes the path parameters (http%3Aname%3Aport, inspect%2Fnode); Go's server hands the
    # handler the decoded path, and the proxy sends the rest on, escaped again where it must be
    m = PATH.match(urllib.parse.unquote(path))
    if m is None:
        raise errors.bad_request(f"invalid service proxy path {path!r}")
    scheme, host, port = resolve(store, m["ns"], m["ref"])
    target = urllib.parse.quote(m["rest"] or "/", safe="/:@!$&'()*+,;=-._~") + (f"?{query}" if query else "")
    conn: Any
    if scheme == "https":
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE  # as the real proxy transport (InsecureSkipVerify)
        conn = http.client.HTTPSConnection(host, port, timeout=30, context=ctx)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request(verb, target, body=body or None, headers={k: v for k, v in headers.items()
                                                               if k.lower() in ("accept", "content-type")})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, {"Content-Type": resp.getheader("Content-Type") or "text/plain"}, data
    except OSError as exc:
        raise ApiError(503, "ServiceUnavailable", f"error trying to reach service: dial tcp {host}:{port}: {exc}") from None
    finally:
        conn.close()
