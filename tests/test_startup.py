"""gptkit/startup.py through train.py: the seconds before the config line, by phase, printed as one line before
the config and kept in runs.jsonl; the device's phase waits for a CUDA device's start."""

import json

import torch
from conftest import tiny_args, train_script

from gptkit import runtime, startup

train = train_script()


def test_train_prints_and_records_where_its_start_went(char_dataset, tmp_path, capsys):
    out = tmp_path / "out"
    train.main(tiny_args(char_dataset, out, max_iters=2, eval_interval=100))
    printed = capsys.readouterr().out.splitlines()
    phases = json.loads((out / "runs.jsonl").read_text().splitlines()[-1])["start"]
    assert list(phases) == ["imports", "config", "device", "data", "model", "setup"]
    assert all(seconds >= 0 for seconds in phases.values())
    # the phases add up to the process' age at the config line: no more than its age now
    assert phases["imports"] > 0 and sum(phases.values()) <= runtime.process_elapsed()
    line = next(i for i, text in enumerate(printed) if text.startswith("start: "))
    assert printed[line + 1] == "config:"  # (just before the config)
    assert printed[line] == startup.line() and "imports " in printed[line] and "setup " in printed[line]


def test_the_device_phase_waits_for_a_cuda_devices_start(monkeypatch):
    """torch.cuda.synchronize on a CUDA device (its context is made lazily: its cost lands in "device"), never
    on the CPU; no trace begun, nothing recorded."""
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    monkeypatch.setattr(startup, "_PHASES", None)
    startup.mark("device", torch.device("cuda", 0))
    assert waited == [] and startup.record() is None and startup.line() == "start: not traced"
    startup.begin()
    startup.mark("device", torch.device("cpu"))
    startup.mark("device", torch.device("cuda", 0))
    assert waited == [torch.device("cuda", 0)] and list(startup.record()) == ["imports", "device"]
