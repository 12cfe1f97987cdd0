"""nanoGPT beside ours in the same call, from a copy of its own code: the nanogpt part (its bench.py, the
denominator of the speed-up at 12 x 1024) and nanogpt_train (not in the default run: its train_shakespeare_char
until its first val loss at or below --val_loss, timed from its start)."""

from __future__ import annotations

import re
import shlex
import shutil
import time
from pathlib import Path

from benchmarks.gpu_check.check import Check, Run, outcome
from benchmarks.gpu_check.common import ROOT, option, python, shakespeare_text, shown
from benchmarks.gpu_check.figures import h200, on_h200

# nanoGPT, run beside ours in the same call (its own code, from shared/anchors/nanoGPT): its bench.py (GPT-2 124M
# without biases at 12 x 1024, compiled, random tokens) and its train_shakespeare_char config, stopped at the first
# val loss at or below --val_loss or at step 1,750 (its best val, ~1.473 on an H200, came there).
NANOGPT_FILES = ("bench.py", "train.py", "model.py", "configurator.py", "config/train_shakespeare_char.py",
                 "data/shakespeare_char/prepare.py")
NANOGPT_BENCH = ("bench.py", "--real_data=False", "--compile=True")
NANOGPT_TRAIN = ("train.py", "config/train_shakespeare_char.py", "--max_iters=1750")
# ... in --smoke: no bench.py (it needs CUDA), its training shrunk to seconds on the CPU
SMOKE_NANOGPT_TRAIN = ("train.py", "config/train_shakespeare_char.py", "--device=cpu", "--compile=False",
                       "--dtype=float32", "--max_iters=60", "--eval_interval=20", "--eval_iters=2", "--log_interval=5",
                       "--n_layer=2", "--n_head=2", "--n_embd=64", "--block_size=32", "--batch_size=8",
                       "--learning_rate=3e-3", "--warmup_iters=5")
NANOGPT_MS_LINE = re.compile(r"^time per iteration: (?P<ms>[\d.]+)ms, MFU: (?P<mfu>-?[\d.]+)%", re.M)
NANOGPT_EVAL_LINE = re.compile(r"^step (?P<step>\d+): train loss (?P<train>[\d.]+), val loss (?P<val>[\d.]+)", re.M)
NANOGPT_ITER_LINE = re.compile(r"^iter (?P<step>\d+): loss [\d.]+, time (?P<ms>[\d.]+)ms", re.M)


def nanogpt_dir(given: str | None) -> Path | None:
    """nanoGPT's own code: --nanogpt, or shared/anchors/nanoGPT in the checkout or beside it; None without."""
    candidates = [Path(given)] if given else [ROOT / "shared/anchors/nanoGPT", ROOT.parent / "shared/anchors/nanoGPT"]
    return next((p for p in candidates if all((p / name).is_file() for name in NANOGPT_FILES)), None)


def nanogpt_commands(smoke: bool, part: str = "nanogpt") -> list[tuple[str, list[str]]]:
    """nanoGPT's runs of a part (nanogpt: its bench.py, which needs CUDA, so none in --smoke; nanogpt_train: its
    train_shakespeare_char, shrunk in --smoke), each (what, command), run in a copy of its folder (its scripts
    read ./data, ./config)."""
    if part == "nanogpt":
        return [] if smoke else [("nanoGPT bench.py", python(*NANOGPT_BENCH))]
    if smoke:
        return [("nanoGPT train_shakespeare_char (shrunk)", python(*SMOKE_NANOGPT_TRAIN))]
    return [("nanoGPT train_shakespeare_char", python(*NANOGPT_TRAIN))]


def nanogpt_results(output: str) -> dict:
    """What nanoGPT's scripts printed: bench.py's ms per iteration and MFU; train.py's evaluations (step, train
    and val loss) and the median of its iter lines' ms from step 100 on (its first steps compile)."""
    bench = NANOGPT_MS_LINE.search(output)
    evals = [{"step": int(m["step"]), "train_loss": float(m["train"]), "val_loss": float(m["val"])}
             for m in NANOGPT_EVAL_LINE.finditer(output)]
    iters = [(int(m["step"]), float(m["ms"])) for m in NANOGPT_ITER_LINE.finditer(output)]
    late = sorted(ms for step, ms in iters if step >= 100) or sorted(ms for _, ms in iters[1:])
    return {"bench_ms": float(bench["ms"]) if bench else None, "bench_mfu": float(bench["mfu"]) / 100 if bench else None,
            "evaluations": evals, "iter_ms_median": late[len(late) // 2] if late else None}


def part_nanogpt(check: Check, args) -> dict:
    """nanoGPT's bench.py beside ours in this call (the denominator of vs_nanogpt: GPT-2 124M without biases at
    12 x 1024, compiled, random tokens), from a copy of its folder."""
    if check.smoke:
        return {"status": "skipped", "runs": [], "reason": "--smoke: nanoGPT's bench.py needs CUDA",
                "bench": {"skipped": "--smoke: nanoGPT's bench.py needs CUDA"}}
    return nanogpt_part(check, args, "nanogpt")


def part_nanogpt_train(check: Check, args) -> dict:
    """nanoGPT's train_shakespeare_char beside ours (--parts=nanogpt_train: its figure is recorded, see
    H200's nanogpt_to_val_s), until its first val loss <= --val_loss (or step 1,750), timed from its start."""
    return nanogpt_part(check, args, "nanogpt_train")


def nanogpt_part(check: Check, args, name: str) -> dict:
    """A nanoGPT part's runs from a copy of its folder, with its own model.py (not ours); for its training, its
    prepare.py on tiny Shakespeare first."""
    source = nanogpt_dir(args.nanogpt)
    if source is None:
        return {"status": "skipped", "runs": [], "reason": "no anchor: nanoGPT's code is not at "
                "shared/anchors/nanoGPT (in the checkout or beside it); pass --nanogpt=PATH"}
    training = name == "nanogpt_train"
    text = shakespeare_text(args.shakespeare_text)
    if training and text is None:
        return {"status": "skipped", "runs": [], "reason": "no anchor: no tiny Shakespeare text for nanoGPT's data: "
                "pass --shakespeare_text=PATH, or put it at shared/data/tinyshakespeare.txt"}
    copy = check.tmp / "nanoGPT"
    for file in NANOGPT_FILES:  # (the files alone: the folder's own modes may be read-only)
        (copy / file).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / file, copy / file)
    env = {"PYTHONPATH": ""}  # nanoGPT's own model.py, not ours
    needs = [need for _, need in run_needs(name, check.smoke)]  # (its prepare.py first, for the training)
    runs: list[Run | None] = []
    labels: list[str] = []
    if training:
        shutil.copyfile(text, copy / "data/shakespeare_char/input.txt")  # (its prepare.py downloads it otherwise)
        # its prepare.py imports requests, which it needs only for the download
        stub = "import runpy, sys, types\ntry:\n    import requests\nexcept ImportError:\n    sys.modules['requests'] " \
               "= types.ModuleType('requests')\nrunpy.run_path('data/shakespeare_char/prepare.py', run_name='__main__')"
        runs.append(check.run("nanoGPT prepare shakespeare_char", python("-c", stub), env=env, cwd=copy,
                              limit_s=check.share(needs[0], sum(needs[1:]))))
        labels.append("nanoGPT's prepare.py")
    result: dict = {}
    if not runs or (runs[0] is not None and runs[0].status == "ok"):
        for i, (label, command) in enumerate(nanogpt_commands(check.smoke, name), start=len(runs)):
            started, seen = time.monotonic(), {}

            def watch(seen=seen, started=started) -> bool:  # each evaluation's wall seconds from the start
                evals = nanogpt_results(check.output_so_far())["evaluations"]
                for e in evals:
                    seen.setdefault(e["step"], round(time.monotonic() - started, 1))
                return any(e["val_loss"] <= args.val_loss for e in evals)

            run = check.run(label, command, watch if training else None, env=env, cwd=copy,
                            limit_s=check.share(needs[i], sum(needs[i + 1:])))
            runs.append(run)
            labels.append(label)
            found = nanogpt_results(run.output) if run else nanogpt_results("")
            record = {"command": shlex.join(command), "status": run.status if run else "not started"}
            if training:
                evals = [{**e, "wall_s": seen.get(e["step"])} for e in found["evaluations"]]
                hit = next((e for e in evals if e["val_loss"] <= args.val_loss), None)
                best = min(evals, key=lambda e: e["val_loss"], default=None)
                result["train"] = record | {"evaluations": evals, "reached": hit, "best": best,
                                            "iter_ms_median": found["iter_ms_median"]}
            else:
                result["bench"] = record | {"ms": found["bench_ms"], "mfu": found["bench_mfu"]}
    status, reason = outcome(runs, labels)
    return {"status": status, "reason": reason, "runs": [r.record() for r in runs if r], **result}


def run_needs(name: str, smoke: bool) -> list[tuple[str, float]]:
    """The nanogpt (or nanogpt_train) part's runs: its bench.py; or its prepare.py, then its training (start,
    compile, steps and evaluations)."""
    needs = [("nanoGPT prepare shakespeare_char", h200("nanogpt_prepare_s"))] if name == "nanogpt_train" else []
    for label, command in nanogpt_commands(smoke, name):
        if "bench.py" in command:
            needs.append((label, h200("nanogpt_bench_s")))
        else:
            steps = float(option(command, "max_iters"))
            evals = steps // float(option(command, "eval_interval") or h200("nanogpt_eval_interval"))
            needs.append((label, h200("nanogpt_start_s") + h200("nanogpt_compile_s")
                          + steps * h200("nanogpt_ms") / 1000 + evals * h200("nanogpt_eval_s")))
    return on_h200(needs, smoke)


def commands(name: str, smoke: bool, args) -> list[str]:
    where = nanogpt_dir(args.nanogpt)
    if where is None:
        return ["no anchor: nanoGPT's code not found (shared/anchors/nanoGPT; --nanogpt=PATH)"]
    return [f"(in a copy of {where}) " + shown(command) for _, command in nanogpt_commands(smoke, name)] or [
        "nothing in --smoke (its bench.py needs CUDA)"]
