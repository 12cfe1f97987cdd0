"""The token-shard format, meta.json, the tokenizer and the concatenated split view (shards.py)."""

import json
import struct

import numpy as np
import pytest
from conftest import needs_gpt2_bpe

from gptkit.data import shards
from gptkit.data.shards import TokenDataset
from gptkit.errors import DataError
from gptkit.tokenizer import Tokenizer


def one_line_error(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


def make_dataset(root, splits: dict[str, list[np.ndarray]], vocab_size: int, tokenizer=None):
    """A dataset folder with one shard per array, written through the public API."""
    root.mkdir(parents=True, exist_ok=True)
    entries = {}
    for split, arrays in splits.items():
        names = []
        for i, arr in enumerate(arrays):
            name = shards.shard_name(split, i)
            shards.write_shard(root / name, arr, vocab_size)
            names.append(name)
        entries[split] = {"shards": names, "tokens": int(sum(len(a) for a in arrays))}
    meta = {
        "format_version": 1,
        "tokenizer": tokenizer or {"kind": "tiktoken", "name": "gpt2"},
        "vocab_size": vocab_size,
        "eot_id": None,
        "splits": entries,
        "source": "test",
        "created": "2024-01-01",
    }
    shards.write_meta(root, meta)
    return root


# ---- shard files ------------------------------------------------------------------------------------------


def test_shard_round_trip_uint16(tmp_path):
    tokens = np.array([0, 1, 50256, 7, 65535], dtype=np.int64)
    path = shards.write_shard(tmp_path / "a.bin", tokens, vocab_size=65536)
    assert path.stat().st_size == 32 + 2 * len(tokens)
    assert [p.name for p in tmp_path.iterdir()] == ["a.bin"]  # the .tmp file was renamed away
    mm = shards.open_shard(path)
    assert isinstance(mm, np.memmap) and mm.ndim == 1 and mm.dtype == np.uint16
    assert mm.tolist() == tokens.tolist()
    magic, version, code, count = struct.unpack("<8sIIQ", path.read_bytes()[:24])
    assert (magic, version, code, count) == (b"GPTTOKS\0", 1, 2, 5)
    assert path.read_bytes()[24:32] == bytes(8)


def test_uint32_shards_for_large_vocab(tmp_path):
    tokens = np.array([0, 65536, 99_999, 123], dtype=np.int64)
    path = shards.write_shard(tmp_path / "big.bin", tokens, vocab_size=100_000)
    mm = shards.open_shard(path)
    assert mm.dtype == np.uint32 and mm.tolist() == tokens.tolist()
    assert path.stat().st_size == 32 + 4 * len(tokens)


def test_write_shard_rejects_ids_outside_vocab(tmp_path):
    with pytest.raises(DataError) as e:
        shards.write_shard(tmp_path / "a.bin", [1, 2, 70], vocab_size=65)
    assert "token id 70" in one_line_error(e)
    assert not any(tmp_path.iterdir())  # nothing written, not even the .tmp


def test_empty_shard_opens(tmp_path):
    path = shards.write_shard(tmp_path / "e.bin", np.zeros(0, dtype=np.int64), vocab_size=10)
    assert len(shards.open_shard(path)) == 0


@pytest.fixture
def good_shard(tmp_path):
    return shards.write_shard(tmp_path / "s.bin", np.arange(100), vocab_size=1000)


def test_bad_magic(good_shard):
    data = bytearray(good_shard.read_bytes())
    data[:8] = b"NOTTOKS\0"
    good_shard.write_bytes(bytes(data))
    with pytest.raises(DataError) as e:
        shards.open_shard(good_shard)
    msg = one_line_error(e)
    assert "not a token shard (bad magic)" in msg and str(good_shard) in msg


def test_not_a_shard_at_all(tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(b"hello")
    with pytest.raises(DataError, match="bad magic"):
        shards.open_shard(path)


def test_wrong_version(good_shard):
    data = bytearray(good_shard.read_bytes())
    data[8:12] = struct.pack("<I", 7)
    good_shard.write_bytes(bytes(data))
    with pytest.raises(DataError) as e:
        shards.open_shard(good_shard)
    msg = one_line_error(e)
    assert "version 7" in msg and "supports version 1" in msg


def test_bad_dtype_code(good_shard):
    data = bytearray(good_shard.read_bytes())
    data[12:16] = struct.pack("<I", 3)
    good_shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match="dtype code 3"):
        shards.open_shard(good_shard)


def test_truncated_shard(good_shard):
    good_shard.write_bytes(good_shard.read_bytes()[:-10])
    with pytest.raises(DataError) as e:
        shards.open_shard(good_shard)
    msg = one_line_error(e)
    assert str(good_shard) in msg and "should be 232 bytes" in msg and "is 222 bytes" in msg
    assert "re-run the prepare script" in msg


def test_size_mismatch_padded(good_shard):
    good_shard.write_bytes(good_shard.read_bytes() + b"\0\0")
    with pytest.raises(DataError, match="should be 232 bytes for 100 tokens but is 234 bytes"):
        shards.open_shard(good_shard)


def test_missing_shard(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        shards.open_shard(tmp_path / "nope.bin")


# ---- meta.json --------------------------------------------------------------------------------------------


def test_meta_round_trip_and_validation(tmp_path):
    root = make_dataset(tmp_path / "d", {"train": [np.arange(10)], "val": [np.arange(5)]}, vocab_size=20)
    meta = shards.read_meta(root)
    assert meta["splits"]["train"] == {"shards": ["train_000000.bin"], "tokens": 10}
    assert not list(root.glob("*.tmp"))

    (root / "meta.json").write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        shards.read_meta(root)

    meta["splits"]["train"]["shards"] = ["../../etc/passwd.bin"]
    (root / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="not a plain .bin file name"):
        shards.read_meta(root)

    (root / "meta.json").unlink()
    with pytest.raises(DataError, match="meta.json not found"):
        shards.read_meta(root)


# ---- tokenizer --------------------------------------------------------------------------------------------


def test_char_tokenizer_round_trip():
    text = "hello, world!\nÄpfel ☃"
    tok = Tokenizer.char_from_text(text)
    assert tok.kind == "char" and tok.eot_id is None and tok.vocab_size == len(set(text))
    assert tok.to_meta() == {"kind": "char", "chars": sorted(set(text))}
    ids = tok.encode(text)
    assert isinstance(ids, list) and tok.decode(ids) == text
    assert ids == [sorted(set(text)).index(c) for c in text]
    # Rebuilt from a whole meta dict or from just its tokenizer entry.
    assert Tokenizer.from_meta({"tokenizer": tok.to_meta(), "vocab_size": 5}).encode("lol") == tok.encode("lol")
    assert Tokenizer.from_meta(tok.to_meta()).decode(ids) == text


def test_char_tokenizer_unknown_character():
    tok = Tokenizer.char_from_text("abc")
    with pytest.raises(DataError) as e:
        tok.encode("abz")
    msg = one_line_error(e)
    assert "'z'" in msg and "vocabulary" in msg
    with pytest.raises(DataError, match="outside"):
        tok.decode([0, 3])


@needs_gpt2_bpe
def test_gpt2_tokenizer():
    tok = Tokenizer.tiktoken("gpt2")
    assert tok.kind == "tiktoken" and tok.vocab_size == 50257 and tok.eot_id == 50256
    assert tok.to_meta() == {"kind": "tiktoken", "name": "gpt2"}
    text = "Hello world <|endoftext|> again\n\n  ünïcödé"
    ids = tok.encode(text)
    assert 50256 not in ids  # user text is never turned into the special token
    assert tok.decode(ids) == text
    assert tok.encode_array(text).tolist() == ids


def test_unknown_tokenizer_kind():
    with pytest.raises(DataError, match="unknown tokenizer kind"):
        Tokenizer.from_meta({"kind": "sentencepiece"})


# ---- the concatenated split -------------------------------------------------------------------------------


def test_windows_cross_shard_boundaries(tmp_path):
    stream = np.arange(1000) % 997
    parts = [stream[:300], stream[300:301], stream[301:700], stream[700:]]
    root = make_dataset(tmp_path / "d", {"train": parts, "val": [stream[:50]]}, vocab_size=1000)
    ds = TokenDataset(root, "train")
    assert len(ds) == 1000 and len(ds.shards) == 4
    for start, length in [(0, 1000), (290, 20), (299, 3), (300, 1), (650, 100), (999, 1), (0, 0)]:
        assert ds.window(start, length).tolist() == stream[start : start + length].tolist()
    starts = np.array([0, 295, 299, 300, 301, 500, 690, 990])
    out = ds.windows(starts, 10)
    assert out.dtype == np.int64 and out.shape == (8, 10)
    assert out.tolist() == [stream[s : s + 10].tolist() for s in starts]
    assert ds.max_token() == 996 and TokenDataset(root, "val").max_token() == 49
    with pytest.raises(IndexError):
        ds.window(995, 10)


def test_max_token_chunked(tmp_path):
    root = make_dataset(tmp_path / "d", {"train": [np.arange(100), np.array([3, 77, 5])], "val": [np.arange(9)]}, 100)
    assert TokenDataset(root, "train").max_token(chunk=7) == 99


def test_split_token_count_mismatch(tmp_path):
    root = make_dataset(tmp_path / "d", {"train": [np.arange(10)], "val": [np.arange(5)]}, vocab_size=20)
    meta = shards.read_meta(root)
    meta["splits"]["train"]["tokens"] = 11
    shards.write_meta(root, meta)
    with pytest.raises(DataError, match="says the train split has 11 tokens but its shards hold 10"):
        TokenDataset(root, "train")
    with pytest.raises(DataError, match="no 'test' split"):
        TokenDataset(root, "test")


# ---- finding datasets -------------------------------------------------------------------------------------


def test_dataset_dir(tmp_path):
    assert shards.dataset_dir("shakespeare_char", "data") == shards.Path("data/shakespeare_char")
    assert shards.dataset_dir("some/where") == shards.Path("some/where")
    assert shards.dataset_dir(tmp_path) == tmp_path


def test_missing_dataset_names_the_prepare_command(tmp_path):
    with pytest.raises(DataError) as e:
        shards.require_dataset("shakespeare_char", tmp_path / "data")
    msg = one_line_error(e)
    assert f"dataset 'shakespeare_char' not found at {tmp_path / 'data' / 'shakespeare_char'}" in msg
    assert msg.endswith("prepare it with: python prepare/shakespeare_char.py")

    with pytest.raises(DataError) as e:
        shards.require_dataset("mybooks", tmp_path / "data")
    assert one_line_error(e).endswith("python prepare/text.py --input YOUR_TEXT --name mybooks")

    with pytest.raises(DataError) as e:
        shards.require_dataset("fineweb_edu", tmp_path / "data")
    assert "python prepare/fineweb.py --edu" in str(e.value)

    (tmp_path / "data" / "shakespeare").mkdir(parents=True)  # a folder without meta.json: interrupted prepare
    with pytest.raises(DataError) as e:
        shards.require_dataset("shakespeare", tmp_path / "data")
    assert "has no meta.json" in one_line_error(e) and "python prepare/shakespeare.py" in str(e.value)


def test_loading_a_missing_dataset_folder_names_the_prepare_command(tmp_path):
    with pytest.raises(DataError, match=r"python prepare/shakespeare_char\.py --out_dir"):
        TokenDataset(tmp_path / "elsewhere" / "shakespeare_char", "train")
