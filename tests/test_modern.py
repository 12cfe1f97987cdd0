"""The modern recipe: GPTConfig's architecture options (model.py), Muon + AdamW and the WSD schedule (optim.py),
and their way through training, resume, decoding, the configs and export (under DDP and FSDP: tests/test_fsdp.py)."""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import tiny_args, train_script

from gptkit.checkpoint import load_checkpoint, save_checkpoint
from gptkit.config import TrainConfig
from gptkit.generate import SamplingOptions, generate
from gptkit.optim import Muon, MuonAdamW, get_lr, make_optimizer, newton_schulz_dtype, set_lr, step_unless
from gptkit.options import load_config
from model import ARCH_PRESETS, GPT, GPTConfig

train = train_script()

REPO = Path(__file__).resolve().parents[1]
TINY = dict(block_size=32, vocab_size=67, n_layer=2, n_head=2, n_embd=32)

# Each option alone, then all of them (the preset).
VARIANTS = {
    "gpt2": {},
    "rope": dict(rope=True),
    "rmsnorm": dict(norm="rmsnorm"),
    "qk_norm": dict(qk_norm=True),
    "relu2": dict(activation="relu2"),
    "untied": dict(tie_embeddings=False),
    "zero_init_proj": dict(zero_init_proj=True),
    "softcap": dict(logit_softcap=3.0),
    "no_bias": dict(bias=False),
    "modern": dict(arch="modern"),
}


def tiny(seed=0, scramble=False, **options) -> GPT:
    """A tiny GPT; scramble=True replaces the (partly zero) initial weights by random ones, so that every
    layer does something."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**TINY, **options})).eval()
    if scramble:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.2 if p.dim() >= 2 else 1.0)
    return model


# ----------------------------------------------------------------------------- the model


@pytest.mark.parametrize("options", VARIANTS.values(), ids=VARIANTS.keys())
def test_every_variant_is_causal_and_starts_near_uniform(options):
    model = tiny(**options)
    torch.manual_seed(1)
    x = torch.randint(0, 67, (3, 32))
    _, loss = model(x, torch.randint(0, 67, (3, 32)))
    assert abs(loss.item() - math.log(67)) < 0.1
    scrambled = tiny(scramble=True, **options)
    x2 = x.clone()
    x2[:, 20:] = torch.randint(0, 67, (3, 12))
    a, b = scrambled(x)[0], scrambled(x2)[0]
    assert torch.equal(a[:, :20], b[:, :20])  # earlier positions never see later tokens
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_the_modern_preset_and_its_overrides():
    c = GPTConfig(**TINY, arch="modern")
    assert {k: getattr(c, k) for k in ARCH_PRESETS["modern"]} == ARCH_PRESETS["modern"]
    c = GPTConfig(**TINY, arch="modern", rope=False, logit_softcap=0.0, bias=True)
    assert (c.rope, c.logit_softcap, c.bias, c.norm) == (False, 0.0, True, "rmsnorm")
    assert GPTConfig.from_dict(c.to_dict()) == c  # what a checkpoint stores rebuilds the same model
    m = tiny(arch="modern")
    names = dict(m.named_parameters())
    assert "transformer.wpe.weight" not in names and "transformer.h.0.ln_1.weight" not in names  # RoPE, RMSNorm
    assert not any(n.endswith(".bias") for n in names)
    assert m.lm_head.weight is not m.transformer.wte.weight and torch.count_nonzero(m.lm_head.weight) == 0
    assert all(torch.count_nonzero(p) == 0 for n, p in names.items() if n.endswith("c_proj.weight"))
    for block in m.transformer.h:  # the Linear layers keep their names (LoRA targets them)
        assert {type(block.attn.c_attn), type(block.attn.c_proj), type(block.mlp.c_fc), type(block.mlp.c_proj)} \
            == {torch.nn.Linear}
    assert m.num_params() == m.num_params(non_embedding=False)  # no position table to leave out


def test_the_default_is_gpt2_key_for_key():
    m = tiny()
    C, L = 32, 2
    expected = {"transformer.wte.weight": (67, C), "transformer.wpe.weight": (32, C),
                "transformer.ln_f.weight": (C,), "transformer.ln_f.bias": (C,), "lm_head.weight": (67, C)}
    for i in range(L):
        h = f"transformer.h.{i}."
        expected.update({h + "ln_1.weight": (C,), h + "ln_1.bias": (C,), h + "attn.c_attn.weight": (3 * C, C),
                         h + "attn.c_attn.bias": (3 * C,), h + "attn.c_proj.weight": (C, C),
                         h + "attn.c_proj.bias": (C,), h + "ln_2.weight": (C,), h + "ln_2.bias": (C,),
                         h + "mlp.c_fc.weight": (4 * C, C), h + "mlp.c_fc.bias": (4 * C,),
                         h + "mlp.c_proj.weight": (C, 4 * C), h + "mlp.c_proj.bias": (C,)})
    assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == expected
    assert list(m.state_dict())[:2] == ["transformer.wte.weight", "transformer.wpe.weight"]
    assert m.lm_head.weight is m.transformer.wte.weight
    c = m.config
    assert (c.arch, c.bias, c.rope, c.norm, c.activation, c.tie_embeddings, c.logit_softcap) == \
        ("gpt2", True, False, "layernorm", "gelu_tanh", True, 0.0)
    # A checkpoint written before these options existed loads as GPT-2.
    assert GPTConfig.from_dict({k: getattr(c, k) for k in PRE_MODERN_FIELDS}) == c


PRE_MODERN_FIELDS = ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "dropout", "bias", "ln_eps",
                     "vocab_multiple")


@pytest.mark.parametrize("kwargs, field", [
    (dict(arch="llama"), "arch"), (dict(norm="batchnorm"), "norm"), (dict(activation="swiglu"), "activation"),
    (dict(logit_softcap=-1.0), "logit_softcap"), (dict(rope_base=1.0), "rope_base"), (dict(rope=1), "rope"),
    (dict(n_embd=30, n_head=10, rope=True), "rope"),
])
def test_bad_options_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        GPTConfig(**{**TINY, "n_embd": 32, **kwargs})


def test_softcap_bounds_the_logits():
    m = tiny(scramble=True, logit_softcap=2.0)
    logits, _ = m(torch.randint(0, 67, (2, 16)))
    assert logits.abs().max() < 2.0 and logits.abs().max() > 1.0


def test_kv_cache_equals_the_full_forward_for_the_modern_model():
    m = tiny(scramble=True, arch="modern")
    torch.manual_seed(3)
    x = torch.randint(0, 67, (3, 20))
    full, _ = m(x)
    m.setup_kv_cache(3)
    pieces = [m(x[:, :7], pos=torch.arange(7))[0]]
    for t in range(7, 20):
        pieces.append(m(x[:, t : t + 1], pos=torch.tensor([t]))[0])
    m.clear_kv_cache()
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shift", [1, 5, 8])
def test_greedy_decoding_with_cache_equals_without_past_block_size(shift):
    m = tiny(scramble=True, arch="modern")
    prompt = torch.randint(0, 67, (3, 5), generator=torch.Generator().manual_seed(4))
    opts = SamplingOptions(temperature=0, window_shift=shift)
    cached = generate(m, prompt, 70, opts, use_cache=True)  # 75 tokens: the window moves past block_size 32
    full = generate(m, prompt, 70, opts, use_cache=False)
    assert cached.shape == (3, 75) and torch.equal(cached, full)


def test_compiled_modern_model_matches_eager():
    pytest.importorskip("torch._inductor")
    # one block: the modern options are all inside a block, and inductor's first compile of each block's kernels
    # is most of this test's time on a machine without its cache
    m = tiny(scramble=True, arch="modern", n_layer=1)
    x = torch.randint(0, 67, (2, 32))
    try:
        compiled = torch.compile(m)(x)[0]
    except Exception as e:  # no C++ compiler on this machine: not what this test is about
        pytest.skip(f"torch.compile unavailable here: {type(e).__name__}")
    torch.testing.assert_close(compiled, m(x)[0], rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- Muon + AdamW


def block_matrix_names(model):
    return {f"transformer.h.{i}.{n}" for i in range(model.config.n_layer)
            for n in ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")}


@pytest.mark.parametrize("arch", ["modern", "gpt2"])
def test_muon_gets_exactly_the_block_matrices(arch):
    m = tiny(arch=arch)
    opt = make_optimizer(m, TrainConfig(optimizer="muon", weight_decay=0.1), "cpu")
    assert isinstance(opt, MuonAdamW) and type(opt.muon) is Muon and opt.muon.ns_dtype == torch.float32
    names = {id(p): n for n, p in m.named_parameters()}
    muon = {names[id(p)] for g in opt.muon.param_groups for p in g["params"]}
    adamw = [names[id(p)] for g in opt.adamw.param_groups for p in g["params"]]
    assert muon == block_matrix_names(m)
    assert sorted(adamw) == sorted(set(names.values()) - muon) and len(adamw) == len(set(adamw))
    decay = opt.adamw.param_groups[0]
    assert decay["weight_decay"] == 0.1 and all(p.dim() == 2 for p in decay["params"])  # wte, lm_head (, wpe)
    assert all(g["weight_decay"] == 0.0 and all(p.dim() < 2 for p in g["params"]) for g in opt.adamw.param_groups[1:])
    assert opt.param_groups == opt.muon.param_groups + opt.adamw.param_groups
    assert newton_schulz_dtype("cuda") == torch.bfloat16 and newton_schulz_dtype("cpu") == torch.float32


@pytest.mark.parametrize("nesterov, weight_decay, adjust", [(True, 0.0, None), (True, 0.1, "original"),
                                                            (False, 0.05, "match_rms_adamw")])
def test_float32_muon_is_torch_muon_within_bf16_rounding(nesterov, weight_decay, adjust):
    torch.manual_seed(0)
    shapes = [(96, 32), (32, 32), (128, 32), (32, 128)]
    ours = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    kw = dict(lr=0.02, momentum=0.9, nesterov=nesterov, weight_decay=weight_decay, adjust_lr_fn=adjust)
    opt_ours, opt_theirs = Muon(ours, **kw), torch.optim.Muon(theirs, **kw)
    for _ in range(3):
        before = [p.detach().clone() for p in ours]
        for a, b in zip(ours, theirs):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        opt_ours.step()
        opt_theirs.step()
        for a, b, p0 in zip(ours, theirs, before):
            ua, ub = a.detach() - p0, b.detach() - p0
            # bf16 keeps 8 bits of mantissa (0.4%): five Newton-Schulz steps in it drift ~1-2% from float32
            assert (ua - ub).norm() / ub.norm() < 0.04
            assert ua.norm() / ub.norm() == pytest.approx(1.0, abs=0.02)
        for a, b in zip(ours, theirs):
            b.data.copy_(a.data)  # the same weights again, so only the step's own difference is compared
    s_ours, s_theirs = opt_ours.state_dict(), opt_theirs.state_dict()
    assert s_ours["param_groups"] == s_theirs["param_groups"]  # interchangeable checkpoints
    for i in s_ours["state"]:
        assert torch.equal(s_ours["state"][i]["momentum_buffer"], s_theirs["state"][i]["momentum_buffer"])


def test_bf16_muon_is_torch_muon_exactly():
    """With ns_dtype=bfloat16 (what CUDA runs) our Muon is torch.optim.Muon, to the bit: the same arithmetic."""
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in [(96, 32), (32, 128)]]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    kw = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)
    opt_ours, opt_theirs = Muon(ours, ns_dtype=torch.bfloat16, **kw), torch.optim.Muon(theirs, **kw)
    for _ in range(3):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        opt_ours.step()
        opt_theirs.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_muon_skips_a_flagged_step_on_the_device(ns_dtype):
    """step_unless: a step flagged by found_inf (NaN gradients here) leaves weights and momentum untouched;
    an unflagged one is the plain step, to the bit."""
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(64, 32) * 0.02)]
    b = [torch.nn.Parameter(a[0].detach().clone())]
    opt_a, opt_b = (Muon(p, lr=0.02, momentum=0.9, nesterov=True, weight_decay=0.1, ns_dtype=ns_dtype)
                    for p in (a, b))
    a[0].grad, b[0].grad = torch.randn(64, 32), None
    b[0].grad = a[0].grad.clone()
    opt_a.step()
    opt_b.step()  # both have momentum now
    w, m = a[0].detach().clone(), opt_a.state[a[0]]["momentum_buffer"].clone()
    a[0].grad = torch.full((64, 32), float("nan"))
    step_unless(opt_a, torch.ones(()))
    assert torch.equal(a[0], w) and torch.equal(opt_a.state[a[0]]["momentum_buffer"], m)
    g = torch.randn(64, 32)
    a[0].grad, b[0].grad = g, g.clone()
    step_unless(opt_a, torch.zeros(()))
    opt_b.step()
    assert torch.equal(a[0], b[0])
    assert torch.equal(opt_a.state[a[0]]["momentum_buffer"], opt_b.state[b[0]]["momentum_buffer"])


def test_muon_adamw_under_grad_scaler_and_in_a_state_dict():
    def setup():
        m = tiny(arch="modern")
        return m, make_optimizer(m, TrainConfig(optimizer="muon", learning_rate=1e-3), "cpu")

    x, y = torch.randint(0, 67, (2, 32)), torch.randint(0, 67, (2, 32))
    (m1, o1), (m2, o2) = setup(), setup()
    for _ in range(2):  # plain steps vs steps through an enabled GradScaler: the same updates
        m1(x, y)[1].backward()
        o1.step()
        o1.zero_grad()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        scaler.scale(m2(x, y)[1]).backward()
        scaler.unscale_(o2)
        scaler.step(o2)
        scaler.update()
        o2.zero_grad()
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b)
    # An overflowed gradient skips the step of both optimizers.
    before = [p.detach().clone() for p in m2.parameters()]
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(m2(x, y)[1]).backward()
    next(m2.parameters()).grad[0, 0] = float("inf")
    scaler.step(o2)
    assert all(torch.equal(a, b) for a, b in zip(before, m2.parameters()))
    o2.zero_grad()
    state = o2.state_dict()
    assert set(state) == {"muon", "adamw"} and state["muon"]["state"] and state["adamw"]["state"]
    _, o3 = setup()
    o3.load_state_dict(state)
    assert torch.equal(o3.muon.state_dict()["state"][0]["momentum_buffer"], state["muon"]["state"][0]["momentum_buffer"])


def test_wsd_schedule_and_per_group_peaks():
    cfg = TrainConfig(learning_rate=1e-3, min_lr=0.0, warmup_iters=10, lr_decay_iters=100, lr_schedule="wsd",
                      cooldown_frac=0.4, optimizer="muon", muon_lr=0.05)
    assert 0 < get_lr(0, cfg) < get_lr(9, cfg) < 1e-3
    assert get_lr(10, cfg) == get_lr(60, cfg) == 1e-3  # stable until the last 40%
    assert get_lr(80, cfg) == pytest.approx(0.5e-3) and get_lr(99, cfg) == pytest.approx(0.025e-3)
    assert get_lr(100, cfg) == 0.0 == get_lr(500, cfg)
    opt = make_optimizer(tiny(arch="modern"), cfg, "cpu")
    assert set_lr(opt, 80, cfg) == pytest.approx(0.5e-3)
    assert opt.muon.param_groups[0]["lr"] == pytest.approx(0.025)  # each at the same fraction of its own peak
    assert all(g["lr"] == pytest.approx(0.5e-3) for g in opt.adamw.param_groups)


# ----------------------------------------------------------------------------- training


def modern_args(data, out, **over):
    """The suite's tiny run (conftest.tiny_args) with the modern recipe: Muon, the WSD schedule."""
    return tiny_args(data, out, **{"min_lr": 0.0, "arch": "modern", "optimizer": "muon", "lr_schedule": "wsd",
                                   "cooldown_frac": 0.5, "muon_lr": 0.02, **over})


def train_losses(out):
    lines = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {m["step"]: m["loss"] for m in lines if "loss" in m}


def test_modern_recipe_learns_and_says_which_muon(char_dataset, tmp_path, capsys):
    out = tmp_path / "out"
    summary = train.main(modern_args(char_dataset, out, max_iters=30, lr_decay_iters=30, eval_interval=15,
                                   dropout=0.0))
    losses = train_losses(out)
    assert losses[30] < losses[1] - 0.5 and summary["best_val_loss"] < 2.7  # ln(21) = 3.04 at init
    assert "Muon on 8 block matrices + AdamW on 2 other tensors; Newton-Schulz in float32" in capsys.readouterr().out
    ckpt = load_checkpoint(out / "last.pt")
    assert ckpt["model_config"]["arch"] == "modern" and ckpt["model_config"]["rope"] is True
    assert set(ckpt["optimizer"]) == {"muon", "adamw"}


def test_resume_with_muon_and_wsd_is_exact(char_dataset, tmp_path):
    full, half = tmp_path / "full", tmp_path / "half"
    train.main(modern_args(char_dataset, full))
    train.main(modern_args(char_dataset, half, max_iters=4))
    train.main(modern_args(char_dataset, half, max_iters=8, init_from="resume"))
    assert train_losses(half) == train_losses(full)  # bit-identical, every step
    a, b = load_checkpoint(full / "last.pt"), load_checkpoint(half / "last.pt")
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    for part in ("muon", "adamw"):
        for s1, s2 in zip(a["optimizer"][part]["state"].values(), b["optimizer"][part]["state"].values()):
            assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)


def test_resume_keeps_the_architecture_and_the_optimizer(char_dataset, tmp_path):
    out = tmp_path / "out"
    train.main(modern_args(char_dataset, out, max_iters=2))
    with pytest.raises(SystemExit, match=r"different model shape: arch \(checkpoint 'modern', asked 'gpt2'\)"):
        train.main(["--init_from=resume", f"--out_dir={out}", "--arch=gpt2"])
    with pytest.raises(SystemExit, match=r"qk_norm \(checkpoint True, asked False\)"):
        train.main(["--init_from=resume", f"--out_dir={out}", "--qk_norm=False"])
    with pytest.raises(SystemExit, match="with --optimizer=adamw: it was trained with muon"):
        train.main(["--init_from=resume", f"--out_dir={out}", "--optimizer=adamw"])
    saved = load_checkpoint(out / "last.pt")["model_config"]
    for name in GPTConfig.shape_names():  # each setting model.py declares part of the shape, changed alone
        other = changed_value(name, saved[name])
        with pytest.raises(SystemExit, match=rf"different model shape: {name} \(checkpoint {saved[name]!r}, "
                                             rf"asked {other!r}\)"):
            train.main(["--init_from=resume", f"--out_dir={out}", f"--{name}={other}"])
    assert train.main(["--init_from=resume", f"--out_dir={out}", "--max_iters=3", "--dropout=0.0"])["step"] == 3


def changed_value(name: str, value):
    """Another valid value of GPTConfig's setting `name`."""
    choices = next(f.metadata["choices"] for f in dataclasses.fields(GPTConfig) if f.name == name)
    if choices:
        return next(c for c in choices if c != value)
    return (not value) if isinstance(value, bool) else value * 2


def test_a_checkpoint_from_before_the_options_resumes(char_dataset, tmp_path):
    out = tmp_path / "out"
    train.main(modern_args(char_dataset, out, max_iters=2, arch="gpt2", optimizer="adamw", lr_schedule="cosine"))
    ckpt = load_checkpoint(out / "last.pt", mmap=False)
    ckpt["model_config"] = {k: ckpt["model_config"][k] for k in PRE_MODERN_FIELDS}
    new_keys = {"arch", "rope", "rope_base", "norm", "qk_norm", "activation", "tie_embeddings", "zero_init_proj",
                "logit_softcap", "optimizer", "muon_lr", "muon_momentum", "muon_weight_decay", "lr_schedule",
                "cooldown_frac"}
    ckpt["config"] = {k: v for k, v in ckpt["config"].items() if k not in new_keys}
    save_checkpoint(ckpt, out / "last.pt")
    assert train.main(["--init_from=resume", f"--out_dir={out}", "--max_iters=3"])["step"] == 3
    assert load_checkpoint(out / "last.pt")["model_config"]["arch"] == "gpt2"


# The modern recipe with Muon under DDP on 2 processes against one process (the same global batch; Muon on the
# all-reduced gradients, one writer of the run's files): tests/test_fsdp.py's test_fsdp_trains_as_one_process_does,
# in the torchrun job of its FSDP runs. (GPT-2's recipe with AdamW under DDP: test_restart's two-node run.)


MODERN_CONFIGS = ["shakespeare_cpu_modern.py", "shakespeare_modern.py", "gpt2_124m_modern.py"]


@pytest.mark.parametrize("name", MODERN_CONFIGS)
def test_modern_configs_take_a_step_at_a_tiny_shape(name, char_dataset, tmp_path):
    path = str(REPO / "configs" / name)
    cfg = load_config(TrainConfig, [path])
    assert (cfg.arch, cfg.optimizer, cfg.lr_schedule) == ("modern", "muon", "wsd")
    tiny_shape = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=2, gradient_accumulation_steps=1,
                      max_iters=2, eval_interval=2, eval_iters=1, warmup_iters=0, lr_decay_iters=2)
    summary = train.main([path, f"--dataset={char_dataset}", f"--out_dir={tmp_path / 'out'}", "--device=cpu",
                          "--compile=False", "--dtype=float32", *(f"--{k}={v}" for k, v in tiny_shape.items())])
    assert summary["step"] == 2 and math.isfinite(summary["val_loss"])


# ----------------------------------------------------------------------------- export


def test_export_of_a_modern_checkpoint_is_one_line_naming_the_options(tmp_path):
    from export import main as export_main

    m = tiny(arch="modern", logit_softcap=0.0)
    meta = {"tokenizer": {"kind": "char", "chars": [chr(65 + i) for i in range(67)]}, "vocab_size": 67}
    save_checkpoint({"format": 1, "model_config": m.config.to_dict(), "model": m.state_dict(), "tokenizer": meta,
                     "step": 0}, tmp_path / "out" / "best.pt")
    with pytest.raises(SystemExit) as e:
        export_main(["--ckpt", str(tmp_path / "out"), "--to", str(tmp_path / "hf")])
    message = str(e.value.code)
    assert message.startswith("error: ") and "\n" not in message
    for option in ("rope=True", "norm='rmsnorm'", "qk_norm=True", "activation='relu2'", "tie_embeddings=False"):
        assert option in message
    assert "logit_softcap" not in message and "zero_init_proj" not in message and "bias" not in message
    assert not (tmp_path / "hf").exists()


def test_export_refuses_exactly_the_options_gpt2_cannot_express():
    from gptkit.hf_gpt2 import HFGPT2Error, hf_config

    assert set(GPTConfig.non_gpt2_names()) == {"rope", "norm", "qk_norm", "activation", "tie_embeddings",
                                               "logit_softcap"}
    for name, value in ARCH_PRESETS["modern"].items():  # each modern option alone
        config = GPTConfig(**TINY, **{name: value})
        if name in GPTConfig.non_gpt2_names():
            with pytest.raises(HFGPT2Error, match=f"cannot be exported as a Hugging Face GPT-2: {name}="):
                hf_config(config, None)
        else:
            assert hf_config(config, None)["n_embd"] == 32


def test_every_option_is_declared_with_its_presets():
    """model.py's declarations agree: every auto option is in every preset, every option GPT-2 lacks has GPT-2's
    value there, and a resumed run keeps every option."""
    auto = {f.name for f in dataclasses.fields(GPTConfig) if f.default is None}
    assert all(set(preset) == auto for preset in ARCH_PRESETS.values())
    assert set(GPTConfig.non_gpt2_names()) <= auto <= set(GPTConfig.shape_names()) <= set(GPTConfig.setting_names())
    assert all(f.metadata["help"] for f in dataclasses.fields(GPTConfig))


def test_zero_init_proj_alone_exports_logits_exact(tmp_path):
    transformers = pytest.importorskip("transformers")
    from export import export_hf

    m = tiny(scramble=True, zero_init_proj=True, bias=False)  # initialisation only: still GPT-2's function
    export_hf(m, tmp_path / "hf")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(0, 67, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, m(x)[0], rtol=1e-4, atol=1e-4)
