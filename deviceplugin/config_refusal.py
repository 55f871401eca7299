"""A refused config reload is seen where admins look, not only in a log line: a Warning Event on the
node (``kubectl describe node``, ``kubectl get events``) and ``vramshare_deviceplugin_config_reloads_total``
(``vramshare_dra_config_reloads_total`` from the DRA plugin) ``{result="refused"}`` to alert on. The last
good config stays in force either way (config_watch). Both node plugins post it; ``vramshare check``
reads the Events back."""
from __future__ import annotations

import datetime
from typing import Any

from prometheus_client import Counter

from vramshare import contract, logs

log = logs.get(__name__)
REASON = contract.EVENT_CONFIG_REFUSED
TIMEOUT_S = 5.0


class RefusalReporter:
    """``ConfigWatcher(on_refused=...)``: count the refusal on ``counter`` (a node plugin's
    :func:`deviceplugin.metrics.config_reloads_counter`) and post the Event as ``component`` (best effort)."""

    def __init__(self, counter: Counter, api: Any, node: str, component: str) -> None:
        self._counter, self._node, self._component = counter, node, component
        self._v1 = None
        if api is not None and node:
            from kubernetes import client
            self._v1 = client.CoreV1Api(api)

    def __call__(self, path: str, error: str) -> None:
        self._counter.labels("refused").inc()
        if self._v1 is None:
            return
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {"apiVersion": "v1", "kind": "Event", "type": "Warning", "reason": REASON,
                "message": f"config {path} refused, the last good config stays in force: {error}"[:1024],
                # node events live in "default", as the kubelet's do
                "metadata": {"generateName": f"{self._node}.", "namespace": "default"},
                "involvedObject": {"kind": "Node", "name": self._node, "uid": self._node, "apiVersion": "v1"},
                "source": {"component": self._component, "host": self._node},
                "firstTimestamp": now, "lastTimestamp": now, "count": 1}
        try:
            self._v1.create_namespaced_event("default", body, _preload_content=False, _request_timeout=TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the refusal is logged and counted; the Event is best effort
            log.warning("config refusal event not posted", node=self._node, error=f"{type(exc).__name__}: {exc}")
