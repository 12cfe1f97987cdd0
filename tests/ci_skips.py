"""Two pytest rules the suite runs under (loaded by conftest.py):

- `@pytest.mark.cuda` marks a test that needs a CUDA GPU: it is skipped, saying so, where there is none. It is
  also how benchmarks/gpu_check finds the tests to run on a GPU (`pytest -m cuda`).
- Under CI (the CI environment variable set to true, as CI services and .ci/run set it), a skip is a failure
  unless the test is marked `cuda`: a kernel that does not build, a browser that is missing or a package left
  out of the install must not turn tests into skips while pytest exits 0. The failure keeps the skip's reason.
"""

import os

import pytest

CUDA_REASON = "needs a CUDA GPU"


def under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def pytest_configure(config):
    config.addinivalue_line("markers", f"cuda: {CUDA_REASON}; skipped without one, the only skip CI allows")


def pytest_collection_modifyitems(config, items):
    marked = [item for item in items if item.get_closest_marker("cuda")]
    if not marked:
        return
    import torch

    if torch.cuda.is_available():
        return
    for item in marked:
        item.add_marker(pytest.mark.skip(reason=CUDA_REASON))


def _reason(longrepr) -> str:
    # a skip's longrepr is (file, line, "Skipped: reason")
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _fail_skip(report, what: str) -> None:
    report.outcome = "failed"
    report.longrepr = (f"{what} was skipped under CI, where only tests marked cuda may skip: "
                       f"{_reason(report.longrepr)}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if (under_ci() and report.skipped and not hasattr(report, "wasxfail")
            and not item.get_closest_marker("cuda")):
        _fail_skip(report, item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    report = (yield).get_result()
    if under_ci() and report.skipped:  # a module-level importorskip: the whole file would silently vanish
        _fail_skip(report, collector.nodeid or "a test module")
