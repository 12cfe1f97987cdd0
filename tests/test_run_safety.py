"""What a run that fails, is refused or is stopped leaves behind: --overwrite=True sets the earlier run aside
until the new one has saved (back when it fails), a refused run leaves nothing new, sizes that cannot fit are
refused before anything is built (naming the largest that fits, by the plan), and a stop signal cuts a long
step short with the last finished step saved exactly."""

import dataclasses
import json
import os
import signal

import pytest
import torch
from conftest import tiny_args, torch_threads, train_script

from gptkit import plan_check, run
from gptkit.config import TrainConfig
from gptkit.options import ConfigError, parse_args
from gptkit.run import where_checkpoints_are
from gptkit.shards import read_meta
from tests.test_train import assert_same_weights, train_losses, weights

train = train_script()


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def short(data, out, **over):
    return tiny_args(data, out, **{"gradient_accumulation_steps": 1, "max_iters": 4, "eval_interval": 2,
                                   "eval_iters": 2, "warmup_iters": 1, "lr_decay_iters": 4, "dropout": 0.0, **over})


def snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------- overwrite and refusals


def test_an_overwrite_that_fails_keeps_the_earlier_run(char_dataset, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    train.main(short(char_dataset, out))
    before = snapshot(out)
    assert {"last.pt", "best.pt", "metrics.jsonl", "runs.jsonl", "config.json"} <= {p.name for p in before}

    def failing_loop(*args, **kwargs):  # the new run fails after writing its config, before any checkpoint
        assert not (out / "last.pt").exists()  # (set aside meanwhile)
        raise RuntimeError("boom")

    monkeypatch.setattr(train, "train_loop", failing_loop)
    with pytest.raises(RuntimeError, match="boom"):
        train.main(short(char_dataset, out, overwrite=True, learning_rate=1e-2))
    assert snapshot(out) == before  # every file back, byte for byte, and nothing else
    said = capsys.readouterr().out
    assert "are set aside in" in said and "the earlier run's files are back in" in said


def test_an_overwrite_that_saves_leaves_no_trace_of_the_earlier_run(char_dataset, tmp_path, capsys):
    out = tmp_path / "out"
    train.main(short(char_dataset, out, max_iters=2, lr_decay_iters=2))
    capsys.readouterr()
    train.main(short(char_dataset, out, overwrite=True, seed=7))
    said = capsys.readouterr().out
    assert "the earlier run's files set aside in" in said and "are removed" in said
    assert sorted(p.name for p in out.iterdir()) == ["best.pt", "config.json", "last.pt", "metrics.jsonl",
                                                     "runs.jsonl"]
    assert len((out / "runs.jsonl").read_text().splitlines()) == 1  # this run's only
    assert all(m["step"] <= 4 for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()))


@pytest.mark.parametrize("existing", [False, True])
def test_a_refused_run_leaves_nothing_new(char_dataset, tmp_path, monkeypatch, existing):
    """Refused in its setup (here: batch_size=auto finding no batch), after the lock made out_dir: a new
    out_dir is gone again, and an earlier run's files are as they were (a resumed run's logs too)."""
    out = tmp_path / "out"
    if existing:
        train.main(short(char_dataset, out, max_iters=2, lr_decay_iters=2))
    before = snapshot(out) if existing else None
    from gptkit import batch_size

    def refuse(*args, **kwargs):
        raise batch_size.BatchSizeError("no batch fits")

    monkeypatch.setattr(run, "choose_batch_size", refuse)
    for over in ({"overwrite": True}, {"init_from": "resume", "max_iters": 4}) if existing else ({},):
        with pytest.raises(SystemExit, match="no batch fits"):
            train.main(short(char_dataset, out, **over))
        assert (snapshot(out) == before) if existing else not out.exists(), list(out.rglob("*"))


# ----------------------------------------------------------------------------- sizes that cannot fit


@pytest.fixture
def gib(monkeypatch):
    """The device holds 1 GiB, whatever this machine has."""
    monkeypatch.setattr(plan_check, "available_memory", lambda device: 2**30)


@pytest.mark.parametrize("over, named", [({"batch_size": 100_000_000}, "batch_size"),
                                         ({"block_size": 1_000_000_000}, "block_size"),
                                         ({"n_layer": 100_000}, "n_layer")])
def test_sizes_that_cannot_fit_are_refused_before_anything_is_built(char_dataset, tmp_path, gib, over, named,
                                                                    monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(run, "build_model", never)
    with pytest.raises(SystemExit) as e:
        train.main(short(char_dataset, tmp_path / "out", **over))
    message = str(e.value.code)
    assert message.startswith("error: this run's training step needs ~") and "more than the 1.00 GiB" in message
    fits = int(message.split(f"at most --{named}=")[1].split()[0])
    assert not (tmp_path / "out").exists()
    # the named value fits by the plan, and one more does not
    cfg = TrainConfig(**{**parse_args(TrainConfig, short(char_dataset, tmp_path / "out")), **over})
    meta = read_meta(char_dataset)
    for value, fit in ((fits, True), (fits + 1, False)):
        try:
            plan_check.check_run_fits(dataclasses.replace(
                cfg, **{named: value}, **({"batch_size": 1} if named == "block_size" else {})), None, meta,
                torch.device("cpu"), torch.float32)
            assert fit, value
        except plan_check.RunTooBig:
            assert not fit, value


def test_a_config_files_value_of_the_wrong_type_names_its_line(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text('out_dir = "x"\nlearning_rate = "fast"\n')
    with pytest.raises(ConfigError, match=rf"learning_rate expects float, got 'fast' \(in {path} line 2\)"):
        parse_args(TrainConfig, [str(path)])


# ----------------------------------------------------------------------------- a stop within a step


def test_a_stop_signal_cuts_the_step_short_and_saves_the_last_finished_step(char_dataset, tmp_path,
                                                                           monkeypatch, capsys):
    """SIGTERM arrives in the second block's forward of step 3's second micro-batch: the step is left there,
    before its update; last.pt holds step 2 (the last finished), whose resume gives the losses and weights of
    a run never stopped, bit for bit."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    over = dict(gradient_accumulation_steps=2, dropout=0.1, max_iters=6, lr_decay_iters=6, eval_interval=4)
    train.main(short(char_dataset, full, **over))
    calls = []
    real_init = train.TrainStep.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        # (registered after the step's own hooks: the signal comes from inside the block's forward)
        kwargs["blocks"][1].register_forward_pre_hook(lambda m, a: kill_at(m))

    def kill_at(module):
        if module.training:
            calls.append(1)
            if len(calls) == 2 * 2 + 2:  # step 3 (after 2 steps of 2 micro-batches), second micro-batch
                os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(train.TrainStep, "__init__", init)
    with pytest.raises(SystemExit) as e:
        train.main(short(char_dataset, cut, **over))
    assert e.value.code == 143
    said = capsys.readouterr().out
    assert "SIGTERM received: cutting this step (or the evaluation) short" in said
    assert f"stopped at step 2; {cut}/last.pt holds it" in said
    assert max(train_losses(cut)) == 2
    monkeypatch.undo()
    train.main(short(char_dataset, cut, init_from="resume", **over))
    assert train_losses(cut) == train_losses(full)
    assert_same_weights(weights(cut), weights(full))


# ----------------------------------------------------------------------------- what a new user is told


def test_more_threads_than_cores_says_what_it_uses():
    from gptkit.threads import resolve_threads

    cores = len(os.sched_getaffinity(0))
    threads = resolve_threads(cores * 500, "cpu")
    assert threads.count == cores
    assert threads.why == f"--threads={cores * 500} is more than the {cores} cores this process may run on: using {cores}"


def test_an_unprepared_dataset_names_the_script_of_its_kind(tmp_path):
    args = [f"--data_root={tmp_path}", "--dataset=mine", "--device=cpu"]
    with pytest.raises(SystemExit, match=r"prepare it with: python prepare/preference\.py --input YOUR_PAIRS\.jsonl "
                                         r"--tokenizer base --name mine$"):
        train.main([*args, "--objective=dpo", "--init_from=base"])
    with pytest.raises(SystemExit, match=r"prepare it with: python prepare/chat\.py --input "
                                         r"YOUR_CONVERSATIONS\.jsonl --name mine \(conversations; for plain text"):
        train.main([*args, "--init_from=gpt2"])
    with pytest.raises(SystemExit, match=r"prepare it with: python prepare/text\.py --input YOUR_TEXT --name mine$"):
        train.main(args)


def test_a_recipe_whose_starting_run_is_missing_names_the_recipe_that_makes_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no out-chat/ here
    with pytest.raises(SystemExit, match=r"^error: out-chat/ has no checkpoint yet \(no best\.pt or last\.pt\); "
                                         r"make it first with python train\.py configs/finetune_chat\.py$"):
        train.main([str(train.Path(train.__file__).parent / "configs" / "dpo_chat.py"), "--plan"])


def test_a_chat_models_last_line_says_to_chat(tmp_path):
    summary = {"step": 4, "best_val_loss": 1.0}
    (tmp_path / "last.pt").write_bytes(b"x")
    assert where_checkpoints_are(str(tmp_path), summary, chat=True).endswith(
        f"chat with: python chat.py --ckpt {tmp_path}/")


def test_a_finished_run_run_again_logs_no_second_evaluation_and_its_clock_goes_on(char_dataset, tmp_path, capsys):
    out = tmp_path / "out"
    train.main(short(char_dataset, out))
    logged = (out / "metrics.jsonl").read_text()
    train.main(short(char_dataset, out, init_from="resume"))
    assert (out / "metrics.jsonl").read_text() == logged  # nothing trained, nothing logged again
    assert "step 4: val loss" in capsys.readouterr().out.split("resumed from step 4")[1]
    train.main(short(char_dataset, out, init_from="resume", max_iters=6, lr_decay_iters=6))
    entries = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evaluations = [m["step"] for m in entries if "val_loss" in m]
    assert evaluations == sorted(set(evaluations)) == [0, 2, 4, 6]
    clock = [m["elapsed_s"] for m in entries]
    assert clock == sorted(clock)  # the resumed entries go on from the earlier run's time


@pytest.mark.parametrize("over", [{"init_from": "resume", "max_iters": 4}, {"overwrite": True}])
def test_a_run_failing_in_its_first_step_leaves_the_earlier_files_as_they_were(char_dataset, tmp_path,
                                                                              monkeypatch, over):
    out = tmp_path / "out"
    train.main(short(char_dataset, out, max_iters=2, lr_decay_iters=2))
    before = snapshot(out)

    def failing_step(*args, **kwargs):
        assert (out / "runs.jsonl").read_bytes() != before[train.Path("runs.jsonl")]  # (this run's line is in)
        raise RuntimeError("boom")

    monkeypatch.setattr(train.TrainStep, "__call__", failing_step)
    with pytest.raises(RuntimeError, match="boom"):
        train.main(short(char_dataset, out, **over))
    assert snapshot(out) == before


def test_a_stop_signal_cuts_an_evaluation_batch_short(char_dataset, tmp_path, monkeypatch, capsys):
    """SIGTERM in the first block's forward of the step-2 evaluation's first batch: the batch is left there (its
    second block never runs), step 2 is saved (unevaluated: its evaluation comes again on resume) and the run
    exits 143."""
    out = tmp_path / "out"
    first, second, real_init = [], [], train.TrainStep.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        kwargs["blocks"][0].register_forward_pre_hook(lambda m, a: kill_at(m))
        kwargs["blocks"][1].register_forward_hook(lambda m, a, o: second.append(1) if not m.training else None)

    def kill_at(module):
        if not module.training:
            first.append(1)
            if len(first) == 3:  # (step 0's evaluation had 2 batches)
                os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(train.TrainStep, "__init__", init)
    with pytest.raises(SystemExit) as e:
        train.main(short(char_dataset, out))
    assert e.value.code == 143 and len(first) == 3 and len(second) == 2  # left in the middle of the batch
    assert f"stopped at step 2; {out}/last.pt holds it" in capsys.readouterr().out
    assert [m["step"] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "val_loss" in m] == [0]


def test_a_run_far_past_the_cpus_speed_says_so_also_with_device_cpu(char_dataset, tmp_path, capsys):
    """--device=cpu (configs/shakespeare_cpu.py's) is no reason to keep quiet about a GPU-sized run."""
    train.main(short(char_dataset, tmp_path / "out", device="cpu", max_iters=10**9, lr_decay_iters=10**9,
                     eval_only=True))
    said = capsys.readouterr().out
    assert "note: on the CPU: this config is sized for a GPU (" in said and "the plan estimates" in said
