"""Checkpoints written in the background (train.py --async_save=True, gptkit/checkpoint/background.py): the copy
is what is saved however the state changes after it, the file is the one a synchronous save writes (atomic,
checksummed), saves happen in order, a failed write is raised, and a process killed mid-write leaves the previous
checkpoint whole."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import train_script

from gptkit import checksum
from gptkit.checkpoint import load_checkpoint, save_checkpoint
from gptkit.checkpoint.background import CheckpointSaver
from tests.test_checksum import sharded, tiny_state
from tests.test_train import assert_same_weights, tiny_args, weights

train = train_script()

REPO = Path(__file__).resolve().parents[1]


def test_the_copy_is_saved_whatever_the_state_becomes(tmp_path):
    state, model = tiny_state()
    want = {k: t.clone() for k, t in checksum.tensors(state)}
    with CheckpointSaver(background=True) as saver:
        saver.save(state, tmp_path / "last.pt")
        with torch.no_grad():  # the next steps change the live tensors while the file is written
            for _, t in checksum.tensors(state):
                t.add_(1)
    loaded = load_checkpoint(tmp_path / "last.pt", mmap=False)
    got = dict(checksum.tensors(loaded))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    # the tied head is stored once, as a synchronous save stores it
    assert loaded["model"]["lm_head.weight"].data_ptr() == loaded["model"]["transformer.wte.weight"].data_ptr()


def test_saves_happen_in_order_and_a_second_waits_for_the_first(tmp_path, monkeypatch):
    import gptkit.checkpoint.background as background

    release, writing, order = threading.Event(), threading.Event(), []

    def slow_save(obj, path):  # the first write holds until released
        if not order:
            writing.set()
            release.wait()
        order.append(obj["step"])
        save_checkpoint(obj, path)

    monkeypatch.setattr(background, "save_checkpoint", slow_save)
    state, _ = tiny_state()
    saver = CheckpointSaver(background=True)
    saver.save({**state, "step": 1}, tmp_path / "last.pt")  # returns with the write pending
    assert writing.wait(60) and saver.pending
    second = threading.Thread(target=saver.save, args=({**state, "step": 2}, tmp_path / "last.pt"))
    second.start()
    second.join(0.5)
    assert second.is_alive() and order == []  # waiting for the first
    release.set()
    second.join()
    saver.wait()
    assert order == [1, 2] and load_checkpoint(tmp_path / "last.pt")["step"] == 2


def test_a_failed_background_write_is_raised_by_the_next_call(tmp_path):
    state, _ = tiny_state()
    (tmp_path / "file").write_text("")
    saver = CheckpointSaver(background=True)
    saver.save(state, tmp_path / "file" / "last.pt")  # its folder is a file
    with pytest.raises(OSError):
        saver.wait()
    saver.wait()  # raised once


def test_a_sharded_checkpoint_saved_in_the_background_equals_one_saved_in_the_caller(tmp_path):
    folder, state = sharded(tmp_path / "sync")
    _, model = tiny_state()
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer.load_state_dict(state["optimizer"])
    record = {k: v for k, v in state.items() if k not in ("model", "optimizer")}
    with CheckpointSaver(background=True) as saver:
        saver.save_sharded(tmp_path / "async" / "last", record, model, optimizer)
    a = load_checkpoint(folder, mmap=False)
    b = load_checkpoint(tmp_path / "async" / "last", mmap=False)  # every checksum verified
    assert_same_weights(a["model"], b["model"])
    assert not (tmp_path / "async" / "last.tmp").exists()


# A process that saves step 1, then saves step 2 in the background with a writer that stops halfway through the
# file; it says when the write has started and when save() has returned, then waits to be killed.
KILLED_MID_WRITE = r"""
import os, sys, threading, torch
import gptkit.checkpoint.file as file
from gptkit.checkpoint import save_checkpoint
from gptkit.checkpoint.background import CheckpointSaver

path = sys.argv[1]
state = {"format": 1, "model_config": {}, "model": {"w": torch.arange(1 << 20, dtype=torch.float32)}, "step": 1}
save_checkpoint(state, path)
real_save = torch.save

def halfway(obj, f, *args, **kwargs):
    f.write(b"PK" + bytes(1 << 16))  # the start of a file, then the writer stops
    f.flush()
    os.write(1, b"writing\n")  # (one write: the two threads' lines never mix)
    threading.Event().wait()

file.torch.save = halfway
saver = CheckpointSaver(background=True)
saver.save({**state, "step": 2}, path)
os.write(1, b"returned\n")
threading.Event().wait()
"""


def test_a_process_killed_mid_write_leaves_the_previous_checkpoint(tmp_path):
    path = tmp_path / "last.pt"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_MID_WRITE, str(path)], cwd=REPO, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        said = {proc.stdout.readline().strip(), proc.stdout.readline().strip()}
        assert said == {"writing", "returned"}  # the loop went on while the file was being written
        assert (tmp_path / "last.pt.tmp").exists()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    loaded = load_checkpoint(path, mmap=False)
    assert loaded["step"] == 1 and torch.equal(loaded["model"]["w"], torch.arange(1 << 20, dtype=torch.float32))


def test_train_with_async_save_writes_the_same_checkpoints(char_dataset, tmp_path):
    sync, background = tmp_path / "sync", tmp_path / "async"
    args = dict(max_iters=4, eval_interval=2, lr_decay_iters=4, always_save_checkpoint=True)
    train.main(tiny_args(char_dataset, sync, **args))
    train.main(tiny_args(char_dataset, background, async_save=True, **args))
    for name in ("last.pt", "best.pt"):
        assert_same_weights(weights(sync, name), weights(background, name))
    a, b = load_checkpoint(sync / "last.pt", mmap=False), load_checkpoint(background / "last.pt", mmap=False)
    assert a["step"] == b["step"] == 4
    for (k, x), (_, y) in zip(checksum.tensors(a["optimizer"]), checksum.tensors(b["optimizer"])):
        assert torch.equal(x, y), k


def test_fsdp_with_async_save_trains_and_saves_as_one_process(char_dataset, tmp_path):
    """Two processes under FSDP (gloo), their shards written by DCP's async_save: the sharded checkpoint holds
    what one process trains."""
    from tests.test_fsdp import single, torchrun
    from tests.test_fsdp import tiny_args as fsdp_args

    one, fsdp = tmp_path / "one", tmp_path / "fsdp"
    single(fsdp_args(char_dataset, one, max_iters=6, eval_interval=3, lr_decay_iters=6))
    torchrun(2, fsdp_args(char_dataset, fsdp, max_iters=6, eval_interval=3, lr_decay_iters=6, parallel="fsdp",
                          async_save=True))
    want, got = load_checkpoint(one / "last.pt")["model"], load_checkpoint(fsdp, mmap=False)["model"]
    assert load_checkpoint(fsdp)["step"] == 6 and want.keys() == got.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5, msg=k)


# train.py stopped by SIGTERM in the middle of its fifth step with --async_save (the step is cut short: the four
# before it are saved), every background write slowed down so that the save of the stop is still being written
# when the loop ends.
SIGTERM_WITH_A_SLOW_WRITER = r"""
import os, signal, sys, time
import sys; sys.path.insert(0, "tests"); from conftest import train_script; train = train_script()
import gptkit.checkpoint.background as background
from gptkit import step
real_save, real_step = background.save_checkpoint, step.forward_backward
calls = {"n": 0}
def slow_save(obj, path):
    time.sleep(0.5)  # (a delay, not a measurement: the write is pending when the loop ends)
    real_save(obj, path)
def forward_backward(*args, **kwargs):
    calls["n"] += 1
    if calls["n"] == 5:
        os.kill(os.getpid(), signal.SIGTERM)
    return real_step(*args, **kwargs)
background.save_checkpoint, step.forward_backward = slow_save, forward_backward
train.main(sys.argv[1:])
"""


def test_sigterm_with_async_save_waits_for_the_write_and_resumes_exactly(char_dataset, tmp_path):
    from tests.test_train import assert_resume_matches_uninterrupted

    full, cut = tmp_path / "full", tmp_path / "cut"
    args = dict(max_iters=8, eval_interval=3, lr_decay_iters=8, async_save=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", SIGTERM_WITH_A_SLOW_WRITER, *tiny_args(char_dataset, cut, **args)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 143, res.stdout + res.stderr
    assert load_checkpoint(cut / "last.pt", mmap=False)["step"] == 4 and not (cut / "last.pt.tmp").exists()
    assert_resume_matches_uninterrupted(char_dataset, full, cut, **args)
