"""What a new user meets walking the README: the messages that say what happened and what to run next, the
checks that come before the work instead of after it, and the exports and scripts that behave as elsewhere.
Each test is one finding of that walk, on tiny data (README's chat recipe: tests/test_readme_recipes.py)."""

import io
import json
import os
import re
import socket
import sys
from pathlib import Path

import pytest
import torch
from conftest import needs_gpt2_bpe, tiny_args, torch_threads, train_script, write_dataset

from gptkit import metrics, network, run
from gptkit.checkpoint import save_checkpoint
from gptkit.config import TrainConfig
from gptkit.optim import get_lr
from gptkit.options import ConfigError, build_config
from gptkit.tokenizer import CHAT_SPECIALS, Tokenizer
from model import GPT, GPTConfig

train = train_script()


def walk_args(data, out, **over):
    """The suite's tiny run (conftest.tiny_args), 4 steps without accumulation: what a newcomer's first run does,
    smaller."""
    return tiny_args(data, out, **{"gradient_accumulation_steps": 1, "max_iters": 4, "eval_interval": 2,
                                   "eval_iters": 2, "warmup_iters": 1, "lr_decay_iters": 4, "dropout": 0.0, **over})


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def stopped_in_evaluation(monkeypatch):
    """Every evaluation is cut short, as a SIGTERM during it does (train.evaluate returns None then)."""
    monkeypatch.setattr(train, "evaluate", lambda *args, **kwargs: None)


# ----------------------------------------------------------------------------- stopping and resuming


def test_a_stop_before_the_first_step_says_that_nothing_was_saved(char_dataset, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    stopped_in_evaluation(monkeypatch)
    with pytest.raises(SystemExit) as e:
        train.main(walk_args(char_dataset, out))
    assert e.value.code == 143
    said = capsys.readouterr().out
    assert "stopped at step 0, before the first step finished: nothing was saved" in said
    assert "saved" not in said.replace("nothing was saved", "")
    assert not (out / "last.pt").exists()
    command = said.split("start again with: ")[1].splitlines()[0]
    assert command.startswith("python train.py --dataset=") and "--init_from" not in command


def test_a_stop_of_a_resumed_run_says_what_to_run_next(char_dataset, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    train.main(walk_args(char_dataset, out, max_iters=2))
    stopped_in_evaluation(monkeypatch)
    with pytest.raises(SystemExit):
        train.main(["--init_from", "resume", *walk_args(char_dataset, out, max_iters=4, lr_decay_iters=4)])
    said = capsys.readouterr().out
    command = said.split("continue with: ")[1].splitlines()[0]
    assert f"stopped at step 2; {out}/last.pt holds it" in said
    assert command.startswith("python train.py --dataset=") and "--max_iters=4" in command
    assert command.endswith(" --init_from=resume") and command.count("--init_from") == 1  # "--init_from resume": gone


def test_a_resumed_run_says_when_its_schedule_ends_before_max_iters(char_dataset, tmp_path, capsys):
    out = tmp_path / "out"
    train.main(walk_args(char_dataset, out, max_iters=2, lr_decay_iters=2))
    capsys.readouterr()
    train.main(walk_args(char_dataset, out, init_from="resume", max_iters=4, lr_decay_iters=2))
    assert "note: max_iters" not in capsys.readouterr().out  # lr_decay_iters set on the command line: meant
    args = [a for a in walk_args(char_dataset, out, init_from="resume", max_iters=6) if "lr_decay" not in a]
    train.main(args)
    said = capsys.readouterr().out
    assert ("note: max_iters is 6 but lr_decay_iters stays the checkpoint's 2: from step 2 on the learning rate "
            "stays at min_lr (0.0003); to decay over the longer run, add --lr_decay_iters=6") in said


def test_resuming_a_finished_run_says_why_nothing_trains(char_dataset, tmp_path, capsys):
    out = tmp_path / "out"
    train.main(walk_args(char_dataset, out, max_iters=2, lr_decay_iters=2))
    capsys.readouterr()
    assert train.main(walk_args(char_dataset, out, init_from="resume", max_iters=2, lr_decay_iters=2))["step"] == 2
    assert f"note: {out}/last.pt is at step 2, and max_iters is 2: the run is finished" in capsys.readouterr().out


def test_a_finished_run_says_where_its_checkpoints_are(char_dataset, tmp_path, capsys):
    out = tmp_path / "out"
    train.main(walk_args(char_dataset, out))
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("done at step 4") and f"checkpoints in {out}/: best.pt, last.pt" in last
    assert last.endswith(f"python sample.py --ckpt {out}/")


# ----------------------------------------------------------------------------- checks before the work


def test_a_changed_tokenizer_folder_is_an_error_before_the_first_step(tmp_path, capsys):
    from gptkit import bpe

    text = " ".join(["the king shall speak to my lord and thou art good sir"] * 400)
    folder, _ = bpe.save(bpe.train(iter([text]), 300, CHAT_SPECIALS, "tok"), tmp_path / "tokenizers")
    data = write_dataset(tmp_path / "mine", text, Tokenizer.from_folder(folder))
    info = json.loads((folder / bpe.INFO_FILE).read_text())
    (folder / bpe.INFO_FILE).write_text(json.dumps({**info, "hash": "0" * 64}))  # changed after prepare
    with pytest.raises(SystemExit, match=r"tokenizer .*tok-.* was changed"):
        train.main(walk_args(data, tmp_path / "out"))
    assert not (tmp_path / "out").exists()  # nothing ran, nothing was written


@pytest.mark.parametrize("over, blamed", [
    ({"learning_rate": -1, "min_lr": -0.1}, "learning_rate must be positive, got -1"),
    ({"warmup_iters": 500, "lr_decay_iters": 100, "max_iters": 1000}, "warmup_iters (500) is past lr_decay_iters (100)"),
])
def test_config_errors_blame_the_setting_that_is_wrong(over, blamed):
    with pytest.raises(ConfigError, match=re.escape(blamed)):
        build_config(TrainConfig, over)


def test_a_short_run_may_stop_inside_its_warmup():
    """warmup_iters past lr_decay_iters is allowed when the run ends before the decay would: the learning rate
    rises through every step of the run and never jumps to min_lr."""
    cfg = build_config(TrainConfig, {"warmup_iters": 100, "lr_decay_iters": 50, "max_iters": 50})
    lrs = [get_lr(step, cfg) for step in range(cfg.max_iters)]
    assert all(a < b for a, b in zip(lrs, lrs[1:]))
    assert lrs[-1] == pytest.approx(cfg.learning_rate * 50 / 101)


def test_float16_on_the_cpu_says_it_is_slow(char_dataset, tmp_path, capsys):
    train.main(walk_args(char_dataset, tmp_path / "out", dtype="float16", eval_only=True))
    assert "note: float16 on the CPU is emulated" in capsys.readouterr().out


@needs_gpt2_bpe
def test_a_base_whose_vocabulary_is_too_small_is_blamed_for_it(tmp_path):
    from export import export_hf

    gpt2 = Tokenizer.tiktoken("gpt2")
    data = write_dataset(tmp_path / "shakespeare", "To be, or not to be, that is the question. " * 300, gpt2)
    base = tmp_path / "hf-1000"
    export_hf(GPT(GPTConfig(block_size=64, vocab_size=1000, n_layer=1, n_head=2, n_embd=16, bias=True)), base)
    with pytest.raises(SystemExit, match=rf"{base} has a vocabulary of 1000 tokens, fewer than the 50257 of its "
                                         rf"tokenizer \(GPT-2's BPE"):
        train.main(walk_args(data, tmp_path / "out", init_from=str(base)))


def test_sample_init_from_a_run_folder_points_at_ckpt(char_dataset, tmp_path):
    import sample

    out = tmp_path / "out"
    train.main(walk_args(char_dataset, out, max_iters=1))
    with pytest.raises(SystemExit, match=rf"{out} is a checkpoint of this project.*: pass it as --ckpt {out}"):
        sample.main([f"--init_from={out}", "--max_new_tokens=2", "--device=cpu"])


# ----------------------------------------------------------------------------- progress on a slow machine


def test_the_cpu_note_gives_the_plans_time(char_dataset, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(run, "CPU_FLOPS_BUDGET", 0)  # this tiny run counts as sized for a GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    train.main(walk_args(char_dataset, tmp_path / "out", device="auto", eval_only=True))
    note = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("note: no GPU here"))
    assert re.search(r"the plan estimates \d+ s on this CPU", note)


class Clock:
    """time.perf_counter for gptkit.metrics: `step` seconds later at every call."""

    def __init__(self, step: float):
        self.now, self.step = 1000.0, step

    def perf_counter(self) -> float:
        self.now += self.step
        return self.now


def test_a_slow_evaluation_prints_lines_when_not_on_a_terminal(monkeypatch, capsys):
    monkeypatch.setattr(metrics, "time", Clock(2.0))
    progress = metrics.LineProgress("evaluating", 200, "batches")
    for done in range(1, 201):
        progress.update(done)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "evaluating: 2/200 batches (4 s)"  # once 3 s have passed
    assert 10 <= len(lines) <= 15 and all(line.startswith("evaluating: ") for line in lines)


def test_slow_steps_print_a_line_between_the_log_lines(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(metrics, "time", Clock(6.0))  # every step takes seconds
    m = metrics.Metrics(tmp_path, master=True, tokens_per_step=1, flops_per_token=1.0, peak_flops=None,
                        world_size=1, max_iters=100, device=torch.device("cpu"), log_interval=10)
    m.log_eval(0, 4.0, 4.0, True)
    for _ in range(9):
        m.step_done()
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("step 1/100 done (") and "the loss is logged every 10 steps" in lines[1]
    assert 2 <= len(lines) - 1 <= 4  # the first step, then one every PROGRESS_EVERY seconds


def test_the_plan_counts_the_parameters_the_run_prints(char_dataset, tmp_path, capsys):
    args = walk_args(char_dataset, tmp_path / "out", eval_only=True)
    report = train.main([*args, "--plan"])
    planned = re.search(r"parameters +([\d.]+M)", capsys.readouterr().out).group(1)
    train.main(args)
    logged = re.search(r"model: ([\d.]+M) parameters", capsys.readouterr().out).group(1)
    assert planned == logged == f"{report['parameters'] / 1e6:.2f}M"


def test_wandb_files_go_into_out_dir(tmp_path, monkeypatch):
    seen = {}
    fake = type(sys)("wandb")
    fake.init = lambda **kwargs: seen.update(kwargs) or "run"
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    assert metrics.start_wandb("p", "r", {}, tmp_path / "out") == "run"
    assert seen["dir"] == tmp_path / "out" and (tmp_path / "out").is_dir()
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    metrics.start_wandb("p", "r", {}, tmp_path / "out")
    assert seen["dir"] is None  # WANDB_DIR says where


# ----------------------------------------------------------------------------- the Hub, offline


@pytest.fixture
def hub_unreachable(monkeypatch, tmp_path):
    """A Hub at a closed local port, an empty Hub cache, and the answer of network.hub_unreachable forgotten."""
    from huggingface_hub import constants

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    for name in network.PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    network.hub_unreachable.cache_clear()
    yield
    network.hub_unreachable.cache_clear()


def test_a_gpt2_name_offline_fails_at_once_in_one_line(hub_unreachable, capsys):
    import sample

    with pytest.raises(SystemExit, match=r"cannot reach the Hugging Face Hub \(127\.0\.0\.1:\d+: .*\) and "
                                         r"config.json of 'gpt2' is not in its local cache"):
        sample.main(["--init_from", "gpt2"])
    assert "Retrying" not in capsys.readouterr().err


def test_a_hub_dataset_offline_fails_at_once_in_one_line(hub_unreachable, monkeypatch):
    datasets = pytest.importorskip("datasets")
    from datasets.packaged_modules.cache import cache
    from huggingface_hub import constants

    from gptkit.prepare import hub
    from gptkit.shards import DataError

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    settings = lambda: (os.environ.get("HF_HUB_OFFLINE"), constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE)
    before, seen = settings(), []
    real_init = cache.Cache.__init__
    monkeypatch.setattr(cache.Cache, "__init__", lambda self, *a, **k: seen.append(settings()) or real_init(self, *a, **k))
    with pytest.raises(DataError, match=r"cannot reach the Hugging Face Hub .* and dataset someone/corpus is not "
                                        r"in the local cache"):
        hub.load_hf_dataset("someone/corpus")
    # the cache was read through the library's own reader, the process' settings untouched during and after
    assert seen == [before] and settings() == before == ("0", False, False)


def test_the_hub_is_asked_once(monkeypatch):
    calls = []
    monkeypatch.setattr(network, "_cannot_connect", lambda *args: calls.append(args) or "down")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for name in network.PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    network.hub_unreachable.cache_clear()
    try:
        assert network.hub_unreachable() == network.hub_unreachable() == "down" and len(calls) == 1
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the clients never try: nothing to ask
        network.hub_unreachable.cache_clear()
        assert network.hub_unreachable() is None and len(calls) == 1
    finally:
        network.hub_unreachable.cache_clear()


# ----------------------------------------------------------------------------- chat and export


CHARS = sorted(set("\n !',.?abcdefghijklmnopqrstuvwxyz"))
CHAT_CHARS = Tokenizer({"kind": "char", "chars": CHARS}).with_special(CHAT_SPECIALS)


def chat_checkpoint(folder: Path, model: GPT) -> Path:
    folder.mkdir()
    meta = {"tokenizer": CHAT_CHARS.to_meta(), "vocab_size": CHAT_CHARS.vocab_size, "eot_id": CHAT_CHARS.eot_id,
            "splits": {}}
    save_checkpoint({"format": 1, "model_config": model.config.to_dict(), "model": model.state_dict(),
                     "tokenizer": meta, "step": 1, "config": {}}, folder / "best.pt")
    return folder


def test_chat_py_says_a_message_cannot_be_encoded_and_goes_on(tmp_path, monkeypatch, capsys):
    import chat

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=CHAT_CHARS.vocab_size, n_layer=1, n_head=2, n_embd=16))
    folder = chat_checkpoint(tmp_path / "out", model)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n日本\nhello\n"))
    chat.main([f"--ckpt={folder}", "--max_new_tokens=3", "--temperature=0", "--device=cpu"])
    captured = capsys.readouterr()
    assert "error: character '日' is not in the model's vocabulary" in captured.err
    assert "the conversation goes on" in captured.err
    assert captured.out.count("\n\n") == 2  # both other messages were answered


def end_token_model() -> GPT:
    """A chat model whose every prediction is <|end|> (its logits are the same at every position): the final
    LayerNorm outputs one constant vector, which only <|end|>'s embedding row points along."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=CHAT_CHARS.vocab_size, n_layer=1, n_head=2, n_embd=16,
                          bias=True))
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.copy_(torch.ones(16))
        model.transformer.wte.weight[CHAT_CHARS.special["<|end|>"]] = 10.0
    return model.eval()


def test_the_hf_export_of_a_chat_model_stops_at_the_end_of_the_turn(tmp_path):
    transformers = pytest.importorskip("transformers")
    import export

    folder = chat_checkpoint(tmp_path / "out", end_token_model())
    export.main(["--ckpt", str(folder), "--out", str(tmp_path / "hf")])  # --out names the folder, as for gguf
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    end = CHAT_CHARS.special["<|end|>"]
    assert generation["eos_token_id"][0] == end and generation["pad_token_id"] == end
    assert set(generation["eos_token_id"]) == {CHAT_CHARS.special[s] for s in CHAT_SPECIALS}

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    out = hf.generate(ids, max_new_tokens=8, do_sample=False)
    assert out[0, ids.size(1):].tolist() == [end]  # one <|end|>, then it stopped
    (tmp_path / "hf" / "generation_config.json").unlink()  # what the export wrote before: runs on
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert again.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.size(1):].tolist() == [end] * 8


def test_export_takes_out_for_every_format_and_refuses_two_folders(tmp_path):
    import export

    args = export.parse_args(["--ckpt", "x", "--out", str(tmp_path / "hf")])
    assert args.format == "hf" and args.out == str(tmp_path / "hf")
    assert export.parse_args(["--ckpt", "x", "--to", "a"]).out == "a"  # --to: the older spelling of --out
    with pytest.raises(export.ConfigError, match="--to and --out are two spellings of out"):
        export.parse_args(["--ckpt", "x", "--to", "a", "--out", "b"])

