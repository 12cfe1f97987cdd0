"""metrics.py: the peak-FLOPs table, and rates that leave out the first (compile, warm-up) step."""

import json

import pytest
import torch

from gptkit import metrics
from gptkit.metrics import Metrics, peak_flops, peak_flops_for


def test_mfu_is_not_claimed_on_cpu():
    assert peak_flops(torch.device("cpu")) is None


@pytest.mark.parametrize("name, flops", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 NVL", 835e12), ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H200", 989e12), ("NVIDIA H800", 989e12), ("NVIDIA L4", 121e12), ("NVIDIA L40", 181e12),
    ("NVIDIA L40S", 362e12), ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA GeForce RTX 4090", 165e12),
    ("NVIDIA GeForce GTX 1080", None), ("Tesla T4", None),
])
def test_peak_flops_table_matches_whole_names(name, flops):
    assert peak_flops_for(name) == flops


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


@pytest.mark.parametrize("log_interval", [1, 3])
def test_rates_leave_out_the_first_step(tmp_path, monkeypatch, log_interval):
    clock = Clock()
    monkeypatch.setattr(metrics.time, "perf_counter", clock)
    m = Metrics(tmp_path, master=True, tokens_per_step=1000, flops_per_token=6.0, peak_flops=1e6, world_size=1,
                max_iters=100, device=torch.device("cpu"))
    for step in range(1, 2 * log_interval + 1):
        clock.t += 30.0 if step == 1 else 0.5  # the first step compiles: 30 s; then 0.5 s per step
        m.step_done()
        if step == 1:
            m.start_timing()
        if step % log_interval == 0:
            m.log_step(step, loss=2.0, lr=1e-3, grad_norm=1.0, epoch=0.0)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if r["ms_per_step"] is not None]
    assert timed and all(r["ms_per_step"] == pytest.approx(500.0) for r in timed)
    assert all(r["tokens_per_s"] == pytest.approx(2000.0) and r["mfu"] == pytest.approx(6e3 * 2 / 1e6) for r in timed)
    if log_interval == 1:  # the first line has only the warm-up step: no rate rather than a wrong one
        assert rows[0]["ms_per_step"] is None
