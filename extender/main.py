"""``vramshare extender``: config, kube client, cache, HTTP server, signals. The composition root.

:func:`start` is also what tests, the demo and the end-to-end suite call to run a real extender on an
ephemeral loopback port against any API server (the double included) and get its URL back.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import ipaddress
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable

from kubernetes import client

from extender import accounting, apicalls, app, binder, cache, dra_scoring, http_server, leader, metrics, tls
from vramshare import kube, logs
from vramshare.config import Config, ConfigError, Policy, load_config

__all__ = ["RunningExtender", "start", "start_for_url", "run", "settle_heap"]

log = logs.get("vramshare.extender")

#: The collector's youngest-generation threshold once the books are in (Python's default is 700).
#: A scheduling cycle leaves only a few dozen tracked objects behind (the watch's pod objects, holds,
#: memo entries), yet at 700 a young collection (about 1 ms, up to 7 ms on a busy machine) landed in
#: one filter or prioritize in ~20: a third of the filter's p99 tail (bench_extender, real mix). At
#: 20,000 one comes every few hundred cycles, and cyclic garbage is still collected.
GC_YOUNG_THRESHOLD = 20_000


def settle_heap() -> None:
    """Once the cache has synced: move the books (millions of objects at 5,000 nodes) out of the
    collector's reach, so a full collection (hundreds of ms) never lands in a verb, and collect the
    young generation rarely (:data:`GC_YOUNG_THRESHOLD`). Process-wide; raises, never lowers."""
    gc.collect()
    gc.freeze()
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, GC_YOUNG_THRESHOLD), middle, old)


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
    metrics_server: http_server.ExtenderHTTPServer | None = None
    _metrics_thread: threading.Thread | None = None
    dra_watch: dra_scoring.DraWatch | None = None
    elector: leader.LeaseElector | None = None
    _elector_stop: threading.Event | None = None
    _elector_thread: threading.Thread | None = None

    def wait_ready(self, timeout: float = 10.0) -> bool:
        return self.cache.ready.wait(timeout)

    def stop(self) -> None:
        if self._elector_stop is not None and self._elector_thread is not None:
            self._elector_stop.set()  # a clean stop releases the Lease: the standby takes over at once
            self._elector_thread.join()
        self.server.close()
        self._thread.join()
        if self.metrics_server is not None and self._metrics_thread is not None:
            self.metrics_server.close()
            self._metrics_thread.join()
        self.cache.stop()
        if self.dra_watch is not None:
            self.dra_watch.stop()
        if self.owned_api is not None:
            self.owned_api.close()

    def __enter__(self) -> "RunningExtender":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# The plain-HTTP listener: Prometheus, the probes, and the read-only /inspect that `vramshare inspect`
# reaches through the API server's service proxy (the admin's RBAC: get services/proxy) or a port-forward,
# so no scheduler key leaves the cluster, and /config (the keys it runs with, for `vramshare check`). The
# verbs stay on the mutual-TLS port.
METRICS_ROUTES = frozenset({("GET", "/metrics"), ("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/inspect"),
                            ("GET", "/inspect/*"), ("GET", "/config")})


def tls_files(config: Config) -> tls.TlsFiles | None:
    e = config.extender
    if e.tls_cert_file and e.tls_key_file and e.client_ca_file:
        return tls.TlsFiles(e.tls_cert_file, e.tls_key_file, e.client_ca_file)
    return None


def _serve(server: http_server.ExtenderHTTPServer, name: str) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, name=name, daemon=True)
    thread.start()
    return thread


def start(api: client.ApiClient, config: Config, host: str = "127.0.0.1", port: int = 0, *,
          policy: Policy | None = None, clock: Callable[[], int] = time.time_ns,
          watch_timeout_s: int = 300, expiry_interval_s: float | None = None,
          metrics_at: tuple[str, int] | None = None, dra: bool = False,
          elect: tuple[str, str, str] | None = None, peer_tls: tls.Reloader | None = None,
          election: leader.Settings = leader.Settings(),
          election_clock: Callable[[], float] = time.monotonic) -> RunningExtender:
    """Start cache and HTTP server(s); returns at once (use ``wait_ready`` for the initial lists).

    With TLS files in ``config`` the verbs and /inspect need a client certificate signed by the client
    CA; ``metrics_at`` adds a plain-HTTP listener serving /metrics, the probes and /inspect only.
    ``dra`` also scores pods whose ResourceClaims use our DeviceClasses (resource.k8s.io/v1, 1.36+).
    ``elect`` = (namespace, identity, the URL this replica's verbs answer on): two or more replicas
    elect a leader over the Lease ``vramshare-extender``; a standby hands verbs to it (``peer_tls``:
    its client certificate for that call).
    Raises ``OSError``/``ssl.SSLError`` when the TLS files do not load.
    """
    chosen = policy or config.extender.policy
    acct = accounting.Accounting(config, clock)
    stats = metrics.ExtenderMetrics(acct)
    kube_api = apicalls.Kube(api)
    watcher = cache.Cache(acct, kube_api, stats, watch_timeout_s=watch_timeout_s,
                          expiry_interval_s=expiry_interval_s)
    extender = app.Extender(acct, binder.Binder(acct, kube_api, chosen, clock), watcher, stats, chosen)
    files = tls_files(config)
    reloader = tls.Reloader(files, lambda result: stats.tls_reloads.labels(result).inc()) if files else None
    if reloader is not None:
        stats.watch_client_certificates(reloader.presented)
    server = http_server.ExtenderHTTPServer(extender, host, port, tls=reloader)
    side = (http_server.ExtenderHTTPServer(extender, *metrics_at, routes=METRICS_ROUTES, workers=2,
                                           max_body_bytes=0, max_connections=64, reserve=0)
            if metrics_at is not None else None)
    dra_watch = None
    if dra:  # score pods whose ResourceClaims use our DeviceClasses (resource.k8s.io/v1, 1.36+)
        extender.dra = dra_scoring.DraCluster(config.names, config.memory_unit_mib)
        dra_watch = dra_scoring.DraWatch(api, extender.dra, timeout_s=watch_timeout_s)
        dra_watch.start()
    watcher.start()
    thread = _serve(server, "extender-http")
    side_thread = _serve(side, "extender-metrics") if side is not None else None
    if files is None and not _loopback(host):
        log.warning("serving the verbs without TLS or client authentication: anyone who can reach "
                    "the port can bind pods; set extender.tlsCertFile/tlsKeyFile/clientCAFile", url=server.url)
    log.info("extender started", url=server.url, policy=chosen.value, client_auth=files is not None,
             metrics_url=side.url if side else None, assume_timeout_s=config.extender.assume_timeout_seconds)
    running = RunningExtender(server.url, extender, acct, watcher, server, thread, None, side, side_thread, dra_watch)
    if elect is not None:
        namespace, identity, url = elect
        running.elector = leader.LeaseElector(api, namespace, "vramshare-extender", identity, url or server.url,
                                              election, clock=election_clock)
        extender.leader, extender.peer_tls = running.elector, peer_tls
        running._elector_stop = threading.Event()
        running._elector_thread = threading.Thread(target=running.elector.run, args=(running._elector_stop,),
                                                   name="extender-leader-election", daemon=True)
        running._elector_thread.start()
    return running


def start_for_url(api_url: str, config: Config | None = None, **kwargs: object) -> RunningExtender:
    """An extender on an ephemeral loopback port for a plain-HTTP API server (the double, the demo)."""
    api = kube.api_client_for(api_url)
    running = start(api, config or Config(), **kwargs)  # type: ignore[arg-type]
    running.owned_api = api
    return running


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _listen(value: str, flag: str = "--listen") -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"{flag} {value!r}: want HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
        config = config.with_overrides(extender=dataclasses.replace(
            config.extender, **{k: v for k, v in (("tls_cert_file", getattr(args, "tls_cert", None)),
                                                  ("tls_key_file", getattr(args, "tls_key", None)),
                                                  ("client_ca_file", getattr(args, "client_ca", None)),
                                                  ("metrics_listen", getattr(args, "metrics_listen", None)))
                                if v is not None}))
        files = tls_files(config)
        if files is None and any((config.extender.tls_cert_file, config.extender.tls_key_file,
                                  config.extender.client_ca_file)):
            raise ConfigError("TLS needs --tls-cert, --tls-key and --client-ca together")
        if files is not None:
            tls.server_context(files)  # fail here, naming the file, not on the first connection
        host, port = _listen(args.listen)
        metrics_at = _listen(config.extender.metrics_listen, "--metrics-listen") if config.extender.metrics_listen else None
    except (ConfigError, ValueError, OSError) as exc:
        log.error("refusing to start", error=str(exc))
        return 2
    api = kube.api_client(args.kubeconfig)
    if api is None:
        log.error("refusing to start", error="no kubeconfig and not in a cluster: the extender needs the API")
        return 2
    elect, peer = None, None
    if getattr(args, "leader_elect", False):
        import os
        import socket
        identity = os.environ.get("POD_NAME") or socket.gethostname()
        url = args.advertise_url or f"{'https' if files else 'http'}://{os.environ.get('POD_IP', host)}:{port}"
        elect = (os.environ.get("POD_NAMESPACE", "vramshare-system"), identity, url)
        if files is not None and args.peer_cert:  # re-read as they rotate, as the serving files are
            peer = tls.Reloader(tls.TlsFiles(args.peer_cert, args.peer_key, files.client_ca), build=tls.peer_context)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    with api:
        running = start(api, config, host, port, policy=Policy(args.policy) if args.policy else None,
                        metrics_at=metrics_at, dra=True, elect=elect, peer_tls=peer)
        if running.wait_ready(60):
            running.app.prepare()
            settle_heap()
        try:
            done.wait()
        finally:
            log.info("extender stopping")
            running.stop()
    return 0
