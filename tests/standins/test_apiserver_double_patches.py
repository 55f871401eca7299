"""The patch dialects as pure functions: the edge cases a client can send but our callers rarely do."""
from __future__ import annotations

import pytest

from standins.apiserver.errors import ApiError
from standins.apiserver.patches import apply_patch, json_patch, merge_patch, strategic_merge_patch


def test_merge_patch_deletes_with_null_and_replaces_lists() -> None:
    target = {"a": {"b": 1, "c": 2}, "l": [1, 2]}
    assert merge_patch(target, {"a": {"b": None, "d": 3}, "l": [3]}) == {"a": {"c": 2, "d": 3}, "l": [3]}
    assert target == {"a": {"b": 1, "c": 2}, "l": [1, 2]}  # inputs are never mutated


def test_strategic_patch_directives() -> None:
    target = {"spec": {"containers": [{"name": "a", "image": "1"}, {"name": "b", "image": "2"}],
                       "tolerations": [{"key": "x"}]}}
    patch = {"spec": {"containers": [{"name": "a", "$patch": "delete"}, {"name": "c", "image": "3"}],
                      "$setElementOrder/containers": [{"name": "b"}, {"name": "c"}],
                      "tolerations": [{"key": "y"}]}}
    assert strategic_merge_patch(target, patch) == {
        "spec": {"containers": [{"name": "b", "image": "2"}, {"name": "c", "image": "3"}],
                 "tolerations": [{"key": "y"}]}}
    assert strategic_merge_patch({"m": {"x": 1, "y": 2}}, {"m": {"$patch": "replace", "z": 3}}) == {"m": {"z": 3}}


def test_json_patch_move_copy_remove_append_and_escapes() -> None:
    doc = {"a": {"x/y": 1}, "l": [1]}
    ops = [{"op": "copy", "from": "/a/x~1y", "path": "/b"},
           {"op": "move", "from": "/b", "path": "/c"},
           {"op": "add", "path": "/l/-", "value": 2},
           {"op": "add", "path": "/l/0", "value": 0},
           {"op": "remove", "path": "/a/x~1y"}]
    assert json_patch(doc, ops) == {"a": {}, "c": 1, "l": [0, 1, 2]}


@pytest.mark.parametrize("ops", [[{"op": "remove", "path": "/missing"}],
                                 [{"op": "replace", "path": "/a/b/c", "value": 1}],
                                 [{"op": "test", "path": "/a", "value": 2}]])
def test_json_patch_failures_are_unprocessable(ops: list) -> None:
    with pytest.raises(ApiError) as failed:
        json_patch({"a": 1}, ops)
    assert failed.value.code == 422


def test_unknown_patch_type_is_unsupported_media_type() -> None:
    with pytest.raises(ApiError) as failed:
        apply_patch("application/apply-patch+yaml", {}, {})
    assert failed.value.code == 415
