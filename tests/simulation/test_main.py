"""``vramshare simulate`` end to end on a tiny trace: files written, figures where the contract says."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from extender.simulation.replay import RunResult
from extender.simulation.report import alloc_at, markdown, summarize
from vramshare_cli import main as cli


def test_simulate_writes_summary_table_and_plot(trace: tuple[str, str], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    # 52 tasks of 0.1 GPU on 4 GPUs: exactly 130% of capacity, passing 100% on the way
    pods = tmp_path / "small.csv"
    pods.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n"
                    + "".join(f"t{i},1000,1024,1,100,\n" for i in range(52)))
    out = tmp_path / "out"
    rc = cli.main(["simulate", "--nodes", trace[0], "--pods", str(pods), "--policy", "fgd", "--policy", "bestfit",
                   "--seeds", "2", "--out", str(out)])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    fgd = summary["policies"]["fgd"]
    assert set(fgd) >= {"allocated_pct_at_100", "unallocated_pct_at_130", "per_seed"}
    assert fgd["per_seed"]["allocated_pct_at_100"] == [100.0, 100.0]  # tiny tasks always fit
    assert fgd["unallocated_pct_at_130"] == pytest.approx(0.0)
    assert fgd["allocated_pct_at_100"] == pytest.approx(np.mean(fgd["per_seed"]["allocated_pct_at_100"]), abs=1e-3)
    assert (out / "allocation.png").read_bytes()[:4] == b"\x89PNG"
    captured = capsys.readouterr()
    assert "| fgd |" in captured.out and "| bestfit |" in captured.out
    assert "fgd seed 42" in captured.err  # progress on stderr


def test_simulate_refuses_unknown_policies_and_missing_files(trace: tuple[str, str], tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["simulate", "--nodes", trace[0], "--pods", trace[1], "--policy", "magic"]) == 2
    assert "unknown policy magic" in capsys.readouterr().err
    assert cli.main(["simulate", "--nodes", str(tmp_path / "none.csv"), "--pods", trace[1]]) == 2
    assert "not found" in capsys.readouterr().err


def run(arrived: list[float], allocated: list[float], seed: int = 42) -> RunResult:
    return RunResult("p", seed, np.array(arrived), np.array(allocated), [(0.0, 0.0)])


def test_alloc_at_averages_the_tasks_whose_arrival_rounds_there() -> None:
    r = run([99.2, 99.8, 100.3, 100.6, 129.9], [90.0, 91.0, 92.0, 93.0, 95.0])
    assert alloc_at(r, 100) == pytest.approx(91.5)  # 99.8 and 100.3 round to 100
    assert alloc_at(r, 130) == 95.0
    assert alloc_at(r, 115) != alloc_at(r, 115)  # nan: nothing within +-1


def test_summary_and_table_report_means_over_seeds() -> None:
    summary = summarize({"fgd": [run([100.0, 130.0], [95.0, 96.0]), run([100.0, 130.0], [97.0, 94.0], 43)]})
    assert summary["fgd"]["allocated_pct_at_100"] == 96.0
    assert summary["fgd"]["unallocated_pct_at_130"] == 5.0
    assert summary["fgd"]["per_seed"]["seeds"] == [42, 43]
    assert "| fgd | 96.00 ± 1.00 | 5.00 ± 1.00 |" in markdown(summary, with_paper=False)
