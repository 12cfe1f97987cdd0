"""Tokenizers (gptkit/tokenizer.py, gptkit/bpe.py, gptkit/hf_tokenizer.py, prepare/tokenizer.py): every kind
round-trips any text, never produces a special token from text, agrees with transformers' AutoTokenizer on
its exported files, and a trained BPE is deterministic, found by name, checked by hash and carried inside
checkpoints."""

import json
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gptkit import bpe
from gptkit.data.shards import read_meta
from gptkit.errors import DataError
from gptkit.hf_tokenizer import bpe_merges, hf_tokenizer_files
from gptkit.tokenizer import CHAT_SPECIALS, Tokenizer, resolve_tokenizer, with_tokenizer_files
from tests.conftest import REPO, gpt2_bpe_problem, needs_gpt2_bpe, write_dataset

WORDS = ("the king queen shall speak to my lord and thou art good sir crown castle river stone night day "
         "über straße naïve café 東京 北京 你好 世界 こんにちは Привет мир مرحبا שלום 🤖 🎉 ⭐").split()


def corpus(seed: int, n_lines: int) -> list[str]:
    """Varied text made deterministically: words of several scripts, numbers, punctuation, code, blank lines."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        kind = rng.random()
        if kind < 0.6:
            line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12)))
            line = line[0].upper() + line[1:] + rng.choice([".", "!", "?", ",", ":", ""])
        elif kind < 0.75:
            line = f"{rng.randint(0, 99999)} + {rng.random():.4f} = {rng.randint(-10**6, 10**6)}"
        elif kind < 0.9:
            line = f"    def f_{rng.randint(0, 99)}(x):\n        return x * {rng.randint(2, 9)}  # it's {rng.choice(WORDS)}"
        else:
            line = ""
        lines.append(line + "\n")
    return ["".join(lines[i : i + 50]) for i in range(0, len(lines), 50)]


def random_strings(n: int, seed: int = 0) -> list[str]:
    """Seeded random strings over all of Unicode: ASCII, control characters, Latin, CJK, emoji, every plane up
    to U+10FFFF (unassigned and private-use code points included), surrogates excluded (see the test of lone
    surrogates)."""
    rng = random.Random(seed)
    ranges = [(0x20, 0x7F), (0x00, 0x20), (0x7F, 0xA0), (0xA0, 0x800), (0x800, 0xD800), (0xE000, 0x10000),
              (0x4E00, 0xA000), (0x1F300, 0x1FAFF), (0x10000, 0x110000), (0x20, 0x7F)]
    out = []
    for _ in range(n):
        chars = []
        for _ in range(rng.randint(0, 40)):
            lo, hi = rng.choice(ranges)
            chars.append(chr(rng.randrange(lo, hi)))
        out.append("".join(chars))
    return out


STRINGS = random_strings(3000)
VARIED = [
    "",
    "Hello world! It's a test, isn't it?",
    "  two leading spaces\n\nnewlines\tand tabs   trailing  ",
    "ünïcödé, 中文, emoji 🤖 and numbers 3.14159 / 2024 / 1234567",
    "\r\n\x00\x1b[0m\u200b\ufeff\u2028 odd whitespace\u00a0and\u3000controls",
    "<|user|>Hi!<|end|><|assistant|>Hello<|end|>",
    "text <|endoftext|>more text<|endoftext|>",
    "almost special: <|user|, |user|>, <|nope|>, <||>, <|<|user|>|>",
    "    def f(x):\n        return x * 2  # it's fine\n",
]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def trained(data_root) -> Tokenizer:
    """A 600-id BPE trained on the varied corpus (with the chat special tokens), saved under data_root."""
    model = bpe.train(corpus(0, 2000), 600, CHAT_SPECIALS, "tiny")
    bpe.save(model, data_root / "tokenizers")
    return resolve_tokenizer("tiny", data_root=data_root)


@pytest.fixture(scope="module")
def gpt2():
    if gpt2_bpe_problem() is not None:
        pytest.skip(f"the GPT-2 BPE files are not available: {gpt2_bpe_problem()}")
    return Tokenizer.tiktoken("gpt2")


@pytest.fixture(scope="module")
def char():
    """A character vocabulary holding every character of the test strings, with the chat special tokens."""
    text = "".join(STRINGS) + "".join(VARIED)
    return Tokenizer.char_from_text(text).with_special(CHAT_SPECIALS)


@pytest.fixture(scope="module", params=["char", "gpt2", "gpt2+chat", "trained"])
def tokenizer(request):
    if request.param == "char":
        return request.getfixturevalue("char")
    if request.param == "trained":
        return request.getfixturevalue("trained")
    tok = request.getfixturevalue("gpt2")
    return tok.with_special(CHAT_SPECIALS) if request.param == "gpt2+chat" else tok


def with_specials(tok: Tokenizer, text: str) -> list[int]:
    """What a chat template renders: the special tokens' names as their ids, the text between them encoded."""
    pattern = "(" + "|".join(re.escape(s) for s in sorted(tok.special, key=len, reverse=True)) + ")"
    ids = []
    for part in re.split(pattern, text):
        ids += [tok.special[part]] if part in tok.special else tok.encode(part)
    return ids


# ----------------------------------------------------------------------------- every kind


def test_round_trip_of_random_unicode(tokenizer):
    for text in STRINGS + VARIED:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text, repr(text)
        assert np.array_equal(tokenizer.encode_array(text), np.asarray(ids, dtype=np.uint32))


def test_special_tokens_are_never_encoded_and_decode_to_their_names(tokenizer):
    specials = set(tokenizer.special.values())
    for text in VARIED + ["".join(tokenizer.special)]:
        assert not specials & set(tokenizer.encode(text)), text
    for name, i in tokenizer.special.items():
        assert tokenizer.decode([i]) == name
        assert tokenizer.special_id(name) == i
    if tokenizer.special:
        ids = with_specials(tokenizer, VARIED[5])
        assert tokenizer.decode(ids) == VARIED[5]


def test_a_list_of_ints_decodes_as_an_array_of_the_same_ids_does(tokenizer):
    """decode takes a plain list of ints (what a stream decodes, token by token) without numpy: the same text
    and the same refusals as the array path, special ids and cut characters included."""
    texts = VARIED + STRINGS[:200]
    if tokenizer.special:
        texts.append(VARIED[5])
    for text in texts:
        ids = with_specials(tokenizer, text) if tokenizer.special else tokenizer.encode(text)
        for cut in (ids, ids[:1], ids[1:-1], ids[-1:], []):  # a cut may end inside a character: U+FFFD
            assert tokenizer.decode(cut) == tokenizer.decode(np.asarray(cut, dtype=np.int64)), repr(text)
    for bad in (-1, tokenizer.vocab_size):
        for ids in ([5, bad], np.asarray([5, bad])):
            with pytest.raises(DataError, match=f"token id {bad} is outside this tokenizer's vocabulary"):
                tokenizer.decode(ids)


def test_vocab_size_counts_ordinary_and_special_ids(tokenizer):
    ids = set(tokenizer.special.values())
    assert tokenizer.vocab_size == max(ids | {len(tokenizer.chars or tokenizer.ranks) - 1}) + 1
    assert tokenizer.eot_id == tokenizer.special.get("<|endoftext|>")
    assert len(tokenizer.token_bytes()) == tokenizer.vocab_size


def test_token_bytes_sum_to_the_utf8_length(tokenizer):
    lengths = tokenizer.token_bytes()
    for text in STRINGS[:500] + VARIED:
        assert lengths[tokenizer.encode(text)].sum() == len(text.encode("utf-8")), repr(text)
    assert all(lengths[i] == 0 for i in tokenizer.special.values())


def test_meta_round_trip(tokenizer):
    again = Tokenizer.from_meta({"tokenizer": tokenizer.to_meta()})
    assert again == tokenizer and again.special == tokenizer.special and again.vocab_size == tokenizer.vocab_size
    assert again.encode(VARIED[3]) == tokenizer.encode(VARIED[3])


def test_special_id_of_an_unknown_name_is_one_line(tokenizer):
    with pytest.raises(DataError) as e:
        tokenizer.special_id("<|tool|>")
    assert "\n" not in str(e.value) and "<|tool|>" in str(e.value)
    assert all(name in str(e.value) for name in tokenizer.special)


def test_lone_surrogates(tokenizer):
    """Not Unicode text, so not UTF-8: a BPE encodes one as U+FFFD (tiktoken's own handling, in encode and
    encode_array alike); a char vocabulary never holds one, so it is an unknown character, and a vocabulary
    cannot be made of one."""
    text = "a\ud800b\udfff"
    if tokenizer.kind == "char":
        with pytest.raises(DataError, match="not in the model's vocabulary"):
            tokenizer.encode(text)
        with pytest.raises(DataError, match="lone surrogate"):
            Tokenizer.char_from_text(text)
    else:
        assert tokenizer.decode(tokenizer.encode(text)) == "a\ufffdb\ufffd"
        assert tokenizer.encode_array(text).tolist() == tokenizer.encode("a\ufffdb\ufffd")


def test_hugging_face_files_give_our_ids(tokenizer, tmp_path):
    """AutoTokenizer on the exported files: our ids for any ordinary text, and a special token's id where its
    name is in the text (an added special token, as chat templates use them)."""
    transformers = pytest.importorskip("transformers")
    for name, text in hf_tokenizer_files(tokenizer, model_max_length=1024).items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in STRINGS[:1000] + VARIED:
        assert hf.encode(text) == with_specials(tokenizer, text), repr(text)
    for text in VARIED[1:5]:
        assert hf.decode(tokenizer.encode(text)) == text
    assert hf.eos_token_id == tokenizer.eot_id
    assert set(hf.all_special_tokens) == set(tokenizer.special)


# ----------------------------------------------------------------------------- special tokens


@needs_gpt2_bpe
def test_gpt2_specials_go_into_the_padded_rows(gpt2):
    chat = gpt2.with_special(CHAT_SPECIALS)
    assert chat.special == {"<|endoftext|>": 50256, "<|system|>": 50257, "<|user|>": 50258,
                            "<|assistant|>": 50259, "<|end|>": 50260}
    assert chat.vocab_size == 50261 <= 50304  # inside a GPT-2 model's padded embedding
    assert chat.encode(VARIED[3]) == gpt2.encode(VARIED[3])
    assert chat.with_special(["<|tool|>"]).special_id("<|tool|>") == 50261
    assert chat.with_special(CHAT_SPECIALS) == chat


@needs_gpt2_bpe
def test_entries_written_before_special_tokens_keep_their_ids(gpt2):
    old = Tokenizer.from_meta({"tokenizer": {"kind": "tiktoken", "name": "gpt2"}, "vocab_size": 50257})
    assert old.vocab_size == 50257 and old.eot_id == 50256 and old.special == {"<|endoftext|>": 50256}
    assert old.to_meta() == {"kind": "tiktoken", "name": "gpt2"}  # written as before: old and new compare equal
    char = Tokenizer.from_meta({"kind": "char", "chars": ["\n", " ", "a", "b"]})
    assert char.vocab_size == 4 and char.eot_id is None and char.special == {}
    assert char.to_meta() == {"kind": "char", "chars": ["\n", " ", "a", "b"]}


def test_char_specials_follow_the_characters():
    tok = Tokenizer.char_from_text("ab").with_special(["<|endoftext|>", "<|user|>"])
    assert tok.special == {"<|endoftext|>": 2, "<|user|>": 3} and tok.vocab_size == 4 and tok.eot_id == 2
    assert tok.to_meta()["special"] == tok.special
    assert tok.decode([0, 3, 1, 2]) == "a<|user|>b<|endoftext|>"


def test_trained_bpe_with_its_specials_is_unchanged(trained):
    assert trained.with_special(CHAT_SPECIALS) == trained
    assert list(trained.special) == list(CHAT_SPECIALS) and trained.vocab_size == 600
    more = trained.with_special(["<|tool|>"])
    assert more.special_id("<|tool|>") == 600 and more.encode(VARIED[3]) == trained.encode(VARIED[3])
    assert Tokenizer.from_meta(more.to_meta()) == more


@pytest.mark.parametrize("special, fragment", [
    ({"<|endoftext|>": 3}, "distinct ids from 4"),
    ({"<|endoftext|>": 4, "<|user|>": 4}, "distinct ids"),
    ({"<|endoftext|>": "4"}, "integer ids"),
])
def test_bad_special_entries_are_one_line_errors(special, fragment):
    with pytest.raises(DataError, match=fragment) as e:
        Tokenizer({"kind": "char", "chars": ["a", "b", "c", "d"], "special": special})
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- training and the folder


def test_split_pattern_is_gpt4s():
    """Exactly tiktoken's cl100k_base pattern, as tiktoken writes it (llama.cpp recognises this split)."""
    import tiktoken_ext.openai_public as openai_public

    source = Path(openai_public.__file__).read_text(encoding="utf-8")
    block = source[source.index("def cl100k_base"):source.index("def o200k_base")]
    assert f'r"""{bpe.SPLIT_PATTERN}"""' in block


def test_training_is_deterministic(trained):
    """The same texts give the same BPE, in this process or another (Rust's hash maps are seeded at random
    per process), whether given as a list or a stream."""
    texts = corpus(0, 2000)
    again = bpe.train(iter(texts), 600, CHAT_SPECIALS, "tiny")
    assert again.ranks == trained.ranks and again.hash == trained.to_meta()["hash"]
    code = ("from tests.test_tokenizer import corpus; from gptkit import bpe; from gptkit.tokenizer import "
            "CHAT_SPECIALS; print(bpe.train(corpus(0, 2000), 600, CHAT_SPECIALS, 'tiny').hash)")
    other_process = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert other_process.stdout.strip() == again.hash
    other = bpe.train(corpus(1, 2000), 600, CHAT_SPECIALS, "tiny")
    assert other.hash != again.hash
    assert bpe.train(texts, 600, ["<|endoftext|>"], "tiny").hash != again.hash  # the specials are hashed


def test_trained_bpe_is_a_consistent_bpe(trained):
    """Every merged token is the merge of two earlier tokens (what tokenizer.json and GGUF store)."""
    merges = bpe_merges(trained.ranks)
    assert len(merges) == len(trained.ranks) - 256
    assert all(trained.ranks[a + b] == 256 + i and trained.ranks[a] < 256 + i > trained.ranks[b]
               for i, (a, b) in enumerate(merges))
    # and it compresses the text it was trained on
    text = "".join(corpus(0, 200))
    assert len(trained.encode(text)) < len(text.encode("utf-8")) / 2


def test_vocab_size_counts_everything():
    model = bpe.train(corpus(0, 500), 300, CHAT_SPECIALS, "x")
    assert model.vocab_size == 300 and len(model.ranks) == 295
    with pytest.raises(DataError, match="at least 261"):
        bpe.train(corpus(0, 10), 260, CHAT_SPECIALS, "x")


def test_save_is_idempotent_and_atomic(tmp_path, monkeypatch):
    model = bpe.train(corpus(0, 500), 400, CHAT_SPECIALS, "x")
    folder, created = bpe.save(model, tmp_path)
    assert created and folder.name == f"x-{model.hash[:12]}"
    assert sorted(p.name for p in folder.iterdir()) == ["ranks.tiktoken", "tokenizer.json", "tokenizer_info.json"]
    info = json.loads((folder / "tokenizer_info.json").read_text())
    assert info["hash"] == model.hash and info["vocab_size"] == 400 and info["pattern"] == bpe.SPLIT_PATTERN
    assert info["special"] == {s: 395 + i for i, s in enumerate(CHAT_SPECIALS)}
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    assert bpe.save(model, tmp_path) == (folder, False)
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before  # not rewritten

    other = bpe.train(corpus(1, 500), 400, CHAT_SPECIALS, "y")

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bpe.os, "rename", full_disk)
    with pytest.raises(OSError):
        bpe.save(other, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name]  # nothing half-written left


def test_changed_or_missing_folder_is_a_one_line_error(trained, tmp_path):
    folder = tmp_path / "tokenizers" / Path(trained.to_meta()["path"]).name
    shutil.copytree(trained.to_meta()["path"], folder)
    spec = {**trained.to_meta(), "path": str(folder)}
    assert Tokenizer.from_meta(spec).encode(VARIED[3]) == trained.encode(VARIED[3])

    ranks = (folder / "ranks.tiktoken").read_text().splitlines(keepends=True)
    ranks[300], ranks[301] = ranks[301].split(" ")[0] + " 300\n", ranks[300].split(" ")[0] + " 301\n"
    (folder / "ranks.tiktoken").write_text("".join(ranks))
    with pytest.raises(DataError) as changed:
        Tokenizer.from_meta({"tokenizer": spec})
    shutil.rmtree(folder)
    with pytest.raises(DataError) as missing:
        Tokenizer.from_meta({"tokenizer": spec})
    for error, fragment in ((changed, "was changed"), (missing, "does not exist")):
        assert fragment in str(error.value) and str(folder) in str(error.value) and "\n" not in str(error.value)


def test_changed_pattern_or_specials_are_caught(trained, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(trained.to_meta()["path"], folder)
    spec = {**trained.to_meta(), "path": str(folder)}
    info = json.loads((folder / "tokenizer_info.json").read_text())
    for edit in ({"pattern": r"\s+|\S+"}, {"special": {"<|endoftext|>": 596}}):
        (folder / "tokenizer_info.json").write_text(json.dumps({**info, **edit}))
        with pytest.raises(DataError, match="was changed"):
            Tokenizer.from_meta(spec)


def test_resolve_tokenizer_by_name_or_path(trained, data_root, tmp_path):
    folder = Path(trained.to_meta()["path"])
    assert resolve_tokenizer(str(folder), data_root=tmp_path) == trained  # a PATH, wherever data_root is
    assert resolve_tokenizer("tiny", data_root=data_root).to_meta()["hash"] == trained.to_meta()["hash"]
    assert resolve_tokenizer("char", chars="ba").to_meta() == {"kind": "char", "chars": ["a", "b"]}

    with pytest.raises(DataError) as e:
        resolve_tokenizer("nope", data_root=data_root)
    assert "no tokenizer named 'nope'" in str(e.value) and folder.name in str(e.value)
    assert "prepare/tokenizer.py" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(DataError, match="holds none"):
        resolve_tokenizer("tiny", data_root=tmp_path)

    other_root = tmp_path / "data"
    shutil.copytree(folder, other_root / "tokenizers" / folder.name)
    bpe.save(bpe.train(corpus(1, 300), 400, CHAT_SPECIALS, "tiny"), other_root / "tokenizers")
    with pytest.raises(DataError) as e:
        resolve_tokenizer("tiny", data_root=other_root)
    assert "several tokenizers are named 'tiny'" in str(e.value) and "PATH" in str(e.value)
    with pytest.raises(DataError, match="gpt2, char, or the NAME"):
        resolve_tokenizer("no/such/folder", data_root=data_root)


# ----------------------------------------------------------------------------- datasets and checkpoints


def test_dataset_meta_records_the_trained_tokenizer(trained, tmp_path):
    text = "".join(corpus(2, 400))
    write_dataset(tmp_path / "ds", text, trained)
    meta = read_meta(tmp_path / "ds")
    assert meta["tokenizer"]["kind"] == "bpe" and meta["tokenizer"]["name"] == "tiny"
    assert meta["tokenizer"]["hash"] == bpe.load(meta["tokenizer"]["path"]).hash
    assert meta["vocab_size"] == 600 and meta["eot_id"] == trained.eot_id
    assert Tokenizer.from_meta(meta) == trained


def test_inline_files_make_a_checkpoint_self_contained(trained, tmp_path):
    folder = tmp_path / "tokenizers" / "tiny-copy"
    shutil.copytree(trained.to_meta()["path"], folder)
    meta = {"tokenizer": {**trained.to_meta(), "path": str(folder)}, "vocab_size": 600}
    inline = with_tokenizer_files(meta)
    assert inline["tokenizer"] == meta["tokenizer"]  # the entry train.py compares on resume is unchanged
    shutil.rmtree(folder)
    assert Tokenizer.from_meta(inline) == Tokenizer.from_meta({**meta, "tokenizer_files": inline["tokenizer_files"]})
    assert Tokenizer.from_meta(inline).encode(VARIED[3]) == trained.encode(VARIED[3])
    with pytest.raises(DataError, match="does not exist"):
        Tokenizer.from_meta(meta)
    files = dict(inline["tokenizer_files"])
    files["ranks.tiktoken"] = files["ranks.tiktoken"].replace(" 300\n", " 3000\n")
    with pytest.raises(DataError, match="in.*was changed|not a byte-level BPE"):
        Tokenizer.from_meta({**meta, "tokenizer_files": files})


def test_train_sample_export_with_a_trained_tokenizer(trained, tmp_path, capsys):
    """A tiny model trains on a dataset written with a trained tokenizer, and its checkpoint samples and
    exports with the tokenizer folder gone (the checkpoint carries it)."""
    transformers = pytest.importorskip("transformers")
    import export
    import sample
    from tests.conftest import train_script

    train = train_script()

    folder = tmp_path / "tokenizers" / "tiny-e2e"
    shutil.copytree(trained.to_meta()["path"], folder)
    tok = Tokenizer.from_meta({**trained.to_meta(), "path": str(folder)})
    data = write_dataset(tmp_path / "data" / "tiny_bpe", "".join(corpus(3, 3000)), tok)
    out = tmp_path / "out"
    train.main([f"--dataset={data}", f"--out_dir={out}", "--n_layer=1", "--n_head=2", "--n_embd=32",
                "--block_size=32", "--batch_size=4", "--gradient_accumulation_steps=1", "--max_iters=4",
                "--eval_interval=2", "--eval_iters=2", "--warmup_iters=1", "--lr_decay_iters=4", "--device=cpu",
                "--compile=False"])
    shutil.rmtree(folder)
    capsys.readouterr()

    sample.main([f"--ckpt={out}", "--device=cpu", "--prompt=The king", "--max_new_tokens=20", "--seed=1"])
    printed = capsys.readouterr().out
    assert "The king" in printed

    export.main(["--ckpt", str(out), "--to", str(tmp_path / "hf")])
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf.encode(VARIED[5]) == with_specials(trained, VARIED[5])
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["vocab_size"] == 600 and config["eos_token_id"] == config["bos_token_id"] == trained.eot_id


# ----------------------------------------------------------------------------- prepare/tokenizer.py


def test_script_trains_saves_and_finds_the_same_folder(tmp_path, capsys, monkeypatch):
    from prepare import tokenizer as script

    texts = tmp_path / "texts"
    (texts / "sub").mkdir(parents=True)
    parts = corpus(4, 1200)
    (texts / "a.txt").write_text("".join(parts[:12]), encoding="utf-8")
    (texts / "sub" / "b.txt").write_text("".join(parts[12:]), encoding="utf-8")
    monkeypatch.setattr(script, "PIECE_CHARS", 5000)  # many pieces per file, cut where the split pattern cuts
    args = ["--input", str(texts), "--vocab_size", "500", "--name", "mine", "--data_root", str(tmp_path / "data")]
    script.main(args)
    out = capsys.readouterr().out
    folder = next((tmp_path / "data" / "tokenizers").iterdir())
    assert f"wrote {folder}/" in out and "vocab_size 500 (256 bytes + 239 merges + 5 special tokens)" in out
    assert "--tokenizer mine" in out
    whole = bpe.train(["".join(parts[:12]), "".join(parts[12:])], 500, CHAT_SPECIALS, "mine")
    assert folder.name == whole.folder_name  # reading in pieces changed nothing

    script.main(args)
    assert "already holds this exact tokenizer" in capsys.readouterr().out
    assert len(list((tmp_path / "data" / "tokenizers").iterdir())) == 1


@pytest.mark.parametrize("args, fragment", [
    (["--input", "{tmp}/missing", "--vocab_size", "500", "--name", "x"], "does not exist"),
    (["--input", "{tmp}", "--vocab_size", "500", "--name", "x"], "contains no .txt files"),
    (["--input", "{tmp}/a.txt", "--vocab_size", "100", "--name", "x"], "at least 261"),
    (["--input", "{tmp}/a.txt", "--vocab_size", "500", "--name", "gpt2"], "not 'gpt2'"),
    (["--input", "{tmp}/a.txt", "--vocab_size", "500", "--name", "a/b"], "must be letters"),
    (["--input", "{tmp}/bad.txt", "--vocab_size", "500", "--name", "x"], "not UTF-8"),
    (["--input", "{tmp}/empty.txt", "--vocab_size", "500", "--name", "x"], "is empty"),
    (["--vocab_size", "500", "--name", "x"], "exactly one of --input"),
])
def test_script_errors_are_one_line(tmp_path, args, fragment):
    from prepare import tokenizer as script

    sub = tmp_path / "in"
    sub.mkdir()
    (tmp_path / "a.txt").write_text("hello world\n")
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\x00bad")
    (tmp_path / "empty.txt").write_text("")
    argv = [a.replace("{tmp}", str(sub if fragment == "contains no .txt files" else tmp_path)) for a in args]
    with pytest.raises(SystemExit) as e:
        script.main([*argv, "--data_root", str(tmp_path / "data")])
    message = str(e.value.code)
    assert message.startswith("error: ") and fragment in message and "\n" not in message, message
    assert not (tmp_path / "data").exists()


def test_script_reads_a_hugging_face_dataset_up_to_max_chars(tmp_path, capsys, monkeypatch):
    datasets = pytest.importorskip("datasets")
    import gptkit.data.prepare.hub as hub
    from prepare import tokenizer as script

    rows = {"body": [*corpus(5, 400), "", None]}
    asked = []

    def load_hf_dataset(name, config=None, *, split="train", **kwargs):
        asked.append((name, config, split))
        return datasets.Dataset.from_dict(rows)

    monkeypatch.setattr(hub, "load_hf_dataset", load_hf_dataset)
    script.main(["--hf_dataset", "someone/texts", "--hf_config", "en", "--hf_split", "validation",
                 "--text_column", "body", "--vocab_size", "400", "--name", "web", "--max_chars", "20000",
                 "--data_root", str(tmp_path)])
    assert asked == [("someone/texts", "en", "validation")]
    folder = next((tmp_path / "tokenizers").iterdir())
    info = json.loads((folder / "tokenizer_info.json").read_text())
    texts, left = [], 20000  # the documents up to 20,000 characters: the last one cut
    for doc in corpus(5, 400):
        texts.append(doc[:left])
        left -= len(texts[-1])
        if not left:
            break
    assert info["hash"] == bpe.train(texts, 400, CHAT_SPECIALS, "web").hash
    n_bytes = len("".join(texts).encode("utf-8"))
    assert info["trained_on"] == f"hf:someone/texts: {n_bytes:,} bytes in {len(texts)} texts"

    with pytest.raises(SystemExit) as e:
        script.main(["--hf_dataset", "someone/texts", "--vocab_size", "400", "--name", "web"])
    assert "has no column 'text'" in str(e.value.code) and "body" in str(e.value.code)


# What requests says when the BPE files cannot be downloaded (no DNS): 350 characters of nested exceptions.
OFFLINE = ("HTTPSConnectionPool(host='openaipublic.blob.core.windows.net', port=443): Max retries exceeded with url: "
           "/gpt-2/encodings/main/vocab.bpe (Caused by NameResolutionError(\"HTTPSConnection(host='openaipublic.blob"
           ".core.windows.net', port=443): Failed to resolve 'openaipublic.blob.core.windows.net' ([Errno -2] Name "
           "or service not known)\"))")


@pytest.mark.parametrize("cause, said", [
    (OFFLINE, "cannot resolve openaipublic.blob.core.windows.net: no network?"),
    ("HTTPSConnectionPool(host='openaipublic.blob.core.windows.net', port=443): Read timed out. (read timeout=10)",
     "timed out reaching openaipublic.blob.core.windows.net"),
    ("something else entirely", "ConnectionError: something else entirely"),
])
def test_gpt2_bpe_offline_is_one_short_line_that_says_how_to_work_offline(monkeypatch, tmp_path, cause, said):
    """Offline, the error says what failed in a few words (not the network library's nested exceptions) and how
    to run without a network: TIKTOKEN_CACHE_DIR, and how to fill it."""
    import requests
    import tiktoken

    def no_network(name):
        raise requests.exceptions.ConnectionError(cause)

    monkeypatch.setattr(tiktoken, "get_encoding", no_network)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    with pytest.raises(DataError) as e:
        Tokenizer.tiktoken("gpt2")
    message = str(e.value)
    assert message == (f"could not download tiktoken's gpt2 BPE files ({said}; not in TIKTOKEN_CACHE_DIR={tmp_path}); "
                       f"offline, set TIKTOKEN_CACHE_DIR to a folder that holds them, filled where there is network "
                       f"by: TIKTOKEN_CACHE_DIR=DIR python -c \"import tiktoken; tiktoken.get_encoding('gpt2')\"")
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR")
    with pytest.raises(DataError, match=r"; no TIKTOKEN_CACHE_DIR set\); offline, set TIKTOKEN_CACHE_DIR"):
        Tokenizer.tiktoken("gpt2")
