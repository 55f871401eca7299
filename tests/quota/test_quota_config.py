"""The quota loop's additions to the v1 config (``quota.marginMiB``, ``quota.kvPressure``)."""
from __future__ import annotations

import pytest

from deviceplugin.quota.model import PolicyParams
from vramshare.config import ConfigError, parse_config


def test_defaults_and_explicit_values_reach_the_policy():
    assert PolicyParams.from_config(parse_config("").quota) == PolicyParams()
    cfg = parse_config("quota: {marginMiB: 2048, kvPressure: 0.8, stepMiB: 256, floorFraction: 0.3}")
    p = PolicyParams.from_config(cfg.quota)
    assert (p.margin_mib, p.kv_pressure, p.step_mib, p.floor_fraction) == (2048, 0.8, 256, 0.3)


@pytest.mark.parametrize("text, message", [
    ("quota: {marginMiB: -1}", "quota.marginMiB: must be >= 0"),
    ("quota: {kvPressure: 1.5}", "quota.kvPressure: must be <= 1"),
    ("quota: {kvPressure: high}", "quota.kvPressure: expected float"),
])
def test_bad_values_are_refused_with_the_key_named(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(text)


# -- live tuning (issue 9 item 5): every quota key reloads through the config watcher -------------
LIVE = [("floorFraction: 0.3", lambda s: s.params.floor_fraction, 0.3),
        ("ceilingFraction: 2.5", lambda s: s.params.ceiling_fraction, 2.5),
        ("stepMiB: 128", lambda s: s.params.step_mib, 128),
        ("marginMiB: 4096", lambda s: s.params.margin_mib, 4096),
        ("kvPressure: 0.75", lambda s: s.params.kv_pressure, 0.75),
        ("protectRequests: false", lambda s: s.params.protect_requests, False),
        ("shareSpare: false", lambda s: s.params.share_spare, False),
        ("peakWindowTicks: 12", lambda s: s.peak_window_ticks, 12),
        ("idleSeconds: 45", lambda s: s.idle_seconds, 45.0),
        ("intervalSeconds: 2.5", lambda s: s.interval_seconds, 2.5),
        ("enabled: false", lambda s: s.enabled, False)]
LIVE_ENF = [("overLimitAction: evict", lambda s: s.action.value, "evict"),
            ("overLimitGraceSeconds: 5", lambda s: s.grace_seconds, 5.0)]


def _watched_loop(tmp_path, text):
    from deviceplugin.config_watch import ConfigWatcher
    from deviceplugin.quota.loop import LoopSettings, QuotaLoop
    path = tmp_path / "config.yaml"
    path.write_text(text)
    cfg = parse_config(text)
    loop = QuotaLoop(None, dict, [], PolicyParams(), str(tmp_path), settings=LoopSettings.from_config(cfg.quota))
    watcher = ConfigWatcher(str(path), lambda c: loop.reconfigure(c.quota, c.enforcement), initial=cfg)
    return path, loop, watcher


@pytest.mark.parametrize("section, line, read, want", [("quota", *x) for x in LIVE] + [("enforcement", *x) for x in LIVE_ENF])
def test_every_key_reloads_live(tmp_path, section, line, read, want):
    path, loop, watcher = _watched_loop(tmp_path, "version: v1\n")
    assert read(loop.settings) != want
    path.write_text(f"version: v1\n{section}:\n  {line}\n")
    assert watcher.check(force="test")
    assert read(loop.settings) == want


@pytest.mark.parametrize("line, key", [("marginMiB: -5", "quota.marginMiB"), ("idleSeconds: soon", "quota.idleSeconds"),
                                       ("peakWindowTicks: 0", "quota.peakWindowTicks"),
                                       ("floorFraction: 2", "floorFraction")])
def test_an_invalid_value_is_refused_naming_the_key_and_the_last_good_config_stays(tmp_path, caplog, line, key):
    path, loop, watcher = _watched_loop(tmp_path, "version: v1\nquota:\n  marginMiB: 2048\n")
    before = loop.settings
    path.write_text(f"version: v1\nquota:\n  marginMiB: 3072\n  {line}\n")
    with caplog.at_level("WARNING"):
        assert not watcher.check(force="test")
    assert loop.settings == before and loop.settings.params.margin_mib == 2048
    refused = [r for r in caplog.records if "keeping the last good config" in r.getMessage()]
    assert refused and key in str(refused[0].__dict__)


class _OneTurn:
    """A stop event that ends ``run`` after one turn and remembers how long it was asked to wait."""

    def __init__(self):
        self.waited, self.done = [], False

    def is_set(self):
        return self.done

    def wait(self, seconds):
        self.waited.append(seconds)
        self.done = True


def test_run_follows_the_reloaded_interval_and_pauses_when_disabled(tmp_path):
    from deviceplugin.quota.loop import QuotaLoop
    path, loop, watcher = _watched_loop(tmp_path, "version: v1\n")
    loop._tenants = type("T", (), {"list_tenants": lambda self: []})()
    stop = _OneTurn()
    loop.run(stop, 10.0)
    assert loop.counts["ticks"] == 1 and stop.waited == [10.0]
    path.write_text("version: v1\nquota: {enabled: false, intervalSeconds: 3}\n")
    watcher.check(force="test")
    stop = _OneTurn()
    loop.run(stop, 10.0)
    assert loop.counts["ticks"] == 1 and stop.waited == [3.0]
    assert isinstance(loop, QuotaLoop)
