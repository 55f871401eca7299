"""The entry point itself: registered in the package metadata, inert without a quota."""
from __future__ import annotations

import os
from importlib.metadata import entry_points

import pytest

from vllm_patches import plugin


def test_entry_point_is_declared() -> None:
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("vramshare_quota") == "vllm_patches.plugin:register"


def test_register_without_a_quota_does_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(plugin, "_installed", None)
    monkeypatch.delenv("VRAMSHARE_MEMORY_LIMIT_MIB", raising=False)
    monkeypatch.setenv("VRAMSHARE_QUOTA_FILE", str(tmp_path / "absent.json"))
    monkeypatch.delenv("VRAMSHARE_VLLM_STATE_DIR", raising=False)
    plugin.register()
    plugin.register()
    assert plugin.installed_hooks() == {}
    # inert means inert: no state directory exported to child processes either
    import os
    assert "VRAMSHARE_VLLM_STATE_DIR" not in os.environ


def test_plugin_log_lines_are_visible_with_their_fields(tmp_path) -> None:
    """Under vLLM nothing configures the root logger: our lines must still show, fields and all."""
    import subprocess
    import sys

    code = (
        "import logging\n"
        "from vllm_patches import plugin\n"
        "from vramshare import logs\n"
        "assert not logging.getLogger().handlers\n"
        "plugin.ensure_log_handler()\n"
        "logs.get('vllm_patches.watcher').info('kv block cap changed', limit_mib=512, new_cap=40)\n"
        "logs.get('vllm_patches.watcher').warning('quota file rejected', error='not JSON')\n"
        "logs.get('vllm_patches.watcher').debug('hidden at info')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    env.pop("VRAMSHARE_LOG_LEVEL", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "kv block cap changed limit_mib=512 new_cap=40" in proc.stderr
    assert "quota file rejected error=\"not JSON\"" in proc.stderr
    assert "hidden at info" not in proc.stderr
