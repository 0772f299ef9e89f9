"""docs/reliability.md names, for every fault it lists, the test that checks it. Those names are kept in step
with the tests here: a row whose test was renamed or removed would promise a check that no longer runs.
No processes: the doc and the test files are read as text and parsed with ast."""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "reliability.md"
# The test column's one format: `tests/<file>.py::<function or class>`, or `tests/<file>.py` for every test in it.
NAMED = re.compile(r"^tests/[\w/]+\.py(::\w+)?$")


@lru_cache(maxsize=None)
def defined_in(path: Path) -> tuple[list[str], list[str]]:
    """(top-level test functions, top-level Test classes) of a test file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    functions = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and n.name.startswith("test_")]
    classes = [n.name for n in tree.body if isinstance(n, ast.ClassDef) and n.name.startswith("Test")]
    return functions, classes


def table_rows(text: str) -> list[tuple[int, dict[str, str]]]:
    """(line number, {column: cell}) of every row of every table whose header has a `test` column."""
    rows, header = [], None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.startswith("|"):
            header = None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif not set("".join(cells)) <= set("-: ") and "test" in header:
            assert len(cells) == len(header), f"docs/reliability.md:{number}: {len(cells)} cells, {len(header)} columns"
            rows.append((number, dict(zip(header, cells))))
    return rows


def test_every_fault_row_names_tests_that_exist():
    rows = table_rows(DOC.read_text())
    assert len(rows) >= 40, f"only {len(rows)} fault rows found: has the table format changed?"
    for number, row in rows:
        names = re.findall(r"`([^`]+)`", row["test"])
        assert names, f"docs/reliability.md:{number}: the row '{row['fault']}' names no test"
        for name in names:
            where = f"docs/reliability.md:{number} ('{row['fault']}'): `{name}`"
            assert NAMED.match(name), f"{where} is not tests/<file>.py::<test> (or a whole tests/<file>.py)"
            file, _, test = name.partition("::")
            assert (REPO / file).is_file(), f"{where}: no such file"
            functions, classes = defined_in(REPO / file)
            if test:
                assert test in functions + classes, f"{where}: no test {test} in {file}"
            else:
                assert functions or classes, f"{where}: {file} holds no test"
            counted = re.search(re.escape(f"`{name}`") + r" \((\d+) tests\)", row["test"])
            if counted:
                assert int(counted.group(1)) == len(functions), f"{where}: it holds {len(functions)} tests"


def test_tests_named_in_the_prose_exist():
    """Outside the tables a test is named by its function alone; it must still be one."""
    every = {name for path in (REPO / "tests").rglob("test_*.py") for group in defined_in(path) for name in group}
    for number, line in enumerate(DOC.read_text().splitlines(), 1):
        if line.startswith("|"):
            continue
        for name in re.findall(r"`(test_\w+)`", line):
            assert name in every, f"docs/reliability.md:{number}: no test {name} in tests/"


def test_the_bad_settings_row_counts_the_table_it_names():
    """'N rows in a table plus M tests': the parametrized table of tests/test_bad_input.py and its other tests."""
    path = REPO / "tests" / "test_bad_input.py"
    tree = ast.parse(path.read_text())
    (table,) = [node.value for node in tree.body if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "TABLE" for t in node.targets)]
    functions, _ = defined_in(path)
    claimed = re.search(r"(\d+) rows in a table plus (\d+) tests", DOC.read_text())
    assert claimed, "the bad settings row no longer says how many rows and tests it covers"
    assert (int(claimed.group(1)), int(claimed.group(2))) == (len(table.keys), len(functions) - 1)


def test_every_last_run_line_names_the_commit_it_ran_at():
    lines = [line for line in DOC.read_text().splitlines() if re.search(r"\blast run\b", line, re.IGNORECASE)
             and not line.startswith("|")]
    assert lines
    for line in lines:
        assert re.search(r"\bat [0-9a-f]{7,40}\b", line), f"a 'last run' line without its commit: {line[:200]}"
