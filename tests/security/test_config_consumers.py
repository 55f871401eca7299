"""Every config the parser accepts is one its consumers can run (issue 18 item 3, the hostile typed fuzz).

On main, 105 of 821 typed-fuzz documents that validation accepted broke a consumer (NaN and infinity
compared with ``<``, no upper bounds): the quota loop froze, the extender's start raised, an assumed
pod never expired, the kubelet refused a 10 MiB ListAndWatch message. Here each accepted document is
handed to every consumer of the config: the device plugin daemon (devices, the ListAndWatch message,
a live reload), the quota loop (a tick, a reconfigure, another tick), the extender's accounting, holds,
expiry and verbs, and the config watcher's reload path. A document is *refused* when the parser or
the node check (:func:`vramshare.config.node_limits`, the device plugin's start) names a key; it
*breaks* a consumer when anything else raises. The property: no accepted document breaks anything.

``python -m tests.security.test_config_consumers [N]`` prints the counts for N seeded documents.
"""
from __future__ import annotations

import math
import os
import random
import sys
import tempfile
from typing import Any, Callable

import orjson
import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from deviceplugin.config_watch import ConfigWatcher
from deviceplugin.kubelet.main import DevicePluginDaemon
from deviceplugin.kubelet.server import list_response
from deviceplugin.quota.loop import LoopSettings, QuotaLoop
from deviceplugin.quota.model import PolicyParams, Tenant, TenantKey
from deviceplugin.quota.telemetry import UsageSample
from deviceplugin.simulated_backend import SimulatedBackend
from extender import accounting, app, binder, metrics
from tests.extender import builders as b
from vramshare import config as vconfig
from vramshare.config import Config, ConfigError, parse_config

EXAMPLES = int(os.environ.get("VRAMSHARE_FUZZ_EXAMPLES", "150")) // 3
NASTY = [float("nan"), float("inf"), float("-inf"), 1e308, -1e308, 2**63, 2**70, -1, 0, 0.0, 1e-9, 0.05, 1, 2]
KEY = TenantKey("ns", "p", "c", pod_uid="u1")
KUBELET_RECEIVE_BYTES = 4 * 1024 * 1024  # grpc-go's default receive limit, which the kubelet keeps


def _set(doc: dict[str, Any], path: str, value: Any) -> None:
    if path.startswith("quota.classes."):
        cls = doc.setdefault("quota", {}).setdefault("classes", [{"name": "c"}])[0]
        cls[path.rsplit(".", 1)[1]] = value
        return
    if path == "health.ignoredXids":
        value = [value]
    parts = path.split(".")
    target = doc
    for p in parts[:-1]:
        target = target.setdefault(p, {})
    target[parts[-1]] = value


# Every numeric key (written out here, not read from the code under test, so the fuzz runs on main
# too) with the range its values usually take.
KEYS: dict[str, tuple[float, float]] = {
    "memoryUnitMiB": (256, 8192), "reservedMiBPerGPU": (0, 4096), "health.ignoredXids": (0, 200),
    "health.recoveryProbeSeconds": (1, 60), "health.probesToRecover": (1, 10),
    "extender.assumeTimeoutSeconds": (10, 600), "extender.workloadWindow": (10, 5000),
    "extender.holdTimeoutSeconds": (0, 60), "quota.intervalSeconds": (1, 60), "quota.floorFraction": (0, 1),
    "quota.ceilingFraction": (1, 4), "quota.stepMiB": (64, 4096), "quota.marginMiB": (0, 4096),
    "quota.kvPressure": (0, 1), "quota.peakWindowTicks": (1, 600), "quota.idleSeconds": (0, 3600),
    "quota.classes.floorFraction": (0, 1), "quota.classes.ceilingFraction": (1, 4),
    "quota.classes.floorMiB": (0, 40960), "quota.classes.ceilingMiB": (40960, 163840),
    "quota.classes.marginMiB": (0, 4096), "quota.classes.idleSeconds": (0, 3600),
    "quota.classes.lendingPriority": (-10, 10), "enforcement.overLimitGraceSeconds": (0, 600),
    "quota.startupTicks": (0, 60), "warmTier.scanIntervalSeconds": (1, 600), "warmTier.maxCacheEntries": (1, 500_000),
    "warmTier.residencyMaxSteps": (0, 3), "dynamicMig.graceSeconds": (0, 600),
    "quota.classes.sleepBookedFraction": (0, 1), "quota.classes.wakeReserve": (1, 8),
}
HUGE = [1e6, 1e9, 1e12, 2**40, 2**62]


def _value(rng: random.Random, path: str) -> Any:
    low, high = KEYS[path]
    integral = not any(w in path for w in ("Fraction", "Seconds", "Pressure"))
    pick = rng.randrange(5)
    if pick == 0:
        return rng.choice(NASTY)
    if pick == 1:
        x = rng.choice(HUGE)
        return int(x) if integral else float(x)
    if pick == 2:
        return rng.choice([low, high, 1, 2, 3])
    x = low + rng.random() * (high - low)
    return int(x) if integral else x


def document(rng: random.Random) -> str:
    """A typed-fuzz document: a few numeric keys, each nasty, huge, at an edge or in its usual range."""
    doc: dict[str, Any] = {"version": "v1"}
    for path in rng.sample(sorted(KEYS), rng.randint(1, 6)):
        _set(doc, path, _value(rng, path))
    if rng.random() < 0.3:
        doc["extender"] = {**doc.get("extender", {}), "policy": rng.choice(["fgd", "binpack", "spread"])}
    return yaml.safe_dump(doc)


# -- the consumers ---------------------------------------------------------------------------------
class _Source:
    name = "fake"

    def __init__(self, used: int) -> None:
        self.used = used

    def list_tenants(self) -> list[Tenant]:
        return [Tenant(KEY, (("GPU-0", 40960),))]

    def read_usage(self) -> list[UsageSample]:
        return [UsageSample("GPU-0", self.used, pod_uid="u1")]


def device_plugin(cfg: Config, nxt: Config, root: str) -> None:
    daemon = DevicePluginDaemon(SimulatedBackend.demo(), cfg.with_overrides(quota_host_dir=root),
                                os.path.join(root, "dp"))  # raises ConfigError for node limits
    try:
        for devices in daemon.state.snapshot.devices.values():
            assert list_response(devices).ByteSize() <= KUBELET_RECEIVE_BYTES
        inv = daemon.state.snapshot.inventory
        assert all(g.units >= 1 for g in inv.gpus if g.mode.value == "shared")
        before = daemon.state.snapshot.devices
        daemon.reload(nxt.with_overrides(quota_host_dir=root))
        snap = daemon.state.snapshot
        assert (snap.config.memory_unit_mib, snap.config.reserved_mib_per_gpu) == (
            cfg.memory_unit_mib, cfg.reserved_mib_per_gpu)
        assert snap.devices == before or nxt.default_gpu_mode != cfg.default_gpu_mode
    finally:
        daemon.close()


def quota_loop(cfg: Config, nxt: Config, root: str) -> None:
    src = _Source(30000)
    loop = QuotaLoop(src, lambda: {"GPU-0": 81920}, [src], PolicyParams.from_config(cfg.quota),
                     os.path.join(root, "q"), settings=LoopSettings.from_config(cfg.quota, cfg.enforcement))
    for used in (30000, 80000, 1000):
        src.used = used
        report = loop.run_once()
        assert not report.errors, report.errors
        for d in report.decisions:
            assert isinstance(d.limit_mib, int) and 0 <= d.limit_mib
    loop.reconfigure(nxt.quota, nxt.enforcement)
    assert not loop.run_once().errors
    interval = LoopSettings.from_config(nxt.quota).interval_seconds
    assert interval is not None and math.isfinite(interval) and interval >= 1


def extender(cfg: Config, _nxt: Config, _root: str) -> None:
    clock = [1_700_000_000 * 10**9]
    acct = accounting.Accounting(cfg, lambda: clock[0])
    acct.apply_node("ADDED", b.gpu_node("n1", b.a100(), b.h100()))
    acct.apply_pod("ADDED", b.assigned(b.pod("p", 8, uid="u-p"), "", [("GPU-n1-0", 8192)], clock[0]))
    ext = app.Extender(acct, binder.Binder(acct, None, cfg.extender.policy), None,  # type: ignore[arg-type]
                       metrics.ExtenderMetrics(acct), cfg.extender.policy)
    for verb in ("filter", "prioritize"):
        out = ext.handle("POST", f"/{verb}", orjson.dumps({"Pod": b.pod("q", 8, uid="u-q"), "NodeNames": ["n1"]}))
        assert out.status == 200, out.body
    clock[0] += int(cfg.extender.assume_timeout_seconds * 1e9) + 1
    assert acct.expire() == ["default/p"]  # an assumed pod that never binds is freed at the timeout


def watcher(cfg_text: str, nxt_text: str, root: str) -> None:
    path = os.path.join(root, "config.yaml")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(cfg_text)
    seen: list[Config] = []
    w = ConfigWatcher(path, seen.append, poll_seconds=3600)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(nxt_text)
    w.check(force="test")


CONSUMERS: list[tuple[str, Callable[[Config, Config, str], None]]] = [
    ("device-plugin", device_plugin), ("quota-loop", quota_loop), ("extender", extender)]


def judge(text: str, nxt_text: str) -> tuple[str, str]:
    """("refused", why) | ("ok", "") | ("broken", consumer: error)."""
    try:
        cfg = parse_config(text)
    except ConfigError as exc:
        return "refused", str(exc)
    try:
        nxt = parse_config(nxt_text)
    except ConfigError:
        nxt = cfg
    with tempfile.TemporaryDirectory(prefix="vramshare-cfg-") as root:
        for name, consume in CONSUMERS:
            try:
                consume(cfg, nxt, root)
            except ConfigError as exc:  # the node check at the device plugin's start: a refusal too
                return "refused", str(exc)
            except Exception as exc:  # noqa: BLE001 - what the property forbids
                return "broken", f"{name}: {type(exc).__name__}: {exc}"
        try:
            watcher(text, nxt_text, root)
        except Exception as exc:  # noqa: BLE001
            return "broken", f"config-watch: {type(exc).__name__}: {exc}"
    return "ok", ""


def test_the_fuzz_covers_every_numeric_key() -> None:
    assert set(KEYS) == set(vconfig.BOUNDS)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), nxt_seed=st.integers(0, 2**32 - 1))
def test_every_accepted_document_runs_every_consumer_and_survives_a_reload(seed: int, nxt_seed: int) -> None:
    text, nxt = document(random.Random(seed)), document(random.Random(nxt_seed))
    verdict, why = judge(text, nxt)
    assert verdict != "broken", f"{why}\n{text}"
    if verdict == "refused":
        assert why.split(":", 1)[0].strip(), why  # names the key


@pytest.mark.parametrize("text", [
    "quota: {ceilingFraction: .nan}", "quota: {ceilingFraction: .inf}", "quota: {ceilingFraction: 1e308}",
    "quota: {intervalSeconds: .nan}", "extender: {holdTimeoutSeconds: .inf}",
    "extender: {assumeTimeoutSeconds: .nan}", "memoryUnitMiB: 1", "reservedMiBPerGPU: 100000",
    "reservedMiBPerGPU: 81000",
])
def test_the_issues_documents_are_refused_with_the_key(text: str) -> None:
    verdict, why = judge(text, "")
    assert verdict == "refused", why
    assert why.startswith(text.split(":")[0].strip("{ ")) or why.split(":")[0] in text, why


def main(argv: list[str]) -> int:
    n = int(argv[1]) if len(argv) > 1 else 821
    counts = {"refused": 0, "ok": 0, "broken": 0}
    broken = []
    for i in range(n):
        verdict, why = judge(document(random.Random(i)), document(random.Random(n + i)))
        counts[verdict] += 1
        if verdict == "broken":
            broken.append(why)
    kinds: dict[str, int] = {}
    for why in broken:
        k = why.split(":")[0] + ": " + why.split(":")[1].strip()
        kinds[k] = kinds.get(k, 0) + 1
    print(orjson.dumps({"documents": n, **counts, "accepted": counts["ok"] + counts["broken"],
                        "by_consumer": kinds, "examples": broken[:8]}).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
