"""The signal loop both node daemons run (``vramshare device-plugin`` and ``vramshare dra-plugin``).

SIGTERM/SIGINT stop; SIGHUP re-reads the config (and whatever else ``on_hup`` restarts, as NVIDIA's
plugin restarts its servers); the config watcher follows ConfigMap ``..data`` swaps on its own thread.
The exit code says whether the daemon failed on its own (1) or was asked to stop (0).
"""
from __future__ import annotations

import signal
import sys
import threading
import time
from typing import Any, Callable, ClassVar, Protocol, Self

from deviceplugin.config_refusal import RefusalReporter
from deviceplugin.config_watch import ConfigWatcher, admit_reload
from deviceplugin.metrics import set_restart_pending
from vramshare import logs
from vramshare.config import Config
from vramshare.contract.config_in_force import ConfigInForce

log = logs.get(__name__)


class Daemon(Protocol):
    failed: str | None

    def start(self) -> None: ...
    def wait(self, timeout: float) -> bool: ...
    def close(self) -> None: ...


def wait_poked(stop: threading.Event, poked: threading.Event, seconds: float) -> None:
    """Wait up to ``seconds`` for ``poked`` (then clear it) or ``stop``, whichever comes first: a loop
    that works on a timer and at once when something changed (``stop`` is seen within 50 ms)."""
    deadline = time.monotonic() + seconds
    while not stop.is_set() and not poked.is_set() and time.monotonic() < deadline:
        poked.wait(min(0.05, max(0.0, deadline - time.monotonic())))
    poked.clear()


def spawn(name: str, body: Callable[[], None], stop: threading.Event, fail: Callable[[str], None], *,
          runs_until_stop: bool = False) -> threading.Thread:
    """Run ``body`` on a daemon thread named ``name``; a crash (or, with ``runs_until_stop``, an end
    before ``stop``) is logged and handed to ``fail`` with the reason, which stops the daemon."""
    def guarded() -> None:
        try:
            body()
        except BaseException as exc:  # noqa: BLE001 - logged, then the daemon stops
            log.error("thread crashed", thread=name, error=str(exc), exc_info=True)
            fail(f"thread {name} crashed: {exc}")
            return
        if runs_until_stop and not stop.is_set():
            log.error("thread ended unexpectedly", thread=name)
            fail(f"thread {name} ended unexpectedly")

    thread = threading.Thread(target=guarded, name=name, daemon=True)
    thread.start()
    return thread


class NodeDaemon:
    """What both node daemons do alike: their threads and the failure that stops them, and the live
    config reload (admitted by :func:`admit_reload`, a refusal counted and posted on the node, the text in
    force kept for the node's report). A subclass sets ``state``, ``enforcement``, ``metrics`` (with
    ``config_reloads`` and ``restart_pending``), ``_api`` and ``node``, calls :meth:`_init_daemon`, and
    says in :meth:`_wake` which of its loops a failure must wake."""

    #: the Event source of a refused reload, as the DaemonSet's container is named
    component: ClassVar[str]
    #: a thread that ends before the stop is a failure (the kubelet plugin: each runs until stopped)
    threads_run_until_stop: ClassVar[bool] = False

    state: Any
    enforcement: Any
    metrics: Any
    node: str
    _api: Any

    def _init_daemon(self) -> None:
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.failed: str | None = None
        self._watcher: ConfigWatcher | None = None  # the live reload, which knows the text in force
        self._restart_pending: tuple[str, ...] = ()

    def _wake(self) -> None:
        """Wake the loops that wait on a timer, so they see the stop at once."""

    def _config_accepted(self, _digest: str) -> None:
        """The config file text in force changed: the node's report says so."""

    def _spawn(self, name: str, body: Callable[[], None]) -> None:
        self._threads.append(spawn(name, body, self._stop, self._fail, runs_until_stop=self.threads_run_until_stop))

    def _fail(self, why: str) -> None:
        self.failed = why
        self._stop.set()
        self._wake()

    def reload(self, config: Config) -> None:
        """A new config from the config watcher, as :func:`admit_reload` admits it (the keys read at start
        keep their running values; evict without the right is refused whole); the subclass's state
        listeners follow it."""
        config, pending = admit_reload(self.state.snapshot.config, config, self._api, self.enforcement)
        self._restart_pending = tuple(pending)
        self.state.on_config(config)
        set_restart_pending(self.metrics.restart_pending, pending)

    @property
    def config_in_force(self) -> ConfigInForce | None:
        """The config text it runs and the keys waiting for a restart, as the node's report carries them."""
        return self._watcher.in_force(self._restart_pending) if self._watcher is not None else None

    def config_watcher(self, path: str, initial: Config, environ: Any = None, overrides: dict[str, Any] | None = None,
                       poll_seconds: float = 2.0) -> ConfigWatcher:
        """The live reload of ``path`` (``initial``: what was read from it at start) into :meth:`reload`; a
        refused one is counted and posted as an Event on the node."""
        watcher = ConfigWatcher(path, self.reload, initial=initial, environ=environ,
                                overrides=overrides, poll_seconds=poll_seconds,
                                on_refused=RefusalReporter(self.metrics.config_reloads, self._api, self.node,
                                                           self.component),
                                on_accepted=self._config_accepted)
        self._watcher = watcher
        return watcher

    def wait(self, timeout: float | None = None) -> bool:
        return self._stop.wait(timeout)

    def start(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(daemon: Daemon, watcher: ConfigWatcher | None, command: str,
          on_hup: Callable[[], None] | None = None) -> int:
    stop = threading.Event()

    def hup(*_: object) -> None:
        if watcher is not None:
            watcher.reload("SIGHUP")
        if on_hup is not None:
            on_hup()

    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, hup)
    daemon.start()
    if watcher is not None:
        watcher.start()  # thread "config-watch": file changes (ConfigMap ..data swaps) and SIGHUP
    try:
        while not stop.is_set() and not daemon.wait(0.5):
            pass
    finally:
        if watcher is not None:
            watcher.stop()
        daemon.close()
    if daemon.failed:
        print(f"vramshare {command}: {daemon.failed}", file=sys.stderr)
        return 1
    return 0
