"""The mutation harness kept true (tests/mutations.py): every mutation quotes code that is in its file exactly once,
changes it, and names a test that exists. Reads files only, so it runs in milliseconds; whether each mutation is
caught is the harness's own run (`python tests/mutations.py`), numbered from 0 as here."""

import re
from pathlib import Path

import pytest
from mutations import MUTATIONS, ROOT


def problems(mutation: tuple[str, str, str, str, str], root: Path = ROOT) -> list[str]:
    """What is wrong with one mutation; empty when the harness can apply it and run its test."""
    what, path, old, new, test = mutation
    found = []
    file = root / path
    if not file.is_file():
        found.append(f"{path} does not exist")
    else:
        count = file.read_text().count(old)
        if count != 1:
            found.append(f"its code occurs {count} times in {path}, not once")
    if not old:
        found.append("it quotes no code")
    if new == old:
        found.append("the mutated code is the code itself")
    test_path, _, name = test.partition("::")
    name = name.split("[", 1)[0]  # a parametrized case: test_x[param] is test_x
    test_file = root / test_path
    if not name or "::" in name:
        found.append(f"{test} is not a file::function node id")
    elif not test_file.is_file():
        found.append(f"{test_path} does not exist")
    elif not re.search(rf"^(async )?def {re.escape(name)}\(", test_file.read_text(), re.MULTILINE):
        found.append(f"{test_path} has no `def {name}(`")
    return found


@pytest.mark.parametrize("i", range(len(MUTATIONS)))
def test_each_mutation_quotes_its_code_once_and_names_a_test_that_exists(i):
    found = problems(MUTATIONS[i])
    assert not found, f"mutation {i} ({MUTATIONS[i][0]}): " + "; ".join(found) + "; update tests/mutations.py"


def test_the_check_fails_on_code_absent_or_quoted_twice_and_on_a_missing_test(tmp_path):
    (tmp_path / "pkg.py").write_text("a = 1\nb = 2\nb = 2\n")
    (tmp_path / "test_pkg.py").write_text("def test_it():\n    pass\n")
    good = ("what", "pkg.py", "a = 1", "a = 2", "test_pkg.py::test_it")
    assert problems(good, tmp_path) == []
    assert problems(good[:4] + ("test_pkg.py::test_it[case-1]",), tmp_path) == []
    assert problems(good[:2] + ("c = 3",) + good[3:], tmp_path) == ["its code occurs 0 times in pkg.py, not once"]
    assert problems(good[:2] + ("b = 2",) + good[3:], tmp_path) == ["its code occurs 2 times in pkg.py, not once"]
    assert problems(good[:3] + ("a = 1",) + good[4:], tmp_path) == ["the mutated code is the code itself"]
    assert problems(good[:1] + ("gone.py",) + good[2:], tmp_path) == ["gone.py does not exist"]
    assert problems(good[:4] + ("test_pkg.py::test_other",), tmp_path) == ["test_pkg.py has no `def test_other(`"]
    assert problems(good[:4] + ("test_pkg.py::test_i",), tmp_path) == ["test_pkg.py has no `def test_i(`"]
    assert problems(good[:4] + ("test_gone.py::test_it",), tmp_path) == ["test_gone.py does not exist"]
