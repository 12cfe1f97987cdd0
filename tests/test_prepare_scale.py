"""Data preparation that scales: exact cuts, the same shards whatever --num_proc, bounded memory, kill -9 and
resume, never rewriting a finished dataset, the hash split."""

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import needs_gpt2_bpe

from gptkit.data import shards
from gptkit.data.prepare import cuts, hub, local, pipeline, pool
from gptkit.data.shards import TokenDataset
from gptkit.errors import DataError
from gptkit.tokenizer import Tokenizer
from prepare import text

REPO = Path(__file__).resolve().parents[1]

# GPT-4's split pattern (cl100k_base, as tiktoken writes it): trained tokenizers split text this way. The test
# pairs it with GPT-2's merges, which is enough to check where pieces begin and end.
CL100K_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|"""
                  r"""\s++$|\s*[\r\n]|\s+(?!\S)|\s""")


class EncodingTokenizer:
    """The slice of Tokenizer that the cut rules use, around any tiktoken Encoding."""

    kind = "tiktoken"

    def __init__(self, enc):
        self.enc = enc

    def encode_array(self, text):
        return np.asarray(self.enc.encode_ordinary(text), dtype=np.uint32)


def cl100k_style():
    import tiktoken

    gpt2 = tiktoken.get_encoding("gpt2")
    return tiktoken.Encoding("cl100k_style", pat_str=CL100K_PATTERN, mergeable_ranks=gpt2._mergeable_ranks,
                             special_tokens={})


def nasty_strings(n: int, seed: int = 0) -> list[str]:
    """Random short strings over the characters that decide where pre-tokenisers split."""
    rng = random.Random(seed)
    alphabet = [*"ab Z9.,'/\n\r\t  \n\n(-", "\u00a0", "\u00e9", "\u65e5", "\x1c", "\u3000", "'s", "  ", "\r\n"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(n)]


def make_corpus(folder: Path, n_small: int = 30, big_copies: int = 3, seed: int = 0) -> Path:
    """Small documents, an empty one, and one document several blocks long (with CRLF and non-ASCII lines)."""
    rng = random.Random(seed)
    words = "the of and to a in is it you that he was for on are with as I his they be at one".split()
    folder.mkdir()

    def prose(n):
        seps = [" "] * 12 + ["\n", "\n\n", "  ", "\t", ",\n", ". ", "\r\n", "\n  ", " \u00e9t\u00e9 ", "\u2603\n"]
        return "".join(rng.choice(words) + rng.choice(seps) for _ in range(n))

    for i in range(n_small):
        (folder / f"doc{i:03d}.txt").write_text(prose(rng.randint(20, 400)), encoding="utf-8", newline="")
    (folder / "empty.txt").write_text("")
    (folder / "sub").mkdir()
    (folder / "sub" / "big.txt").write_text(prose(3000) * big_copies, encoding="utf-8", newline="")
    return folder


def folder_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def split_tokens(out: Path, split: str) -> np.ndarray:
    ds = TokenDataset(out, split)
    return ds.window(0, len(ds))


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 4 KB, so a small corpus makes many tasks and runs on worker processes."""
    monkeypatch.setattr(local, "BLOCK_BYTES", 4096)
    monkeypatch.setattr(local, "PARALLEL_MIN_BLOCKS", 1)
    monkeypatch.setattr(hub, "ROWS_PER_TASK", 8)
    monkeypatch.setattr(hub, "PARALLEL_MIN_BYTES", 0)


# ---- exact cuts -------------------------------------------------------------------------------------------


@needs_gpt2_bpe
def test_cut_rules_are_exact_for_the_gpt2_and_gpt4_split_patterns():
    gpt2 = Tokenizer.tiktoken("gpt2")
    gpt4 = EncodingTokenizer(cl100k_style())
    for s in nasty_strings(1500):
        assert cuts.is_exact(gpt2.encode_array, s, "gpt2"), repr(s)
        assert cuts.is_exact(gpt4.encode_array, s, "newline"), repr(s)
    # Each rule is wrong for the other pattern, which is why the rule follows the tokenizer.
    assert not cuts.is_exact(gpt4.encode_array, "end.\n\nNext", "gpt2")
    assert not cuts.is_exact(gpt2.encode_array, "a\n\nNext", "newline")
    assert cuts.choose_rule(gpt2) == "gpt2" and cuts.choose_rule(gpt4) == "newline"
    assert cuts.choose_rule(Tokenizer.char_from_text("ab")) == "gpt2"
    # Control characters that Python calls whitespace and the tokenizer does not (the old rule cut here wrongly).
    assert cuts.is_exact(gpt2.encode_array, "x" * 10 + "\n\n\x1cA y", "gpt2")


@pytest.mark.parametrize("rule", ["gpt2", "newline"])
def test_find_cut_in_a_file_agrees_with_the_rule_on_the_whole_text(tmp_path, rule):
    """Every byte position, a UTF-8 text with CRLF and multi-byte characters: the first cut at or after it,
    never looking past the document's end (here: byte `end`, before the text's own end)."""
    content = "".join(nasty_strings(60, seed=1)) + "tail text"
    data = content.encode("utf-8")
    path = tmp_path / "t.txt"
    path.write_bytes(data)
    end = len(data) - 5
    doc = data[:end].decode("utf-8", errors="ignore")
    doc_bytes = doc.encode("utf-8")
    byte_cuts = [len(doc[:c].encode("utf-8")) for c in cuts.cuts_in(doc, rule)]
    with open(path, "rb") as f:
        for pos in range(1, len(doc_bytes)):
            want = min([c for c in byte_cuts if c >= pos], default=len(doc_bytes))
            assert cuts.find_cut(f, pos, len(doc_bytes), rule) == want, pos


# ---- the same shards whatever --num_proc ------------------------------------------------------------------


@needs_gpt2_bpe
def test_num_proc_1_and_2_give_identical_shards(tmp_path, small_blocks):
    corpus = make_corpus(tmp_path / "docs")
    outs = {}
    for n in (1, 2):
        outs[n] = tmp_path / f"out{n}"
        text.main(["--input", str(corpus), "--out_dir", str(outs[n]), "--num_proc", str(n),
                   "--shard_tokens", "3000"])
    assert folder_bytes(outs[1]) == folder_bytes(outs[2])
    # And they are right: every document whole, tokenised as by one encode call, in order within its split.
    tok = Tokenizer.tiktoken("gpt2")
    files = [p for p in sorted(corpus.rglob("*.txt")) if p.stat().st_size]
    assert files[-1].stat().st_size > 5 * local.BLOCK_BYTES  # the big document was cut into many tasks
    rule = pipeline.ValRule.for_documents(0.1, len(files))
    for split in ("train", "val"):
        want = [np.append(tok.encode_array(p.read_bytes().decode("utf-8")), tok.eot_id)
                for i, p in enumerate(files) if rule.split(i) == split]
        assert split_tokens(outs[1], split).tolist() == np.concatenate(want).tolist()
    meta = shards.read_meta(outs[1])
    assert meta["documents"] == len(files) and len(meta["splits"]["train"]["shards"]) > 3


@needs_gpt2_bpe
def test_one_large_file_streams_in_blocks_and_keeps_the_character_split(tmp_path, small_blocks, shakespeare_path):
    outs = {}
    for n in (1, 2):
        outs[n] = tmp_path / f"s{n}"
        text.main(["--input", str(shakespeare_path), "--out_dir", str(outs[n]), "--num_proc", str(n)])
    assert folder_bytes(outs[1]) == folder_bytes(outs[2])
    content = shakespeare_path.read_text(encoding="utf-8")
    cut = round(len(content) * 0.9)
    tok = Tokenizer.tiktoken("gpt2")
    assert split_tokens(outs[1], "train").tolist() == tok.encode(content[:cut])
    assert split_tokens(outs[1], "val").tolist() == tok.encode(content[cut:])


@needs_gpt2_bpe
def test_hf_dataset_rows_with_hash_split_match_num_proc(tmp_path, small_blocks):
    import datasets

    rng = random.Random(0)
    docs = ["".join(rng.choice("abc de\n") for _ in range(rng.randint(50, 300))) for _ in range(60)]
    ds = datasets.Dataset.from_dict({"text": docs})
    tok = Tokenizer.tiktoken("gpt2")
    for n in (1, 2):
        hub.write_hf_corpus(tmp_path / f"h{n}", ds, tok, source="t", num_proc=n, shard_tokens=2000,
                            val_fraction=0.2)
    assert folder_bytes(tmp_path / "h1") == folder_bytes(tmp_path / "h2")
    rule = pipeline.ValRule.for_documents(0.2, len(docs))
    want = [np.append(tok.encode_array(d), tok.eot_id) for i, d in enumerate(docs) if rule.split(i) == "val"]
    assert split_tokens(tmp_path / "h1", "val").tolist() == np.concatenate(want).tolist()


# ---- bounded memory ---------------------------------------------------------------------------------------


def _square(x):
    return x * x


def test_ordered_map_keeps_order_and_a_bounded_number_in_flight():
    pulled = []

    def tasks():
        for i in range(40):
            pulled.append(i)
            yield i

    got = []
    for task, result in pool.ordered_map(_square, tasks(), 2, ahead=3):
        assert len(pulled) - len(got) <= 3  # submitted and not yet consumed
        got.append(result)
        assert task == len(got) - 1
    assert got == [i * i for i in range(40)]


def _die(x):
    os._exit(3)  # as the OOM killer would: no Python error comes back


def test_a_worker_that_dies_is_a_one_line_error():
    with pytest.raises(pool.WorkerError, match="worker process died") as e:
        list(pool.ordered_map(_die, range(4), 2))
    assert "\n" not in str(e.value)


@needs_gpt2_bpe
def test_what_is_in_flight_does_not_grow_with_the_corpus(tmp_path, small_blocks, monkeypatch):
    """The largest input a task reads and the largest array written at once stay under a bound set by the
    block size, for a small corpus and one four times larger: not by the corpus (or shard) size."""
    biggest = {"task_bytes": 0, "write": 0}
    write = shards.ShardWriter.write

    def recording_write(self, tokens):
        biggest["write"] = max(biggest["write"], len(tokens))
        write(self, tokens)

    read_piece = local.read_piece

    def recording_read(piece, rule):
        out = read_piece(piece, rule)
        biggest["task_bytes"] = max(biggest["task_bytes"], len(out.encode("utf-8")))
        return out

    monkeypatch.setattr(shards.ShardWriter, "write", recording_write)
    monkeypatch.setattr(local, "read_piece", recording_read)
    for copies in (4, 16):
        biggest.update(task_bytes=0, write=0)
        corpus = make_corpus(tmp_path / f"c{copies}", big_copies=copies)
        assert (corpus / "sub" / "big.txt").stat().st_size > 10 * local.BLOCK_BYTES
        text.main(["--input", str(corpus), "--out_dir", str(tmp_path / f"o{copies}"), "--num_proc", "1"])
        assert 0 < biggest["task_bytes"] <= local.BLOCK_BYTES + 64  # a block, plus the way to its next cut
        assert 0 < biggest["write"] <= local.BLOCK_BYTES + 64  # GPT-2 never has more tokens than bytes


def test_peak_memory_does_not_grow_with_the_corpus(tmp_path, monkeypatch):
    """Python's own allocation peak (numpy's included) while preparing one 4 MB file is that of a 1 MB one:
    neither the text nor its tokens are ever held whole (they would be 12 MB here)."""
    import tracemalloc

    monkeypatch.setattr(local, "BLOCK_BYTES", 1 << 16)
    line = "".join(chr(c) for c in range(32, 127)) + "\n"
    peaks = []
    for mb in (1, 4):
        src = tmp_path / f"in{mb}.txt"
        src.write_text(line * (mb * (1 << 20) // len(line)))
        tracemalloc.start()
        text.main(["--input", str(src), "--out_dir", str(tmp_path / f"o{mb}"), "--tokenizer", "char",
                   "--num_proc", "1"])
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert peaks[1] < peaks[0] + (1 << 20) and peaks[1] < 4 << 20, peaks


# ---- kill -9, then resume ---------------------------------------------------------------------------------

# Runs prepare/text.py in a child process that SIGKILLs itself (no cleanup of any kind runs) right after its
# Nth write of tokens: half-written .part files, shards completed after the last checkpoint, live workers.
KILLER = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, sys.argv[1])
    from gptkit.data.prepare import local, writer
    local.BLOCK_BYTES, local.PARALLEL_MIN_BLOCKS = 4096, 1
    kill_after, writes = int(sys.argv[2]), []
    write = writer.DatasetWriter.write
    def killing_write(self, split, tokens):
        write(self, split, tokens)
        writes.append(split)
        if len(writes) == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    writer.DatasetWriter.write = killing_write
    from prepare import text
    text.main(sys.argv[3:])
""")


def run_killable(kill_after: int, argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", KILLER, str(REPO), str(kill_after), *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


@needs_gpt2_bpe
def test_killed_then_resumed_prepare_gives_byte_identical_shards(tmp_path, small_blocks):
    corpus = make_corpus(tmp_path / "docs")
    argv = ["--input", str(corpus), "--shard_tokens", "2500"]
    reference = tmp_path / "reference"
    text.main([*argv, "--out_dir", str(reference), "--num_proc", "1"])  # uninterrupted, with KILLER's blocks
    assert len(list(reference.glob("*.bin"))) > 8
    # Killed before its first checkpoint (so it starts again), and mid-run with two live workers.
    for kill_after, procs in ((1, "1"), (12, "2")):
        out = tmp_path / f"killed{kill_after}"
        killed = run_killable(kill_after, [*argv, "--out_dir", str(out), "--num_proc", procs])
        assert killed.returncode == -9, killed.stderr
        assert not (out / "meta.json").exists() and (out / ".partial").is_dir()
        checkpointed = (out / ".partial" / "progress.json").exists()
        assert checkpointed == (kill_after > 1)  # the first write completes no shard, so no checkpoint yet
        resumed = run_killable(0, [*argv, "--out_dir", str(out), "--num_proc", "1"])  # another --num_proc too
        assert resumed.returncode == 0, resumed.stderr
        assert ("resuming the interrupted run" in resumed.stdout) == checkpointed
        assert folder_bytes(out) == folder_bytes(reference)
        assert not (out / ".partial").exists()


@needs_gpt2_bpe
def test_a_stream_that_breaks_resumes_from_its_state(tmp_path, small_blocks):
    """A Hub stream dies mid-way (the network): the published dataset is untouched, the next run continues
    from the stream's saved position and ends with the bytes of an uninterrupted run."""
    import datasets

    rng = random.Random(1)
    docs = ["".join(rng.choice("xyz uv\n") for _ in range(rng.randint(100, 400))) for _ in range(120)]
    ds = datasets.Dataset.from_dict({"text": docs})
    tok = Tokenizer.tiktoken("gpt2")
    opts = dict(source="t", num_proc=1, shard_tokens=1500, val_tokens=2000)
    hub.write_hf_corpus(tmp_path / "ref", ds.to_iterable_dataset(num_shards=4), tok, **opts)

    class Breaking:  # the stream, until the network drops after 70 rows
        def __init__(self):
            self.inner = ds.to_iterable_dataset(num_shards=4)

        def __iter__(self):
            for i, row in enumerate(self.inner):
                if i == 70:
                    raise ConnectionError("network dropped")
                yield row

        def state_dict(self):
            return self.inner.state_dict()

        def load_state_dict(self, state):
            self.inner.load_state_dict(state)

    out = tmp_path / "out"
    with pytest.raises(DataError, match="run the same command again"):
        hub.write_hf_corpus(out, Breaking(), tok, **opts)
    assert json.loads((out / ".partial" / "progress.json").read_text())["cursor"]["task"]["rows"] > 0
    hub.write_hf_corpus(out, ds.to_iterable_dataset(num_shards=4), tok, **opts)
    assert folder_bytes(out) == folder_bytes(tmp_path / "ref")


# ---- a finished dataset is never rewritten unless asked ---------------------------------------------------


def test_a_prepared_dataset_is_left_alone_unless_overwrite(tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("To be, or not to be, that is the question.\n" * 300)
    out = tmp_path / "out"
    text.main(["--input", str(src), "--out_dir", str(out), "--tokenizer", "char"])
    summary = capsys.readouterr().out
    assert "1 document, 12,900 tokens (train 11,610 in 1 shard, val 1,290 in 1 shard" in summary
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    text.main(["--input", str(src), "--out_dir", str(out), "--tokenizer", "char", "--num_proc", "2"])
    assert "already prepared" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
    with pytest.raises(SystemExit) as e:  # other options: refused, nothing touched
        text.main(["--input", str(src), "--out_dir", str(out), "--tokenizer", "char", "--val_fraction", "0.2"])
    assert "--overwrite" in str(e.value.code) and "\n" not in str(e.value.code)
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
    text.main(["--input", str(src), "--out_dir", str(out), "--tokenizer", "char", "--val_fraction", "0.2",
               "--overwrite"])
    assert shards.read_meta(out)["splits"]["val"]["tokens"] == 2580


def test_text_py_on_a_hugging_face_dataset_with_char(tmp_path, monkeypatch, capsys):
    """--hf_dataset: the characters of every row first, whole rows to the splits, and a second run does
    nothing."""
    import datasets

    rng = random.Random(2)
    rows = ["".join(rng.choice("abcdef \n\u00e9") for _ in range(rng.randint(100, 300))) for _ in range(50)]
    monkeypatch.setattr(hub, "load_hf_dataset", lambda *a, **k: datasets.Dataset.from_dict({"body": rows, "n": [0] * 50}))
    argv = ["--hf_dataset", "someone/texts", "--text_column", "body", "--tokenizer", "char", "--out_dir",
            str(tmp_path / "o"), "--val_fraction", "0.2"]
    text.main(argv)
    meta = shards.read_meta(tmp_path / "o")
    assert meta["tokenizer"]["chars"] == sorted(set("".join(rows))) and meta["documents"] == 50
    tok = Tokenizer.from_meta(meta)
    rule = pipeline.ValRule.for_documents(0.2, 50)
    assert tok.decode(split_tokens(tmp_path / "o", "val")) == "".join(r for i, r in enumerate(rows)
                                                                       if rule.split(i) == "val")
    capsys.readouterr()
    text.main(argv)
    assert "already prepared" in capsys.readouterr().out


def test_char_over_a_stream_is_refused_before_any_download(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("downloaded"))
    with pytest.raises(DataError, match="--tokenizer char needs the whole corpus") as e:
        hub.prepare_hub_corpus(tmp_path / "o", "some/corpus", tokenizer="char", streaming=True)
    assert "\n" not in str(e.value) and not (tmp_path / "o").exists()


# ---- the hash split ---------------------------------------------------------------------------------------


def test_val_rule_is_a_fixed_share_of_documents_with_at_least_one_each():
    rule = pipeline.ValRule.for_documents(0.1, 10_000)
    picked = [rule.split(i) for i in range(10_000)]
    assert 900 < picked.count("val") < 1100
    assert picked == [pipeline.ValRule.for_documents(0.1, 10_000).split(i) for i in range(10_000)]
    few = pipeline.ValRule.for_documents(0.01, 5)  # the hash picks none of 5: the smallest hash is val
    assert [few.split(i) for i in range(5)].count("val") == 1
    most = pipeline.ValRule.for_documents(0.99, 5)  # the hash picks all: the largest stays train
    assert [most.split(i) for i in range(5)].count("train") == 1


# ---- a trained tokenizer ----------------------------------------------------------------------------------


def test_a_trained_tokenizer_gets_exact_newline_cuts_and_the_same_shards(tmp_path, small_blocks):
    pytest.importorskip("rustbpe")
    from gptkit import bpe
    from gptkit.tokenizer import CHAT_SPECIALS, resolve_tokenizer

    corpus = make_corpus(tmp_path / "docs")
    texts = [p.read_bytes().decode("utf-8") for p in sorted(corpus.rglob("*.txt"))]
    folder, _ = bpe.save(bpe.train(texts, 400, CHAT_SPECIALS, "tiny"), tmp_path / "tokenizers")
    tok = resolve_tokenizer(str(folder))
    assert cuts.choose_rule(tok) == "newline"  # GPT-4's split pattern
    for s in nasty_strings(300):
        assert cuts.is_exact(tok.encode_array, s, "newline"), repr(s)
    for n, by in ((1, ["--tokenizer", str(folder)]), (2, ["--tokenizer", "tiny", "--data_root", str(tmp_path)])):
        text.main(["--input", str(corpus), "--out_dir", str(tmp_path / f"t{n}"), "--num_proc", str(n), *by,
                   "--shard_tokens", "5000"])  # by PATH, then by NAME
    assert folder_bytes(tmp_path / "t1") == folder_bytes(tmp_path / "t2")
    meta = shards.read_meta(tmp_path / "t1")
    assert meta["tokenizer"]["kind"] == "bpe" and meta["eot_id"] == tok.eot_id is not None
    # The big document, cut into many tasks, is the last of its split: its tokens are one encode call's.
    big = (corpus / "sub" / "big.txt").read_bytes().decode("utf-8")
    split = pipeline.ValRule.for_documents(0.1, meta["documents"]).split(meta["documents"] - 1)
    whole = [*tok.encode_array(big).tolist(), tok.eot_id]
    assert split_tokens(tmp_path / "t1", split)[-len(whole):].tolist() == whole
