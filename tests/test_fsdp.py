"""FSDP (--parallel=fsdp) on the CPU through torchrun and gloo: the same training as one process, sharded
checkpoints that survive a kill and reshard to other job sizes, the readers, the memory per process, and
--parallel=auto's choice."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import train_script

from gptkit import parallel, plan
from gptkit.checkpoint import is_sharded_checkpoint, load_checkpoint, saved_checkpoint
from gptkit.runtime import Runtime
from model import GPT, GPTConfig
from tests.conftest import torch_threads
from tests.test_train import tiny_args as train_args

train = train_script()

REPO = Path(__file__).resolve().parents[1]

# The recipes each compared with one process (dropout 0, fp32, 20 steps): GPT-2's (AdamW) and the modern
# block with Muon (whole matrices gathered for its Newton-Schulz), each with one and with two micro-batches per
# process (the gradients reduce-scattered after each), the latter with activation checkpointing; and LoRA on a
# trained GPT-2-style base (frozen base sharded, adapters trained by AdamW). GPT-2's with one micro-batch saves
# with --async_save (its shards written by DCP's async_save, at steps 10 and 20), the others synchronously. The
# modern block with Muon runs under DDP as well.
RECIPES = {
    "gpt2_async_save": dict(gradient_accumulation_steps=2, async_save=True),
    "gpt2_accumulation": dict(gradient_accumulation_steps=4, batch_size=2),
    "modern_muon": dict(gradient_accumulation_steps=2, arch="modern", optimizer="muon"),
    "gpt2_lora": dict(gradient_accumulation_steps=2, lora_rank=4, lora_alpha=8, lora_dropout=0.0,
                      learning_rate=1e-2),
    "modern_muon_accumulation": dict(gradient_accumulation_steps=4, batch_size=2, arch="modern", optimizer="muon",
                                     lr_schedule="wsd", cooldown_frac=0.5, min_lr=0.0, activation_checkpointing=True),
}


def tiny_args(data, out, **over):
    """test_train's tiny run, 20 steps long and without dropout (so that processes and one process agree)."""
    return train_args(data, out, **{"max_iters": 20, "eval_interval": 10, "lr_decay_iters": 20, "dropout": 0.0,
                                    **over})


def torchrun(n: int, args: list[str], script: Path = REPO / "train.py", check: bool = True):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", str(script), *args]
    res = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                         timeout=240)
    if check:
        assert res.returncode == 0, res.stdout + res.stderr
    return res


# A torchrun worker: one run after another in the same processes (starting a process and importing torch costs
# each of them seconds; the runs are independent), each given in the JSON file it is handed: train.py's main for
# an argument list, or {"script": path, "argv": [...]}, a script run as __main__. Each run's process group gets
# keys of its own in torchrun's store, as a restarted attempt's do.
EACH = """
import json, os, runpy, sys
sys.path.insert(0, {repo!r})
sys.path.insert(0, {tests!r}); from conftest import train_script; train = train_script()
for i, run in enumerate(json.loads(open(sys.argv[1]).read())):
    os.environ["TORCHELASTIC_RESTART_COUNT"] = f"run{{i}}"
    if isinstance(run, dict):
        sys.argv = [run["script"], *run.get("argv", [])]
        runpy.run_path(run["script"], run_name="__main__")
    else:
        train.main(run)
"""


def torchrun_each(n: int, runs: list, tmp_path: Path) -> subprocess.CompletedProcess:
    """Each of runs (train.py's argument lists, or {"script": path, "argv": [...]}) on n processes, in one
    torchrun job (EACH): its output."""
    worker, listed = tmp_path / "each_worker.py", tmp_path / "each_runs.json"
    worker.write_text(EACH.format(repo=str(REPO), tests=str(REPO / "tests")))
    listed.write_text(json.dumps(runs))
    return torchrun(n, [str(listed)], script=worker)


def single(args: list[str]) -> dict:
    with torch_threads(1):
        return train.main(args)


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def losses(out) -> dict[int, float]:
    """The training loss of every step (a resumed run's steps replace the earlier run's)."""
    return {m["step"]: m["loss"] for m in metrics(out) if "loss" in m}


def assert_close_losses(got: dict, want: dict, steps) -> None:
    for step in steps:
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-6), (step, got[step], want[step])


def test_fsdp_trains_as_one_process_does(char_dataset, tmp_path):
    """2 processes under FSDP == 1 process with the same global batch, for each recipe: every step's loss, every
    val loss, the saved model. And the modern recipe with Muon under DDP too (Muon on the all-reduced gradients;
    one writer of the run's files). (The recipes' 2-process runs in one torchrun job, one after another.)"""
    ones, runs = {}, {}
    for recipe, over in RECIPES.items():
        over = dict(over)
        if over.get("lora_rank"):
            base = tmp_path / "base"
            single(tiny_args(char_dataset, base, max_iters=3, eval_interval=3))
            over["init_from"] = str(base)
        ones[recipe] = tmp_path / recipe / "one"
        single(tiny_args(char_dataset, ones[recipe], **over))
        for how in ("fsdp", "ddp") if recipe == "modern_muon" else ("fsdp",):
            out = tmp_path / recipe / how
            runs[recipe, how] = (out, tiny_args(char_dataset, out, parallel=how, **over))
    res = torchrun_each(2, [args for _, args in runs.values()], tmp_path)
    assert res.stdout.count("parallel: FSDP over 2 processes (--parallel=fsdp)") == len(RECIPES), res.stdout
    assert res.stdout.count("parallel: DDP over 2 processes (--parallel=ddp)") == 1, res.stdout
    for (recipe, how), (two, _) in runs.items():
        one = ones[recipe]
        a, b = metrics(one), metrics(two)
        assert [m["step"] for m in a] == [m["step"] for m in b], recipe  # one writer: no duplicated lines
        for x, y in zip(a, b):
            for key in ("loss", "val_loss"):
                if key in x:
                    assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-6), (recipe, how, x["step"], key)
        if how == "fsdp":
            assert is_sharded_checkpoint(two / "last") and not (two / "last.pt").exists(), recipe
        else:
            assert sorted(p.name for p in two.iterdir()) == ["best.pt", "config.json", "last.pt", "metrics.jsonl",
                                                            "runs.jsonl"]
            assert json.loads((two / "runs.jsonl").read_text())["world_size"] == 2
        want, got = load_checkpoint(one / "last.pt")["model"], load_checkpoint(two)["model"]
        assert want.keys() == got.keys(), recipe  # a LoRA run's adapters only; the tied head under its own name too
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5, msg=f"{recipe} {how}: {k}")


# A torchrun worker: train.py, except that the third save into a last.tmp/ folder (step 6 of a run saving last/
# at steps 2, 4 and 6) is killed with SIGKILL halfway: the even ranks write their shards, then every rank kills
# itself (the odd ones first waiting until rank 0's shard is on disk), as a job killed by the OOM killer or a
# scheduler would be, lock and all.
KILLED_SAVE = """
import os, signal, sys, time
from pathlib import Path
from torch.distributed.checkpoint import filesystem
sys.path.insert(0, {repo!r})
original, saves = filesystem._FileSystemWriter.write_data, []

def write_data(self, plan, planner):
    if Path(self.path).name == "last.tmp":
        saves.append(self.path)
    if len(saves) < 3:
        return original(self, plan, planner)
    rank = int(os.environ["RANK"])
    if rank % 2 == 0:
        original(self, plan, planner).wait()
    else:
        deadline = time.time() + 30
        while not list(Path(self.path).glob("__0_*.distcp")) and time.time() < deadline:
            time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)

filesystem._FileSystemWriter.write_data = write_data
import sys; sys.path.insert(0, "tests"); from conftest import train_script; train = train_script()
train.main(sys.argv[1:])
"""


def test_a_sharded_checkpoint_survives_a_kill_and_resumes_under_fsdp_ddp_and_one_process(char_dataset, tmp_path,
                                                                                         capsys):
    """A run on 2 processes (2 micro-batches each) saves last/ at steps 2 and 4 and is killed (SIGKILL) in the
    middle of its save at step 6. last/ still holds step 4; from it a run on 2 processes under FSDP continues bit
    for bit as the killed run went on; under DDP (--parallel=auto's choice) and on 1 process (4 micro-batches)
    it continues within float32 rounding, and the single process takes over the lock the killed job left. A
    single-file last.pt (that run's) resumes under FSDP on 2 processes too, as one process continues it: the
    shards are cut anew each way, fewer processes and more."""
    killed = tmp_path / "killed"
    worker = tmp_path / "killed_save.py"
    worker.write_text(KILLED_SAVE.format(repo=str(REPO)))
    args = dict(batch_size=2, gradient_accumulation_steps=4, max_iters=6, eval_interval=2, parallel="fsdp")
    res = torchrun(2, tiny_args(char_dataset, killed, **args), script=worker, check=False)
    assert res.returncode != 0
    reference = losses(killed)  # steps 1..6 of the run, logged before its last save
    assert sorted(reference) == [1, 2, 3, 4, 5, 6]
    assert saved_checkpoint(killed, "last") == killed / "last"
    assert load_checkpoint(killed / "last")["step"] == 4  # the previous checkpoint, whole
    partial = killed / "last.tmp"
    assert (partial / "__0_0.distcp").is_file() and not (partial / ".metadata").exists()
    assert (killed / ".lock").exists()  # left by rank 0, killed
    for name in ("fsdp", "ddp", "on1"):
        shutil.copytree(killed, tmp_path / name)

    resume = dict(args, init_from="resume")
    capsys.readouterr()
    single(tiny_args(char_dataset, tmp_path / "on1", **resume))
    assert "took over the lock" in capsys.readouterr().out
    assert_close_losses(losses(tmp_path / "on1"), reference, (5, 6))
    # last.pt (one process') under FSDP, against that process going on alone
    shutil.copytree(tmp_path / "on1", tmp_path / "file_to_fsdp")
    longer = dict(resume, max_iters=8, lr_decay_iters=8)
    single(tiny_args(char_dataset, tmp_path / "on1", **longer))

    # the three 2-process resumes in one torchrun job: FSDP, --parallel=auto (DDP), and FSDP from last.pt
    res = torchrun_each(2, [tiny_args(char_dataset, tmp_path / "fsdp", **resume),
                            tiny_args(char_dataset, tmp_path / "ddp", **dict(resume, parallel="auto")),
                            tiny_args(char_dataset, tmp_path / "file_to_fsdp", **longer)], tmp_path)
    assert {s: losses(tmp_path / "fsdp")[s] for s in (5, 6)} == {s: reference[s] for s in (5, 6)}  # bit for bit
    assert not (tmp_path / "fsdp" / "last.tmp").exists()  # the next save cleared what the killed one left

    assert res.stdout.count("parallel: DDP over 2 processes (a whole replica fits each device") == 1  # auto's
    assert_close_losses(losses(tmp_path / "ddp"), reference, (5, 6))
    assert (tmp_path / "ddp" / "last.pt").is_file() and not (tmp_path / "ddp" / "last").exists()  # DDP's file

    assert_close_losses(losses(tmp_path / "file_to_fsdp"), losses(tmp_path / "on1"), (7, 8))


def test_the_readers_take_a_sharded_checkpoint(char_dataset, tmp_path):
    """sample.py, eval.py, export.py, chat.py and serve.py load through checkpoint.load_model: a sharded folder
    (here written by one process: the reading is the same for any number) gives the same model as today's
    file, and export.py --format pt makes that file of it."""
    import export
    from gptkit import checkpoint

    out, run = tmp_path / "out", tmp_path / "run"
    single(tiny_args(char_dataset, run, max_iters=2, eval_interval=2))
    state = load_checkpoint(run / "last.pt")
    model = checkpoint.model_from_checkpoint(state)
    optimizer = torch.optim.AdamW(model.parameters())
    record = {k: v for k, v in state.items() if k not in ("model", "optimizer")}
    checkpoint.save_sharded(out / "last", record, model, optimizer)
    assert saved_checkpoint(out, "last") == out / "last"
    export.main(["--ckpt", str(out), "--format", "pt", "--out", str(tmp_path / "one.pt")])
    file = load_checkpoint(tmp_path / "one.pt")
    assert "optimizer" not in file and file["step"] == 2
    a, tok_a, what = checkpoint.load_model(str(out))
    b, tok_b, _ = checkpoint.load_model(str(run / "last.pt"))
    assert what.startswith(str(out / "last")) and tok_a.vocab_size == tok_b.vocab_size
    x = torch.randint(tok_a.vocab_size, (2, 16))
    assert torch.equal(a(x)[0], b(x)[0])
    # a save killed between its two renames leaves the previous folder as last.old/, and no last/: it is found
    (out / "last").rename(out / "last.old")
    assert saved_checkpoint(out, "last") == out / "last.old" and load_checkpoint(out)["step"] == 2


# A torchrun worker: HellaSwag's scoring (train.py's hellaswag_scores: model.hidden_states and model.head called
# directly, the ranks scoring different numbers of batches) of a sharded model, before any training step, inside
# parallel.gathered; then a training step, which must still work. Prints the scores of the plain model and the
# sharded one as JSON.
HELLASWAG = """
import json, random, sys, torch
sys.path.insert(0, {repo!r})
from gptkit import hellaswag, parallel, plan
from gptkit.config import TrainConfig
from gptkit.runtime import distributed
from model import GPT, GPTConfig
random.seed(0)
items = [hellaswag.Encoded(rows=tuple(tuple(random.randrange(67) for _ in range(random.randint(5, 20)))
                                      for _ in range(4)), ending_lengths=(2, 3, 2, 4), label=random.randrange(4))
         for _ in range(37)]
with distributed("cpu", "float32") as (d, rt):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=67, n_layer=2, n_head=2, n_embd=32, block_size=32, dropout=0.0))
    alone = hellaswag.score(model, items, rt, None, batch_items=2)
    cfg = TrainConfig(parallel="fsdp", block_size=32, batch_size=2, gradient_accumulation_steps=d.world_size)
    wrapped = parallel.wrap(model, plan.decide_parallel(model, cfg, d, rt, False)[0], rt, use_compile=False)
    with parallel.gathered(wrapped):
        sharded = hellaswag.score(model, items, rt, d, batch_items=2)
    x = torch.randint(67, (2, 32))
    wrapped(x, x)[1].backward()
    if d.master:
        print(json.dumps({{"alone": alone, "sharded": sharded}}))
"""


def test_a_sharded_model_scores_hellaswag_and_each_process_holds_a_shard(tmp_path):
    """In one torchrun job of 2 processes, one check after the other: HellaSwag's scores of a sharded model are
    the plain model's (HELLASWAG); and parameters, gradients and optimizer states on each process after a step
    are at most half of one process' bytes plus the largest unit gathered whole (benchmarks/fsdp_memory.py's
    worker; the plan's figure too)."""
    sys.path.insert(0, str(REPO))
    from benchmarks.fsdp_memory import measure

    worker, result = tmp_path / "hellaswag_worker.py", tmp_path / "fsdp_memory.json"
    worker.write_text(HELLASWAG.format(repo=str(REPO)))
    res = torchrun_each(2, [{"script": str(worker)},
                            {"script": str(REPO / "benchmarks" / "fsdp_memory.py"),
                             "argv": ["--worker", "--shape", "tiny", "--result", str(result)]}], tmp_path)
    scores = json.loads(next(line for line in res.stdout.splitlines() if line.startswith('{"alone"')))
    assert scores["sharded"] == scores["alone"] and scores["alone"]["n"] == 37

    with torch_threads(1):
        alone = measure("tiny")  # (in this process)
    sharded = json.loads(result.read_text())
    whole = sum(alone["ranks"][0].values())
    assert sharded["world_size"] == 2 and len(sharded["ranks"]) == 2
    for held in sharded["ranks"]:
        assert sum(held.values()) <= whole / 2 + sharded["largest_unit"], held
    assert sharded["largest_unit"] < whole / 2  # (else the bound above would hold without any sharding)
    assert sum(sharded["plan"].values()) == pytest.approx(max(sum(h.values()) for h in sharded["ranks"]), rel=0.05)


def test_auto_chooses_ddp_when_a_replica_fits_and_fsdp_when_not():
    model = GPT(GPTConfig(vocab_size=67, n_layer=2, n_head=2, n_embd=32, block_size=32, dropout=0.0))
    setup = plan.Setup("cpu", torch.float32, 32, world_size=4)
    ddp = plan.memory(model, setup, 4).peak
    fsdp = plan.memory(model, plan.Setup("cpu", torch.float32, 32, world_size=4, parallel="fsdp"), 4).peak
    assert fsdp < ddp
    choice, why = plan.parallel_for("auto", model, setup, capacity=ddp * 2, batch_size=4)
    assert choice == "ddp" and "a whole replica fits" in why
    choice, why = plan.parallel_for("auto", model, setup, capacity=(ddp + fsdp) / 2, batch_size=4)
    assert choice == "fsdp" and "FSDP over 4 devices" in why
    assert plan.parallel_for("fsdp", model, setup, capacity=ddp * 2, batch_size=4)[0] == "fsdp"
    assert plan.parallel_for("ddp", model, setup, capacity=1, batch_size=4)[0] == "ddp"


def test_fsdp_with_float16_is_a_one_line_error():
    rt = Runtime(device=torch.device("cuda"), dtype=torch.float16)  # (never touched: refused first)
    with pytest.raises(parallel.ParallelError, match="use --dtype=bfloat16, or --parallel=ddp"):
        parallel.shard(GPT(GPTConfig(vocab_size=67, n_layer=1, n_head=2, n_embd=32, block_size=32)), rt, False)
