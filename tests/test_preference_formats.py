"""prepare/preference.py on data as people have it: bad input (a byte that is not UTF-8, an empty or all-bad
file, a byte-order mark, a huge line), each a one-line report and nothing half-written; and the layouts
preference data comes in (explicit and implicit prompts, as text or as chat messages, unpaired rows with a
label), from a file or a Hugging Face dataset, each rendered by the chat template with the loss on the reply."""

import json
import random
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import needs_gpt2_bpe

from benchmarks import dpo_rule
from gptkit.chat import prompt_ids, render
from gptkit.data.loader import BatchLoader
from gptkit.data.pairs import Pairs, unpaired_labels
from gptkit.data.prepare import preferences
from gptkit.data.prepare.pipeline import ValRule
from gptkit.data.prepare.preferences import BAD, Pair, Unpaired, fit, parse_pair, parse_unpaired, render_pair
from gptkit.data.shards import TokenDataset, read_meta
from gptkit.errors import UserError
from gptkit.objectives.dpo import DPO
from gptkit.tokenizer import CHAT_SPECIALS, Tokenizer
from prepare import preference

BLOCK = 40
USER, SYSTEM = "user", "system"


def msg(role, content):
    return {"role": role, "content": content}


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def prepare(source, root, name="p", *extra, flag="--input", block=BLOCK):
    preference.main([flag, str(source), "--tokenizer", "char", "--block_size", str(block), "--data_root", str(root),
                     "--name", name, *extra])
    return root / name


def refused(source, root, name="p", *extra):
    """prepare()'s one-line error (SystemExit), checked to be one line."""
    with pytest.raises(SystemExit) as e:
        prepare(source, root, name, *extra)
    message = str(e.value)
    assert message.startswith("error: ") and "\n" not in message
    return message


def task_pairs(n, seed=0):
    rng = random.Random(seed)
    return [dpo_rule.preference_pair(w, rng) for w in dpo_rule.made_up_words(n, rng)]


def sequences(data, split):
    """The split's sequences (each starting with <|endoftext|>) as (token ids, loss mask) lists."""
    ds = TokenDataset(data, split)
    ids = ds.window(0, len(ds)).tolist()
    mask = ds.masks.window(0, len(ds)).tolist()
    eot = read_meta(data)["eot_id"]
    starts = [i for i, t in enumerate(ids) if t == eot] + [len(ids)]
    return [(ids[a:b], mask[a:b]) for a, b in zip(starts, starts[1:])]


# ----------------------------------------------------------------------------------------------------------
# Bad input


def test_a_line_that_is_not_utf8_is_counted_and_named(tmp_path, capsys):
    rows = task_pairs(150)
    lines = [json.dumps(r).encode() for r in rows]
    lines.insert(6, b'{"prompt":"caf\xe9","chosen":"a","rejected":"b"}')  # Latin-1, not UTF-8: line 7
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    data = prepare(path, tmp_path)
    assert f"{BAD['not_utf8']}: 1 (line 7)" in capsys.readouterr().out
    report = read_meta(data)["preference"]
    assert report["bad_rows"] == {"not_utf8": ["line 7"]} and sum(report["pairs"].values()) == 150
    # the one-line file: the report, then one line saying no pair could be used; no folder left behind
    one = tmp_path / "x.jsonl"
    one.write_bytes(b'{"prompt":"caf\xe9","chosen":"a","rejected":"b"}\n')
    message = refused(one, tmp_path, "x")
    assert f"{BAD['not_utf8']}: 1 (line 1)" in capsys.readouterr().out
    assert "no usable preference pair in" in message and "all 1 rows were left out" in message
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("tokenizer", ["char", pytest.param("gpt2", marks=needs_gpt2_bpe)])
def test_an_empty_or_all_bad_file_reports_its_rows_then_says_no_pair_was_usable(tmp_path, capsys, tokenizer):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"\n  \n")
    bad = write_jsonl(tmp_path / "bad.jsonl", ["{oops", {"prompt": "p", "chosen": "a"}, {"prompt": "p",
                                               "chosen": "same", "rejected": "same"}, [1, 2]])
    for path, name in ((empty, "empty"), (bad, "bad")):
        with pytest.raises(SystemExit) as e:
            preference.main(["--input", str(path), "--tokenizer", tokenizer, "--data_root", str(tmp_path),
                             "--name", name])
        message, printed = str(e.value), capsys.readouterr().out
        assert "\n" not in message and "vocabulary" not in message
        assert not (tmp_path / name).exists()  # nothing half-written that a later run could take as prepared
        if path is empty:
            assert "holds no rows" in message and "left out" not in printed
        else:
            assert "no usable preference pair" in message and "all 4 rows were left out" in message
            for reason, line in (("not_json", "line 1, line 4"), ("missing", "line 2"), ("identical", "line 3")):
                assert f"{BAD[reason]}: {len(line.split(','))} ({line})" in printed


def test_a_byte_order_mark_before_line_one_is_skipped(tmp_path):
    rows = task_pairs(150, seed=3)
    plain = write_jsonl(tmp_path / "plain.jsonl", rows)
    marked = tmp_path / "marked.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())  # what Windows editors write as "UTF-8"
    a, b = prepare(plain, tmp_path, "plain"), prepare(marked, tmp_path, "marked")
    assert read_meta(b)["preference"]["bad"] == {} and read_meta(b)["preference"]["pairs"] == \
        read_meta(a)["preference"]["pairs"]
    for split in ("train", "val"):
        assert sequences(a, split) == sequences(b, split)


def test_a_huge_line_is_length_checked_before_it_is_tokenised(tmp_path, monkeypatch, capsys):
    huge = 3_000_000  # characters: a few MB, far past any context; tokenised whole it would take ~100 MB
    rows = task_pairs(150, seed=5)
    rows.insert(5, {"prompt": "say abc, end with !", "chosen": "a" * huge, "rejected": "abc?"})  # line 6
    rows.insert(9, {"prompt": "b" * huge + "say abc, end with !", "chosen": "abc!", "rejected": "abc?"})  # line 10
    path = write_jsonl(tmp_path / "big.jsonl", rows)
    longest = []
    encode = Tokenizer.encode
    monkeypatch.setattr(Tokenizer, "encode", lambda self, text: longest.append(len(text)) or encode(self, text))
    tracemalloc.start()
    try:
        data = prepare(path, tmp_path, "big", "--min_prompt_tokens", "4")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # nothing longer than what the context holds was ever tokenised, and memory stayed near one line's size
    # (the line as text, then as the parsed row: ~2x; tokenised whole, its ids alone would take 8 bytes a character)
    assert max(longest) <= BLOCK + 1 and peak < 4 * huge
    assert f"{BAD['too_long']}: 1 (line 6)" in capsys.readouterr().out  # a reply that can never fit: left out
    report = read_meta(data)["preference"]
    assert report["bad_rows"] == {"too_long": ["line 6"]} and report["cut"] == 1  # the long prompt: cut, kept
    tok = Tokenizer.from_meta(read_meta(data))
    cut = [ids for split in ("train", "val") for ids, _ in sequences(data, split) if tok.decode(ids[1:3]) == "bb"]
    assert [len(ids) for ids in cut] == [BLOCK + 1] * 2
    for ids, reply in zip(cut, ("abc!", "abc?")):
        assert tok.decode(ids).endswith(f"bbsay abc, end with !<|end|><|assistant|>{reply}<|end|>")


@pytest.mark.parametrize("kind", ["char", pytest.param("gpt2", marks=needs_gpt2_bpe)])
def test_fitting_before_tokenising_changes_no_token(shakespeare_path, kind):
    """A long prompt tokenised only as far as the cut can keep gives the very ids of the whole prompt cut (with
    GPT-2's BPE: on real text)."""
    text = shakespeare_path.read_text(encoding="utf-8")[:60_000]
    pair = Pair([msg(SYSTEM, text[:20_000]), msg(USER, text[20_000:])], msg("assistant", "Ay, my lord."),
                msg("assistant", "No."))
    base = Tokenizer.char_from_text(text + "Ay, my lord.No.") if kind == "char" else Tokenizer.tiktoken("gpt2")
    tok = base.with_special(CHAT_SPECIALS)
    per_token = preferences.chars_per_token(tok)
    assert per_token == (1 if kind == "char" else max(len(b) for b in tok.ranks))
    for block in (64, 300):
        fitted = fit(pair, block, per_token)
        assert sum(len(m["content"]) for m in fitted.prompt) <= (block + 1) * per_token < len(text)
        whole, short = render_pair(pair, tok, block, 4), render_pair(fitted, tok, block, 4)
        assert short.sequences == whole.sequences and short.cut > 0
    # a reply longer than block_size + 1 tokens could ever be is refused unread
    with pytest.raises(preferences.BadPair) as e:
        fit(Pair(pair.prompt, msg("assistant", "x" * (65 * per_token + 1)), pair.rejected), 64, per_token)
    assert e.value.reason == "too_long"


# ----------------------------------------------------------------------------------------------------------
# The layouts


def layouts(row):
    """One of the task's pairs in each layout TRL documents for preference data."""
    p, c, r = row["prompt"], row["chosen"], row["rejected"]
    prompt = [msg(SYSTEM, "Answer with one word."), msg(USER, "hello"), msg("assistant", "hi"), msg(USER, p)]
    return {
        "explicit text": ({"prompt": p, "chosen": c, "rejected": r}, [msg(USER, p)]),
        "explicit messages": ({"prompt": prompt, "chosen": [msg("assistant", c)], "rejected": [msg("assistant", r)]},
                              prompt),
        "implicit messages": ({"chosen": [*prompt, msg("assistant", c)], "rejected": [*prompt, msg("assistant", r)]},
                              prompt),
        "implicit text": ({"chosen": f"{p} {c}", "rejected": f"{p} {r}"}, [msg(USER, p + " ")]),
    }


@pytest.mark.parametrize("layout", ["explicit text", "explicit messages", "implicit messages", "implicit text"])
def test_each_pair_layout_is_rendered_by_the_chat_template_with_the_loss_on_the_reply(tmp_path, layout):
    pairs = task_pairs(120, seed=7)
    rows = [layouts(row)[layout][0] for row in pairs]
    data = prepare(write_jsonl(tmp_path / "p.jsonl", rows), tmp_path, block=100)  # room for the system prompt
    tok = Tokenizer.from_meta(read_meta(data))
    rule = ValRule.for_documents(0.05, len(rows))
    for split in ("train", "val"):
        got = sequences(data, split)
        mine = [row for i, row in enumerate(pairs) if rule.split(i) == split]
        assert len(got) == 2 * len(mine)
        for j, row in enumerate(mine):
            prompt = layouts(row)[layout][1]
            head = len(prompt_ids(prompt, tok))
            for (ids, mask), reply in zip(got[2 * j : 2 * j + 2], (row["chosen"], row["rejected"])):
                expected, _ = render([*prompt, msg("assistant", reply)], tok)
                assert ids == expected and mask == [0] * head + [1] * (len(ids) - head)
                # the loss: the reply and its <|end|>, never the prompt's own assistant turn ("hi")
                assert tok.decode([t for t, m in zip(ids, mask) if m]) == reply + "<|end|>"


def test_the_layouts_parse_to_the_same_pair_and_unpaired_rows_to_their_completion():
    row = task_pairs(1)[0]
    for raw, prompt in layouts(row).values():
        assert parse_pair(raw) == Pair(prompt, msg("assistant", row["chosen"]), msg("assistant", row["rejected"]))
    assert parse_pair({"chosen": "The sky is blue.", "rejected": "The sky is green."}) == \
        Pair([msg(USER, "The sky is ")], msg("assistant", "blue."), msg("assistant", "green."))
    conv = [msg(SYSTEM, "s"), msg(USER, "q")]
    assert parse_unpaired({"prompt": "q", "completion": "a", "label": True}) == \
        Unpaired([msg(USER, "q")], msg("assistant", "a"), True)
    assert parse_unpaired({"prompt": conv, "completion": [msg("assistant", "a")], "label": False}) == \
        Unpaired(conv, msg("assistant", "a"), False)
    assert parse_unpaired({"prompt": conv, "completion": [*conv, msg("assistant", "a")], "label": 1}).label is True
    for bad, reason in [({"chosen": "4.", "rejected": "5."}, "no_prompt"),  # texts that share no word
                        ({"prompt": "q", "completion": "a"}, "no_label"),
                        ({"prompt": "q", "completion": "a", "label": "yes"}, "bad_label"),
                        ({"completion": "a", "label": True}, "no_prompt"),
                        ({"prompt": "q", "completion": [msg(USER, "a")], "label": True}, "not_one_reply")]:
        with pytest.raises(preferences.BadPair) as e:
            (parse_unpaired if "label" in bad or "completion" in bad else parse_pair)(bad)
        assert e.value.reason == reason


def unpaired_rows(n, seed=0):
    """The task as unpaired rows: each word's asked-for mark (desirable) or another (undesirable), half as
    chat messages."""
    rows = []
    for i, row in enumerate(task_pairs(n, seed)):
        good = i % 3 != 0
        reply = row["chosen"] if good else row["rejected"]
        if i % 2:
            rows.append({"prompt": [msg(USER, row["prompt"])], "completion": [msg("assistant", reply)], "label": good})
        else:
            rows.append({"prompt": row["prompt"], "completion": reply, "label": good})
    return rows


def test_unpaired_rows_make_their_own_kind_of_dataset_which_dpo_refuses(tmp_path, capsys):
    rows = unpaired_rows(240)
    rows.insert(3, {"prompt": "say abc, end with !", "completion": "abc!"})  # line 4: no label
    data = prepare(write_jsonl(tmp_path / "u.jsonl", rows), tmp_path, "u")
    assert "unpaired rows: 240 kept (160 desirable, 80 undesirable" in capsys.readouterr().out
    meta = read_meta(data)
    report = meta["preference"]
    assert report["format"] == "unpaired" and report["bad_rows"] == {"no_label": ["line 4"]}
    assert report["labels"] == {"desirable": 160, "undesirable": 80} and sum(report["rows"].values()) == 240
    tok = Tokenizer.from_meta(meta)
    rule = ValRule.for_documents(0.05, len(rows))
    for split in ("train", "val"):
        mine = [r for i, r in enumerate(rows) if rule.split(i) == split and "label" in r]
        assert unpaired_labels(data, split).tolist() == [r["label"] for r in mine]
        got = sequences(data, split)
        assert len(got) == len(mine)
        for (ids, mask), r in zip(got, mine):
            reply = r["completion"] if isinstance(r["completion"], str) else r["completion"][0]["content"]
            prompt = r["prompt"] if isinstance(r["prompt"], str) else r["prompt"][0]["content"]
            assert ids == render([msg(USER, prompt), msg("assistant", reply)], tok)[0]
            assert tok.decode([t for t, m in zip(ids, mask) if m]) == reply + "<|end|>"
    # DPO (train.py's dataset check, eval.py's pairs) and the next-token loader refuse it, in one line
    for refuse in (lambda: DPO(SimpleNamespace(objective="dpo")).check_dataset(meta, "u"),
                   lambda: Pairs(data, "train")):
        with pytest.raises(UserError, match=r"holds unpaired rows .* not pairs: train on them with --objective=kto") as e:
            refuse()
        assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="preference"):
        BatchLoader(data, "train", batch_size=2, block_size=BLOCK)
    with pytest.raises(UserError, match="no unpaired rows"):
        unpaired_labels(prepare(write_jsonl(tmp_path / "p.jsonl", task_pairs(150)), tmp_path, "pairs"), "train")


def test_a_file_mixing_pairs_and_unpaired_rows_is_refused_naming_the_line(tmp_path):
    rows = task_pairs(150)
    rows.insert(1, "{oops")  # line 2: a bad row of no kind, counted as usual
    rows.insert(6, unpaired_rows(1)[0])  # line 7
    message = refused(write_jsonl(tmp_path / "mixed.jsonl", rows), tmp_path, "mixed")
    assert "line 7 is an unpaired row (prompt, completion, label), but line 1 is a pair" in message
    assert not (tmp_path / "mixed").exists()
    unpaired = unpaired_rows(150)
    unpaired.insert(2, task_pairs(1)[0])  # the other way round: line 3
    message = refused(write_jsonl(tmp_path / "mixed2.jsonl", unpaired), tmp_path, "mixed2")
    assert "line 3 is a pair (prompt, chosen, rejected), but line 1 is an unpaired row" in message


def test_a_hub_dataset_of_messages_and_labels_reads_as_its_file_does(tmp_path):
    pytest.importorskip("datasets")
    rows = [r for r in unpaired_rows(480, seed=2) if isinstance(r["prompt"], list)]  # one schema per dataset
    folder = tmp_path / "hub"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", rows)  # a local dataset folder: datasets reads it as the Hub's would be
    from_file = prepare(folder / "train.jsonl", tmp_path, "file")
    from_hub = prepare(folder, tmp_path, "hub", flag="--hf_dataset")
    for split in ("train", "val"):
        assert sequences(from_hub, split) == sequences(from_file, split)
        assert unpaired_labels(from_hub, split).tolist() == unpaired_labels(from_file, split).tolist()


def test_a_hub_dataset_offline_says_what_to_download_where(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    from gptkit.data.prepare import hub

    monkeypatch.setattr(hub, "hub_unreachable", lambda: "huggingface.co: no network")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    with pytest.raises(SystemExit) as e:
        preference.main(["--hf_dataset", "someone/prefs", "--tokenizer", "char", "--data_root", str(tmp_path)])
    message = str(e.value)
    assert "\n" not in message and "cannot reach the Hugging Face Hub (huggingface.co: no network)" in message
    assert "https://huggingface.co/datasets/someone/prefs" in message and "give that folder" in message
    assert not (tmp_path / "prefs").exists()


def test_a_lone_surrogate_is_a_bad_row_not_a_broken_vocabulary(tmp_path, capsys):
    rows = task_pairs(150, seed=9)
    rows.insert(2, '{"prompt": "say abc, end with !", "chosen": "abc\\ud800", "rejected": "abc?"}')  # line 3
    data = prepare(write_jsonl(tmp_path / "s.jsonl", rows), tmp_path)
    assert read_meta(data)["preference"]["bad_rows"] == {"not_text": ["line 3"]}
    assert f"{BAD['not_text']}: 1 (line 3)" in capsys.readouterr().out
    assert np.all(np.array([ord(c) for c in read_meta(data)["tokenizer"]["chars"]]) < 0xD800)


def test_the_readmes_example_rows_read_as_it_says():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    table = readme[readme.index("| layout | one row |"):].split("\n\n")[0].splitlines()[2:]
    examples = {line.split("|")[1].strip(): json.loads(line.split("`")[1]) for line in table}
    assert len(examples) == 5
    for layout, row in examples.items():
        kind = preferences.row_kind(row)
        assert kind == (preferences.UNPAIRED if layout.startswith("unpaired") else preferences.PAIRS)
        item = preferences.PARSERS[kind](row)
        assert item.prompt[-1]["role"] == "user" and all(r["role"] == "assistant" for r in item.replies)
