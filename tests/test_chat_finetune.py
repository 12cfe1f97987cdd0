"""Chat fine-tuning (#23): prepare/chat.py's loss mask, the loader's targets, train.py fine-tuning a base of
this project or GPT-2 on conversations (its vocabulary grown by the special tokens), LoRA on them, exact resume."""

import json
import random

import numpy as np
import pytest
import torch
from conftest import make_char_dataset, needs_gpt2_bpe, train_script

from gptkit.chat import render
from gptkit.checkpoint import load_checkpoint, model_from_checkpoint
from gptkit.loader import BatchLoader, ValBatches, conversation_starts, read_batch
from gptkit.shards import TokenDataset, read_meta
from gptkit.tokenizer import CHAT_SPECIALS, Tokenizer
from prepare import chat as prepare_chat

train = train_script()

WORDS = ["the", "king", "queen", "shall", "speak", "to", "my", "lord", "and", "thou", "art", "good", "sir"]


def write_conversations(path, n=300, seed=0):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))
            turns = [{"role": "user", "content": words}, {"role": "assistant", "content": words[::-1]}]
            if rng.random() < 0.3:
                turns = [{"role": "system", "content": "good sir"}, *turns, {"role": "user", "content": "and"},
                         {"role": "assistant", "content": "dna"}]
            f.write(json.dumps({"messages": turns}) + "\n")
    return path


def args(**over):
    a = dict(n_layer=2, n_head=2, n_embd=32, block_size=48, batch_size=4, gradient_accumulation_steps=1,
             max_iters=6, eval_interval=3, eval_iters=2, log_interval=1, warmup_iters=1, lr_decay_iters=6,
             device="cpu", compile=False, learning_rate=1e-3, min_lr=1e-4)
    a.update(over)
    return [f"--{k}={v}" for k, v in a.items()]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A char model of this project (a few steps on random sentences) and a chat dataset in its tokenizer."""
    root = tmp_path_factory.mktemp("chat")
    data = make_char_dataset(root / "data" / "text")
    train.main(args(dataset=str(data), out_dir=str(root / "base"), max_iters=4, eval_interval=4))
    conversations = write_conversations(root / "chats.jsonl")
    prepare_chat.main(["--input", str(conversations), "--tokenizer", str(root / "base"), "--block_size", "48",
                       "--data_root", str(root / "data"), "--name", "chat"])
    return root


def test_the_mask_marks_exactly_the_replies(base):
    meta = read_meta(base / "data" / "chat")
    tok = Tokenizer.from_meta(meta)
    assert meta["chat"]["kept"] + meta["chat"]["cut"] == 300 and meta["vocab_size"] == tok.vocab_size
    assert tok.special == {name: read_meta(base / "data" / "text")["vocab_size"] + i
                           for i, name in enumerate(CHAT_SPECIALS)}  # appended to the base's characters
    ds = TokenDataset(base / "data" / "chat", "train")
    ids, mask = ds.window(0, len(ds)), ds.masks.window(0, len(ds))
    # Render the stream's conversations again: the mask is render's trained flags, conversation by conversation.
    starts = np.flatnonzero(ids == tok.special["<|endoftext|>"]).tolist() + [len(ds)]
    lines = [json.loads(line)["messages"] for line in open(base / "chats.jsonl")]
    rendered = {tuple(render(m, tok)[0][:49]): render(m, tok)[1][:49] for m in lines}
    for a, b in zip(starts[:-1], starts[1:]):
        assert mask[a:b].tolist() == [int(t) for t in rendered[tuple(ids[a:b].tolist())]]


def test_targets_are_minus_one_exactly_where_the_target_is_context(base):
    data = base / "data" / "chat"
    ds = TokenDataset(data, "train")
    loader = BatchLoader(data, "train", batch_size=8, block_size=48, seed=3)
    x, y = loader.next_batch()
    starts = loader.sample_starts(np.arange(8))
    eot = read_meta(data)["eot_id"]
    for row, start in enumerate(starts):
        assert x[row, 0] == eot  # every window starts at a conversation
        window, trained = ds.window(int(start), 49), ds.masks.window(int(start), 49)
        expected = np.where(trained[1:] == 1, window[1:].astype(np.int64), -1)
        assert y[row].tolist() == expected.tolist() and x[row].tolist() == window[:-1].tolist()
    x_val, y_val = next(iter(ValBatches(data, "val", batch_size=2, block_size=48, n_batches=1)))
    assert (x_val[:, 0] == eot).all() and (y_val == -1).any()


def test_a_user_turn_never_changes_the_targets(base, tmp_path):
    """Two datasets equal but for the letters of one user turn: the inputs differ there, the targets nowhere."""
    lines = open(base / "chats.jsonl").read().splitlines()
    at = next(i for i, line in enumerate(lines) if "k" in json.loads(line)["messages"][0]["content"])
    lines.insert(0, lines.pop(at))  # a conversation whose first (user) turn has a k, first
    first = json.loads(lines[0])
    changed = dict(first, messages=[dict(m, content=m["content"].replace("k", "g")) if m["role"] == "user" else m
                                    for m in first["messages"]])
    assert changed != first
    ys, xs = [], []
    for name, line in (("a", lines[0]), ("b", json.dumps(changed))):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("\n".join([line, *lines[1:]]) + "\n")
        prepare_chat.main(["--input", str(path), "--tokenizer", str(base / "base"), "--block_size", "48",
                           "--data_root", str(tmp_path / "data"), "--name", name, "--val_fraction", "0.05"])
        x, y = [], []
        for split in ("train", "val"):  # every conversation's window, wherever the split rule put it
            ds = TokenDataset(tmp_path / "data" / name, split)
            xy = read_batch(ds, conversation_starts(ds, 48), 48, torch.device("cpu"))
            x.append(xy[0])
            y.append(xy[1])
        xs.append(torch.cat(x))
        ys.append(torch.cat(y))
    assert torch.equal(ys[0], ys[1]) and not torch.equal(xs[0], xs[1])


def test_a_character_the_base_vocabulary_lacks_is_named_with_its_line(base, tmp_path):
    lines = open(base / "chats.jsonl").read().splitlines()
    lines.insert(6, json.dumps({"messages": [{"role": "user", "content": "hi 🙃"},
                                             {"role": "assistant", "content": "ih"}]}))
    path = tmp_path / "emoji.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(SystemExit) as e:
        prepare_chat.main(["--input", str(path), "--tokenizer", str(base / "base"), "--block_size", "48",
                           "--data_root", str(tmp_path / "data"), "--name", "emoji"])
    message = e.value.code
    assert isinstance(message, str) and "\n" not in message, message
    assert message.startswith(f"error: {path} line 7: character '🙃' is not in the model's vocabulary"), message
    assert not (tmp_path / "data" / "emoji" / "meta.json").exists()  # nothing half-written


def test_finetune_a_char_model_on_conversations_grows_its_vocabulary_and_resumes_exactly(base, capsys):
    data = str(base / "data" / "chat")
    whole = train.main(args(dataset=data, out_dir=str(base / "ft"), init_from=str(base / "base")))
    printed = capsys.readouterr().out
    assert "loss: over the answer tokens only" in printed and "answer loss" in printed
    ckpt = load_checkpoint(base / "ft" / "last.pt")
    assert ckpt["model_config"]["vocab_size"] == read_meta(data)["vocab_size"]
    entries = [json.loads(line) for line in open(base / "ft" / "metrics.jsonl")]
    assert all(e.get("loss_on") == "answers" for e in entries if "loss" in e or "val_loss" in e)
    # 3 steps, then 3 more resumed: the same weights as the 6 in one go.
    train.main(args(dataset=data, out_dir=str(base / "half"), init_from=str(base / "base"), max_iters=3))
    train.main(args(dataset=data, out_dir=str(base / "half"), init_from="resume", max_iters=6))
    resumed = load_checkpoint(base / "half" / "last.pt")
    assert whole["step"] == resumed["step"] == 6
    for key, value in ckpt["model"].items():
        assert torch.equal(value, resumed["model"][key]), key


def test_lora_on_conversations_trains_the_new_tokens_rows_and_reloads(base):
    data = str(base / "data" / "chat")
    base_model = model_from_checkpoint(load_checkpoint(base / "base"))
    train.main(args(dataset=data, out_dir=str(base / "lora"), init_from=str(base / "base"), lora_rank=2))
    ckpt = load_checkpoint(base / "lora" / "last.pt")
    assert ckpt["lora"]["train_embeddings"] and "transformer.wte.weight" in ckpt["model"]
    merged = model_from_checkpoint(ckpt)  # the base, grown the same way, checked, adapters and rows on
    n = base_model.config.vocab_size
    assert merged.config.vocab_size == n + len(CHAT_SPECIALS)
    wte = merged.transformer.wte.weight
    assert not torch.equal(wte[n:], wte[:n].mean(0).expand(len(CHAT_SPECIALS), -1))  # the new rows learnt
    train.main(args(dataset=data, out_dir=str(base / "lora"), init_from="resume", max_iters=8, lora_rank=2))


@needs_gpt2_bpe
def test_finetune_gpt2_with_chat_tokens_inside_its_padding(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    folder = tmp_path / "tiny-gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=64, vocab_size=50257)).save_pretrained(
        folder)
    conversations = write_conversations(tmp_path / "c.jsonl", n=600)
    prepare_chat.main(["--input", str(conversations), "--block_size", "48", "--data_root", str(tmp_path / "data"),
                       "--name", "c"])
    assert read_meta(tmp_path / "data" / "c")["vocab_size"] == 50261
    train.main(args(dataset=str(tmp_path / "data" / "c"), out_dir=str(tmp_path / "out"), init_from=str(folder),
                    n_layer=1, max_iters=2, eval_interval=2))  # (the base's shape: another would be refused)
    model = model_from_checkpoint(load_checkpoint(tmp_path / "out"))
    assert model.config.vocab_size == 50261 and model.transformer.wte.weight.shape[0] == 50304
