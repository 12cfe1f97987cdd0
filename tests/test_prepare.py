"""The prepare scripts (prepare/): round trips, refusals, idempotence, offline errors, the big-corpus writer."""

import random
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import needs_gpt2_bpe

from gptkit.data import shards
from gptkit.data.prepare import cuts, hub, local
from gptkit.data.prepare.pipeline import ValRule
from gptkit.data.prepare.tiny_shakespeare import prepare_shakespeare
from gptkit.data.shards import TokenDataset
from gptkit.errors import DataError
from gptkit.tokenizer import Tokenizer
from prepare import openwebtext, shakespeare, shakespeare_char, text

REPO = Path(__file__).resolve().parents[1]
WORDS = "the of and to a in is it you that he was for on are with as I his they be at one have this from".split()


def make_text(n_words: int, seed: int = 0) -> str:
    """Deterministic prose-like text with varied whitespace (the cases chunked tokenisation must respect)."""
    rng = random.Random(seed)
    seps = [" "] * 20 + ["\n", "\n\n", "  ", "\t", " \n", "\r\n", "\n  ", ",\n", ". "]
    return "".join(rng.choice(WORDS) + rng.choice(seps) for _ in range(n_words)) + "Ünïcode ☃ end.\n"


def decode_dataset(out_dir: Path) -> str:
    meta = shards.read_meta(out_dir)
    tok = Tokenizer.from_meta(meta)
    return "".join(tok.decode(np.asarray(TokenDataset(out_dir, s).window(0, len(TokenDataset(out_dir, s)))))
                   for s in ("train", "val"))


def exit_message(excinfo) -> str:
    msg = str(excinfo.value.code)
    assert msg.startswith("error: ") and "\n" not in msg
    return msg


def write_docs(folder: Path, docs: list[str]) -> Path:
    """A folder of documents doc00.txt, doc01.txt, ... (the order text.py reads them in)."""
    folder.mkdir()
    for i, d in enumerate(docs):
        (folder / f"doc{i:02d}.txt").write_text(d, encoding="utf-8", newline="")
    return folder


def folder_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


# ---- tiny Shakespeare -------------------------------------------------------------------------------------


def test_shakespeare_char_exact_round_trip(shakespeare_path, tmp_path):
    out = tmp_path / "sc"
    shakespeare_char.main(["--input", str(shakespeare_path), "--out_dir", str(out)])
    meta = shards.read_meta(out)
    original = shakespeare_path.read_text(encoding="utf-8")
    assert meta["vocab_size"] == 65 and meta["eot_id"] is None and meta["tokenizer"]["kind"] == "char"
    assert meta["splits"]["train"]["tokens"] == round(len(original) * 0.9)
    assert decode_dataset(out) == original
    first = folder_bytes(out)
    shakespeare_char.main(["--input", str(shakespeare_path), "--out_dir", str(out)])
    assert folder_bytes(out) == first  # idempotent: the same bytes again, meta.json included


@needs_gpt2_bpe
def test_shakespeare_gpt2_round_trip(shakespeare_path, tmp_path):
    out = tmp_path / "s"
    shakespeare.main(["--input", str(shakespeare_path), "--out_dir", str(out), "--num_proc", "2"])
    meta = shards.read_meta(out)
    assert meta["tokenizer"] == {"kind": "tiktoken", "name": "gpt2"}
    assert meta["vocab_size"] == 50257 and meta["eot_id"] == 50256
    assert meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"] == 338025
    assert decode_dataset(out) == shakespeare_path.read_text(encoding="utf-8")


def test_no_network_is_one_line_naming_the_url(tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("[Errno -2] Name or service not known")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    out = tmp_path / "sc"
    with pytest.raises(SystemExit) as e:
        shakespeare_char.main(["--out_dir", str(out)])
    msg = exit_message(e)
    assert shakespeare_char.URL in msg and "--input PATH" in msg
    assert not list(out.glob("*"))  # no partial download left behind


def test_prepare_shakespeare_function_raises_data_error(tmp_path, monkeypatch, shakespeare_path):
    """The function train.py calls: a meta dict back, or a one-line DataError (never SystemExit)."""
    meta = prepare_shakespeare(tmp_path / "sc", "char", shakespeare_path, num_proc=1)
    assert meta == shards.read_meta(tmp_path / "sc") and meta["source"] == str(shakespeare_path)
    with pytest.raises(DataError, match="'bpe'") as e:  # before any download (there is no network here)
        prepare_shakespeare(tmp_path / "x", "bpe")
    assert "\n" not in str(e.value)
    (tmp_path / "a_file").write_text("not a folder")
    with pytest.raises(DataError, match="a_file"):  # an out_dir that cannot be written
        prepare_shakespeare(tmp_path / "a_file", "char", shakespeare_path)

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(DataError, match=r"could not download .*--input PATH"):
        prepare_shakespeare(tmp_path / "offline", "gpt2")


def test_download_is_written_once_and_whole(tmp_path, monkeypatch):
    import io

    body = make_text(3000).encode()
    calls = []

    class Response(io.BytesIO):
        headers = {"Content-Length": str(len(body))}

    def fake_urlopen(url, timeout):
        calls.append(url)
        return Response(body)

    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen)
    dest = tmp_path / "dl" / "input.txt"
    assert local.download("https://example.org/t.txt", dest) == dest and dest.read_bytes() == body
    assert local.download("https://example.org/t.txt", dest) == dest and len(calls) == 1  # cached
    assert [p.name for p in dest.parent.iterdir()] == ["input.txt"]  # no temporary file left


def test_script_help_runs_as_a_subprocess():
    for script in ("shakespeare_char", "text"):
        result = subprocess.run([sys.executable, f"prepare/{script}.py", "--help"], cwd=REPO,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert "--out_dir" in result.stdout


def test_script_error_as_a_subprocess(tmp_path):
    result = subprocess.run([sys.executable, "prepare/shakespeare_char.py", "--input", str(tmp_path / "missing.txt"),
                             "--out_dir", str(tmp_path / "o")], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0 and "does not exist" in result.stderr


def test_bad_option_is_one_line_exit_1():
    """A bad command line fails like every other mistake: exit code 1 and one `error:` line naming the key."""
    result = subprocess.run([sys.executable, "prepare/shakespeare_char.py", "--bogus"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0 and "unknown config key 'bogus'" in result.stderr
    for script, argv, fragment in ((text, ["--num_proc", "x"], "num_proc expects int, got 'x'"),
                                   (openwebtext, ["--shard_tokens", "many"], "shard_tokens expects int, got 'many'"),
                                   (text, ["--input", "a.txt", "--hf_dataset", "b"], "exactly one of --input")):
        with pytest.raises(SystemExit) as e:
            script.main(argv)
        assert fragment in exit_message(e)


# ---- refusals ---------------------------------------------------------------------------------------------


@needs_gpt2_bpe
@pytest.mark.parametrize("content", ["", "tiny text, far fewer than 4096 tokens\n"])
def test_refuses_empty_or_tiny_input_and_writes_nothing(tmp_path, content):
    src = tmp_path / "in.txt"
    src.write_text(content)
    for script, extra in ((shakespeare_char, []), (text, ["--tokenizer", "gpt2"]), (text, ["--tokenizer", "char"])):
        out = tmp_path / "out"
        with pytest.raises(SystemExit) as e:
            script.main(["--input", str(src), "--out_dir", str(out), *extra])
        msg = exit_message(e)
        assert ("empty" in msg) if not content else ("at least 4096" in msg)
        assert not out.exists()


def test_text_argument_errors(tmp_path):
    with pytest.raises(SystemExit) as e:
        text.main(["--name", "x"])
    assert "exactly one of --input" in exit_message(e)
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(SystemExit) as e:
        text.main(["--input", str(tmp_path / "empty_dir"), "--out_dir", str(tmp_path / "o")])
    assert "no .txt files" in exit_message(e)
    src = tmp_path / "a.txt"
    src.write_text(make_text(3000))
    with pytest.raises(SystemExit) as e:
        text.main(["--input", str(src), "--out_dir", str(tmp_path / "o"), "--val_fraction", "1.5", "--tokenizer", "char"])
    assert "--val_fraction must be between 0 and 1" in exit_message(e)


# ---- text.py ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokenizer", ["char", pytest.param("gpt2", marks=needs_gpt2_bpe)])
def test_text_single_file_round_trip(tmp_path, tokenizer):
    src = tmp_path / "book.txt"
    content = make_text(6000, seed=1)
    src.write_text(content, encoding="utf-8", newline="")
    out = tmp_path / "book"
    text.main(["--input", str(src), "--out_dir", str(out), "--tokenizer", tokenizer, "--num_proc", "2"])
    assert decode_dataset(out) == content
    meta = shards.read_meta(out)
    assert meta["source"] == str(src)
    assert meta["eot_id"] == (50256 if tokenizer == "gpt2" else None)


@needs_gpt2_bpe
def test_text_folder_of_documents(tmp_path):
    docs = [make_text(300, seed=i) for i in range(30)]
    folder = write_docs(tmp_path / "docs", docs)
    out = tmp_path / "out"
    text.main(["--input", str(folder), "--out_dir", str(out), "--shard_tokens", "2000"])
    meta = shards.read_meta(out)
    assert len(meta["splits"]["train"]["shards"]) > 1
    tok = Tokenizer.from_meta(meta)
    got = {}
    for split in ("train", "val"):
        ds = TokenDataset(out, split)
        ids = ds.window(0, len(ds))
        assert ids[-1] == 50256  # every document ends with the end-of-text token
        pieces = tok.decode(ids).split("<|endoftext|>")
        assert pieces[-1] == ""
        got[split] = pieces[:-1]
    assert sorted(got["train"] + got["val"]) == sorted(docs)  # whole documents, none lost or cut
    assert 1 <= len(got["val"]) <= 6  # about 10% of 30 documents
    assert [d for d in docs if d in got["train"]] == got["train"]  # original order kept


def val_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(("val: ", "warning: "))]


def test_the_summary_names_the_val_documents_and_warns_when_val_is_unlike_a_sample(tmp_path, capsys):
    # Two files, the second of another kind of text (the report's): val is that whole file.
    folder = write_docs(tmp_path / "two", [make_text(900, seed=0), "héllo wörld 🙃 ünïcode テキスト " * 150])
    text.main(["--input", str(folder), "--out_dir", str(tmp_path / "o2"), "--tokenizer", "char"])
    val = TokenDataset(tmp_path / "o2", "val")
    assert Tokenizer.from_meta(val.meta).decode(val.window(0, len(val))) == (folder / "doc01.txt").read_text()
    share = len(val) / (len(val) + len(TokenDataset(tmp_path / "o2", "train")))
    assert val_lines(capsys.readouterr().out) == [
        f"val: 1 of the 2 documents (doc01.txt), {share:.0%} of the tokens (--val_fraction 0.1 picks whole "
        f"documents)",
        "warning: val is 1 of only 2 documents: the val loss measures how well the model knows that text, which "
        "may be unlike the rest, and it is never trained on; cut the text into more documents (files), or join "
        "them into one file, whose last 10% is then val"]

    # 30 documents of one size: the rule's three, a tenth of the tokens, nothing to warn about
    picked = [i for i in range(30) if ValRule.for_documents(0.1, 30).split(i) == "val"]
    assert len(picked) == 3
    folder = write_docs(tmp_path / "thirty", [make_text(60, seed=i)[:300] for i in range(30)])
    text.main(["--input", str(folder), "--out_dir", str(tmp_path / "o30"), "--tokenizer", "char"])
    names = ", ".join(f"doc{i:02d}.txt" for i in picked)
    assert val_lines(capsys.readouterr().out) == [
        f"val: 3 of the 30 documents ({names}), 10% of the tokens (--val_fraction 0.1 picks whole documents)"]

    # 12 documents, the one val takes far longer than the rest: a large share, and the names past three counted
    picked = [i for i in range(12) if ValRule.for_documents(0.5, 12).split(i) == "val"]
    assert len(picked) > 3
    docs = [make_text(60, seed=i)[:300] for i in range(12)]
    docs[picked[0]] = make_text(2000, seed=99)
    folder = write_docs(tmp_path / "twelve", docs)
    text.main(["--input", str(folder), "--out_dir", str(tmp_path / "o12"), "--tokenizer", "char", "--val_fraction",
               "0.5"])
    info, warning = val_lines(capsys.readouterr().out)
    shown = ", ".join(f"doc{i:02d}.txt" for i in picked[:3])
    assert info.startswith(f"val: {len(picked)} of the 12 documents ({shown} and {len(picked) - 3} more), ")
    assert warning.startswith("warning: val holds ") and ", not 50%: the val loss measures how well the model " \
        "knows those texts" in warning


def test_text_char_folder_and_stale_shards(tmp_path):
    docs = [make_text(400, seed=i) for i in range(5)]
    folder = write_docs(tmp_path / "docs", docs)
    out = tmp_path / "out"
    text.main(["--input", str(folder), "--out_dir", str(out), "--tokenizer", "char", "--shard_tokens", "1000"])
    n_before = len(list(out.glob("train_*.bin")))
    # One shard per split now: other options, so the finished dataset is only replaced when asked.
    text.main(["--input", str(folder), "--out_dir", str(out), "--tokenizer", "char", "--overwrite"])
    assert n_before > 1 and sorted(p.name for p in out.glob("*.bin")) == ["train_000000.bin", "val_000000.bin"]
    assert sorted(decode_dataset(out)) == sorted("".join(docs))


@needs_gpt2_bpe
def test_chunked_gpt2_encoding_equals_whole_text():
    """Cut at every position the GPT-2 rule allows (gptkit/data/prepare/cuts.py): the tokens of one encode call."""
    tok = Tokenizer.tiktoken("gpt2")
    content = make_text(20000, seed=3) + "\n\n\n   \n" + make_text(200, seed=4) + " \r\n\r\nx\n"
    bounds = [0, *cuts.cuts_in(content, "gpt2"), len(content)]
    assert len(bounds) > 1000
    chunked = np.concatenate([tok.encode_array(content[a:b]) for a, b in zip(bounds[:-1], bounds[1:])])
    assert chunked.tolist() == tok.encode(content)


# ---- big corpora (openwebtext.py / fineweb.py share this writer) ------------------------------------------


@needs_gpt2_bpe
def test_hf_corpus_writer(tmp_path):
    import datasets

    docs = [make_text(150, seed=i) for i in range(40)]
    ds = datasets.Dataset.from_dict({"text": docs, "id": list(range(40))})
    tok = Tokenizer.tiktoken("gpt2")
    expected = np.concatenate([np.append(tok.encode_array(d), 50256) for d in docs])

    out = tmp_path / "map"
    meta = hub.write_hf_corpus(out, ds, tok, source="test", num_proc=1, shard_tokens=1000, val_tokens=1500)
    assert meta["splits"]["val"]["tokens"] == 1500
    assert meta["splits"]["train"]["tokens"] == len(expected) - 1500
    for split in ("train", "val"):
        sizes = [len(shards.open_shard(out / n)) for n in meta["splits"][split]["shards"]]
        assert all(s == 1000 for s in sizes[:-1]) and 0 < sizes[-1] <= 1000  # full shards, then the rest
    stream = np.concatenate([TokenDataset(out, s).window(0, len(TokenDataset(out, s))) for s in ("val", "train")])
    assert stream.tolist() == expected.tolist()

    # The streaming path (IterableDataset, thread pool) writes the very same bytes.
    out2 = tmp_path / "stream"
    hub.write_hf_corpus(out2, ds.to_iterable_dataset(), tok, source="test", num_proc=2, shard_tokens=1000,
                           val_tokens=1500)
    assert folder_bytes(out2) == folder_bytes(out)

    # Default val size is one shard.
    meta = hub.write_hf_corpus(tmp_path / "d", ds, tok, source="test", shard_tokens=2000)
    assert meta["splits"]["val"]["tokens"] == 2000


@needs_gpt2_bpe
def test_hf_corpus_writer_refuses_tiny_corpus(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"text": ["just a few words"] * 10})
    with pytest.raises(DataError, match="at least 4096"):
        hub.write_hf_corpus(tmp_path / "o", ds, Tokenizer.tiktoken("gpt2"), source="test", shard_tokens=50)
    assert not (tmp_path / "o").exists()  # the streamed shards were removed again
    with pytest.raises(DataError, match="no column 'content'"):
        hub.write_hf_corpus(tmp_path / "o", ds, Tokenizer.tiktoken("gpt2"), source="t", text_column="content")


@needs_gpt2_bpe
def test_hf_offline_is_one_line(tmp_path, monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'Skylion007/openwebtext' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(SystemExit) as e:
        openwebtext.main(["--out_dir", str(tmp_path / "owt")])
    msg = exit_message(e)
    assert "Skylion007/openwebtext" in msg and "network" in msg
    assert not (tmp_path / "owt").exists()


@needs_gpt2_bpe
def test_failed_rerun_leaves_the_prepared_dataset_intact(tmp_path, monkeypatch):
    """A corpus run that dies half-way (e.g. a network drop) must not destroy the dataset already there. (Its
    own shards stay in .partial for the next run of the same command to continue from.)"""
    monkeypatch.setattr(hub, "ROWS_PER_TASK", 8)  # several tasks, so some shards are done when it dies
    out = tmp_path / "corpus"
    tok = Tokenizer.tiktoken("gpt2")
    docs = [{"text": make_text(150, seed=i)} for i in range(40)]
    hub.write_hf_corpus(out, docs, tok, source="test", shard_tokens=1000, val_tokens=1500)
    before = folder_bytes(out)

    def dying():
        yield from docs[:30]
        raise ConnectionError("network dropped")

    with pytest.raises(DataError, match="network"):
        hub.write_hf_corpus(out, dying(), tok, source="test2", shard_tokens=1000, val_tokens=1500, overwrite=True)
    assert folder_bytes(out) == before  # the files; .partial is a folder
    assert shards.read_meta(out)["source"] == "test"
    assert (out / ".partial" / "progress.json").is_file()  # for the same command to continue from
