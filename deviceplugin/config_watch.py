"""Live config reload: on SIGHUP, and when the mounted ConfigMap file changes.

A ConfigMap volume is a directory whose ``config.yaml`` is a symlink through ``..data``, itself a
symlink the kubelet swaps atomically to a fresh timestamped directory on every update (which is also
why a ``subPath`` mount never sees updates). So the watcher polls the *resolved* file's identity
(real path, device, inode, mtime, size): any swap or in-place edit changes it, and no inotify watch
can be left pointing at a deleted directory. A changed file is parsed with the same strict parser
as at start; ``on_change`` is called only with a valid config that differs from the one in force,
and a bad file is refused with a log line naming the bad key while the last good config stays.
"""
from __future__ import annotations

import os
import signal
import threading
from typing import Any, Callable, Mapping

from deviceplugin import enforcement
from deviceplugin.quota import rights
from vramshare import config as vconfig
from vramshare import logs

log = logs.get(__name__)

Fingerprint = tuple[str, int, int, int, int] | None  # None: the file is not there


def fingerprint(path: str) -> Fingerprint:
    """The identity of what ``path`` resolves to now; changes on a ``..data`` swap or an edit."""
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError:
        return None
    return (real, st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


class ConfigWatcher:
    """Owns the config in force; ``check()`` is one synchronous step, ``start()`` runs it on a thread.

    ``overrides`` are the CLI flags (``Config.with_overrides``), re-applied on every reload so a
    reload never drops them; ``environ`` gives the ``VRAMSHARE_*`` overrides (pass ``os.environ``).
    """

    def __init__(self, path: str, on_change: Callable[[vconfig.Config], None], *,
                 initial: vconfig.Config | None = None, environ: Mapping[str, str] | None = None,
                 overrides: Mapping[str, Any] | None = None, poll_seconds: float = 2.0,
                 on_refused: Callable[[str, str], None] | None = None) -> None:
        self.path = path
        self.on_change = on_change
        self.on_refused = on_refused  # (path, error): an Event and a metric (deviceplugin.config_refusal)
        self.environ = environ
        self.overrides = dict(overrides or {})
        self.poll_seconds = poll_seconds
        self._seen = fingerprint(path)
        self._current = initial if initial is not None else self._load()  # a bad file at start: raise
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._forced: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def current(self) -> vconfig.Config:
        with self._lock:
            return self._current

    def _load(self) -> vconfig.Config:
        return vconfig.load_config(self.path, self.environ).with_overrides(**self.overrides)

    # -- one step ------------------------------------------------------------------------------
    def check(self, force: str | None = None) -> bool:
        """Reload if the file changed (or ``force`` names a reason, e.g. "SIGHUP"); True if applied."""
        seen = fingerprint(self.path)
        if force is None and seen == self._seen:
            return False
        self._seen = seen
        reason = force or "file changed"
        if seen is None:
            log.warning("config file missing; keeping the last good config", path=self.path, reason=reason)
            return False
        try:
            new = self._load()
        except vconfig.ConfigError as exc:
            log.warning("config refused; keeping the last good config", path=self.path, reason=reason,
                        error=str(exc))
            if self.on_refused is not None:
                self.on_refused(self.path, str(exc))
            return False
        with self._lock:
            if new == self._current:
                log.info("config reloaded, nothing changed", path=self.path, reason=reason)
                return False
        try:  # the daemon may refuse a valid config it cannot honour (e.g. evict without the right)
            self.on_change(new)
        except vconfig.ConfigError as exc:
            log.warning("config refused; keeping the last good config", path=self.path, reason=reason,
                        error=str(exc))
            return False
        with self._lock:
            self._current = new
        log.info("config changed", path=self.path, reason=reason)
        return True

    # -- the thread ----------------------------------------------------------------------------
    def reload(self, reason: str = "SIGHUP") -> None:
        """Ask for a reload from anywhere, a signal handler included (it only sets an event)."""
        self._forced = reason
        self._wake.set()

    def install_sighup(self) -> Any:
        """Route SIGHUP to :meth:`reload`; main thread only. Returns the previous handler."""
        return signal.signal(signal.SIGHUP, lambda _sig, _frame: self.reload("SIGHUP"))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="config-watch", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.poll_seconds)
            self._wake.clear()
            if self._stop.is_set():
                return
            forced, self._forced = self._forced, None
            try:
                self.check(force=forced)
            except Exception:  # a failing on_change must not end live reload
                log.error("config change handler failed", exc_info=True, path=self.path)


def admit_reload(running: vconfig.Config, new: vconfig.Config, api: Any,
                 chosen: enforcement.Chosen) -> tuple[vconfig.Config, list[str]]:
    """What a node plugin applies of a reload, and the keys it left for a restart: a config that turns on
    ``overLimitAction: evict`` without the eviction right is refused whole (:class:`rights.RightRefused`,
    a ConfigError: the watcher keeps the last good config); the keys read only at start keep their
    running values, each logged (:func:`vramshare.config.keep_restart_only`); the node's fence stays the
    one pinned at start."""
    rights.check(new, api, running=running)
    new, refused = vconfig.keep_restart_only(running, new)
    for why in refused:
        log.warning("config key needs a restart; the rest of the reload applies", reason=why)
    return enforcement.pin(new, chosen), [why.split(":", 1)[0] for why in refused]
