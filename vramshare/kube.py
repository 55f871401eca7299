"""Reaching the API server through the official ``kubernetes`` client: one way to build a client, and
one way to read a raw response (:func:`decode`, :func:`decode_lines`, :func:`body`).

Used by the device plugin and the extender. Returns ``None`` when there is no kubeconfig and no
in-cluster service account, so the device plugin can run standalone and say so once.
"""
from __future__ import annotations

import os
from typing import Any, Iterator

import orjson
from kubernetes import client, config as kconfig
from kubernetes.watch.watch import iter_resp_lines


def api_client(kubeconfig: str | None) -> client.ApiClient | None:
    """A client from ``kubeconfig``, else the in-cluster service account, else ``None``."""
    if kubeconfig:
        return kconfig.new_client_from_config(config_file=kubeconfig)
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        cfg = client.Configuration()
        kconfig.load_incluster_config(client_configuration=cfg)
        return client.ApiClient(cfg)
    return None


def user_client(kubeconfig: str | None) -> client.ApiClient | None:
    """An admin's client, as kubectl finds it: ``kubeconfig``, ``$KUBECONFIG``, ``~/.kube/config``, else
    the in-cluster service account, else ``None``. It tries each request once, as kubectl does: the
    client's default (urllib3's three retries) kept a command silent for 4 x its timeout on an API server
    that accepts and never answers."""
    path = kubeconfig or os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
    cfg = client.Configuration()
    if os.path.isfile(path):
        kconfig.load_kube_config(config_file=path, client_configuration=cfg)
    elif os.environ.get("KUBERNETES_SERVICE_HOST"):
        kconfig.load_incluster_config(client_configuration=cfg)
    else:
        return None
    cfg.retries = 0
    return client.ApiClient(cfg)


def user_client_or_say(kubeconfig: str | None, fix: str) -> client.ApiClient:
    """:func:`user_client` for a CLI command: a kubeconfig that does not load, or none at all, is a
    :class:`vramshare.errors.UsageError` whose one line ends with ``fix`` (what to pass instead)."""
    from vramshare.errors import UsageError
    try:
        api = user_client(kubeconfig)
    except Exception as exc:  # noqa: BLE001 - the kubernetes loader raises many kinds; all mean "no config"
        raise UsageError(f"cannot load a kubeconfig ({exc}): {fix}") from None
    if api is None:
        raise UsageError(f"no kubeconfig ($KUBECONFIG, ~/.kube/config): {fix}")
    return api


def api_client_for(host: str) -> client.ApiClient:
    """A client for a plain-HTTP API endpoint (the local API server stand-in used by tests and the demo)."""
    cfg = client.Configuration()
    cfg.host = host
    return client.ApiClient(cfg)


# -- raw responses: the one decoder ----------------------------------------------------------------------
# Our daemons ask the client for raw responses (``_preload_content=False``): the placement core, the
# reconciler and the DRA plugin read Kubernetes JSON as dicts, and the client's model classes cost far
# more than the work and change names between client versions (37.x: ``ResourceV1ResourceClaim``).

def body(resp: Any) -> bytes:
    """The raw body of a ``_preload_content=False`` response, read to the end, and the connection back
    in the pool (one never released is lost to the pool: the client opens a new one each time)."""
    try:
        return bytes(resp.data)
    finally:
        resp.release_conn()


def decode(resp: Any) -> Any:
    """The JSON body of a ``_preload_content=False`` response (:func:`body`, parsed)."""
    return orjson.loads(body(resp))


def decode_lines(resp: Any) -> Iterator[Any]:
    """The JSON documents of a watch stream, one per line, as they arrive (the client's own line
    splitter, ``kubernetes.watch.watch.iter_resp_lines``); the response is closed at the end."""
    try:
        for line in iter_resp_lines(resp):
            if line:
                yield orjson.loads(line)
    finally:
        resp.close()
        resp.release_conn()
