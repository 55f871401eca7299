"""Quantities by the API server's rules, and the kubelet's way of adding up a pod's containers."""
from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings, strategies as st

from vramshare import podspec, quantity


@pytest.mark.parametrize("text,value", [
    ("22", 22), ("1k", 1000), ("500m", Fraction(1, 2)), ("16Gi", 16 * 2**30), ("1e3", 1000),
    ("1.5", Fraction(3, 2)), (".5", Fraction(1, 2)), ("+7", 7), ("-3", -3), ("2E2", 200), ("1Ki", 1024),
    (" 4 ", 4), (12, 12),
])
def test_parse_reads_the_api_servers_forms(text, value):
    assert quantity.parse(text, "x") == value


@pytest.mark.parametrize("text", ["", "1.2.3", "Gi", "1 Gi", "1KB", "٣", "1e", "1e999", "x" * 100, None, True, 1.5])
def test_parse_refuses_what_the_api_server_refuses(text):
    with pytest.raises(quantity.QuantityError):
        quantity.parse(text, "container vllm: vramshare.io/gpu-memory")


def test_whole_refuses_fractions_negatives_and_the_absurd_with_a_reason():
    assert quantity.whole("1k", "r", 10_000) == 1000
    with pytest.raises(quantity.QuantityError, match="whole"):
        quantity.whole("500m", "r", 10)
    with pytest.raises(quantity.QuantityError, match="negative"):
        quantity.whole(-1, "r", 10)
    with pytest.raises(quantity.QuantityError, match="more than"):
        quantity.whole("9.1e15", "r", podspec.MAX_DEVICES)


def test_cpu_and_memory_round_up_as_the_scheduler_does():
    assert quantity.cpu_millis("0.0005", "c") == 1
    assert quantity.cpu_millis("2", "c") == 2000
    assert quantity.byte_count("1.5Ki", "m") == 1536


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=10**12))
def test_integers_round_trip(n):
    assert quantity.parse(str(n), "x") == n


def _units(c):
    return {"u": int(c.get("resources", {}).get("requests", {}).get("u", 0))}


def _c(name, u, restart=None):
    c = {"name": name, "resources": {"requests": {"u": u}}}
    if restart:
        c["restartPolicy"] = restart
    return c


def test_effective_requests_follow_the_kubelets_rule():
    # app 10 + 20; init 100 alone -> 100 wins
    pod = {"spec": {"containers": [_c("a", 10), _c("b", 20)], "initContainers": [_c("i", 100)]}}
    assert podspec.effective_requests(pod, _units) == {"u": 100}
    # a sidecar (5) runs beside the apps and beside every later init container
    pod = {"spec": {"containers": [_c("a", 10)],
                    "initContainers": [_c("s", 5, "Always"), _c("i", 12)]}}
    assert podspec.effective_requests(pod, _units) == {"u": 17}
    pod = {"spec": {"containers": [_c("a", 10)],
                    "initContainers": [_c("i", 12), _c("s", 5, "Always")]}}
    assert podspec.effective_requests(pod, _units) == {"u": 15}


def test_pod_demand_reads_quantities_by_kubernetes_rules():
    from vramshare import contract
    names = contract.Names()
    pod = {"metadata": {"name": "p"}, "spec": {"containers": [
        {"name": "c", "resources": {"limits": {names.gpu_memory: "1k"}}}]}}
    assert podspec.pod_demand(pod, names).containers[0].units == 1000
    for bad in ("-1", "٣", "9.1e15", "1.5"):
        pod["spec"]["containers"][0]["resources"]["limits"][names.gpu_memory] = bad
        with pytest.raises(podspec.PodSpecError):
            podspec.pod_demand(pod, names)


QUANTITIES = st.one_of(st.from_regex(r"[+-]?[0-9]{1,4}(\.[0-9]{0,3})?(Ki|Mi|Gi|m|k|M|e[0-9]|e-[0-9])?", fullmatch=True),
                       st.text(max_size=6), st.integers(-10**6, 10**6))


@settings(max_examples=200, deadline=None)
@given(calls=st.lists(st.tuples(QUANTITIES, st.sampled_from(["cpu", "memory"])), max_size=12))
def test_quantities_read_again_read_as_the_first_time(calls):
    """Strings read lately are remembered (each watch event re-reads a pod's quantities): a second
    reading gives the same value, and a refusal always names the caller's own ``where``."""
    for value, where in calls:
        for read in (quantity.parse, quantity.cpu_millis, quantity.byte_count):
            seen = []
            for at in (where, f"{where} again"):
                try:
                    seen.append(("ok", read(value, at)))
                except quantity.QuantityError as exc:
                    assert at in str(exc)
                    # the prefix only: a value may read as its where ('cpu' at 'cpu')
                    seen.append(("refused", str(exc).replace(at, "<where>", 1)))
            assert seen[0] == seen[1], (value, read)
