"""bench/mutation_sweep.py's mutants: one change each, where the syntax tree says, never in docstrings,
log calls or raised messages, and every mutant still parses."""
from __future__ import annotations

import ast
from pathlib import Path

from bench.mutation_sweep import PRESETS, mutants_of

ROOT = Path(__file__).resolve().parent.parent

SOURCE = '''"""A docstring: a < b and not c."""
def f(a, b, items):
    """a <= b stays."""
    log.info("a > b", n=1 + 2)
    if a < b and not items:
        raise ValueError(f"a >= {b}")
    return max(a - 1, min(b, 64))
'''


def test_each_operator_gives_one_mutant_in_code_only():
    found = {(m.line, m.what) for m in mutants_of(SOURCE)}
    assert found == {(5, "< -> <="), (5, "and -> or"), (5, "not dropped"), (5, "if never taken"),
                     (7, "max -> min"), (7, "- -> +"), (7, "1 -> 2"), (7, "min -> max"), (7, "64 -> 63")}


def test_every_mutant_changes_one_line_and_still_parses():
    lines = SOURCE.splitlines(keepends=True)
    for m in mutants_of(SOURCE):
        mutated = m.apply(lines)
        assert sum(a != b for a, b in zip(lines, mutated)) == 1
        ast.parse("".join(mutated))


def test_a_line_range_limits_the_mutants():
    assert {m.line for m in mutants_of(SOURCE, 7, 7)} == {7}


def test_every_preset_names_a_module_and_tests_that_exist():
    for module, tests in PRESETS.values():
        assert list(mutants_of((ROOT / module).read_text(encoding="utf-8"))), module
        for t in tests:
            assert (ROOT / t).exists(), t


def test_a_recheck_places_outcomes_stored_without_a_column():
    """Results written before outcomes kept their column: same-line, same-change mutants get the columns
    left over, in order, beside those stored with one."""
    from bench.mutation_sweep import _placed
    mutants = [m for m in mutants_of("x = f(1, 1, 1)\n") if m.what == "1 -> 2"]
    cols = [m.col for m in mutants]
    stored = [{"line": 1, "what": "1 -> 2", "col": cols[1]}, {"line": 1, "what": "1 -> 2"},
              {"line": 1, "what": "1 -> 2", "col": -1}]
    assert [o["col"] for o in _placed(stored, mutants)] == [cols[1], cols[0], cols[2]]
