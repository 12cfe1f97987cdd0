"""The suite's own rules (tests/ci_skips.py): under CI only tests marked cuda may skip; every other skip fails
the run with its reason, so a broken default (a kernel that does not build, a missing browser) cannot pass."""

import os
import re
from pathlib import Path

from conftest import SLOWEST

TESTS = """
import pytest

def test_runs():
    pass

def test_skips_for_want_of_something():
    pytest.skip("the widget is not installed")

@pytest.mark.cuda
def test_needs_a_gpu():
    import torch
    assert torch.cuda.is_available()
"""


def run(pytester, monkeypatch, ci: str | None, source: str = TESTS):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent), prepend=os.pathsep)
    pytester.makepyfile(test_rules=source)
    # in a subprocess: an in-process run restores sys.modules afterwards, which unloads torch under it
    return pytester.runpytest_subprocess("-p", "ci_skips", "-rs")


def test_outside_ci_a_skip_is_a_skip(pytester, monkeypatch):
    result = run(pytester, monkeypatch, None)
    result.assert_outcomes(passed=1, skipped=2)
    assert result.ret == 0


def test_under_ci_only_a_gpu_test_may_skip(pytester, monkeypatch):
    import torch

    result = run(pytester, monkeypatch, "true")
    gpu = torch.cuda.is_available()
    result.assert_outcomes(passed=1 + gpu, failed=1, skipped=0 if gpu else 1)
    assert result.ret != 0
    # the failure names the test and keeps the skip's reason
    result.stdout.fnmatch_lines(["*test_skips_for_want_of_something was skipped under CI*the widget is not installed*"])
    if not gpu:
        result.stdout.fnmatch_lines(["*needs a CUDA GPU*"])


def test_under_ci_a_module_that_skips_whole_is_a_failure(pytester, monkeypatch):
    result = run(pytester, monkeypatch, "true", 'import pytest\npytest.importorskip("no_such_module_here")\n'
                                                "def test_x():\n    pass\n")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*skipped under CI*no_such_module_here*"])
    result = run(pytester, monkeypatch, "false", 'import pytest\npytest.importorskip("no_such_module_here")\n')
    assert result.ret == 0 or result.ret == 5  # nothing ran, nothing failed


def test_the_slowest_tests_conftest_runs_first_exist():
    """conftest.py's SLOWEST names tests by file and function: a test renamed or moved would silently drop out of
    the order that keeps the two workers ending together."""
    tests = Path(__file__).parent
    for _, *names in SLOWEST:
        for name in names:
            file, function = name.split("::")
            assert re.search(rf"^def {function}\(", (tests / file).read_text(), flags=re.M), name
