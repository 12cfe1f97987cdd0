"""eval.py and hellaswag.py: HellaSwag scoring against transformers, DDP, loss and bits per byte, the training
hook, and the one-line errors.

No network: the "GPT-2" is a tiny random GPT2LMHeadModel saved into a tmp folder, and the HellaSwag items are
written by the tests themselves.
"""

import io
import json
import math
import os
import random
import subprocess
import sys
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import make_char_dataset, torch_threads, train_script, write_dataset

import eval as eval_script
from benchmarks import dpo_rule
from gptkit import hellaswag
from gptkit.checkpoint import save_checkpoint
from gptkit.runtime import setup_runtime
from gptkit.shards import TokenDataset, make_meta, read_meta, shard_name, write_meta, write_shard
from gptkit.tokenizer import Tokenizer
from model import GPT, GPTConfig
from prepare import chat as prepare_chat
from prepare import preference

train = train_script()

REPO = Path(__file__).resolve().parents[1]
WORDS = ("the man woman dog runs slowly into a kitchen and then picks up the ball while people watch from "
         "far away she he they it is was bright café naïve quickly throws over under near table").split()


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True)
def one_thread():
    """These models are tiny: one thread is as fast, and much faster on a busy machine."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def bpe():
    try:
        return Tokenizer.tiktoken("gpt2")
    except Exception as e:  # the BPE files are not cached on this machine and there is no network
        pytest.skip(f"the GPT-2 BPE files cannot be had: {e}")


def make_items(n: int, seed: int = 0, ctx_words=(3, 40), ending_words=(1, 14)) -> list[dict]:
    """HellaSwag-shaped items: contexts and endings of varied lengths (word counts drawn from the given
    ranges), so that the total and the per-token loss often pick different endings. BENCHMARKS.md times
    eval.py on longer ones."""
    rng = np.random.default_rng(seed)

    def words(lo, hi):
        return " ".join(rng.choice(WORDS, size=int(rng.integers(lo, hi))))

    return [{"ind": i, "ctx": words(*ctx_words).capitalize(), "endings": [words(*ending_words) + "." for _ in range(4)],
             "label": int(rng.integers(0, 4)), "split": "val"} for i in range(n)]


def write_items(path: Path, items: list[dict]) -> Path:
    path.write_text("".join(json.dumps(item) + "\n" for item in items), encoding="utf-8")
    return path


def make_hf_folder(folder: Path, n_positions: int = 128, seed: int = 0):
    """A tiny random GPT-2 with the real vocabulary, saved as a Hugging Face folder; its weights get noise so
    that the endings' losses differ clearly."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=50257, n_positions=n_positions, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=None, eos_token_id=None)
    torch.manual_seed(seed)
    hf = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(folder)
    return hf


@pytest.fixture(scope="module")
def hf_setup(tmp_path_factory, bpe):
    root = tmp_path_factory.mktemp("hellaswag")
    hf = make_hf_folder(root / "hf")
    items = make_items(13)
    return hf, root / "hf", write_items(root / "items.jsonl", items), items


def run_eval(capsys, *args, err: bool = False) -> dict:
    """eval.py in this process; its last stdout line, parsed (and with err, its stderr under "err")."""
    eval_script.main(["--device=cpu", *map(str, args)])
    said = capsys.readouterr()
    return {**json.loads(said.out.strip().splitlines()[-1]), **({"err": said.err} if err else {})}


def reference_scores(hf, items: list[dict], block_size: int) -> tuple[dict, list[list[float]], bool]:
    """The completion scoring computed directly with transformers and tiktoken, one sequence at a time; also
    every ending's total loss, and whether the two scorings ever pick different endings."""
    import tiktoken

    enc = tiktoken.get_encoding("gpt2")
    right = right_norm = 0
    all_totals, disagree = [], False
    with torch.no_grad():
        for item in items:
            totals, means = [], []
            for ending in item["endings"]:
                ctx, end = enc.encode_ordinary(item["ctx"]), enc.encode_ordinary(" " + ending)
                seq = torch.tensor((ctx + end)[-(block_size + 1):])
                n = min(len(end), len(seq) - 1)
                logits = hf(seq[None, :-1]).logits[0]
                losses = F.cross_entropy(logits, seq[1:], reduction="none")[-n:]
                totals.append(losses.sum().item())
                means.append(losses.mean().item())
            right += int(np.argmin(totals) == item["label"])
            right_norm += int(np.argmin(means) == item["label"])
            disagree |= bool(np.argmin(totals) != np.argmin(means))
            all_totals.append(totals)
    n = len(items)
    return {"task": "hellaswag", "n": n, "acc": right / n, "acc_norm": right_norm / n}, all_totals, disagree


# ----------------------------------------------------------------------------- HellaSwag


def test_hellaswag_matches_a_transformers_reference(capsys, hf_setup):
    hf, folder, path, items = hf_setup
    expected, totals, disagree = reference_scores(hf, items, block_size=128)
    assert disagree  # the two scorings pick different endings somewhere: both are checked
    assert run_eval(capsys, "--init_from", folder, "--task=hellaswag", "--input", path, "--batch_size=3") == expected
    # the per-ending losses themselves, from a batch padded to one length
    from gptkit.hf_gpt2 import load_pretrained

    encoded = hellaswag.encode(hellaswag.read_items(path), Tokenizer.tiktoken("gpt2"), 128)
    ours, _ = hellaswag.ending_losses(load_pretrained(str(folder)).eval(), encoded, setup_runtime("cpu"))
    torch.testing.assert_close(ours, torch.tensor(totals), rtol=1e-5, atol=1e-4)


def test_contexts_longer_than_the_model_keep_their_last_tokens(capsys, tmp_path, bpe):
    hf = make_hf_folder(tmp_path / "hf", n_positions=12, seed=1)  # most items exceed 12 tokens
    items = make_items(9, seed=1)
    path = write_items(tmp_path / "items.jsonl", items)
    expected, _, _ = reference_scores(hf, items, block_size=12)
    assert run_eval(capsys, "--init_from", tmp_path / "hf", "--input", path, "--batch_size=4") == expected
    assert run_eval(capsys, "--init_from", tmp_path / "hf", "--input", path, "--limit=4")["n"] == 4


def torchrun_eval(*args) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "eval.py"), "--device=cpu", *map(str, args)]
    res = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1  # rank 0 alone prints
    return json.loads(lines[0])


def test_two_processes_give_the_same_result_as_one(capsys, hf_setup):
    _, folder, path, _ = hf_setup
    single = run_eval(capsys, "--init_from", folder, "--input", path)
    # 13 items: 7 on one rank, 6 on the other
    assert torchrun_eval("--init_from", folder, "--input", path, "--batch_size=2") == single


def test_the_file_is_downloaded_once_into_the_cache(monkeypatch, tmp_path):
    payload = "".join(json.dumps(item) + "\n" for item in make_items(3)).encode()
    calls = []

    class Response(io.BytesIO):
        headers = {"Content-Length": str(len(payload))}

    def urlopen(url, timeout):
        calls.append(url)
        return Response(payload)

    monkeypatch.setenv("GPTKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(hellaswag.urllib.request, "urlopen", urlopen)
    path = hellaswag.obtain()
    assert path == tmp_path / "cache" / "hellaswag_val.jsonl" and calls == [hellaswag.URL]
    assert hellaswag.obtain() == path and len(calls) == 1
    assert [item.label for item in hellaswag.read_items(path)] == [item["label"] for item in make_items(3)]


def expect_error(capsys, args, *fragments):
    with pytest.raises(SystemExit) as e:
        eval_script.main(["--device=cpu", *map(str, args)])
    message = e.value.code  # cli.fail's exit: Python prints it to stderr on the way out
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    assert "Traceback" not in capsys.readouterr().err


def test_hellaswag_errors_are_one_line(capsys, monkeypatch, tmp_path, hf_setup):
    _, folder, path, items = hf_setup
    expect_error(capsys, ["--init_from", folder, "--input", tmp_path / "nope.jsonl"], "nope.jsonl", "does not exist")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(path.read_text().splitlines()[0] + "\n\n{not json\n")
    expect_error(capsys, ["--init_from", folder, "--input", bad], "bad.jsonl line 3", "not valid JSON")
    no_label = dict(items[0])
    del no_label["label"]
    write_items(bad, [items[1], no_label])
    expect_error(capsys, ["--init_from", folder, "--input", bad], "line 2", "label")
    write_items(bad, [{**items[0], "endings": items[0]["endings"][:3]}])
    expect_error(capsys, ["--init_from", folder, "--input", bad], "line 1", "4 strings")

    def offline(url, timeout):
        raise urllib.error.URLError("no route to host")

    monkeypatch.setenv("GPTKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(hellaswag.urllib.request, "urlopen", offline)
    expect_error(capsys, ["--init_from", folder], "could not download", "no route to host", "--input")
    assert not (tmp_path / "cache" / "hellaswag_val.jsonl").exists()  # nothing half-written


def char_checkpoint(folder: Path, data: Path, block_size: int = 64, seed: int = 0, settings: dict | None = None
                    ) -> Path:
    """A random char-level model whose tokenizer is the dataset's, saved the way train.py saves one (with the
    run's `settings` when given: train.py's config)."""
    meta = read_meta(data)
    cfg = GPTConfig(block_size=block_size, vocab_size=meta["vocab_size"], n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(seed)
    model = GPT(cfg)
    save_checkpoint({"format": 1, "model_config": cfg.to_dict(), "model": model.state_dict(), "tokenizer": meta,
                     "step": 3, **({"config": settings} if settings is not None else {})}, folder / "best.pt")
    return folder


def test_a_char_model_cannot_take_hellaswag(capsys, tmp_path, char_dataset):
    ckpt = char_checkpoint(tmp_path / "out", char_dataset)
    expect_error(capsys, ["--ckpt", ckpt, "--task=hellaswag"], "character-level")  # before any download


# ----------------------------------------------------------------------------- loss and bits per byte


def direct_losses(model: GPT, ids: np.ndarray) -> torch.Tensor:
    """Every token's loss but the first, in windows of block_size, computed without eval.py."""
    block, out = model.config.block_size, []
    with torch.no_grad():
        for s in range(0, len(ids) - 1, block):
            chunk = torch.from_numpy(ids[s : s + block + 1].astype(np.int64))
            logits = model.head(model.hidden_states(chunk[None, :-1]))[0]
            out.append(F.cross_entropy(logits, chunk[1:], reduction="none"))
    return torch.cat(out).double()


def test_bits_per_byte_of_a_char_model_is_its_loss_over_ln2(capsys, tmp_path, char_dataset):
    ckpt = char_checkpoint(tmp_path / "out", char_dataset)
    result = run_eval(capsys, "--ckpt", ckpt, "--task=loss", "--dataset", char_dataset, "--batch_size=5")
    val = np.fromfile(char_dataset / shard_name("val", 0), dtype=np.uint16, offset=32)  # after the header
    losses = direct_losses(load_char_model(ckpt), val)
    assert result["tokens"] == result["bytes"] == len(val) - 1  # ASCII: a byte per character
    assert result["loss"] == pytest.approx(losses.mean().item(), rel=1e-6)
    assert result["bpb"] == pytest.approx(result["loss"] / math.log(2), rel=1e-12)
    assert result["ppl"] == pytest.approx(math.exp(result["loss"]))
    limited = run_eval(capsys, "--ckpt", ckpt, "--task=loss", "--dataset", char_dataset, "--limit_tokens=100")
    assert limited["tokens"] == 100 and limited["loss"] == pytest.approx(losses[:100].mean().item(), rel=1e-6)
    ddp = torchrun_eval("--ckpt", ckpt, "--task=loss", "--dataset", char_dataset, "--batch_size=5")
    assert ddp == {**result, "loss": pytest.approx(result["loss"], rel=1e-9), "ppl": pytest.approx(result["ppl"]),
                   "bpb": pytest.approx(result["bpb"], rel=1e-9)}  # the windows split over 2 processes


def load_char_model(ckpt: Path) -> GPT:
    from gptkit.checkpoint import load_checkpoint, model_from_checkpoint

    return model_from_checkpoint(load_checkpoint(ckpt)).eval()


def test_bits_per_byte_of_a_bpe_model_counts_the_bytes_of_the_text(capsys, tmp_path, bpe):
    docs = ["Café au lait — naïve, über straße.", "世界 says hello 🙂 to the world", "plain ascii text " * 5]
    ids = []
    for doc in docs * 3:
        ids += bpe.encode(doc) + [bpe.eot_id]  # documents end with <|endoftext|>, which stands for no text
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "val"):
        write_shard(data / shard_name(split, 0), ids, bpe.vocab_size)
    write_meta(data, make_meta(bpe, {s: {"shards": [shard_name(s, 0)], "tokens": len(ids)} for s in ("train", "val")},
                               source="tests"))
    cfg = GPTConfig(block_size=16, vocab_size=50257, n_layer=1, n_head=2, n_embd=32)
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    save_checkpoint({"format": 1, "model_config": cfg.to_dict(), "model": model.state_dict(),
                     "tokenizer": read_meta(data)}, tmp_path / "out" / "best.pt")
    result = run_eval(capsys, "--ckpt", tmp_path / "out", "--task=loss", "--dataset", data, "--batch_size=3")

    import tiktoken

    targets = np.array(ids[1:])
    text = targets != bpe.eot_id
    enc = tiktoken.get_encoding("gpt2")
    nbytes = len(enc.decode_bytes(targets[text].tolist()))
    assert nbytes == len("".join(docs * 3).encode()) - len(enc.decode_bytes(ids[:1]))  # all but the first token
    losses = direct_losses(model, np.array(ids))
    assert result["tokens"] == len(ids) - 1 and result["bytes"] == nbytes
    assert result["loss"] == pytest.approx(losses.mean().item(), rel=1e-6)
    assert result["bpb"] == pytest.approx(losses[torch.from_numpy(text)].sum().item() / math.log(2) / nbytes,
                                          rel=1e-6)


def test_loss_reads_the_checkpoints_dataset_and_limit_counts_windows(capsys, tmp_path, char_dataset):
    ckpt = char_checkpoint(tmp_path / "out", char_dataset, settings={"dataset": str(char_dataset)})
    given = run_eval(capsys, "--ckpt", ckpt, "--task=loss", "--dataset", char_dataset)
    assert run_eval(capsys, "--ckpt", ckpt, "--task=loss") == given  # the dataset the run trained on
    # --limit N: the first N windows of block_size (64) tokens, as HellaSwag's first N items
    val = np.fromfile(char_dataset / shard_name("val", 0), dtype=np.uint16, offset=32)
    losses = direct_losses(load_char_model(ckpt), val)
    limited = run_eval(capsys, "--ckpt", ckpt, "--task=loss", "--limit=3")
    assert limited["tokens"] == 3 * 64 and limited["loss"] == pytest.approx(losses[: 3 * 64].mean().item(), rel=1e-6)
    assert run_eval(capsys, "--ckpt", ckpt, "--task=loss", "--limit=3", "--limit_tokens=100")["tokens"] == 100


def test_a_missing_checkpoint_is_named_first(capsys, tmp_path, hf_setup):
    expect_error(capsys, ["--ckpt", tmp_path / "out-nope", "--task=loss"], "out-nope does not exist")
    expect_error(capsys, ["--ckpt", tmp_path / "out-nope", "--task=loss", "--limit=3"], "out-nope does not exist")
    _, folder, _, _ = hf_setup  # GPT-2 weights record no dataset: said before they load
    expect_error(capsys, ["--init_from", folder, "--task=loss"], "--dataset", "GPT-2 weights record no dataset")


def test_loss_errors_are_one_line(capsys, tmp_path, char_dataset):
    ckpt = char_checkpoint(tmp_path / "out", char_dataset)
    other = make_char_dataset(tmp_path / "other", seed=1)
    meta = read_meta(other)
    chars = meta["tokenizer"]["chars"]
    chars[0], chars[1] = chars[1], chars[0]  # the same characters, two ids swapped: another tokenizer
    write_meta(other, meta)
    expect_error(capsys, ["--ckpt", ckpt, "--task=loss", "--dataset", other], "tokenized with", "the model")
    expect_error(capsys, ["--ckpt", ckpt, "--task=loss"], "--dataset", "records no dataset")
    expect_error(capsys, ["--ckpt", ckpt, "--task=loss", "--dataset", tmp_path / "missing"], "not found")


def test_loss_on_a_chat_dataset_is_the_answers_loss_as_training_logs_it(capsys, tmp_path, char_dataset):
    """On a chat dataset --task loss counts the assistant's replies (the tokens its loss mask trains) in windows
    that start at conversations, as training's loss, and says so; --loss_on=all counts every token. A preference dataset is refused in one
    line pointing to --task preference; nanoGPT's --out_dir names the checkpoint as --ckpt does."""
    rng = random.Random(0)
    words = dpo_rule.made_up_words(300, rng)
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(dpo_rule.sft_conversation(w, rng)) + "\n"
                                                for w in words[:200]))
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(dpo_rule.preference_pair(w, rng)) + "\n"
                                                  for w in words[200:]))
    prepare_chat.main(["--input", str(tmp_path / "sft.jsonl"), "--tokenizer", "char", "--block_size", "40",
                       "--data_root", str(tmp_path), "--name", "sft"])
    data = tmp_path / "sft"
    ckpt = char_checkpoint(tmp_path / "out", data, block_size=40, settings={"dataset": str(data)})
    val = TokenDataset(data, "val")
    tokens, mask = val.window(0, len(val)), val.masks.window(0, len(val))
    trained = torch.from_numpy(mask[1:] != 0)
    model = load_char_model(ckpt)
    losses = direct_losses(model, tokens)
    assert 0 < trained.sum() < len(trained)  # the prompts are context, the replies trained

    # The answers are predicted in windows that start where conversations start, as in training: by hand,
    # whole conversations packed into the model's 40 tokens (each conversation is shorter here).
    starts = sorted({0, *np.flatnonzero(tokens == read_meta(data)["eot_id"]).tolist()})
    ends = starts[1:] + [len(tokens) - 1]  # each conversation's last target
    assert all(e - b <= 40 for b, e in zip(starts, ends))
    nats, answer_tokens, k = 0.0, 0, 0
    while k < len(starts):
        m = k
        while m + 1 < len(starts) and ends[m + 1] - starts[k] <= 40:
            m += 1
        chunk = torch.from_numpy(tokens[starts[k] : ends[m] + 1].astype(np.int64))
        with torch.no_grad():
            window = F.cross_entropy(model.head(model.hidden_states(chunk[None, :-1]))[0], chunk[1:], reduction="none")
        counted = torch.from_numpy(mask[starts[k] + 1 : ends[m] + 1] != 0)
        nats, answer_tokens, k = nats + window[counted].double().sum().item(), answer_tokens + int(counted.sum()), m + 1
    answers = run_eval(capsys, "--ckpt", ckpt, "--task=loss", "--batch_size=3", err=True)
    assert answers["loss_on"] == "answers" and answers["tokens"] == trained.sum() == answer_tokens
    assert answers["loss"] == pytest.approx(nats / answer_tokens, rel=1e-6)
    assert answers["loss"] != pytest.approx(losses[trained].mean().item(), rel=1e-6)  # not the plain windows'

    assert "val: answer loss (the assistant's replies, as training's; --loss_on=all for every token)" in answers["err"]
    every = run_eval(capsys, "--ckpt", ckpt, "--task=loss", "--loss_on=all", err=True)
    assert every["loss_on"] == "all" and every["tokens"] == len(tokens) - 1
    assert every["loss"] == pytest.approx(losses.mean().item(), rel=1e-6) and every["loss"] != answers["loss"]
    assert "loss over all tokens (training's is over the answers: --loss_on=answers)" in every["err"]
    assert run_eval(capsys, "--out_dir", tmp_path / "out", "--task=loss", "--batch_size=3") == {
        k: v for k, v in answers.items() if k != "err"}  # nanoGPT's spelling of the run's folder
    expect_error(capsys, ["--ckpt", ckpt, "--task=loss", "--loss_on=answers", "--dataset", char_dataset],
                 "--loss_on=answers needs a chat dataset", "--loss_on=all")

    preference.main(["--input", str(tmp_path / "pairs.jsonl"), "--tokenizer", "char", "--block_size", "40",
                     "--data_root", str(tmp_path), "--name", "pairs"])
    expect_error(capsys, ["--ckpt", ckpt, "--task=loss", "--dataset", tmp_path / "pairs"],
                 "holds preference pairs", f"--task preference --dataset {tmp_path / 'pairs'}")
    expect_error(capsys, ["--ckpt", ckpt, "--task=preference", "--dataset", tmp_path / "pairs", "--loss_on=all"],
                 "--loss_on is for --task loss")


# ----------------------------------------------------------------------------- during training


def bpe_train_args(data, out, **over):
    args = dict(dataset=str(data), out_dir=str(out), n_layer=1, n_head=2, n_embd=32, block_size=32, batch_size=4,
                gradient_accumulation_steps=1, max_iters=4, eval_interval=2, eval_iters=2, log_interval=1,
                warmup_iters=1, lr_decay_iters=4, learning_rate=3e-3, min_lr=3e-4, device="cpu", compile=False,
                hellaswag_interval=2, hellaswag_limit=6)
    args.update(over)
    return [f"--{k}={v}" for k, v in args.items()]


def test_training_logs_hellaswag_beside_the_val_loss(capsys, monkeypatch, tmp_path, bpe):
    rng = np.random.default_rng(0)
    data = write_dataset(tmp_path / "data", " ".join(rng.choice(WORDS, size=4000)), bpe)
    monkeypatch.setenv("GPTKIT_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    write_items(tmp_path / "cache" / "hellaswag_val.jsonl", make_items(10, seed=2))
    out = tmp_path / "out"
    train.main(bpe_train_args(data, out))
    printed = capsys.readouterr().out
    evals = [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "val_loss" in m]
    assert [m["step"] for m in evals] == [0, 2, 4]
    assert all(0 <= m["hellaswag_acc_norm"] <= 1 and m["hellaswag_acc_norm"] * 6 % 1 == 0 for m in evals)
    assert "step 4: val loss" in printed and "hellaswag_acc_norm" in printed.split("step 4: val loss")[1]
    # the same score as eval.py gives the final weights
    result = run_eval(capsys, "--ckpt", out / "last.pt", "--limit=6")
    assert result["acc_norm"] == evals[-1]["hellaswag_acc_norm"] and result["acc"] == evals[-1]["hellaswag_acc"]


def test_training_fails_at_the_start_without_hellaswag(capsys, monkeypatch, tmp_path, bpe, char_dataset):
    rng = np.random.default_rng(0)
    data = write_dataset(tmp_path / "data", " ".join(rng.choice(WORDS, size=2000)), bpe)
    monkeypatch.setenv("GPTKIT_CACHE_DIR", str(tmp_path / "cache"))

    def offline(url, timeout):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(hellaswag.urllib.request, "urlopen", offline)
    for dataset, fragment in ((data, "could not download"), (char_dataset, "character-level")):
        with pytest.raises(SystemExit, match=f"^error: .*{fragment}"):
            train.main(bpe_train_args(dataset, tmp_path / "out"))
        assert not (tmp_path / "out").exists()  # failed before the run touched anything
    with pytest.raises(SystemExit, match="multiple of eval_interval"):
        train.main(bpe_train_args(data, tmp_path / "out", hellaswag_interval=3))
