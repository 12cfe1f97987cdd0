"""What a stopped run prints to continue it works as printed, for every objective: next-token from scratch, a
chat fine-tune, LoRA and DPO, each started from a config file whose block_size (1024, as the README's recipes
say) is more than the run trains with (its base's context, its data's longest pair). Each run is stopped in its
step-2 evaluation (as a SIGTERM then does), and the printed `continue with:` line is run as it stands."""

import shlex

import pytest
from conftest import make_char_dataset, tiny_args, torch_threads, train_script
from test_chat_finetune import write_conversations

from gptkit.checkpoint import load_checkpoint
from gptkit.run import rerun_command
from prepare import chat as prepare_chat
from tests.test_dpo_train import dpo_args, task  # noqa: F401  (task: the DPO fixture, a chat model and its pairs)

train = train_script()


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A char model of 32 positions (3 steps), its text dataset, and conversations prepared in its tokens."""
    root = tmp_path_factory.mktemp("continue")
    text = make_char_dataset(root / "data" / "text", n_chars=20_000)
    with torch_threads(1):
        train.main(tiny_args(text, root / "base", max_iters=3, eval_interval=3))
    prepare_chat.main(["--input", str(write_conversations(root / "chats.jsonl", n=300)), "--tokenizer",
                       str(root / "base"), "--block_size", "32", "--data_root", str(root / "data"), "--name", "chat"])
    return root


def stopped_at_the_second_evaluation(monkeypatch):
    """The second evaluation (step 2) is cut short, as a SIGTERM during it does: the run saves step 2 and
    prints its continue line."""
    real, calls = train.evaluate, []

    def evaluate(*args, **kwargs):
        calls.append(1)
        return None if len(calls) == 2 else real(*args, **kwargs)

    monkeypatch.setattr(train, "evaluate", evaluate)


def recipe(tmp_path, **values) -> str:
    path = tmp_path / "recipe.py"
    path.write_text("".join(f"{k} = {v!r}\n" for k, v in values.items()))
    return str(path)


def run_args(kind, base, task, out):  # noqa: F811
    short = dict(max_iters=4, eval_interval=2, eval_iters=2, warmup_iters=1, lr_decay_iters=4)
    if kind == "dpo":
        return dpo_args(task, out, **short)
    over = {} if kind == "next-token" else dict(init_from=base / "base", dataset=base / "data" / "chat")
    if kind == "lora":
        over.update(lora_rank=4, lora_dropout=0.0)
    args = tiny_args(base / "data" / "text", out, gradient_accumulation_steps=1, dropout=0.0, **short, **over)
    if kind != "next-token":  # the fine-tune's shape is its base's
        args = [a for a in args if not a.startswith(("--block_size", "--n_layer", "--n_head", "--n_embd"))]
    return args


@pytest.mark.parametrize("kind", ["next-token", "chat", "lora", "dpo"])
def test_the_printed_continue_line_continues_the_run(kind, base, task, tmp_path, monkeypatch, capsys):  # noqa: F811
    out = tmp_path / "out"
    config = recipe(tmp_path, block_size=32 if kind == "next-token" else 1024)
    stopped_at_the_second_evaluation(monkeypatch)
    with pytest.raises(SystemExit):
        train.main([config, *run_args(kind, base, task, out)])
    said = capsys.readouterr().out
    assert f"stopped at step 2; {out}/last.pt holds it; continue with: " in said
    line = said.split("continue with: ")[1].splitlines()[0]
    assert line.startswith(f"python train.py {config} ") and line.endswith(" --init_from=resume")
    trained = load_checkpoint(out / "last.pt")["config"]["block_size"]
    if kind != "next-token":
        assert trained < 1024  # the base's context, or the longest pair: fitted, not the config file's

    monkeypatch.undo()
    summary = train.main(shlex.split(line)[2:])  # as printed
    said = capsys.readouterr().out
    assert f"resumed from step 2 of {out}/last.pt" in said
    assert summary["step"] == 4 and "done at step 4" in said
    assert load_checkpoint(out / "last.pt")["config"]["block_size"] == trained


def test_the_continue_line_drops_a_block_size_the_run_fitted():
    argv = ["recipe.py", "--block_size", "1024", "--init_from", "out-chat", "--learning_rate=1e-4"]
    assert rerun_command(argv, resume=True, block_size=39) == (
        "python train.py recipe.py --learning_rate=1e-4 --init_from=resume")
    assert rerun_command(argv, resume=True, block_size=1024) == (
        "python train.py recipe.py --block_size 1024 --learning_rate=1e-4 --init_from=resume")
    assert rerun_command(argv) == "python train.py " + " ".join(argv)  # to start again: as typed
