"""A golden loss record: short fixed CPU fp32 runs of each recipe, their per-step losses compared to the ones
stored in tests/assets/golden_loss.json. A change that moves the numbers (an initialisation, a schedule, a
kernel, an optimizer detail) fails here instead of drifting silently. When a change is meant to move them,
re-record on purpose and say so in the commit message:

    python -m tests.test_golden_loss --record          # from the repository root
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
RECORD = REPO / "tests" / "assets" / "golden_loss.json"
STEPS = 25
# Tight enough that a 0.5% change of the initialisation's std fails (measured: it moves these losses by up to
# 4e-4 and 6e-4, relative), loose enough for another CPU's float rounding (vectorised kernels' summation order).
RTOL = 2e-5

COMMON = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=8, gradient_accumulation_steps=1,
              max_iters=STEPS, lr_decay_iters=STEPS, warmup_iters=5, eval_interval=1000, eval_iters=1,
              log_interval=1, dropout=0.0, device="cpu", dtype="float32", compile=False, seed=1337)
RECIPES = {
    "gpt2_adamw": dict(learning_rate=3e-3, min_lr=3e-4, optimizer="adamw"),
    "modern_muon": dict(arch="modern", optimizer="muon", lr_schedule="wsd", learning_rate=3e-3, min_lr=3e-4,
                        muon_lr=0.02),
}


def corpus(n_chars: int = 30_000) -> str:
    """Sentences over a small word list, drawn by a fixed linear congruential generator: the same text on every
    machine and every version of every library (no NumPy stream involved)."""
    words = ["the", "king", "queen", "shall", "speak", "to", "my", "lord", "and", "thou", "art", "good", "sir"]
    state, parts, size = 12345, [], 0

    def draw(n: int) -> int:
        nonlocal state
        state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
        return (state >> 33) % n

    while size < n_chars:
        sentence = " ".join(words[draw(len(words))] for _ in range(3 + draw(6))) + ".\n"
        parts.append(sentence)
        size += len(sentence)
    return "".join(parts)


def run_recipe(name: str, workdir: Path) -> list[float]:
    """The per-step training losses of one recipe's fixed run (one thread: one summation order)."""
    from tests.conftest import train_script

    train = train_script()
    from gptkit.tokenizer import Tokenizer
    from tests.conftest import write_dataset  # (as a package path: this file also runs as a module, --record)

    data = workdir / "data"
    if not (data / "meta.json").is_file():
        text = corpus()
        write_dataset(data, text, Tokenizer.char_from_text(text))
    out = workdir / name
    args = {**COMMON, **RECIPES[name], "dataset": str(data), "out_dir": str(out), "overwrite": True}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train.main([f"--{k}={v}" for k, v in args.items()])
    finally:
        torch.set_num_threads(threads)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [m["loss"] for m in lines if "loss" in m]


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_losses_match_the_record(name, tmp_path):
    record = json.loads(RECORD.read_text())
    got = run_recipe(name, tmp_path)
    want = record["losses"][name]
    assert len(got) == len(want) == STEPS
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
    assert worst <= RTOL, (f"{name}: per-step losses moved from tests/assets/golden_loss.json (worst relative "
                           f"difference {worst:.2e}; first steps now {got[:3]}, recorded {want[:3]}); if the "
                           f"change is meant to move them: python -m tests.test_golden_loss --record")


def test_the_record_notices_a_half_percent_change_of_the_init(tmp_path, monkeypatch):
    """The point of the record: a small change of the numerics is caught. Here every normal_ init draws with
    a 0.5% larger std, and the GPT-2 recipe's losses leave the tolerance."""
    real = torch.nn.init.normal_
    # (named as torch names it: on the meta device, as the run's memory check builds its model, it is passed by name)
    monkeypatch.setattr(torch.nn.init, "normal_",
                        lambda tensor, mean=0.0, std=1.0, **kw: real(tensor, mean, std * 1.005, **kw))
    got = run_recipe("gpt2_adamw", tmp_path)
    want = json.loads(RECORD.read_text())["losses"]["gpt2_adamw"]
    assert max(abs(g - w) / abs(w) for g, w in zip(got, want)) > RTOL


def record() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        losses = {name: run_recipe(name, Path(tmp)) for name in sorted(RECIPES)}
    RECORD.parent.mkdir(exist_ok=True)
    RECORD.write_text(json.dumps({"steps": STEPS, "torch": str(torch.__version__), "losses": losses}, indent=1) + "\n")
    print(f"recorded {RECORD.relative_to(REPO)}: {', '.join(f'{k} {v[0]:.4f} -> {v[-1]:.4f}' for k, v in losses.items())}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python -m tests.test_golden_loss --record   (re-records tests/assets/golden_loss.json)")
    record()
