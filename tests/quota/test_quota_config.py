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
