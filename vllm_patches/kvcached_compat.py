"""Which kvcached runs with which vLLM, decided in process 0 before any engine process starts.

Pure core, no vLLM or kvcached import. kvcached patches vLLM from an import hook (``import vllm``
with ``KVCACHED_AUTOPATCH=1``) and refuses to build an engine on a vLLM it has no runner adapter
for: kvcached 0.1.6 raises ``KVCachedConfigError: kvcached has no runner adapter for vLLM 0.32.0``
in ``EngineCore.__init__`` (``kvcached/integration/vllm/patches.py``, ``EngineCorePatch``, for
``>=0.29`` outside ``VLLM_MRV2_RANGE = ">=0.29.0,<0.31.0"``), so ``vramshare[kvcached]`` with the
pinned vLLM 0.32 never starts. An engine that cannot release memory is still worth running: on an
unsupported pair the plugin switches kvcached off for the whole process tree (kvcached reads
``ENABLE_KVCACHED`` at every call: ``kvcached.integration.patch_base.enable_kvcached``) and the
engine runs in throttle mode, with the reason on ``vramshare_vllm_release_mode{reason=...}`` and
in the log.

The ranges are kvcached's own: the ``>=0.29`` runner window from its source and the README's
"tested up to" line below it (0.1.6: "vLLM >= v0.17.0 (tested up to v0.30.0)").
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import MutableMapping

ENV_ENABLE = "ENABLE_KVCACHED"
ENV_FALLBACK = "VRAMSHARE_KVCACHED_FALLBACK"  # the reason, handed to the engine processes
ENV_IPC_NAME = "KVCACHED_IPC_NAME"
# The operator vouches for the pair (a kvcached build newer than this table, e.g. its main branch
# with an adapter for this vLLM): skip the check, keep kvcached on.
ENV_ASSUME_SUPPORTED = "VRAMSHARE_KVCACHED_ASSUME_SUPPORTED"


@dataclass(frozen=True)
class VllmRange:
    """``low <= vllm < high`` (release numbers only; ``0.30.0rc1`` counts as 0.30.0)."""

    low: tuple[int, ...]
    high: tuple[int, ...]

    def __str__(self) -> str:
        return f">={_fmt(self.low)},<{_fmt(self.high)}"


# kvcached release -> the vLLM releases it runs (from its source and README at that release).
SUPPORTED: dict[str, VllmRange] = {
    "0.1.6": VllmRange((0, 17, 0), (0, 31, 0)),  # VLLM_MRV2_RANGE upper bound; tested up to 0.30.0
    "0.1.5": VllmRange((0, 8, 4), (0, 25, 0)),  # README: >= v0.8.4, tested up to v0.24.0
}


def _fmt(v: tuple[int, ...]) -> str:
    return ".".join(str(x) for x in v)


def release_tuple(version: str) -> tuple[int, ...]:
    """``"0.32.0+cpu"`` -> ``(0, 32, 0)``; pre/post/local tags are dropped."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version or "")
    if m is None:
        raise ValueError(f"not a version: {version!r}")
    parts = tuple(int(x) for x in m.group(1).split("."))
    return (parts + (0, 0, 0))[:3]


def unsupported_reason(vllm_version: str, kvcached_version: str | None) -> str | None:
    """None when kvcached ``kvcached_version`` runs vLLM ``vllm_version``; else why not (one line)."""
    if kvcached_version is None:
        return "kvcached not installed"
    known = SUPPORTED.get(_fmt(release_tuple(kvcached_version)))
    if known is None:
        return (f"kvcached {kvcached_version} is not a release vramshare knows "
                f"(known: {', '.join(sorted(SUPPORTED))})")
    v = release_tuple(vllm_version)
    if not known.low <= v < known.high:
        return f"kvcached {kvcached_version} supports vLLM {known}, not {vllm_version}"
    return None


def enabled(env: "MutableMapping[str, str] | dict[str, str]") -> bool:
    """kvcached's own switch (read by its patches at every call)."""
    return env.get(ENV_ENABLE, "false").strip().lower() in ("true", "1")


def fall_back_if_unsupported(env: MutableMapping[str, str], vllm_version: str,
                             kvcached_version: str | None) -> str | None:
    """In process 0: switch kvcached off for this process tree when the pair cannot run.

    Returns the reason (also left in ``VRAMSHARE_KVCACHED_FALLBACK`` for the engine processes,
    which inherit the environment), or None when kvcached is off or the pair is supported.
    """
    if env.get(ENV_FALLBACK):
        return env[ENV_FALLBACK]
    if not enabled(env):
        return None
    if env.get(ENV_ASSUME_SUPPORTED, "").strip().lower() in ("1", "true"):
        return None
    reason = unsupported_reason(vllm_version, kvcached_version)
    if reason is not None:
        env[ENV_ENABLE] = "false"
        env[ENV_FALLBACK] = reason
    return reason
