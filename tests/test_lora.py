"""lora.py: adapters that start as a no-op, train alone, merge exactly, and know their base."""

import copy

import pytest
import torch
from conftest import tiny_args, train_script

from gptkit import lora
from gptkit.lora import LoRAError, LoRASettings
from gptkit.objectives import make_objective
from gptkit.run import Run, load_dataset, setup_run
from model import GPT


def logits(model, idx):
    with torch.no_grad():
        return model(idx)[0]


def test_step_zero_equals_the_base_exactly(tiny_model, tiny_config):
    idx = torch.randint(0, tiny_config.vocab_size, (2, 16))
    base = logits(tiny_model, idx)
    adapted = lora.apply(copy.deepcopy(tiny_model), LoRASettings(rank=4, dropout=0.1)).eval()
    assert torch.equal(logits(adapted, idx), base)
    # the base's parameter names are unchanged; each targeted layer gains lora_A and lora_B
    names = set(adapted.state_dict())
    assert set(tiny_model.state_dict()) <= names
    assert len(lora.adapter_state_dict(adapted)) == 2 * 4 * tiny_config.n_layer


def test_only_adapters_train(tiny_model, tiny_config):
    model = lora.apply(copy.deepcopy(tiny_model), LoRASettings(rank=2, targets="attn.c_attn,mlp.c_proj")).train()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"transformer.h.{i}.{t}.lora_{ab}" for i in range(tiny_config.n_layer)
                         for t in ("attn.c_attn", "mlp.c_proj") for ab in "AB"}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        idx = torch.randint(0, tiny_config.vocab_size, (2, 16))
        model(idx, idx)[1].backward()
        opt.step()
        opt.zero_grad()
    after = model.state_dict()
    for k, v in before.items():
        if "lora_" in k:
            continue
        assert torch.equal(after[k], v), k  # every base tensor bit-identical
    assert any(not torch.equal(after[k], before[k]) for k in after if k.endswith("lora_B"))


def test_merge_gives_the_same_function_and_leaves_other_tensors_alone(tiny_model, tiny_config):
    model = lora.apply(copy.deepcopy(tiny_model), LoRASettings(rank=3, alpha=6.0, targets="attn.c_attn,mlp.c_fc"))
    torch.manual_seed(1)
    for k, p in model.named_parameters():
        if k.endswith("lora_B"):
            p.data.normal_(0, 0.05)  # as if trained
    idx = torch.randint(0, tiny_config.vocab_size, (2, 16))
    unmerged = logits(model.eval(), idx)
    merged = lora.merge(model)
    assert not any(isinstance(m, lora.LoRALinear) for m in merged.modules())
    assert set(merged.state_dict()) == set(tiny_model.state_dict())
    torch.testing.assert_close(logits(merged, idx), unmerged, rtol=1e-5, atol=1e-5)
    for k, v in tiny_model.state_dict().items():
        changed = k.endswith(("attn.c_attn.weight", "mlp.c_fc.weight"))
        assert torch.equal(merged.state_dict()[k], v) != changed, k


def test_bad_settings_are_one_line_errors():
    with pytest.raises(LoRAError, match=r"unknown layer\(s\) attn\.q_proj; choose from attn\.c_attn, attn\.c_proj"):
        LoRASettings(rank=8, targets="attn.c_attn,attn.q_proj")
    with pytest.raises(LoRAError, match="lora_rank must be a positive integer"):
        LoRASettings(rank=0)
    with pytest.raises(LoRAError, match="lora_dropout"):
        LoRASettings(rank=4, dropout=1.0)


def test_adapters_must_fit_their_model(tiny_model):
    saved = lora.adapter_state_dict(lora.apply(copy.deepcopy(tiny_model), LoRASettings(rank=4)))
    other = lora.apply(copy.deepcopy(tiny_model), LoRASettings(rank=2))
    with pytest.raises(LoRAError, match="another lora_rank"):
        lora.load_adapters(other, saved)
    fewer = lora.apply(copy.deepcopy(tiny_model), LoRASettings(rank=4, targets="attn.c_attn"))
    with pytest.raises(LoRAError, match="other lora_targets"):
        lora.load_adapters(fewer, saved)


def test_fingerprint_tells_bases_apart(tiny_model, tiny_config):
    fp = lora.fingerprint(tiny_model.state_dict())
    assert fp == lora.fingerprint(copy.deepcopy(tiny_model).state_dict())
    torch.manual_seed(5)
    assert lora.fingerprint(GPT(tiny_config).state_dict()) != fp  # another initialisation
    changed = copy.deepcopy(tiny_model)
    with torch.no_grad():
        changed.transformer.h[0].mlp.c_fc.weight.mul_(1.01)  # a slightly fine-tuned layer
    assert lora.fingerprint(changed.state_dict()) != fp


# ---- through train.py, sample.py and export.py: a LoRA run on a char model this project trained

def run_args(data, out, **over):
    """The suite's tiny run (conftest.tiny_args), 4 steps at a learning rate LoRA's few weights learn at."""
    return tiny_args(data, out, **{"max_iters": 4, "eval_interval": 2, "eval_iters": 2, "warmup_iters": 1,
                                   "lr_decay_iters": 4, "learning_rate": 1e-2, "min_lr": 1e-3, "dropout": 0.0,
                                   **over})


@pytest.fixture
def base_run(char_dataset, tmp_path):
    train = train_script()

    out = tmp_path / "base"
    train.main(run_args(char_dataset, out, max_iters=3))
    return out


def lora_args(data, base, out, **over):
    args = dict(init_from=str(base), lora_rank=4, lora_alpha=8, lora_dropout=0.1, lora_targets="attn.c_attn,mlp.c_fc")
    return run_args(data, out, **{**args, **over})


def test_lora_run_trains_only_adapters_and_resumes_exactly(char_dataset, base_run, tmp_path):
    train = train_script()
    from gptkit.checkpoint import load_checkpoint, model_from_checkpoint

    full, cut = tmp_path / "full", tmp_path / "cut"
    train.main(lora_args(char_dataset, base_run, full, max_iters=6))
    train.main(lora_args(char_dataset, base_run, cut, max_iters=3))
    train.main(run_args(char_dataset, cut, init_from="resume", max_iters=6))
    a, b = load_checkpoint(full / "last.pt"), load_checkpoint(cut / "last.pt")
    assert set(a["model"]) == {k for k in a["model"] if k.endswith((".lora_A", ".lora_B"))}  # adapters only
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k  # resumed == uninterrupted, bit for bit
    assert a["lora"]["base"]["init_from"] == str(base_run.resolve())
    base = load_checkpoint(base_run / "best.pt")
    unmerged = model_from_checkpoint(a, merge_lora=False).state_dict()
    for k, v in base["model"].items():
        assert torch.equal(unmerged[k], v), k  # the base is untouched by training
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in a["model"].items() if k.endswith("lora_B"))
    assert (full / "last.pt").stat().st_size < (base_run / "last.pt").stat().st_size / 2


def test_lora_checkpoint_refuses_a_changed_or_missing_base(char_dataset, base_run, tmp_path):
    import shutil

    import sample
    train = train_script()

    out = tmp_path / "lora"
    train.main(lora_args(char_dataset, base_run, out, max_iters=2))
    sample.main(["--ckpt", str(out), "--max_new_tokens", "5", "--device=cpu", "--prompt", "the "])
    train.main(run_args(char_dataset, base_run, max_iters=3, seed=7, overwrite=True))  # the base changes
    with pytest.raises(SystemExit, match="is not the one these LoRA adapters were trained on"):
        sample.main(["--ckpt", str(out), "--max_new_tokens", "5", "--device=cpu"])
    with pytest.raises(SystemExit, match="is not the one these LoRA adapters were trained on"):
        train.main(run_args(char_dataset, out, init_from="resume", max_iters=4))
    shutil.rmtree(base_run)
    with pytest.raises(SystemExit, match="cannot load the base model .* of this LoRA checkpoint"):
        sample.main(["--ckpt", str(out), "--max_new_tokens", "5", "--device=cpu"])


def test_lora_settings_errors_through_train(char_dataset, base_run, tmp_path):
    train = train_script()

    with pytest.raises(SystemExit, match=r"lora_targets: unknown layer\(s\) mlp.c_out; choose from"):
        train.main(lora_args(char_dataset, base_run, tmp_path / "x", lora_targets="mlp.c_out"))
    with pytest.raises(SystemExit, match="LoRA adapts a trained model"):
        train.main(run_args(char_dataset, tmp_path / "y", lora_rank=4))


def test_lora_export_merges_into_an_ordinary_gpt2_folder(char_dataset, base_run, tmp_path):
    transformers = pytest.importorskip("transformers")
    import export
    train = train_script()
    from gptkit.checkpoint import load_checkpoint, model_from_checkpoint

    out = tmp_path / "lora"
    train.main(lora_args(char_dataset, base_run, out, max_iters=3))
    export.main(["--ckpt", str(out), "--to", str(tmp_path / "hf")])
    export.main(["--ckpt", str(base_run), "--to", str(tmp_path / "hf_base")])
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ours = model_from_checkpoint(load_checkpoint(out / "last.pt"), merge_lora=False).eval()
    idx = torch.randint(0, ours.config.vocab_size, (2, 24))
    with torch.no_grad():
        theirs = hf(idx).logits
    torch.testing.assert_close(theirs, logits(ours, idx), rtol=1e-5, atol=1e-5)
    from safetensors.torch import load_file

    merged, base = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "hf_base" / "model.safetensors")
    for k, v in base.items():
        targeted = k.endswith(("attn.c_attn.weight", "mlp.c_fc.weight"))
        assert torch.equal(merged[k], v) != targeted, k  # every tensor LoRA did not target is the base's, bit for bit


def test_lora_keeps_a_longer_base_whole(char_dataset, tmp_path):
    """A shorter block_size limits the training sequences only: the model keeps all the base's positions, so
    the merged model has its context, and every tensor LoRA does not target is the base's, shape included."""
    from safetensors.torch import load_file

    import export
    train = train_script()
    from gptkit.checkpoint import load_checkpoint, model_from_checkpoint
    from gptkit.checkpoint.resume import resolve_config
    from gptkit.generate import SamplingOptions, generate
    from gptkit.runtime import Dist

    base = tmp_path / "base"
    train.main(run_args(char_dataset, base, block_size=64, max_iters=3))
    full, cut = tmp_path / "full", tmp_path / "cut"
    train.main(lora_args(char_dataset, base, full, block_size=32, max_iters=4))
    train.main(lora_args(char_dataset, base, cut, block_size=32, max_iters=2))
    train.main(run_args(char_dataset, cut, init_from="resume", block_size=32, max_iters=4))  # the same flag
    a, b = load_checkpoint(full / "last.pt"), load_checkpoint(cut / "last.pt")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])  # resumed == uninterrupted
    assert a["model_config"]["block_size"] == 64 and a["loader"]["block_size"] == 32  # 32-token sequences
    cfg = resolve_config(run_args(char_dataset, cut, init_from="resume", block_size=32))[0]
    run = Run(cfg, [], Dist(), None, None, model_from_checkpoint(a), None, None, None, None, None, accum=2,
              objective=make_objective(cfg))
    assert run.tokens_per_step == 4 * 32 * 2

    export.main(["--ckpt", str(full), "--to", str(tmp_path / "hf")])
    export.main(["--ckpt", str(base), "--to", str(tmp_path / "hf_base")])
    merged, original = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "hf_base" / "model.safetensors")
    assert merged.keys() == original.keys() and merged["transformer.wpe.weight"].shape == (64, 32)
    for k, v in original.items():
        targeted = k.endswith(("attn.c_attn.weight", "mlp.c_fc.weight"))
        assert torch.equal(merged[k], v) != targeted, k

    model = model_from_checkpoint(a).eval()  # merged, as sample.py loads it
    prompt = torch.randint(0, model.config.vocab_size, (1, 50), generator=torch.Generator().manual_seed(0))
    out = generate(model, prompt, 1, SamplingOptions(temperature=0))  # the window holds all 50 tokens
    assert model.config.block_size == 64 and out[0, -1] == logits(model, prompt)[0, -1].argmax()

    # A full fine-tune crops (as nanoGPT does): it trains the first block_size positions only.
    train.main(run_args(char_dataset, tmp_path / "ft", init_from=str(base), block_size=32, max_iters=1))
    assert load_checkpoint(tmp_path / "ft" / "last.pt")["model"]["transformer.wpe.weight"].shape == (32, 32)


# ---- the frozen base in bf16 (train.py, on a GPU with bf16)


def block_linear(name: str) -> bool:
    """A weight or bias of one of the blocks' Linear layers (not an adapter)."""
    return name.startswith("transformer.h.") and name.endswith(tuple(f"{t}.{w}" for t in lora.TARGETS
                                                                     for w in ("weight", "bias")))


@pytest.mark.parametrize("tied", [True, False], ids=["tied-head", "untied-head"])
def test_cast_frozen_base_keeps_the_residual_stream_in_fp32(tiny_config, tied):
    import dataclasses

    torch.manual_seed(0)
    model = GPT(dataclasses.replace(tiny_config, tie_embeddings=tied))
    if not tied:
        torch.nn.init.normal_(model.lm_head.weight, std=0.02)  # its zero init would make every logit 0
    idx = torch.randint(0, tiny_config.vocab_size, (2, 16))
    reference = logits(model.eval(), idx)
    lora.cast_frozen_base(lora.apply(model, LoRASettings(rank=4, targets="attn.c_attn,mlp.c_fc")),
                          torch.bfloat16)
    for name, p in model.named_parameters():  # bf16: the blocks' frozen Linear weights and biases only
        assert p.dtype == (torch.bfloat16 if block_linear(name) else torch.float32), name
    assert not model.lm_head.weight.requires_grad

    residual = []
    model.transformer.h[0].register_forward_hook(lambda module, inputs, out: residual.append(out.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        adapted = logits(model, idx)
        loss = model.train()(idx, idx)[1]
    loss.backward()
    assert residual == [torch.float32, torch.float32]  # as in every run that is not LoRA
    torch.testing.assert_close(adapted.float(), reference, rtol=0.05, atol=0.05)  # bf16 matmuls
    assert all(p.grad.dtype == torch.float32 for n, p in model.named_parameters() if p.requires_grad)


def test_a_gpu_lora_run_casts_only_the_blocks(char_dataset, base_run, tmp_path):
    from gptkit.checkpoint.resume import resolve_config
    from gptkit.runtime import Dist, Runtime

    class CudaLike(Runtime):  # what setup_run sees on a GPU with bf16; the tensors stay on the CPU here
        @property
        def device_type(self) -> str:
            return "cuda"

    argv = lora_args(char_dataset, base_run, tmp_path / "lora")
    cfg, _ = resolve_config(argv)
    data_dir, meta = load_dataset(cfg, Dist())
    (tmp_path / "lora").mkdir()
    run, _, _ = setup_run(cfg, None, argv, Dist(), CudaLike(torch.device("cpu"), torch.bfloat16), data_dir, meta)
    dtypes = {n: p.dtype for n, p in run.raw_model.named_parameters()}
    assert {n for n, dt in dtypes.items() if dt == torch.bfloat16} == {n for n in dtypes if block_linear(n)}
    assert dtypes["transformer.wte.weight"] == dtypes["transformer.ln_f.weight"] == torch.float32


def test_activation_checkpointing_gives_the_same_gradients(tiny_config):
    import dataclasses

    torch.manual_seed(0)
    model = GPT(dataclasses.replace(tiny_config, dropout=0.1)).train()
    idx = torch.randint(0, tiny_config.vocab_size, (3, 24))
    grads = []
    for recompute in (False, True):
        model.activation_checkpointing = recompute
        model.zero_grad()
        torch.manual_seed(1)  # the same dropout masks: the recomputation must replay them
        loss = model(idx, idx)[1]
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert torch.equal(grads[0][0], grads[1][0])
    for n in grads[0][1]:
        torch.testing.assert_close(grads[1][1][n], grads[0][1][n], rtol=1e-6, atol=1e-7, msg=n)
