"""The README's example pod is one a user can apply as written: it names the vramshare scheduler and the
NVIDIA RuntimeClass (without it the container starts without a GPU where NVIDIA's runtime is not the
default), and it passes the admission policy's scheduler rule."""
from __future__ import annotations

import pathlib
import re

import yaml

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_the_example_pod_names_the_scheduler_and_the_runtime_class():
    blocks = re.findall(r"```yaml\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    pods = [d for b in blocks for d in yaml.safe_load_all(b) if isinstance(d, dict) and d.get("kind") == "Pod"]
    assert pods, "README has no example Pod"
    spec = pods[0]["spec"]
    assert spec["schedulerName"] == "vramshare-scheduler"
    assert spec["runtimeClassName"] == "nvidia"
    assert "nodeName" not in spec
