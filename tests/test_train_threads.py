"""benchmarks/train_threads.py runs: a tiny rehearsal of its train.py rows (no neighbours, 3 steps of a 1-layer
model), its table, and its one-line refusals. The figures themselves are for a quiet machine (BENCHMARKS.md)."""

import os

import pytest

from benchmarks import train_threads


def test_a_tiny_rehearsal_gives_a_figure_per_setting_and_the_threads_each_ran_with(shakespeare_path, tmp_path,
                                                                                    capsys):
    results = train_threads.main(["--steps=3", "--neighbours=0", "--repeats=1", "--settings=1,auto", f"--text={shakespeare_path}",
                                  f"--out={tmp_path}", "--", "--n_layer=1", "--n_head=1", "--n_embd=16"])
    assert set(results) == {"train.py 1 0", "train.py auto 0"}
    one, auto = results["train.py 1 0"][0], results["train.py auto 0"][0]
    assert one["threads"] == 1 and 1 <= auto["threads"] <= (os.cpu_count() or 1)
    assert one["ms"] > 0 and auto["ms"] > 0
    table = capsys.readouterr().out.split("| program |")[1]
    assert "0 busy: ms/step (threads)" in table and "| train.py | 1 | " in table and " (1) |" in table


def test_the_table_takes_the_median_of_the_repeats():
    results = {("train.py", "1", 0): [{"ms": 10.0, "threads": 1}, {"ms": 30.0, "threads": 1},
                                      {"ms": 20.0, "threads": 1}],
               ("train.py", "auto", 0): [{"ms": 5.0, "threads": 2}, {"ms": 7.0, "threads": 1}]}
    lines = train_threads.table(results, [0, 1], [("train.py", "1"), ("train.py", "auto")]).splitlines()
    assert lines[2] == "| train.py | 1 | 20.0 (10.0-30.0) (1) | n/a |"
    assert lines[3] == "| train.py | auto | 6.0 (5.0-7.0) (1/2) | n/a |"


def test_nanogpts_rows_give_a_ratio_per_repeat_with_its_range_and_verdict():
    """train.py's steps/s over nanoGPT's, repeat by repeat (a slow repeat slows both): the median and range of
    those ratios, and "at parity" where the two programs' ranges overlap."""
    ms = {("train.py", "auto", 0): [10.0, 20.0, 11.0], ("nanoGPT", "auto", 0): [12.0, 22.0, 13.2],
          ("train.py", "auto", 1): [10.0, 10.5, 11.0], ("nanoGPT", "auto", 1): [20.0, 20.0, 33.0]}
    results = {k: [{"ms": m, "threads": 2} for m in v] for k, v in ms.items()}
    text = train_threads.table(results, [0, 1], [("train.py", "auto"), ("nanoGPT", "auto")])
    assert "train.py auto, 0 busy: 1.20x (1.10-1.20) nanoGPT's steps/s, at parity" in text
    assert "train.py auto, 1 busy: 2.00x (1.90-3.00) nanoGPT's steps/s, ahead" in text


@pytest.mark.parametrize("args, match", [(["--settings=fast"], "--settings 'fast'"),
                                         (["--neighbours=a"], "--neighbours 'a'"),
                                         (["--steps=2"], "--steps >= 3")])
def test_bad_options_are_one_line_errors(args, match):
    with pytest.raises(SystemExit, match=match):
        train_threads.main(args)
