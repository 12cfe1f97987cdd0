"""gptkit/threads.py: the thread count every script computes with (the cores other processes leave free,
OMP_NUM_THREADS, --threads), and train.py's and eval.py's --threads: chosen, applied, said, recorded in
runs.jsonl, and torch's count given back when main() returns."""

import itertools
import json
import os
from pathlib import Path

import pytest
import torch
from conftest import tiny_args, torch_threads, train_script

import eval as evaluate
from gptkit import threads
from gptkit.config import TrainConfig
from gptkit.threads import Threads, resolve_threads

train = train_script()


def pretend_busy(monkeypatch, busy: float) -> None:
    """This machine as 2 cores of which `busy` are kept busy by other processes (/proc/stat's ticks over the
    wait: `busy` cores of 2 busy for all 100 ticks of the interval, at every measurement), measured at once."""
    samples = itertools.cycle([(1000, 5000, 2), (1000 + round(50 * busy), 5100, 2)])
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(threads, "_cpu_times", lambda: next(samples))
    monkeypatch.setattr(threads.time, "sleep", lambda seconds: None)


@pytest.mark.parametrize("busy, expected", [(0.0, 2), (0.6, 1), (1.4, 1), (7.0, 1)])
def test_choose_threads_leaves_the_busy_cores(monkeypatch, busy, expected):
    pretend_busy(monkeypatch, busy)
    n, why = threads.choose_threads(seconds=0)
    assert n == expected and why == f"auto: 2 cores, {busy:.1f} busy with other processes"


@pytest.mark.parametrize("load, expected", [(0.0, 2), (1.4, 1)])
def test_without_proc_stat_the_load_average_stands_in(monkeypatch, load, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(threads, "_cpu_times", lambda: None)
    monkeypatch.setattr(os, "getloadavg", lambda: (load, 0.0, 0.0))
    n, why = threads.choose_threads(seconds=0)
    assert n == expected and why == f"auto: 2 cores, load average {load:.1f}"


def test_busy_cores_reads_this_machine():
    # The real /proc/stat (Linux): a figure between 0 and the machine's CPUs.
    if not Path("/proc/stat").exists():
        pytest.skip("no /proc/stat on this platform")
    busy = threads.busy_cores(0.05)
    assert busy is not None and 0.0 <= busy <= os.cpu_count() + 1e-9


def test_threads_then_omp_num_threads_then_auto(monkeypatch):
    """--threads wins; else on the CPU OMP_NUM_THREADS (the count torch read at its start); else the cores left
    free. On a GPU auto keeps torch's own count and measures nothing; a negative count is refused."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    pretend_busy(monkeypatch, 1.0)
    assert resolve_threads(0, "cpu") == Threads(1, "auto: 2 cores, 1.0 busy with other processes", auto=True)
    assert resolve_threads(0, "cpu").describe() == ("1 thread (auto: 2 cores, 1.0 busy with other processes; "
                                                    "--threads to choose)")
    assert resolve_threads(1, "cpu") == Threads(1, "--threads") and resolve_threads(1, "cuda").n == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    with torch_threads(5):  # (what torch read from it at its start)
        assert resolve_threads(0, "cpu") == Threads(5, "OMP_NUM_THREADS")
        assert resolve_threads(2, "cpu").n == 2
        gpu = resolve_threads(0, "cuda")
        assert gpu.n is None and gpu.record() == {"n": 5, "why": "torch's own count: on cuda the device computes"}
    with pytest.raises(ValueError, match=r"threads must be >= 0 \(0 = auto\), got -1"):
        resolve_threads(-1, "cpu")


def test_applied_sets_the_count_and_gives_the_old_one_back():
    with torch_threads(2):
        with Threads(1, "--threads").applied():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with Threads(None, "torch's own count").applied():  # a GPU run's auto: nothing set
            assert torch.get_num_threads() == 2


# ----------------------------------------------------------------------------- train.py and eval.py


def runs(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]


def test_train_py_chooses_says_and_records_its_threads(char_dataset, tmp_path, monkeypatch, capsys):
    """train.py's default is auto (one of this machine's 2 cores busy: 1 thread), said at the start and
    recorded in runs.jsonl with why; --threads=2 is taken as given; torch's count is given back on return."""
    assert TrainConfig().threads == 0  # auto, the default
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    pretend_busy(monkeypatch, 1.0)
    out = tmp_path / "out"
    seen = []
    real_setup = train.setup_run
    monkeypatch.setattr(train, "setup_run", lambda *a, **k: (seen.append(torch.get_num_threads()), real_setup(*a, **k))[1])
    with torch_threads(2):
        train.main(tiny_args(char_dataset, out, max_iters=2, threads=0))
        assert torch.get_num_threads() == 2  # given back
        assert seen == [1]  # the run computed with the count it chose
        assert "threads: 1 thread (auto: 2 cores, 1.0 busy with other processes; --threads to choose)" in \
            capsys.readouterr().out.splitlines()
        assert runs(out)[0]["threads"] == {"n": 1, "why": "auto: 2 cores, 1.0 busy with other processes"}
        train.main(tiny_args(char_dataset, out, max_iters=3, init_from="resume", threads=2))
        assert seen == [1, 2] and torch.get_num_threads() == 2
        assert "threads: 2 threads (--threads)" in capsys.readouterr().out.splitlines()
        assert runs(out)[1]["threads"] == {"n": 2, "why": "--threads"}
    with pytest.raises(SystemExit, match=r"threads must be >= 0 \(0 = auto\), got -2"):
        train.main(tiny_args(char_dataset, tmp_path / "bad", threads=-2))


def test_eval_py_takes_threads_too(char_dataset, tmp_path, capsys):
    out = tmp_path / "out"
    train.main(tiny_args(char_dataset, out, max_iters=2))
    with torch_threads(2):
        result = evaluate.main([f"--ckpt={out}", "--task=loss", "--device=cpu", "--threads=1", "--limit=2"])
        assert torch.get_num_threads() == 2
    assert result["task"] == "loss"
    assert "process(es) on cpu float32, 1 thread (--threads);" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"threads must be >= 0 \(0 = auto\), got -1"):
        evaluate.main([f"--ckpt={out}", "--task=loss", "--threads=-1"])
