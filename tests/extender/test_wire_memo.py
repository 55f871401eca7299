"""The wire's memos answer exactly what a plain decode/encode answers (p21wire).

:class:`extender.wire.NameLists` lets :func:`extender.wire.decode_extender_args` read the ``NodeNames``
list apart from the rest of the body and skip decoding a list whose bytes it saw lately, and lets
:func:`extender.wire.encode_filter_result` remember the list it answered (kube-scheduler's next
prioritize sends exactly that). Properties over random bodies, in Go's field order and in others,
well-formed and not, each decoded through one memo shared by the whole sequence: the same pod, the
same names, the same node objects, or the same refusal, as the whole-body decode without a memo.
"""
from __future__ import annotations

import numpy as np
import orjson
import pytest
from hypothesis import given, settings, strategies as st

from extender import wire

# Node names as the API server allows them, plus characters JSON must escape (quotes, backslashes,
# controls, non-ASCII): the memo compares bytes, so escapes must round-trip to the same names.
NAMES = st.one_of(st.from_regex(r"[a-z0-9]([a-z0-9.-]{0,20}[a-z0-9])?", fullmatch=True),
                  st.text(min_size=0, max_size=8))
TRAPS = ['"NodeNames":', ',"NodeNames":["x"]}', '\\"NodeNames\\":', "}", '{"NodeNames":[]}']


def _pod(draw: st.DrawFn) -> object:
    if draw(st.integers(0, 9)) == 0:  # a malformed Pod now and then
        return draw(st.sampled_from([None, [], {"metadata": []}, {"metadata": {"annotations": {"a": 1}}}]))
    ann = {f"k{i}": draw(st.one_of(st.sampled_from(TRAPS), st.text(max_size=6))) for i in range(draw(st.integers(0, 3)))}
    if draw(st.booleans()):
        ann["NodeNames"] = draw(st.sampled_from(TRAPS))  # the key inside the pod, not at the top
    return {"metadata": {"name": draw(st.sampled_from(["p", "q"])), "uid": "u", "annotations": ann},
            "spec": {"containers": [{"name": "c", "resources": {"limits": {"x": "1"}}}]}}


@st.composite
def bodies(draw: st.DrawFn, lists: list[list[str]]) -> bytes:
    """A filter or prioritize body: mostly Go's shape with a list seen before, sometimes anything."""
    pod = _pod(draw)
    if lists and draw(st.booleans()):
        names: object = draw(st.sampled_from(lists))
    else:
        names = draw(st.lists(NAMES, max_size=6))
        if draw(st.integers(0, 9)) == 0:
            names = draw(st.sampled_from([None, "a", [1], ["a", None], {"a": 1}]))
        elif isinstance(names, list):
            lists.append(names)
    nodes = None
    if draw(st.integers(0, 5)) == 0:
        nodes = {"metadata": {}, "items": [{"metadata": {"name": n}} for n in ["n1", "n2"][:draw(st.integers(0, 2))]]}
    shape = draw(st.integers(0, 9))
    if shape <= 5:  # Go: Pod, Nodes, NodeNames
        return orjson.dumps({"Pod": pod, "Nodes": nodes, "NodeNames": names})
    if shape == 6:  # another order, lowercase keys
        return orjson.dumps({"nodenames": names, "pod": pod, "nodes": nodes})
    if shape == 7:  # a duplicate NodeNames earlier in the body: the last one counts
        head = orjson.dumps({"Pod": pod, "NodeNames": ["dup"]})[:-1]
        return head + b',"NodeNames":' + orjson.dumps(names) + b"}"
    if shape == 8:  # whitespace, a trailing newline (json.Encoder's)
        return orjson.dumps({"Pod": pod, "Nodes": nodes, "NodeNames": names}, option=orjson.OPT_INDENT_2) + b"\n"
    # broken: cut short, or NodeNames alone
    raw = orjson.dumps({"Pod": pod, "NodeNames": names})
    return draw(st.sampled_from([raw[:-2] + b"}", b'{,"NodeNames":' + orjson.dumps(names) + b"}",
                                 b'{"Pod":{},' + raw[1:], raw.replace(b'"Pod"', b'"Pod" ')]))


def _outcome(body: bytes, lists: wire.NameLists | None) -> tuple:
    try:
        args = wire.decode_extender_args(body, lists)
    except wire.WireError as exc:
        return ("refused", str(exc))
    return ("ok", orjson.dumps(args.pod), args.node_names, args.nodes)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_decode_with_the_memo_equals_the_whole_body_decode(data: st.DataObject) -> None:
    lists, seen = wire.NameLists(size=3), []
    for _ in range(data.draw(st.integers(1, 12))):
        body = data.draw(bodies(seen))
        assert _outcome(body, lists) == _outcome(body, None), body


@settings(max_examples=100, deadline=None)
@given(passed=st.lists(NAMES, max_size=8), failed=st.dictionaries(NAMES, st.text(max_size=5), max_size=3),
       unresolvable=st.dictionaries(NAMES, st.text(max_size=5), max_size=3), error=st.text(max_size=5),
       full=st.booleans())
def test_filter_answer_with_the_memo_is_byte_identical(passed: list[str], failed: dict[str, str],
                                                       unresolvable: dict[str, str], error: str, full: bool) -> None:
    result = wire.FilterResult(passed=passed, failed=failed, unresolvable=unresolvable, error=error)
    nodes = [{"metadata": {"name": n}} for n in passed + ["other"]] if full else None
    args = wire.ExtenderArgs(pod={"metadata": {}}, node_names=None if full else passed + ["other"], nodes=nodes)
    lists = wire.NameLists()
    assert wire.encode_filter_result(result, args, lists) == wire.encode_filter_result(result, args)
    assert wire.encode_filter_result(result, None, lists) == wire.encode_filter_result(result, None)


def test_prioritize_after_filter_decodes_the_answered_list_from_the_memo() -> None:
    """kube-scheduler's cycle: filter with every name, prioritize with the names filter passed."""
    lists = wire.NameLists()
    names = [f"node-{i:05d}" for i in range(50)]
    pod = {"metadata": {"name": "p", "namespace": "ns", "uid": "u", "resourceVersion": "1"}}
    args = wire.decode_extender_args(orjson.dumps({"Pod": pod, "Nodes": None, "NodeNames": names}), lists)
    assert args.node_names == names and lists.misses == 1
    answer = orjson.loads(wire.encode_filter_result(wire.FilterResult(passed=names[1:]), args, lists))
    prio = wire.decode_extender_args(orjson.dumps({"Pod": pod, "Nodes": None, "NodeNames": answer["NodeNames"]}), lists)
    assert prio.node_names == names[1:] and prio.pod == pod and lists.hits == 1
    again = wire.decode_extender_args(orjson.dumps({"Pod": pod, "Nodes": None, "NodeNames": names}), lists)
    assert again.node_names == names and lists.hits == 2


@pytest.mark.parametrize("body", [
    b'{"Pod":{"metadata":{}},"NodeNames":[1]}', b'{"Pod":[],"Nodes":null,"NodeNames":["a"]}',
    b'{"NodeNames":["a"]}', b'{,"NodeNames":["a"]}', b'{"Pod":{"metadata":{}},"NodeNames":["a"]',
])
def test_malformed_bodies_are_refused_alike_with_the_memo(body: bytes) -> None:
    assert _outcome(body, wire.NameLists())[0] == "refused"
    assert _outcome(body, wire.NameLists()) == _outcome(body, None)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_prepared_priority_entries_follow_rows_changing_hands(data: st.DataObject) -> None:
    """:meth:`HostFragments.prepare` (once the books are in) and encodes after nodes come and go
    (a freed row taken by another node, the epoch bumped) give :func:`encode_host_priorities`'s bytes."""
    from extender.cluster import ClusterState, Slot

    state, frags = ClusterState(gpus_per_node=1), wire.HostFragments()
    pool = [f"n{i}" for i in range(12)] + ['q"uote', "ünï"]
    for name in pool[:6]:
        state.set_node(name, [Slot(f"{name}-g0", "A100", capacity=1000)])
    nodes = state.nodes()
    frags.prepare(nodes, state.rows_of(nodes, remember=False), state.names_epoch)
    for _ in range(data.draw(st.integers(1, 8))):
        for _ in range(data.draw(st.integers(0, 3))):
            name = data.draw(st.sampled_from(pool))
            if name in state.nodes() and data.draw(st.booleans()):
                state.remove_node(name)
            else:
                state.set_node(name, [Slot(f"{name}-g0", "A100", capacity=1000)])
        names = data.draw(st.permutations(state.nodes() + ["ghost"]))
        scores = np.array(data.draw(st.lists(st.integers(0, 10), min_size=len(names), max_size=len(names))))
        rows = state.rows_of(names, remember=False)
        assert frags.encode(names, rows, scores, state.names_epoch) == \
            wire.encode_host_priorities(list(zip(names, scores.tolist())))
