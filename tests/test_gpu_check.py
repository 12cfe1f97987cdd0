"""benchmarks/gpu_check: its --smoke rehearsal on the CPU runs every part or says why not, its report has
the structure a GPU run's will have, every default part's budget holds what its commands need by the H200's
figures, and what could make the GPU's minutes come back empty is caught here: a hung run or test stopped at its
limit without losing the rest, a failed bench.py row, a failed nanoGPT run, a missing file or package."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import SHARED_DATA

from benchmarks import gpu_check, gpu_readings
from benchmarks.gpu_check import bench_runs, common, cuda_tests, device, figures, gpt2_step, memory_plan
from benchmarks.gpu_check import budgets as plan
from benchmarks.gpu_check import check as checks
from benchmarks.gpu_check import nanogpt as nanogpt_part
from benchmarks.gpu_check import steps as steps_part
from benchmarks.gpu_check.summary import summarise

# nanoGPT's own code, beside the checkout's shared data (as gpu_check finds it)
NANOGPT = SHARED_DATA.parent / "anchors" / "nanoGPT"


SMOKE_PARTS = (*plan.DEFAULT_PARTS, "nanogpt_train", "steps")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One --smoke run of every part (the test files share it: it is the suite's costliest rehearsal): the
    folder of its JSON and log, and its report."""
    tmp_path = tmp_path_factory.mktemp("smoke")
    text = SHARED_DATA / "tinyshakespeare.txt"
    # The default parts, and nanoGPT's training and the steps part beside them. Without a local copy the
    # Shakespeare parts would try a download: left out here (skipped, with the reason).
    extra = ([f"--shakespeare_text={text}", f"--parts={','.join(SMOKE_PARTS)}"] if text.is_file()
             else ["--parts=decode,train,tests,plan,serve"])
    anchor = [f"--nanogpt={NANOGPT}"] if NANOGPT.is_dir() else []
    return tmp_path, gpu_check.main(["--smoke", f"--out={tmp_path / 'check.json'}", *extra, *anchor])


def test_smoke_runs_every_part_or_says_why_not(smoke):
    tmp_path, report = smoke
    text = SHARED_DATA / "tinyshakespeare.txt"
    out = tmp_path / "check.json"
    assert json.loads(out.read_text()) == json.loads(json.dumps(report, default=str))
    assert {"date", "command", "smoke", "device", "torch", "git", "readings", "parts", "rows", "summary",
            "missing"} <= set(report)
    assert report["device"]["torch"] == report["torch"] and report["device"]["peak"]["tflops_measured"] > 0
    assert report["device"]["peak"]["warmup_products"] >= 10
    # both shapes timed, NVML read meanwhile (here, without NVML, said so), and the readings at the start
    peaks = report["device"]["peaks"]
    assert [p["shape"] for p in peaks] == [name for name, _ in device.PEAK_SHAPES[True]]
    assert all(p["tflops_measured"] > 0 and p["timed_products"] >= 50 and "samples" in p["clocks"] for p in peaks)
    assert report["device"]["peak"]["tflops_measured"] == peaks[0]["tflops_measured"]
    assert report["readings"]["line"] == gpu_readings.line(report["readings"]["start"])
    assert report["summary"]["gpu_readings"]["line"] == report["readings"]["line"]
    assert set(report["parts"]) == set(plan.PARTS)
    for name, part in report["parts"].items():
        assert part["status"] in ("ok", "skipped"), (name, part)
        assert part["status"] == "ok" or part["reason"], (name, part)  # every skip says why
        assert {"seconds", "budget_s", "runs"} <= set(part), (name, part)
        for run in part["runs"]:
            assert run["status"] in ("ok", "stopped") and run["command"], (name, run)
    # the CUDA tests were found and collected (skipped here, without CUDA), each with its outcome and reason: the
    # graphed step's file first, on its own
    tests = report["parts"]["tests"]
    assert tests["results"] and all(t["outcome"] == "skipped" and "CUDA" in t["message"] for t in tests["results"])
    assert [run["command"].split()[-1] for run in tests["runs"][:1]] == [cuda_tests.GRAPH_TESTS]
    assert len(tests["runs"]) == len(cuda_tests.cuda_test_runs()) >= 2
    assert all(cuda_tests.GRAPH_TESTS not in run["command"] for run in tests["runs"][1:]) and not tests["not_run"]
    assert tests["counts"]["skipped"] == len(tests["results"]) >= 5
    kinds = {r["kind"] for r in report["rows"]}
    assert kinds == {"train", "decode", "prefill"}
    train = [r for r in report["rows"] if r["kind"] == "train"]
    assert {r["model"] for r in train} == {"tiny", "tinynobias"}
    assert any(r["status"] == "skipped" and r["sdpa"] == "cudnn" for r in train)  # no cuDNN attention on a CPU
    assert all(r["mfu_measured_peak"] > 0 for r in train if r["status"] == "ok")
    assert any(r["status"] == "skipped" and r["cuda_graphs"] and "CUDA device" in r["reason"] for r in train)
    if text.is_file():
        shakespeare = report["parts"]["shakespeare"]
        reached = shakespeare["reached"]
        assert reached["val_loss"] <= 3.6 and reached["wall_s"] > 0
        # elapsed_s counts from train.py's process start: its imports and setup are in it
        assert 0 < reached["elapsed_s"]
        assert "--async_save=True" in shakespeare["runs"][-1]["command"]
        assert shakespeare["plain"]["skipped"].startswith("--smoke")
        # train.py's start-up trace, read from its runs.jsonl
        assert list(shakespeare["start"]) == ["imports", "config", "device", "data", "model", "setup"]
        assert report["summary"]["shakespeare_s_to_val"]["start"] == shakespeare["start"]
        graphed, plain = report["parts"]["steps"]["steps"]  # (the graphed run first)
        assert "no CUDA graph" in graphed["skipped"]
        assert plain["early_ms"] == plain["ms_per_step"]["20"] > 0 and plain["late_ms"] == plain["ms_per_step"]["60"]
        assert plain["late_over_early"] > 0 and report["parts"]["steps"]["windows"]["late"] == [51, 60]
        assert report["summary"]["shakespeare_ms_per_step_late"]["value"] == plain["late_ms"]
    assert set(report["summary"]) >= {"train_12x1024_no_bias", "decode_compiled_batch1_tokens_per_s", "prefill_ms"}
    # bench.py's newer flags where this checkout's bench.py has them (else left out, and said so): decode rows a
    # window each with host and GPU microseconds per token, training rows profiled by kind
    flags = bench_runs.bench_flags()
    ours = [r for r in report["rows"] if r["kind"] == "decode" and r["model"] == "tiny"]
    if "decode_window" in flags and "profile_decode" in flags:
        assert [r["decode_window"] for r in ours] == [1, 4] and all(r["host_us_per_token"] > 0 for r in ours)
    else:
        assert "--decode_window" in report["parts"]["decode"]["lacking_flags"]
    if "profile_step" in flags:
        profile = report["summary"]["train_12x1024_no_bias"]["profile_default"]
        assert set(profile) == {"matmul", "attention", "head_loss", "optimizer", "other"}
    else:
        assert report["parts"]["train"]["lacking_flags"] == ["--profile_step"]
    # transformers' eager generate of the same shape, beside our eager decode
    assert any(r["model"] == "tiny (transformers)" and r["tokens_per_s"] > 0 for r in report["rows"])
    assert report["summary"]["decode_eager_vs_transformers"]["value"] > 0
    log = (tmp_path / "check.log").read_text()
    assert all(run["command"] in log for part in report["parts"].values() for run in part["runs"])


# (next to the smoke run's first test: pytest -n sends consecutive tests to one worker, where the module's
# fixture is made once; on two workers the rehearsal would run twice)
def test_nanogpt_runs_beside_ours_in_smoke(tmp_path, smoke):
    """The nanogpt part runs nanoGPT's own train.py (shrunk, on the CPU) from a copy of its folder with its own
    prepare.py, reads its evaluations and iter times from what it printed, and stops it at the threshold.
    Without a copy of nanoGPT the part and the summary say "no anchor"."""
    text = SHARED_DATA / "tinyshakespeare.txt"
    found = NANOGPT.is_dir() or nanogpt_part.nanogpt_dir(None) is not None
    if NANOGPT.is_dir() and text.is_file():
        report = smoke[1]  # the smoke run above ran nanoGPT beside ours
    else:
        report = gpu_check.main(["--smoke", f"--out={tmp_path / 'c.json'}", "--parts=nanogpt,nanogpt_train",
                                 *([f"--shakespeare_text={text}"] if text.is_file() else []), "--total_s=120"])
    part, summary = report["parts"]["nanogpt_train"], report["summary"]
    # no bench.py on the CPU (it needs CUDA): the speed-up has no anchor, and says so
    assert summary["train_12x1024_no_bias"]["value"] is None
    assert summary["train_12x1024_no_bias"]["note"].startswith("no anchor")
    if not found or not text.is_file():
        assert part["status"] == "skipped" and summary["shakespeare_s_to_val"]["note"].startswith("no anchor")
        assert ("no anchor" in part["reason"]) == (not found)
        return
    assert part["status"] == "ok", part
    train = part["train"]
    evals = train["evaluations"]
    # it trained until its first val at or below the smoke's 3.6, and was stopped there
    # the first evaluation at or below it is the one reached (the stop lands a little later, under load after
    # an evaluation or two more)
    first_below = next(e for e in evals if e["val_loss"] <= 3.6)
    assert evals[0]["step"] == 0 and 3.6 < evals[0]["val_loss"] and train["reached"] == first_below
    assert all(e["wall_s"] > 0 for e in evals) and train["iter_ms_median"] > 0
    assert [r["status"] for r in part["runs"]] == ["ok", "stopped"]
    assert summary["shakespeare_s_to_val"]["nanogpt"] == train["reached"]
    assert summary["shakespeare_ms_per_step_late"]["nanogpt_iter_ms"] == train["iter_ms_median"]


def test_a_hung_run_is_stopped_at_its_limit_and_the_check_goes_on(tmp_path, monkeypatch):
    """A run past its part's time (or its own limit) is stopped (its whole process group) and reported as a
    timeout, with its last lines; a watched run is stopped once its watcher has what it needs, or with the
    status the watcher names."""
    monkeypatch.setattr(checks, "MIN_RUN_S", 0)
    args = gpu_check.parse_args(["--smoke", f"--out={tmp_path / 'c.json'}"])
    check = checks.Check(args)
    try:
        check.part_end = time.monotonic() + 30
        hang = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"]
        run = check.run("sleeper", hang, limit_s=1.5)
        assert run.status == "timeout" and run.seconds < 10 and "started" in run.output
        assert run.record()["last_lines"] == ["started"]
        flag = tmp_path / "flag"
        run = check.run("watched", [sys.executable, "-c", f"open({str(flag)!r}, 'w'); import time; time.sleep(60)"],
                        watch=flag.exists)
        assert run.status == "stopped" and run.seconds < 10 and "last_lines" not in run.record()
        run = check.run("named", hang, watch=lambda: "timeout" if "started" in check.output_so_far() else None)
        assert run.status == "timeout" and run.seconds < 10
        assert checks.outcome([run, None], ["a", "b"]) == ("timeout", "stopped at or not reached within the "
                                                                         "time budget: a; b")
        assert check.share(own=20, later=5) == pytest.approx(check.left() - 5, abs=0.5)
        assert check.share(own=40, later=5) == 40  # the part has less than this run needs: it gets its need
    finally:
        check.close()


HANGING_TESTS = """
import time

import pytest

pytestmark = pytest.mark.cuda


def test_a():
    pass


def test_hangs():
    time.sleep(60)


def test_c():
    pass


def test_d():
    assert 1 == 2, "boom"
"""


def test_a_test_past_its_limit_is_stopped_and_pytest_goes_on_with_the_rest(tmp_path, monkeypatch):
    """The tests part's pytest: each outcome is read from -v's lines as the test ends, so a stop keeps them; a
    test past its limit is marked timeout and pytest starts again on the tests that have no outcome, the failed
    one's message from -rfE's summary. Stopped by the group's own limit instead, the running test is marked so
    and nothing more runs."""
    monkeypatch.setattr(checks, "MIN_RUN_S", 0)
    (tmp_path / "conftest.py").write_text("def pytest_configure(config):\n"
                                          "    config.addinivalue_line('markers', 'cuda: needs a CUDA GPU')\n")
    tests = tmp_path / "test_hangs.py"
    tests.write_text(HANGING_TESTS)
    args = gpu_check.parse_args(["--smoke", f"--out={tmp_path / 'c.json'}"])
    check = checks.Check(args)
    try:
        check.part_end = time.monotonic() + 60
        runs, results = cuda_tests.run_tests(check, "hanging", [tests.name], limit_s=50, test_limit_s=2, cwd=tmp_path)
        assert [r.status for r in runs] == ["timeout", "failed"]  # (the second: test_d fails)
        assert "--deselect=test_hangs.py::test_hangs" in runs[1].command
        assert {test.split("::")[1]: r["outcome"] for test, r in results.items()} == {
            "test_a": "passed", "test_hangs": "timeout", "test_c": "passed", "test_d": "failed"}
        assert "no outcome within 2 s" in results["test_hangs.py::test_hangs"]["message"]
        assert "boom" in results["test_hangs.py::test_d"]["message"]
        runs, results = cuda_tests.run_tests(check, "cut", [tests.name], limit_s=2, test_limit_s=100, cwd=tmp_path)
        assert [r.status for r in runs] == ["timeout"]
        assert {test.split("::")[1]: r["outcome"] for test, r in results.items()} == {
            "test_a": "passed", "test_hangs": "timeout"}
        assert "part's time was up" in results["test_hangs.py::test_hangs"]["message"]
    finally:
        check.close()
    log = (tmp_path / "c.log").read_text()
    assert "test_hangs.py::test_hangs \n----- hanging: timeout" in log  # (the stop's line on a line of its own)


def test_a_failed_row_fails_its_part_named(tmp_path, monkeypatch):
    """bench.py --keep_going reports a row that failed as a row and exits 0: the part is "failed" all the same,
    naming the row and its reason; the other rows are kept."""
    monkeypatch.setattr(checks, "MIN_RUN_S", 0)
    rows = [{"kind": "train", "model": "gpt2nobias", "batch_size": 12, "cuda_graphs": False, "status": "ok",
             "reason": None},
            {"kind": "train", "model": "gpt2nobias", "batch_size": 12, "cuda_graphs": True, "status": "failed",
             "reason": "RuntimeError: CUDA error: operation not permitted when stream is capturing"}]

    def fake_bench(options, extra, path):
        return [sys.executable, "-c", f"import json; json.dump({{'rows': {rows!r}}}, open({str(path)!r}, 'w'))"]

    monkeypatch.setattr(bench_runs, "bench_command", fake_bench)
    check = checks.Check(gpu_check.parse_args(["--smoke", f"--out={tmp_path / 'c.json'}"]))
    try:
        check.part_end = time.monotonic() + 30
        part = bench_runs.bench_part(check, "train", gpt2_step.SMOKE_TRAIN_RUNS, [])
    finally:
        check.close()
    assert part["status"] == "failed" and [r["status"] for r in part["runs"]] == ["ok"]
    assert part["reason"] == ("failed rows: train gpt2nobias batch 12 cuda_graphs=True: RuntimeError: CUDA error: "
                              "operation not permitted when stream is capturing")
    assert [r["status"] for r in check.report["rows"]] == ["ok", "failed"]


NANOGPT_FAKE = {
    "bench.py": "print('Compiling model...')\nraise RuntimeError('inductor: the compile failed')\n",
    "train.py": "print('step 0: train loss 4.2874, val loss 4.2823')\nprint('iter 100: loss 2.3, time 8.10ms, "
                "mfu 30.00%')\nprint('step 250: train loss 1.2, val loss 1.4600')\n",
    "model.py": "", "configurator.py": "", "config/train_shakespeare_char.py": "",
    "data/shakespeare_char/prepare.py": "",
}


def test_when_nanogpt_fails_the_summary_says_so_with_its_last_lines(tmp_path, monkeypatch):
    """nanoGPT's bench.py failing (its compile, say) is "nanoGPT failed: ..." with its last lines in the
    summary, never "no anchor"; its training (the nanogpt_train part) still runs and gives its figures. Not run
    at all, "no anchor"; its training not run, its recorded figure."""
    monkeypatch.setattr(checks, "MIN_RUN_S", 0)
    for name, text in NANOGPT_FAKE.items():
        (tmp_path / "nanoGPT" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "nanoGPT" / name).write_text(text)
    corpus = tmp_path / "input.txt"
    corpus.write_text("To be, or not to be\n")
    args = gpu_check.parse_args([f"--out={tmp_path / 'c.json'}", f"--nanogpt={tmp_path / 'nanoGPT'}",
                                 f"--shakespeare_text={corpus}"])
    check = checks.Check(args)
    try:
        check.part_end = time.monotonic() + 60
        part = nanogpt_part.part_nanogpt(check, args)
        trained = nanogpt_part.part_nanogpt_train(check, args)
    finally:
        check.close()
    assert part["status"] == "failed" and part["bench"]["status"] == "failed" and part["bench"]["ms"] is None
    assert trained["status"] == "ok" and trained["train"]["reached"]["val_loss"] == 1.46
    assert trained["train"]["iter_ms_median"] == 8.10
    summary = summarise({"rows": [], "device": {}, "parts": {"nanogpt": part, "nanogpt_train": trained}},
                                  smoke=False)
    note = summary["train_12x1024_no_bias"]["note"]
    assert note.startswith("nanoGPT failed: nanoGPT bench.py failed (exit code 1") and "no anchor" not in note
    assert "RuntimeError: inductor: the compile failed" in note
    assert summary["shakespeare_s_to_val"]["nanogpt"]["val_loss"] == 1.46
    skipped = {"status": "skipped", "reason": "no anchor: nanoGPT's code is not at shared/anchors/nanoGPT"}
    summary = summarise({"rows": [], "device": {}, "parts": {"nanogpt": skipped}}, smoke=False)
    assert summary["train_12x1024_no_bias"]["note"] == skipped["reason"]
    recorded = summary["shakespeare_s_to_val"]["nanogpt"]
    assert recorded["wall_s"] == figures.H200["nanogpt_to_val_s"].value == 94.7 and recorded["recorded"]


def test_plan_memory_table_is_read():
    """benchmarks/plan_memory.py's CUDA table (the format it prints), rows and failures."""
    mib = "{:,.0f} MiB".format
    line = f"{'gpt2 124M b8':<16}{8:>6}{mib(9876):>12}{mib(9800):>12}{9876 / 9800 - 1:>+10.1%} "
    output = "\n".join([f"{'shape':<16}{'batch':>6}{'plan peak':>12}", line + f"{12.3:>9.1f}", "16: failed",
                        "Traceback (most recent call last):"])
    rows, failed = memory_plan.plan_rows(output)
    assert rows == [{"shape": "gpt2 124M b8", "batch": 8, "plan_mib": 9876, "allocator_mib": 9800, "error": 0.008}]
    assert failed == ["16"]


def test_summary_against_the_targets():
    """The summary picks the fastest 12 x 1024 row without biases, whatever its variant (against nanoGPT's
    bench.py in the same call), with the default row's profile; the best tokens/s with the device's floor,
    beside the best at 12; the best decode window against the target, with K=1's host and GPU microseconds per
    token; the prefill; the readings and both matmul peaks with their clocks."""
    profile = {"matmul": 14.0, "attention": 4.0, "head_loss": 3.0, "optimizer": 1.0, "other": 3.0}

    def train(model, batch, ms, **variant):
        return {"kind": "train", "status": "ok", "model": model, "batch_size": batch, "ms": ms, "mfu": 0.4,
                "tokens_per_s": batch * 1024 / ms * 1000, "sdpa": "default", "compile_mode": "default",
                "compile_optimizer": False, "cuda_graphs": True, "loss_slice_rows": 4096, **variant}

    def decode(window, tokens_per_s, **more):
        return {"kind": "decode", "status": "ok", "compile": True, "batch_size": 1, "tokens_per_s": tokens_per_s,
                "ms": 1000 / tokens_per_s, "compile_s": 16.0, "kv_cache": True, "decode_window": window, **more}

    rows = [train("gpt2nobias", 12, 24.0, fp8_head=False, profile=profile), train("gpt2nobias", 12, 22.0, fp8_head=True),
            train("gpt2nobias", 12, 24.5, loss_slice_rows=None), train("gpt2nobias", 32, 50.0),
            train("gpt2", 12, 30.0), {"kind": "train", "status": "skipped", "model": "gpt2nobias", "batch_size": 12},
            decode(1, 1000.0, host_us_per_token=900.0, gpu_us_per_token=60.0), decode(16, 4500.0),
            decode(32, 4200.0),
            {"kind": "decode", "status": "ok", "compile": False, "batch_size": 1, "tokens_per_s": 200.0, "ms": 5.0,
             "compile_s": None, "kv_cache": True},
            {"kind": "decode", "status": "ok", "compile": False, "batch_size": 1, "tokens_per_s": 20.0, "ms": 50.0,
             "compile_s": None, "kv_cache": False},
            {"kind": "prefill", "status": "ok", "ms": 4.0, "seq_len": 1000}]
    clocks = {"samples": 5, "sm_clock_mhz": {"min": 1755, "median": 1830, "max": 1980}}
    peaks = [{"shape": "8192^3", "tflops_measured": 780.0, "tflops_datasheet": 989.0, "clocks": clocks,
              "clocks_line": "SM 1,755-1,980 MHz"}, {"shape": "GPT-2's", "tflops_measured": 640.0, "clocks": clocks}]
    report = {"rows": rows, "device": {"name": "NVIDIA H200", "peaks": peaks},
              "readings": {"line": "NVIDIA H200 (pynvml): SM 345/1,980 MHz", "start": {"source": "pynvml"}},
              "parts": {"plan": {"status": "ok", "rows": [{"error": -0.013}]},
                        "nanogpt": {"status": "ok", "bench": {"ms": 26.3}}}}
    summary = summarise(report, smoke=False)
    first = summary["train_12x1024_no_bias"]
    assert first["variant"]["fp8_head"] is True and abs(first["value"] - 26.3 / 22.0) < 1e-9 and first["met"]
    assert first["profile"] is None and first["profile_default"] == profile  # (only the default row profiled)
    assert [r["ms"] for r in first["rows"]] == [24.0, 22.0, 24.5] and first["rows"][2]["loss_slice_rows"] is None
    best = summary["train_best_tokens_per_s"]
    assert best["variant"]["batch_size"] == 32 and best["target"] == 600_000 and best["met"] is True
    assert best["at_12_tokens_per_s"] == 12 * 1024 / 22.0 * 1000
    assert first["nanogpt_ms"] == 26.3 and first["note"].startswith("the best row at 12 x 1024: x nanoGPT's")
    decoding = summary["decode_compiled_batch1_tokens_per_s"]
    assert decoding["value"] == 4500.0 and decoding["met"] and decoding["decode_window"] == 16
    assert decoding["by_window"] == {"1": 1000.0, "16": 4500.0, "32": 4200.0}
    assert (decoding["k1_host_us_per_token"], decoding["k1_gpu_us_per_token"]) == (900.0, 60.0)
    assert summary["prefill_ms"]["met"]
    assert summary["plan_worst_error"]["value"] == 0.013 and summary["shakespeare_s_to_val"]["value"] is None
    assert summary["shakespeare_ms_per_step_late"]["value"] is None
    assert summary["gpu_readings"]["line"] == report["readings"]["line"]
    assert summary["matmul_peak_8192_tflops"]["value"] == 780.0 and summary["matmul_peak_8192_tflops"]["target"] == 989
    assert summary["matmul_gpt2_mlp_tflops"]["value"] == 640.0 and summary["matmul_gpt2_mlp_tflops"]["clocks"] == clocks
    # sample.py --compile=auto's threshold: 16 s to compile K=1, 5.0 - 1.0 ms saved per token (the cached eager row)
    assert summary["decode_eager_vs_transformers"]["value"] is None  # (no transformers row here)
    cost = summary["decode_compile_cost"]
    assert cost["compile_s"] == 16.0 and abs(cost["saved_ms_per_token"] - 4.0) < 1e-9
    assert cost["value"] == round(16.0 / 0.004)
    # no nanoGPT in the call: no speed-up, "no anchor"; no plan part asked: no plan figure promised
    report["parts"] = {"nanogpt": {"status": "skipped", "reason": "nanoGPT's code is not at shared/anchors"}}
    summary = summarise(report, smoke=False)
    assert summary["train_12x1024_no_bias"]["value"] is None and "plan_worst_error" not in summary
    assert summary["train_12x1024_no_bias"]["note"].startswith("no anchor: nanoGPT's code is not")


def test_the_steps_part_compares_the_windows_both_runs_reached():
    """The graphed run reached step 1,500, the plain one was stopped after step 1,300: the late window is
    1,201-1,300 for both, and the summary's late figure is the faster run's there."""
    graphed = {"run": "one CUDA graph", "ms_per_step": {str(s): 3.0 for s in range(100, 1501, 100)}}
    plain = {"run": "as train.py runs it", "ms_per_step": {str(s): 9.0 + s / 1000 for s in range(100, 1301, 100)}}
    windows = steps_part.step_windows([graphed, plain], (200, 1500), 100)
    assert windows == {"early": [101, 200], "late": [1201, 1300], "late_wanted": [1401, 1500]}
    assert plain["late_ms"] == pytest.approx(10.3) and plain["late_over_early"] == pytest.approx(10.3 / 9.2)
    assert graphed["late_ms"] == 3.0 and graphed["late_over_early"] == 1.0
    report = {"rows": [], "device": {}, "parts": {"steps": {"status": "timeout", "windows": windows,
                                                           "steps": [graphed, plain]}}}
    late = summarise(report, smoke=False)["shakespeare_ms_per_step_late"]
    assert late["value"] == 3.0 and late["window"] == [1201, 1300]
    # the graphed run failed before its first log line: the plain run keeps its own late window
    failed, plain = {"run": "one CUDA graph", "ms_per_step": {}}, {"run": "plain", "ms_per_step": plain["ms_per_step"]}
    assert steps_part.step_windows([failed, plain], (200, 1500), 100)["late"] == [1201, 1300]
    assert plain["late_step"] == 1300 and failed["late_ms"] is None
    short = {"run": "x", "ms_per_step": {"100": 5.0, "200": 6.0, "300": 6.6}}
    assert steps_part.step_windows([short, {"run": "y", "ms_per_step": {"100": 5.0}}], (200, 1500), 100)["late"] is None
    assert short["late_step"] == 300 and short["late_over_early"] == pytest.approx(1.1)


def test_the_default_plan_gives_every_part_its_floor_and_a_short_total_is_refused_before_it_starts(tmp_path):
    """The default run (on a GPU and in --smoke): the device read first with its own budget, every default part
    at least its floor, the budgets within --total_s; a --total_s below that is one line, before anything runs
    (no log, no JSON written)."""
    for smoke in (False, True):
        args = gpu_check.parse_args([*(["--smoke"] if smoke else []), f"--out={tmp_path / 'c.json'}"])
        budgets = args.budgets
        assert list(budgets) == ["device", *plan.DEFAULT_PARTS]
        assert budgets["device"] >= plan.DEVICE_BUDGET.of(smoke)[1]
        for name in plan.DEFAULT_PARTS:
            assert budgets[name] >= plan.BUDGETS[name].of(smoke)[1], (smoke, name, budgets)
        assert sum(budgets.values()) + 2 * checks.GRACE_S <= args.total_s + 1e-9
        assert args.total_s == plan.DEFAULT_TOTAL_S[smoke]
    with pytest.raises(SystemExit, match=r"^error: --total_s=300 is too short .*use --total_s=\d+ or more"):
        gpu_check.main([f"--out={tmp_path / 'short.json'}", "--total_s=300"])
    assert not (tmp_path / "short.json").exists() and not (tmp_path / "short.log").exists()
    # more time: every part's share grows, the device's stays its own
    roomy = gpu_check.parse_args(["--total_s=900", "--parts=train,decode", f"--out={tmp_path / 'c.json'}"]).budgets
    assert list(roomy) == ["device", "decode", "train"] and roomy["device"] == plan.DEVICE_BUDGET.gpu
    assert roomy["train"] > plan.BUDGETS["train"].gpu and abs(sum(roomy.values()) - 890) < 1e-6


def dry_run_table(tmp_path, capsys, *extra: str, anchor: bool = True) -> list[str]:
    anchor = [f"--nanogpt={NANOGPT}"] if anchor and NANOGPT.is_dir() else []  # (else found in the checkout, or none)
    report = gpu_check.main(["--dry_run", f"--out={tmp_path / 'c.json'}", *anchor, *extra])
    assert report == {} and not (tmp_path / "c.json").exists()  # nothing ran
    return capsys.readouterr().out.splitlines()


def with_every_flag_and_test_file(monkeypatch) -> None:
    """The plan of a checkout whose bench.py has every flag the default run uses and which holds every CUDA test
    file it names (as after the branches that add them are merged)."""
    monkeypatch.setattr(bench_runs, "bench_flags", lambda: None)
    files = cuda_tests.cuda_test_files()
    monkeypatch.setattr(cuda_tests, "cuda_test_files", lambda: sorted({*files, *cuda_tests.NEW_TESTS}))


@pytest.mark.parametrize("complete", [False, True], ids=["this checkout", "every flag and test file"])
def test_every_default_part_gets_what_its_commands_need_by_the_h200s_figures(tmp_path, capsys, monkeypatch,
                                                                              complete):
    """--dry_run's need column: each part's runs added up from the H200 figures (start + compile + steps x ms),
    from the commands the part runs. The default plan gives every part at least 1.1x that (NEED_MARGIN: room for
    a host as slow as the slowest seen), this checkout's and one with every flag and test file the default run
    would use, and the whole within one 10-minute call; a part made to run longer is starved no more silently:
    its need outgrows its budget."""
    if complete:
        with_every_flag_and_test_file(monkeypatch)
    table = dry_run_table(tmp_path, capsys)
    rows = {line.split()[0]: line.split() for line in table if line.split()[:1] and line.split()[0] in plan.PARTS}
    assert list(rows) == ["device", *plan.DEFAULT_PARTS]
    assert plan.NEED_MARGIN >= 1.1
    for name, row in rows.items():
        budget, need = float(row[1]), float(row[5])
        assert need == round(plan.part_need(name)) and need > 0, (name, row)
        assert budget >= plan.NEED_MARGIN * plan.part_need(name), (
            f"{name}: a budget of {budget:g} s, below {plan.NEED_MARGIN:g} x the {need:g} s its commands need "
            f"on an H200")
        assert float(row[7]) == pytest.approx(budget / plan.part_need(name), abs=0.02)
    assert plan.DEFAULT_TOTAL_S[False] <= 580  # (with pip's install of the wheel, inside a 600-s call)
    # the runs' needs follow the commands: one per pytest run, bench.py run, train.py run; a bench.py run's rows
    # measured as time allows are not in it
    groups = 3 if set(cuda_tests.NEW_TESTS) & set(cuda_tests.cuda_test_files()) else 2  # (the newest files' own)
    assert len(plan.run_needs("tests")) == len(cuda_tests.cuda_test_runs()) == groups and (groups == 3 or not complete)
    assert [label for label, _ in plan.run_needs("steps")[1:]] == [label for label, _ in steps_part.STEP_RUNS]
    assert bench_runs.bench_rows(["--models=a,b", "--batch_size=12", "--cuda_graphs=False,True"]) == 4
    micro = dict(plan.run_needs("train"))["micro-batches 32, 24, 16 as one CUDA graph"]
    assert micro == figures.h200("bench_start_s") + figures.h200("bench_row_s")  # (24 and 16 as time allows)
    assert all(figure.where for figure in figures.H200.values())
    steps = plan.part_need("steps")
    monkeypatch.setattr(steps_part, "STEP_AT", (200, 3000))
    assert plan.part_need("steps") > steps + 30 > plan.BUDGETS["steps"].gpu
    monkeypatch.setattr(nanogpt_part, "NANOGPT_TRAIN", ("train.py", "config/train_shakespeare_char.py", "--max_iters=5000"))
    assert plan.part_need("nanogpt_train") > plan.BUDGETS["nanogpt_train"].gpu


def test_dry_run_prints_each_part_its_budget_and_what_it_runs(tmp_path, capsys, monkeypatch):
    """Every part's budget and commands, the rows measured as time allows and the runs made if time holds them
    said so, what the default run leaves out; a flag this checkout's bench.py lacks is left out of the
    commands, saying so."""
    table = dry_run_table(tmp_path, capsys)
    budgets = gpu_check.parse_args([f"--out={tmp_path / 'c.json'}"]).budgets
    for name, budget in budgets.items():
        row = next(line for line in table if line.startswith(f"{name} "))
        assert row.split()[1] == f"{budget:.0f}", (name, row)
    text = "\n".join(table)
    assert "--batch_size=12 --cuda_graphs=True" in text and "--hf_reference" not in text
    assert "--batch_size=32,24,16 --cuda_graphs=True" in text and "(the last 2 row(s) if time holds them)" in text
    tests = next(line for line in table if line.startswith("tests "))
    assert "-m cuda" in tests and tests.endswith(cuda_tests.GRAPH_TESTS) and "--verbosity=1" in tests
    assert "tests/test_engine.py" in text and "(if the part's time left holds it)" in text
    shakespeare = next(line for line in table if line.startswith("shakespeare "))
    assert "--async_save=True" in shakespeare and "--cuda_graphs=True" in shakespeare
    plain = table[table.index(shakespeare) + 1]
    assert "shakespeare_plain --overwrite=True" in plain and "--cuda_graphs" not in plain and "time left" in plain
    assert table[-2].split()[:2] == ["total", f"{plan.DEFAULT_TOTAL_S[False]:.0f}"]
    assert table[-1].startswith("not in the default run: nanogpt_train (nanoGPT's time to val 1.47, recorded")
    nanogpt = next(line for line in table if line.startswith("nanogpt "))
    if NANOGPT.is_dir() or nanogpt_part.nanogpt_dir(None):  # nanoGPT's own bench.py, run, not quoted
        assert "python bench.py --real_data=False --compile=True" in nanogpt
        assert "train_shakespeare_char" not in text  # (its training: --parts=nanogpt_train)
        assert not table[0].startswith("missing:")
    else:
        assert "no anchor" in nanogpt
    # a bench.py without the newer flags: they are left out, and said so; with them, in the commands
    monkeypatch.setattr(bench_runs, "bench_flags", lambda: {"models", "batch_size", "cuda_graphs", "loss_chunk",
                                                            "compile", "decode_window"})
    text = "\n".join(dry_run_table(tmp_path, capsys))
    assert "(left out: --fp8_head, --profile_step, which this checkout's bench.py lacks)" in text
    assert "(left out: --profile_decode, which this checkout's bench.py lacks)" in text
    assert "--fp8_head" not in text.replace("left out: --fp8_head", "") and "--decode_window=1,16,8,32" in text
    with_every_flag_and_test_file(monkeypatch)
    text = "\n".join(dry_run_table(tmp_path, capsys))
    assert "left out" not in text and "--profile_step=True --loss_chunk=default,plain --fp8_head=False,True" in text
    assert "--decode_window=1,16,8,32 --profile_decode=True" in text and "tests/test_fp8.py" in text


def test_what_is_missing_is_said_in_one_line_before_anything_runs(tmp_path, capsys, monkeypatch):
    """No shared data, no nanoGPT, a package not installed: --dry_run says so in its first line, and a run says
    it before its first part, whose package is missing, is skipped (saying which) instead of failing later."""
    monkeypatch.setattr(common, "shared_path", lambda relative: None)
    monkeypatch.setattr(nanogpt_part, "nanogpt_dir", lambda given: None)
    monkeypatch.setattr(plan, "PART_MODULES", {**plan.PART_MODULES,
                                                    "device": ("torch", "no_such_module_here"),
                                                    "decode": ("torch", "no_such_module_here")})
    table = dry_run_table(tmp_path, capsys, "--parts=decode,nanogpt,shakespeare,nanogpt_train,steps", "--total_s=900",
                          anchor=False)
    assert table[0].startswith("missing: the package no_such_module_here (device, decode skipped); tiny "
                               "Shakespeare's text") and "(nanogpt, nanogpt_train skipped: no anchor)" in table[0]
    assert "shakespeare, steps would download it; nanogpt_train skipped" in table[0]
    assert table[1].startswith("gpu_check plan")
    report = gpu_check.main(["--smoke", "--parts=decode", f"--out={tmp_path / 'r.json'}"])
    out = capsys.readouterr().out
    assert out.index("missing: the package no_such_module_here") < out.index("device (up to")
    assert report["missing"].startswith("missing: the package no_such_module_here")
    for name in ("device", "decode"):
        part = report["parts"][name]
        assert part["status"] == "skipped" and part["reason"].startswith("needs no_such_module_here, not installed")


def test_the_report_goes_to_out_and_names_the_commit_without_git(tmp_path, monkeypatch):
    """$OUT, where set, gets the JSON and the log by default; where .git did not travel, the commit comes from
    $GPU_CHECK_COMMIT or else shared/COMMIT, as the launcher wrote it."""
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    args = gpu_check.parse_args([])
    assert args.out.startswith(str(tmp_path / "out" / "gpu_check_")) and args.log == args.out[:-5] + ".log"
    copy = tmp_path / "tree"  # a copy of the working tree: no .git
    (copy / "shared").mkdir(parents=True)
    monkeypatch.setattr(common, "ROOT", copy)
    monkeypatch.delenv(common.COMMIT_ENV, raising=False)
    assert common.git_version() == {"commit": None, "dirty": None, "from": None}
    sha = "0123456789abcdef0123456789abcdef01234567"
    (copy / "shared" / "COMMIT").write_text(f"{sha}\ndirty\n")
    assert common.git_version() == {"commit": sha, "dirty": True, "from": str(copy / "shared" / "COMMIT")}
    monkeypatch.setenv(common.COMMIT_ENV, "abcdef1")
    assert common.git_version() == {"commit": "abcdef1", "dirty": False, "from": "$GPU_CHECK_COMMIT"}


def test_the_packages_each_part_needs_are_all_it_imports():
    """A part whose package is missing is skipped (PART_MODULES): that list must hold every package of the
    project's that the parts' scripts import. With every other dependency made unimportable, train.py,
    bench.py, the data's preparation, the memory plan and the CUDA test files still import (crc32c, a
    dependency the GPU image lacked, was found this way)."""
    text = (common.ROOT / "pyproject.toml").read_text()
    deps = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    names = {line.split('"')[1].split(">")[0].split("=")[0].split("[")[0].replace("-", "_")
             for line in deps.splitlines() if '"' in line}
    blocked = sorted(names - set(plan.OURS))
    assert "crc32c" in names and "datasets" in blocked  # (the list read is pyproject's)
    modules = ["train", "bench", "prepare.shakespeare_char", "benchmarks.plan_memory"] + [
        path.removeprefix("tests/").removesuffix(".py") for _, files in cuda_tests.cuda_test_runs() for path in files]
    code = textwrap.dedent(f"""
        import importlib, importlib.abc, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in {blocked!r}:
                    raise ImportError(f"{{name}} is not installed (blocked)")
        sys.meta_path.insert(0, Block())
        for module in {modules!r}:
            importlib.import_module(module)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(common.ROOT), str(common.ROOT / "tests")])}
    done = subprocess.run([sys.executable, "-c", code], cwd=common.ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]



def test_the_check_itself_imports_only_the_standard_library():
    """The check's own process (the driver and every part's module) imports neither torch nor any other package:
    it runs the parts as subprocesses, and reads the device in a child, so that it starts where a package is
    missing and says so (the parts that need it skipped) instead of failing at its import."""
    code = textwrap.dedent("""
        import importlib.abc, pkgutil, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in {"torch", "numpy", "tiktoken", "tqdm", "crc32c", "transformers", "pytest"}:
                    raise ImportError(f"{name} is blocked")
        sys.meta_path.insert(0, Block())
        import benchmarks.gpu_check
        for module in pkgutil.iter_modules(benchmarks.gpu_check.__path__):
            __import__(f"benchmarks.gpu_check.{module.name}")
        print(len([name for name in sys.modules if name.startswith("benchmarks.gpu_check.")]))
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=common.ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(common.ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout) >= 10  # (the parts' modules, each imported)


NANOGPT_OUTPUT = """Compiling model...
0/10 loss: 10.9876
time per iteration: 26.3456ms, MFU: 40.12%
step 0: train loss 4.2874, val loss 4.2823
iter 0: loss 4.2654, time 19876.54ms, mfu -100.00%
iter 100: loss 2.3456, time 8.10ms, mfu 30.00%
iter 110: loss 2.3000, time 7.90ms, mfu 30.20%
iter 120: loss 2.2000, time 8.40ms, mfu 29.80%
step 250: train loss 1.9876, val loss 2.0654
"""


def test_nanogpts_output_is_read():
    """bench.py's ms per iteration and MFU, train.py's evaluations and its iter times (after its compile)."""
    found = nanogpt_part.nanogpt_results(NANOGPT_OUTPUT)
    assert found["bench_ms"] == 26.3456 and found["bench_mfu"] == pytest.approx(0.4012)
    assert found["evaluations"] == [{"step": 0, "train_loss": 4.2874, "val_loss": 4.2823},
                                    {"step": 250, "train_loss": 1.9876, "val_loss": 2.0654}]
    assert found["iter_ms_median"] == 8.10  # iters 100-120, not the compile's 19,876 ms at iter 0
    assert nanogpt_part.nanogpt_results("crashed")["bench_ms"] is None


def quick_device(check, args) -> dict:
    """The device part's stand-in where a test needs none of it (its child process takes seconds)."""
    return {"status": "ok", "reason": None, "runs": []}


def test_a_part_that_ends_early_passes_its_time_to_the_next(tmp_path, monkeypatch):
    """Each part may run until where its time would end had every part before it used its whole budget: a part
    that ends at once leaves its budget to the next, and so on to the last, which gets the whole check's time
    but the device's (itself used at once here)."""
    left = {}

    def part(name):
        def run(check, args):
            left[name] = check.left()
            return {"status": "ok", "reason": None, "runs": []}
        return run

    for name in ("device", "decode", "train", "tests"):
        monkeypatch.setitem(plan.PARTS, name, part(name))
    report = gpu_check.main(["--smoke", "--parts=decode,train,tests", f"--out={tmp_path / 'c.json'}"])
    budgets = report["budgets_s"]
    assert left["device"] == pytest.approx(budgets["device"], abs=2)
    assert left["decode"] == pytest.approx(budgets["device"] + budgets["decode"], abs=2)
    assert left["train"] == pytest.approx(budgets["device"] + budgets["decode"] + budgets["train"], abs=2)
    total = plan.DEFAULT_TOTAL_S[True] - 2 * checks.GRACE_S
    assert left["tests"] == pytest.approx(total, abs=2) and sum(budgets.values()) == pytest.approx(total, abs=2)
    assert [report["parts"][name]["budget_s"] for name in ("decode", "train")] == [budgets["decode"],
                                                                                   budgets["train"]]


def train_row(batch: int) -> dict:
    return {"kind": "train", "status": "ok", "model": "tinynobias", "batch_size": batch, "ms": 10.0 * batch,
            "tokens_per_s": 3200.0, "mfu": 0.1, "flops_per_token": 1000, "cuda_graphs": False}


def test_a_check_cut_short_keeps_on_disk_what_it_measured(tmp_path, monkeypatch):
    """The JSON is rewritten as each bench.py run ends (a snapshot taken by the part's second run holds the
    first run's rows) and as each part ends, with the summary of what is there: a check cut short in a later
    part (the call's limit: here an interrupt, as SIGTERM is made) leaves every row measured before it in the JSON
    under --out, and says where it was cut."""
    monkeypatch.setattr(checks, "MIN_RUN_S", 0)
    out, snapshot = tmp_path / "out" / "check.json", tmp_path / "mid_part.json"

    def fake_bench(options, extra, path):
        row = train_row(int(common.option(extra, "batch_size")))
        code = f"import json, shutil; json.dump({{'rows': [{row!r}]}}, open({str(path)!r}, 'w'))"
        if path.stem.endswith("_1"):  # (the second run: what is on disk while the part still runs)
            code = f"import shutil; shutil.copyfile({str(out)!r}, {str(snapshot)!r}); {code}"
        return [sys.executable, "-c", code]

    monkeypatch.setattr(bench_runs, "bench_command", fake_bench)
    monkeypatch.setattr(gpt2_step, "SMOKE_TRAIN_RUNS", (("first", ["--batch_size=2"], 0), ("second", ["--batch_size=4"],
                                                                                           0)))
    monkeypatch.setitem(plan.PARTS, "device", quick_device)
    on_disk = {}

    def cut(check, args):
        on_disk.update(json.loads(out.read_text()))
        handler = signal.getsignal(signal.SIGTERM)
        assert handler is gpu_check.interrupt  # (while the check runs)
        handler(signal.SIGTERM, None)  # (the call's limit, mid-part)

    monkeypatch.setitem(plan.PARTS, "shakespeare", cut)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit, match="interrupted"):
        gpu_check.main(["--smoke", "--parts=train,shakespeare", f"--out={out}"])
    assert signal.getsignal(signal.SIGTERM) is before
    mid = json.loads(snapshot.read_text())
    assert [r["batch_size"] for r in mid["rows"]] == [2] and "train" not in mid["parts"]
    assert mid["summary"]["train_12x1024_no_bias"]["ms"] == 20.0  # (the summary of the rows so far)
    assert [r["batch_size"] for r in on_disk["rows"]] == [2, 4] and on_disk["parts"]["train"]["status"] == "ok"
    final = json.loads(out.read_text())  # (still there after the cut, saying where it was cut)
    assert final["rows"] == on_disk["rows"] and "(SIGTERM)" in final["cut_short"]
    assert "during the part shakespeare" in final["cut_short"]
    assert not out.with_name(out.name + ".partial").exists()


def test_a_run_stopped_after_its_wanted_rows_keeps_its_part_ok(tmp_path, monkeypatch):
    """A bench.py run whose last rows are measured only as time allows (micro-batches 24 and 16 after 32): stopped
    at the part's end after its first row, it is "stopped" and the part ok, saying how many rows it measured;
    stopped before that row, a timeout."""
    monkeypatch.setattr(checks, "MIN_RUN_S", 0)
    written = {"rows": [train_row(32)]}

    def fake_bench(options, extra, path):
        rows = written if "32" in common.option(extra, "batch_size") else {"rows": []}
        return [sys.executable, "-c", f"import json, time; json.dump({rows!r}, open({str(path)!r}, 'w')); "
                                      f"time.sleep(60)"]

    monkeypatch.setattr(bench_runs, "bench_command", fake_bench)
    check = checks.Check(gpu_check.parse_args(["--smoke", f"--out={tmp_path / 'c.json'}"]))
    try:
        runs = [("micro-batches", ["--batch_size=32,24,16"], 2)]
        check.part_end = time.monotonic() + 2
        part = bench_runs.bench_part(check, "train", runs, [])
        assert part["status"] == "ok" and [r["status"] for r in part["runs"]] == ["stopped"]
        assert part["cut_short"] == ["micro-batches: 1 of 3 rows (the last 2 as time allowed)"]
        check.part_end = time.monotonic() + 0.5  # (no row is ever written: the end comes first, however soon)
        part = bench_runs.bench_part(check, "train", [("micro-batches", ["--batch_size=24,16"], 1)], [])
        assert part["status"] == "timeout" and not part["cut_short"]
    finally:
        check.close()
    assert [r["batch_size"] for r in check.report["rows"]] == [32]
