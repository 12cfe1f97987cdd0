"""train.py on CPU: learning, exact resume, signals, safe checkpoints, guards, and DDP through torchrun."""

import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (  # (tiny_args is also imported from here by other test files)
    tiny_args,
    torch_threads,
    train_script,
)

from gptkit import checkpoint
from gptkit.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from model import GPT

train = train_script()

REPO = Path(__file__).resolve().parents[1]


def metrics(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def train_losses(out):
    return {m["step"]: m["loss"] for m in metrics(out) if "loss" in m}


def weights(out, name="last.pt"):
    return load_checkpoint(Path(out) / name)["model"]


def assert_same_weights(a, b, exact=True):
    assert a.keys() == b.keys()
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), k
        else:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


def test_training_lowers_the_loss_and_writes_the_run_record(char_dataset, tmp_path):
    out = tmp_path / "out"
    summary = train.main(tiny_args(char_dataset, out, max_iters=40, lr_decay_iters=40, learning_rate=1e-2,
                                         eval_interval=20, dropout=0.0))
    losses = train_losses(out)
    assert losses[40] < losses[1] - 0.5
    assert summary["best_val_loss"] < 2.7  # ln(21) = 3.04 at init
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["max_iters"] == 40 and cfg["n_embd"] == 32
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert len(runs) == 1 and "torch" in runs[0]["versions"] and "--max_iters=40" in runs[0]["argv"]
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:  # the tests run from a git checkout: the record names its commit
        assert runs[0]["code"]["commit"] == head.stdout.strip() and isinstance(runs[0]["code"]["dirty"], bool)
    assert runs[0]["code"]["gptkit"]  # the installed package's version
    ckpt = load_checkpoint(out / "best.pt")
    # the unwrapped model's keys, loadable without the optimizer, with the tokenizer to decode samples
    assert all(not k.startswith(("module.", "_orig_mod.")) for k in ckpt["model"])
    assert ckpt["tokenizer"]["tokenizer"]["kind"] == "char"
    model = checkpoint.model_from_checkpoint(ckpt)
    assert isinstance(model, GPT)


def test_resume_is_exact(char_dataset, tmp_path):
    full, half = tmp_path / "full", tmp_path / "half"
    train.main(tiny_args(char_dataset, full, max_iters=8))
    train.main(tiny_args(char_dataset, half, max_iters=4))
    train.main(tiny_args(char_dataset, half, max_iters=8, init_from="resume"))
    assert train_losses(half) == train_losses(full)  # bit-identical losses, every step
    assert_same_weights(weights(half), weights(full))
    a, b = load_checkpoint(full / "last.pt"), load_checkpoint(half / "last.pt")
    assert a["step"] == b["step"] == 8 and a["loader"] == b["loader"]
    for s1, s2 in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert torch.equal(s1["exp_avg"], s2["exp_avg"])


def test_resume_takes_the_config_from_the_checkpoint(char_dataset, tmp_path):
    out = tmp_path / "out"
    train.main(tiny_args(char_dataset, out, max_iters=2))
    summary = train.main(["--init_from=resume", f"--out_dir={out}", "--max_iters=4"])
    assert summary["step"] == 4


def test_resume_mismatch_errors(char_dataset, tmp_path):
    out = tmp_path / "out"
    train.main(tiny_args(char_dataset, out, max_iters=2))
    with pytest.raises(SystemExit, match=r"different model shape: n_layer \(checkpoint 2, asked 3\); n_embd"):
        train.main(tiny_args(char_dataset, out, init_from="resume", n_layer=3, n_embd=48, n_head=2))
    from conftest import make_char_dataset

    other = make_char_dataset(tmp_path / "other", seed=1)
    (other / "meta.json").write_text((other / "meta.json").read_text().replace('"vocab_size": 21', '"vocab_size": 22')
                                     .replace('"chars": [', '"chars": ["~", '))
    with pytest.raises(SystemExit, match="vocabulary differs: tokenizer .*; vocab_size"):
        train.main(tiny_args(other, out, init_from="resume"))
    with pytest.raises(SystemExit, match="nothing to resume"):
        train.main(tiny_args(char_dataset, tmp_path / "empty", init_from="resume"))


def test_scratch_run_refuses_to_replace_checkpoints(char_dataset, tmp_path):
    out = tmp_path / "out"
    train.main(tiny_args(char_dataset, out, max_iters=2))
    before = (out / "last.pt").read_bytes()
    with pytest.raises(SystemExit, match="already holds last.pt and best.pt; continue it with --init_from=resume"):
        train.main(tiny_args(char_dataset, out, max_iters=2, seed=5))
    assert (out / "last.pt").read_bytes() == before
    train.main(tiny_args(char_dataset, out, max_iters=2, seed=5, overwrite=True))
    assert (out / "last.pt").read_bytes() != before


def test_resume_with_overwrite_names_the_two_settings_passed(char_dataset, tmp_path):
    """--init_from=resume with --overwrite=True is refused naming those two (not resume=auto, which a run started
    with it records); and a run started with --overwrite=True continues with --resume=auto: how one invocation
    starts is never taken from the checkpoint."""
    out = tmp_path / "out"
    train.main(tiny_args(char_dataset, out, max_iters=2, resume="auto"))
    before = (out / "last.pt").read_bytes()
    with pytest.raises(SystemExit) as e:
        train.main([f"--out_dir={out}", "--init_from=resume", "--overwrite=True"])
    assert str(e.value.code) == ("error: init_from=resume continues the run in out_dir, and overwrite=True is for a new "
                                 "run that replaces it: drop --overwrite=True to continue it, or --init_from=resume "
                                 "to start again")
    assert (out / "last.pt").read_bytes() == before
    again = tmp_path / "again"
    train.main(tiny_args(char_dataset, again, max_iters=2, overwrite=True))
    assert train.main(tiny_args(char_dataset, again, max_iters=4, resume="auto"))["step"] == 4
    assert train.main([f"--out_dir={again}", "--init_from=resume", "--max_iters=5"])["step"] == 5


def test_missing_dataset_names_the_prepare_command(tmp_path):
    with pytest.raises(SystemExit, match=r"python prepare/text.py --input YOUR_TEXT --name nope"):
        train.main([f"--data_root={tmp_path}", "--dataset=nope", f"--out_dir={tmp_path / 'o'}", "--device=cpu"])
    assert not (tmp_path / "o").exists()  # nothing written by a run that could not start


def test_out_of_vocab_token_is_caught_before_training(char_dataset, tmp_path):
    meta = json.loads((char_dataset / "meta.json").read_text())
    meta["vocab_size"] = 10  # the shards hold ids up to 20
    (char_dataset / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(SystemExit, match="token id 20 >= the model's vocab_size 10"):
        train.main(tiny_args(char_dataset, tmp_path / "out"))


def poison_training_forward(monkeypatch, call: int) -> None:
    """The training forward's `call`-th loss (counting micro-batches from 1) becomes NaN."""
    real_forward = GPT.forward
    calls = {"n": 0}

    def poisoned(self, idx, targets=None, pos=None):
        logits, loss = real_forward(self, idx, targets, pos)
        if targets is not None and self.training:
            calls["n"] += 1
            if calls["n"] == call:
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(GPT, "forward", poisoned)


def test_non_finite_loss_stops_before_the_update(char_dataset, tmp_path, monkeypatch):
    out = tmp_path / "out"
    train.main(tiny_args(char_dataset, out, max_iters=3))
    best_before = (out / "best.pt").read_bytes()
    poison_training_forward(monkeypatch, 3)  # the 2nd micro-batch of the 2nd resumed step
    steps = []
    real_step = torch.optim.AdamW.step
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a, **k: steps.append(1) or real_step(self, *a, **k))
    last_before = (out / "last.pt").read_bytes()
    with pytest.raises(SystemExit, match="non-finite loss or gradient norm at step 4"):
        train.main(tiny_args(char_dataset, out, max_iters=8, init_from="resume", eval_interval=100))
    assert len(steps) == 1  # step 3 updated; step 4 stopped before its optimizer step
    assert (out / "best.pt").read_bytes() == best_before and (out / "last.pt").read_bytes() == last_before


def record_masked_steps(monkeypatch) -> tuple[list[float], list[bool]]:
    """Every fused AdamW step from now on records its found_inf flag and whether it left every weight as it
    was: the two lists returned."""
    flagged, unchanged = [], []
    real_step = torch.optim.AdamW.step

    def step(self, *a, **k):
        assert self.defaults["fused"]
        flagged.append(float(self.found_inf))
        params = [p for g in self.param_groups for p in g["params"]]
        weights_before = [p.detach().clone() for p in params]
        result = real_step(self, *a, **k)
        unchanged.append(all(torch.equal(p, w) for p, w in zip(params, weights_before)))
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    return flagged, unchanged


@pytest.fixture
def deferred_on_cpu(monkeypatch):
    """train.py's GPU way of checking a step, on the CPU: fused AdamW masks a flagged step on the device and
    the flags are read one step late (step.StepGuard)."""
    from gptkit import optim

    monkeypatch.setattr("gptkit.step.DEFERRED_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(optim, "FUSED_DEVICE_TYPES", ("cpu",))


def test_deferred_check_never_applies_a_non_finite_step(char_dataset, tmp_path, monkeypatch, deferred_on_cpu):
    """Without a host read per step: step 4's NaN is flagged on the device, its update skipped by the fused
    AdamW (found_inf), the run stops at the next step's check, before that step's update, and the
    checkpoints are as they were."""
    out = tmp_path / "out"
    train.main(tiny_args(char_dataset, out, max_iters=3))
    before = {n: (out / n).read_bytes() for n in ("best.pt", "last.pt")}
    poison_training_forward(monkeypatch, 3)  # the 2nd micro-batch of the 2nd resumed step: step 4
    flagged, weights_seen = record_masked_steps(monkeypatch)
    with pytest.raises(SystemExit, match="non-finite loss or gradient norm at step 4"):
        train.main(tiny_args(char_dataset, out, max_iters=8, init_from="resume", eval_interval=100))
    assert flagged == [0.0, 1.0]  # step 3 applied, step 4 masked; step 5 stopped before its update
    assert weights_seen == [False, True]  # ...and the masked step left every weight as it was
    assert {n: (out / n).read_bytes() for n in before} == before


def test_guard_reads_the_flags_a_step_late_when_deferred(deferred_on_cpu):
    """StepGuard on its own: deferred, check() answers the previous step's flags; settle() the last one's."""
    from gptkit.runtime import Dist, setup_runtime
    from gptkit.step import StepGuard, Verdict

    rt = setup_runtime("cpu", "float32")
    p = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.AdamW([p], lr=0.1, fused=True)
    guard = StepGuard(optimizer, rt, Dist())
    assert guard.deferred
    one, nan = torch.tensor(1.0), torch.tensor(float("nan"))
    assert guard.check(0, one, one, False) == Verdict()  # nothing before step 0
    assert guard.check(1, nan, one, True) == Verdict(loss=1.0, grad_norm=1.0)  # step 0's flags
    verdict = guard.settle()  # step 1's, read now
    assert verdict.bad_step == 1 and verdict.stop and guard.settle() == Verdict()
    p.grad = torch.full((3,), float("nan"))
    guard.check(2, nan, one, False)
    guard.optimizer_step(optimizer, torch.amp.GradScaler("cpu", enabled=False))
    assert torch.equal(p, torch.zeros(3))  # step 2 flagged: masked on the device


def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    save_checkpoint({"model": {"w": torch.ones(3)}, "model_config": {}, "step": 1}, path)

    def crash(obj, f, *a, **k):
        f.write(b"partial garbage")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)  # (as gptkit/checkpoint/file.py calls it)
    with pytest.raises(OSError):
        save_checkpoint({"model": {"w": torch.zeros(3)}, "model_config": {}, "step": 2}, path)
    monkeypatch.undo()
    assert load_checkpoint(path)["step"] == 1
    assert not (tmp_path / "last.pt.tmp").exists()


def test_malicious_pickle_is_refused(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "evil.pt"
    torch.save({"model": Evil(), "model_config": {}}, path)
    with pytest.raises(CheckpointError, match="refusing to load"):
        load_checkpoint(path)
    assert not marker.exists()
    raw = tmp_path / "raw.pt"
    raw.write_bytes(pickle.dumps({"model": 1}))
    with pytest.raises(CheckpointError):
        load_checkpoint(raw)
    with pytest.raises(CheckpointError, match="python train.py"):
        load_checkpoint(tmp_path / "nope")


def assert_resume_matches_uninterrupted(data, full, cut, **args) -> None:
    """Resume the stopped run in `cut` and run the same run uninterrupted in `full`, on one thread (the
    arithmetic of the subprocess that was stopped): the same losses every step and the same weights, bit for
    bit."""
    with torch_threads(1):
        train.main(tiny_args(data, full, **args))
        train.main(tiny_args(data, cut, init_from="resume", **args))
    assert train_losses(cut) == train_losses(full)
    assert_same_weights(weights(cut), weights(full))


def sigterm_at_step(stop: int):
    """step.forward_backward sending SIGTERM to this process in the middle of step `stop` (its next call)."""
    from gptkit import step

    real, calls = step.forward_backward, {"n": 0}

    def forward_backward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == stop + 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    return step, "forward_backward", forward_backward


def sigterm_in_evaluation():
    """train.evaluate sending SIGTERM as the evaluation of step 6 (the third) starts: it is cut short, step 6 is
    saved unevaluated."""
    real, calls = train.evaluate, {"n": 0}

    def evaluate(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    return train, "evaluate", evaluate


@pytest.mark.parametrize("stop, deferred", [(4, False), (5, False), ("eval", False), (4, True), (5, True)])
def test_sigterm_saves_and_resume_matches_uninterrupted(char_dataset, tmp_path, stop, deferred, monkeypatch,
                                                        capsys):
    """A SIGTERM mid-step cuts that step short (one plain process: gptkit/step.py's TrainStep `stop`), saves
    the last finished step (also where, as on a GPU, the flags are read a step late) and exits 143; the resumed
    run is bit-exact. (In this process: the signal is this process' own, caught by train.py's handler while it
    runs; test_async_save's SIGTERM test stops a separate process and reads its exit status.)"""
    if deferred:
        monkeypatch.setattr("gptkit.step.DEFERRED_DEVICE_TYPES", ("cpu",))
        from gptkit import optim
        monkeypatch.setattr(optim, "FUSED_DEVICE_TYPES", ("cpu",))
    full, cut = tmp_path / "full", tmp_path / "cut"
    args = dict(max_iters=12, eval_interval=3, lr_decay_iters=12)
    with monkeypatch.context() as patch, torch_threads(1):
        patch.setattr(*(sigterm_in_evaluation() if stop == "eval" else sigterm_at_step(stop)))
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            train.main(tiny_args(char_dataset, cut, **args))
    out = capsys.readouterr().out
    assert e.value.code == 143, out  # 128 + SIGTERM: a scheduler requeues it
    assert "SIGTERM received" in out and "--init_from=resume" in out
    # the step in flight was cut short: the one before it is saved
    finished = 6 if stop == "eval" else stop
    assert load_checkpoint(cut / "last.pt")["step"] == finished
    evaluated = [m["step"] for m in map(json.loads, (cut / "metrics.jsonl").read_text().splitlines()) if "val_loss" in m]
    assert evaluated == [0, 3] if stop == "eval" else max(evaluated) <= finished
    assert_resume_matches_uninterrupted(char_dataset, full, cut, **args)
    # best.pt too: an evaluation the stopped run never did happens on resume, and is saved when it improves
    best_cut, best_full = load_checkpoint(cut / "best.pt"), load_checkpoint(full / "best.pt")
    assert best_cut["step"] == best_full["step"] and best_cut["best_val_loss"] == best_full["best_val_loss"]
    assert_same_weights(best_cut["model"], best_full["model"])


def test_dropout_can_change_on_resume(char_dataset, tmp_path):
    out = tmp_path / "out"
    train.main(tiny_args(char_dataset, out, max_iters=2, dropout=0.0))
    train.main(tiny_args(char_dataset, out, max_iters=3, init_from="resume", dropout=0.3))
    assert load_checkpoint(out / "last.pt")["model_config"]["dropout"] == 0.3


def test_unwritable_out_dir_is_one_line(char_dataset, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit, match="^error: .*file"):
        train.main(tiny_args(char_dataset, blocker / "out"))


def test_torchrun_with_too_few_micro_batches_says_it_once_with_the_fix(char_dataset, tmp_path):
    """gradient_accumulation_steps=1 on 2 processes: one `error:` line (not one per process) naming the setting
    that works, before any process group; torchrun's summary shows that line as its root cause instead of a
    link to its docs (its own traceback stays: torchrun raises one whenever a process fails)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(REPO / "train.py"),
           *tiny_args(char_dataset, tmp_path / "out", gradient_accumulation_steps=1)]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode != 0
    line = ("error: gradient_accumulation_steps (1) counts the micro-batches of all 2 processes together, so it must "
            "be a multiple of 2: use --gradient_accumulation_steps=2; to keep its 128 tokens per step: "
            "--gradient_accumulation_steps=2 --batch_size=2")
    said = [text for text in (res.stdout + res.stderr).splitlines() if text.startswith("error:")]
    assert said == [line], res.stdout + res.stderr
    root_cause = res.stderr[res.stderr.index("Root Cause"):]
    assert f"traceback : {line}" in root_cause and "To enable traceback" not in res.stderr
    assert not (tmp_path / "out").exists()


QUIET_CHILD = """
import sys, time
sys.path.insert(0, {repo!r})
from gptkit import cli
real_sleep = time.sleep
def sleep(seconds):  # (says when the process waits, its SIGTERM handler in place)
    print("waiting", flush=True)
    real_sleep(seconds)
time.sleep = sleep
cli._leave_quietly()
"""


def test_a_quiet_process_tells_torchrun_its_line_only_when_it_leaves(tmp_path):
    """torchrun names the failure with the earliest time in its error files as the root cause: the process
    that stays quiet (its machine's first process says the error) writes its line only when torchrun stops it,
    so it can never be named before the process that says the error, however the two were scheduled."""
    error_file = tmp_path / "error.json"
    env = dict(os.environ, TORCHELASTIC_ERROR_FILE=str(error_file), LOCAL_RANK="1")
    child = subprocess.Popen([sys.executable, "-c", QUIET_CHILD.format(repo=str(REPO))], env=env,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "waiting\n"
        assert not error_file.exists()  # met the error, says nothing yet
        child.send_signal(signal.SIGTERM)  # as torchrun stops the others once one has failed
        assert child.wait(timeout=60) == 1
    finally:
        child.kill()
    said = json.loads(error_file.read_text())["message"]
    assert said["message"] == "the same error as local rank 0's" and int(said["extraInfo"]["timestamp"]) > 0


def test_wandb_offline_logging(char_dataset, tmp_path):
    pytest.importorskip("wandb")
    env = dict(os.environ, WANDB_MODE="offline", WANDB_DIR=str(tmp_path), WANDB_SILENT="true", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, str(REPO / "train.py"),
                          *tiny_args(char_dataset, tmp_path / "out", max_iters=3, wandb_log=True)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0


def test_unavailable_device_is_a_one_line_error(char_dataset, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit, match="CUDA is not available here; use --device=cpu"):
        train.main(tiny_args(char_dataset, tmp_path / "out", device="cuda"))


def test_shakespeare_is_prepared_on_the_fly_or_explains_how(tmp_path, monkeypatch, shakespeare_path):
    import urllib.error
    import urllib.request

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    args = [f"--data_root={tmp_path}", "--dataset=shakespeare_char", f"--out_dir={tmp_path / 'out'}",
            "--device=cpu", "--n_layer=1", "--n_head=1", "--n_embd=16", "--block_size=16", "--batch_size=2",
            "--gradient_accumulation_steps=1", "--max_iters=1", "--eval_iters=1"]
    with pytest.raises(SystemExit) as e:
        train.main(args)
    message = str(e.value.code)
    # one line, with the command that works here (train.py takes no --input): run as it is written, it prepares
    # the dataset where this run looks for it
    folder = tmp_path / "shakespeare_char"
    command = f"python prepare/shakespeare_char.py --input PATH_TO_THE_TEXT --out_dir {folder}"
    assert message == (f"error: could not download the text of shakespeare_char to prepare {folder} (no network); "
                       f"with a copy of it here, run: {command} (then this command again)")
    assert not (tmp_path / "out").exists()
    prepare = command.replace("PATH_TO_THE_TEXT", str(shakespeare_path)).split()[1:]
    subprocess.run([sys.executable, *prepare], cwd=REPO, check=True, capture_output=True, timeout=300)
    assert train.main(args)["step"] == 1
    # with the text already downloaded (here: copied) into the dataset folder, train.py prepares it itself
    other = [a.replace(str(tmp_path), str(tmp_path / "other")) for a in args]
    (tmp_path / "other" / "shakespeare_char").mkdir(parents=True)
    (tmp_path / "other" / "shakespeare_char" / "input.txt").write_bytes(shakespeare_path.read_bytes())
    assert train.main(other)["step"] == 1
    assert (tmp_path / "other" / "shakespeare_char" / "meta.json").is_file()


def test_a_busy_out_dir_is_refused_at_once_and_nothing_is_touched(char_dataset, tmp_path):
    from gptkit.files import OutDirLock

    out = tmp_path / "out"
    train.main(tiny_args(char_dataset, out, max_iters=2))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with OutDirLock(out):  # as if another run were training into out/
        for extra in ({}, {"overwrite": True}, {"init_from": "resume", "max_iters": 4}):
            with pytest.raises(SystemExit, match=rf"out/ is in use by another run \(pid {os.getpid()} on host "):
                train.main(tiny_args(char_dataset, out, **{"max_iters": 2, **extra}))
        assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != ".lock"} == before
    assert train.main(tiny_args(char_dataset, out, max_iters=4, init_from="resume"))["step"] == 4


def test_a_gpu_sized_config_on_the_cpu_says_so(char_dataset, tmp_path, capsys):
    if torch.cuda.is_available() or torch.backends.mps.is_available():
        pytest.skip("device=auto would not pick the CPU here")
    train.main(tiny_args(char_dataset, tmp_path / "big", device="auto", max_iters=10**9, eval_only=True))
    assert "sized for a GPU" in capsys.readouterr().out
    train.main(tiny_args(char_dataset, tmp_path / "small", device="auto", max_iters=10, eval_only=True))
    assert "sized for a GPU" not in capsys.readouterr().out
