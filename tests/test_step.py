"""gptkit/step.py, the one training step: the same as the step written out by hand with torch's own operations
(the oracle), an objective of one's own plugged in with its metrics carried out of the step (plain and graphed),
and those metrics in the log."""

import json

import pytest
import torch

from gptkit.config import TrainConfig
from gptkit.cudagraph import GraphedStep
from gptkit.metrics import Metrics
from gptkit.optim import make_optimizer
from gptkit.runtime import Dist, setup_runtime
from gptkit.step import TrainStep, next_token_loss
from model import GPT, GPTConfig

CFG = TrainConfig(learning_rate=1e-2, decay_lr=False, grad_clip=0.05, weight_decay=0.1)
ACCUM = 2


class Batches:
    """A loader as the step uses it: fixed random micro-batches in turn, and a prefetch that counts."""

    def __init__(self, vocab: int, n: int = 6, batch: int = 3, block: int = 16):
        g = torch.Generator().manual_seed(0)
        self.data = [torch.randint(0, vocab, (batch, block + 1), generator=g) for _ in range(n)]
        self.served = self.prefetched = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.data[self.served % len(self.data)]
        self.served += 1
        return b[:, :-1], b[:, 1:]

    def prefetch(self) -> None:
        self.prefetched += 1


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=16, vocab_size=37, n_layer=2, n_head=2, n_embd=16, dropout=0.0))


def with_metrics(model, batch):
    """An objective of one's own: the default loss, and two metrics to log beside it, computable from the
    micro-batch alone (the mean target id) and from the loss (its value)."""
    loss, _ = next_token_loss(model, batch)
    return loss, {"target_mean": batch[1].float().mean(), "loss_seen": loss.detach()}


def test_the_step_is_the_step_written_out_by_hand():
    """Three steps of TrainStep and three written out (forward, loss / accum, backward per micro-batch, torch's
    clip_grad_norm_, the optimizer step, zero_grad): the same losses, norms and weights, bit for bit. The clip
    bites (grad_clip 0.05), so it is the clipped update that is compared."""
    rt = setup_runtime("cpu", "float32")
    ours, theirs = tiny_gpt(), tiny_gpt()
    step = TrainStep(ours, make_optimizer(ours, CFG, "cpu"), torch.amp.GradScaler("cpu", enabled=False), rt,
                     Dist(), CFG, accum=ACCUM)
    optimizer = make_optimizer(theirs, CFG, "cpu")
    a, b = Batches(37), Batches(37)
    for i in range(3):
        out = step(i, a)
        loss = torch.zeros(())
        for _ in range(ACCUM):
            x, y = b.next_batch()
            micro = theirs(x, y)[1] / ACCUM
            micro.backward()
            loss += micro.detach()
        params = [p for group in optimizer.param_groups for p in group["params"]]  # (the norm's summation order)
        norm = torch.nn.utils.clip_grad_norm_(params, CFG.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        assert norm > CFG.grad_clip  # (clipped)
        assert torch.equal(out.loss, loss) and torch.equal(out.grad_norm, norm) and out.lr == CFG.learning_rate
        assert out.verdict.bad_step is None and out.metrics == {}
    assert a.prefetched == 3 * ACCUM  # the loader reads ahead after each micro-batch's forward
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_an_objective_of_ones_own_carries_its_metrics_out():
    """The objective's metrics come out of the step as device tensors, each the mean over the step's
    micro-batches (as the loss is), and read() brings them to the host; the update is the default
    objective's, since the loss is."""
    rt = setup_runtime("cpu", "float32")
    plain, own = tiny_gpt(), tiny_gpt()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    default = TrainStep(plain, make_optimizer(plain, CFG, "cpu"), scaler, rt, Dist(), CFG, accum=ACCUM)
    custom = TrainStep(own, make_optimizer(own, CFG, "cpu"), scaler, rt, Dist(), CFG, accum=ACCUM,
                       objective=with_metrics)
    a, b, data = Batches(37), Batches(37), Batches(37)
    for i in range(3):
        expected = torch.stack([data.next_batch()[1].float().mean() for _ in range(ACCUM)]).mean()
        out, reference = custom(i, a), default(i, b)
        assert set(out.metrics) == {"target_mean", "loss_seen"}
        assert torch.allclose(out.metrics["target_mean"], expected) and torch.equal(out.loss, reference.loss)
        assert torch.allclose(out.metrics["loss_seen"], out.loss)
        loss, grad_norm, metrics = out.read(Dist())
        assert (loss, grad_norm) == (out.loss.item(), out.grad_norm.item())
        assert metrics == {k: v.item() for k, v in out.metrics.items()}
    for p, q in zip(own.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q)


def test_the_graphed_step_carries_the_objectives_metrics_too():
    """The same objective through GraphedStep (on the CPU its step runs eagerly: the same arithmetic): its
    metrics come out beside the loss, the mean over the micro-batches copied into its static buffers."""
    rt = setup_runtime("cpu", "float32")
    model = tiny_gpt()
    optimizer = make_optimizer(model, CFG, "cpu", graphable=True)
    graphed = GraphedStep(model, optimizer, rt.device, accum=ACCUM, grad_clip=CFG.grad_clip,
                          autocast=lambda: rt.autocast(cache=False), objective=with_metrics)
    step = TrainStep(model, optimizer, torch.amp.GradScaler("cpu", enabled=False), rt, Dist(), CFG, accum=ACCUM,
                     graphed=graphed)
    loader, data = Batches(37), Batches(37)
    for i in range(3):
        expected = torch.stack([data.next_batch()[1].float().mean() for _ in range(ACCUM)]).mean()
        out = step(i, loader)
        assert torch.allclose(out.metrics["target_mean"], expected)
        assert torch.allclose(out.metrics["loss_seen"], out.loss) and out.verdict.bad_step is None
    assert graphed.steps == 3 and loader.prefetched == 3  # the graph reads ahead once per step


def test_a_stop_asked_during_the_step_is_this_steps():
    """The step asks for the boundary's request after its backward: a stop signal that comes while the
    micro-batches run stops the run after this very step (not the next)."""
    rt = setup_runtime("cpu", "float32")
    model = tiny_gpt()
    step = TrainStep(model, make_optimizer(model, CFG, "cpu"), torch.amp.GradScaler("cpu", enabled=False), rt,
                     Dist(), CFG, accum=ACCUM)
    asked = []

    class SignalDuringTheStep(Batches):
        def next_batch(self):
            asked.append("batch")
            return super().next_batch()

    out = step(0, SignalDuringTheStep(37), lambda: asked.append("request") or 1.0)  # 1.0: STOP
    assert asked == ["batch", "batch", "request"] and out.verdict.stop


def test_the_objectives_metrics_reach_the_log(tmp_path, capsys):
    metrics = Metrics(tmp_path, master=True, tokens_per_step=96, flops_per_token=1.0, peak_flops=None,
                      world_size=1, max_iters=10, device=torch.device("cpu"))
    metrics.log_step(1, 2.5, 1e-3, 0.75, 0.0, {"reward_margin": 0.125, "reward_accuracy": 0.5})
    metrics.log_step(2, 2.0, 1e-3, 0.5, 0.0)
    metrics.close()
    first, second = (json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines())
    assert first["reward_margin"] == 0.125 and first["reward_accuracy"] == 0.5 and first["loss"] == 2.5
    assert "reward_margin" not in second
    printed = capsys.readouterr().out.splitlines()
    assert "| reward_margin 0.125 | reward_accuracy 0.5 |" in printed[0] and "reward" not in printed[1]


@pytest.mark.parametrize("objective", [next_token_loss, with_metrics])
def test_every_objective_leaves_no_gradient_behind(objective):
    """After a step the gradients are gone (zero_grad(set_to_none)), whatever the objective returned."""
    rt = setup_runtime("cpu", "float32")
    model = tiny_gpt()
    step = TrainStep(model, make_optimizer(model, CFG, "cpu"), torch.amp.GradScaler("cpu", enabled=False), rt,
                     Dist(), CFG, accum=ACCUM, objective=objective)
    step(0, Batches(37))
    assert all(p.grad is None for p in model.parameters())
