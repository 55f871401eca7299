"""Run every benchmark of the project and write bench/results/SUMMARY.md.

Each ``bench/bench_*.py`` is a standalone script that writes ``bench/results/<name>.json``; this runs
them one after the other (a fresh process each, so one's memory does not skew another's RSS figure),
shows progress, and gathers the headline figures of every JSON under bench/results/ (also those of
benchmarks not run this time, marked so) into one markdown file.

    python bench/run_all.py            # everything (the placement comparison takes the longest)
    python bench/run_all.py --quick    # smaller sizes, for a smoke run
    python bench/run_all.py --only extender --only deviceplugin
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")


def _scripts(only: list[str] | None) -> list[tuple[str, str]]:
    names = sorted(f[len("bench_"):-3] for f in os.listdir(HERE) if f.startswith("bench_") and f.endswith(".py"))
    if only:
        unknown = set(only) - set(names)
        if unknown:
            raise SystemExit(f"unknown benchmark(s): {', '.join(sorted(unknown))}; have: {', '.join(names)}")
        names = [n for n in names if n in only]
    return [(n, os.path.join(HERE, f"bench_{n}.py")) for n in names]


def _flatten(prefix: str, value: Any, out: list[tuple[str, Any]]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    elif isinstance(value, (int, float, str, bool)) or value is None:
        out.append((prefix, value))


def _headline(doc: dict[str, Any]) -> list[tuple[str, Any]]:
    """The figures a reader wants: the JSON's ``summary`` section when it has one, else its scalars."""
    rows: list[tuple[str, Any]] = []
    _flatten("", doc.get("summary", {k: v for k, v in doc.items() if not isinstance(v, list)}), rows)
    return rows


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="pass --quick to every benchmark (smaller runs)")
    ap.add_argument("--only", action="append", metavar="NAME", help="run only this benchmark (repeatable)")
    ap.add_argument("--summary-only", action="store_true",
                    help="run nothing: rebuild SUMMARY.md from the results already in bench/results")
    args = ap.parse_args(argv)
    os.makedirs(RESULTS, exist_ok=True)
    scripts = [] if args.summary_only else _scripts(args.only)
    failed = []
    for i, (name, path) in enumerate(scripts, 1):
        print(f"[{i}/{len(scripts)}] {name} ...", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        rc = subprocess.call([sys.executable, path] + (["--quick"] if args.quick else []))
        print(f"[{i}/{len(scripts)}] {name} {'ok' if rc == 0 else f'FAILED rc={rc}'} "
              f"in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        if rc:
            failed.append(name)
    lines = ["# Benchmark summary", "",
             f"Produced by `python bench/run_all.py{' --quick' if args.quick else ''}` on "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs.", ""]
    ran = {name for name, _ in scripts}
    for name in sorted(f[:-5] for f in os.listdir(RESULTS) if f.endswith(".json")):
        path = os.path.join(RESULTS, f"{name}.json")
        lines += [f"## {name}" + ("" if name in ran else " (from an earlier run)"), ""]
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
        lines += ["| figure | value |", "| --- | --- |"]
        lines += [f"| {k} | {_fmt(v)} |" for k, v in _headline(doc)]
        lines.append("")
    with open(os.path.join(RESULTS, "SUMMARY.md"), "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines))
    print(f"wrote {os.path.join(RESULTS, 'SUMMARY.md')}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
