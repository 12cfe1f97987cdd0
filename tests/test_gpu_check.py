"""benchmarks/gpu_check.py: its --smoke rehearsal on the CPU runs every part or says why not, its report has
the structure a GPU run's will have, and a run that hangs is stopped at its time limit without losing the rest."""

import json
import sys

from conftest import SHARED_DATA

from benchmarks import gpu_check


def test_smoke_runs_every_part_or_says_why_not(tmp_path):
    text = SHARED_DATA / "tinyshakespeare.txt"
    # Without a local copy the Shakespeare part would try a download: left out here (skipped, with the reason).
    extra = [f"--shakespeare_text={text}"] if text.is_file() else ["--parts=tests,train,decode,plan,serve"]
    out = tmp_path / "check.json"
    report = gpu_check.main(["--smoke", f"--out={out}", *extra])
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
    """The summary picks the fastest 12 x 1024 row without biases (against nanoGPT's 26.3 ms), the best tokens/s
    with the device's floor, and compiled decode and prefill against their targets."""
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
    report = {"rows": rows, "device": {"name": "NVIDIA H200"}, "parts": {"plan": {"rows": [{"error": -0.013}]}}}
    summary = gpu_check.summarise(report, smoke=False)
    first = summary["train_12x1024_no_bias"]
    assert first["variant"]["sdpa"] == "cudnn" and abs(first["value"] - 26.3 / 22.0) < 1e-9 and first["met"]
    best = summary["train_best_tokens_per_s"]
    assert best["variant"]["batch_size"] == 32 and best["target"] == 600_000 and best["met"] is True
    assert summary["decode_compiled_batch1_tokens_per_s"]["met"] and summary["prefill_ms"]["met"]
    assert summary["plan_worst_error"]["value"] == 0.013 and summary["shakespeare_s_to_val"]["value"] is None
    assert summary["shakespeare_ms_per_step_late"]["value"] is None
    # sample.py --compile=auto's threshold: 40 s to compile, 5.0 - 0.22 ms saved per token (the cached eager row)
    assert summary["decode_eager_vs_transformers"]["value"] is None  # (no transformers row here)
    cost = summary["decode_compile_cost"]
    assert cost["compile_s"] == 40.0 and abs(cost["saved_ms_per_token"] - 4.78) < 1e-9
    assert cost["value"] == round(40.0 / 0.00478)
