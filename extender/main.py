"""``vramshare extender``: config, kube client, cache, HTTP server, signals. The composition root.

:func:`start` is also what tests, the demo and the end-to-end suite call to run a real extender on an
ephemeral loopback port against any API server (the double included) and get its URL back.
"""
from __future__ import annotations

import argparse
import gc
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable

from kubernetes import client

from extender import accounting, apicalls, app, binder, cache, dra_scoring, http_server, metrics
from vramshare import kube, logs
from vramshare.config import Config, ConfigError, Policy, load_config

__all__ = ["RunningExtender", "start", "start_for_url", "run"]

log = logs.get("vramshare.extender")


@dataclass
class RunningExtender:
    """A started extender; :meth:`stop` ends the server, the watches and the sweeper."""

    url: str
    app: app.Extender
    acct: accounting.Accounting
    cache: cache.Cache
    server: http_server.ExtenderHTTPServer
    _thread: threading.Thread
    owned_api: client.ApiClient | None = None
    dra_watch: dra_scoring.DraWatch | None = None

    def wait_ready(self, timeout: float = 10.0) -> bool:
        return self.cache.ready.wait(timeout)

    def stop(self) -> None:
        self.server.close()
        self._thread.join()
        self.cache.stop()
        if self.dra_watch is not None:
            self.dra_watch.stop()
        if self.owned_api is not None:
            self.owned_api.close()

    def __enter__(self) -> "RunningExtender":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start(api: client.ApiClient, config: Config, host: str = "127.0.0.1", port: int = 0, *,
          policy: Policy | None = None, clock: Callable[[], int] = time.time_ns,
          watch_timeout_s: int = 300, expiry_interval_s: float | None = None, dra: bool = False) -> RunningExtender:
    """Start cache and HTTP server; returns at once (use ``wait_ready`` for the initial lists)."""
    chosen = policy or config.extender.policy
    acct = accounting.Accounting(config, clock)
    stats = metrics.ExtenderMetrics(acct)
    kube_api = apicalls.Kube(api)
    watcher = cache.Cache(acct, kube_api, stats, watch_timeout_s=watch_timeout_s,
                          expiry_interval_s=expiry_interval_s)
    extender = app.Extender(acct, binder.Binder(acct, kube_api, chosen, clock), watcher, stats, chosen)
    server = http_server.ExtenderHTTPServer(extender, host, port)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                              name="extender-http", daemon=True)
    dra_watch = None
    if dra:  # score pods whose ResourceClaims use our DeviceClasses (resource.k8s.io/v1, 1.36+)
        extender.dra = dra_scoring.DraCluster(config.names, config.memory_unit_mib)
        dra_watch = dra_scoring.DraWatch(api, extender.dra, timeout_s=watch_timeout_s)
        dra_watch.start()
    watcher.start()
    thread.start()
    log.info("extender started", url=server.url, policy=chosen.value,
             assume_timeout_s=config.extender.assume_timeout_seconds)
    return RunningExtender(server.url, extender, acct, watcher, server, thread, dra_watch=dra_watch)


def start_for_url(api_url: str, config: Config | None = None, **kwargs: object) -> RunningExtender:
    """An extender on an ephemeral loopback port for a plain-HTTP API server (the double, the demo)."""
    api = kube.api_client_for(api_url)
    running = start(api, config or Config(), **kwargs)  # type: ignore[arg-type]
    running.owned_api = api
    return running


def _listen(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"--listen {value!r}: want HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
        host, port = _listen(args.listen)
    except (ConfigError, ValueError) as exc:
        log.error("refusing to start", error=str(exc))
        return 2
    api = kube.api_client(args.kubeconfig)
    if api is None:
        log.error("refusing to start", error="no kubeconfig and not in a cluster: the extender needs the API")
        return 2
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    with api:
        running = start(api, config, host, port, policy=Policy(args.policy) if args.policy else None, dra=True)
        if running.wait_ready(60):
            # The cache of thousands of nodes and pods lives for the process: move it out of the
            # collector's reach, so a full collection (hundreds of ms at 5,000 nodes) never lands in a
            # filter call.
            gc.collect()
            gc.freeze()
        try:
            done.wait()
        finally:
            log.info("extender stopping")
            running.stop()
    return 0
