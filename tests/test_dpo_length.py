"""benchmarks/dpo_length.py, the preference task where length alone decides: its pairs are two right replies
that nothing but their length tells apart (rules blind to the prompt and to length score about 50%), and its
--train table at a tiny scale (the recipe's commands run in this process), with the pair scores it prints
against a direct computation."""

import json

import numpy as np
import pytest
import torch
from conftest import torch_threads, train_script

from benchmarks import dpo_length, preference_recipe
from gptkit.checkpoint import load_model
from gptkit.data.pairs import Pairs
from prepare import chat as prepare_chat
from prepare import preference
from tests.test_dpo import direct_logps


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def score(rule, rows) -> float:
    """The share of pairs a rule (chosen, rejected) -> 1 chosen first, 0 a tie, -1 rejected first gets right,
    ties counted as half."""
    return sum({1: 1.0, 0: 0.5, -1: 0.0}[rule(r["chosen"], r["rejected"])] for r in rows) / len(rows)


def sign(a, b) -> int:
    return (a > b) - (a < b)


# rules that see neither the prompt nor the replies' lengths
BLIND = {"the earlier last letter": lambda c, r: sign(r[-1], c[-1]),
         "the more vowels per letter": lambda c, r: sign(vowels(c), vowels(r)),
         "the lower mean letter": lambda c, r: sign(mean_letter(r), mean_letter(c)),
         "the earlier last word": lambda c, r: sign(r.split()[-1], c.split()[-1])}


def vowels(text: str) -> float:
    letters = text.replace(" ", "")
    return sum(ch in "aeiou" for ch in letters) / len(letters)


def mean_letter(text: str) -> float:
    letters = text.replace(" ", "")
    return sum(map(ord, letters)) / len(letters)


def test_only_the_length_tells_the_replies_apart(tmp_path):
    """Both replies of every pair are right answers (the prompt's first words), the shorter the start of the
    longer; shorter.jsonl chooses the shorter of every pair and longer.jsonl holds the same pairs flipped; the
    word counts of the chosen replies in one are those of the rejected in the other, every count from 1 to 5
    on both sides; and rules blind to the prompt and to length score 50% +- 4 points (2,000 pairs: a 50% rule
    stays within 4 points but about once in 10,000). The SFT conversations are right replies of every count."""
    files = dpo_length.write(tmp_path, 500, 2000, seed=3)
    shorter, longer = ([json.loads(line) for line in files[v].read_text().splitlines()] for v in dpo_length.VARIANTS)
    assert len(shorter) == len(longer) == 2000 and len({r["prompt"] for r in shorter}) == 2000
    for s, lg in zip(shorter, longer, strict=True):
        assert (s["prompt"], s["chosen"], s["rejected"]) == (lg["prompt"], lg["rejected"], lg["chosen"])
        assert dpo_length.is_right(s["prompt"], s["chosen"]) and dpo_length.is_right(s["prompt"], s["rejected"])
        assert len(s["chosen"]) < len(s["rejected"]) and s["rejected"].startswith(s["chosen"] + " ")
    counts = [len(r["chosen"].split()) for r in shorter] + [len(r["rejected"].split()) for r in shorter]
    assert set(counts) == {1, 2, 3, 4, 5}
    assert score(lambda c, r: sign(len(r), len(c)), shorter) == 1.0  # the length rule: the variant's definition
    for name, rule in BLIND.items():
        for rows in (shorter, longer):
            assert abs(score(rule, rows) - 0.5) < 0.04, name
    sft = [json.loads(line)["messages"] for line in files["sft"].read_text().splitlines()]
    assert all(dpo_length.is_right(m[0]["content"], m[1]["content"]) for m in sft)
    assert {len(m[1]["content"].split()) for m in sft} == {1, 2, 3, 4, 5}
    assert not dpo_length.is_right("first few: abc def ghi", "abc ghi")  # not the first words
    assert not dpo_length.is_right("first few: abc def ghi", "")


def in_process(cmd: list[str]) -> float:
    """preference_recipe.run's commands (python SCRIPT ARGS) run by the script's main in this process."""
    script, args = cmd[1], cmd[2:]
    mains = {"train.py": train_script().main, "prepare/chat.py": prepare_chat.main,
             "prepare/preference.py": preference.main}
    mains[script](args)
    return 0.0


def test_the_table_at_a_tiny_scale(tmp_path, monkeypatch, capsys):
    """--train end to end at a tiny scale (the recipe's commands in this process): one table per variant, its
    columns, a row for the chat model and one per loss; the chat model against itself ties every pair (no
    accuracy, "-"); every other cell a figure. And the pair scores the table is made of equal a direct
    computation from the two models' full logits: the summed and the per-token implicit reward's accuracy,
    the chosen and rejected replies' log-probabilities."""
    monkeypatch.setattr(preference_recipe, "run", in_process)
    out = tmp_path / "run"
    dpo_length.main(["--out", str(out), "--train", "--sft", "300", "--pairs", "60", "--sft_steps", "4",
                     "--dpo_steps", "2", "--losses", "sigmoid", "--chat_prompts", "3",
                     "--max_new_tokens", "8"])
    said = capsys.readouterr().out
    table = said[said.index("shorter reply preferred"):].splitlines()
    header = "| model | " + " | ".join(name for name, _ in dpo_length.COLUMNS) + " |"
    assert [line for line in table if line.startswith("| model")] == [header, header]
    assert any(line.startswith("longer reply preferred") for line in table)
    rows = [line.strip("|").split("|") for line in table if line.startswith("| ") and line != header]
    assert [r[0].strip() for r in rows] == ["SFT", "sigmoid"] * 2
    for row in rows:
        cells = [c.strip() for c in row[1:]]
        assert len(cells) == len(dpo_length.COLUMNS)
        for (name, _), c in zip(dpo_length.COLUMNS, cells):
            if row[0].strip() == "SFT" and name in ("summed", "per token"):
                assert c == "-"
            else:
                float(c.rstrip("%"))

    # the scores against a direct computation, for the sigmoid run on the longer-preferred pairs
    data, sft, tuned = out / "data" / "longer", out / "sft", out / "longer_sigmoid" / "last.pt"
    got = dpo_length.pair_scores(tuned, sft, data)
    pairs = Pairs(data, "val")
    batch = pairs.read(np.arange(len(pairs)), dpo_length.BLOCK, "cpu")
    B = len(batch)

    with torch.no_grad():
        pi, rho = (direct_logps(load_model(str(ckpt))[0], batch.x, batch.y) for ckpt in (tuned, sft))
    n = (batch.y != -1).sum(-1)
    summed = ((pi - rho)[:B] - (pi - rho)[B:])
    per_token = ((pi - rho) / n)[:B] - ((pi - rho) / n)[B:]
    assert got["summed"] == pytest.approx(float((summed > 0).double().mean()))
    assert got["per token"] == pytest.approx(float((per_token > 0).double().mean()))
    assert got["likelier"] == pytest.approx(float((pi[:B] > pi[B:]).double().mean()))
    assert got["chosen"] == pytest.approx(float(pi[:B].mean()), rel=1e-5)
    assert got["rejected"] == pytest.approx(float(pi[B:].mean()), rel=1e-5)
