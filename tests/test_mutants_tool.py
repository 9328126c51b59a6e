"""tools/mutants.py (`make mutants`): every mutant still applies to today's code, names tests that exist,
and the record renders; a toy tree shows what counts as caught (a test that fails against the mutant and
passes, with the same seed, on the clean tree)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tools import mutants

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.tier1
def test_every_mutant_applies_once_and_still_parses():
    assert len(mutants.MUTANTS) >= 24
    names = [m.name for m in mutants.MUTANTS]
    assert len(set(names)) == len(names), "mutant names repeat"
    for m in mutants.MUTANTS:
        text = (ROOT / m.path).read_text()
        assert text.count(m.old) == 1, f"{m.name}: its text occurs {text.count(m.old)} times in {m.path}"
        assert m.new != m.old and m.tests, m.name
        ast.parse(text.replace(m.old, m.new), m.path)          # a mutant is a running program, not a syntax error


@pytest.mark.tier2      # a pytest collection of every file the mutants name (~8 s)
def test_every_named_test_exists():
    """Each node id a mutant names is a test pytest collects (a renamed test or case fails here)."""
    nodes = {n for m in mutants.MUTANTS for n in m.tests}
    files = sorted({n.split("::")[0] for n in nodes})
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-n", "0",
                          *files], cwd=ROOT, capture_output=True, text=True)
    collected = set(out.stdout.split())
    for node in nodes:
        if "::" not in node:
            assert (ROOT / node).is_file(), node
        else:
            assert node in collected or any(c.startswith(node + "[") for c in collected), \
                f"{node} is not a collected test"


@pytest.mark.tier1
def test_the_record_covers_every_mutant_and_renders():
    data = mutants.json.loads(mutants.RECORD.read_text())
    last = data["runs"][-1]
    assert [r["name"] for r in last["mutants"]] == [m.name for m in mutants.MUTANTS], \
        "the record's last run is not of today's mutants: run `make mutants`"
    assert 1 <= len(data["runs"]) <= mutants.KEEP_RUNS
    table = mutants.format_table(data)
    for m in mutants.MUTANTS:
        assert f"`{m.name}`" in table


@pytest.mark.tier1
def test_margin_reads_the_failing_checks_message():
    assert mutants.margin("loss: relative error 0.05 > 1e-05") == pytest.approx(5000.0)
    assert mutants.margin("d/dtable: 3 entries past their bound, the worst 32.6x its bound at (1, 2)") == 32.6
    assert mutants.margin("metric top1: got 6.0, oracle 8.0") is None


@pytest.mark.tier2      # three pytest runs in a copied toy tree (~8 s)
def test_a_toy_tree_caught_survived_and_unproven(tmp_path):
    """Three mutants of a toy module: one its test catches, one it cannot see, one whose test fails on
    the clean tree too (not caught: the failure proves nothing)."""
    (tmp_path / "toy.py").write_text("def add(x, y):\n    return x + y\n\n\ndef unused():\n    return 1\n")
    (tmp_path / "test_toy.py").write_text(
        "import os, pytest, toy\n\n"
        "@pytest.mark.tier1\ndef test_add():\n    assert toy.add(2, 3) == 5\n\n"
        "@pytest.mark.tier1\ndef test_seed_is_passed():\n    assert os.environ['RECLOSS_TEST_SEED'] == '77'\n\n"
        "@pytest.mark.tier1\ndef test_broken():\n    assert False\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    tier1: first tier\n")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "add", "-A"], cwd=tmp_path, check=True)
    toys = (
        mutants.Mutant("plus-minus", "toy", "toy.py", "return x + y", "return x - y", "adds wrong",
                       ("test_toy.py::test_seed_is_passed", "test_toy.py::test_add")),
        mutants.Mutant("dead-code", "toy", "toy.py", "return 1", "return 2", "unused", ("test_toy.py::test_add",)),
        mutants.Mutant("broken-test", "toy", "toy.py", "def add(x, y):", "def add(x, y):  # changed", "a comment",
                       ("test_toy.py::test_broken",)),
    )
    record = mutants.run(seed=77, jobs=1, log=lambda *_: None, root=tmp_path, mutants=toys)
    status = {r["name"]: r["status"] for r in record["mutants"]}
    assert status == {"plus-minus": "caught", "dead-code": "survived", "broken-test": "unproven"}
    caught = record["mutants"][0]
    assert caught["first_failure"] == "test_toy.py::test_add" and caught["control"] == "passed"
    assert (tmp_path / "toy.py").read_text().count("return x + y") == 1      # the source tree is never touched
    assert record["seed"] == 77 and re.fullmatch(r"\d{4}-\d\d-\d\d", record["date"])
