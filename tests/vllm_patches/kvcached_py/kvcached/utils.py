# SPDX-FileCopyrightText: Copyright contributors to the kvcached project
# SPDX-License-Identifier: Apache-2.0

import importlib.util
import logging
import os
import threading
import uuid
from typing import BinaryIO, Optional


class KVCachedConfigError(RuntimeError):
    """Raised for kvcached misconfiguration the user must fix (e.g. a KV block
    larger than the page size). Integration patches re-raise this loudly to
    abort startup instead of silently falling back to non-kvcached behavior."""


class KVCachePoolExhausted(ValueError):
    """Raised when the shared physical KV pool cannot back an allocation.

    This is a transient condition, not a defect: colocated engines share one
    physical pool, so a peer can take the last pages between the moment
    availability is observed and the moment the pages are claimed. Serving
    engines already know how to respond -- free something and try again -- so
    integrations translate this into whatever "cannot allocate right now"
    signal their engine understands, rather than letting it terminate the
    process.

    It subclasses ValueError so callers written against the pre-existing
    behavior keep working.
    """


def _sanitize_segment(segment: str) -> str:
    """Sanitize a segment to safe characters for SHM names."""
    allowed = []
    for ch in segment:
        if ch.isalnum() or ch in ("_", "-"):
            allowed.append(ch)
        else:
            allowed.append("-")
    # Collapse to at most 64 chars to keep names short
    return "".join(allowed)[:64]


def _detect_engine_tag() -> str:
    """Best-effort detection of the hosting engine for naming.
    """
    if importlib.util.find_spec("vllm") is not None:
        return "vLLM"
    if importlib.util.find_spec("sglang") is not None:
        return "SGLang"
    return "proc"


def _ipc_segment_exists(name: str) -> bool:
    """Return True if a shared-memory segment/file with this name exists.
    """
    try:
        return os.path.exists(os.path.join(SHM_DIR, name))
    except Exception:
        return False


def _obtain_default_ipc_name() -> str:
    """Return a default IPC name like kvcached_<Engine>_<PGID>.

    Precedence:
    1) KVCACHED_IPC_NAME: explicit full name
    2) Otherwise, derive from engine tag and process group id (PGID).
    Using PGID ensures all processes within the same instance share a
    single segment, while separate launches get distinct names.
    """

    explicit = os.getenv("KVCACHED_IPC_NAME")
    if explicit:
        # An explicit IPC name is a contract between all processes in one
        # serving instance.  Treat it as exact after SHM-safe sanitization: do
        # not probe or auto-suffix it, because late-importing TP workers must
        # still join the same namespace.
        return _sanitize_segment(explicit)

    engine_tag = _detect_engine_tag()
    try:
        group_id = os.getpgid(0)
    except Exception:
        try:
            group_id = os.getsid(0)
        except Exception:
            group_id = os.getpid()

    # No explicit override: start from conventional base and ensure uniqueness
    base = "kvcached"
    name = f"{base}_{engine_tag}_{group_id}"
    if not _ipc_segment_exists(name):
        return name
    for i in range(1, 100):
        candidate = f"{name}_{i}"
        if not _ipc_segment_exists(candidate):
            return candidate
    return f"{name}_{os.getpid()}"


def _get_page_size() -> int:
    """Get PAGE_SIZE from environment variable with validation.

    Returns:
        PAGE_SIZE in bytes, must be a multiple of 2MB (2097152 bytes)

    Raises:
        ValueError: If PAGE_SIZE is not a multiple of 2MB
    """
    default_page_size = 2 * 1024 * 1024  # 2MB
    page_size_mb_str = os.getenv("KVCACHED_PAGE_SIZE_MB")

    if page_size_mb_str is None:
        return default_page_size

    try:
        page_size = int(page_size_mb_str) * 1024 * 1024
    except ValueError:
        raise ValueError(
            f"Invalid KVCACHED_PAGE_SIZE_MB: {page_size_mb_str}. Must be an integer."
        )

    # Validate that PAGE_SIZE is a multiple of 2MB
    base_size = 2 * 1024 * 1024  # 2MB
    if page_size <= 0 or page_size % base_size != 0:
        raise ValueError(
            f"PAGE_SIZE must be a positive multiple of 2MB (2097152 bytes), "
            f"got: {page_size}")

    return page_size


PAGE_SIZE = _get_page_size()

# Configuration constants for KVCacheManager
GPU_UTILIZATION = float(os.getenv("KVCACHED_GPU_UTILIZATION", "0.95"))
PAGE_PREALLOC_ENABLED = os.getenv("KVCACHED_PAGE_PREALLOC_ENABLED",
                                  "true").lower() == "true"
MIN_RESERVED_PAGES = int(os.getenv("KVCACHED_MIN_RESERVED_PAGES", "5"))
MAX_RESERVED_PAGES = int(os.getenv("KVCACHED_MAX_RESERVED_PAGES", "10"))
MAX_CACHED_BLOCKS = int(os.getenv("KVCACHED_MAX_CACHED_BLOCKS", "1000"))
SANITY_CHECK = os.getenv("KVCACHED_SANITY_CHECK", "false").lower() == "true"
# Maximum number of tokens the cache may hold as evictable (cached) entries.
# Semantics:
#   < 0  → unlimited (closest to vanilla vLLM/SGLang prefix-cache behavior;
#          gives up memory elasticity)
#   == 0 → disabled (cached prefixes are evicted as soon as they become
#          evictable, effectively turning off prefix-cache reuse)
#   > 0  → proactively evict after each finished request to stay within
#          this many cached tokens
# Used by both SGLang (RadixCacheLimitPatch) and vLLM (ElasticBlockPool),
# which converts to blocks internally via MAX_CACHED_TOKENS // block_size.
MAX_CACHED_TOKENS = int(os.getenv("KVCACHED_MAX_CACHED_TOKENS", "16000"))


def _default_contiguous_layout() -> bool:
    """Default KV-cache layout: contiguous on CUDA, non-contiguous on HIP/ROCm.

    An explicit ``KVCACHED_CONTIGUOUS_LAYOUT`` always wins. Otherwise we pick
    non-contiguous on ROCm: the contiguous (compound-page) layout hands the
    attention backend strided/interleaved per-layer KV tensors, which vLLM's
    ROCm attention path (``split_kv_cache`` + paged kernels) reads incorrectly,
    whereas CUDA's FlashAttention/FlashInfer tolerate it.
    """
    explicit = os.getenv("KVCACHED_CONTIGUOUS_LAYOUT")
    if explicit is not None:
        return explicit.lower() == "true"
    try:
        import torch
        if getattr(torch.version, "hip", None):
            return False  # ROCm/HIP: non-contiguous is required for correctness
    except Exception:
        pass
    return True


CONTIGUOUS_LAYOUT = _default_contiguous_layout()

DEFAULT_IPC_NAME = _obtain_default_ipc_name()
SHM_DIR = "/dev/shm"

# Root of the per-instance TP worker socket directories (kvcached.tp_ipc_util).
# The naming rule lives here, next to the IPC name, so tools that never load
# the compiled extension (kvctl) can derive the directory from an IPC name.
TP_SOCKET_DIR_ROOT = "/tmp"


def get_tp_socket_dir(ipc_name: Optional[str] = None) -> str:
    """Return the TP worker socket directory for *ipc_name* (default: this
    instance's DEFAULT_IPC_NAME).

    The directory keeps the IPC name readable and appends a short
    deterministic hash, so every worker of one engine instance agrees on it.
    Unix domain socket paths are limited to 108 characters on Linux; the
    caller validates the final socket path length.
    """
    name = DEFAULT_IPC_NAME if ipc_name is None else ipc_name
    suffix = uuid.uuid5(uuid.NAMESPACE_DNS, name).hex[:8]
    return os.path.join(TP_SOCKET_DIR_ROOT, f"kvcached-tp-{name}-{suffix}")


class IPCSegmentCleanup:
    """Remember one segment across teardown and retry only its failed unlink.

    Capture before stopping the engine: it may remove its own segment during
    shutdown. The open file pins the inode, so a later file at the same path
    cannot inherit its identity. No contents are read or modified. This is
    a replacement check, not a lock against concurrent instance startup.
    """

    def __init__(self, segment: str) -> None:
        self.segment = segment
        self._lock = threading.Lock()
        self._file: Optional[BinaryIO]
        try:
            self._file = open(segment, "rb")
        except FileNotFoundError:
            self._file = None

    def unlink(self) -> bool:
        """Return True when done; keep the original file open on failure."""
        with self._lock:
            return self._unlink()

    def _unlink(self) -> bool:
        if self._file is None:
            return True
        try:
            current = os.stat(self.segment)
            original = os.fstat(self._file.fileno())
            if os.path.samestat(current, original):
                os.unlink(self.segment)
                get_kvcached_logger().info(
                    "Unlinked KV cache limit segment %s", self.segment)
        except FileNotFoundError:
            pass
        except OSError as e:
            get_kvcached_logger().warning(
                "Failed to unlink %s on shutdown: %s", self.segment, e)
            return False
        self._file.close()
        self._file = None
        return True

    def close(self) -> None:
        """Discard an unconfirmed identity without deleting anything."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

LOG_USE_COLOR = os.getenv("KVCACHED_LOG_COLOR", "true").lower() == "true"
_UNIFORM_COLOR = os.getenv("KVCACHED_LOG_COLOR_CODE", "\033[36m")

_LEVEL_TO_COLOR = {
    logging.DEBUG: "\033[36m",  # Cyan
    logging.INFO: "\033[32m",  # Green
    logging.WARNING: "\033[33m",  # Yellow
    logging.ERROR: "\033[31m",  # Red
    logging.CRITICAL: "\033[35m",  # Magenta
}
_COLOR_RESET = "\033[0m"


def normalize_gpu_device(device: str) -> str:
    """Map a ``hip[:N]`` device string to ``cuda[:N]``.

    PyTorch-ROCm and the C++ extension (``c10::Device``) address AMD GPUs as
    ``cuda``; kvcached's integration accepts ``hip`` strings, so normalize them
    before handing the device to any ``torch.cuda`` API or ``create_kv_tensors``.
    """
    dev = str(device)
    if dev.lower().startswith("hip"):
        return "cuda" + dev[3:]
    return dev


def align_to(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def align_up_to_page(n_cells: int, cell_size: int) -> int:
    n_cells_per_page = PAGE_SIZE // cell_size
    aligned_n_cells = align_to(n_cells, n_cells_per_page)
    return aligned_n_cells


class ColorFormatter(logging.Formatter):
    """A logging formatter that injects ANSI colors based on the log level."""

    def format(self, record: logging.LogRecord) -> str:
        formatted = super().format(record)

        color = _LEVEL_TO_COLOR.get(record.levelno, _UNIFORM_COLOR)

        prefix, sep, rest = formatted.partition("] ")

        if sep:
            prompt = f"{prefix}{sep}"
            return f"{color}{prompt}{_COLOR_RESET}{rest}"
        else:
            return f"{color}{formatted}{_COLOR_RESET}"


def get_log_level():
    level = os.getenv("KVCACHED_LOG_LEVEL", "INFO").upper()
    return getattr(logging, level, logging.INFO)


def get_kvcached_logger(name: str = "kvcached") -> logging.Logger:
    logger = logging.getLogger(name)

    # Only add handler if none exists (prevents duplicate handlers)
    if not logger.handlers:
        handler = logging.StreamHandler()

        fmt_str = (f"[{name}]"
                   "[%(levelname)s]"
                   "[%(asctime)s]"
                   "[%(filename)s:%(lineno)d] %(message)s")

        if LOG_USE_COLOR and handler.stream.isatty():
            formatter: logging.Formatter = ColorFormatter(
                fmt_str, datefmt="%Y-%m-%d %H:%M:%S")
        else:
            formatter = logging.Formatter(fmt_str, datefmt="%Y-%m-%d %H:%M:%S")

        handler.setFormatter(formatter)
        logger.addHandler(handler)
        logger.setLevel(get_log_level())
        # Prevent propagation to inference engines; avoid duplicate messages
        logger.propagate = False

    return logger
