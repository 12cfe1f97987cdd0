"""gptkit/step_factory.py's make_step, the one place a run's step is built: bench.py's training rows,
batch_size=auto's trial step and the memory benchmarks build theirs there and run it; the plain and the graphed
step run one body (step.step_body); and the plan's peak for a DPO step is the allocator's, measured on that step."""

import copy

import pytest
import torch

import bench
from benchmarks import fsdp_memory
from gptkit import lora, optim, plan, runtime, step, step_factory
from gptkit.config import TrainConfig
from gptkit.objectives import make_objective
from gptkit.objectives.next_token import NextToken
from gptkit.plan import batch_size
from gptkit.runtime import Dist, Runtime
from gptkit.step_factory import OneBatch, make_step
from model import GPT, LOSS_CHUNK_ELEMENTS, GPTConfig


def spy_on(monkeypatch, module) -> list[dict]:
    """Every make_step that `module` calls from now on: its keywords, and how often the step it built ran."""
    built = []

    def spy(*args, **kwargs):
        train_step = make_step(*args, **kwargs)
        record = dict(kwargs, runs=0)
        built.append(record)
        real = train_step.__class__.__call__

        class Counted(train_step.__class__):
            def __call__(self, *a, **k):
                record["runs"] += 1
                return real(self, *a, **k)

        train_step.__class__ = Counted
        return train_step

    monkeypatch.setattr(module, "make_step", spy)
    return built


def test_bench_rows_build_their_step_with_make_step_and_time_it(monkeypatch):
    """bench.py's training rows, plain and graphed (the graph path allowed on the CPU, where it runs eagerly):
    one make_step each, with the row's choice of graphs, and the step it built is the one timed."""
    monkeypatch.setattr(runtime, "GRAPH_DEVICE_TYPES", ("cpu",))
    built = spy_on(monkeypatch, bench)
    rows = bench.main(["--models=tiny", "--device=cpu", "--warmup=1", "--repeats=1", "--accum=2", "--skip_decode",
                       "--compile=False", "--cuda_graphs=False,True"])
    trained = [r for r in rows if r["kind"] == "train"]
    assert len(trained) == 2 and all(r["tokens_per_s"] > 0 for r in trained)
    assert [b["graphs"] for b in built] == [False, True]
    assert all(b["accum"] == 2 and b["runs"] == 2 for b in built)  # the warm-up step and the one timed


@pytest.mark.parametrize("arch, optimizer", [("gpt2", "adamw"), ("modern", "muon")])
def test_the_trial_step_is_the_runs_step_at_learning_rate_zero(monkeypatch, arch, optimizer):
    """batch_size=auto's trial (fits_on_gpu, run here on the CPU where it always fits): one make_step of the
    run's objective, run once on a micro-batch of `batch` made-up sequences; the weights stay as they were (AdamW's
    and Muon's learning rates 0, weight decay included) and no gradient is left behind."""
    built = spy_on(monkeypatch, batch_size)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=37, n_layer=2, n_head=2, n_embd=16, arch=arch))
    before = copy.deepcopy(model.state_dict())
    cfg = TrainConfig(optimizer=optimizer, block_size=16, batch_size=None, weight_decay=0.1)
    seen = []
    monkeypatch.setattr(NextToken, "__call__", lambda self, m, b: seen.append(b[0].shape) or step.next_token_loss(m, b))
    assert batch_size.fits_on_gpu(model, cfg, Runtime(torch.device("cpu"), torch.float32), 3)
    assert len(built) == 1 and built[0]["accum"] == 1 and built[0]["runs"] == 1
    assert seen == [(3, 16)]
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert all(p.grad is None for p in model.parameters())


def test_the_memory_benchmarks_run_the_step_make_step_builds(monkeypatch):
    """benchmarks/fsdp_memory.py (one process here) takes its step through make_step, as loss_memory.py and
    plan_memory.py do; the gradients it counts are those the optimizer stepped with (the step frees them after)."""
    built = spy_on(monkeypatch, step_factory)  # (the benchmark imports it inside measure)
    held = fsdp_memory.measure("tiny")["ranks"][0]
    assert len(built) == 1 and built[0]["runs"] == 1
    assert held["grads"] == held["params"] and held["optimizer"] >= 2 * held["params"]


def test_the_plain_and_the_graphed_step_run_one_body(monkeypatch):
    """TrainStep's plain step and cudagraph.GraphedStep's (on the CPU: the recorded body run eagerly) both call
    step.step_body, once a step: the plain one with the run's GradScaler and StepGuard's decision, the graphed
    one with no scaler and its flags on the device. Both train: their losses agree to rounding."""
    calls = []
    real = step.step_body

    def body(model, optimizer, scaler, *args, **kwargs):
        calls.append("plain" if scaler is not None else "graphed")
        return real(model, optimizer, scaler, *args, **kwargs)

    monkeypatch.setattr(step, "step_body", body)
    rt = runtime.setup_runtime("cpu", "float32")
    cfg = TrainConfig(learning_rate=1e-2, decay_lr=False)
    losses = {}
    for graphs in (False, True):
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=16, vocab_size=37, n_layer=1, n_head=2, n_embd=16, dropout=0.0))
        train_step = make_step(model, cfg, rt, Dist(), accum=2, graphs=graphs)
        assert (train_step.graphed is not None) == graphs and isinstance(train_step.optimizer.param_groups[0]["lr"],
                                                                          torch.Tensor) == graphs
        x = torch.randint(0, 37, (2, 16), generator=torch.Generator().manual_seed(1))
        losses[graphs] = [float(train_step(i, OneBatch((x, x))).loss) for i in range(3)]
    assert calls == ["plain"] * 3 + ["graphed"] * 3
    assert losses[True] == pytest.approx(losses[False], rel=1e-5) and losses[False][2] < losses[False][0]


def step_peak(train_step, loader) -> int:
    """Live tensor bytes at the peak of a steady-state step (its second), from torch's profiler, plus the weights
    and optimizer states that exist before it: the figure the plan predicts (benchmarks/plan_memory.py)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler import _memory_profiler as mp

    train_step(0, loader)  # the optimizer states exist from here on
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as p:
        train_step(1, loader)
    live = peak = 0
    for _, action, _, size in p._memory_profile().timeline:
        live += size if action == mp.Action.CREATE else -size if action == mp.Action.DESTROY else 0
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("lora_rank, dtype, softcap, T", [
    (0, torch.float32, 0.0, 16),  # one slice of logits (64 rows here)
    (4, torch.float32, 0.0, 32),  # two: the previous slice's still live as the next is computed
    (0, torch.bfloat16, 30.0, 32),  # autocast and a soft cap
])
def test_the_plans_dpo_peak_is_the_allocators_for_the_real_step(monkeypatch, lora_rank, dtype, softcap, T):
    """--plan for DPO counts what its step holds: a micro-batch of 2 pairs (4 sequences of T tokens, the
    log-probabilities by slices of 64 rows: slices as large against the model as GPT-2's vocabulary makes them)
    through the run's own DPO step (make_step, trial_batch's pairs; a full fine-tune's precomputed reference,
    LoRA's adapters-off forward), measured by torch's allocator: the plan's peak within 2%, where one slice of
    logits more or less is 15-30% of it (the plan had one too many for a micro-batch of one slice, and one too
    few under autocast with a soft cap)."""
    monkeypatch.setitem(LOSS_CHUNK_ELEMENTS, "cpu", 64 * 4032)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=T, vocab_size=4000, vocab_multiple=64, n_layer=1, n_head=2, n_embd=16,
                          dropout=0.0, logit_softcap=softcap))
    if lora_rank:
        lora.apply(model, lora.LoRASettings(rank=lora_rank, alpha=16.0, dropout=0.0))
    cfg = TrainConfig(objective="dpo", init_from="out-chat", block_size=T, dropout=0.0, lora_rank=lora_rank,
                      lora_dropout=0.0)
    rt = Runtime(torch.device("cpu"), dtype)
    objective, pairs = make_objective(cfg).trial_batch(cfg, model, 2, rt.device)
    measured = step_peak(make_step(model, cfg, rt, Dist(), accum=1, objective=objective), OneBatch(pairs))
    measured += plan.weights_bytes(model) + plan.optimizer_bytes(model, cfg.optimizer)
    setup = plan.Setup("cpu", dtype, T, loss="sequence_logps", sequences_per_item=2)
    assert plan.loss_rows(model, setup) == 64
    assert plan.memory(model, setup, 4).peak == pytest.approx(measured, rel=0.02)
    assert 64 * model.config.padded_vocab_size * 4 > 0.1 * measured  # (one slice: 5x the tolerance, or more)


def test_set_lr_at_learning_rate_zero_sets_every_group_to_zero():
    """The trial's configuration (learning_rate 0): Muon's groups, whose rate is relative to AdamW's, get 0 too
    instead of a division by zero."""
    model = GPT(GPTConfig(block_size=8, vocab_size=11, n_layer=1, n_head=2, n_embd=8, arch="modern"))
    cfg = TrainConfig(optimizer="muon", learning_rate=0.0, min_lr=0.0, muon_lr=0.0, decay_lr=False)
    optimizer = optim.make_optimizer(model, TrainConfig(optimizer="muon"), "cpu")
    assert optim.set_lr(optimizer, 0, cfg) == 0.0
    assert all(group["lr"] == 0.0 for group in optimizer.param_groups)
