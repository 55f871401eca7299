"""User mistakes end in one line that says the fix and a non-zero exit, never a traceback (issue 22):
flags that do not apply are refused, not ignored; a bad ``--classes`` file is named with its fault;
``--pods`` beyond the demo's shapes is refused, not cut; a closed pipe (``vramshare demo | head``)
ends quietly."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from standins import demo, demo_dra
from vramshare_cli import main as cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _one_line_error(capsys, argv: list[str]) -> str:
    rc = cli.main(argv)
    captured = capsys.readouterr()
    assert rc == 2, f"{argv}: exit {rc}, stderr {captured.err!r}"
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"vramshare {argv[0]}: "), captured.err
    assert "Traceback" not in captured.err
    return lines[0]


@pytest.mark.parametrize("argv, says", [
    (["demo", "--classes", "x.yaml"], "--quota --classes"),
    (["demo", "--quota", "--dra"], "two different demos"),
    (["demo", "--quota", "--pods", "3"], "drop --pods"),
    (["demo", "--pods", "20"], "choose 1 to 8"),
    (["demo", "--pods", "0"], "at least 1"),
    (["demo", "--dra", "--pods", "7"], "choose 1 to 6"),
])
def test_flags_that_do_not_apply_are_refused(capsys, argv, says):
    assert says in _one_line_error(capsys, argv)


def test_the_pod_shapes_the_help_names_are_the_demos():
    assert cli.DEMO_PODS == len(demo.PODS) and len(demo_dra.PODS) < cli.DEMO_PODS


@pytest.mark.parametrize("content, says", [
    (None, "No such file"),
    ("version: v1\nquota: {classes: [{name: x, floorMiB: -4}]}\n", "quota.classes[0].floorMiB: must be >= 0"),
    ("\x00: [", "not valid YAML"),
    ("- a\n- b\n", "expected a mapping"),
])
def test_a_bad_classes_file_is_one_line_with_the_fix(capsys, tmp_path, content, says):
    path = tmp_path / "classes.yaml"
    if content is not None:
        path.write_text(content)
    line = _one_line_error(capsys, ["demo", "--quota", "--classes", str(path)])
    assert says in line and str(path) in line and "deploy/examples/quota-classes" in line


def test_a_closed_pipe_ends_quietly():
    """``vramshare demo | head -1``: the reader goes away; no traceback, no 'Exception ignored'."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.Popen([sys.executable, "-m", "vramshare_cli.main", "demo", "--quota"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.stderr.close()
    rc = proc.wait(timeout=60)
    assert rc != 0 and "Traceback" not in err and "Exception ignored" not in err, err


def test_quota_reasons_are_cut_at_a_word_and_say_their_unit():
    import argparse
    import io
    out = io.StringIO()
    assert demo.run(argparse.Namespace(quota=True, verbose=False, pods=None), out) == 0
    assert "why (largest move, in MiB)" in out.getvalue()
    long = "cut -1024: GPU over-committed, kept 30000 of its use 41000: it asks the most beyond its request " \
           "26624 (whole tenants filled first)"
    short = demo.short_reason(long)
    assert len(short) <= demo.REASON_WIDTH and short.endswith(" ...")
    assert long.startswith(short[:-len(" ...")] + " "), "cut at a word boundary"
    assert demo.short_reason("hold") == "hold"


@pytest.mark.parametrize("content, says", [("a,b\n1,2\n", "missing column 'sn'"), ("sn,gpu\nx,notanumber\n", "not an openb CSV")])
def test_simulate_with_a_file_that_is_no_trace(capsys, tmp_path, content, says):
    bad = tmp_path / "nodes.csv"
    bad.write_text(content)
    line = _one_line_error(capsys, ["simulate", "--nodes", str(bad), "--pods", str(bad), "--policy", "fgd",
                                    "--out", str(tmp_path / "out")])
    assert says in line and "--nodes" in line


def test_inspect_with_a_missing_certificate_file(capsys):
    line = _one_line_error(capsys, ["inspect", "--extender", "https://127.0.0.1:1", "--cacert", "/nonexistent.pem"])
    assert "--cacert" in line and "No such file" in line


def test_simulate_as_scheduler_runs_from_any_folder(capsys, tmp_path, monkeypatch):
    """``--as-scheduler`` without a file takes the shipped profile. On main its default was the relative
    path deploy/daemonset/scheduler-config.yaml, so outside a checkout's root (a pip install, any other
    folder) it ended in 'No such file'."""
    from vramshare import traces
    nodes, pods = (pathlib.Path(traces.find(rel) or pytest.skip("openb trace not here"))
                   for rel in (traces.OPENB_NODES, traces.openb_pods()))
    (tmp_path / "nodes.csv").write_text("".join(nodes.read_text().splitlines(keepends=True)[:30]))
    (tmp_path / "pods.csv").write_text("".join(pods.read_text().splitlines(keepends=True)[:60]))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["simulate", "--nodes", "nodes.csv", "--pods", "pods.csv", "--policy", "fgd",
                     "--as-scheduler", "--out", "out"]) == 0, capsys.readouterr().err
    assert (tmp_path / "out" / "summary.json").exists()
