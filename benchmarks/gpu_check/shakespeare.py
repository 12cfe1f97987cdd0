"""The shakespeare part: train.py on configs/shakespeare.py the fastest way until its first val loss at or below
--val_loss, timed from the process start, then, where the part's time left holds it, as train.py runs by
default (the pair that decides --cuda_graphs' default); and what the steps part shares with it (the data,
prepared once, and train.py's command and need)."""

from __future__ import annotations

import json
import re
import shlex
import time
from pathlib import Path

from benchmarks.gpu_check.check import Check, Run
from benchmarks.gpu_check.common import ROOT, python, read_metrics, shakespeare_text, shown
from benchmarks.gpu_check.figures import h200, on_h200

# The shakespeare part's options on top of configs/shakespeare.py's (--smoke: of the CPU config's, shrunk, and
# without the CUDA graph): the fastest way to its val loss (the graphed step, 2.1-2.4x the plain one's speed on
# the H200 of 2026-11-28, the same val loss at step 1,500), with its saves in the background, so that the
# pinned-memory copy and the writer thread run beside a captured step on a GPU. Then, where the part's time
# (with what earlier parts left) holds its need, train.py as it runs by default, to the same val loss: the pair
# that decides --cuda_graphs' default.
SHAKESPEARE_OPTIONS = ("--async_save=True", "--cuda_graphs=True")


def shakespeare_options(smoke: bool) -> tuple[str, ...]:
    return tuple(o for o in SHAKESPEARE_OPTIONS if not (smoke and o.startswith("--cuda_graphs")))


def shakespeare_data(check: Check, args) -> tuple[Path | None, list[Run], str | None]:
    """The data_root holding shakespeare_char (data/ if prepared there, else prepared once into the check's
    temporary folder), the runs that made it, and why there is none."""
    data_root = ROOT / "data"
    if (data_root / "shakespeare_char" / "meta.json").is_file():
        return data_root, [], None
    data_root = check.tmp / "data"
    if (data_root / "shakespeare_char" / "meta.json").is_file():
        return data_root, [], None
    text = shakespeare_text(args.shakespeare_text)
    prepare = check.python("prepare/shakespeare_char.py", f"--out_dir={data_root / 'shakespeare_char'}",
                           *([f"--input={text}"] if text else []))  # without a copy: a download
    run = check.run("prepare shakespeare_char", prepare)
    if run is not None and run.status == "ok":
        return data_root, [run], None
    why = "no time left" if run is None else f"{run.status}, see the log"
    return None, [run] if run else [], (f"could not prepare tiny Shakespeare ({why}): pass --shakespeare_text=PATH, "
                                        f"or put the text at shared/data/tinyshakespeare.txt")


def shakespeare_command(smoke: bool, data_root: Path, out_dir: Path, *extra: str) -> list[str]:
    """train.py on configs/shakespeare.py (in --smoke: the CPU config, shrunk), writing into out_dir."""
    if smoke:
        command = python("train.py", "configs/shakespeare_cpu.py", "--max_iters=200", "--eval_interval=10",
                         "--eval_iters=2", "--log_interval=10", "--n_layer=2", "--n_head=2", "--n_embd=64",
                         "--block_size=32", "--warmup_iters=5", "--learning_rate=3e-3")
    else:
        command = python("train.py", "configs/shakespeare.py")
    return command + [f"--out_dir={out_dir}", "--overwrite=True", f"--data_root={data_root}", *extra]


def config_value(path: str, key: str) -> float:
    """A number set in one of configs/ (plain `key = value` lines)."""
    m = re.search(rf"^{key}\s*=\s*([\d.]+)", (ROOT / path).read_text(), re.M)
    if m is None:
        raise KeyError(f"{path} sets no {key}")
    return float(m[1])


def train_py_need(command: list[str], steps: float, evals: float, eval_batches: float, warm: bool = False) -> float:
    """train.py on configs/shakespeare.py's model: its start, the evaluation's and the training step's compiles
    (`warm`: from inductor's cache, an earlier run having compiled the same model), `steps` steps (as one CUDA
    graph where the command says so) and `evals` evaluations of `eval_batches` batches."""
    compiles = h200("train_compiles_warm_s") if warm else h200("train_eval_compile_s") + h200("train_compile_s")
    ms = h200("train_graphed_ms" if "--cuda_graphs=True" in command else "train_ms")
    return h200("train_start_s") + compiles + steps * ms / 1000 + evals * h200("train_eval_s") * eval_batches / 200


def to_val_need(command: list[str], warm: bool = False) -> float:
    """train.py on configs/shakespeare.py (`command`) until its val loss reaches the threshold, by the H200's
    figures: the step it came at, with an evaluation every eval_interval."""
    steps = h200("train_val_step")
    evals = steps // config_value("configs/shakespeare.py", "eval_interval") + 1
    return train_py_need(command, steps, evals, config_value("configs/shakespeare.py", "eval_iters"), warm=warm)


def plain_shakespeare_need() -> float:
    """The shakespeare part's second run, as train.py runs it by default (compiling from inductor's cache, warm
    from the graphed run of the same model): started only where the part's time left holds this."""
    return to_val_need(shakespeare_command(False, Path("data"), Path("out"), "--async_save=True"), warm=True)


def train_until_val(check: Check, args, label: str, command: list[str], out_dir: Path) -> tuple[Run | None, dict]:
    """train.py (`command`, writing into out_dir) until its first evaluation at or below args.val_loss, then
    stopped: the run, and what it reached (step, val_loss, elapsed_s from its process start, wall_s), its
    evaluations and its start-up trace (runs.jsonl's start: imports, device, data, model, ...)."""
    metrics, started = out_dir / "metrics.jsonl", time.monotonic()
    reached: dict = {}

    def watch() -> bool:
        if reached:
            return True
        lines = read_metrics(metrics)
        hit = next((e for e in lines if e.get("val_loss") is not None and e["val_loss"] <= args.val_loss), None)
        if hit:
            rates = [e for e in lines if e.get("tokens_per_s") is not None and e["step"] <= hit["step"]]
            reached.update(step=hit["step"], val_loss=hit["val_loss"], elapsed_s=hit["elapsed_s"],
                           wall_s=round(time.monotonic() - started, 1), last_rates=rates[-1] if rates else None)
        return bool(reached)

    run = check.run(label, command, watch)
    watch()  # what it wrote just before it ended
    evals = [{k: e[k] for k in ("step", "val_loss", "elapsed_s")} for e in read_metrics(metrics) if "val_loss" in e]
    return run, {"command": shlex.join(command), "reached": reached or None, "evaluations": evals,
                 "start": start_trace(out_dir)}


def start_trace(out_dir: Path) -> dict | None:
    """train.py's start-up trace from its runs.jsonl (the last invocation's "start": seconds per phase)."""
    try:
        lines = (out_dir / "runs.jsonl").read_text().splitlines()
        return json.loads(lines[-1]).get("start") if lines else None
    except (OSError, ValueError):
        return None


def part_shakespeare(check: Check, args) -> dict:
    """train.py on shakespeare_char, the fastest way (SHAKESPEARE_OPTIONS), until its first evaluation at or below
    args.val_loss; then, where the part's time left holds what it needs, as train.py runs it by default, to the
    same val loss (--smoke: not again, the run being that already)."""
    data_root, runs, why = shakespeare_data(check, args)
    if data_root is None:
        return {"status": "skipped", "runs": [r.record() for r in runs], "reason": why}
    options = shakespeare_options(check.smoke)
    command = shakespeare_command(check.smoke, data_root, check.tmp / "shakespeare_out", *options)
    run, result = train_until_val(check, args, f"train.py {' '.join(options)} until val <= {args.val_loss}", command,
                                  check.tmp / "shakespeare_out")
    runs.append(run)
    result = {"val_threshold": args.val_loss, **result}
    plain: dict = {"skipped": "--smoke: the run above is train.py as it runs by default"} if check.smoke else {}
    need = plain_shakespeare_need()
    if not check.smoke and result["reached"] and check.left() < need:
        plain = {"skipped": f"not enough time left: {check.left():.0f} s, and it needs {need:.0f} s"}
    elif not check.smoke and result["reached"]:
        command = shakespeare_command(check.smoke, data_root, check.tmp / "shakespeare_plain", "--async_save=True")
        plain_run, plain = train_until_val(check, args, f"train.py as it runs by default until val <= "
                                                        f"{args.val_loss}", command, check.tmp / "shakespeare_plain")
        runs.append(plain_run)
        plain["status"] = plain_run.status if plain_run else "not started"
    elif not check.smoke:
        plain = {"skipped": "the run above did not reach the val loss"}
    result = {"runs": [r.record() for r in runs if r], **result, "plain": plain}
    if result["reached"]:
        return {"status": "ok", "reason": None, **result}
    best = min((e["val_loss"] for e in result["evaluations"]), default=None)
    status = "timeout" if run is None or run.status == "timeout" else "failed"
    return {"status": status, "reason": f"train.py ended ({run.status if run else 'not started'}) before val <= "
                                        f"{args.val_loss}; best val {best}", **result}


def run_needs(smoke: bool) -> list[tuple[str, float]]:
    """The data's preparation, then train.py the fastest way to the val loss (the plain run after it is started
    only where the part's time left holds it: not in the need)."""
    command = shakespeare_command(smoke, Path("data"), Path("out"), *shakespeare_options(smoke))
    return on_h200([("prepare shakespeare_char", h200("prepare_s")), ("train.py until val", to_val_need(command))],
                   smoke)


def commands(smoke: bool, args) -> list[str]:
    tmp = Path("TMP")
    graphed = shown(shakespeare_command(smoke, tmp / "data", tmp / "shakespeare_out", *shakespeare_options(smoke)))
    plain = shown(shakespeare_command(smoke, tmp / "data", tmp / "shakespeare_plain", "--async_save=True"))
    return [f"{graphed}  (stopped at the first val <= {args.val_loss})"] + (
        [] if smoke else [f"{plain}  (then, if the part's time left holds its {plain_shakespeare_need():.0f} s)"])
