"""Reaching the API server through the official ``kubernetes`` client: one way to build a client.

Used by the device plugin and the extender. Returns ``None`` when there is no kubeconfig and no
in-cluster service account, so the device plugin can run standalone and say so once.
"""
from __future__ import annotations

import os

from kubernetes import client, config as kconfig


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
    the in-cluster service account, else ``None``."""
    path = kubeconfig or os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
    if os.path.isfile(path):
        return kconfig.new_client_from_config(config_file=path)
    return api_client(None)


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
