"""nanoGPT's users: its setting names work here (ours, an alias, or an error naming ours), and its checkpoint
(out/ckpt.pt, with its dataset's meta.pkl) is read wherever a checkpoint is. The checkpoints are written here,
in nanoGPT's key layout, from a tiny random transformers GPT-2 (no nanoGPT code); transformers is the oracle."""

from __future__ import annotations

import json
import pickle
from dataclasses import fields
from pathlib import Path

import pytest
import torch

import export
import sample
import train
from gptkit import checkpoint
from gptkit.config import ConfigError, TrainConfig, parse_args

transformers = pytest.importorskip("transformers")

# The settings of nanoGPT's train.py (its configurator globals) and of its sample.py.
NANOGPT_TRAIN = ("out_dir eval_interval log_interval eval_iters eval_only always_save_checkpoint init_from wandb_log "
                 "wandb_project wandb_run_name dataset gradient_accumulation_steps batch_size block_size n_layer "
                 "n_head n_embd dropout bias learning_rate max_iters weight_decay beta1 beta2 grad_clip decay_lr "
                 "warmup_iters lr_decay_iters min_lr backend device dtype compile").split()
NANOGPT_SAMPLE = "init_from out_dir start num_samples max_new_tokens temperature top_k seed device dtype compile".split()
A_VALUE = {"init_from": "resume", "out_dir": "out", "start": "hello", "dataset": "x", "wandb_project": "p",
           "wandb_run_name": "r", "backend": "gloo", "device": "cpu", "dtype": "float32"}


@pytest.mark.parametrize("cls, names", [(TrainConfig, NANOGPT_TRAIN), (sample.SampleConfig, NANOGPT_SAMPLE)])
def test_every_nanogpt_setting_name_is_ours_or_an_alias_or_names_ours(cls, names):
    ours = {f.name for f in fields(cls)}
    aliases = getattr(cls, "ALIASES", {})
    for name in names:
        if name in ours or name in aliases:
            value = A_VALUE.get(name, "1")
            parsed = parse_args(cls, [f"--{name}={value}"], allow_files=False)
            assert len(parsed) == 1 and set(parsed) <= ours, name
        else:  # not one of ours: a one-line error that names our spelling
            with pytest.raises(ConfigError, match=r"did you mean '\w+'") as e:
                parse_args(cls, [f"--{name}=1"], allow_files=False)
            assert "\n" not in str(e.value)


def test_sample_help_lists_the_aliases(capsys):
    with pytest.raises(SystemExit):
        sample.main(["--help"])
    out = capsys.readouterr().out
    assert "aliases (nanoGPT's spellings)" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip().startswith("--")}
    assert "alias  same as --ckpt" in lines["--out_dir=..."] and "alias  same as --prompt" in lines["--start=..."]


def test_start_with_file_is_prompt_file_and_out_dir_is_ckpt():
    assert parse_args(sample.SampleConfig, ["--start=FILE:p.txt", "--out_dir=o"], allow_files=False) == {
        "prompt_file": "p.txt", "ckpt": "o"}
    assert parse_args(sample.SampleConfig, ["--start", "ROMEO:", "--out_dir", "o"], allow_files=False) == {
        "prompt": "ROMEO:", "ckpt": "o"}


# ----------------------------------------------------------------------------- nanoGPT's ckpt.pt


def tiny_hf(vocab: int, seed: int = 0, n_embd: int = 32):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=32, n_embd=n_embd, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=None, eos_token_id=None)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # biases and LayerNorms away from their 0/1 init, so a mix-up shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.normal_(0, 0.1 if name.endswith("bias") else 1.0)
    return model


def write_nanogpt(out: Path, hf, dataset: str = "shakespeare_char", compiled: bool = True,
                  vocab: int | None = None) -> Path:
    """A ckpt.pt as nanoGPT's train.py saves one: its GPT's state dict (nn.Linear weights: HF's Conv1D ones
    transposed, as its from_pretrained does; the causal-mask buffers; `_orig_mod.` when compiled)."""
    c = hf.config
    state = {}
    for key, tensor in hf.state_dict().items():
        if key.endswith(("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")):
            tensor = tensor.t()
        state[key] = tensor.clone()
    state["lm_head.weight"] = state["transformer.wte.weight"]  # tied
    for i in range(c.n_layer):
        state[f"transformer.h.{i}.attn.bias"] = torch.tril(torch.ones(32, 32)).view(1, 1, 32, 32)
    if compiled:
        state = {f"_orig_mod.{k}": v for k, v in state.items()}
    model_args = dict(n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd, block_size=c.n_positions, bias=True,
                      vocab_size=vocab or c.vocab_size, dropout=0.0)
    config = dict(out_dir=str(out), dataset=dataset, batch_size=12, learning_rate=1e-3, compile=compiled)
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"model": state, "optimizer": {"state": {}, "param_groups": []}, "model_args": model_args,
                "iter_num": 250, "best_val_loss": torch.tensor(1.4697), "config": config}, out / "ckpt.pt")
    return out / "ckpt.pt"


def write_meta_pkl(path: Path, chars: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": {c: i for i, c in enumerate(chars)}}
    path.write_bytes(pickle.dumps(meta))


def char_chars(char_dataset: Path) -> list[str]:
    return json.loads((char_dataset / "meta.json").read_text())["tokenizer"]["chars"]


def test_a_nanogpt_checkpoint_gives_transformers_logits(tmp_path, monkeypatch, char_dataset, capsys):
    chars = char_chars(char_dataset)
    hf = tiny_hf(len(chars))
    monkeypatch.chdir(tmp_path)
    write_nanogpt(tmp_path / "out", hf)
    write_meta_pkl(tmp_path / "data" / "shakespeare_char" / "meta.pkl", chars)  # where nanoGPT keeps it
    model, tokenizer, what = checkpoint.load_model("out")
    assert tokenizer.kind == "char" and list(tokenizer.chars) == chars and "(step 250)" in what
    assert "nanoGPT checkpoint" in capsys.readouterr().err
    x = torch.randint(len(chars), (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(model(x)[0], hf(x).logits, atol=1e-5, rtol=1e-5)


def test_sample_with_nanogpts_spellings_and_the_meta_beside_the_checkpoint(tmp_path, char_dataset, capsys):
    chars = char_chars(char_dataset)
    write_nanogpt(tmp_path / "out", tiny_hf(len(chars)), dataset="elsewhere", compiled=False)
    write_meta_pkl(tmp_path / "out" / "meta.pkl", chars)
    (tmp_path / "prompt.txt").write_text("the king")
    sample.main(["--device=cpu", f"--out_dir={tmp_path / 'out'}", f"--start=FILE:{tmp_path / 'prompt.txt'}",
                 "--init_from=resume", "--max_new_tokens=5", "--num_samples=1", "--stream=False"])
    out = capsys.readouterr().out
    assert out.startswith("the king") and len(out) == len("the king") + 5 + 1


def test_a_nanogpt_checkpoint_without_its_meta_pkl_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_nanogpt(tmp_path / "out", tiny_hf(40))
    with pytest.raises(SystemExit) as e:
        sample.main(["--device=cpu", "--out_dir=out"])
    message = str(e.value.code)
    assert "\n" not in message and "40-token vocabulary" in message
    assert "out/meta.pkl or data/shakespeare_char/meta.pkl" in message


def test_a_gpt2_bpe_nanogpt_checkpoint_keeps_its_padding_out_of_the_logits(tmp_path, monkeypatch):
    """nanoGPT pads GPT-2's 50257 tokens to 50304 rows; no meta.pkl: GPT-2's BPE, as nanoGPT assumes."""
    monkeypatch.chdir(tmp_path)
    hf = tiny_hf(50304, n_embd=8)
    write_nanogpt(tmp_path / "out", hf, dataset="openwebtext")
    state = checkpoint.load_checkpoint("out")
    assert state["tokenizer"]["tokenizer"] == {"kind": "tiktoken", "name": "gpt2"}
    model = checkpoint.model_from_checkpoint(state).eval()
    assert model.config.vocab_size == 50257 and model.config.padded_vocab_size == 50304
    x = torch.randint(50257, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(x)[0], hf(x).logits[..., :50257], atol=1e-5, rtol=1e-5)


def test_export_and_fine_tune_from_a_nanogpt_checkpoint(tmp_path, char_dataset):
    chars = char_chars(char_dataset)
    hf = tiny_hf(len(chars))
    write_nanogpt(tmp_path / "out", hf, dataset=str(char_dataset))
    write_meta_pkl(tmp_path / "out" / "meta.pkl", chars)
    export.main(["--ckpt", str(tmp_path / "out"), "--to", str(tmp_path / "hf")])
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(len(chars), (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, hf(x).logits, atol=1e-5, rtol=1e-5)
    summary = train.main([f"--dataset={char_dataset}", f"--out_dir={tmp_path / 'ft'}",
                          f"--init_from={tmp_path / 'out'}", "--block_size=32", "--batch_size=2",
                          "--gradient_accumulation_steps=1", "--max_iters=2", "--eval_interval=2", "--eval_iters=1",
                          "--warmup_iters=0", "--lr_decay_iters=2", "--device=cpu", "--compile=False"])
    assert summary["step"] == 2
    assert checkpoint.load_checkpoint(tmp_path / "ft")["model_config"]["n_embd"] == 32


def test_resuming_a_nanogpt_out_dir_says_how_to_continue_from_it(tmp_path):
    write_nanogpt(tmp_path / "out", tiny_hf(40))
    with pytest.raises(SystemExit) as e:
        train.main(["--init_from=resume", f"--out_dir={tmp_path / 'out'}"])
    message = str(e.value.code)
    assert "nanoGPT's checkpoint" in message and f"--init_from={tmp_path / 'out'} --out_dir=NEW_DIR" in message
