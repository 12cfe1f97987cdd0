"""metrics.py: the peak-FLOPs table, and rates that leave out the first (compile, warm-up) step."""

import json
import re

import pytest
import torch

from gptkit import lora, metrics
from gptkit.metrics import Metrics, peak_flops, peak_flops_for
from gptkit.plan import flops_per_token
from model import GPT, GPTConfig


def test_mfu_is_not_claimed_on_cpu():
    assert peak_flops(torch.device("cpu")) is None


@pytest.mark.parametrize("name, flops", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 NVL", 835e12), ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H200", 989e12), ("NVIDIA H800", 989e12), ("NVIDIA L4", 121e12), ("NVIDIA L40", 181e12),
    ("NVIDIA L40S", 362e12), ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA GeForce RTX 4090", 165e12),
    ("NVIDIA GeForce GTX 1080", None), ("Tesla T4", None),
    # a variant word after the model number: its own entry (or none), never the plain part's figure
    ("NVIDIA H200 NVL", 835e12), ("NVIDIA A100-PCIE-40GB", 312e12), ("NVIDIA A100 80GB PCIe", 312e12),
    ("NVIDIA B200 NVL", None),
])
def test_peak_flops_table_matches_whole_names(name, flops):
    assert peak_flops_for(name) == flops


@pytest.mark.parametrize("dtype, flops", [(torch.bfloat16, 989e12), (torch.float16, 989e12),
                                          (torch.float32, 495e12)])
def test_float32_runs_are_measured_against_the_tf32_peak(monkeypatch, dtype, flops):
    """A float32 run on CUDA multiplies in TF32 (setup_runtime), whose dense peak is half the bf16 one."""
    monkeypatch.setattr(metrics.torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert peak_flops(torch.device("cuda", 0), dtype) == flops


def matmul_weights(c: GPTConfig) -> int:
    """The model's matmul weights, counted from its shape: per block c_attn 3C x C, attn.c_proj C x C, c_fc
    4C x C, mlp.c_proj C x 4C; and the head, Vp x C. The embeddings (wte when untied, wpe) are lookups."""
    return c.n_layer * 12 * c.n_embd**2 + c.padded_vocab_size * c.n_embd


@pytest.mark.parametrize("arch", ["gpt2", "modern"])  # tied head (wte is the head) / untied (lm_head)
def test_flops_per_token_counts_the_matmul_weights_once(arch):
    c = GPTConfig(block_size=16, vocab_size=100, n_layer=2, n_head=2, n_embd=32, vocab_multiple=64, arch=arch)
    attention = 12 * c.n_layer * c.n_embd * c.block_size
    assert flops_per_token(GPT(c)) == 6 * matmul_weights(c) + attention


def test_flops_per_token_counts_frozen_weights_at_four():
    """LoRA: the frozen base weights need the forward and the input gradient (4 FLOPs per weight and token),
    not their own gradient; the adapters are trained (6)."""
    c = GPTConfig(block_size=16, vocab_size=100, n_layer=2, n_head=2, n_embd=32)
    rank = 4
    model = lora.apply(GPT(c), lora.LoRASettings(rank=rank))  # all four Linear layers of every block
    # A (rank, in) and B (out, rank) per layer (in -> out): c_attn C -> 3C, attn.c_proj C -> C,
    # c_fc C -> 4C, mlp.c_proj 4C -> C
    adapters = c.n_layer * rank * (4 + 2 + 5 + 5) * c.n_embd
    assert adapters == sum(p.numel() for p in model.parameters() if p.requires_grad)
    attention = 12 * c.n_layer * c.n_embd * c.block_size
    assert flops_per_token(model) == 4 * matmul_weights(c) + 6 * adapters + attention


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


def run_steps(m: Metrics, clock: Clock, seconds: list[float], log_interval: int) -> None:
    """Steps taking seconds[i] each (the first, warm-up, left out of the rates), logged every log_interval."""
    for step, dt in enumerate(seconds, start=1):
        clock.t += dt
        m.step_done()
        if step == 1:
            m.start_timing()
        if step % log_interval == 0:
            m.log_step(step, loss=2.0, lr=1e-3, grad_norm=1.0, epoch=0.0)


@pytest.mark.parametrize("log_interval", [1, 10])
def test_steps_far_slower_than_the_first_ones_get_one_note_with_the_threads_to_use(tmp_path, monkeypatch, capsys,
                                                                                  log_interval):
    """On the CPU, with 2 threads: steps of 40 ms, then 400 ms (a busy neighbour) give one note, once, as soon
    as the recent median is 3x the early one, naming both and --threads=1 (the cores left free, measured then:
    here 1); steps 2x slower give none, nor a GPU run's."""
    clock = Clock()
    monkeypatch.setattr(metrics.time, "perf_counter", clock)
    monkeypatch.setattr(metrics, "choose_threads", lambda: (1, "auto: 2 cores, 1.0 busy with other processes"))

    def notes(threads: int | None, slow: float) -> list[str]:
        m = Metrics(tmp_path, master=True, tokens_per_step=1000, flops_per_token=6.0, peak_flops=None, world_size=1,
                    max_iters=1000, device=torch.device("cpu"), log_interval=log_interval, cpu_threads=threads)
        run_steps(m, clock, [5.0] + [0.04] * 60 + [slow] * 300, log_interval)  # warm-up, 60 steps of 40 ms, slower
        return [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]

    said = notes(2, 0.4)
    assert len(said) == 1
    # the median of the recent steps once it is 3x the early one or more (halfway through the change: 220 ms)
    slower = re.fullmatch(r"note: steps now take ([\d,]+) ms, ([\d.]+)x the first ones' 40 ms: (.*)", said[0])
    assert slower and float(slower[2]) >= 3 and int(slower[1]) == pytest.approx(40 * float(slower[2]), abs=1)
    assert slower[3] == ("other processes are likely using the cores this run's 2 threads compute on, and each "
                         "product waits for its slowest thread; fewer threads run faster then: stop (Ctrl-C saves "
                         "last.pt) and go on with --init_from=resume --threads=1")
    assert notes(2, 0.08) == [] and notes(None, 0.4) == []  # 2x slower; a GPU run
    said = notes(1, 0.4)  # one thread already: no setting to suggest
    assert len(said) == 1 and said[0].endswith("x the first ones' 40 ms: other processes are likely using the core "
                                               "this run computes on")
