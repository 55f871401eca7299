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
from typing import Any, Callable, Mapping, Sequence

from deviceplugin import enforcement
from deviceplugin.quota import rights
from vramshare import config as vconfig
from vramshare import logs
from vramshare.contract.config_in_force import ConfigInForce

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
                 on_refused: Callable[[str, str], None] | None = None,
                 on_accepted: Callable[[str], None] | None = None) -> None:
        self.path = path
        self.on_change = on_change
        self.on_refused = on_refused  # (path, error): an Event and a metric (deviceplugin.config_refusal)
        self.on_accepted = on_accepted  # (digest): the file text in force changed (published for check)
        self.environ = environ
        self.overrides = dict(overrides or {})
        self.poll_seconds = poll_seconds
        self._seen = fingerprint(path)
        if initial is not None:  # read by the main at start: only its text's digest is read here
            self._current = initial
            try:
                self.digest: str | None = vconfig.text_digest(self._text())
            except vconfig.ConfigError:
                self.digest = None
        else:
            self._current, self.digest = self._load()  # a bad file at start: raise
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._forced: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def current(self) -> vconfig.Config:
        with self._lock:
            return self._current

    def _text(self) -> str:
        try:
            with open(self.path, encoding="utf-8") as fh:
                return fh.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise vconfig.ConfigError(f"cannot read config {self.path}: {exc}") from exc

    def _load(self) -> tuple[vconfig.Config, str]:
        """The config from the file, and its text's digest (one read: the digest is of what was parsed)."""
        text = self._text()
        return vconfig.parse_config(text, self.environ).with_overrides(**self.overrides), vconfig.text_digest(text)

    def in_force(self, restart_pending: Sequence[str] = ()) -> ConfigInForce | None:
        """What the node plugin says it runs (its inventory's or slices' ``config``): the text in force and
        the keys of it its reload left for a restart; None while no text could be read."""
        return ConfigInForce(self.digest, tuple(restart_pending)) if self.digest is not None else None

    def _accepted(self, digest: str) -> None:
        """The file text in force is now ``digest`` (a change applied, or one that changed nothing)."""
        if digest != self.digest:
            self.digest = digest
            if self.on_accepted is not None:
                self.on_accepted(digest)

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
            new, digest = self._load()
        except vconfig.ConfigError as exc:
            log.warning("config refused; keeping the last good config", path=self.path, reason=reason,
                        error=str(exc))
            if self.on_refused is not None:
                self.on_refused(self.path, str(exc))
            return False
        with self._lock:
            same = new == self._current
        if same:
            log.info("config reloaded, nothing changed", path=self.path, reason=reason)
            self._accepted(digest)  # e.g. a comment edited: this text is the one in force now
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
        self._accepted(digest)
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
    for change in refused:
        log.warning("config key needs a restart; the rest of the reload applies", key=change.key,
                    reason=vconfig.refusal(change))
    return enforcement.pin(new, chosen), [change.key for change in refused]
