"""The ``vramshare.io/model`` annotation (issue 23 item 1): one codec, optional, a bad value is ignored
with a reason (a wrong hint must not keep a pod from running)."""
from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from vramshare import contract
from vramshare.podspec import pod_demand

NAMES = contract.Names()


def _pod(ann: dict) -> dict:
    return {"metadata": {"name": "p", "namespace": "ns", "annotations": ann},
            "spec": {"containers": [{"name": "c", "resources": {"limits": {NAMES.gpu_memory: "4"}}}]}}


def test_name_is_in_the_user_writable_list():
    assert NAMES.model == "vramshare.io/model"
    assert "model" in contract.USER_ANNOTATIONS
    assert NAMES.model in NAMES.user_annotations()


@pytest.mark.parametrize("text,name,rev", [
    ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B-Instruct", ""),
    ("qwen2.5-14b@main", "qwen2.5-14b", "main"),
    (" org/m@0123abcd ", "org/m", "0123abcd"),
])
def test_parses(text, name, rev):
    ref = contract.parse_model_ref(text)
    assert (ref.name, ref.revision) == (name, rev)
    assert contract.parse_model_ref(str(ref)) == ref


@pytest.mark.parametrize("text", ["", "@main", "m@", "../etc", "a/../b", "m@re v", "/abs", "m@a@b", 7,
                                  "x" * 201, "m@" + "r" * 129, "a//b"])
def test_refuses_with_a_reason(text):
    with pytest.raises(contract.ModelRefError, match="model"):
        contract.parse_model_ref(text)


@given(st.text(max_size=60))
def test_never_raises_anything_else(text):
    try:
        ref = contract.parse_model_ref(text)
    except contract.ModelRefError:
        return
    assert ".." not in ref.name.split("/") and not ref.name.startswith("/")


def test_match_revision_optional():
    held = contract.ModelRef("org/m", "abc")
    assert contract.ModelRef("org/m").matches(held)
    assert contract.ModelRef("org/m", "abc").matches(held)
    assert not contract.ModelRef("org/m", "def").matches(held)
    assert not contract.ModelRef("org/n").matches(held)


def test_pod_demand_reads_it_and_degrades_without_it():
    assert pod_demand(_pod({}), NAMES).model is None
    d = pod_demand(_pod({NAMES.model: "org/m@r1"}), NAMES)
    assert d.model == contract.ModelRef("org/m", "r1") and d.model_error is None
    bad = pod_demand(_pod({NAMES.model: "../x"}), NAMES)
    assert bad.model is None and "model" in bad.model_error
    assert bad.containers == d.containers  # the request itself is read as without the hint
