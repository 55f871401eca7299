"""Where the weights are (issue 23 item 3): the models a node can start fast, from its host cache dir.

Two layouts are read under the configured directory:

* the Hugging Face hub cache: ``models--<org>--<name>/snapshots/<revision>/...`` (files are symlinks into
  ``../../blobs``; sizes are the blobs', each blob counted once per snapshot; a dangling link, an
  interrupted download, is skipped);
* a plain tree: ``<name>/<revision>/...`` (one level each).

A revision directory counts as a model only when it holds a weight file (``*.safetensors``, ``*.bin``,
``*.pt``, ``*.gguf``) or a ``config.json``; anything else (junk, partial trees, names that are not model
names) is skipped and the reason logged once. Bounded: at most ``max_entries`` directory entries are
read in all (a huge listing stops there, ``truncated`` says so) and at most ``max_models`` models are
reported, largest first. Directories are never followed through symlinks (a loop or a link out of the
cache cannot be walked).

Engines (which GPU holds a sleeping or awake engine of which model) come from the quota loop's view of
its tenants and are merged in by :func:`with_engines`.

Both node plugins run it (:func:`node_reporter`, same config, same bounds): the device plugin publishes
the models in its inventory's ``models``, the DRA plugin in its ``resident-models`` annotation.
"""
from __future__ import annotations

import logging
import os
import stat
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

from deviceplugin.serve import wait_poked
from vramshare import contract
from vramshare.config import WarmTierConfig
from vramshare.inventory import MAX_MODELS, EngineState, NodeInventory, ResidentModel

log = logging.getLogger("vramshare.residency")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
HF_PREFIX = "models--"


@dataclass(frozen=True)
class Scan:
    models: tuple[ResidentModel, ...]
    truncated: bool = False
    skipped: tuple[str, ...] = field(default_factory=tuple)  # "path: why", at most 32


class _Budget:
    def __init__(self, entries: int) -> None:
        self.left = entries
        self.truncated = False

    def take(self) -> bool:
        if self.left <= 0:
            self.truncated = True
            return False
        self.left -= 1
        return True


def _entries(path: str, budget: _Budget) -> list[os.DirEntry]:
    out = []
    try:
        with os.scandir(path) as it:
            for e in it:
                if not budget.take():
                    break
                out.append(e)
    except OSError:
        return []
    return out


def _tree_bytes(path: str, budget: _Budget) -> tuple[int, bool]:
    """Bytes of the regular files under ``path`` (symlinked files followed, each target once; symlinked
    directories not entered) and whether a model file is among them."""
    total, model, seen = 0, False, set()
    stack = [path]
    while stack:
        for e in _entries(stack.pop(), budget):
            try:
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                    continue
                st = os.stat(e.path)  # follows a file symlink (HF snapshots point into blobs/)
            except OSError:
                continue  # dangling link: an interrupted download
            if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
            model = model or e.name.endswith(WEIGHT_SUFFIXES) or e.name == "config.json"
    return total, model


def scan_cache(root: str, max_entries: int = 200_000, max_models: int = MAX_MODELS) -> Scan:
    """The models under ``root`` (both layouts), largest first, within the bounds. A missing or
    unreadable ``root`` is an empty scan, not an error (a node without a cache has nothing fast)."""
    budget = _Budget(max_entries)
    found: list[ResidentModel] = []
    skipped: list[str] = []

    def skip(path: str, why: str) -> None:
        if len(skipped) < 32:
            skipped.append(f"{path}: {why}")

    def add(name: str, revision: str, path: str) -> None:
        try:
            ref = contract.parse_model_ref(f"{name}@{revision}")
        except contract.ModelRefError as exc:
            skip(path, str(exc))
            return
        size, is_model = _tree_bytes(path, budget)
        if not is_model:
            skip(path, "no weight file or config.json")
            return
        found.append(ResidentModel(ref.name, ref.revision, size))

    for top in _entries(root, budget):
        if not top.is_dir(follow_symlinks=False):
            continue
        if top.name.startswith(HF_PREFIX):
            name = top.name[len(HF_PREFIX):].replace("--", "/")
            for snap in _entries(os.path.join(top.path, "snapshots"), budget):
                if snap.is_dir(follow_symlinks=False):
                    add(name, snap.name, snap.path)
            continue
        if top.name.startswith(".") or top.name in ("hub", "datasets"):
            continue
        for rev in _entries(top.path, budget):
            if rev.is_dir(follow_symlinks=False):
                add(top.name, rev.name, rev.path)
    found.sort(key=lambda m: (-m.bytes, m.name, m.revision))
    if budget.truncated:
        log.warning("model cache %s: stopped after %d entries; the report is partial", root, max_entries)
    for s in skipped[:8]:
        log.info("model cache: skipped %s", s)
    return Scan(tuple(found[:max_models]), budget.truncated or len(found) > max_models, tuple(skipped))


def with_engines(models: Iterable[ResidentModel],
                 engines: Iterable[tuple[contract.ModelRef, str, EngineState]]) -> tuple[ResidentModel, ...]:
    """Merge ``(model, gpu uuid, state)`` of the node's engines into the scanned files (a model with an
    engine but no files in the cache is reported with 0 bytes). Engines first, then the largest files."""
    by_ref = {(m.name, m.revision): m for m in models}
    for ref, gpu, state in engines:
        key = (ref.name, ref.revision)
        m = by_ref.get(key) or ResidentModel(ref.name, ref.revision)
        by_ref[key] = replace(m, engines=m.engines + ((gpu, state),))
    out = sorted(by_ref.values(), key=lambda m: (not m.engines, -m.bytes, m.name, m.revision))
    return tuple(out[:MAX_MODELS])


def publishable(inventory: NodeInventory, scan: Scan,
                engines: Iterable[tuple[contract.ModelRef, str, EngineState]] = ()) -> NodeInventory:
    """The inventory with its ``models`` section (additive within v1)."""
    return replace(inventory, models=with_engines(scan.models, engines))


class ResidencyReporter:
    """The node agent's thread: re-scan the cache every ``scan_interval_s``, merge the engines every
    ``engines_interval_s`` or at once when :meth:`poke` says they changed (the warm broker's
    ``on_engines``), and call ``on_change`` with the models when they differ from the last."""

    def __init__(self, cache_dir: str | None, on_change: Callable[[tuple[ResidentModel, ...]], None],
                 engines: Callable[[], Iterable[tuple[contract.ModelRef, str, str]]] = lambda: (),
                 scan_interval_s: float = 60.0, engines_interval_s: float = 5.0, max_entries: int = 200_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cache_dir, self._on_change, self._engines = cache_dir, on_change, engines
        self.scan_interval_s, self.engines_interval_s = scan_interval_s, engines_interval_s
        self.max_entries, self._clock = max_entries, clock
        self.last_scan: Scan = Scan(())
        self._scanned_at: float | None = None
        self.models: tuple[ResidentModel, ...] = ()
        self._poked = threading.Event()

    def run_once(self) -> tuple[ResidentModel, ...]:
        now = self._clock()
        if self.cache_dir and (self._scanned_at is None or now - self._scanned_at >= self.scan_interval_s):
            self.last_scan, self._scanned_at = scan_cache(self.cache_dir, self.max_entries), now
        engines = []
        for ref, gpu, state in self._engines():
            try:
                engines.append((ref, gpu, EngineState(state)))
            except ValueError:
                continue
        models = with_engines(self.last_scan.models, engines)
        if models != self.models:
            self.models = models
            self._on_change(models)
        return models

    def poke(self) -> None:
        """The engines changed (one came, went, slept or woke): merge them now, not at the next round."""
        self._poked.set()

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.run_once()
            except Exception as exc:  # noqa: BLE001 - a bad scan keeps the last report
                log.warning("model residency report failed, keeping the last", error=str(exc))
            wait_poked(stop, self._poked, self.engines_interval_s)


def tenant_engines(warm: Any, loop: Any) -> list[tuple[contract.ModelRef, str, str]]:
    """``(model, gpu uuid, state)`` of the engines the warm broker ``warm`` knows on the GPUs of the quota
    loop ``loop``'s tenants (nothing while either is missing: no warm tier, no quota loop)."""
    if warm is None or loop is None:
        return []
    tenants = loop.tenants_now
    return list(warm.engines({t.key: [g for g, _ in t.gpus] for t in tenants},
                             {t.key: t.meta.model for t in tenants if t.meta is not None and t.meta.model}))


def node_reporter(wt: WarmTierConfig, on_change: Callable[[tuple[ResidentModel, ...]], None], warm: Any,
                  loop: Callable[[], Any]) -> ResidencyReporter:
    """The reporter a node plugin runs: ``warmTier.modelCacheDir`` scanned within its bounds, the engines
    of ``warm`` (the warm broker, or None) over the tenants of ``loop()`` merged in, at once when the
    broker says they changed (``on_engines``)."""
    reporter = ResidencyReporter(wt.model_cache_dir, on_change, lambda: tenant_engines(warm, loop()),
                                 wt.scan_interval_seconds, max_entries=wt.max_cache_entries)
    if warm is not None:  # an engine slept, woke, came or went: the report follows at once
        warm.on_engines = reporter.poke
    return reporter
