"""``VRAMSHARE_TRACES`` has one meaning everywhere (the folder holding openb/, genai/, servegen/),
``vramshare traces download`` fills such a folder (tested against a server on 127.0.0.1 only, and
offline), and no file of the repository carries a development machine's absolute path (issue 22)."""
from __future__ import annotations

import io
import pathlib
import re
import socket
import subprocess
import tarfile
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from deviceplugin import simulated_usage
from vramshare import traces
from vramshare_cli import main as cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
# the development machines' roots (written without their leading slash so this line does not match itself)
DEV_ROOTS = ("work\\b", "home/[a-z]", "Users/[A-Za-z]", "root/\\w")
DEV_PATH = re.compile(r"(?<![\w.$])/(?:" + "|".join(DEV_ROOTS) + ")")


def _repo_files() -> list[pathlib.Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / f for f in out if (ROOT / f).is_file()]


def test_no_absolute_development_paths_anywhere():
    found = []
    for path in _repo_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary (a plot)
        for n, line in enumerate(text.splitlines(), 1):
            if DEV_PATH.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert found == [], "\n".join(found)


def test_only_the_traces_module_reads_the_setting():
    readers = [str(p.relative_to(ROOT)) for p in _repo_files() if p.suffix == ".py"
               and "VRAMSHARE_TRACES\"" in p.read_text(encoding="utf-8") and "environ" in p.read_text(encoding="utf-8")]
    assert readers == ["vramshare/traces.py"], readers


def test_tests_use_the_checkouts_shared_traces():
    assert traces.CHECKOUT_TRACES == ROOT.parent / "shared" / "traces"


def _fill(root: pathlib.Path) -> None:
    for rel in (traces.OPENB_NODES, traces.openb_pods(), traces.GENAI_MEMORY):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x\n")


def test_one_meaning_for_simulate_the_quota_replay_and_the_benchmarks(tmp_path, monkeypatch):
    _fill(tmp_path)
    monkeypatch.setenv(traces.ENV, str(tmp_path))
    sim = cli.build_parser().parse_args(["simulate"])
    assert sim.nodes == str(tmp_path / traces.OPENB_NODES) and sim.pods == str(tmp_path / traces.openb_pods())
    assert simulated_usage.find_trace() == str(tmp_path / traces.GENAI_MEMORY)
    assert traces.shown(sim.pods) == "$VRAMSHARE_TRACES/openb/openb_pod_list_default.csv"


def test_a_missing_trace_names_the_folders_and_the_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(traces.ENV, str(tmp_path))
    monkeypatch.setattr(traces, "CHECKOUT_TRACES", tmp_path / "no-checkout")  # a clone without shared/
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert cli.main(["simulate"]) == 2
    err = capsys.readouterr().err
    assert "vramshare traces download" in err and str(tmp_path) in err and len(err.strip().splitlines()) == 1


# -- download, against a server on 127.0.0.1 -------------------------------------------------------
def _targz(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _published() -> dict[str, bytes]:
    """What the publishers serve, by URL path under <mirror>/<host>."""
    files: dict[str, bytes] = {}
    for src in traces.SOURCES:
        parts = urllib.parse.urlsplit(src.url)
        key = f"/{parts.netloc}{parts.path}"
        if src.member is None:
            files[key] = f"{src.path}\n".encode()
        elif "GenAI" in src.url:
            files[key] = _targz({f"{src.path.split('/')[-1][:-4]}_anon.csv": f"{src.path}\n".encode()})
        else:
            files[key] = _targz({"ServeGen-main/LICENSE": b"Apache License 2.0\n",
                                 "ServeGen-main/data/language/m-mid/chunk-1-trace.csv": b"0,1.0\n",
                                 "ServeGen-main/data/language/m-small/chunk-2-trace.csv": b"0,2.0\n",
                                 "ServeGen-main/data/video/x/chunk-1-trace.csv": b"no\n"})
    return files


@pytest.fixture()
def mirror():
    files = _published()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            body = files.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", files
    server.shutdown()
    server.server_close()
    thread.join()


def test_download_fills_a_traces_folder_that_simulate_then_finds(tmp_path, mirror, monkeypatch, capsys):
    url, _files = mirror
    assert cli.main(["traces", "download", "--dest", str(tmp_path), "--mirror", url]) == 0
    assert (tmp_path / traces.OPENB_NODES).read_text() == f"{traces.OPENB_NODES}\n"
    assert (tmp_path / traces.GENAI_MEMORY).read_text() == f"{traces.GENAI_MEMORY}\n"
    assert (tmp_path / "servegen/m-mid/chunk-1-trace.csv").read_text() == "0,1.0\n"
    assert (tmp_path / "servegen/m-small/chunk-2-trace.csv").exists()
    assert (tmp_path / "servegen/LICENSE").read_text().startswith("Apache")
    assert not list(tmp_path.rglob(".part-*")) and not (tmp_path / "servegen/x").exists()
    monkeypatch.setenv(traces.ENV, str(tmp_path))
    assert cli.build_parser().parse_args(["simulate"]).nodes == str(tmp_path / traces.OPENB_NODES)
    capsys.readouterr()
    assert cli.main(["traces", "where"]) == 0
    said = capsys.readouterr().out
    assert f"{traces.GENAI_MEMORY}: {tmp_path / traces.GENAI_MEMORY}" in said
    # every file and folder download writes (on main: only three of them, never ServeGen nor the openb
    # variants README's benchmarks replay), each found where download put it
    for src in traces.SOURCES:
        assert f"{src.path}: {tmp_path / src.path}" in said, said


def test_download_offline_refuses_in_one_line(tmp_path, capsys):
    with socket.socket() as s:  # a port nobody listens on: what "no internet" looks like from here
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = cli.main(["traces", "download", "--dest", str(tmp_path), "--mirror", f"http://127.0.0.1:{port}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "cannot reach 127.0.0.1" in err and "needs the internet" in err
    assert not any(tmp_path.iterdir()), "nothing half-written"


def test_download_of_a_moved_file_names_it(tmp_path, mirror, capsys):
    url, files = mirror
    files.pop(next(k for k in files if k.endswith("openb_pod_list_default.csv")))
    assert cli.main(["traces", "download", "--dest", str(tmp_path), "--mirror", url]) == 2
    err = capsys.readouterr().err
    assert "openb_pod_list_default.csv: HTTP 404" in err and "Traceback" not in err
