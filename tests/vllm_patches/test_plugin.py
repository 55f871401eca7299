"""The entry point itself: registered in the package metadata, inert without a quota."""
from __future__ import annotations

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
