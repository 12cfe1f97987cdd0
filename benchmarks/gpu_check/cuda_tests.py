"""The tests part: the tests marked cuda (they skip without a CUDA GPU), the graphed training step's file first
and on its own, then the newest CUDA code's, then the others where the part's time left holds them; each test
within CUDA_TEST_LIMIT_S, each outcome read from pytest -v's lines as the test ends, so that a run stopped keeps
every outcome so far."""

from __future__ import annotations

import ast
import functools
import re
import time
from pathlib import Path

from benchmarks.gpu_check.check import Check, Run
from benchmarks.gpu_check.common import ROOT, python, shown
from benchmarks.gpu_check.figures import h200, on_h200
from gptkit import cli  # (standard library only)

# The tests part: tests/test_cudagraph_cuda.py first, on its own (the graphed step, its capture compiled and
# beside an asynchronous save), then the files of the newest CUDA code (the decode window, the FP8 head), then,
# where the part's time holds them, the other files holding CUDA tests (they passed on 2026-11-28); a test
# running longer than CUDA_TEST_LIMIT_S is stopped (its outcome: timeout) and pytest goes on with the rest.
GRAPH_TESTS = "tests/test_cudagraph_cuda.py"
NEW_TESTS = ("tests/test_decode_window.py", "tests/test_fp8.py")
CUDA_TEST_LIMIT_S = 90
CUDA_TEST_FILE_S = {GRAPH_TESTS: "graph_tests_s", "tests/test_decode_window.py": "decode_window_tests_s",
                    "tests/test_fp8.py": "fp8_tests_s", "tests/test_generate.py": "generate_loader_tests_s",
                    "tests/test_loader.py": None, "tests/test_engine.py": "engine_tests_s",
                    "tests/test_prefix_cache.py": "prefix_tests_s"}  # (None: in another's)


def marks_cuda(source: str) -> bool:
    """Whether a test file holds a test marked cuda (the marker tests/ci_skips.py defines): a test function
    decorated @pytest.mark.cuda, or the module's pytestmark (a test's text inside a string does not count)."""
    def is_cuda(node: ast.AST) -> bool:
        return any(isinstance(n, ast.Attribute) and n.attr == "cuda" and ast.unparse(n) == "pytest.mark.cuda"
                   for n in ast.walk(node))

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            if is_cuda(node.value):
                return True
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and any(is_cuda(d) for d in node.decorator_list):
            return True
    return False


@functools.cache
def file_marks_cuda(path: Path, stamp: tuple[int, int]) -> bool:
    """marks_cuda of a file, parsed once per version of it (`stamp`: its modification time and size): the plan
    asks for the CUDA test files several times, and parsing every test file takes a second or two."""
    return marks_cuda(path.read_text())


def cuda_test_files() -> list[str]:
    """The test files holding a test marked cuda (it needs a CUDA GPU)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if file_marks_cuda(p, (p.stat().st_mtime_ns, p.stat().st_size)))


OTHER_TESTS = "CUDA tests: the others"  # (the group run where the part's time holds it: OPTIONAL_RUNS)
# Runs that start only where their part's time left holds what they need, and are not in the part's need: the
# older CUDA test files (the tests part, last, gets what every part before it left unused).
OPTIONAL_RUNS = {OTHER_TESTS}


def cuda_test_runs() -> list[tuple[str, list[str]]]:
    """The tests part's pytest runs, in order: the graphed training step's file on its own, then the newest
    code's (NEW_TESTS), then the others."""
    files = cuda_test_files()
    groups = (("CUDA tests: the graphed training step", [f for f in files if f == GRAPH_TESTS]),
              ("CUDA tests: the decode window, the FP8 head", [f for f in files if f in NEW_TESTS]),
              (OTHER_TESTS, [f for f in files if f != GRAPH_TESTS and f not in NEW_TESTS]))
    return [(label, chosen) for label, chosen in groups if chosen]


def tests_command(files: list[str], done: list[str] = ()) -> list[str]:
    """pytest on the CUDA tests of `files`, each outcome on its own line as the test ends (--verbosity=1: the
    project's addopts say -q), the tests in `done` left out."""
    return python("-m", "pytest", "--verbosity=1", "-rfE", "-p", "no:cacheprovider", "-m", "cuda",
                  *[f"--deselect={test}" for test in done], *files)


# pytest -v: a test's node id when it starts, its outcome on the same line when it ends; -rfE's summary at the end
TEST_LINE = re.compile(r"^(?P<test>\S+::\S+) (?P<outcome>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)"
                       r"(?: \((?P<why>.*)\))?(?:\s+\[\s*\d+%\])?\s*$", re.M)
TEST_FAILURE = re.compile(r"^(?:FAILED|ERROR) (?P<test>\S+::\S+)(?: - (?P<message>.*))?$", re.M)
RUNNING_TEST = re.compile(r"(?:^|\n)(?P<test>\S+::\S+) *$")


def read_outcomes(output: str) -> dict[str, dict]:
    """Each test's outcome (passed, failed, error, skipped, ...) and message, from pytest -v's lines (a failure
    in a teardown after a pass counts) and its short summary (the failures' messages, at the end)."""
    found: dict[str, dict] = {}
    for m in TEST_LINE.finditer(output):
        outcome = m["outcome"].lower()
        kept = found.get(m["test"])
        if kept is None or outcome in ("failed", "error"):
            found[m["test"]] = {"test": m["test"], "outcome": outcome, "message": m["why"]}
    for m in TEST_FAILURE.finditer(output):
        if m["test"] in found and m["message"]:
            found[m["test"]]["message"] = cli.one_line(m["message"])[:300]
    return found


def running_test(output: str) -> str | None:
    """The test pytest -v is running: its node id on the last line, not yet followed by an outcome."""
    m = RUNNING_TEST.search(output[-2000:])
    return m["test"] if m else None


class PerTestLimit:
    """A watch over pytest -v (Check.run): which test is running and since when; once one has run past
    limit_s, it stops the run with the status timeout, naming that test in `hung`."""

    def __init__(self, check: Check, limit_s: float):
        self.check, self.limit_s = check, limit_s
        self.current: str | None = None
        self.since = time.monotonic()
        self.hung: str | None = None

    def __call__(self) -> str | None:
        running = running_test(self.check.output_so_far())
        now = time.monotonic()
        if running != self.current:
            self.current, self.since = running, now
        if running is not None and now - self.since > self.limit_s:
            self.hung = running
            return "timeout"
        return None


def run_tests(check: Check, label: str, files: list[str], limit_s: float, env: dict[str, str] | None = None,
              test_limit_s: float = CUDA_TEST_LIMIT_S, cwd: Path = ROOT) -> tuple[list[Run], dict[str, dict]]:
    """pytest on `files` (run in `cwd`, its rootdir: -v names the tests by their node ids there) within limit_s,
    each test within test_limit_s: a test past it is stopped (its outcome timeout) and pytest starts again on
    the tests that have no outcome yet. Every outcome printed before a stop is kept; the runs, and each test's
    outcome."""
    end = time.monotonic() + limit_s
    runs: list[Run] = []
    results: dict[str, dict] = {}
    while True:
        clock = PerTestLimit(check, test_limit_s)
        run = check.run(label, tests_command(files, list(results)), clock, env=env, cwd=cwd,
                        limit_s=end - time.monotonic())
        if run is None:
            return runs, results
        runs.append(run)
        known = set(results)
        results.update(read_outcomes(run.output))
        cut = clock.hung or (clock.current if run.status == "timeout" else None)
        if cut is not None and cut not in results:
            why = f"no outcome within {test_limit_s:g} s" if clock.hung else "running when the part's time was up"
            results[cut] = {"test": cut, "outcome": "timeout", "message": f"{why}: stopped"}
        if clock.hung is None or clock.hung in known:  # (a test left out that ran again: no loop)
            return runs, results


def part_tests(check: Check, args) -> dict:
    groups = cuda_test_runs()
    if not groups:
        return {"status": "skipped", "reason": "no test file holds a test that skips without CUDA", "runs": []}
    # The tests' conftest asks tiktoken for GPT-2's BPE files at start, a download where they are not cached;
    # the CUDA tests need none, and on a machine without network the attempt could wait long for an answer. A
    # proxy that refuses at once makes it fail at once (those tests then skip, saying why).
    # (COLUMNS: pytest -v cuts a line, a skip's reason first, at the terminal's width, 80 in a file)
    offline = {"HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9", "COLUMNS": "250"}
    needs = [need for _, need in run_needs(check.smoke)]
    counted = [0.0 if label in OPTIONAL_RUNS else need for (label, _), need in zip(groups, needs)]
    runs: list[Run] = []
    results: dict[str, dict] = {}
    not_started, not_run = [], []
    for i, (label, files) in enumerate(groups):
        if label in OPTIONAL_RUNS and check.left() < needs[i]:
            not_run.append(f"{label} ({', '.join(files)}): not enough time left ({check.left():.0f} s; it needs "
                           f"{needs[i]:.0f} s): --parts=tests runs them")
            continue
        done, found = run_tests(check, label, files, check.share(needs[i], sum(counted[i + 1:])), offline)
        runs += done
        results.update(found)
        if not done:
            not_started.append(label)
    counts = {o: sum(r["outcome"] == o for r in results.values())
              for o in ("passed", "failed", "error", "skipped", "timeout")}
    bad = [r["test"] for r in results.values() if r["outcome"] in ("failed", "error")]
    late = [r["test"] for r in results.values() if r["outcome"] == "timeout"]
    broken = [r.label for r in runs if r.status == "failed"]  # (without a failed test: collection, an import)
    status, reason = "ok", None
    if bad:
        status, reason = "failed", "failed: " + ", ".join(bad) + (f"; timeout: {', '.join(late)}" if late else "")
    elif broken:
        status, reason = "failed", f"pytest failed (see the log): {'; '.join(broken)}"
    elif late or not_started:
        status, reason = "timeout", "; ".join(([f"timeout: {', '.join(late)}"] if late else [])
                                             + ([f"not reached: {'; '.join(not_started)}"] if not_started else []))
    elif not_run:
        reason = "; ".join(not_run)
    return {"status": status, "reason": reason, "runs": [r.record() for r in runs], "counts": counts,
            "results": list(results.values()), "not_run": not_run}


def run_needs(smoke: bool) -> list[tuple[str, float]]:
    """What each pytest run needs on an H200: pytest's start and its files' tests (CUDA_TEST_FILE_S)."""
    def file_s(path: str) -> float:
        figure = CUDA_TEST_FILE_S.get(path, "other_test_file_s")
        return h200(figure) if figure else 0.0

    return on_h200([(label, h200("pytest_start_s") + sum(map(file_s, files))) for label, files in cuda_test_runs()],
                   smoke)


def commands(smoke: bool) -> list[str]:
    return [shown(tests_command(files)) + ("  (if the part's time left holds it)" if label in OPTIONAL_RUNS else "")
            for label, files in cuda_test_runs()] or ["nothing: no test skips without CUDA"]
