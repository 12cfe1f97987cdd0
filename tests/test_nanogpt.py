"""nanoGPT's users: its setting names work here (ours, an alias, or an error naming ours), and its checkpoint
(out/ckpt.pt, with its dataset's meta.pkl) is read wherever a checkpoint is.

Two oracles. nanoGPT's own code (../shared/anchors/nanoGPT, copied into a temporary folder): its train.py
trains its shakespeare_char config a few steps on the CPU, and its model.py and sample.py give the logits and
greedy text ours must equal, past block_size. And transformers: checkpoints written here in nanoGPT's key
layout from a tiny random GPT-2 with the exact GELU (activation_function="gelu", nanoGPT's nn.GELU()) cover
the layouts (compiled keys, mask buffers, GPT-2's padded vocabulary, where meta.pkl is looked for)."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import shutil
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

import pytest
import torch
from conftest import SHARED_DATA, train_script

import export
import sample
from gptkit import checkpoint, cpu_decode
from gptkit import generate as gen
from gptkit.config import TrainConfig
from gptkit.generate import SamplingOptions, decode_one_token, generate, prefill
from gptkit.hf_gpt2 import load_pretrained
from gptkit.options import ConfigError, parse_args
from model import GPT, GPTConfig

train = train_script()

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
    assert "1 is exact (nanoGPT's tokens)" in lines["--window_shift=1"]  # and more is approximate, it says


def test_start_with_file_is_prompt_file_and_out_dir_is_ckpt():
    assert parse_args(sample.SampleConfig, ["--start=FILE:p.txt", "--out_dir=o"], allow_files=False) == {
        "prompt_file": "p.txt", "ckpt": "o"}
    assert parse_args(sample.SampleConfig, ["--start", "ROMEO:", "--out_dir", "o"], allow_files=False) == {
        "prompt": "ROMEO:", "ckpt": "o"}


# ----------------------------------------------------------------------------- nanoGPT's ckpt.pt


def tiny_hf(vocab: int, seed: int = 0, n_embd: int = 32):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=32, n_embd=n_embd, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, activation_function="gelu",
                                     bos_token_id=None, eos_token_id=None)  # gelu: the exact one, nanoGPT's
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
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["activation_function"] == "gelu"
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(len(chars), (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, hf(x).logits, atol=1e-5, rtol=1e-5)
    summary = train.main([f"--dataset={char_dataset}", f"--out_dir={tmp_path / 'ft'}",
                          f"--init_from={tmp_path / 'out'}", "--block_size=32", "--batch_size=2",
                          "--gradient_accumulation_steps=1", "--max_iters=2", "--eval_interval=2", "--eval_iters=1",
                          "--warmup_iters=0", "--lr_decay_iters=2", "--device=cpu", "--compile=False"])
    assert summary["step"] == 2
    saved = checkpoint.load_checkpoint(tmp_path / "ft")["model_config"]
    assert saved["n_embd"] == 32 and saved["activation"] == "gelu"  # the fine-tuned model keeps nanoGPT's GELU


def test_resuming_a_nanogpt_out_dir_says_how_to_continue_from_it(tmp_path):
    write_nanogpt(tmp_path / "out", tiny_hf(40))
    with pytest.raises(SystemExit) as e:
        train.main(["--init_from=resume", f"--out_dir={tmp_path / 'out'}"])
    message = str(e.value.code)
    assert "nanoGPT's checkpoint" in message and f"--init_from={tmp_path / 'out'} --out_dir=NEW_DIR" in message


# ----------------------------------------------------------------------------- nanoGPT's own code as the oracle

NANOGPT = SHARED_DATA.parent / "anchors" / "nanoGPT"  # nanoGPT's repository (MIT), beside the shared data
# nanoGPT's shakespeare_char config, shrunk to train in seconds on a CPU: ~0.1M parameters, 32 characters of
# context (a 200-character sample runs far past it), no dropout, a checkpoint at the last step. The high learning
# rate takes the loss from 4.2 to ~2.75 in 300 steps: enough for a greedy text that depends on its context (so
# that the window's moves show in it) and for the tanh GELU to move the logits well past the tolerance; both
# are checked below, so that the tests can see what they test.
BLOCK = 32
STEPS = 300
NANOGPT_TRAIN = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--dtype=float32",
                 "--n_layer=2", "--n_head=2", "--n_embd=64", f"--block_size={BLOCK}", "--batch_size=16",
                 "--dropout=0.0", f"--max_iters={STEPS}", f"--eval_interval={STEPS}", "--eval_iters=1",
                 f"--log_interval={STEPS}", "--always_save_checkpoint=True", "--warmup_iters=0",
                 "--learning_rate=1e-2", f"--lr_decay_iters={STEPS}", "--min_lr=1e-3", "--out_dir=out"]
PROMPT = "ROMEO:"
NEW_TOKENS = 200  # past block_size: the window slides 175 times


def run_nanogpt(root: Path, *args: str) -> str:
    """One of nanoGPT's scripts, run as nanoGPT's README says (from its folder, so that its `import model` is
    its own model.py and data/ is its data); its stdout. One thread: the model is tiny."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"nanoGPT's {args[0]} failed:\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def nanogpt_run(tmp_path_factory) -> Path:
    """A copy of nanoGPT whose out/ckpt.pt its own train.py wrote, from data its own prepare.py made."""
    text = SHARED_DATA / "tinyshakespeare.txt"
    if not (NANOGPT / "train.py").is_file() or not text.is_file():
        pytest.skip(f"nanoGPT's code ({NANOGPT}) or {text} is not present")
    root = tmp_path_factory.mktemp("nanogpt") / "nanoGPT"
    shutil.copytree(NANOGPT, root, ignore=shutil.ignore_patterns("out*", "*.bin", "*.pkl", "__pycache__"))
    shutil.copy(text, root / "data" / "shakespeare_char" / "input.txt")  # else prepare.py downloads it
    run_nanogpt(root, "data/shakespeare_char/prepare.py")
    run_nanogpt(root, "train.py", *NANOGPT_TRAIN)
    assert (root / "out" / "ckpt.pt").is_file()
    return root


def nanogpt_model(root: Path):
    """nanoGPT's own GPT (its model.py, imported under another name: ours is `model`) with the weights of
    root/out/ckpt.pt, loaded as its sample.py loads them."""
    spec = importlib.util.spec_from_file_location("nanogpt_model", root / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ckpt = torch.load(root / "out" / "ckpt.pt", map_location="cpu")
    model = module.GPT(module.GPTConfig(**ckpt["model_args"]))
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()})
    return model.eval()


def logits_per_step(monkeypatch, model, idx: torch.Tensor, shift: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding with gptkit/generate.py's window (moved `shift` tokens at a time): the tokens (prompt
    included) and the logits each step chose from, (NEW_TOKENS, vocab)."""
    seen, choose = [], gen.next_token

    def recording(logits, options, noise=None):
        seen.append(logits[0].float().clone())
        return choose(logits, options, noise)

    monkeypatch.setattr(gen, "next_token", recording)
    try:
        ids = generate(model, idx, NEW_TOKENS, SamplingOptions(temperature=0, window_shift=shift))[0]
    finally:
        monkeypatch.setattr(gen, "next_token", choose)
    return ids, torch.stack(seen)


def window_is_exact(prompt: int, block: int, shift: int) -> torch.Tensor:
    """For each generated token: whether a window moved `shift` tokens at a time (as generate moves it) holds
    exactly the last min(length, block) tokens before it, what the exact window sees."""
    start, exact = max(0, prompt - block), []
    for length in range(prompt, prompt + NEW_TOKENS):
        if length - start > block:
            start += shift
        exact.append(start == max(0, length - block))
    return torch.tensor(exact)


@torch.no_grad()
def windowed_logits(theirs, ids: torch.Tensor, prompt: int, block: int) -> torch.Tensor:
    """nanoGPT's model's logits for each token after the prompt, from exactly the last `block` tokens before
    it (what its generate does): the oracle of the exact window."""
    rows = [theirs(ids[None, max(0, t - block): t])[0][0, -1] for t in range(prompt, len(ids))]
    return torch.stack(rows).float()


def test_a_checkpoint_of_nanogpts_train_py_gives_its_model_py_logits(nanogpt_run, monkeypatch):
    monkeypatch.chdir(nanogpt_run)  # its meta.pkl is where nanoGPT keeps it, data/shakespeare_char/
    ours, tokenizer, _ = checkpoint.load_model("out")
    assert ours.config.activation == "gelu" and tokenizer.kind == "char" and ours.config.block_size == BLOCK
    theirs = nanogpt_model(nanogpt_run)
    x = torch.randint(tokenizer.vocab_size, (2, BLOCK), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, _ = theirs(x, x)  # with targets nanoGPT returns every position's logits
        torch.testing.assert_close(ours(x)[0], expected, atol=1e-5, rtol=0)
        # The test can see the activation: GPT-2's tanh GELU on these weights misses by more than the tolerance.
        tanh = GPT(replace(ours.config, activation="gelu_tanh"))
        tanh.load_state_dict(ours.state_dict())
        assert (tanh.eval()(x)[0] - expected).abs().max() > 1e-4
        # sample.py's CPU default: packed float32 weights, one-token steps through the KV cache (whose fused
        # kernel computes the tanh GELU: a gelu block must not take it)
        cpu_decode.pack_for_cpu(ours, "float32")
        ours.setup_kv_cache(2)
        steps = [prefill(ours, x[:, :1], torch.arange(1))]
        steps += [decode_one_token(ours, x[:, t : t + 1], torch.tensor([t])) for t in range(1, BLOCK)]
        torch.testing.assert_close(torch.stack(steps, dim=1), expected, atol=1e-5, rtol=0)


def test_greedy_samples_past_block_size_are_nanogpts_sample_py_text(nanogpt_run, monkeypatch, capsys):
    """nanoGPT's sample.py with top_k=1 is greedy (its multinomial draws the one token left); ours with
    temperature 0 and the default window prints the same 200 characters, far past the 32-character context."""
    out = run_nanogpt(nanogpt_run, "sample.py", "--out_dir=out", "--device=cpu", "--dtype=float32",
                      f"--start={PROMPT}", "--num_samples=1", f"--max_new_tokens={NEW_TOKENS}", "--top_k=1")
    theirs = out.split("Loading meta from data/shakespeare_char/meta.pkl...\n", 1)[1].rsplit("\n" + "-" * 15, 1)[0]
    assert theirs.startswith(PROMPT) and len(theirs) == len(PROMPT) + NEW_TOKENS
    monkeypatch.chdir(nanogpt_run)
    sample.main(["--ckpt=out", f"--prompt={PROMPT}", "--temperature=0", f"--max_new_tokens={NEW_TOKENS}",
                 "--device=cpu", "--stream=False"])
    assert capsys.readouterr().out == theirs + "\n"
    # model.generate and generate's default window give the same tokens.
    model, tokenizer, _ = checkpoint.load_model("out")
    idx = torch.tensor([tokenizer.encode(PROMPT)])
    assert tokenizer.decode(model.generate(idx, NEW_TOKENS, temperature=0)[0].tolist()) == theirs
    assert tokenizer.decode(generate(model, idx, NEW_TOKENS, SamplingOptions(temperature=0))[0].tolist()) == theirs
    # The same text could hide a wrong window when the greedy text is a loop that any context reproduces (it
    # depends on the machine's floating-point path that trained the model). So the window is checked on the
    # logits of every step: the default window's equal nanoGPT's model's on the last BLOCK tokens, and a faster
    # window_shift's differ from them once its window has moved (it sees fewer tokens): the check sees the window.
    theirs_model = nanogpt_model(nanogpt_run)
    exact_ids, exact = logits_per_step(monkeypatch, model, idx, 1)
    shifted_ids, shifted = logits_per_step(monkeypatch, model, idx, BLOCK // 4)
    same = window_is_exact(idx.shape[1], BLOCK, BLOCK // 4)  # per step: does the moved window see the same tokens?
    torch.testing.assert_close(exact, windowed_logits(theirs_model, exact_ids, idx.shape[1], BLOCK), atol=1e-4,
                               rtol=0)
    gap = (shifted - windowed_logits(theirs_model, shifted_ids, idx.shape[1], BLOCK)).abs().amax(dim=-1)
    assert gap[same].max() < 1e-4 and gap[~same].min() > 1e-3 and (~same).sum() > NEW_TOKENS // 2
    assert tokenizer.decode(exact_ids.tolist()) == theirs
    capsys.readouterr()  # (nanoGPT's model printed its size)
    sample.main(["--ckpt=out", f"--prompt={PROMPT}", "--temperature=0", f"--max_new_tokens={NEW_TOKENS}",
                 "--device=cpu", "--stream=False", f"--window_shift={BLOCK // 4}"])
    fast = capsys.readouterr().out  # sample.py's approximate window: the same text up to a full window
    assert fast[: BLOCK + 1] == theirs[: BLOCK + 1] and len(fast) == len(theirs) + 1
    with pytest.raises(SystemExit) as e:
        sample.main(["--ckpt=out", "--device=cpu", f"--window_shift={BLOCK + 1}"])
    assert f"window_shift must be at most the model's block_size, {BLOCK}; got {BLOCK + 1}" in str(e.value.code)


def test_a_nanogpt_checkpoint_exports_to_transformers_with_the_exact_gelu_and_not_to_gguf(nanogpt_run, tmp_path,
                                                                                          monkeypatch):
    monkeypatch.chdir(nanogpt_run)
    export.main(["--ckpt", "out", "--out", str(tmp_path / "hf")])
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.activation_function == "gelu"
    back = load_pretrained(str(tmp_path / "hf"))  # and read back here, as gelu
    assert back.config.activation == "gelu"
    x = torch.randint(65, (1, BLOCK), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, _ = nanogpt_model(nanogpt_run)(x, x)
        torch.testing.assert_close(hf(x).logits, expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(back(x)[0], expected, atol=1e-5, rtol=0)
    pytest.importorskip("gguf", reason="the GGUF export needs the gguf package: pip install gguf")
    with pytest.raises(SystemExit) as e:
        export.main(["--ckpt", "out", "--format", "gguf", "--out", str(tmp_path / "m.gguf")])
    message = str(e.value.code)
    assert "\n" not in message and "exact (erf) GELU" in message and "--format hf" in message
    assert not (tmp_path / "m.gguf").exists()


def test_a_checkpoint_from_before_the_activation_setting_loads_with_gpt2s_gelu(tiny_config):
    config = GPTConfig.to_dict(tiny_config)
    del config["activation"]
    model = checkpoint.model_from_checkpoint({"model_config": config, "model": GPT(tiny_config).state_dict()})
    assert model.config.activation == "gelu_tanh" and GPT(tiny_config).config.to_dict()["activation"] == "gelu_tanh"
