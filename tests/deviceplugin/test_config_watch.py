"""Config live reload: ConfigMap-style ``..data`` swaps, in-place edits, SIGHUP, bad files refused."""
from __future__ import annotations

import logging
import os
import signal
import threading

import pytest

from deviceplugin.config_watch import ConfigWatcher, fingerprint
from vramshare.config import Config, ConfigError


class ConfigMapDir:
    """A directory laid out as the kubelet lays out a ConfigMap volume, updated the same way."""

    def __init__(self, root) -> None:
        self.root = root
        self.generation = 0
        self.path = str(root / "config.yaml")

    def publish(self, text: str) -> None:
        self.generation += 1
        stamped = self.root / f"..2026_11_29_{self.generation}"
        stamped.mkdir()
        (stamped / "config.yaml").write_text(text)
        tmp = self.root / "..data_tmp"
        os.symlink(stamped.name, tmp)
        os.replace(tmp, self.root / "..data")  # the atomic swap
        if not os.path.islink(self.path):
            os.symlink("..data/config.yaml", self.path)


@pytest.fixture
def cm(tmp_path) -> ConfigMapDir:
    d = ConfigMapDir(tmp_path)
    d.publish("version: v1\nmemoryUnitMiB: 1024\n")
    return d


def watcher(cm: ConfigMapDir, **kw) -> tuple[ConfigWatcher, list[Config]]:
    changes: list[Config] = []
    return ConfigWatcher(cm.path, changes.append, **kw), changes


def test_starts_with_the_file_and_ignores_an_unchanged_one(cm):
    w, changes = watcher(cm)
    assert w.current.memory_unit_mib == 1024
    assert w.check() is False and changes == []


def test_configmap_swap_is_picked_up(cm):
    w, changes = watcher(cm)
    cm.publish("version: v1\nmemoryUnitMiB: 2048\n")
    assert w.check() is True
    assert [c.memory_unit_mib for c in changes] == [2048] and w.current.memory_unit_mib == 2048
    assert w.check() is False


def test_in_place_edit_is_picked_up(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("memoryUnitMiB: 1024\n")
    changes: list[Config] = []
    w = ConfigWatcher(str(path), changes.append)
    path.write_text("memoryUnitMiB: 4096\n")  # a different size: the fingerprint changes even in one tick
    assert w.check() is True and changes[0].memory_unit_mib == 4096


def test_a_new_but_equal_config_is_not_a_change(cm):
    w, changes = watcher(cm)
    cm.publish("# same, reformatted\nmemoryUnitMiB: 1024\nversion: v1\n")
    assert w.check() is False and changes == []


def test_a_bad_file_is_refused_naming_the_key_and_the_last_good_stays(cm, caplog):
    w, changes = watcher(cm)
    cm.publish("version: v1\nmemoryUnitMiB: lots\n")
    with caplog.at_level(logging.WARNING, logger="deviceplugin.config_watch"):
        assert w.check() is False
    assert changes == [] and w.current.memory_unit_mib == 1024
    [record] = caplog.records
    assert record.getMessage() == "config refused; keeping the last good config"
    assert record.fields["error"].startswith("memoryUnitMiB: expected int")
    cm.publish("version: v1\nmemoryUnitMiB: 512\n")  # fixed: applied
    assert w.check() is True and changes[-1].memory_unit_mib == 512


def test_a_missing_file_keeps_the_last_good_config(cm):
    w, changes = watcher(cm)
    os.unlink(cm.path)
    assert fingerprint(cm.path) is None
    assert w.check() is False and w.current.memory_unit_mib == 1024
    os.symlink("..data/config.yaml", cm.path)
    cm.publish("memoryUnitMiB: 256\n")
    assert w.check() is True and changes[-1].memory_unit_mib == 256


def test_a_bad_file_at_start_raises(cm):
    cm.publish("memoryUnitMiB: -5\n")
    with pytest.raises(ConfigError, match="memoryUnitMiB: must be >= 50"):
        watcher(cm)


def test_forced_reload_rereads_an_unchanged_file_and_keeps_overrides_and_env(cm):
    env = {"VRAMSHARE_HEALTH_DISABLED": "true"}
    w, changes = watcher(cm, environ=env, overrides={"quota_host_dir": "/cli/quota"})
    assert (w.current.health.disabled, w.current.quota_host_dir) == (True, "/cli/quota")
    env["VRAMSHARE_MEMORY_UNIT_MIB"] = "8192"  # the file did not change; SIGHUP rereads anyway
    assert w.check() is False
    assert w.check(force="SIGHUP") is True
    assert (changes[-1].memory_unit_mib, changes[-1].health.disabled, changes[-1].quota_host_dir) == (
        8192, True, "/cli/quota")


def test_sighup_wakes_the_thread(cm):
    got = threading.Event()
    changes: list[Config] = []

    def on_change(config: Config) -> None:
        changes.append(config)
        got.set()
    w = ConfigWatcher(cm.path, on_change, poll_seconds=3600, environ={"VRAMSHARE_MEMORY_UNIT_MIB": "64"},
                      initial=Config())
    previous = w.install_sighup()
    w.start()
    try:
        os.kill(os.getpid(), signal.SIGHUP)
        assert got.wait(10)
    finally:
        w.stop()
        signal.signal(signal.SIGHUP, previous)
    assert [c.memory_unit_mib for c in changes] == [64]


def test_a_failing_handler_does_not_end_the_thread(cm):
    calls: list[int] = []
    first, second = threading.Event(), threading.Event()

    def on_change(config: Config) -> None:
        calls.append(config.memory_unit_mib)
        if len(calls) == 1:
            first.set()
            raise RuntimeError("consumer bug")
        second.set()
    w = ConfigWatcher(cm.path, on_change, poll_seconds=3600)
    w.start()
    try:
        cm.publish("memoryUnitMiB: 256\n")
        w.reload("test")
        assert first.wait(10)
        cm.publish("memoryUnitMiB: 512\n")
        w.reload("test")
        assert second.wait(10)
    finally:
        w.stop()
    assert calls == [256, 512]


def test_a_refused_reload_is_an_event_on_the_node_and_a_metric(cm):
    """Issue 22: not only a log line. The Event goes through the official client to the API double."""
    from prometheus_client import generate_latest

    from deviceplugin.config_refusal import REASON, RefusalReporter
    from deviceplugin.metrics import PluginMetrics
    from standins.apiserver import ApiServerDouble
    from vramshare.kube import api_client_for

    metrics = PluginMetrics()
    with ApiServerDouble() as api, api_client_for(api.url) as http:
        w, changes = watcher(cm, on_refused=RefusalReporter(metrics.config_reloads, http, "gpu-node-1",
                                                                   "vramshare-device-plugin"))
        cm.publish("version: v1\nmemoryUnitMiB: lots\n")
        assert w.check() is False and changes == []
        [event] = api.events("default")
    assert event["type"] == "Warning" and event["reason"] == REASON
    assert event["involvedObject"]["kind"] == "Node" and event["involvedObject"]["name"] == "gpu-node-1"
    assert "memoryUnitMiB: expected int" in event["message"] and "last good config stays" in event["message"]
    text = generate_latest(metrics.registry).decode()
    assert 'vramshare_deviceplugin_config_reloads_total{result="refused"} 1.0' in text


def test_a_refusal_without_an_api_server_is_still_counted(cm):
    from deviceplugin.config_refusal import RefusalReporter
    from deviceplugin.metrics import PluginMetrics
    metrics = PluginMetrics()
    w, _ = watcher(cm, on_refused=RefusalReporter(metrics.config_reloads, None, "", "vramshare-device-plugin"))
    cm.publish("version: v1\nmemoryUnitMiB: -1\n")
    assert w.check() is False
    assert metrics.config_reloads.labels("refused")._value.get() == 1


def test_the_digest_is_of_the_text_in_force(cm):
    """What a node publishes as the config it runs (``vramshare check`` compares it with the ConfigMap):
    the digest of the text it last accepted. A change applied or one that changes nothing (a comment)
    moves it; a file refused by the parser or by the daemon leaves it on the last good text."""
    from vramshare.config import text_digest
    seen: list[str] = []

    def refuse_2048(config: Config) -> None:
        if config.memory_unit_mib == 2048:
            raise ConfigError("refused by the daemon")

    w = ConfigWatcher(cm.path, refuse_2048, on_accepted=seen.append)
    first = "version: v1\nmemoryUnitMiB: 1024\n"
    assert w.digest == text_digest(first) and seen == []
    comment = first + "# tuned on Monday\n"
    cm.publish(comment)
    assert w.check() is False and w.digest == text_digest(comment) and seen == [text_digest(comment)]
    cm.publish("version: v1\nmemoryUnitMiB: lots\n")  # the parser refuses it
    assert w.check() is False and w.digest == text_digest(comment)
    cm.publish("version: v1\nmemoryUnitMiB: 2048\n")  # the daemon refuses it
    assert w.check() is False and w.digest == text_digest(comment)
    applied = "version: v1\nmemoryUnitMiB: 512\n"
    cm.publish(applied)
    assert w.check() is True and w.digest == text_digest(applied) and seen[-1] == text_digest(applied)
    assert len(seen) == 2
    started = ConfigWatcher(cm.path, lambda c: None, initial=w.current)  # the main read it at start
    assert started.digest == text_digest(applied)
