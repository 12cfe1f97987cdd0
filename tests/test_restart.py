"""Runs that outlive their processes: --resume=auto (the same command starts and continues a run), torchrun's
restarts after a killed process (DDP, FSDP, a kill during a save), two nodes as the README starts them,
SIGUSR1 (save and go on), checkpoint_interval_s, and a fine-tune's shape (its base's)."""

import functools
import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import train_script

import gptkit.step
from gptkit.checkpoint import load_checkpoint
from gptkit.step import GO_ON, SAVE, STOP, StepRequests, StopFlag
from tests.conftest import make_char_dataset, torch_threads
from tests.test_train import assert_same_weights, tiny_args, train_losses, weights

train = train_script()

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def single(args: list[str]) -> dict:
    with torch_threads(1):
        return train.main(args)


# ----------------------------------------------------------------------------- --resume=auto, in this process


def test_resume_auto_starts_then_continues_exactly(char_dataset, tmp_path, capsys):
    """One command line for the first start and every restart: from scratch when out_dir is empty, then from
    its last.pt, with the losses and weights of a run that was never stopped."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    single(tiny_args(char_dataset, full, max_iters=8))
    capsys.readouterr()
    single(tiny_args(char_dataset, cut, max_iters=4, lr_decay_iters=8, resume="auto"))
    assert f"resume=auto: no checkpoint in {cut}/ (no last.pt or last/): starting from scratch" in \
        capsys.readouterr().out.splitlines()[0]
    single(tiny_args(char_dataset, cut, max_iters=8, resume="auto"))
    assert capsys.readouterr().out.splitlines()[0] == \
        f"resume=auto: {cut}/last.pt holds step 4 of this run: continuing it"
    assert train_losses(cut) == train_losses(full)
    assert_same_weights(weights(cut), weights(full))
    assert json.loads((cut / "config.json").read_text())["resume"] == "auto"
    # run again once finished: it says so, trains nothing and keeps the checkpoint
    assert single(tiny_args(char_dataset, cut, max_iters=8, resume="auto"))["step"] == 8
    assert "the run is finished" in capsys.readouterr().out
    assert_same_weights(weights(cut), weights(full))


def test_resume_auto_refuses_a_checkpoint_of_another_run(char_dataset, tmp_path):
    out = tmp_path / "out"
    single(tiny_args(char_dataset, out, max_iters=2, resume="auto"))
    before = (out / "last.pt").read_bytes()
    with pytest.raises(SystemExit, match=r"^error: resume=auto: .*out/ holds a checkpoint of another run: n_layer "
                                         r"\(checkpoint 2, this run 3\); choose another --out_dir"):
        single(tiny_args(char_dataset, out, max_iters=4, resume="auto", n_layer=3))
    # a setting left to its default counts too: this command's model would have 12 layers, the checkpoint's 2
    args = [a for a in tiny_args(char_dataset, out, max_iters=4, resume="auto") if not a.startswith("--n_layer")]
    with pytest.raises(SystemExit, match=r"n_layer \(checkpoint 2, this run 12\)"):
        single(args)
    other = make_char_dataset(tmp_path / "other", seed=1)
    with pytest.raises(SystemExit, match=rf"another run: dataset \(checkpoint '{char_dataset}', this run '{other}'\)"):
        single(tiny_args(other, out, max_iters=4, resume="auto"))
    # the same dataset folder, prepared again with another vocabulary: the tokenizer differs
    meta = char_dataset / "meta.json"
    meta.write_text(meta.read_text().replace('"vocab_size": 21', '"vocab_size": 22').replace('"chars": [', '"chars": ["~", '))
    with pytest.raises(SystemExit, match="vocabulary differs: tokenizer .*; vocab_size"):
        single(tiny_args(char_dataset, out, max_iters=4, resume="auto"))
    with pytest.raises(SystemExit, match="resume=auto continues the run in out_dir and overwrite=True replaces it"):
        single(tiny_args(char_dataset, out, max_iters=4, resume="auto", overwrite=True))
    assert (out / "last.pt").read_bytes() == before  # nothing touched


def test_a_fine_tune_has_its_bases_shape_and_records_it(char_dataset, tmp_path, capsys):
    """The base decides a fine-tune's shape: a shape setting that differs is an error; config.json and the
    checkpoint record the base's shape (not TrainConfig's defaults). With resume=auto the same command first
    fine-tunes the base, then continues the fine-tune."""
    base, tuned = tmp_path / "base", tmp_path / "tuned"
    single(tiny_args(char_dataset, base, max_iters=2, n_layer=1))
    with pytest.raises(SystemExit, match=rf"^error: {base} decides the model's shape, and this run sets another: "
                                         r"n_layer=3 \(the base has 1\); n_embd=48 \(the base has 32\); drop these"):
        single(tiny_args(char_dataset, tuned, init_from=str(base), n_layer=3, n_embd=48, max_iters=2))
    assert not (tuned / "last.pt").exists()
    def command(max_iters):  # the tiny run without its shape settings, which would otherwise be 12 x 768
        return [a for a in tiny_args(char_dataset, tuned, init_from=str(base), resume="auto", max_iters=max_iters,
                                     lr_decay_iters=4) if not a.startswith(("--n_layer", "--n_head", "--n_embd"))]

    single(command(2))
    assert f"starting from {base}" in capsys.readouterr().out
    recorded = json.loads((tuned / "config.json").read_text())
    saved = load_checkpoint(tuned / "last.pt")
    assert (recorded["n_layer"], recorded["n_embd"], recorded["n_head"]) == (1, 32, 2)
    assert (saved["config"]["n_layer"], saved["config"]["n_embd"]) == (1, 32) == \
        (saved["model_config"]["n_layer"], saved["model_config"]["n_embd"])
    assert single(command(4))["step"] == 4
    assert "holds step 2 of this run: continuing it" in capsys.readouterr().out


# ----------------------------------------------------------------------------- SIGUSR1 and the clock


def test_step_requests():
    stop = StopFlag()
    now = [0.0]
    clocked = StepRequests(stop, interval_s=10, owns_clock=True, clock=lambda: now[0])
    other = StepRequests(stop, interval_s=10, owns_clock=False, clock=lambda: 1e9)  # not rank 0: no clock
    assert clocked.next() == GO_ON and other.next() == GO_ON
    now[0] = 10.0
    assert other.next() == GO_ON
    assert clocked.next() == SAVE and clocked.next() == GO_ON  # sent once; the clock starts again
    stop.save_requested = True  # SIGUSR1
    assert other.next() == SAVE and not stop.save_requested and other.next() == GO_ON
    now[0] = 15.0
    clocked.saved()  # an evaluation saved last.pt
    now[0] = 24.0
    assert clocked.next() == GO_ON
    stop.requested = True
    assert clocked.next() == STOP == 1.0  # a bool stop signal is a STOP


def record_saves(monkeypatch) -> list[tuple[str, int]]:
    saves, real = [], train.save

    def save(run, name, step, best_val, requests=None, **more):
        saves.append((name, step))
        return real(run, name, step, best_val, requests, **more)

    monkeypatch.setattr(train, "save", save)
    return saves


@pytest.mark.parametrize("deferred", [False, True])
def test_sigusr1_saves_after_the_step_and_goes_on(char_dataset, tmp_path, monkeypatch, capsys, deferred):
    """SIGUSR1 during step 4 saves last.pt after step 4 (deferred, as on a GPU where the flags are read a step
    late: after step 5), says so in one line naming the step once saved, and the run goes on to the end, as if
    no signal had come."""
    if deferred:
        from gptkit import optim

        monkeypatch.setattr("gptkit.step.DEFERRED_DEVICE_TYPES", ("cpu",))
        monkeypatch.setattr(optim, "FUSED_DEVICE_TYPES", ("cpu",))
    args = dict(max_iters=8, eval_interval=3)
    single(tiny_args(char_dataset, tmp_path / "quiet", **args))
    saves, real, calls = record_saves(monkeypatch), gptkit.step.forward_backward, [0]

    def forward_backward(*a, **k):
        calls[0] += 1
        if calls[0] == 4:
            os.kill(os.getpid(), signal.SIGUSR1)
        return real(*a, **k)

    monkeypatch.setattr(gptkit.step, "forward_backward", forward_backward)
    capsys.readouterr()
    assert single(tiny_args(char_dataset, tmp_path / "signalled", **args))["step"] == 8
    last = [step for name, step in saves if name == "last.pt"]
    assert last == [3, 5 if deferred else 4, 6, 8]
    out = capsys.readouterr().out.splitlines()
    said = out.index(f"saved {tmp_path / 'signalled' / 'last.pt'} at step {5 if deferred else 4} (SIGUSR1); going on")
    assert "SIGUSR1 received: saving last.pt after this step, then going on" in out[:said]
    assert sum(line.startswith("saved ") for line in out) == 1  # the other saves, as ever, silent
    assert train_losses(tmp_path / "signalled") == train_losses(tmp_path / "quiet")
    assert_same_weights(weights(tmp_path / "signalled"), weights(tmp_path / "quiet"))


@pytest.mark.parametrize("async_save", [False, True])
def test_checkpoint_interval_s_saves_on_rank_0s_clock(char_dataset, tmp_path, monkeypatch, capsys, async_save):
    """A clock that moves 10 s per step and checkpoint_interval_s=25: last.pt after step 3 (30 s), again 25 s
    after the save at the evaluation of step 4, so after step 7, then step 8's evaluation, and the end. The two
    saves the clock asked for are said in a line each once written (with async_save: by the writing thread,
    after the write)."""
    from gptkit.checkpoint import background

    real_write = background.save_checkpoint

    def save_checkpoint(obj, path):
        real_write(obj, path)
        print(f"written: step {obj['step']}", flush=True)

    monkeypatch.setattr(background, "save_checkpoint", save_checkpoint)
    now, real = [0.0], gptkit.step.forward_backward

    def forward_backward(*a, **k):
        now[0] += 10
        return real(*a, **k)

    monkeypatch.setattr(gptkit.step, "forward_backward", forward_backward)
    monkeypatch.setattr(train, "StepRequests", functools.partial(StepRequests, clock=lambda: now[0]))
    saves = record_saves(monkeypatch)
    single(tiny_args(char_dataset, tmp_path / "out", max_iters=10, lr_decay_iters=10, eval_interval=4,
                     checkpoint_interval_s=25, async_save=async_save))
    assert [step for name, step in saves if name == "last.pt"] == [3, 4, 7, 8, 10]
    out = capsys.readouterr().out.splitlines()
    said = [line for line in out if line.startswith("saved ")]
    assert said == [f"saved {tmp_path / 'out' / 'last.pt'} at step {n} (every checkpoint_interval_s=25); going on"
                    for n in (3, 7)]
    for line, n in zip(said, (3, 7)):
        assert out.index(f"written: step {n}") < out.index(line)
    with pytest.raises(SystemExit, match="checkpoint_interval_s must be >= 0"):
        single(tiny_args(char_dataset, tmp_path / "bad", checkpoint_interval_s=-1))


# ----------------------------------------------------------------------------- torchrun: restarts, two nodes

# A torchrun worker: train.py, except that it kills itself (SIGKILL), as the OOM killer or a lost node would:
# with KILL_STEP=ATTEMPT:RANK:N, the process of that rank on that attempt (TORCHELASTIC_RESTART_COUNT) in the
# middle of its N-th step; with KILL_SAVE=ATTEMPT:RANK:N, in the middle of writing its N-th last.pt (half of
# it written).
KILLING_WORKER = """
import io, os, signal, sys
sys.path.insert(0, {repo!r})
import torch
import sys; sys.path.insert(0, "tests"); from conftest import train_script; train = train_script()
from gptkit import step
here = os.environ["TORCHELASTIC_RESTART_COUNT"] + ":" + os.environ["RANK"] + ":"
steps, last_saves = [0], [0]
real_step, real_save = step.forward_backward, torch.save

def forward_backward(*args, **kwargs):
    steps[0] += 1
    if os.environ.get("KILL_STEP") == here + str(steps[0]):
        os.kill(os.getpid(), signal.SIGKILL)
    return real_step(*args, **kwargs)

def save(obj, f, *args, **kwargs):
    last_saves[0] += "last" in str(getattr(f, "name", f))
    if os.environ.get("KILL_SAVE") == here + str(last_saves[0]):
        whole = io.BytesIO()
        real_save(obj, whole, *args, **kwargs)
        f.write(whole.getvalue()[: len(whole.getvalue()) // 2])
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return real_save(obj, f, *args, **kwargs)

step.forward_backward, torch.save = forward_backward, save
train.main(sys.argv[1:])
"""


def torchrun(args: list[str], *options: str, script: Path = REPO / "train.py", env: dict | None = None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *options,
           str(script), *args]
    res = subprocess.run(cmd, cwd=REPO, env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return res


def killed_and_restarted(tmp_path, args: list[str], kills: int, **kill: str) -> str:
    """torchrun --max-restarts=2 of the killing worker, killed `kills` times (and so restarted); its output."""
    worker = tmp_path / "killing_worker.py"
    worker.write_text(KILLING_WORKER.format(repo=str(REPO)))
    res = torchrun(args, "--max-restarts=2", script=worker, env={k.upper(): v for k, v in kill.items()})
    assert res.stderr.count("exitcode: -9") == kills, res.stderr
    return res.stdout


RESTART_RUN = dict(max_iters=6, eval_interval=2, lr_decay_iters=6, n_layer=1, dropout=0.1, resume="auto")


def test_torchrun_restarts_a_killed_ddp_run_from_its_last_checkpoint(char_dataset, tmp_path):
    """DDP on 2 processes, torchrun --max-restarts=2; last.pt at steps 2, 4 and 6. On the first attempt rank 1
    is killed in the middle of a random step past a checkpoint (3 or 5): the group restarts and continues from
    last.pt. On that second attempt rank 0 is killed halfway through writing its first last.pt (step 4 or 6):
    the previous last.pt is whole, and the third attempt continues from it. The run ends with the weights of
    the uninterrupted run, bit for bit."""
    full = tmp_path / "full"
    torchrun(tiny_args(char_dataset, full, **RESTART_RUN))
    kill_step = random.choice([3, 5])
    out = killed_and_restarted(tmp_path, tiny_args(char_dataset, tmp_path / "killed", **RESTART_RUN), kills=2,
                               kill_step=f"0:1:{kill_step}", kill_save="1:0:1")
    resumed = re.findall(r"last.pt holds step (\d+) of this run: continuing it", out)
    assert resumed == [str(kill_step - 1)] * 2, (kill_step, out)
    assert "took over the lock" in out  # the one rank 0 left when it was killed
    assert_same_weights(weights(tmp_path / "killed"), weights(full))
    assert train_losses(tmp_path / "killed") == train_losses(full)


def test_torchrun_restarts_a_killed_fsdp_run(char_dataset, tmp_path):
    """The same under FSDP: a sharded last/ at step 2, a process killed in step 3, the restart continues from
    last/ and ends with the uninterrupted run's weights, bit for bit."""
    run = dict(RESTART_RUN, parallel="fsdp", max_iters=4, lr_decay_iters=4)
    full, killed = tmp_path / "full", tmp_path / "killed"
    torchrun(tiny_args(char_dataset, full, **run))
    out = killed_and_restarted(tmp_path, tiny_args(char_dataset, killed, **run), kills=1, kill_step="0:1:3")
    assert f"resume=auto: {killed}/last holds step 2 of this run: continuing it" in out
    assert_same_weights(load_checkpoint(killed / "last")["model"], load_checkpoint(full / "last")["model"])


def readme_multi_node_command() -> list[str]:
    """The README's command for each node of a multi-node run (from its "Past one GPU" section)."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text[text.index("\n### Past one GPU"):]
    section = section[:section.index("\n### ", 1)]
    lines = [line for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S) for line in block.splitlines()
             if "--nnodes=2" in line]
    assert len(lines) == 1, lines
    return shlex.split(lines[0], comments=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_as_the_readme_starts_them_train_as_one_process(char_dataset, tmp_path):
    """The README's multi-node command, run twice on this machine as two nodes of one CPU process each (its
    rendezvous on 127.0.0.1, a free port; the tiny run's settings after its config), trains as one process
    with the same global batch."""
    command = readme_multi_node_command()
    assert command[0] == "torchrun" and "--rdzv-backend=c10d" in command and "train.py" in command
    port = free_port()
    command = [a.replace("NODE0:29500", f"127.0.0.1:{port}").replace("--nproc_per_node=8", "--nproc_per_node=1")
               for a in command]
    at = command.index("train.py")
    settings = tiny_args(char_dataset, tmp_path / "nodes", max_iters=4, eval_interval=2, lr_decay_iters=4,
                         dropout=0.0, hellaswag_interval=0)
    argv = [sys.executable, "-m", "torch.distributed.run", *command[1:at], str(REPO / "train.py"),
            *command[at + 1:], *settings]
    nodes = [subprocess.Popen(argv, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(outputs)
    assert any("DDP over 2 processes" in out for out in outputs)
    config = [str(REPO / a) if a.startswith("configs/") else a for a in command[at + 1:]]
    single([*config, *tiny_args(char_dataset, tmp_path / "one", max_iters=4, eval_interval=2,
                                          lr_decay_iters=4, dropout=0.0, hellaswag_interval=0)])
    a, b = train_losses(tmp_path / "one"), train_losses(tmp_path / "nodes")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6)
    assert_same_weights(weights(tmp_path / "nodes"), weights(tmp_path / "one"), exact=False)


def test_the_sbatch_script_requeues_and_continues():
    """scripts/slurm.sbatch is valid bash; it requeues, asks for SIGUSR1 to its shell before the time limit,
    passes it on to train.py's processes, and starts each node's torchrun as the README's multi-node command
    does, continuing with --resume=auto."""
    script = (REPO / "scripts" / "slurm.sbatch").read_text()
    assert subprocess.run(["bash", "-n", str(REPO / "scripts" / "slurm.sbatch")]).returncode == 0
    assert "#SBATCH --requeue" in script and "#SBATCH --signal=B:USR1@120" in script
    assert "trap on_time_limit USR1" in script and "scontrol requeue" in script and "pkill -USR1" in script
    launch = shlex.split(script[script.index("srun "):].split("&\n")[0].replace("\\\n", " "))
    readme = readme_multi_node_command()
    options = {a.split("=")[0] for a in readme[1:readme.index("train.py")]}
    assert options <= {a.split("=")[0] for a in launch}, options
    assert launch[-1] == "--resume=auto" and readme[-1] == "--resume=auto"
