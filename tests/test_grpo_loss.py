"""GRPO's loss (gptkit/objectives/grpo_loss.py) against a direct computation: a hand-written GRPO loss on a few fixed rollouts
(plain Python loops over replies and tokens, the log-softmax of the whole logits), its value and its gradients
with respect to every weight within float32 rounding; with the ratio away from 1 (clipping at work), with a KL
penalty, and with both averagings. And the group advantages against statistics' mean and stdev."""

import math
import statistics

import pytest
import torch

from gptkit.objectives.grpo_loss import (
    GRPOError,
    GRPOObjective,
    GRPOSettings,
    RolloutBatch,
    group_advantages,
    grpo_loss,
)
from model import GPT

# Four rollouts (two prompts x n=2) of a vocabulary of 67: prompt tokens, then the reply; padded with 0.
PROMPTS = [[5, 9, 3], [5, 9, 3], [7, 1], [7, 1]]
REPLIES = [[11, 12, 13, 2], [11, 2], [40, 41, 42, 43, 2], [44, 2]]
REWARDS = [1.0, 0.0, 0.0, 1.0]


def rollouts() -> tuple[torch.Tensor, torch.Tensor]:
    seqs = [p + r for p, r in zip(PROMPTS, REPLIES)]
    T = max(map(len, seqs)) - 1
    x = torch.zeros(len(seqs), T, dtype=torch.long)
    y = torch.full((len(seqs), T), -1, dtype=torch.long)
    for i, (p, s) in enumerate(zip(PROMPTS, seqs)):
        x[i, : len(s) - 1] = torch.tensor(s[:-1])
        y[i, len(p) - 1: len(s) - 1] = torch.tensor(s[len(p):])  # the reply's tokens only
    return x, y


def direct_loss(model, old, ref, advantages, settings) -> torch.Tensor:
    """GRPO written out: each reply's each token, its log-probability from the softmax of the whole logits."""
    seq_losses, token_losses, count = [], [], 0
    for i, (p, r) in enumerate(zip(PROMPTS, REPLIES)):
        seq = torch.tensor([p + r])
        logits = model(seq[:, :-1])[0][0]  # (len - 1, V)
        per = []
        for j, token in enumerate(r):
            t = len(p) - 1 + j  # the position that predicts reply token j
            lp = torch.log_softmax(logits[t].float(), -1)[token]
            ratio = torch.exp(lp - old[i][j])
            a = advantages[i]
            clipped = min(max(ratio, torch.tensor(1 - settings.clip)), torch.tensor(1 + settings.clip))
            loss = -torch.minimum(ratio * a, clipped * a)
            if settings.kl:
                d = ref[i][j] - lp
                loss = loss + settings.kl * (torch.exp(d) - d - 1)
            per.append(loss)
        token_losses += per
        count += len(per)
        seq_losses.append(sum(per) / len(per))
    if settings.averaging == "token":
        return sum(token_losses) / count
    return sum(seq_losses) / len(seq_losses)


def table(rows, x) -> torch.Tensor:
    """Per-reply-token values (lists, one a reply) placed at the batch's reply positions (B, T)."""
    out = torch.zeros(x.shape)
    for i, (p, vals) in enumerate(zip(PROMPTS, rows)):
        out[i, len(p) - 1: len(p) - 1 + len(vals)] = torch.as_tensor(vals).detach()
    return out


class Reference:
    def __init__(self, values):
        self.values = values

    def logps(self, model, x, y):
        return self.values


@pytest.mark.parametrize("averaging", ["token", "sequence"])
@pytest.mark.parametrize("kl", [0.0, 0.3])
@pytest.mark.parametrize("moved", [False, True])
def test_loss_and_gradients_match_a_direct_computation(tiny_config, averaging, kl, moved):
    torch.manual_seed(0)
    model = GPT(tiny_config).train()  # (dropout 0: train mode is deterministic)
    settings = GRPOSettings(n=2, clip=0.2, kl=kl, averaging=averaging)
    x, y = rollouts()
    advantages, flat = group_advantages(torch.tensor(REWARDS), 2)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        current = [torch.log_softmax(model(torch.tensor([p + r])[:, :-1])[0][0].float(), -1)
                   [torch.arange(len(p) - 1, len(p) + len(r) - 1), torch.tensor(r)] for p, r in zip(PROMPTS, REPLIES)]
    # old: the drawing model's log-probabilities. moved: +-0.5 away, so that many ratios leave [0.8, 1.2]
    shift = [(torch.rand(len(r), generator=g) - 0.5) for r in REPLIES] if moved else [0 * c for c in current]
    old = [c + s for c, s in zip(current, shift)]
    ref = [c + (torch.rand(len(c), generator=g) - 0.5) for c in current]

    batch = RolloutBatch(x, y, advantages, torch.tensor(REWARDS), torch.tensor([4, 2, 5, 2]), flat / 2,
                         old_logps=table(old, x) if moved else None)
    loss, metrics = GRPOObjective(settings, Reference(table(ref, x)))(model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    expected = direct_loss(model, old, ref, advantages, settings)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert metrics["reward"].item() == 0.5 and metrics["reply_tokens"].item() == 3.25
    if moved:  # some tokens' ratio was clipped, and the share is counted over the reply tokens
        ratios = [torch.exp(c - o) for c, o in zip(current, old)]
        held = sum(int(((r > 1.2) & (a > 0)).sum() + ((r < 0.8) & (a < 0)).sum())
                   for r, a in zip(ratios, advantages))
        assert held > 0 and metrics["clip_fraction"].item() == pytest.approx(held / 13)
    else:
        assert metrics["clip_fraction"].item() == 0.0
    if kl:
        k3 = [torch.exp(r - c) - (r - c) - 1 for r, c in zip(ref, current)]
        assert metrics["kl"].item() == pytest.approx(float(sum(k.sum() for k in k3)) / 13, rel=1e-5)


def test_group_advantages_are_normalised_within_each_group():
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.5, 0.2, 0.0, 0.0, 0.0, 0.0]  # groups of 3: one all-equal
    advantages, flat = group_advantages(torch.tensor(rewards), 3)
    for g in range(4):
        group = rewards[3 * g: 3 * g + 3]
        mean, std = statistics.mean(group), statistics.stdev(group)
        for i in range(3):
            want = 0.0 if std == 0 else (group[i] - mean) / (std + 1e-4)
            assert advantages[3 * g + i].item() == pytest.approx(want, rel=1e-6, abs=1e-7)
    assert flat.item() == 2  # (1, 1, 1) and (0, 0, 0): no signal, advantages exactly 0
    assert advantages[3:6].abs().sum().item() == 0.0 and math.isclose(advantages[9:].abs().sum().item(), 0.0)


def test_settings_are_checked():
    for bad in (dict(n=1), dict(clip=0), dict(kl=-1.0), dict(averaging="mean")):
        with pytest.raises(GRPOError):
            GRPOSettings(**bad)


def test_a_reply_free_of_signal_gives_no_gradient():
    x, y = rollouts()
    logps = torch.randn(x.shape, requires_grad=True)
    loss, _ = grpo_loss(logps, logps.detach(), torch.zeros(4), y != -1, GRPOSettings(n=2))
    loss.backward()
    assert loss.item() == 0.0 and logps.grad.abs().sum().item() == 0.0
