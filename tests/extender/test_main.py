"""``vramshare extender``: the composition root refuses bad input and stops cleanly on SIGTERM."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from extender import main
from standins.apiserver import ApiServerDouble
from tests.extender import builders as b
from vramshare_cli import main as cli


@pytest.mark.parametrize("argv, why", [
    (["extender", "--listen", "nonsense"], "--listen"),
    (["extender", "--config", "/nonexistent/config.yaml"], "cannot read config"),
], ids=["bad-listen", "missing-config"])
def test_refuses_to_start_on_bad_input(argv: list[str], why: str, caplog: pytest.LogCaptureFixture) -> None:
    assert main.run(cli.build_parser().parse_args(argv)) == 2
    assert any(why in str(getattr(r, "fields", {}).get("error", "")) for r in caplog.records)


def test_refuses_to_start_without_an_api(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    assert main.run(cli.build_parser().parse_args(["extender", "--listen", "127.0.0.1:0"])) == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return int(exc.code)
    except OSError:
        return 0


def test_the_command_serves_until_sigterm(tmp_path: Path) -> None:
    with ApiServerDouble() as api:
        api.create_node(b.gpu_node("n1", b.l4()))
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: d\n"
            f"clusters: [{{name: d, cluster: {{server: '{api.url}'}}}}]\n"
            "users: [{name: u, user: {}}]\ncontexts: [{name: d, context: {cluster: d, user: u}}]\n")
        port = _free_port()
        proc = subprocess.Popen([sys.executable, "-m", "vramshare_cli.main", "extender", "--listen", f"127.0.0.1:{port}",
                                 "--kubeconfig", str(kubeconfig), "--policy", "spread"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ})
        try:
            deadline = time.monotonic() + 30
            while _get(f"http://127.0.0.1:{port}/readyz") != 200:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=20)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 0
        log = out.decode()
        assert "extender started" in log and "policy=spread" in log and "extender stopping" in log
