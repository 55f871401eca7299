"""The pure core of the device plugin imports no I/O library, and the servicer knows no GPU library:
the layering the design promises, checked on the source."""
from __future__ import annotations

import ast
import os

import pytest

import deviceplugin

ROOT = os.path.dirname(os.path.dirname(deviceplugin.__file__))
IO_LIBRARIES = {"grpc", "kubernetes", "pynvml", "protos", "urllib3", "prometheus_client"}


def imported_roots(module: str) -> set[str]:
    with open(os.path.join(ROOT, *module.split(".")) + ".py", encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("module", ["deviceplugin.devices", "deviceplugin.allocation",
                                    "deviceplugin.assignment", "deviceplugin.node_state"])
def test_the_core_does_no_io(module):
    assert imported_roots(module) & IO_LIBRARIES == set()


@pytest.mark.parametrize("module", ["deviceplugin.kubelet.server", "deviceplugin.kubelet.lifecycle",
                                    "deviceplugin.kubelet.manager"])
def test_the_kubelet_side_knows_no_gpu_library_or_api_server(module):
    assert imported_roots(module) & {"pynvml", "kubernetes"} == set()
