"""``vramshare traces download``: fetch the public traces into a traces folder (:mod:`vramshare.traces`).

For users with the internet; offline it says so in one line and writes nothing half-done (each file
goes to a temporary name and is renamed when complete). ``--mirror URL`` fetches
``URL/<host>/<path>`` instead of ``https://<host>/<path>`` (an internal mirror, or a test's server).
"""
from __future__ import annotations

import argparse
import io
import os
import sys
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from typing import Callable, TextIO

from vramshare import traces
from vramshare.errors import UsageError

Fetch = Callable[[str], bytes]
TIMEOUT_S = 60.0


def mirrored(url: str, mirror: str | None) -> str:
    """``url`` as served by ``mirror`` (``<mirror>/<host>/<path>``), or unchanged."""
    if not mirror:
        return url
    parts = urllib.parse.urlsplit(url)
    return f"{mirror.rstrip('/')}/{parts.netloc}{parts.path}"


def http_fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as resp:  # noqa: S310 - https or the user's mirror
        return resp.read()


def _write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".part-")
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def _members(archive: bytes, member: str, folder: bool) -> list[tuple[str, bytes]]:
    """(name below ``member``, bytes) of the archive's regular files whose path ends with (or, for a
    folder, contains) ``member``."""
    out = []
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        for info in tar.getmembers():
            name = "/" + info.name.lstrip("./")
            if not info.isfile():
                continue
            if folder and member in name:
                rest = name.split(member, 1)[1]
                if rest and ".." not in rest.split("/"):
                    out.append((rest, tar.extractfile(info).read()))  # type: ignore[union-attr]
            elif not folder and name.endswith(member) and "/._" not in name:
                out.append((os.path.basename(name), tar.extractfile(info).read()))  # type: ignore[union-attr]
    return out


def download(dest: str, fetch: Fetch, mirror: str | None = None, out: TextIO = sys.stdout,
             sources: tuple[traces.Source, ...] = traces.SOURCES) -> int:
    """Fetch every source into ``dest``; returns the number of files written. A source that cannot be
    fetched or is not what it should be raises :class:`UsageError` naming it."""
    cache: dict[str, bytes] = {}
    written = 0
    for src in sources:
        url = mirrored(src.url, mirror)
        if url not in cache:
            try:
                cache[url] = fetch(url)
            except urllib.error.HTTPError as exc:
                raise UsageError(f"{url}: HTTP {exc.code} {exc.reason}; the publisher may have moved it "
                                 f"(see README, 'Traces'), or pass --mirror") from None
            except (urllib.error.URLError, OSError) as exc:
                why = getattr(exc, "reason", exc)
                raise UsageError(f"cannot reach {urllib.parse.urlsplit(url).netloc} ({why}): this command needs "
                                 f"the internet; download elsewhere and copy the folder, then set "
                                 f"{traces.ENV}") from None
        data = cache[url]
        target = os.path.join(dest, src.path)
        if src.member is None:
            files = [("", data)]
        else:
            try:
                files = _members(data, src.member, folder=src.path.endswith("/"))
            except (tarfile.TarError, OSError, EOFError) as exc:
                raise UsageError(f"{url}: not a .tar.gz archive ({exc}); a Git LFS pointer or an error page "
                                 "came back: download it by hand (README, 'Traces')") from None
            if not files or (not src.path.endswith("/") and len(files) != 1):
                raise UsageError(f"{url}: expected {'files under' if src.path.endswith('/') else 'one file'} "
                                 f"*{src.member} in the archive, found {len(files)}")
        for rest, body in files:
            path = os.path.join(target, rest) if src.path.endswith("/") else target
            _write(path, body)
            written += 1
        print(f"  {src.path:<45} {sum(len(b) for _, b in files) / 2**20:8.1f} MiB  from {url}", file=out)
    return written


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    if args.action == "where":
        for rel in dict.fromkeys(src.path for src in traces.SOURCES):  # every file download writes
            print(f"{rel}: {traces.find(rel) or 'missing'}", file=out)
        print(f"searched: {', '.join(traces.roots())}", file=out)
        return 0
    dest = args.dest or traces.download_dir()
    print(f"Downloading the public traces into {dest} (set {traces.ENV}={dest} if that is not a default "
          f"folder):", file=out)
    n = download(dest, http_fetch, args.mirror, out)
    print(f"{n} files written; 'vramshare simulate' and the benchmarks now find them.", file=out)
    return 0
