"""NVML health watching against the fake pynvml: Xid events, MIG mapping, lost GPUs, recovery.

Each test scripts ``nvmlEventSetWait``; when the script ends the fake sets ``stop``, so
``watch_health`` runs to completion on the test's thread in virtual time (no sleeps, no threads).
"""
from __future__ import annotations

import threading

import pynvml
import pytest

from deviceplugin import health
from deviceplugin.backend import BackendError, HealthEvent
from deviceplugin.nvml_backend import NvmlBackend
from deviceplugin.nvml_health import NO_INSTANCE
from tests.fixtures.fake_nvml import A100_80GB_MIG, H100_80GB, H200_141GB, FakeNvml, Xid

H100, H200, A100 = H100_80GB.uuid, H200_141GB.uuid, A100_80GB_MIG.uuid
MIG_3G, MIG_1G = A100_80GB_MIG.migs[0], A100_80GB_MIG.migs[2]
WAIT = pynvml.NVMLError_Timeout  # one empty 5 s wait


def watch(fake: FakeNvml, *script, ignored=health.DEFAULT_IGNORED_XIDS, probe_seconds=3600.0,
          probes_to_recover=2, on_event=None) -> list[HealthEvent]:
    events: list[HealthEvent] = []
    stop = threading.Event()
    fake.events = list(script)
    fake.on_idle = stop.set
    nvml = NvmlBackend(nvml=fake, clock=fake.clock, probe_seconds=probe_seconds,
                       probes_to_recover=probes_to_recover)
    nvml.watch_health(stop, on_event or events.append, ignored)
    assert stop.is_set()
    assert fake.calls[-1] == "nvmlEventSetFree"
    return events


def unhealthy(uuid, reason, xid=None, mig=None):
    return HealthEvent(uuid=uuid, healthy=False, reason=reason, xid=xid, mig_uuid=mig)


@pytest.fixture
def fake() -> FakeNvml:
    return FakeNvml([H100_80GB, H200_141GB, A100_80GB_MIG])


def test_registers_xid_and_double_bit_ecc_masked_by_support(fake):
    watch(fake)
    wanted = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError
    assert fake.registered == {H100: wanted, H200: wanted, A100: wanted}


def test_critical_xid_makes_the_gpu_unhealthy_once(fake):
    assert watch(fake, Xid(H100, 79), WAIT, Xid(H100, 48)) == [unhealthy(H100, "xid 79", 79)]


@pytest.mark.parametrize("xid", sorted(health.DEFAULT_IGNORED_XIDS))
def test_application_xids_are_ignored(fake, xid):
    assert watch(fake, Xid(H200, xid)) == []


def test_ignored_xids_are_configurable(fake):
    assert watch(fake, Xid(H200, 79), Xid(H200, 13), ignored=frozenset({79})) == [unhealthy(H200, "xid 13", 13)]


def test_non_xid_events_do_not_act(fake):
    assert watch(fake, Xid(H100, 0, event_type=pynvml.nvmlEventTypeDoubleBitEccError)) == []


def test_mig_event_maps_gi_ci_to_the_mig_uuid(fake):
    assert watch(fake, Xid(A100, 94, gi=MIG_1G.gi, ci=MIG_1G.ci)) == [
        unhealthy(A100, "xid 94", 94, mig=MIG_1G.uuid)]


def test_mig_gpu_event_without_instance_concerns_the_whole_gpu(fake):
    assert watch(fake, Xid(A100, 79, gi=NO_INSTANCE, ci=NO_INSTANCE)) == [unhealthy(A100, "xid 79", 79)]


def test_mig_event_for_an_unknown_instance_is_dropped(fake):
    assert watch(fake, Xid(A100, 94, gi=12, ci=0)) == []


def test_failed_wait_marks_every_gpu_unhealthy(fake):
    events = watch(fake, pynvml.NVMLError_Unknown)
    assert [(e.uuid, e.healthy) for e in events] == [(H100, False), (H200, False), (A100, False)]
    assert events[0].reason == "nvml: event wait failed: Unknown Error"


def test_watch_fails_like_discovery_when_a_gpu_cannot_be_read(fake):
    fake.fail("nvmlDeviceGetUUID", pynvml.NVMLError_Unknown, uuid=H200)
    with pytest.raises(BackendError, match=r"GPU 1 \(\?\): reading uuid failed"):
        NvmlBackend(nvml=fake).watch_health(threading.Event(), lambda e: None, health.DEFAULT_IGNORED_XIDS)
    assert "nvmlEventSetCreate" not in fake.calls


def test_xid_on_a_gpu_nvml_cannot_name_marks_every_gpu_unhealthy(fake):
    def break_next_uuid_read() -> None:
        fake.fail("nvmlDeviceGetUUID", pynvml.NVMLError_GpuIsLost)
    events = watch(fake, break_next_uuid_read, Xid(H200, 79))
    assert {e.uuid for e in events} == {H100, H200, A100} and {e.reason for e in events} == {"xid 79"}


def test_registration_not_supported_leaves_the_watch_running(fake):
    fake.fail("nvmlDeviceRegisterEvents", pynvml.NVMLError_NotSupported, uuid=H200)
    assert watch(fake, Xid(H100, 79)) == [unhealthy(H100, "xid 79", 79)]
    assert H200 not in fake.registered


def test_gpu_without_event_support_is_not_registered():
    quiet = H100_80GB.__class__(**{**H100_80GB.__dict__, "supported_events": pynvml.nvmlEventTypePState})
    fake = FakeNvml([quiet])
    assert watch(fake) == [] and fake.registered == {}


def test_gpu_lost_at_registration_is_unhealthy(fake):
    fake.fail("nvmlDeviceGetSupportedEventTypes", pynvml.NVMLError_GpuIsLost, uuid=H200)
    assert watch(fake) == [unhealthy(H200, "nvml: GPU is lost")]


def test_probe_finds_a_lost_gpu(fake):
    events = watch(fake, lambda: fake.lose(H200), WAIT, probe_seconds=5)
    assert events == [unhealthy(H200, "nvml: GPU is lost")]


def test_recovery_after_consecutive_good_probes(fake):
    events = watch(fake, Xid(H100, 79), WAIT, WAIT, WAIT, probe_seconds=5, probes_to_recover=2)
    assert events == [unhealthy(H100, "xid 79", 79),
                      HealthEvent(uuid=H100, healthy=True, reason="gpu answers again")]
    assert fake.calls.count("nvmlDeviceRegisterEvents") == 4  # re-registered on the fresh handle


def test_no_recovery_while_the_gpu_does_not_answer(fake):
    events = watch(fake, Xid(H100, 79), lambda: fake.lose(H100), WAIT, WAIT, WAIT, WAIT,
                   probe_seconds=5, probes_to_recover=2)
    assert events == [unhealthy(H100, "xid 79", 79)]


def test_a_failed_probe_restarts_the_recovery_streak(fake):
    script = [Xid(H100, 79), WAIT, lambda: fake.lose(H100), lambda: fake.revive(H100)]
    assert watch(fake, *script, probe_seconds=5, probes_to_recover=2) == [unhealthy(H100, "xid 79", 79)]
    assert watch(fake, *script, WAIT, probe_seconds=5, probes_to_recover=2)[-1].healthy is True


def test_a_new_xid_restarts_the_recovery_streak(fake):
    events = watch(fake, Xid(H100, 79), WAIT, Xid(H100, 48), WAIT, probe_seconds=5, probes_to_recover=2)
    assert [e.healthy for e in events] == [False]


def test_mig_instance_recovers_by_its_own_uuid(fake):
    events = watch(fake, Xid(A100, 94, gi=MIG_3G.gi, ci=MIG_3G.ci), WAIT, WAIT,
                   probe_seconds=5, probes_to_recover=2)
    assert events[-1] == HealthEvent(uuid=A100, healthy=True, reason="gpu answers again", mig_uuid=MIG_3G.uuid)


def test_a_failing_callback_does_not_stop_the_watch(fake):
    seen = []

    def on_event(event: HealthEvent) -> None:
        seen.append(event)
        raise RuntimeError("consumer bug")
    watch(fake, Xid(H100, 79), Xid(H200, 79), on_event=on_event)
    assert [e.uuid for e in seen] == [H100, H200]


def test_event_set_is_freed_when_the_watch_fails(fake):
    fake.fail("nvmlDeviceGetSupportedEventTypes", pynvml.NVMLError_Unknown, uuid=H100)
    fake.events = [Xid(H100, 79)]
    stop = threading.Event()
    nvml = NvmlBackend(nvml=fake, clock=fake.clock)

    def explode(_event: HealthEvent) -> None:
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        nvml.watch_health(stop, explode, health.DEFAULT_IGNORED_XIDS)
    assert fake.calls[-1] == "nvmlEventSetFree"
