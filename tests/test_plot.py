"""plot.py: loss curves of one or several runs from their metrics.jsonl, as a PNG."""

import json
import struct
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib")

import plot  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(folder: Path, steps: int = 20, hellaswag: bool = False, config: bool = True, resumed: bool = False,
              seed: int = 0) -> Path:
    """An out_dir as train.py leaves it: training lines every step, an evaluation every 5 steps."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    lines = []
    for step in range(steps + 1):
        if step % 5 == 0:
            entry = {"step": step, "val_loss": 4.0 / (1 + step / 10), "best_val_loss": 4.0 / (1 + step / 10)}
            if hellaswag:
                entry.update(hellaswag_acc=0.25, hellaswag_acc_norm=0.25 + step / 1000)
            lines.append(entry)
        if step < steps:
            lines.append({"step": step + 1, "loss": 4.2 / (1 + step / 10) + rng.normal(0, 0.05), "lr": 1e-3,
                          "grad_norm": 1.0, "ms_per_step": None if step == 0 else 120.0,
                          "tokens_per_s": 1000.0, "mfu": None, "peak_mem_mb": 100.0, "epoch": 0.1})
    if resumed:  # the run stopped after step 12 and resumed from its step-10 checkpoint
        lines = [e for e in lines if e["step"] <= 12] + [e for e in lines if e["step"] >= 10]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    if config:
        (folder / "config.json").write_text(json.dumps({"batch_size": 4, "block_size": 64,
                                                        "gradient_accumulation_steps": 2}))
    return folder


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_one_run(tmp_path):
    run = write_run(tmp_path / "out")
    out = plot.main([str(run), "--out", str(tmp_path / "loss.png")])
    width, height = png_size(out)
    assert (width, height) == (700, 420)  # one panel


def test_two_runs_with_hellaswag_on_every_axis(tmp_path):
    a = write_run(tmp_path / "a", hellaswag=True)
    b = write_run(tmp_path / "b", resumed=True, seed=1)
    for x in ("step", "tokens", "time"):
        out = tmp_path / f"{x}.png"
        plot.main([str(a), str(b), "--out", str(out), "--x", x, "--logy"])
        assert png_size(out) == (1100, 420)  # a second panel for HellaSwag


def test_a_resumed_run_is_one_curve_and_time_sums_the_step_times(tmp_path):
    run = plot.read_run(write_run(tmp_path / "out", resumed=True), "out")
    assert [r["step"] for r in run.train] == list(range(1, 21))
    assert [r["step"] for r in run.evals] == [0, 5, 10, 15, 20]
    assert run.tokens_per_step == 4 * 64 * 2
    # minutes: step 1 is untimed (ms_per_step null), every later step took 120 ms
    expected = [0] + [(s - 1) * 120 / 60_000 for s in (5, 10, 15, 20)]
    np.testing.assert_allclose(plot.x_values(run, run.evals, "time"), expected)
    np.testing.assert_allclose(plot.x_values(run, run.evals, "tokens"), [0, 2560, 5120, 7680, 10240])


def test_errors_are_one_line(tmp_path, capsys):
    def expect(args, fragment):
        with pytest.raises(SystemExit) as e:
            plot.main(args)
        assert isinstance(e.value.code, str) and e.value.code.startswith("error: ") and fragment in e.value.code

    (tmp_path / "empty").mkdir()
    expect([str(tmp_path / "empty")], "has no metrics.jsonl")
    expect([str(tmp_path / "missing")], "does not exist")
    run = write_run(tmp_path / "noconfig", config=False)
    expect([str(run), "--x", "tokens", "--out", str(tmp_path / "x.png")], "config.json")
    expect([str(run), "--x", "hours"], "x must be one of step, tokens, time; got 'hours'")
    expect(["--x", "step"], "give at least one run folder")
    expect([str(run), "--ot", "a.png"], "unknown config key 'ot' (in the command line); did you mean 'out'?")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{oops\n{"step": 2, "loss": 1.0}\n')
    expect([str(run)], "line 2")


def test_an_unfinished_last_line_is_skipped_and_said(tmp_path, capsys):
    run = write_run(tmp_path / "out")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 99, "lo')  # a line being written
    plot.main([str(run), "--out", str(tmp_path / "x.png")])
    assert "skipped 1 unreadable line" in capsys.readouterr().err
    assert plot.read_run(run, "out").skipped == 1
