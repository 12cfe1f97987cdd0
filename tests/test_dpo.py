"""The DPO objective (gptkit/objectives/preference_losses.py): its loss, gradients and metrics against a direct computation from two
models' per-token log-probabilities; LoRA's adapters-off reference against the base model, bit for bit; the
precomputed reference; and eval.py --task preference."""

import copy
import json
import math
import random

import pytest
import torch
from conftest import torch_threads, train_script

import eval as eval_script
from benchmarks import dpo_rule
from gptkit import lora
from gptkit.checkpoint import load_model
from gptkit.data.pairs import PairLoader, ValPairs
from gptkit.data.shards import read_meta
from gptkit.errors import DPOError
from gptkit.evaluation import evaluate
from gptkit.objectives import preference_losses as dpo
from gptkit.objectives.preference_losses import (
    AdapterOffReference,
    DPOObjective,
    DPOSettings,
    PrecomputedReference,
    policy_logps,
    sequence_logps,
)
from gptkit.runtime import Dist, Runtime
from model import GPT, GPTConfig
from prepare import chat as prepare_chat
from prepare import preference

train = train_script()

BLOCK = 40


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """A preference dataset of the synthetic task, in a character vocabulary."""
    root = tmp_path_factory.mktemp("dpo")
    rng = random.Random(3)
    rows = [dpo_rule.preference_pair(w, rng) for w in dpo_rule.made_up_words(300, rng)]
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    preference.main(["--input", str(root / "pairs.jsonl"), "--tokenizer", "char", "--block_size", str(BLOCK),
                     "--data_root", str(root), "--name", "pairs"])
    return root / "pairs"


def tiny(vocab_size, seed, dropout=0.0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(block_size=BLOCK, vocab_size=vocab_size, n_layer=2, n_head=2, n_embd=32, dropout=dropout,
                         bias=True))


def direct_logps(model, x, y):
    """Each row's reply log-probability, by hand: log_softmax, gather at the targets, sum where y != -1."""
    logp = torch.log_softmax(model(x)[0].float(), dim=-1)
    per_token = logp.gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (per_token * (y != -1)).sum(-1)


def direct_loss(pc, pr, rc, rr, s: DPOSettings, chosen_tokens):
    h = (pc - rc) - (pr - rr)
    if s.loss == "ipo":
        losses = (h - 1 / (2 * s.beta)) ** 2
    else:
        e = s.label_smoothing
        losses = -(1 - e) * torch.log(torch.sigmoid(s.beta * h)) - e * torch.log(torch.sigmoid(-s.beta * h))
    return losses.mean() + s.nll_weight * (-pc.sum() / chosen_tokens), h


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("settings", [DPOSettings(beta=0.1), DPOSettings(beta=0.5, label_smoothing=0.2),
                                      DPOSettings(beta=0.1, loss="ipo"), DPOSettings(beta=0.2, nll_weight=0.3)],
                         ids=["dpo", "cdpo", "ipo", "dpo+nll"])
def test_loss_gradients_and_metrics_equal_a_direct_computation(pairs, settings):
    vocab = read_meta(pairs)["vocab_size"]
    policy, ref_model = tiny(vocab, 0), tiny(vocab, 1)  # two different models: the reference is not the policy
    batch = PairLoader(pairs, "train", batch_size=6, block_size=BLOCK, seed=0).next_batch()
    B = len(batch)
    reference = PrecomputedReference.compute(ref_model, pairs, block_size=BLOCK, batch_size=16)

    loss, metrics = DPOObjective(settings, reference)(policy.train(), batch)
    loss.backward()
    ours = grads(policy)
    policy.zero_grad()

    with torch.no_grad():
        ref = direct_logps(ref_model.eval(), batch.x, batch.y)
    pi = direct_logps(policy, batch.x, batch.y)
    expected, h = direct_loss(pi[:B], pi[B:], ref[:B], ref[B:], settings, (batch.y[:B] != -1).sum())
    expected.backward()
    theirs = grads(policy)

    # (relative: IPO's loss is ~24 here, where float32's spacing is 1.9e-6)
    assert abs(loss.item() - expected.item()) < 1e-6 * max(1.0, abs(expected.item())) and 0.05 < abs(h).mean().item()
    assert ours.keys() == theirs.keys() and len(ours) == len(list(policy.parameters()))
    for name in ours:
        scale = max(1.0, theirs[name].abs().max().item())  # (float32 rounding, relative to IPO's large gradients)
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-6 * scale, rtol=1e-6, msg=name)
    rewards_c, rewards_r = settings.beta * (pi[:B] - ref[:B]), settings.beta * (pi[B:] - ref[B:])
    direct = {"chosen_reward": rewards_c.mean(), "rejected_reward": rewards_r.mean(),
              "reward_margin": (rewards_c - rewards_r).mean(), "accuracy": (rewards_c > rewards_r).float().mean(),
              "chosen_logp": pi[:B].mean(), "rejected_logp": pi[B:].mean()}
    for key, value in direct.items():
        assert abs(metrics[key].item() - value.item()) < 1e-5, key
    assert 0 < metrics["accuracy"] < 1  # a mix of wins and losses, so the comparison means something


def test_ties_are_counted_apart_from_the_accuracy_in_the_log_and_the_evaluation(pairs):
    """A pair whose margin is exactly 0 is neither won nor lost: the accuracy is over the decided pairs, exact
    over batches with different numbers of ties (the evaluation weighs each batch by its decided pairs), and
    n/a when every pair ties (as at a run's first evaluation), never a 0 that reads as every pair wrong."""
    vocab = read_meta(pairs)["vocab_size"]
    model = tiny(vocab, 0).eval()
    reference = PrecomputedReference.compute(model, pairs, block_size=BLOCK, batch_size=8, splits=("val",))
    objective = DPOObjective(DPOSettings(beta=0.1), reference)
    batches = ValPairs(pairs, "val", batch_size=8, block_size=BLOCK)
    rt, d = Runtime(torch.device("cpu"), torch.float32), Dist()
    loss, tied = evaluate(model, batches, rt, d, objective=objective)
    assert loss == pytest.approx(math.log(2), abs=1e-6)  # the model is its reference: every pair ties
    assert math.isnan(tied["accuracy"]) and tied["ties"] == 1 and tied["reward_margin"] == 0
    n = reference.tables["val"].shape[0]
    rng = random.Random(0)
    # make some pairs won (the reference liked the chosen reply less) and some lost, more in the first batch
    outcome = {i: rng.choice("wl") for i in rng.sample(range(8), 6) + rng.sample(range(8, n), 5)}
    for i, o in outcome.items():
        reference.tables["val"][i, 0] += -1.0 if o == "w" else 1.0
    loss, mixed = evaluate(model, batches, rt, d, objective=objective)
    wins = sum(o == "w" for o in outcome.values())
    assert mixed["accuracy"] == pytest.approx(wins / len(outcome), abs=1e-6)  # wins over decided pairs
    assert mixed["ties"] == pytest.approx(1 - len(outcome) / n, abs=1e-6)
    batch = next(iter(batches))  # one micro-batch, as the training step logs it
    _, metrics = objective(model, batch)
    first = [outcome[i] for i in range(8) if i in outcome]
    assert metrics["accuracy"].item() == pytest.approx(first.count("w") / len(first), abs=1e-6)
    assert metrics["ties"].item() == pytest.approx(1 - len(first) / len(batch), abs=1e-6)


def test_sequence_logps_counts_only_the_targets():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 7)
    targets = torch.tensor([[-1, 2, 3, -1, -1], [-1, -1, -1, -1, -1], [0, 1, 2, 3, 4]])
    logp = torch.log_softmax(logits, -1)
    expected = torch.stack([logp[0, 1, 2] + logp[0, 2, 3], torch.tensor(0.0),
                            sum(logp[2, t, t] for t in range(5))])
    torch.testing.assert_close(sequence_logps(logits, targets), expected)
    changed = logits.clone()
    changed[0, 0], changed[0, 3:] = 100.0, -100.0  # positions without a target: no effect
    torch.testing.assert_close(sequence_logps(changed, targets), sequence_logps(logits, targets))


def test_the_adapters_off_reference_is_the_base_model_bit_for_bit(pairs):
    vocab = read_meta(pairs)["vocab_size"]
    base = tiny(vocab, 0, dropout=0.1).eval()
    adapted = lora.apply(copy.deepcopy(base), lora.LoRASettings(rank=4, dropout=0.1))
    for name, p in adapted.named_parameters():
        if name.endswith("lora_B"):
            p.data.normal_(0, 0.1)  # as if trained: the adapters change the function
    batch = next(iter(ValPairs(pairs, "val", batch_size=4, block_size=BLOCK)))
    with torch.no_grad():
        base_logps = policy_logps(base, batch)
        base_logits = base(batch.x)[0]
    reference = AdapterOffReference(adapted.train())
    assert torch.equal(reference.logps(adapted, batch), base_logps)
    with lora.adapters_off(adapted), torch.no_grad():
        assert torch.equal(adapted.eval()(batch.x)[0], base_logits)
    adapted.train()
    assert adapted.training and all(m.enabled for m in adapted.modules() if isinstance(m, lora.LoRALinear))
    with torch.no_grad():
        assert not torch.equal(policy_logps(adapted.eval(), batch), base_logps)  # the adapters are on again
    with pytest.raises(ValueError), lora.adapters_off(adapted):
        raise ValueError
    assert all(m.enabled for m in adapted.modules() if isinstance(m, lora.LoRALinear))  # also after an error


def test_a_lora_run_starts_at_log_2_and_trains_only_its_adapters(pairs):
    vocab = read_meta(pairs)["vocab_size"]
    model = lora.apply(tiny(vocab, 0), lora.LoRASettings(rank=4))
    objective = DPOObjective(DPOSettings(beta=0.1), AdapterOffReference(model))
    batch = PairLoader(pairs, "train", batch_size=4, block_size=BLOCK).next_batch()
    loss, metrics = objective(model.train(), batch)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7) and metrics["reward_margin"].item() == 0.0
    loss.backward()
    assert {n for n, p in model.named_parameters() if p.grad is not None} == {
        n for n, _ in model.named_parameters() if n.endswith((".lora_A", ".lora_B"))}
    lora.unfreeze_embeddings(model)  # the embeddings would train too: adapters off would not be the start
    with pytest.raises(DPOError, match="adapters are all it trains"):
        AdapterOffReference(model)


def test_the_precomputed_reference_round_trips_and_belongs_to_its_dataset(pairs):
    vocab = read_meta(pairs)["vocab_size"]
    model = tiny(vocab, 2)
    reference = PrecomputedReference.compute(model, pairs, block_size=BLOCK, batch_size=16)
    batch = PairLoader(pairs, "train", batch_size=5, block_size=BLOCK, seed=9).next_batch()
    with torch.no_grad():
        torch.testing.assert_close(reference.logps(model, batch), direct_logps(model.eval(), batch.x, batch.y),
                                   atol=1e-5, rtol=0)
    restored = PrecomputedReference.from_state_dict(reference.state_dict(), pairs, BLOCK)
    assert torch.equal(restored.logps(model, batch), reference.logps(model, batch))
    with pytest.raises(DPOError, match="another dataset or block_size"):
        PrecomputedReference.from_state_dict(reference.state_dict(), pairs, BLOCK + 8)


def test_the_ranks_share_the_precomputing_and_run_the_same_forwards(pairs, monkeypatch):
    """Two ranks, simulated one after the other in a one-process group (its all_reduce is the identity): each
    scores its own batches, both run as many forwards (FSDP hangs otherwise), and their tables add up to the
    table of one process."""
    vocab = read_meta(pairs)["vocab_size"]
    model = tiny(vocab, 2)
    whole = PrecomputedReference.compute(model, pairs, block_size=BLOCK, batch_size=8)
    n_val = len(whole.tables["val"])
    assert -(-n_val // 5) % 2 == 1  # an odd number of val batches of 5: rank 1 has one fewer
    forwards = []
    original = GPT.forward
    monkeypatch.setattr(GPT, "forward", lambda self, *a, **k: forwards.append(1) or original(self, *a, **k))
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t: None)  # each rank's own rows, unsummed
    parts, counts = [], []
    for rank in (0, 1):
        forwards.clear()
        parts.append(PrecomputedReference.compute(model, pairs, block_size=BLOCK, batch_size=5, rank=rank,
                                                  world_size=2))
        counts.append(len(forwards))
    assert counts[0] == counts[1]
    for split, table in whole.tables.items():
        torch.testing.assert_close(parts[0].tables[split] + parts[1].tables[split], table, atol=1e-5, rtol=0)
        assert (parts[0].tables[split] == 0).all(dim=1).any() and (parts[1].tables[split] == 0).all(dim=1).any()


@pytest.mark.parametrize("kwargs, words", [
    (dict(beta=0), "dpo_beta"), (dict(beta=float("nan")), "dpo_beta"), (dict(label_smoothing=0.5), "[0, 0.5)"),
    (dict(loss="kto"), "sigmoid, hinge, robust, ipo"), (dict(loss="ipo", label_smoothing=0.1), "IPO"),
    (dict(nll_weight=-1), ">= 0"), (dict(loss="hinge", label_smoothing=0.1), "hinge has none"),
    (dict(loss="orpo", nll_weight=0.5), "its own NLL term"), (dict(loss="simpo", simpo_gamma=float("inf")), "gamma"),
])
def test_bad_settings_are_one_line_errors(kwargs, words):
    with pytest.raises(DPOError) as e:
        DPOSettings(**kwargs)
    assert words in str(e.value) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------- eval.py --task preference


def run_eval(capsys, *argv, err=False):
    """eval.py's JSON result (and with err, its stderr under "stderr")."""
    eval_script.main([*map(str, argv), "--device=cpu", "--compile=False"])
    said = capsys.readouterr()
    return {**json.loads(said.out.strip().splitlines()[-1]), **({"stderr": said.err} if err else {})}


def test_eval_scores_the_pairs_of_any_checkpoint(tmp_path, capsys):
    rng = random.Random(0)
    words = dpo_rule.made_up_words(500, rng)
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(dpo_rule.sft_conversation(w, rng)) + "\n"
                                                for w in words[:300]))
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(dpo_rule.preference_pair(w, rng)) + "\n"
                                                  for w in words[300:]))
    prepare_chat.main(["--input", str(tmp_path / "sft.jsonl"), "--tokenizer", "char", "--block_size", str(BLOCK),
                       "--data_root", str(tmp_path), "--name", "sft"])
    run = dict(dataset=tmp_path / "sft", n_layer=2, n_head=2, n_embd=32, block_size=BLOCK, batch_size=8,
               gradient_accumulation_steps=1, eval_interval=3, eval_iters=1, log_interval=1, warmup_iters=1,
               learning_rate=3e-3, min_lr=3e-4, device="cpu", compile=False, dropout=0.0)
    train.main([f"--{k}={v}" for k, v in {**run, "out_dir": tmp_path / "a", "max_iters": 3,
                                          "lr_decay_iters": 3}.items()])
    train.main([f"--{k}={v}" for k, v in {**run, "out_dir": tmp_path / "b", "max_iters": 3, "lr_decay_iters": 3,
                                          "init_from": tmp_path / "a"}.items()])
    preference.main(["--input", str(tmp_path / "pairs.jsonl"), "--tokenizer", str(tmp_path / "a"), "--block_size",
                     str(BLOCK), "--data_root", str(tmp_path), "--name", "pairs", "--val_fraction", "0.2"])
    data = tmp_path / "pairs"
    a, _, _ = load_model(str(tmp_path / "a"))
    b, _, _ = load_model(str(tmp_path / "b"))
    batch = next(iter(ValPairs(data, "val", batch_size=1000, block_size=BLOCK)))
    B = len(batch)
    with torch.no_grad():
        pa, pb = direct_logps(a, batch.x, batch.y), direct_logps(b, batch.x, batch.y)

    alone = run_eval(capsys, "--ckpt", tmp_path / "b", "--task=preference", "--dataset", data, "--batch_size=7")
    margin = pb[:B] - pb[B:]
    assert alone["pairs"] == B and alone["against"].startswith("none")
    assert alone["ties"] == 0 and alone["accuracy"] * B == pytest.approx(int((margin > 0).sum()))
    assert alone["margin_nats"] == pytest.approx(margin.mean().item(), abs=1e-5)
    assert alone["chosen_logp"] == pytest.approx(pb[:B].mean().item(), abs=1e-5)

    against = run_eval(capsys, "--ckpt", tmp_path / "b", "--task=preference", "--dataset", data, "--reference",
                       tmp_path / "a")
    margin = (pb[:B] - pa[:B]) - (pb[B:] - pa[B:])
    assert against["against"] == f"reference {tmp_path / 'a'}"
    assert against["accuracy"] * B == pytest.approx(int((margin > 0).sum()))
    assert against["margin_nats"] == pytest.approx(margin.mean().item(), abs=1e-5) and against["margin_nats"] != 0
    itself = run_eval(capsys, "--ckpt", tmp_path / "a", "--task=preference", "--dataset", data, "--reference",
                      tmp_path / "a", err=True)
    # every pair ties: no accuracy (0 would read as every pair ordered wrong), and the summary says why
    assert itself["margin_nats"] == 0 and itself["ties"] == 1 and itself["accuracy"] is None
    assert "accuracy n/a (every pair tied: margin 0), margin 0.000 nats (not beta-scaled)" in itself["stderr"]

    for argv, words in ((["--dataset", tmp_path / "sft"], "not preference pairs"), ([], "--dataset"),
                        (["--dataset", data, "--split", "train", "--reference", tmp_path / "nope"], "nope")):
        with pytest.raises(SystemExit) as e:
            eval_script.main(["--ckpt", str(tmp_path / "a"), "--task=preference", *map(str, argv), "--device=cpu"])
        assert words in str(e.value) and str(e.value).startswith("error:")


@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_chunked_sequence_logps_equal_the_whole_log_softmax_in_float64(softcap):
    """Slices of 7 token rows (a sequence spans several, a slice several sequences), a padded vocabulary, rows
    with no target: the same sums and gradients (hidden states and head) as the log-softmax of whole logits."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=50, vocab_multiple=64, n_layer=1, n_head=2, n_embd=16, bias=True,
                          logit_softcap=softcap)).double()
    x, y = torch.randint(50, (4, 16)), torch.randint(50, (4, 16))
    y[:, :5], y[1, 10:], y[3] = -1, -1, -1  # a prompt, a short reply, a sequence with no reply at all
    weights = torch.randn(4, dtype=torch.float64)  # d(loss)/d(sum) differs per sequence, as DPO's does

    def chunked(m, h, t):
        return dpo.chunked_sequence_logps(m, h, t, chunk_elements=64 * 7)

    ours = model(x, y, head_loss=chunked)[1]
    (ours * weights).sum().backward()
    ours_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    hidden = model.hidden_states(x)
    logits = hidden @ model.lm_head.weight.t()
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    logp = torch.log_softmax(logits[..., :50], dim=-1).gather(-1, y.clamp(min=0)[..., None])[..., 0]
    theirs = (logp * (y != -1)).sum(-1)
    (theirs * weights).sum().backward()
    assert ours.dtype == torch.float64 and ours[3] == 0 and (ours[:3] < -10).all()
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    for name, p in model.named_parameters():
        torch.testing.assert_close(ours_grads[name], p.grad, rtol=1e-10, atol=1e-12, msg=name)


def paper_loss(pc, pr, rc, rr, nc, nr, s: DPOSettings):
    """Each loss per pair from its paper's formula, in float64, written apart from preference_losses.py's (log sigmoid
    as -log(1 + e^-x), ORPO's odds as p / (1 - p))."""
    def log_sigmoid(x):
        return -torch.log1p(torch.exp(-x))

    b, e = s.beta, s.label_smoothing
    h = (pc - rc) - (pr - rr) if rc is not None else None
    if s.loss == "sigmoid":
        return -log_sigmoid(b * h) * (1 - e) - log_sigmoid(-b * h) * e
    if s.loss == "hinge":  # SLiC-HF
        return torch.clamp(1 - b * h, min=0)
    if s.loss == "robust":  # rDPO: the unbiased estimate of the loss under a flip rate e
        return ((1 - e) * -log_sigmoid(b * h) - e * -log_sigmoid(-b * h)) / (1 - 2 * e)
    if s.loss == "ipo":
        return (h - 1 / (2 * b)) ** 2
    if s.loss == "ipo_per_token":  # TRL's: every log-probability divided by its reply's tokens
        return ((pc / nc - rc / nc) - (pr / nr - rr / nr) - 1 / (2 * b)) ** 2
    if s.loss == "simpo":
        z = b / nc * pc - b / nr * pr - s.simpo_gamma
        return -log_sigmoid(z) * (1 - e) - log_sigmoid(-z) * e
    if s.loss == "orpo":
        p_c, p_r = torch.exp(pc / nc), torch.exp(pr / nr)
        return b * -log_sigmoid(torch.log((p_c / (1 - p_c)) / (p_r / (1 - p_r))))
    raise AssertionError(s.loss)


def direct_logps64(model, x, y):
    """direct_logps without its float32 cast: the log-softmax of a float64 model's logits."""
    logp = torch.log_softmax(model(x)[0], dim=-1)
    assert logp.dtype == torch.float64
    return (logp.gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (y != -1)).sum(-1)


class ForbiddenReference:
    def logps(self, model, batch):
        raise AssertionError("a reference-free loss computed a reference")


class ExactReference:
    """The reference model's log-probabilities computed directly, in float64 (a precomputed table is float32)."""

    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def logps(self, model, batch):
        return direct_logps64(self.model, batch.x, batch.y)


@pytest.mark.parametrize("settings", [
    DPOSettings(beta=0.3, loss="hinge"), DPOSettings(beta=0.5, loss="robust", label_smoothing=0.2),
    DPOSettings(beta=0.1, loss="ipo_per_token"), DPOSettings(beta=2.0, loss="simpo", simpo_gamma=0.7),
    DPOSettings(beta=2.0, loss="simpo", simpo_gamma=0.3, label_smoothing=0.1), DPOSettings(beta=0.2, loss="orpo"),
    DPOSettings(beta=0.1, loss="hinge", nll_weight=0.4), DPOSettings(beta=0.5, label_smoothing=0.2)],
    ids=["hinge", "robust", "ipo_per_token", "simpo", "simpo_smoothed", "orpo", "hinge+nll", "cdpo"])
def test_each_loss_and_its_gradients_equal_its_papers_formula_in_float64(pairs, settings):
    """The micro-batch loss (DPOObjective: the mean over the pairs, plus the NLL anchor; orpo's own NLL term)
    and its gradients against the paper's formula on log-probabilities computed directly, in float64 (1e-10);
    the reference-free losses never ask for a reference."""
    vocab = read_meta(pairs)["vocab_size"]
    policy, ref_model = tiny(vocab, 0).double(), tiny(vocab, 1).double().eval()
    batch = PairLoader(pairs, "train", batch_size=6, block_size=BLOCK, seed=0).next_batch()
    B = len(batch)
    reference = ForbiddenReference() if settings.reference_free else ExactReference(ref_model)
    loss, metrics = DPOObjective(settings, reference)(policy.train(), batch)
    loss.backward()
    ours = grads(policy)
    policy.zero_grad()

    tokens = (batch.y != -1).sum(-1).double()
    pi = direct_logps64(policy, batch.x, batch.y)
    with torch.no_grad():
        ref = None if settings.reference_free else direct_logps64(ref_model, batch.x, batch.y)
    rc, rr = (None, None) if ref is None else (ref[:B], ref[B:])
    per_pair = paper_loss(pi[:B], pi[B:], rc, rr, tokens[:B], tokens[B:], settings)
    nll = -pi[:B].sum() / tokens[:B].sum()
    expected = per_pair.mean() + (1.0 if settings.loss == "orpo" else settings.nll_weight) * nll
    expected.backward()
    theirs = grads(policy)

    assert loss.dtype == torch.float64 and 0 < per_pair.std() and per_pair.min() > 0  # pairs of distinct losses
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(metrics["dpo_loss"], per_pair.mean(), rtol=1e-10, atol=1e-12)
    if not settings.reference_free:  # the rewards logged are the log ratios the loss compares (ipo_per_token's per token)
        per = tokens if settings.loss == "ipo_per_token" else torch.ones_like(tokens)
        for key, half in (("chosen_reward", slice(0, B)), ("rejected_reward", slice(B, None))):
            want = (settings.beta * (pi[half].detach() - ref[half]) / per[half]).mean()
            torch.testing.assert_close(metrics[key], want, rtol=1e-10, atol=1e-12, msg=key)
    assert ours.keys() == theirs.keys() and len(ours) == len(list(policy.parameters()))
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-9, atol=1e-12, msg=name)
