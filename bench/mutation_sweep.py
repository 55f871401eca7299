"""Mutation sweep: which rules of a module could change without any test noticing.

"A test that cannot fail is a defect" has a dual: a rule no test can fail is unpinned. This makes one
small change at a time (a mutant) in a module of the committed tree, runs the tests that should catch
it, and lists the mutants every test survived. Each survivor is either equivalent (the code means the
same either way), redundant (another rule already decides), or a rule no test states yet: the last two
are work. Round 18's throwaway sweep of the quota policy found seven of the third kind.

Mutants, one per site, found in the syntax tree (docstrings, log calls and strings are left alone):
a comparison flipped at its boundary (``<`` and ``<=``, ``>`` and ``>=``, ``==`` and ``!=``), ``and``
and ``or`` swapped, a ``not`` dropped, ``+`` and ``-`` swapped, ``min`` and ``max`` swapped, an integer
constant moved by one, an ``if`` body's condition forced false (``if False and (...)``).

Every mutant runs in a clone of the committed tree (``git clone --shared``, the checkout's ``.venv``
linked in), never in the working tree, so an interrupted sweep leaves nothing behind; ``--jobs`` clones
run side by side. A mutant is killed when the tests fail or run past ``--timeout`` (a loop that no
longer ends). The unmutated tree must pass first. Writes ``bench/results/mutation-<name>.json``: every
mutant, and per module the survivors with their line, what changed and the code.

    python bench/mutation_sweep.py --preset quota-headroom            # a preset: module + tests
    python bench/mutation_sweep.py --module deviceplugin/quota/fence.py --lines 100-200 \\
        --tests tests/quota/test_driver_mode.py tests/quota/test_driver_fence_soundness.py --name fence
    python bench/mutation_sweep.py --preset quota-policy --list       # the mutants only, no tests run
    python bench/mutation_sweep.py --preset quota-fence --recheck     # only the stored survivors, after new tests

About 10-40 s per mutant on a 2-core machine with the presets' test sets.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "bench", "results")

QUOTA_TESTS = ["tests/quota", "tests/dra/test_claim_soundness.py"]
EXTENDER_CORE_TESTS = [f"tests/extender/test_{name}.py" for name in (
    "cluster", "cluster_memo", "placement", "policies", "soundness", "verbs", "filter_caches", "incremental",
    "host_parity")] + ["tests/coldstart/test_residency.py", "tests/coldstart/test_residency_extender.py"]
#: name -> (module, tests). The test sets are the ones that own the module's rules.
PRESETS: dict[str, tuple[str, list[str]]] = {
    "quota-policy": ("deviceplugin/quota/policy.py", QUOTA_TESTS),
    "quota-headroom": ("deviceplugin/quota/headroom.py", QUOTA_TESTS),
    "quota-learned": ("deviceplugin/quota/learned.py", QUOTA_TESTS),
    "quota-fence": ("deviceplugin/quota/fence.py", QUOTA_TESTS + ["tests/dra/test_enforcement_dra.py"]),
    "quota-loop": ("deviceplugin/quota/loop.py", QUOTA_TESTS),
    "foreign": ("vramshare/foreign.py", ["tests/test_foreign.py", "tests/quota/test_foreign_settled.py",
                                         "tests/extender/test_foreign_booked.py", "tests/deviceplugin/test_departures.py",
                                         "tests/dra/test_forced_deletion.py", "tests/dra/test_slice_foreign.py"]),
    "quota-classes": ("deviceplugin/quota/classes.py", QUOTA_TESTS + ["tests/coldstart/test_overcommit.py",
                                                                      "tests/coldstart/test_warm_tier.py"]),
    "quota-warm": ("deviceplugin/quota/warm.py", ["tests/coldstart", "tests/quota/test_warmth.py"]),
    "extender-fit": ("extender/fit.py", EXTENDER_CORE_TESTS),
    "extender-placement": ("extender/placement.py", EXTENDER_CORE_TESTS),
}

COMPARE_FLIP = {ast.Lt: "<=", ast.LtE: "<", ast.Gt: ">=", ast.GtE: ">", ast.Eq: "!=", ast.NotEq: "=="}
COMPARE_TEXT = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}


@dataclass(frozen=True)
class Mutant:
    """One textual change: ``line`` (1-based), columns ``[col, end)`` of that line become ``new``."""

    line: int
    col: int
    end: int
    old: str
    new: str
    what: str

    def apply(self, lines: list[str]) -> list[str]:
        text = lines[self.line - 1]
        assert text[self.col:self.end] == self.old, (self, text)
        return lines[:self.line - 1] + [text[:self.col] + self.new + text[self.end:]] + lines[self.line:]


def _quiet_nodes(tree: ast.AST) -> set[int]:
    """ids of nodes inside docstrings, log calls and strings: changing them changes no rule."""
    quiet: set[int] = set()
    for node in ast.walk(tree):
        inside = None
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            inside = node
        elif isinstance(node, ast.JoinedStr):
            inside = node
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and isinstance(node.func.value, ast.Name) and node.func.value.id in ("log", "logger", "logging")):
            inside = node
        elif isinstance(node, ast.Raise):
            inside = node
        if inside is not None:
            quiet.update(id(n) for n in ast.walk(inside))
    return quiet


def _token_between(lines: list[str], a: ast.AST, b: ast.AST, token: str) -> tuple[int, int] | None:
    """(line, col) of ``token`` between the end of ``a`` and the start of ``b``, when both sit on one line."""
    if a.end_lineno != b.lineno:  # type: ignore[attr-defined]
        return None
    text = lines[b.lineno - 1]  # type: ignore[attr-defined]
    at = text.find(f" {token} ", a.end_col_offset, b.col_offset)  # type: ignore[attr-defined]
    return None if at < 0 else (b.lineno, at + 1)  # type: ignore[attr-defined]


def mutants_of(source: str, lo: int = 1, hi: int = 10 ** 9) -> Iterator[Mutant]:
    """Every mutant of ``source`` on lines ``lo..hi``, in line order."""
    lines = source.splitlines(keepends=True)
    tree = ast.parse(source)
    quiet = _quiet_nodes(tree)
    found: list[Mutant] = []
    for node in ast.walk(tree):
        if id(node) in quiet or not lo <= getattr(node, "lineno", 0) <= hi:
            continue
        if isinstance(node, ast.Compare):
            left = node.left
            for op, right in zip(node.ops, node.comparators):
                if type(op) in COMPARE_FLIP:
                    tok = COMPARE_TEXT[type(op)]
                    at = _token_between(lines, left, right, tok)
                    if at:
                        found.append(Mutant(at[0], at[1], at[1] + len(tok), tok, COMPARE_FLIP[type(op)],
                                            f"{tok} -> {COMPARE_FLIP[type(op)]}"))
                left = right
        elif isinstance(node, ast.BoolOp):
            tok, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
            at = _token_between(lines, node.values[0], node.values[1], tok)
            if at:
                found.append(Mutant(at[0], at[1], at[1] + len(tok), tok, new, f"{tok} -> {new}"))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            text = lines[node.lineno - 1]
            if text[node.col_offset:node.col_offset + 4] == "not ":
                found.append(Mutant(node.lineno, node.col_offset, node.col_offset + 4, "not ", "", "not dropped"))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
            tok, new = ("+", "-") if isinstance(node.op, ast.Add) else ("-", "+")
            if not (isinstance(node.left, ast.Constant) and isinstance(node.left.value, str)):
                at = _token_between(lines, node.left, node.right, tok)
                if at:
                    found.append(Mutant(at[0], at[1], at[1] + 1, tok, new, f"{tok} -> {new}"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("min", "max")
              and node.func.end_lineno == node.func.lineno):
            new = "max" if node.func.id == "min" else "min"
            found.append(Mutant(node.func.lineno, node.func.col_offset, node.func.end_col_offset,
                                node.func.id, new, f"{node.func.id} -> {new}"))
        elif (isinstance(node, ast.Constant) and type(node.value) is int and node.end_lineno == node.lineno):
            old = lines[node.lineno - 1][node.col_offset:node.end_col_offset]
            if old.isdigit():
                new = str(node.value + 1) if node.value in (0, 1) else str(node.value - 1)
                found.append(Mutant(node.lineno, node.col_offset, node.end_col_offset, old, new, f"{old} -> {new}"))
        elif isinstance(node, ast.If) and node.test.lineno == node.lineno and not isinstance(node.test, ast.Constant):
            test = node.test
            end = test.end_col_offset if test.end_lineno == test.lineno else None
            if end is not None:
                old = lines[test.lineno - 1][test.col_offset:end]
                found.append(Mutant(test.lineno, test.col_offset, end, old, f"False and ({old})", "if never taken"))
    yield from sorted(set(found), key=lambda m: (m.line, m.col, m.what))


@dataclass
class Outcome:
    module: str
    line: int
    col: int
    what: str
    code: str
    killed: bool
    how: str  # "tests failed", "timeout", "survived"
    seconds: float


def _clone(into: str, commit: str) -> str:
    """A clone of ``commit`` with the checkout's virtual environment linked in."""
    subprocess.run(["git", "clone", "-q", "--shared", ROOT, into], check=True)
    subprocess.run(["git", "-C", into, "checkout", "-q", "--detach", commit], check=True)
    os.symlink(os.path.join(ROOT, ".venv"), os.path.join(into, ".venv"))
    return into


def _run_tests(tree: str, tests: list[str], timeout: float) -> tuple[bool, str]:
    """(passed, how) for the test set in ``tree``; a run past ``timeout`` counts as failed."""
    cmd = [os.path.join(tree, ".venv", "bin", "python"), "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
           *tests]
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    try:
        r = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return False, "timeout"
    finally:  # hypothesis replays the examples it stored: one mutant's failures must not decide the next's
        shutil.rmtree(os.path.join(tree, ".hypothesis"), ignore_errors=True)
    if r.returncode == 5:
        raise SystemExit(f"no tests collected for {tests}")
    return r.returncode == 0, "survived" if r.returncode == 0 else "tests failed"


def sweep(module: str, mutants: list[Mutant], tests: list[str], jobs: int, timeout: float,
          commit: str = "HEAD") -> list[Outcome]:
    """Run every mutant of ``module`` as ``commit`` has it against ``tests``, ``jobs`` clones at a time,
    showing progress."""
    with tempfile.TemporaryDirectory(prefix="vramshare-mutants-") as tmp:
        trees = [_clone(os.path.join(tmp, f"tree{i}"), commit) for i in range(max(1, jobs))]
        passed, how = _run_tests(trees[0], tests, timeout * 3)
        if not passed:
            raise SystemExit(f"the unmutated tree does not pass {tests} ({how}): fix that first")
        free = list(trees)
        with open(os.path.join(trees[0], module), encoding="utf-8") as fh:  # the committed text
            original = fh.read()
        lines = original.splitlines(keepends=True)
        outcomes: list[Outcome] = []

        def one(m: Mutant) -> Outcome:
            tree = free.pop()
            path = os.path.join(tree, module)
            try:
                with open(path, "w", encoding="utf-8") as fh:
                    fh.write("".join(m.apply(lines)))
                t0 = time.monotonic()
                ok, how = _run_tests(tree, tests, timeout)
                return Outcome(module, m.line, m.col, m.what, lines[m.line - 1].strip()[:140], not ok, how,
                               round(time.monotonic() - t0, 1))
            finally:
                with open(path, "w", encoding="utf-8") as fh:
                    fh.write(original)
                free.append(tree)

        with ThreadPoolExecutor(max_workers=len(trees)) as pool:
            for i, o in enumerate(pool.map(one, mutants), 1):
                outcomes.append(o)
                mark = "killed" if o.killed else "SURVIVED"
                print(f"[{i}/{len(mutants)}] {module}:{o.line} {o.what:<18} {mark:<8} {o.seconds:5.1f}s  "
                      f"{o.code[:70]}", flush=True)
        shutil.rmtree(tmp, ignore_errors=True)
    return outcomes


def _placed(stored: list[dict], mutants: list[Mutant]) -> list[dict]:
    """Stored outcomes with their column (results written before outcomes kept one: the mutants of a line
    with the same change, in the order the sweep ran them)."""
    placed = {(o["line"], o.get("col"), o["what"]) for o in stored}
    cols: dict[tuple[int, str], list[int]] = {}
    for m in mutants:
        if (m.line, m.col, m.what) not in placed:
            cols.setdefault((m.line, m.what), []).append(m.col)
    out = []
    for o in stored:
        if o.get("col") is None or o["col"] < 0:
            free = cols.get((o["line"], o["what"]), [])
            o = {**o, "col": free.pop(0) if free else -1}
        out.append(o)
    return out


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), help="a module with the tests that own its rules")
    ap.add_argument("--module", help="a module's path in the repository (instead of --preset)")
    ap.add_argument("--tests", nargs="+", help="pytest paths the mutants run against (with --module)")
    ap.add_argument("--lines", default="", help="LO-HI: only mutants on these lines")
    ap.add_argument("--name", default="", help="names the result file (default: the preset)")
    ap.add_argument("--jobs", type=int, default=2, help="clones tested side by side (default 2)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds before a test run counts as killed")
    ap.add_argument("--list", action="store_true", help="print the mutants and stop")
    ap.add_argument("--recheck", action="store_true",
                    help="run only the survivors of the stored result (after new tests), and update it")
    a = ap.parse_args(argv)
    if a.preset:
        module, tests = PRESETS[a.preset]
        module, tests = a.module or module, a.tests or tests
    elif a.module and a.tests:
        module, tests = a.module, a.tests
    else:
        ap.error("give --preset, or --module with --tests")
    lo, _, hi = a.lines.partition("-")
    # one commit for the mutants, the clones and the report, whatever is committed meanwhile
    commit = _git("rev-parse", "HEAD").stdout.strip()
    shown = _git("show", f"{commit}:{module}")
    if shown.returncode:
        ap.error(f"{module} is not in the committed tree: {shown.stderr.strip()}")
    source = shown.stdout
    mutants = list(mutants_of(source, int(lo or 1), int(hi or 10 ** 9)))
    if a.list:
        for m in mutants:
            print(f"{module}:{m.line}:{m.col} {m.what}")
        print(f"{len(mutants)} mutants")
        return 0
    if _git("status", "--porcelain", "--", module).stdout.strip():
        print(f"note: {module} has uncommitted changes; the sweep mutates the committed version", file=sys.stderr)
    name = a.name or a.preset or os.path.splitext(os.path.basename(module))[0]
    out = os.path.join(RESULTS_DIR, f"mutation-{name}.json")
    earlier: list[dict] = []
    if a.recheck:  # the same mutants, by place, while the module is unchanged (only tests were added)
        with open(out, encoding="utf-8") as fh:
            stored = json.load(fh)
        if _git("diff", "--quiet", stored["commit"], commit, "--", module).returncode:
            ap.error(f"{module} changed since the stored sweep at {stored['commit']}: run it whole")
        earlier = [Outcome(**o) for o in _placed(stored["all"], mutants)]
        left = {(o.line, o.col, o.what) for o in earlier if not o.killed}
        mutants = [m for m in mutants if (m.line, m.col, m.what) in left]
    t0 = time.monotonic()
    outcomes = sweep(module, mutants, tests, a.jobs, a.timeout, commit)
    if earlier:
        again = {(o.line, o.col, o.what) for o in outcomes}
        outcomes = [o for o in earlier if (o.line, o.col, o.what) not in again] + outcomes
        outcomes.sort(key=lambda o: (o.line, o.col, o.what))
    survivors = [o for o in outcomes if not o.killed]
    report = {"benchmark": "mutation-sweep", "module": module, "lines": a.lines or "all", "tests": tests,
              "commit": commit[:7], "rechecked": a.recheck, "mutants": len(outcomes),
              "killed": len(outcomes) - len(survivors), "survived": len(survivors),
              "wall_s": round(time.monotonic() - t0, 1),
              "survivors": [asdict(o) for o in survivors], "all": [asdict(o) for o in outcomes]}
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1)
        fh.write("\n")
    print(f"{module}: {len(outcomes)} mutants, {len(survivors)} survived; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
