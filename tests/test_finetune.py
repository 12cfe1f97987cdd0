"""End to end: fine-tune a (tiny, local) GPT-2 folder with train.py, then sample and export the result;
and sample.py on a checkpoint that train.py wrote."""

import pytest
import torch
from conftest import needs_gpt2_bpe, train_script, write_dataset

import export
import sample
from gptkit.checkpoint import load_checkpoint, model_from_checkpoint
from gptkit.tokenizer import Tokenizer

train = train_script()

pytest.importorskip("transformers")


@pytest.fixture
def tiny_gpt2_folder(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=50257))
    folder = tmp_path / "tiny-gpt2"
    hf.save_pretrained(folder)
    return folder


@needs_gpt2_bpe
def test_finetune_local_gpt2_then_sample_and_export(tiny_gpt2_folder, tmp_path, capsys):
    text = "To be, or not to be, that is the question.\n" * 400
    data = write_dataset(tmp_path / "bpe", text, Tokenizer.tiktoken("gpt2"))
    out = tmp_path / "out"
    summary = train.main([f"--init_from={tiny_gpt2_folder}", f"--dataset={data}", f"--out_dir={out}",
                          "--block_size=32", "--batch_size=4", "--gradient_accumulation_steps=1", "--max_iters=20",
                          "--eval_interval=10", "--eval_iters=2", "--learning_rate=1e-2", "--decay_lr=False",
                          "--dropout=0.1", "--device=cpu", "--compile=False"])
    losses = [m["loss"] for m in map(__import__("json").loads, (out / "metrics.jsonl").read_text().splitlines())
              if "loss" in m]
    assert losses[-1] < losses[0] - 1.0  # a repeated sentence is quickly learned
    ckpt = load_checkpoint(out / "best.pt")
    assert ckpt["model_config"]["block_size"] == 32 and ckpt["model_config"]["dropout"] == 0.1
    assert summary["best_val_loss"] < 5

    capsys.readouterr()
    sample.main(["--ckpt", str(out), "--prompt", "To be", "--max_new_tokens", "12", "--temperature", "0",
                 "--stream=False"])
    printed = capsys.readouterr().out
    assert printed.startswith("To be") and len(printed) > len("To be\n")

    export.main(["--ckpt", str(out), "--to", str(tmp_path / "hf")])
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ours = model_from_checkpoint(ckpt).eval()
    x = torch.randint(0, 50257, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x)[0], rtol=1e-5, atol=1e-5)


def test_sample_cli_on_a_checkpoint_trained_by_train_py(char_dataset, tmp_path, capsys):
    out = tmp_path / "out"
    train.main([f"--dataset={char_dataset}", f"--out_dir={out}", "--n_layer=2", "--n_head=2", "--n_embd=32",
                "--block_size=32", "--batch_size=8", "--gradient_accumulation_steps=1", "--max_iters=30",
                "--eval_interval=15", "--eval_iters=2", "--learning_rate=1e-2", "--decay_lr=False", "--device=cpu"])
    capsys.readouterr()
    sample.main(["--ckpt", str(out), "--num_samples", "2", "--max_new_tokens", "40", "--prompt", "the "])
    printed = capsys.readouterr().out
    assert printed.count("---------- sample") == 2 and printed.count("----------\nthe ") == 2  # prompt, verbatim
    with pytest.raises(SystemExit, match="'Z'"):  # a character the char model has never seen
        sample.main(["--ckpt", str(out), "--prompt", "Zebra"])


@needs_gpt2_bpe
def test_lora_checkpoint_from_before_padded_loading_still_loads_and_resumes(tiny_gpt2_folder, tmp_path):
    """GPT-2 weights used to load with 50257 rows, and a LoRA run's shorter block_size cropped its base: the
    fingerprint such a checkpoint recorded is of that base. The same weights, so it loads and resumes."""
    import json

    from safetensors.torch import load_file

    from gptkit import lora
    from gptkit.checkpoint import save_checkpoint
    from gptkit.hf_gpt2 import config_from_hf, load_hf_state_dict
    from model import GPT

    data = write_dataset(tmp_path / "bpe", "To be, or not to be, that is the question.\n" * 200,
                         Tokenizer.tiktoken("gpt2"))
    out = tmp_path / "lora"

    def args(init_from: str, max_iters: int) -> list[str]:
        return [f"--init_from={init_from}", f"--dataset={data}", f"--out_dir={out}", "--block_size=32",
                "--batch_size=2", "--gradient_accumulation_steps=1", f"--max_iters={max_iters}",
                "--eval_interval=2", "--eval_iters=1", "--lora_rank=2", "--device=cpu", "--compile=False"]

    train.main(args(str(tiny_gpt2_folder), 2))
    ckpt = load_checkpoint(out / "last.pt", mmap=False)
    assert ckpt["model_config"]["vocab_multiple"] == 64 and ckpt["model_config"]["block_size"] == 64

    # What such a checkpoint holds: the fingerprint of the base as it loaded then, and its model_config.
    old_base = GPT(config_from_hf(json.loads((tiny_gpt2_folder / "config.json").read_text())))
    load_hf_state_dict(old_base, load_file(tiny_gpt2_folder / "model.safetensors"))
    old_base.crop_block_size(32)
    assert old_base.transformer.wte.weight.shape[0] == 50257
    ckpt["lora"]["base"]["fingerprint"] = lora.fingerprint(old_base.state_dict())
    ckpt["model_config"].update(block_size=32, vocab_multiple=1)
    for name in ("last.pt", "best.pt"):
        save_checkpoint(ckpt, out / name)

    assert model_from_checkpoint(load_checkpoint(out)).config.block_size == 32  # as it was trained
    sample.main(["--ckpt", str(out), "--prompt", "To be", "--max_new_tokens", "4", "--stream=False"])
    assert train.main(args("resume", 3))["step"] == 3
