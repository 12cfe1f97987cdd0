"""KTO on unpaired rows (gptkit/objectives/kto.py, kto_loss.py, gptkit/data/unpaired.py): the loss and its
gradients against the paper's formula in float64 on fixed log-probabilities (z's clamp at 0, both weights);
the rows and their KL sequences as batches; the training step against KTO computed by hand from two models'
per-token log-probabilities; a run on the synthetic task that ranks desirable completions above undesirable
ones; exact resume; the refusals and the weights' note."""

import contextlib
import copy
import functools
import gc
import json
import math
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import torch_threads, train_script

from benchmarks import dpo_rule
from gptkit.checkpoint import load_checkpoint, load_model
from gptkit.checkpoint.run_model import attach_lora, build_model
from gptkit.config import TrainConfig
from gptkit.data.pairs import PairLoader, unpaired_labels
from gptkit.data.prepare.pipeline import ValRule
from gptkit.data.shards import read_meta
from gptkit.data.unpaired import RowLoader, Rows
from gptkit.errors import DataError
from gptkit.objectives import make_objective
from gptkit.objectives.kto import ratio_note
from gptkit.objectives.kto_loss import KTOObjective, kto_loss, row_metrics
from gptkit.optim import make_optimizer
from gptkit.plan import batch_size
from gptkit.runtime import Dist, setup_runtime
from gptkit.settings import KTOSettings
from gptkit.step import TrainStep, accumulate
from gptkit.tokenizer import Tokenizer
from prepare import preference
from tests.test_dpo import direct_logps
from tests.test_dpo_train import BLOCK, gpu_like, prepare_pairs, prepare_task, sft_args  # noqa: F401
from tests.test_fsdp import torchrun_each
from tests.test_train import assert_same_weights, metrics, train_losses, weights

train = train_script()


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


# ----------------------------------------------------------------------------- the loss


def paper_loss(policy, reference, policy_kl, reference_kl, desirable, s: KTOSettings):
    """The paper's KTO in float64 Python numbers, row by row: (mean loss, rewards, z)."""
    B = len(policy)
    z = max(0.0, sum(p - r for p, r in zip(policy_kl, reference_kl)) / B)
    losses, rewards = [], []
    for p, r, good in zip(policy, reference, desirable):
        ratio = p - r
        sig = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
        losses.append(s.desirable_weight * (1 - sig(s.beta * (ratio - z))) if good else
                      s.undesirable_weight * (1 - sig(s.beta * (z - ratio))))
        rewards.append(s.beta * ratio)
    return sum(losses) / B, rewards, z


@pytest.mark.parametrize("settings, kl_shift", [
    (KTOSettings(beta=0.1), 3.0),
    (KTOSettings(beta=0.5, desirable_weight=1.5, undesirable_weight=0.7), 2.0),
    (KTOSettings(beta=0.2, desirable_weight=0.8, undesirable_weight=1.3), -4.0),  # the KL estimate < 0: z = 0
], ids=["z_positive", "weights", "z_clamped_at_0"])
def test_the_loss_and_its_gradients_equal_the_papers_formula_in_float64(settings, kl_shift):
    """kto_loss on fixed log-probabilities: the loss, each row's gradient (d loss / d log pi, by the formula's
    derivative: w beta s (1 - s) / B with the sign of the row's label), the rewards and z, against float64;
    z is detached (no gradient reaches the KL sequences' log-probabilities) and clamped at 0."""
    g = torch.Generator().manual_seed(0)
    B = 8
    policy = (-20 + 6 * torch.rand(B, generator=g, dtype=torch.float64)).float().requires_grad_()
    reference = (policy.detach() + torch.randn(B, generator=g, dtype=torch.float64).float() * 4)
    policy_kl = (-30 + 6 * torch.rand(B, generator=g, dtype=torch.float64)).float().requires_grad_()
    reference_kl = policy_kl.detach() - kl_shift + torch.randn(B, generator=g).float() * 0.5
    desirable = torch.tensor([True, False, True, True, False, False, True, False])

    losses, rewards, z = kto_loss(policy, reference, policy_kl, reference_kl, desirable, settings)
    losses.mean().backward()

    p, r, pk, rk = (t.detach().double().tolist() for t in (policy, reference, policy_kl, reference_kl))
    expected, expected_rewards, expected_z = paper_loss(p, r, pk, rk, desirable.tolist(), settings)
    assert losses.mean().item() == pytest.approx(expected, rel=1e-6)
    assert z.item() == pytest.approx(expected_z, abs=1e-6) and not z.requires_grad
    assert (expected_z == 0.0) == (kl_shift < 0)
    assert rewards.tolist() == pytest.approx(expected_rewards, rel=1e-6)
    beta = settings.beta
    for i in range(B):
        ratio = p[i] - r[i]
        if desirable[i]:
            s = 1 / (1 + math.exp(-beta * (ratio - expected_z)))
            grad = -settings.desirable_weight * beta * s * (1 - s) / B
        else:
            s = 1 / (1 + math.exp(-beta * (expected_z - ratio)))
            grad = settings.undesirable_weight * beta * s * (1 - s) / B
        assert policy.grad[i].item() == pytest.approx(grad, rel=1e-5), i
    assert policy_kl.grad is None  # z is a constant to the loss

    logged = row_metrics(losses, rewards, policy, desirable, z)
    d = [x for x, good in zip(expected_rewards, desirable.tolist()) if good]
    u = [x for x, good in zip(expected_rewards, desirable.tolist()) if not good]
    auc = sum((a > b) + 0.5 * (a == b) for a in d for b in u) / (len(d) * len(u))
    assert logged["chosen_reward"].item() == pytest.approx(sum(d) / len(d), rel=1e-5)
    assert logged["rejected_reward"].item() == pytest.approx(sum(u) / len(u), rel=1e-5)
    assert logged["rewards/chosen"] is logged["chosen_reward"] and logged["logps/rejected"] is logged["rejected_logp"]
    assert logged["kl"].item() == pytest.approx(expected_z, abs=1e-6) and logged["desirable"].item() == 0.5
    assert logged["auc"].item() == pytest.approx(auc) and 0 < auc < 1


def test_a_micro_batch_of_one_label_logs_the_other_as_n_a_and_the_step_weighs_by_label():
    """A micro-batch without undesirable rows has no rejected_reward (NaN: n/a), and the step's mean of a
    per-label metric is over that label's rows of all its micro-batches (metric_over), not a mean of means."""
    s = KTOSettings(beta=1.0)
    batches = [(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([True, True, True, True])),
               (torch.tensor([5.0, 6.0, 7.0, 8.0]), torch.tensor([True, False, False, False]))]

    class Fixed:
        metric_names = KTOObjective.metric_names
        metric_over = KTOObjective.metric_over

        def __call__(self, model, batch):
            ratio, desirable = batch
            zero = torch.zeros(4)
            policy = ratio.clone().requires_grad_()
            losses, rewards, z = kto_loss(policy, zero, zero, zero, desirable, s)
            return losses.mean(), row_metrics(losses, rewards, policy, desirable, z)

    first = Fixed()(None, batches[0])[1]
    assert math.isnan(first["rejected_reward"].item()) and first["chosen_reward"].item() == 2.5
    it = iter(batches)
    _, means = accumulate(torch.nn.Linear(1, 1), lambda: next(it), 2, contextlib.nullcontext, torch.device("cpu"),
                          objective=Fixed())
    assert means["chosen_reward"].item() == pytest.approx((1 + 2 + 3 + 4 + 5) / 5)
    assert means["rejected_reward"].item() == pytest.approx((6 + 7 + 8) / 3)
    assert means["rewards/rejected"].item() == means["rejected_reward"].item()
    assert means["desirable"].item() == pytest.approx(5 / 8)


# ----------------------------------------------------------------------------- the data


def unpaired_rows(n, seed=0, desirable=0.5):
    """The synthetic task's rows: a word and the mark to end it with; desirable: the asked-for mark. One row a
    word, so no two rows share a prompt (each row's KL sequence is a mismatched one)."""
    rng = random.Random(seed)
    rows = []
    for word in dpo_rule.made_up_words(n, rng):
        pair = dpo_rule.preference_pair(word, rng)
        good = rng.random() < desirable
        rows.append({"prompt": pair["prompt"], "completion": pair["chosen" if good else "rejected"], "label": good})
    rng.shuffle(rows)
    return rows


def prepare_rows(root: Path, rows, tokenizer, name="rows", block=BLOCK) -> Path:
    path = root / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    preference.main(["--input", str(path), "--tokenizer", str(tokenizer), "--block_size", str(block),
                     "--data_root", str(root / "data"), "--name", name, "--val_fraction", "0.2"])
    return root / "data" / name


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """The synthetic task: a chat model trained 3 steps on its conversations (the start of the KTO runs), its
    unpaired rows in that model's tokens, and its pairs (a paired dataset, for the refusals)."""
    root = tmp_path_factory.mktemp("kto")
    prepare_task(root, n_sft=300, n_pairs=200)
    with torch_threads(1):
        train.main(sft_args(root / "data" / "sft", root / "sft"))
    rows = prepare_rows(root, unpaired_rows(240), root / "sft")
    return SimpleNamespace(root=root, sft=root / "sft", rows=rows, pairs=prepare_pairs(root, root / "sft"))


def test_each_row_comes_with_its_prompt_and_the_previous_rows_completion(task):
    """A batch's first half are the rows as prepared (targets on the reply alone), its second half their KL
    sequences: row i's prompt and row i-1's completion (row 0: the last's), with their labels; a KL sequence
    longer than the batch is cut from its prompt's start, <|endoftext|> kept."""
    tok = Tokenizer.from_meta(read_meta(task.rows))
    rows = [json.loads(line) for line in (task.root / "rows.jsonl").read_text().splitlines()]
    rule = ValRule.for_documents(0.2, len(rows))
    train_rows = [r for i, r in enumerate(rows) if rule.split(i) == "train"]
    items = Rows(task.rows, "train")
    assert len(items) == len(train_rows) and unpaired_labels(task.rows, "train").tolist() == [
        r["label"] for r in train_rows]
    picked = np.array([0, 5, 17])
    batch = items.read(picked, BLOCK)
    B = len(picked)

    def text(ids):
        return tok.decode([t for t in ids if t != -1])

    for k, i in enumerate(picked.tolist()):
        row, other = train_rows[i], train_rows[i - 1]
        assert text(batch.y[k].tolist()) == row["completion"] + "<|end|>"
        assert text(batch.x[k].tolist()).startswith(f"<|endoftext|><|user|>{row['prompt']}<|end|><|assistant|>"
                                                     f"{row['completion']}")
        assert text(batch.y[B + k].tolist()) == other["completion"] + "<|end|>"
        assert text(batch.x[B + k].tolist()).startswith(f"<|endoftext|><|user|>{row['prompt']}<|end|><|assistant|>"
                                                        f"{other['completion']}")
        assert batch.labels[k].item() == float(row["label"])
    assert items.partner(np.array([0]))[0] == len(items) - 1
    # cut to fit: the rows of 30 tokens or fewer at T = 29; their longer KL sequences lose their prompts' first
    # tokens, and keep their completions whole
    T = 29
    n = len(items)
    full = items.kl_lengths()
    fits = np.flatnonzero(items.lengths <= T + 1)
    short = items.read(fits, T)
    assert (full[fits] > T + 1).sum() >= 5 and (full[fits] <= T + 1).sum() >= 5
    for k, i in enumerate(fits.tolist()):
        x, y = short.x[len(fits) + k], short.y[len(fits) + k]
        assert x[0].item() == items.eot and (x[1:] != items.eot).sum().item() == min(full[i], T + 1) - 2
        other = train_rows[i - 1]
        assert text(y.tolist()) == other["completion"] + "<|end|>"  # (the completion whole)
        assert text(x.tolist()).endswith(f"<|end|><|assistant|>{other['completion']}" + "<|endoftext|>" * (
            T + 1 - min(full[i], T + 1)))
    assert n == len(train_rows)


# ----------------------------------------------------------------------------- the training step


def kto_args(task, out, **over) -> list[str]:
    """A KTO run from the task's chat model on its rows: 8 steps of 2 micro-batches of 4 rows."""
    args = dict(objective="kto", init_from=task.sft, dataset=task.rows, out_dir=out, batch_size=4,
                gradient_accumulation_steps=2, max_iters=8, eval_interval=4, eval_iters=3, log_interval=1,
                warmup_iters=2, lr_decay_iters=8, learning_rate=3e-3, min_lr=3e-4, dropout=0.0, dpo_beta=0.5,
                device="cpu", compile=False)
    return [f"--{k}={v}" for k, v in {**args, **over}.items()]


@pytest.mark.parametrize("lora_rank", [0, 4], ids=["precomputed_reference", "adapters_off_reference"])
def test_the_training_step_is_kto_computed_by_hand(task, lora_rank):
    """TrainStep with the objective, loader and reference a run builds, 2 micro-batches per step: the second
    step's loss and the gradients its optimizer step receives equal KTO written out from the per-token
    log-probabilities (a whole log-softmax) of the model before that step and of the starting model (the
    reference), of each row's completion and of its KL sequence, z per micro-batch, weights 1.5 and 0.8 (1e-6,
    float32). The second step, so that the model has moved from its reference."""
    cfg = TrainConfig(objective="kto", init_from=str(task.sft), dataset=str(task.rows), block_size=BLOCK,
                      batch_size=3, gradient_accumulation_steps=2, learning_rate=1e-2, decay_lr=False,
                      grad_clip=0.0, weight_decay=0.0, dropout=0.0, lora_rank=lora_rank, lora_dropout=0.0,
                      dpo_beta=0.5, kto_desirable_weight=1.5, kto_undesirable_weight=0.8)
    rt = setup_runtime("cpu", "float32")
    model, added = build_model(cfg, read_meta(task.rows), None, keep_context=True)
    attach_lora(cfg, model, None, added)
    start = copy.deepcopy(model).eval()  # the starting model: the oracle's reference
    objective = make_objective(cfg)
    objective.start(cfg, model, task.rows, None, Dist(), rt)
    loader, _ = objective.batches(cfg, task.rows, Dist(), rt)
    assert type(objective.reference).__name__ == ("AdapterOffReference" if lora_rank else "RowReference")
    optimizer = make_optimizer(model, cfg, "cpu")
    step = TrainStep(model, optimizer, torch.amp.GradScaler("cpu", enabled=False), rt, Dist(), cfg, accum=2,
                     objective=objective)
    received = {}
    optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: received.update({n: p.grad.clone() for n, p in model.named_parameters()
                                                   if p.grad is not None}))
    step(0, loader)
    before = copy.deepcopy(model)
    out = step(1, loader)

    batches = RowLoader(task.rows, "train", batch_size=3, block_size=BLOCK, seed=cfg.seed)
    micro = [batches.next_batch() for _ in range(4)][2:]  # the second step's
    total, chosen, zs = 0.0, [], []
    for batch in micro:
        B = len(batch)
        with torch.no_grad():
            ref = direct_logps(start, batch.x, batch.y)
            pi_kl = direct_logps(before.train(), batch.x[B:], batch.y[B:])
        pi = direct_logps(before.train(), batch.x[:B], batch.y[:B])
        z = (pi_kl - ref[B:]).mean().clamp(min=0)
        zs.append(z.item())
        ratio = pi - ref[:B]
        good = batch.labels > 0.5
        losses = torch.where(good, 1.5 * (1 - torch.sigmoid(0.5 * (ratio - z))),
                             0.8 * (1 - torch.sigmoid(0.5 * (z - ratio))))
        total = total + losses.mean() / 2
        chosen += (0.5 * ratio[good]).tolist()
    total.backward()
    by_hand = {n: p.grad for n, p in before.named_parameters() if p.grad is not None}

    assert abs(out.loss.item() - total.item()) < 1e-6
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert received.keys() == by_hand.keys() == trained  # (LoRA: the adapters alone)
    for name in by_hand:
        torch.testing.assert_close(received[name], by_hand[name], atol=1e-6, rtol=1e-6, msg=name)
    assert out.metrics["chosen_reward"].item() == pytest.approx(sum(chosen) / len(chosen), abs=1e-6)
    assert abs(sum(chosen)) > 1e-3  # (the model has moved from its reference)
    assert out.metrics["kl"].item() == pytest.approx(sum(zs) / 2, abs=1e-6)
    assert set(out.metrics) == set(objective.metric_names)


# ----------------------------------------------------------------------------- the run


def row_rewards(tuned, start, data, split="train"):
    """Each row's log ratio log pi(y|x) - log ref(y|x) of its completion, by a whole log-softmax, and the
    labels."""
    items = Rows(data, split)
    batch = items.read(np.arange(len(items)), int(items.lengths.max()) - 1)
    B = len(items)
    with torch.no_grad():
        ratio = direct_logps(tuned, batch.x[:B], batch.y[:B]) - direct_logps(start, batch.x[:B], batch.y[:B])
    return ratio, batch.labels > 0.5


def auc_of(ratio, good):
    diff = ratio[good][:, None] - ratio[~good][None, :]
    return ((diff > 0).float() + 0.5 * (diff == 0).float()).mean().item()


def test_kto_ranks_desirable_completions_above_undesirable_ones(task, tmp_path, capsys):
    """300 steps of KTO from the task's chat model: the rows' rewards (log ratio to the starting model, computed
    here by a whole log-softmax) put the desirable completions above the undesirable ones, nearly every pair of
    the rows tuned on (from 0.5: the model is its reference at the start), the desirable ones' up and the
    undesirable ones' down (by the rows themselves: on held-out rows of this task KTO does not learn the rule,
    BENCHMARKS.md "KTO on the rule task made unpaired"). The log says what the run optimizes, and each step logs KTO's numbers, TRL's names
    beside ours in metrics.jsonl; the first step is the loss of a model that is its reference, (w_D n_D + w_U
    n_U) / 2n per row: 0.5 x the mean weight."""
    out = tmp_path / "out"
    train.main(kto_args(task, out, max_iters=300, eval_interval=300, log_interval=1, batch_size=8,
                        gradient_accumulation_steps=1, learning_rate=3e-3, min_lr=3e-3, warmup_iters=5,
                        kto_desirable_weight=1.2))
    said = capsys.readouterr().out
    assert "objective: KTO (beta 0.5, weights 1.2 desirable / 1 undesirable) on the unpaired rows of" in said
    assert "against the starting model's log-probabilities, precomputed (8 bytes a row" in said
    assert "kl is the reference point z" in said and "outside [1, 4/3]" not in said  # (1.2 x 92 / 105)
    lines = metrics(out)
    steps = [m for m in lines if "loss" in m]
    first = steps[0]
    assert first["loss"] == pytest.approx(0.5 * (1.2 * first["desirable"] + (1 - first["desirable"])), abs=1e-5)
    assert first["kl"] == 0 and first["chosen_reward"] == pytest.approx(0, abs=1e-6) and first["auc"] == 0.5
    for m in steps + [{k.removeprefix("val_"): v for k, v in m.items()} for m in lines if "val_loss" in m]:
        assert set(KTOObjective.metric_names) <= set(m)
        assert (m["rewards/chosen"], m["rewards/rejected"], m["logps/chosen"], m["logps/rejected"]) == (
            m["chosen_reward"], m["rejected_reward"], m["chosen_logp"], m["rejected_logp"])
    assert "rewards/" not in said

    start = load_model(str(task.sft))[0]
    tuned = load_model(str(out / "last.pt"))[0]
    ratio, good = row_rewards(tuned, start, task.rows)
    assert auc_of(ratio, good) >= 0.9, auc_of(ratio, good)
    assert ratio[good].mean() > 0 > ratio[~good].mean()


@pytest.mark.parametrize("over", [dict(), dict(lora_rank=4, lora_dropout=0.1, dropout=0.1)],
                         ids=["precomputed_reference", "lora_with_dropout"])
def test_resume_is_exact(task, tmp_path, over, capsys):
    """8 steps, or 4 then 4 resumed: the same losses and metrics every step and the same weights, bit for bit.
    The resumed full fine-tune reads its reference (rows and KL sequences) back from the checkpoint."""
    full, half = tmp_path / "full", tmp_path / "half"
    train.main(kto_args(task, full, **over))
    train.main(kto_args(task, half, max_iters=4, **over))
    said = capsys.readouterr().out
    assert "= 1 x 92 / (1 x 105) = 0.876, outside [1, 4/3], the range TRL advises" in said  # (at each start)
    train.main(kto_args(task, half, init_from="resume", **over))
    said = capsys.readouterr().out
    assert "scoring the train and val rows" not in said  # (read back; LoRA: the adapters off)
    assert train_losses(half) == train_losses(full)
    steps = {m["step"]: m for m in metrics(full) if "loss" in m}
    resumed = [m for m in metrics(half) if "loss" in m and m["step"] > 4]
    assert len(resumed) == 4
    for m in resumed:
        mine = {k: v for k, v in m.items() if k in KTOObjective.metric_names}
        assert mine == {k: v for k, v in steps[m["step"]].items() if k in KTOObjective.metric_names}
    assert_same_weights(weights(half), weights(full))
    ckpt = load_checkpoint(full / "last.pt")
    assert ("kto_reference" in ckpt) == (not over) and "dpo_reference" not in ckpt
    if not over:
        tables = ckpt["kto_reference"]["tables"]
        assert tables["train"].shape == (len(Rows(task.rows, "train")), 2)


# ----------------------------------------------------------------------------- refusals and notes


@pytest.mark.parametrize("dataset, over, words", [
    ("pairs", dict(), "holds preference pairs (train on them with --objective=dpo), not unpaired rows"),
    ("rows", dict(objective="dpo"), "holds unpaired rows (a prompt, one completion and a label), not pairs: train "
                                    "on them with --objective=kto"),
    ("sft", dict(), "holds conversations (prepare/chat.py), not unpaired rows"),
    ("desirable_only", dict(), "holds 150 desirable rows and no undesirable one: KTO weighs each kind against the "
                               "other; add rows labelled false"),
    ("rows", dict(init_from="scratch"), "objective=kto tunes a trained chat model"),
    ("rows", dict(dpo_loss="ipo"), "dpo_loss is DPO's; objective=kto has its own loss"),
    ("rows", dict(dpo_nll_weight=0.5), "drop --dpo_nll_weight"),
    ("rows", dict(kto_undesirable_weight=0), "kto_undesirable_weight must be a positive number, got 0"),
    ("rows", dict(dpo_beta=-1), "dpo_beta must be a positive number"),
])
def test_what_does_not_fit_is_a_one_line_error(task, tmp_path, dataset, over, words):
    """Each a one-line error that says what to do, before anything is written."""
    if dataset == "desirable_only":
        data = prepare_rows(tmp_path, unpaired_rows(150, desirable=1.0), task.sft, "desirable_only")
    else:
        data = {"pairs": task.pairs, "rows": task.rows, "sft": task.root / "data" / "sft"}[dataset]
    with pytest.raises(SystemExit) as e:
        train.main(kto_args(task, tmp_path / "out", dataset=data, **over))
    assert str(e.value).startswith("error:") and words in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_the_weights_note_says_when_trls_advised_ratio_does_not_hold():
    """lambda_D n_D / (lambda_U n_U) outside [1, 4/3]: one line with the weight that brings it in; none inside."""
    labels = np.array([True] * 30 + [False] * 70)
    line = ratio_note(KTOSettings(), labels)
    assert "= 1 x 30 / (1 x 70) = 0.429, outside [1, 4/3]" in line and "--kto_desirable_weight=2.33 puts it at 1" in line
    assert "\n" not in line
    assert ratio_note(KTOSettings(desirable_weight=2.5), labels) == ""  # 75 / 70
    assert "puts it at 1.33" in ratio_note(KTOSettings(), ~labels)  # 70 / 30 = 2.33
    assert ratio_note(KTOSettings(desirable_weight=0.5), ~labels) == ""  # 35 / 30


def test_batch_size_auto_and_the_plan_count_rows(task, tmp_path, capsys):
    """batch_size=auto under KTO: tokens_per_step counts rows of one sequence (their KL sequences, scored without
    gradients, beside them); the run fits block_size to the longest row or KL sequence, keeps the rows per
    step and trains; --plan says what it counts."""
    out = tmp_path / "out"
    train.main(kto_args(task, out, batch_size="auto", gradient_accumulation_steps=1, block_size=BLOCK,
                        tokens_per_step=6 * BLOCK, max_iters=2, eval_interval=2))
    said = capsys.readouterr().out
    T = max(Rows(task.rows, split).longest for split in ("train", "val")) - 1
    assert f"tokens_per_step={6 * T} keeps its 6 rows per step" in said
    assert "batch_size=auto: 6 (" in said
    assert load_checkpoint(out / "last.pt")["config"]["batch_size"] == 6
    assert sorted(train_losses(out)) == [1, 2] and all(math.isfinite(v) for v in train_losses(out).values())
    train.main(kto_args(task, tmp_path / "plan", plan=True, batch_size=4))
    said = " ".join(capsys.readouterr().out.split())
    assert f"KTO: the micro-batch of 4 rows is planned as 4 sequences of {T} tokens" in said


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_batch_size_autos_trial_step_is_the_kto_step(task, lora_rank, monkeypatch):
    """On a GPU batch_size=auto tries real steps (fits_on_gpu): under KTO the step is KTO's, on rows and their KL
    sequences, against the run's kind of reference (LoRA's: the adapters off); at learning rate 0 the weights
    stay. Run here on the CPU, where it always fits."""
    cfg = TrainConfig(objective="kto", init_from=str(task.sft), dataset=str(task.rows), block_size=BLOCK,
                      batch_size=None, tokens_per_step=4 * BLOCK, lora_rank=lora_rank, dropout=0.0, lora_dropout=0.0)
    rt = setup_runtime("cpu", "float32")
    model, added = build_model(cfg, read_meta(task.rows), None, keep_context=True)
    attach_lora(cfg, model, None, added)
    before = copy.deepcopy(model.state_dict())
    calls = []
    real = KTOObjective.__call__

    def spy(self, m, batch):
        calls.append((type(self.reference).__name__, tuple(batch.x.shape), int((batch.y != -1).sum()),
                      batch.labels.tolist()))
        return real(self, m, batch)

    monkeypatch.setattr(KTOObjective, "__call__", spy)
    assert batch_size.fits_on_gpu(model, cfg, rt, 3)
    reference = "AdapterOffReference" if lora_rank else "RowReference"
    assert calls == [(reference, (6, BLOCK), 6 * (BLOCK - BLOCK // 2), [0.0, 1.0, 0.0])]
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


@pytest.mark.parametrize("over", [dict(), dict(lora_rank=4, lora_dropout=0.0)],
                         ids=["reference_read_with_the_batch", "adapters_off_inside_the_step"])
@pytest.mark.usefixtures("gpu_like")  # (tests/test_dpo_train.py's: the CUDA choices on the CPU)
def test_the_graphed_step_trains_as_the_plain_step(task, tmp_path, over):
    """--cuda_graphs=True's step (its static buffers: the rows' and KL sequences' tokens, the labels and,
    precomputed, the reference's log-probabilities, read with the batch) gives the plain step's losses, metrics
    and weights, bit for bit."""
    plain, graphed = tmp_path / "plain", tmp_path / "graphed"
    train.main(kto_args(task, plain, **over))
    train.main(kto_args(task, graphed, cuda_graphs=True, **over))
    assert train_losses(graphed) == train_losses(plain)
    for a, b in zip(metrics(plain), metrics(graphed), strict=True):
        assert {k: v for k, v in a.items() if k in KTOObjective.metric_names} == {
            k: v for k, v in b.items() if k in KTOObjective.metric_names}
    assert_same_weights(weights(graphed), weights(plain))


def test_compile_keeps_the_eager_losses(task, tmp_path, monkeypatch):
    """A LoRA run compiled: every forward is of B sequences (the rows, their KL sequences, the reference's two
    halves), so the model compiles one graph per mode (training; no gradients; the reference's eval mode; the
    evaluation's) and the losses are the eager run's. (Dynamo's eager backend: the guards are inductor's.)"""
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    over = dict(lora_rank=4, lora_dropout=0.0, max_iters=4, eval_interval=2)
    train.main(kto_args(task, eager, **over))
    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    frames = []
    real = torch._dynamo.convert_frame.ConvertFrameAssert.__call__

    def counted(self, frame, *args, **kwargs):
        frames.append(frame.f_code.co_name)
        return real(self, frame, *args, **kwargs)

    monkeypatch.setattr(torch._dynamo.convert_frame.ConvertFrameAssert, "__call__", counted)
    train.main(kto_args(task, compiled, compile=True, **over))
    torch.compiler.reset()
    gc.collect()
    assert frames.count("forward") == 4, frames
    a, b = train_losses(eager), train_losses(compiled)
    assert a.keys() == b.keys() and all(b[s] == pytest.approx(a[s], rel=1e-6) for s in a)


# each run on 2 processes against 1 process: FSDP with the reference's log-probabilities precomputed (each process
# scores half of the rows), and DDP with LoRA (the reference is the base, adapters off)
TWO_PROCESSES = {"fsdp_precomputed_reference": (dict(), "fsdp"),
                 "ddp_adapters_off_reference": (dict(lora_rank=4, lora_dropout=0.0), "ddp")}


def test_two_processes_train_as_one_with_z_over_both(task, tmp_path):
    """2 processes x 4 rows == 1 process x 8 rows: every step's loss and z (kl), z being the mean over both
    processes' micro-batches (without the collective each process would have its own z, and the losses would
    differ). (Both 2-process runs in one torchrun job, one after the other.)"""
    # (the desirable rows weighed up: their completions' likelihood rises, the mismatched ones' with it, z > 0)
    common = dict(max_iters=4, eval_interval=4, gradient_accumulation_steps=1, learning_rate=1e-2, warmup_iters=1,
                  kto_desirable_weight=4, kto_undesirable_weight=0.1)
    for name, (over, _) in TWO_PROCESSES.items():
        train.main(kto_args(task, tmp_path / name / "one", batch_size=8, **common, **over))
    res = torchrun_each(2, [kto_args(task, tmp_path / name / "two", batch_size=4, parallel=parallel,
                                     **{**common, "gradient_accumulation_steps": 2}, **over)
                            for name, (over, parallel) in TWO_PROCESSES.items()], tmp_path)
    for name, (_, parallel) in TWO_PROCESSES.items():
        assert f"over 2 processes (--parallel={parallel})" in res.stdout, name
        a = [m for m in metrics(tmp_path / name / "one") if "loss" in m]
        b = [m for m in metrics(tmp_path / name / "two") if "loss" in m]
        assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3, 4], name
        assert any(m["kl"] > 0.01 for m in a), name  # (z is not clamped to 0 everywhere: it is compared)
        for x, y in zip(a, b):
            for key in ("loss", "kl"):
                assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), (name, x["step"], key)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_autocast_steps_start_at_half_the_weight(task, tmp_path, dtype):
    """bf16 and fp16 (its loss scaler) autocast: the first step is the loss of a model that is its reference,
    0.5 a row (weights 1), z is 0 there, and the steps are finite."""
    out = tmp_path / dtype
    train.main(kto_args(task, out, max_iters=3, eval_interval=3, dtype=dtype))
    steps = [m for m in metrics(out) if "loss" in m]
    assert steps[0]["loss"] == pytest.approx(0.5, abs=1e-2) and steps[0]["kl"] == pytest.approx(0, abs=1e-2)
    assert len(steps) == 3 and all(math.isfinite(m["loss"]) and math.isfinite(m["kl"]) for m in steps)


def test_a_row_loader_reads_its_own_state_only(task):
    """The row loader's state resumes it where it was; a pair loader's state (a DPO run's) is refused, naming
    what each reads."""
    loader = RowLoader(task.rows, "train", batch_size=4, block_size=BLOCK, seed=3)
    for _ in range(5):
        loader.next_batch()
    again = RowLoader(task.rows, "train", batch_size=4, block_size=BLOCK, seed=3)
    again.load_state_dict(loader.state_dict())
    a, b = loader.next_batch(), again.next_batch()
    assert torch.equal(a.pairs, b.pairs) and torch.equal(a.x, b.x) and torch.equal(a.labels, b.labels)
    pairs = PairLoader(task.pairs, "train", batch_size=4, block_size=BLOCK, seed=3)
    with pytest.raises(DataError, match="read 'pairs' batches, this run reads unpaired preference rows"):
        again.load_state_dict(pairs.state_dict())
    with pytest.raises(DataError, match="read 'unpaired rows' batches, this run reads preference pairs"):
        pairs.load_state_dict(loader.state_dict())


def test_batch_size_auto_refuses_tokens_per_step_below_one_row(task, tmp_path):
    """Under batch_size=auto a step holds whole rows: fewer tokens than one is a one-line error, before anything
    is written."""
    with pytest.raises(SystemExit, match=rf"^error: tokens_per_step \({BLOCK // 2}\) must be a multiple of "
                                         rf"block_size \({BLOCK}\): a step is made of whole sequences$"):
        train.main(kto_args(task, tmp_path / "out", batch_size="auto", gradient_accumulation_steps=1,
                            block_size=BLOCK, tokens_per_step=BLOCK // 2, max_iters=2))
    assert not (tmp_path / "out" / "last.pt").exists()


def test_the_rule_benchmark_runs_its_recipe_end_to_end_at_a_tiny_size(tmp_path):
    """benchmarks/kto_rule.py --train at a size CI runs in seconds (its figures are from the full size:
    BENCHMARKS.md): the files, SFT, the rows and their pairs prepared, KTO, then eval.py and chat.py on each
    model, and both tables, a row per evaluation step and per model."""
    out = tmp_path / "kto-rule"
    cmd = [sys.executable, "-m", "benchmarks.kto_rule", f"--out={out}", "--train", "--sft=300", "--rows=200",
           "--sft_steps=10", "--kto_steps=4", "--batch_size=8", "--lrs=1e-3", "--eval_interval=2", "--chat_prompts=3"]
    done = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    steps = lines.index("KTO, lr 0.001") + 2  # its header, then a line a step
    assert [line.split()[0] for line in lines[steps: steps + 3]] == ["0", "2", "4"]
    assert all(line.split()[2].endswith("%") for line in lines[steps: steps + 3])  # the auc
    for model in ("SFT model", "KTO, lr 0.001"):
        row = next(line for line in lines if line.startswith(model) and line.rstrip().endswith("%"))
        assert len(row[len(model):].split()) == 5  # accuracy, margin, chosen, rejected, the rule followed
    assert (out / "kto_lr0.001" / "last.pt").is_file()

