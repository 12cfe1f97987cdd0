"""benchmarks/gpu_check.py: its --smoke rehearsal on the CPU runs every part or says why not, its report has
the structure a GPU run's will have, and a run that hangs is stopped at its time limit without losing the rest."""

import json
import sys

import pytest
from conftest import SHARED_DATA

from benchmarks import gpu_check

# nanoGPT's own code, beside the checkout's shared data (as gpu_check finds it)
NANOGPT = SHARED_DATA.parent / "anchors" / "nanoGPT"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One --smoke run of every part (the test files share it: it is the suite's costliest rehearsal): the
    folder of its JSON and log, and its report."""
    tmp_path = tmp_path_factory.mktemp("smoke")
    text = SHARED_DATA / "tinyshakespeare.txt"
    # Without a local copy the Shakespeare part would try a download: left out here (skipped, with the reason).
    extra = [f"--shakespeare_text={text}"] if text.is_file() else ["--parts=tests,train,decode,plan,serve"]
    anchor = [f"--nanogpt={NANOGPT}"] if NANOGPT.is_dir() else []
    return tmp_path, gpu_check.main(["--smoke", f"--out={tmp_path / 'check.json'}", *extra, *anchor])


def test_smoke_runs_every_part_or_says_why_not(smoke):
    tmp_path, report = smoke
    text = SHARED_DATA / "tinyshakespeare.txt"
    out = tmp_path / "check.json"
    assert json.loads(out.read_text()) == json.loads(json.dumps(report, default=str))
    assert {"date", "command", "smoke", "device", "torch", "git", "parts", "rows", "summary"} <= set(report)
    assert report["device"]["torch"] == report["torch"] and report["device"]["peak"]["tflops_measured"] > 0
    assert set(report["parts"]) == set(gpu_check.PARTS)
    for name, part in report["parts"].items():
        assert part["status"] in ("ok", "skipped"), (name, part)
        assert part["status"] == "ok" or part["reason"], (name, part)  # every skip says why
        assert {"seconds", "budget_s", "runs"} <= set(part), (name, part)
        for run in part["runs"]:
            assert run["status"] in ("ok", "stopped") and run["command"], (name, run)
    # the CUDA tests were found and collected (skipped here, without CUDA), each with its outcome
    tests = report["parts"]["tests"]["results"]
    assert tests and all(t["outcome"] == "skipped" and "CUDA" in t["message"] for t in tests)
    kinds = {r["kind"] for r in report["rows"]}
    assert kinds == {"train", "decode", "prefill"}
    train = [r for r in report["rows"] if r["kind"] == "train"]
    assert {r["model"] for r in train} == {"tiny", "tinynobias"}
    assert any(r["status"] == "skipped" and r["sdpa"] == "cudnn" for r in train)  # no cuDNN attention on a CPU
    assert all(r["mfu_measured_peak"] > 0 for r in train if r["status"] == "ok")
    assert any(r["status"] == "skipped" and r["cuda_graphs"] and "CUDA device" in r["reason"] for r in train)
    if text.is_file():
        reached = report["parts"]["shakespeare"]["reached"]
        assert reached["val_loss"] <= 3.6 and reached["wall_s"] > 0
        # elapsed_s counts from train.py's process start: its imports and setup are in it
        assert 0 < reached["elapsed_s"]
        plain, graphed = report["parts"]["steps"]["steps"]
        assert plain["ms_per_step"]["100"] > 0 and plain["ms_per_step"]["300"] > 0 and plain["late_over_early"] > 0
        assert "no CUDA graph" in graphed["skipped"]
    assert set(report["summary"]) >= {"train_12x1024_no_bias", "decode_compiled_batch1_tokens_per_s", "prefill_ms"}
    # transformers' eager generate of the same shape, beside our eager decode
    assert any(r["model"] == "tiny (transformers)" and r["tokens_per_s"] > 0 for r in report["rows"])
    assert report["summary"]["decode_eager_vs_transformers"]["value"] > 0
    log = (tmp_path / "check.log").read_text()
    assert all(run["command"] in log for part in report["parts"].values() for run in part["runs"])


def test_a_hung_run_is_stopped_at_its_limit_and_the_check_goes_on(tmp_path, monkeypatch):
    """A run past its part's time is stopped (its whole process group) and reported as a timeout; a watched run
    is stopped once its watcher has what it needs."""
    monkeypatch.setattr(gpu_check, "MIN_RUN_S", 0)
    args = gpu_check.parse_args(["--smoke", f"--out={tmp_path / 'c.json'}"])
    check = gpu_check.Check(args)
    try:
        check.part_end = gpu_check.time.monotonic() + 1.5
        run = check.run("sleeper", [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"])
        assert run.status == "timeout" and run.seconds < 10 and "started" in run.output
        check.part_end = gpu_check.time.monotonic() + 30
        flag = tmp_path / "flag"
        run = check.run("watched", [sys.executable, "-c", f"open({str(flag)!r}, 'w'); import time; time.sleep(60)"],
                        watch=flag.exists)
        assert run.status == "stopped" and run.seconds < 10
        assert gpu_check.outcome([run, None], ["a", "b"]) == ("timeout", "stopped at or not reached within the "
                                                                         "time budget: b")
    finally:
        check.close()


def test_plan_memory_table_is_read():
    """benchmarks/plan_memory.py's CUDA table (the format it prints), rows and failures."""
    mib = "{:,.0f} MiB".format
    line = f"{'gpt2 124M b8':<16}{8:>6}{mib(9876):>12}{mib(9800):>12}{9876 / 9800 - 1:>+10.1%} "
    output = "\n".join([f"{'shape':<16}{'batch':>6}{'plan peak':>12}", line + f"{12.3:>9.1f}", "16: failed",
                        "Traceback (most recent call last):"])
    rows, failed = gpu_check.plan_rows(output)
    assert rows == [{"shape": "gpt2 124M b8", "batch": 8, "plan_mib": 9876, "allocator_mib": 9800, "error": 0.008}]
    assert failed == ["16"]


def test_summary_against_the_targets():
    """The summary picks the fastest 12 x 1024 row without biases (against nanoGPT's bench.py in the same call),
    the best tokens/s with the device's floor, and compiled decode and prefill against their targets."""
    def train(model, batch, ms, **variant):
        return {"kind": "train", "status": "ok", "model": model, "batch_size": batch, "ms": ms, "mfu": 0.4,
                "tokens_per_s": batch * 1024 / ms * 1000, "sdpa": "default", "compile_mode": "default",
                "compile_optimizer": False, **variant}

    rows = [train("gpt2nobias", 12, 24.0), train("gpt2nobias", 12, 22.0, sdpa="cudnn"), train("gpt2nobias", 32, 50.0),
            train("gpt2", 12, 30.0), {"kind": "train", "status": "skipped", "model": "gpt2nobias", "batch_size": 12},
            {"kind": "decode", "status": "ok", "compile": True, "batch_size": 1, "tokens_per_s": 4500.0,
             "ms": 0.22, "compile_s": 40.0, "kv_cache": True},
            {"kind": "decode", "status": "ok", "compile": False, "batch_size": 1, "tokens_per_s": 200.0, "ms": 5.0,
             "compile_s": None, "kv_cache": True},
            {"kind": "decode", "status": "ok", "compile": False, "batch_size": 1, "tokens_per_s": 20.0, "ms": 50.0,
             "compile_s": None, "kv_cache": False},
            {"kind": "prefill", "status": "ok", "ms": 4.0, "seq_len": 1000}]
    report = {"rows": rows, "device": {"name": "NVIDIA H200"},
              "parts": {"plan": {"status": "ok", "rows": [{"error": -0.013}]}, "nanogpt": {"bench": {"ms": 26.3}}}}
    summary = gpu_check.summarise(report, smoke=False)
    first = summary["train_12x1024_no_bias"]
    assert first["variant"]["sdpa"] == "cudnn" and abs(first["value"] - 26.3 / 22.0) < 1e-9 and first["met"]
    best = summary["train_best_tokens_per_s"]
    assert best["variant"]["batch_size"] == 32 and best["target"] == 600_000 and best["met"] is True
    assert first["nanogpt_ms"] == 26.3
    assert summary["decode_compiled_batch1_tokens_per_s"]["met"] and summary["prefill_ms"]["met"]
    assert summary["plan_worst_error"]["value"] == 0.013 and summary["shakespeare_s_to_val"]["value"] is None
    assert summary["shakespeare_ms_per_step_late"]["value"] is None
    # sample.py --compile=auto's threshold: 40 s to compile, 5.0 - 0.22 ms saved per token (the cached eager row)
    assert summary["decode_eager_vs_transformers"]["value"] is None  # (no transformers row here)
    cost = summary["decode_compile_cost"]
    assert cost["compile_s"] == 40.0 and abs(cost["saved_ms_per_token"] - 4.78) < 1e-9
    assert cost["value"] == round(40.0 / 0.00478)
    # no nanoGPT in the call: no speed-up, "no anchor"; no plan part asked: no plan figure promised
    report["parts"] = {"nanogpt": {"status": "skipped", "reason": "nanoGPT's code is not at shared/anchors"}}
    summary = gpu_check.summarise(report, smoke=False)
    assert summary["train_12x1024_no_bias"]["value"] is None and "plan_worst_error" not in summary
    assert summary["train_12x1024_no_bias"]["note"].startswith("no anchor: nanoGPT's code is not")


def test_the_default_plan_gives_every_part_its_floor_and_a_short_total_is_refused_before_it_starts(tmp_path):
    """The default run (on a GPU and in --smoke): the device read first with its own budget, every default part
    at least its floor, the budgets within --total_s; a --total_s below that is one line, before anything runs
    (no log, no JSON written)."""
    for smoke in (False, True):
        args = gpu_check.parse_args([*(["--smoke"] if smoke else []), f"--out={tmp_path / 'c.json'}"])
        budgets = args.budgets
        assert list(budgets) == ["device", *gpu_check.DEFAULT_PARTS]
        assert budgets["device"] >= gpu_check.DEVICE_BUDGET.of(smoke)[1]
        for name in gpu_check.DEFAULT_PARTS:
            assert budgets[name] >= gpu_check.BUDGETS[name].of(smoke)[1], (smoke, name, budgets)
        assert sum(budgets.values()) + 2 * gpu_check.GRACE_S <= args.total_s + 1e-9
        assert args.total_s == gpu_check.DEFAULT_TOTAL_S[smoke]
    with pytest.raises(SystemExit, match=r"^error: --total_s=300 is too short .*use --total_s=\d+ or more"):
        gpu_check.main([f"--out={tmp_path / 'short.json'}", "--total_s=300"])
    assert not (tmp_path / "short.json").exists() and not (tmp_path / "short.log").exists()
    # more time: every part's share grows, the device's stays its own
    roomy = gpu_check.parse_args(["--total_s=900", "--parts=train,decode", f"--out={tmp_path / 'c.json'}"]).budgets
    assert list(roomy) == ["device", "train", "decode"] and roomy["device"] == gpu_check.DEVICE_BUDGET.gpu
    assert roomy["train"] > gpu_check.BUDGETS["train"].gpu and abs(sum(roomy.values()) - 890) < 1e-6


def test_dry_run_prints_each_part_its_budget_and_what_it_runs(tmp_path, capsys):
    anchor = [f"--nanogpt={NANOGPT}"] if NANOGPT.is_dir() else []  # (else found in the checkout, or none)
    report = gpu_check.main(["--dry_run", f"--out={tmp_path / 'c.json'}", *anchor])
    assert report == {} and not (tmp_path / "c.json").exists()  # nothing ran
    table = capsys.readouterr().out
    budgets = gpu_check.parse_args([f"--out={tmp_path / 'c.json'}"]).budgets
    for name, budget in budgets.items():
        row = next(line for line in table.splitlines() if line.startswith(f"{name} "))
        assert row.split()[1] == f"{budget:.0f}", (name, row)
    assert "--batch_size=12 --cuda_graphs=False,True" in table and "--hf_reference" in table
    assert "--cuda_graphs=True" in next(line for line in table.splitlines() if "steps_1" in line)
    assert "-m cuda" in table and "tests/test_cudagraph_cuda.py" in table
    assert table.splitlines()[-1].split()[:2] == ["total", "480"]
    nanogpt = next(line for line in table.splitlines() if line.startswith("nanogpt "))
    if anchor or gpu_check.nanogpt_dir(None):  # nanoGPT's own bench.py and Shakespeare, run, not quoted
        assert "python bench.py --real_data=False --compile=True" in nanogpt
        assert "python train.py config/train_shakespeare_char.py" in table
    else:
        assert "no anchor" in nanogpt


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
    found = gpu_check.nanogpt_results(NANOGPT_OUTPUT)
    assert found["bench_ms"] == 26.3456 and found["bench_mfu"] == pytest.approx(0.4012)
    assert found["evaluations"] == [{"step": 0, "train_loss": 4.2874, "val_loss": 4.2823},
                                    {"step": 250, "train_loss": 1.9876, "val_loss": 2.0654}]
    assert found["iter_ms_median"] == 8.10  # iters 100-120, not the compile's 19,876 ms at iter 0
    assert gpu_check.nanogpt_results("crashed")["bench_ms"] is None


def test_nanogpt_runs_beside_ours_in_smoke(tmp_path, smoke):
    """The nanogpt part runs nanoGPT's own train.py (shrunk, on the CPU) from a copy of its folder with its own
    prepare.py, reads its evaluations and iter times from what it printed, and stops it at the threshold.
    Without a copy of nanoGPT the part and the summary say "no anchor"."""
    text = SHARED_DATA / "tinyshakespeare.txt"
    found = NANOGPT.is_dir() or gpu_check.nanogpt_dir(None) is not None
    if NANOGPT.is_dir() and text.is_file():
        report = smoke[1]  # the smoke run above ran nanoGPT beside ours
    else:
        report = gpu_check.main(["--smoke", f"--out={tmp_path / 'c.json'}", "--parts=nanogpt",
                                 *([f"--shakespeare_text={text}"] if text.is_file() else []), "--total_s=120"])
    part, summary = report["parts"]["nanogpt"], report["summary"]
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
