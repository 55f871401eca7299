"""The signal loop both node daemons run (``vramshare device-plugin`` and ``vramshare dra-plugin``).

SIGTERM/SIGINT stop; SIGHUP re-reads the config (and whatever else ``on_hup`` restarts, as NVIDIA's
plugin restarts its servers); the config watcher follows ConfigMap ``..data`` swaps on its own thread.
The exit code says whether the daemon failed on its own (1) or was asked to stop (0).
"""
from __future__ import annotations

import signal
import sys
import threading
from typing import Callable, Protocol

from deviceplugin.config_watch import ConfigWatcher


class Daemon(Protocol):
    failed: str | None

    def start(self) -> None: ...
    def wait(self, timeout: float) -> bool: ...
    def close(self) -> None: ...


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
