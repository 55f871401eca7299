"""Fuzz the surfaces a hostile or broken peer reaches (issue 11): the extender's verbs through its HTTP
server with real JSON, the config parser and the inventory parser. Bounded: fixed example counts,
no per-example deadline (a shared CI machine), a few seconds in all.

Properties: no crash (a verb's unexpected exception is logged as "verb failed" and counted as an
``error`` outcome: there must be none), no 5xx, and every refusal carries a reason (a 4xx body, a
filter ``Error`` or a reason per failed node, a bind ``Error``, a parser error naming the field).
"""
from __future__ import annotations

import http.client
import json
import logging
import os
from typing import Any, Iterator

import orjson
import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from extender import main, translate
from standins.apiserver import ApiServerDouble
from tests.extender import builders as b
from vramshare import contract
from vramshare.config import ConfigError, _EXTENDER_KEYS, _HEALTH_KEYS, _QUOTA_KEYS, _TOP_KEYS, parse_config
from vramshare.inventory import InventoryError, inventory_from_dict

N = contract.Names()
FUZZ = settings(max_examples=int(os.environ.get("VRAMSHARE_FUZZ_EXAMPLES", "150")), deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.function_scoped_fixture])
NODES = ["n1", "n2", "n3"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                    st.text(max_size=12))
json_values = st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                          st.dictionaries(st.text(max_size=8), kids, max_size=4)),
                           max_leaves=20)
quantities = st.one_of(st.sampled_from(["1", "0", "-1", "80", "81", "1k", "1Ki", "1e3", "9.1e15", "٣", "", "1.5",
                                        "99999999999999999999", "0x10", " 2"]),
                       st.integers(-10, 200).map(str), json_values)
resource_names = st.sampled_from([N.gpu_memory, N.gpu, N.mig("1g.10gb"), N.mig("3g.40gb"), "cpu", "memory",
                                  "nvidia.com/gpu", f"{N.domain}/unknown"])
annotation_values = st.one_of(st.sampled_from(["2", "0", "-3", "x", "H100|A100", "spread", "binpack", "nope",
                                               '{"c0": [{"uuid": "GPU-n1-0", "mib": 1024}]}', "{", "9" * 30]),
                              st.text(max_size=20))


@st.composite
def pods(draw: st.DrawFn) -> dict[str, Any]:
    pod = b.pod(draw(st.sampled_from(["p", "q", "victim"])), 0,
                namespace=draw(st.sampled_from(["default", "kube-system"])),
                uid=draw(st.sampled_from(["u1", "u2", "u3"])))
    containers = []
    for i in range(draw(st.integers(0, 3))):
        res = draw(st.dictionaries(resource_names, quantities, max_size=3))
        containers.append({"name": f"c{i}", "image": "x",
                           "resources": draw(st.sampled_from([{"limits": res}, {"requests": res},
                                                              {"limits": res, "requests": res}, {}]))})
    pod["spec"]["containers"] = containers
    if draw(st.booleans()):
        pod["spec"]["initContainers"] = [{"name": "init", "image": "x", "resources": {
            "limits": draw(st.dictionaries(resource_names, quantities, max_size=2))},
            **({"restartPolicy": "Always"} if draw(st.booleans()) else {})}]
    keys = st.sampled_from([N.gpu_count, N.gpu_models, N.policy, N.assignment, N.assume_time, N.allocation_state])
    pod["metadata"]["annotations"] = draw(st.dictionaries(keys, annotation_values, max_size=4))
    if draw(st.integers(0, 9)) == 0:  # now and then a broken shape anywhere in the pod
        path = draw(st.sampled_from([("spec",), ("metadata",), ("spec", "containers"), ("metadata", "annotations")]))
        target = pod
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = draw(json_values)
    return pod


node_names = st.one_of(st.lists(st.sampled_from(NODES + ["ghost", ""]), max_size=5), json_values)


@st.composite
def verb_calls(draw: st.DrawFn) -> tuple[str, bytes]:
    verb = draw(st.sampled_from(["filter", "prioritize", "bind", "preempt"]))
    shape = draw(st.integers(0, 9))
    if shape == 0:
        return verb, draw(st.binary(max_size=64))
    if shape == 1:
        return verb, json.dumps(draw(json_values)).encode()
    pod = draw(pods())
    if verb in ("filter", "prioritize"):
        body: Any = {"Pod": pod, "NodeNames": draw(node_names)}
    elif verb == "bind":
        body = {"PodName": draw(st.sampled_from(["p", "q", "victim", ""])),
                "PodNamespace": draw(st.sampled_from(["default", "kube-system", ""])),
                "PodUID": draw(st.sampled_from(["u1", "u2", "u3", "", "other"])),
                "Node": draw(st.sampled_from(NODES + ["ghost", ""]))}
    else:
        victims = draw(st.dictionaries(st.sampled_from(NODES + ["ghost"]), st.fixed_dictionaries({
            "Pods": st.lists(st.fixed_dictionaries({"UID": st.sampled_from(["u1", "u2", "x"])}), max_size=3),
            "NumPDBViolations": st.integers(-1, 3)}), max_size=3))
        body = {"Pod": pod, "NodeNameToMetaVictims": victims}
    return verb, json.dumps(body).encode()


class Server:
    def __init__(self, url: str) -> None:
        host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
        self.conn = http.client.HTTPConnection(host, int(port), timeout=10)

    def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        self.conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        return resp.status, resp.read()


@pytest.fixture(scope="module")
def extender() -> Iterator[Server]:
    with ApiServerDouble() as api:
        api.create_node(b.gpu_node("n1", b.a100(), b.l4()))
        api.create_node(b.gpu_node("n2", b.a100(mig=(("1g.10gb", 9984), ("3g.40gb", 40192)))))
        api.create_node(b.gpu_node("n3", b.h100(mode="exclusive")))
        for name, uid in (("p", "u1"), ("victim", "u2")):
            api.create_pod(b.assigned(b.pod(name, 8, uid=uid), "n1", [(b.uuid_of("n1", 0), 8192)], 1,
                                      state="allocated"))
        with main.start_for_url(api.url) as ext:
            assert ext.wait_ready(10)
            server = Server(ext.url)
            yield server
            server.conn.close()


def _reasoned(verb: str, status: int, body: bytes) -> None:
    assert status < 500, body
    if status != 200:
        assert body.strip(), f"{verb}: {status} without a reason"
        return
    out = orjson.loads(body)
    if verb == "filter":
        assert isinstance(out, dict)
        for node, why in (out.get("FailedNodes") or {}).items():
            assert isinstance(why, str) and why.strip(), f"filter failed {node} without a reason"
        for node, why in (out.get("FailedAndUnresolvableNodes") or {}).items():
            assert isinstance(why, str) and why.strip(), f"filter failed {node} without a reason"
    elif verb == "bind":
        assert isinstance(out, dict) and isinstance(out.get("Error", ""), str)
    elif verb == "prioritize":
        assert isinstance(out, list) and all(0 <= h["Score"] <= contract.MAX_EXTENDER_PRIORITY for h in out)
    else:
        assert isinstance(out, dict)


@FUZZ
@given(call=verb_calls())
def test_verbs_never_crash_never_5xx_and_always_say_why(extender: Server, call: tuple[str, bytes],
                                                        caplog: pytest.LogCaptureFixture) -> None:
    verb, body = call
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        status, out = extender.post(f"/{verb}", body)
    _reasoned(verb, status, out)
    crashes = [r for r in caplog.records if r.getMessage() in ("verb failed", "handler raised", "connection failed")]
    assert not crashes, [getattr(r, "fields", r.getMessage()) for r in crashes]


# -- the config parser -------------------------------------------------------------------------
def _config_docs() -> st.SearchStrategy[Any]:
    section = lambda keys: st.dictionaries(st.sampled_from(sorted(keys) + ["bogus"]), json_values, max_size=4)  # noqa: E731
    top = st.fixed_dictionaries({}, optional={
        **{k: json_values for k in _TOP_KEYS if k not in ("health", "extender", "quota")},
        "health": section(_HEALTH_KEYS), "extender": section(_EXTENDER_KEYS), "quota": section(_QUOTA_KEYS),
        "version": st.sampled_from(["v1", "v2", 1, None])})
    return st.one_of(top, json_values)


@FUZZ
@given(doc=_config_docs())
def test_the_config_parser_accepts_or_names_the_bad_key(doc: Any) -> None:
    try:
        text = yaml.safe_dump(doc)
    except yaml.YAMLError:
        return
    try:
        parse_config(text)
    except ConfigError as exc:
        assert str(exc).strip()


@FUZZ
@given(text=st.text(max_size=200))
def test_the_config_parser_survives_any_text(text: str) -> None:
    try:
        parse_config(text)
    except ConfigError as exc:
        assert str(exc).strip()


# -- the inventory parser ----------------------------------------------------------------------
VALID = json.loads(b.node_inventory("n1", b.a100(), b.l4(mode="exclusive"),
                                    b.a100(mig=(("3g.40gb", 40192),))).to_json())


@st.composite
def inventories(draw: st.DrawFn) -> Any:
    if draw(st.integers(0, 4)) == 0:
        return draw(json_values)
    doc = json.loads(json.dumps(VALID))
    gpus = list(doc["gpus"])
    migs = [m for g in gpus for m in g["mig"]]
    targets = [doc, *gpus, *migs]  # mutations pick among the original objects, whatever they became
    for _ in range(draw(st.integers(1, 4))):
        target = draw(st.sampled_from(targets))
        key = draw(st.sampled_from(sorted(target) + ["extra"]))
        if draw(st.booleans()):
            target.pop(key, None)
        else:
            target[key] = draw(json_values)
    return doc


@FUZZ
@given(doc=inventories())
def test_the_inventory_parser_accepts_or_names_the_field(doc: Any) -> None:
    try:
        inv = inventory_from_dict(doc)
    except InventoryError as exc:
        assert str(exc).startswith("inventory")
        return
    for g in inv.gpus:  # what it accepts is schedulable as is: bounded, non-negative
        assert 0 <= g.units * inv.unit_mib <= max(g.memory_mib, 0) and g.memory_mib >= 0
    try:  # the annotation is JSON text: a doc holding inf (in a field the parser ignores) has none
        text = json.dumps(doc, allow_nan=False)
    except ValueError:
        return
    node = {"metadata": {"name": "n1", "annotations": {N.inventory: text}}}
    assert translate.node_slots(node, N) is not None


# -- HTTP framing ------------------------------------------------------------------------------
class _Echo:
    def handle(self, method: str, path: str, body: bytes) -> Any:
        from extender.app import Response
        return Response(200, b"{}")


@pytest.fixture(scope="module")
def raw_server() -> Iterator[Any]:
    import threading

    from extender.http_server import ExtenderHTTPServer
    server = ExtenderHTTPServer(_Echo(), "127.0.0.1", 0, request_timeout_s=0.5, max_body_bytes=4096)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02})
    thread.start()
    yield server
    server.close()
    thread.join(10)


head_lines = st.lists(st.one_of(
    st.sampled_from([b"Content-Length: 2", b"Content-Length: -1", b"Content-Length: 99999999999",
                     b"Content-Length: 1, 2", b"Transfer-Encoding: chunked", b"Expect: 100-continue",
                     b"Expect: weird", b"Connection: close", b" folded", b"NoColon", b"Host: x"]),
    st.binary(max_size=30).filter(lambda b: b"\r\n" not in b)), max_size=5)


@FUZZ
@given(line=st.one_of(st.sampled_from([b"POST /filter HTTP/1.1", b"GET /healthz HTTP/1.0", b"BREW / HTTP/1.1",
                                       b"POST /filter HTTP/2.0", b"POST filter HTTP/1.1", b"post /x HTTP/1.1"]),
                      st.binary(max_size=40).filter(lambda b: b"\r\n" not in b)),
       headers=head_lines, body=st.binary(max_size=8))
def test_any_request_head_gets_an_answer_with_a_reason_or_is_closed(raw_server: Any, line: bytes,
                                                                      headers: list[bytes], body: bytes) -> None:
    import socket
    with socket.create_connection(raw_server.server_address, timeout=5) as sock:
        sock.sendall(b"\r\n".join([line, *headers]) + b"\r\n\r\n" + body)
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    if data:
        status = int(data.split(b" ", 2)[1])
        assert status != 500, data
        if status >= 400:
            assert data.split(b"\r\n\r\n", 1)[1].strip(), f"{status} without a reason"
    with socket.create_connection(raw_server.server_address, timeout=5) as sock:  # still serving
        sock.sendall(b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
