"""The extender/v1 wire format, pinned to kube-scheduler's own fixtures (extender/v1/types_test.go).

Each ``expectJSON`` below is copied byte for byte from ``TestCompatibility``; Go marshals the embedded
Pod/Node with its zero values, which we echo untouched. Go also decodes the lowercased form (the test
round-trips ``strings.ToLower(json)``), so we accept it too.
"""
from __future__ import annotations

import orjson
import pytest

from extender import wire

GO_NODE = ('{"metadata":{"name":"nodename","creationTimestamp":null},"spec":{},"status":{"daemonEndpoints":'
           '{"kubeletEndpoint":{"Port":0}},"nodeInfo":{"machineID":"","systemUUID":"","bootID":"",'
           '"kernelVersion":"","osImage":"","containerRuntimeVersion":"","kubeletVersion":"",'
           '"kubeProxyVersion":"","operatingSystem":"","architecture":""}}}')
GO_POD = '{"metadata":{"name":"podname","creationTimestamp":null},"spec":{"containers":null},"status":{}}'
EXTENDER_ARGS = f'{{"Pod":{GO_POD},"Nodes":{{"metadata":{{}},"items":[{GO_NODE}]}},"NodeNames":["node1"]}}'
BINDING_ARGS = '{"PodName":"mypodname","PodNamespace":"mypodnamespace","PodUID":"mypoduid","Node":"mynode"}'
PREEMPTION_RESULT = '{"NodeNameToMetaVictims":{"foo":{"Pods":[{"UID":"myuid"}],"NumPDBViolations":1}}}'
PREEMPTION_ARGS = (f'{{"Pod":{GO_POD},"NodeNameToVictims":{{"foo":{{"Pods":[{GO_POD}],"NumPDBViolations":1}}}},'
                   '"NodeNameToMetaVictims":{"foo":{"Pods":[{"UID":"myuid"}],"NumPDBViolations":1}}}')


@pytest.mark.parametrize("text", [EXTENDER_ARGS, EXTENDER_ARGS.lower()], ids=["go", "lowercased"])
def test_extender_args_fixture_decodes_with_node_names_preferred(text: str) -> None:
    args = wire.decode_extender_args(text.encode())
    assert args.node_names == ["node1"]
    assert args.nodes is None
    assert args.pod["metadata"]["name"] == "podname"
    assert args.names == ["node1"]


def test_full_nodes_form_echoes_only_fitting_node_objects() -> None:
    other = GO_NODE.replace('"nodename"', '"other"')
    body = f'{{"Pod":{GO_POD},"Nodes":{{"metadata":{{}},"items":[{GO_NODE},{other}]}},"NodeNames":null}}'
    args = wire.decode_extender_args(body.encode())
    assert args.names == ["nodename", "other"]
    result = wire.FilterResult(passed=["nodename"], failed={"other": "bar"})
    assert wire.encode_filter_result(result, args) == (
        f'{{"Nodes":{{"metadata":{{}},"items":[{GO_NODE}]}},"NodeNames":["nodename"],'
        '"FailedNodes":{"other":"bar"},"FailedAndUnresolvableNodes":{},"Error":""}').encode()


def test_filter_result_keys_match_types_test() -> None:
    """The fixture's keys and values, plus FailedAndUnresolvableNodes (added to the type after it)."""
    result = wire.FilterResult(passed=["node1"], failed={"foo": "bar"}, unresolvable={"baz": "qux"}, error="myerror")
    assert wire.encode_filter_result(result, wire.ExtenderArgs(pod={"metadata": {}}, node_names=["node1"])) == (
        b'{"Nodes":null,"NodeNames":["node1"],"FailedNodes":{"foo":"bar"},'
        b'"FailedAndUnresolvableNodes":{"baz":"qux"},"Error":"myerror"}')


def test_no_fit_is_an_empty_list_never_null() -> None:
    out = orjson.loads(wire.encode_filter_result(wire.FilterResult(), None))
    assert out["NodeNames"] == [] and out["Error"] == ""


def test_host_priority_fixture() -> None:
    assert wire.encode_host_priorities([("myhost", 1)]) == b'[{"Host":"myhost","Score":1}]'
    assert wire.encode_host_priorities([]) == b"[]"


@pytest.mark.parametrize("text", [BINDING_ARGS, BINDING_ARGS.lower()], ids=["go", "lowercased"])
def test_binding_args_fixture(text: str) -> None:
    args = wire.decode_binding_args(text.encode())
    assert args == wire.BindingArgs("mypodname", "mypodnamespace", "mypoduid", "mynode")
    assert args.pod_key == "mypodnamespace/mypodname"


def test_binding_result_fixture() -> None:
    assert wire.encode_binding_result("myerror") == b'{"Error":"myerror"}'
    assert wire.encode_binding_result() == b'{"Error":""}'


def test_preemption_fixtures() -> None:
    args = wire.decode_preemption_args(PREEMPTION_ARGS.encode())
    assert args.victims == {"foo": ["myuid"]} and args.pdb_violations == {"foo": 1}
    assert wire.encode_preemption_result(args.victims, args.pdb_violations) == PREEMPTION_RESULT.encode()


@pytest.mark.parametrize("body, message", [
    (b"{not json", "not JSON"),
    (b"[]", "expected a JSON object"),
    (b'{"NodeNames":["a"]}', "Pod"),
    (b'{"Pod":{"metadata":{}},"NodeNames":"a"}', "NodeNames"),
    (b'{"Pod":{"metadata":{}},"NodeNames":null,"Nodes":null}', "neither"),
    (b'{"Pod":{"metadata":{}},"Nodes":{"items":[{"metadata":{}}]}}', r"items\[0\]"),
], ids=["not-json", "array", "no-pod", "names-not-list", "no-nodes", "nameless-node"])
def test_malformed_extender_args_name_the_field(body: bytes, message: str) -> None:
    with pytest.raises(wire.WireError, match=message):
        wire.decode_extender_args(body)


@pytest.mark.parametrize("body, message", [
    (b'{"PodNamespace":"ns","Node":"n"}', "PodName"),
    (b'{"PodName":"p","PodNamespace":"ns","Node":""}', "Node"),
], ids=["no-name", "empty-node"])
def test_malformed_binding_args(body: bytes, message: str) -> None:
    with pytest.raises(wire.WireError, match=message):
        wire.decode_binding_args(body)
