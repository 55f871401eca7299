"""Where the production traces are: one setting, ``VRAMSHARE_TRACES``, with one meaning everywhere.

``VRAMSHARE_TRACES`` names the folder that HOLDS the trace folders (``openb/``, ``genai/``,
``servegen/``), the layout of a checkout's ``../shared/traces`` and of what ``vramshare traces
download`` writes. Unset, a checkout's ``../shared/traces`` is used, then the download's default
folder (``$XDG_CACHE_HOME/vramshare/traces``, else ``~/.cache/vramshare/traces``). Pure: paths only;
the download lives in :mod:`vramshare_cli.traces_download`.
"""
from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass
from typing import Mapping

__all__ = ["ENV", "OPENB_NODES", "GENAI_MEMORY", "Source", "SOURCES", "roots", "find", "shown", "not_found", "download_dir", "openb_pods"]

ENV = "VRAMSHARE_TRACES"
OPENB_NODES = "openb/openb_node_list_gpu_node.csv"
GENAI_MEMORY = "genai/pod_gpu_memory_used_bytes.csv"
GENAI_COLD_STARTS = "genai/basemodel_update_latency.csv"
OPENB_TRACES = ("default", "gpushare40", "gpuspec10", "multigpu20")
# the checkout's sibling folder: <repo>/../shared/traces (tests and benchmarks of a development tree)
CHECKOUT_TRACES = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "traces"


def openb_pods(trace: str = "default") -> str:
    """The openb pod list of one trace variant, relative to a traces folder."""
    return f"openb/openb_pod_list_{trace}.csv"


def download_dir(environ: Mapping[str, str] | None = None) -> str:
    """Where ``vramshare traces download`` writes by default: ``$VRAMSHARE_TRACES``, else the user cache."""
    env = os.environ if environ is None else environ
    if env.get(ENV):
        return env[ENV]
    cache = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "vramshare", "traces")


def roots(environ: Mapping[str, str] | None = None) -> list[str]:
    """The folders searched, in order: ``$VRAMSHARE_TRACES``, a checkout's ``../shared/traces``, the cache."""
    env = os.environ if environ is None else environ
    out = [env[ENV]] if env.get(ENV) else []
    out += [str(CHECKOUT_TRACES), download_dir({k: v for k, v in env.items() if k != ENV})]
    return list(dict.fromkeys(out))


def find(relative: str, environ: Mapping[str, str] | None = None) -> str | None:
    """``relative`` (e.g. :data:`OPENB_NODES`; a folder when it ends in ``/``, e.g. ``servegen/m-mid/``)
    under the first root that has it; ``None`` if none does."""
    exists = os.path.isdir if relative.endswith("/") else os.path.isfile
    for root in roots(environ):
        path = os.path.join(root, relative)
        if exists(path):
            return os.path.normpath(path) + ("/" if relative.endswith("/") else "")
    return None


def shown(path: str, environ: Mapping[str, str] | None = None) -> str:
    """``path`` as results record it: ``$VRAMSHARE_TRACES/<relative>`` when under a traces folder, so no
    machine's absolute path lands in a committed result."""
    real = os.path.realpath(path)
    for root in roots(environ):
        base = os.path.realpath(root)
        if real.startswith(base + os.sep):
            return f"${ENV}/{os.path.relpath(real, base)}"
    return path


def not_found(relative: str, environ: Mapping[str, str] | None = None) -> str:
    """The one-line fix when a trace is missing: where it was looked for and how to get it."""
    return (f"trace {relative} not found under {', '.join(roots(environ))}: run 'vramshare traces download' "
            f"(needs the internet) or set {ENV} to the folder holding openb/ and genai/")


@dataclass(frozen=True)
class Source:
    """One file of a traces folder and where it is published (``member``: the file inside a .tar.gz)."""

    path: str  # relative to the traces folder
    url: str
    member: str | None = None  # suffix of the archive member to extract; None: the URL is the file


_CLUSTERDATA = "https://raw.githubusercontent.com/alibaba/clusterdata/master"
_OPENB = f"{_CLUSTERDATA}/cluster-trace-gpu-v2023/csv"
_GENAI = f"{_CLUSTERDATA}/cluster-trace-v2026-GenAI"
_SERVEGEN = "https://codeload.github.com/alibaba/ServeGen/tar.gz/refs/heads/main"
# Alibaba's clusterdata (openb: cluster-trace-gpu-v2023, the FGD paper's trace, USENIX ATC '23; GenAI:
# cluster-trace-v2026-GenAI, published as .tar.gz) and alibaba/ServeGen (Apache-2.0, data/language/).
SOURCES: tuple[Source, ...] = (
    Source(OPENB_NODES, f"{_OPENB}/openb_node_list_gpu_node.csv"),
    *(Source(openb_pods(t), f"{_OPENB}/openb_pod_list_{t}.csv") for t in OPENB_TRACES),
    Source(GENAI_MEMORY, f"{_GENAI}/pod_gpu_memory_used_bytes_anon.tar.gz", member=".csv"),
    Source(GENAI_COLD_STARTS, f"{_GENAI}/basemodel_update_latency_anon.tar.gz", member=".csv"),
    Source("servegen/m-mid/", _SERVEGEN, member="/data/language/m-mid/"),  # a folder: every member under it
    Source("servegen/m-small/", _SERVEGEN, member="/data/language/m-small/"),
    Source("servegen/LICENSE", _SERVEGEN, member="/LICENSE"),
)
