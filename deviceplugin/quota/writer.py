"""The quota file: the one atomic writer every part of the node uses (the document and its codec are the
contract's, :mod:`vramshare.contract.quota_file`).

The container reads ``/var/run/vramshare/quota.json`` (DESIGN.md section 3), a read-only mount of
``<quotaHostDir>/<pod-uid>/<container>/``. The device plugin writes the first version at Allocate and
the quota loop rewrites it; both go through :func:`write_quota` so there is one format and one
generation counter. Why the care:

* a reader must never see a half-written file, so we write a temporary file in the same directory
  and ``os.replace`` it over the old one (atomic on POSIX). No fsync by default: it costs 5-15 ms on
  ext4, on the Allocate path, for durability nobody needs (after a host crash the pod restarts and
  the loop rewrites the file within one interval); ``durable=True`` adds it;
* the generation must only ever grow, even across daemon restarts and between the two writers, so
  the writer takes an exclusive ``flock`` on the directory, reads the generation on disk and writes
  ``max(requested, on_disk + 1)``. A reader can then ignore any file whose generation it has seen.
  The generation is an int64 on every reader's side: it saturates at :data:`GENERATION_MAX` (logged)
  rather than overflow, and a file claiming more (or less than 0) is corrupt;
* the writer runs under a lock on the Allocate path, so nothing it opens may block or lead elsewhere
  (issue 17): ``quota.json`` is opened ``O_NOFOLLOW | O_NONBLOCK`` and read only when ``fstat`` says it
  is a regular file (a FIFO or a link there is treated as corrupt and replaced by the rename, never
  read or written through), and with ``root`` given the directory must resolve inside that root;
* every path component that comes from another process (a pod UID, a container or claim name) passes
  :func:`safe_component` where the path is built: it names one entry of its directory, never ``..``,
  ``/`` or an absolute path, so nothing is created or removed outside the quota root. The DRA side
  (claim UIDs, ``reservedFor`` pod UIDs) uses the same helper.
"""
from __future__ import annotations

import errno
import fcntl
import os
import stat
import tempfile
import threading
import time
from dataclasses import replace

from vramshare import contract, logs
from vramshare.contract import quota_file
from vramshare.contract.quota_file import GENERATION_MAX, GpuQuota, QuotaFile, QuotaFileError

__all__ = ["GENERATION_MAX", "GpuQuota", "QuotaFile", "QuotaFileError", "UnsafePathError", "safe_component",
           "inside", "parse_quota", "quota_path", "container_dir", "read_regular", "read_quota", "write_quota"]

log = logs.get("vramshare.quota.writer")
_LOCAL_LOCK = threading.Lock()  # flock is per open file description; this keeps threads orderly too


MAX_COMPONENT = 253  # a DNS subdomain (object names) is at most 253; a UID is 36; a file name at most 255


class UnsafePathError(QuotaFileError):
    """A path component from another process that would leave its directory; the message says which."""


def safe_component(value: object, what: str) -> str:
    """``value`` when it names exactly one entry of a directory, else :class:`UnsafePathError`.

    For every pod UID, container name, claim UID or name joined under the quota root: refuses the
    empty string, ``.``, ``..`` and any other name starting with a dot (hidden entries are the writer's
    temporary files), anything with ``/`` or a NUL (so no absolute path and no climbing), anything not a
    string, and anything longer than :data:`MAX_COMPONENT` characters."""
    if not isinstance(value, str):
        raise UnsafePathError(f"{what} {value!r} is not a string")
    if value in ("", ".", "..") or value.startswith("."):
        raise UnsafePathError(f"{what} {value!r} does not name a directory entry (empty, or starts with a dot)")
    if "/" in value or "\0" in value or (os.sep != "/" and os.sep in value):
        raise UnsafePathError(f"{what} {value!r} contains a path separator or NUL")
    if len(value) > MAX_COMPONENT:
        raise UnsafePathError(f"{what} is {len(value)} characters long (at most {MAX_COMPONENT})")
    return value


def inside(root: str, path: str, *, follow_last: bool = True) -> bool:
    """Whether ``path`` lies strictly below ``root`` with every directory on the way resolved.

    ``follow_last`` (for writing into ``path``): the last component is resolved too, so a planted link
    pointing elsewhere is outside. Without it (for removing ``path``): a link inside the root is inside,
    since removing it removes the link, not its target."""
    norm = os.path.normpath(path)
    real = os.path.realpath(norm) if follow_last else \
        os.path.join(os.path.realpath(os.path.dirname(norm)), os.path.basename(norm))
    return real.startswith(os.path.realpath(root) + os.sep)


#: the document and its one codec live in the contract (:mod:`vramshare.contract.quota_file`)
parse_quota = quota_file.parse


def quota_path(directory: str | os.PathLike[str]) -> str:
    return os.path.join(os.fspath(directory), contract.QUOTA_FILE_NAME)


def container_dir(host_root: str, pod_uid: str, container: str) -> str:
    """``<quotaHostDir>/<pod-uid>/<container>``: the directory mounted at /var/run/vramshare.

    Raises :class:`UnsafePathError` when the UID or the name would leave ``host_root``."""
    return os.path.join(host_root, safe_component(pod_uid, "pod UID"), safe_component(container, "container name"))


MAX_QUOTA_BYTES = quota_file.MAX_BYTES


def read_regular(path: str, dir_fd: int | None = None) -> str | None:
    """The text of ``path`` when it is a regular file; ``None`` when absent. Never blocks (a FIFO),
    never follows a link; anything but a regular file raises :class:`QuotaFileError`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise QuotaFileError(f"{path} is a symbolic link, not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise QuotaFileError(f"{path} is not a regular file (mode {stat.filemode(st.st_mode)})")
        if st.st_size > MAX_QUOTA_BYTES:
            raise QuotaFileError(f"{path} is {st.st_size} bytes (at most {MAX_QUOTA_BYTES})")
        return os.read(fd, MAX_QUOTA_BYTES + 1).decode("utf-8", errors="replace")
    finally:
        os.close(fd)


def read_quota(directory: str | os.PathLike[str]) -> QuotaFile | None:
    """The quota file in ``directory``; ``None`` when there is none. Raises :class:`QuotaFileError`
    (also for a FIFO, device or link in its place: it is never opened blocking nor followed)."""
    text = read_regular(quota_path(directory))
    return None if text is None else parse_quota(text)


def _generation_on_disk(dir_fd: int, directory: str) -> int:
    try:
        text = read_regular(contract.QUOTA_FILE_NAME, dir_fd=dir_fd)
        current = None if text is None else parse_quota(text)
    except QuotaFileError as exc:
        # A corrupt file cannot hold us back; the new one replaces it with a fresh generation.
        log.warning("quota file unreadable, replacing it", dir=directory, error=str(exc))
        return 0
    return current.generation if current else 0


def write_quota(directory: str | os.PathLike[str], quota: QuotaFile, *, durable: bool = False,
                root: str | None = None) -> QuotaFile:
    """Atomically write ``quota`` as ``<directory>/quota.json`` and return what was written.

    The generation written is ``max(quota.generation, generation on disk + 1)``, so it grows by at
    least one with every write whoever writes; an empty ``updated`` becomes the current UTC time.
    The directory is created (0755) when missing; the file is 0644 so a non-root container can read
    it. Raises :class:`QuotaFileError` (a ``ValueError``) for a document the contract refuses, e.g. no
    GPU or a GPU entry without floor <= limit <= ceiling (the vLLM plugin refuses such a file, so it must
    never reach the disk), and ``OSError`` when the directory cannot
    be written (the caller logs and keeps its state). With ``root``, a directory that resolves
    outside it (a planted link) raises :class:`UnsafePathError` before anything is created.
    """
    quota_file.encode(replace(quota, generation=0))  # refused before any I/O; the generation is clamped below
    d = os.fspath(directory)
    if root is not None and not inside(root, d):
        raise UnsafePathError(f"{d} resolves to {os.path.realpath(d)}, outside the quota root {root}")
    os.makedirs(d, mode=0o755, exist_ok=True)
    with _LOCAL_LOCK:
        dir_fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX)
            generation = max(quota.generation, _generation_on_disk(dir_fd, d) + 1)
            if generation > GENERATION_MAX:
                log.error("quota generation exhausted, kept at the int64 maximum", dir=d, generation=GENERATION_MAX)
                generation = GENERATION_MAX
            final = replace(quota, generation=generation,
                            updated=quota.updated or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            data = quota_file.encode(final).encode()
            fd, tmp = tempfile.mkstemp(prefix=".quota.", suffix=".tmp", dir=d)
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
                    if durable:
                        fh.flush()
                        os.fsync(fh.fileno())
                os.chmod(tmp, 0o644)
                os.replace(tmp, quota_path(d))
            except BaseException:
                _unlink_quietly(tmp)
                raise
            if durable:
                os.fsync(dir_fd)  # make the rename itself durable
        finally:
            os.close(dir_fd)  # also releases the flock
    return final


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
