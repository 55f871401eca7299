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
from typing import Callable, Protocol

from deviceplugin.config_watch import ConfigWatcher
from vramshare import logs

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
