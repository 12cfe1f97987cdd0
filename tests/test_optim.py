"""optim.py: the learning-rate schedule and the optimizer's parameter groups."""

import pytest
import torch

from gptkit.config import TrainConfig
from gptkit.optim import get_lr, make_optimizer


def test_lr_schedule():
    cfg = TrainConfig(learning_rate=1e-3, min_lr=1e-4, warmup_iters=10, lr_decay_iters=100)
    assert 0 < get_lr(0, cfg) < get_lr(5, cfg) < get_lr(9, cfg) <= 1e-3
    assert get_lr(10, cfg) == pytest.approx(1e-3)
    assert get_lr(55, cfg) == pytest.approx(5.5e-4)
    assert get_lr(100, cfg) == pytest.approx(1e-4) and get_lr(1000, cfg) == 1e-4
    assert get_lr(0, TrainConfig(warmup_iters=0, learning_rate=1e-3, min_lr=1e-4)) == pytest.approx(1e-3)
    assert get_lr(50, TrainConfig(decay_lr=False, learning_rate=2e-3)) == 2e-3


def test_optimizer_decays_matrices_only(tiny_model):
    opt = make_optimizer(tiny_model, TrainConfig(weight_decay=0.1), "cpu")
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    n_opt = sum(p.numel() for g in opt.param_groups for p in g["params"])
    assert n_opt == tiny_model.num_params(non_embedding=False)  # the tied weight is optimised once


@pytest.mark.parametrize("saved_on, resumed_on", [("cpu", "cuda"), ("cuda", "cpu")])
def test_resume_keeps_this_machines_fused_choice(saved_on, resumed_on):
    """A checkpoint's param groups carry the saving machine's `fused`; the resuming optimizer keeps its own
    (the CUDA choice is fused=True, which torch also runs on CPU tensors, so both sides run here)."""
    from gptkit.optim import load_optimizer_state

    cfg = TrainConfig(learning_rate=1e-3)
    model = torch.nn.Linear(4, 3)
    saved = make_optimizer(model, cfg, saved_on)
    model(torch.randn(2, 4)).sum().backward()
    saved.step()
    resumed = make_optimizer(model, cfg, resumed_on)
    load_optimizer_state(resumed, saved.state_dict())
    want = True if resumed_on == "cuda" else None
    assert [g["fused"] for g in resumed.param_groups] == [want] * len(resumed.param_groups)
    assert resumed.state_dict()["state"][0]["exp_avg"].equal(saved.state_dict()["state"][0]["exp_avg"])
