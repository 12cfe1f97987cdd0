"""Preference data: prepare/preference.py's pairs (the layouts, the reply mask, truncation, bad rows counted and
named) and gptkit/data/pairs.py's batches of whole pairs (as rendered, fixed shapes, epochs, resume, ranks)."""

import json
import random

import numpy as np
import pytest
import torch

from benchmarks import dpo_rule
from gptkit.chat import prompt_ids, render
from gptkit.data.loader import BatchLoader
from gptkit.data.pairs import PairLoader, Pairs, ValPairs
from gptkit.data.prepare.pipeline import ValRule
from gptkit.data.prepare.preferences import BAD, BadPair, Pair, parse_pair, render_pair
from gptkit.data.shards import read_meta
from gptkit.errors import DataError
from gptkit.tokenizer import CHAT_SPECIALS, Tokenizer
from prepare import chat as prepare_chat
from prepare import preference

BLOCK = 40


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def prepare(path, root, name="pairs", *extra):
    preference.main(["--input", str(path), "--tokenizer", "char", "--block_size", str(BLOCK), "--data_root",
                     str(root), "--name", name, *extra])
    return root / name


@pytest.fixture(scope="module")
def pairs_data(tmp_path_factory):
    """400 pairs of the synthetic task (benchmarks/dpo_rule.py) and their dataset."""
    root = tmp_path_factory.mktemp("pref")
    rng = random.Random(1)
    rows = [dpo_rule.preference_pair(w, rng) for w in dpo_rule.made_up_words(400, rng)]
    path = write_jsonl(root / "pairs.jsonl", rows)
    return rows, prepare(path, root, "pairs", "--val_fraction", "0.1")


def expected_rows(pair_row, tok, block_size=BLOCK):
    """x, y of the pair's chosen and rejected sequences, computed from the template directly."""
    prompt = [{"role": "user", "content": pair_row["prompt"]}]
    head = len(prompt_ids(prompt, tok))
    out = []
    for reply in (pair_row["chosen"], pair_row["rejected"]):
        ids, _ = render([*prompt, {"role": "assistant", "content": reply}], tok)
        x = np.full(block_size, tok.eot_id)
        y = np.full(block_size, -1)
        x[: len(ids) - 1] = ids[:-1]
        y[head - 1 : len(ids) - 1] = ids[head:]  # the targets from the reply's first token to its <|end|>
        out.append((x, y))
    return out


def test_every_layout_gives_the_same_pair():
    user, reply_c, reply_r = "say abc, end with !", "abc!", "abc?"
    msgs = [{"role": "user", "content": user}]
    conv_c = [*msgs, {"role": "assistant", "content": reply_c}]
    conv_r = [*msgs, {"role": "assistant", "content": reply_r}]
    layouts = [
        {"prompt": user, "chosen": reply_c, "rejected": reply_r},
        {"prompt": msgs, "chosen": {"role": "assistant", "content": reply_c},
         "rejected": [{"role": "assistant", "content": reply_r}]},
        {"chosen": conv_c, "rejected": conv_r},  # the shared prompt is the common start
        {"prompt": user, "chosen": conv_c, "rejected": conv_r},  # conversations that repeat the prompt
    ]
    expected = Pair(msgs, conv_c[1], conv_r[1])
    assert all(parse_pair(row) == expected for row in layouts)
    system = [{"role": "system", "content": "be brief"}, *msgs]  # a multi-message prompt stays whole
    assert parse_pair({"prompt": system, "chosen": reply_c, "rejected": reply_r}).prompt == system


@pytest.mark.parametrize("row, reason", [
    ("not json", "not_json"), ([1, 2], "not_json"),
    ({"prompt": "p", "chosen": "a"}, "missing"),
    ({"prompt": "p", "chosen": 3, "rejected": "b"}, "malformed"),
    ({"prompt": [{"role": "bot", "content": "p"}], "chosen": "a", "rejected": "b"}, "malformed"),
    ({"chosen": [{"role": "user", "content": "p"}], "rejected": [{"role": "assistant", "content": "b"}]},
     "no_prompt"),
    ({"prompt": "p", "chosen": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "x"}],
      "rejected": "b"}, "not_one_reply"),
    ({"prompt": "p", "chosen": {"role": "user", "content": "a"}, "rejected": "b"}, "not_one_reply"),
    ({"prompt": "p", "chosen": "  ", "rejected": "b"}, "empty"),
    ({"prompt": "", "chosen": "a", "rejected": "b"}, "empty"),
    ({"prompt": "p", "chosen": "same", "rejected": "same"}, "identical"),
])
def test_each_bad_row_has_its_reason(row, reason):
    with pytest.raises(BadPair) as e:
        parse_pair(json.loads(row) if row == "[1, 2]" else (None if row == "not json" else row))
    assert e.value.reason == reason


def test_bad_rows_are_left_out_counted_and_named(tmp_path, capsys):
    rng = random.Random(0)
    good = [dpo_rule.preference_pair(w, rng) for w in dpo_rule.made_up_words(150, rng)]
    bad = {3: "{oops", 10: {"prompt": "say abc, end with !", "chosen": "abc!"},
           11: {"prompt": "say abc, end with !", "chosen": "abc!", "rejected": "abc!"},
           40: {"prompt": "say abc, end with !", "chosen": "", "rejected": "abc?"},
           41: {"prompt": "say abc, end with !", "chosen": "a" * 60, "rejected": "abc?"},  # no room for the prompt
           90: {"prompt": "say abc, end with !", "chosen": "abc!", "rejected": "abc\u00e9"}}  # see below
    rows = list(good)
    for line in sorted(bad):
        rows.insert(line - 1, bad[line])
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    capsys.readouterr()
    data = prepare(path, tmp_path)
    printed = capsys.readouterr().out
    report = read_meta(data)["preference"]
    assert report["bad"] == {"not_json": 1, "missing": 1, "identical": 1, "empty": 1, "too_long": 1}
    assert report["bad_rows"] == {"not_json": ["line 3"], "missing": ["line 10"], "identical": ["line 11"],
                                  "empty": ["line 40"], "too_long": ["line 41"]}
    assert report["kept"] + report["cut"] == 151 and sum(report["pairs"].values()) == 151  # 150 good and line 90
    for reason, lines in report["bad_rows"].items():
        assert f"{BAD[reason]}: 1 ({lines[0]})" in printed
    assert "5 rows left out" in printed
    # é is in a vocabulary made from these rows; a tokenizer without it leaves such a pair out, by name
    without = Tokenizer.char_from_text("".join(c for r in good for c in r["prompt"] + r["chosen"] + r["rejected"]))
    with pytest.raises(BadPair) as e:
        render_pair(parse_pair(bad[90]), without.with_special(CHAT_SPECIALS), BLOCK, 1)
    assert e.value.reason == "unknown_char"


def test_the_shards_hold_the_pairs_as_rendered_and_the_mask_is_the_reply(pairs_data):
    rows, data = pairs_data
    tok = Tokenizer.from_meta(read_meta(data))
    rule = ValRule.for_documents(0.1, len(rows))
    by_split = {"train": [], "val": []}
    for i, row in enumerate(rows):
        by_split[rule.split(i)].append(row)
    assert {s: len(v) for s, v in by_split.items()} == read_meta(data)["preference"]["pairs"]
    for split, split_rows in by_split.items():
        pairs = Pairs(data, split)
        batch = pairs.read(np.arange(len(pairs)), BLOCK)
        B = len(pairs)
        assert batch.x.shape == batch.y.shape == (2 * B, BLOCK) and batch.x.dtype == torch.int64
        for j, row in enumerate(split_rows):
            (xc, yc), (xr, yr) = expected_rows(row, tok)
            assert batch.x[j].tolist() == xc.tolist() and batch.y[j].tolist() == yc.tolist()
            assert batch.x[B + j].tolist() == xr.tolist() and batch.y[B + j].tolist() == yr.tolist()
            # the targets are exactly the reply and its <|end|>: no prompt token, no padding
            assert tok.decode([t for t in batch.y[j].tolist() if t != -1]) == row["chosen"] + "<|end|>"
            assert tok.decode([t for t in batch.y[B + j].tolist() if t != -1]) == row["rejected"] + "<|end|>"


def test_truncation_keeps_the_end_of_the_prompt_for_both_replies(tmp_path, capsys):
    rng = random.Random(2)
    rows = [dpo_rule.preference_pair(w, rng) for w in dpo_rule.made_up_words(150, rng)]
    long_prompt = "a" * 30 + "say qoxet, end with !"
    rows[0] = {"prompt": long_prompt, "chosen": "qoxet!", "rejected": "qoxet?!"}
    data = prepare(write_jsonl(tmp_path / "p.jsonl", rows), tmp_path, "p", "--min_prompt_tokens", "8")
    assert "1 with their prompt cut" in capsys.readouterr().out
    tok = Tokenizer.from_meta(read_meta(data))
    pairs = Pairs(data, ValRule.for_documents(0.05, len(rows)).split(0))
    full = [render([{"role": "user", "content": long_prompt}, {"role": "assistant", "content": reply}], tok)[0]
            for reply in ("qoxet!", "qoxet?!")]
    cut = len(full[1]) - (BLOCK + 1)  # the longer sequence fills the block exactly
    for side, ids in enumerate(full):
        stored = pairs.dataset.window(int(pairs.starts[0, side]), int(pairs.lengths[0, side])).tolist()
        assert stored == ids[:1] + ids[1 + cut :]  # <|endoftext|>, then the prompt less its first `cut` tokens
        reply = ("qoxet!", "qoxet?!")[side]
        assert tok.decode(stored).endswith(f"say qoxet, end with !<|end|><|assistant|>{reply}<|end|>")
    # replies that leave fewer than --min_prompt_tokens of the prompt: the pair is left out
    rows[0] = {"prompt": long_prompt, "chosen": "q" * 28, "rejected": "qoxet?!"}  # 12 tokens left for it
    data = prepare(write_jsonl(tmp_path / "p2.jsonl", rows), tmp_path, "p2", "--min_prompt_tokens", "16")
    assert read_meta(data)["preference"]["bad_rows"] == {"too_long": ["line 1"]}


def test_epochs_visit_every_pair_once_and_resume_gives_the_same_batches(pairs_data):
    _, data = pairs_data
    n = len(Pairs(data, "train"))
    whole = PairLoader(data, "train", batch_size=6, block_size=BLOCK, seed=5)
    batches = [whole.next_batch() for _ in range(n // 6 + 3)]  # past one epoch
    seen = torch.cat([b.pairs for b in batches])
    assert sorted(seen[:n].tolist()) == list(range(n))  # the first n samples: every pair once
    part = PairLoader(data, "train", batch_size=6, block_size=BLOCK, seed=5)
    for _ in range(4):
        part.next_batch()
    part.prefetch()  # a batch read early is not a batch consumed
    resumed = PairLoader(data, "train", batch_size=6, block_size=BLOCK, seed=5)
    resumed.load_state_dict(part.state_dict())
    for b in batches[4:]:
        r = resumed.next_batch()
        assert torch.equal(r.x, b.x) and torch.equal(r.y, b.y) and torch.equal(r.pairs, b.pairs)
    # two ranks of 3 pairs read what one process of 6 reads, split between them
    ranks = [PairLoader(data, "train", batch_size=3, block_size=BLOCK, seed=5, rank=r, world_size=2)
             for r in (0, 1)]
    for b in batches[:3]:
        got = [ld.next_batch() for ld in ranks]
        assert torch.cat([g.pairs for g in got]).tolist() == b.pairs.tolist()
    other = PairLoader(data, "train", batch_size=6, block_size=BLOCK, seed=6).next_batch()
    assert not torch.equal(other.pairs, batches[0].pairs)
    with pytest.raises(DataError, match="seed"):
        PairLoader(data, "train", batch_size=6, block_size=BLOCK, seed=6).load_state_dict(part.state_dict())
    with pytest.raises(DataError, match="preference pairs"):
        resumed.load_state_dict({**part.state_dict(), "mode": "random"})


def test_val_pairs_are_fixed_and_each_pair_is_read_once(pairs_data):
    _, data = pairs_data
    n = len(Pairs(data, "val"))
    every = list(ValPairs(data, "val", batch_size=7, block_size=BLOCK))
    assert torch.cat([b.pairs for b in every]).tolist() == list(range(n))
    assert all(b.x.shape == (14, BLOCK) for b in every[:-1])
    fixed = list(ValPairs(data, "val", batch_size=7, block_size=BLOCK, n_batches=9))
    assert all(b.x.shape == (14, BLOCK) for b in fixed) and len(fixed) == 9  # wraps around: fixed shapes
    again = list(ValPairs(data, "val", batch_size=7, block_size=BLOCK, n_batches=9))
    assert all(torch.equal(a.x, b.x) for a, b in zip(fixed, again))
    halves = [list(ValPairs(data, "val", batch_size=7, block_size=BLOCK, rank=r, world_size=2)) for r in (0, 1)]
    assert sorted(torch.cat([b.pairs for h in halves for b in h]).tolist()) == list(range(n))


def test_block_sizes_and_dataset_kinds_are_checked(pairs_data, tmp_path):
    _, data = pairs_data
    with pytest.raises(DataError, match="--block_size 20"):
        PairLoader(data, "train", batch_size=2, block_size=20)
    longer = PairLoader(data, "train", batch_size=2, block_size=64).next_batch()  # more padding is fine
    assert longer.x.shape == (4, 64) and (longer.y[:, BLOCK:] == -1).all()
    with pytest.raises(DataError, match="preference pairs"):  # the language-model loader refuses pairs
        BatchLoader(data, "train", batch_size=2, block_size=BLOCK)
    chats = write_jsonl(tmp_path / "c.jsonl", [dpo_rule.sft_conversation(w, random.Random(0))
                                               for w in dpo_rule.made_up_words(300, random.Random(0))])
    prepare_chat.main(["--input", str(chats), "--tokenizer", "char", "--data_root", str(tmp_path), "--name", "c"])
    with pytest.raises(DataError, match="conversations .* not preference pairs"):
        Pairs(tmp_path / "c", "train")


def test_a_refused_input_leaves_the_prepared_dataset_alone(pairs_data, tmp_path, capsys):
    rows, data = pairs_data
    before = {p.name: p.read_bytes() for p in data.iterdir()}
    again = prepare(data.parent / "pairs.jsonl", data.parent, "pairs", "--val_fraction", "0.1")
    assert "nothing to do" in capsys.readouterr().out and again == data
    path = write_jsonl(tmp_path / "few.jsonl", rows[:3] + [{"prompt": "p"}])
    with pytest.raises(SystemExit) as e:
        preference.main(["--input", str(path), "--tokenizer", "char", "--out_dir", str(data),
                         "--overwrite", "true"])
    message = str(e.value)
    assert message.startswith("error: ") and "\n" not in message and "3 train and 0 val pairs" in message
    assert {p.name: p.read_bytes() for p in data.iterdir()} == before


def test_a_hub_dataset_gives_the_same_shards(pairs_data, tmp_path):
    rows, data = pairs_data
    folder = tmp_path / "hub"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", rows)  # a local dataset folder: datasets reads it as the Hub's would be
    hub = tmp_path / "from_hub"
    preference.main(["--hf_dataset", str(folder), "--tokenizer", "char", "--block_size", str(BLOCK),
                     "--out_dir", str(hub), "--val_fraction", "0.1"])
    for name in ("train_000000.bin", "val_000000.bin", "train_mask_000000.bin", "val_mask_000000.bin"):
        assert (hub / name).read_bytes() == (data / name).read_bytes()
    assert read_meta(hub)["preference"]["pairs"] == read_meta(data)["preference"]["pairs"]


def test_the_synthetic_task_holds_out_its_words_and_its_pairs_differ_in_the_mark(tmp_path):
    sft, pairs = dpo_rule.write(tmp_path, 200, 100, seed=4)
    conversations = [json.loads(line)["messages"] for line in sft.read_text().splitlines()]
    rows = [json.loads(line) for line in pairs.read_text().splitlines()]
    sft_words = {m[1]["content"][:-1] for m in conversations}
    pair_words = [r["chosen"][:-1] for r in rows]
    assert len(sft_words) == 200 and len(set(pair_words)) == 100 and not sft_words & set(pair_words)
    for r in rows:
        asked = r["prompt"][-1]
        assert r["chosen"] == r["chosen"][:-1] + asked and r["rejected"] == r["chosen"][:-1] + r["rejected"][-1]
        assert r["rejected"][-1] in dpo_rule.MARKS and r["rejected"][-1] != asked
    # in the SFT data the mark is drawn whatever the prompt asks: it follows the rule about a third of the time
    follows = sum(m[1]["content"][-1] == m[0]["content"][-1] for m in conversations) / len(conversations)
    assert 0.2 < follows < 0.5
