"""The test tiers: tests/conftest.py gives every test exactly one tier and refuses a module
without one. Checked on a scratch test tree that uses this conftest.py, in a child pytest."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parent
MARKERS = ["unit: u", "dist: d", "cli: c", "slow: s"]

TIERED = """
import pytest

pytestmark = pytest.mark.unit


def marks(request):
    return {m.name for m in request.node.iter_markers()} & {"unit", "dist", "cli", "slow"}


def test_plain(request):
    assert marks(request) == {"unit"}


@pytest.mark.cli
def test_own_tier(request):
    assert marks(request) == {"cli"}


@pytest.mark.slow
def test_slow(request):
    assert marks(request) == {"unit", "slow"}


@pytest.mark.parametrize("n", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_cases(request, n):
    assert marks(request) == ({"unit"} if n == 1 else {"unit", "slow"})
"""


def _pytest(tree: Path, *args: str) -> subprocess.CompletedProcess:
    ini = "[pytest]\nmarkers =\n" + "".join(f"    {m}\n" for m in MARKERS)
    (tree / "pytest.ini").write_text(ini)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--strict-markers", *args, str(tree)],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def tree(tmp_path):
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_tiered.py").write_text(TIERED)
    return tmp_path


def _selected(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_tests_own_tier_replaces_its_modules(tree):
    # every test asserts its own markers; -m selects on the same markers
    assert _selected(_pytest(tree)).startswith("5 passed")
    assert _selected(_pytest(tree, "-m", "unit and not slow")).startswith("2 passed, 3 deselected")


def test_a_module_without_a_tier_fails_the_collection(tree):
    (tree / "test_untiered.py").write_text("def test_x():\n    pass\n")
    result = _pytest(tree, "--collect-only")
    assert result.returncode == 4, result.stdout + result.stderr
    assert "no test tier in test_untiered.py: add `pytestmark = pytest.mark.unit`" in result.stderr
