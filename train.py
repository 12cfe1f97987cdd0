"""Train a GPT on prepared token shards.

    python train.py configs/shakespeare.py                      # one GPU, CPU or MPS
    python train.py configs/shakespeare.py --init_from=resume   # continue exactly where out_dir stopped
    python train.py configs/shakespeare.py --resume=auto        # continue if out_dir holds this run, else start
    python train.py configs/gpt2_124m.py --plan                 # memory, time and cost per device; trains nothing
    torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m.py
    torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m.py --parallel=fsdp  # sharded (auto: if needed)
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=NODE0:29500 --rdzv-id=gpt2 \
        --max-restarts=3 train.py configs/gpt2_124m.py --resume=auto            # on each node; restarts continue

Following one batch: `gptkit/loader.py` reads a window of tokens from the memory-mapped shards (x, y = the window and
the window shifted by one) -> `gptkit/step.py`: `model.py` turns x into logits and the cross-entropy against y ->
backward -> after the last micro-batch, clip and `gptkit/optim.py`'s AdamW step -> `gptkit/metrics.py` logs ->
`gptkit/checkpoint/` saves.

This file: the command (`main`), then `train_loop`, the whole loop on one screen, its saves and its stop. The
run's setup and its state (what a checkpoint holds) are gptkit/run.py's, what it trains toward
gptkit/objectives/', what it continues from gptkit/checkpoint/resume.py's and the step gptkit/step.py's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from gptkit import cli, startup
from gptkit.batch_size import oom_message
from gptkit.checkpoint.resume import check_out_dir, resolve_config, set_aside_damaged_best
from gptkit.checkpoint.run_files import RunFiles
from gptkit.config import TrainConfig
from gptkit.evaluation import evaluate, hellaswag_scores, load_hellaswag
from gptkit.metrics import Metrics
from gptkit.objectives import make_objective
from gptkit.plan_check import check_run_fits, fit_base_context
from gptkit.plan_report import format_plan, make_plan
from gptkit.run import (
    Run,
    TrainError,
    check_accumulation,
    cuts_steps,
    load_dataset,
    lock_out_dir,
    make_metrics,
    rerun_command,
    save,
    setup_run,
    where_checkpoints_are,
)
from gptkit.runtime import Dist, Runtime, distributed, resolve_compile
from gptkit.step import NonFiniteError, StepInterrupted, StepRequests, StopFlag, TrainStep
from gptkit.threads import Threads, resolve_threads

# ----------------------------------------------------------------------------- the loop


def stop_run(run: Run, step: int, best_val: float, start_step: int) -> None:
    """A stop signal: save the last finished step (unless last.pt holds it already) and say what is saved and
    what to run next. A new run stopped before its first step has nothing to save: it says so."""
    if step > start_step:
        save(run, "last.pt", step, best_val)
    if not run.d.master:
        return
    last = f"{run.cfg.out_dir}/last.pt"
    # (resume=auto: the same command)
    again = rerun_command(run.argv, resume=run.cfg.resume != "auto", block_size=run.cfg.block_size)
    if step > start_step or run.cfg.init_from == "resume":  # (resumed: last.pt holds the start step already)
        print(f"stopped at step {step}; {last} holds it; continue with: {again}")
    else:
        print(f"stopped at step {step}, before the first step finished: nothing was saved (no {last}); start "
              f"again with: {rerun_command(run.argv)}")


def train_loop(run: Run, step: int, best_val: float, metrics: Metrics, requests: StepRequests) -> dict:
    cfg, d, stop = run.cfg, run.d, requests.stop
    start_step, val_loss, stopped, save_asked = step, None, False, False
    train_step = TrainStep(run.model, run.optimizer, run.scaler, run.rt, d, cfg, accum=run.accum,
                           objective=run.objective, graphed=run.graphed, stop=stop if cuts_steps(run) else None,
                           blocks=list(run.raw_model.transformer.h))
    while True:
        # ---- evaluate and checkpoint
        if step % cfg.eval_interval == 0 or step >= cfg.max_iters or cfg.eval_only:
            verdict = train_step.settle()  # the last step's flags, before anything is evaluated or saved
            if verdict.bad_step is not None:
                raise NonFiniteError(verdict)
            save_asked |= verdict.save
            try:
                with train_step.cut_short():  # (a stop signal leaves a long evaluation batch too)
                    evaluated = None if verdict.stop else evaluate(run.model, run.val, run.rt, d, stop, run.objective)
            except StepInterrupted:
                evaluated = None
            if evaluated is None:  # a stop signal, before or during the evaluation (evaluated again on resume)
                stop_run(run, step, best_val, start_step)
                stopped = True
                break
            val_loss, val_metrics = evaluated  # (best.pt: by the val loss, DPO's with its anchor as trained)
            improved = val_loss < best_val
            best_val = min(best_val, val_loss)
            scores = {**{f"val_{k}": v for k, v in val_metrics.items()}, **hellaswag_scores(run.model, run.raw_model, run.hellaswag, run.cfg, step, run.rt, d)}
            if step == start_step and run.evaluated:  # (the run it continues logged this evaluation)
                if d.master:
                    print(f"step {step}: val {metrics.label} {val_loss:.4f} (logged in metrics.jsonl before)")
            else:
                metrics.log_eval(step, val_loss, best_val, improved, scores)
            # Step 0 of a fresh run is the random initialisation: not worth a file. A resumed run may start on a
            # step whose evaluation the stopped run never did: an improvement there is saved too.
            if improved and step > 0:
                save(run, "best.pt", step, best_val)
            if step > start_step and (improved or cfg.always_save_checkpoint or step >= cfg.max_iters or save_asked):
                # (on the start step last.pt holds this state)
                save(run, "last.pt", step, best_val, requests, asked=requests.why_saved() if save_asked else "")
            save_asked = False
            if step > start_step:
                metrics.start_timing()  # keep the evaluation out of the step timings
        if cfg.eval_only or step >= cfg.max_iters:
            break

        # ---- one step (gptkit/step.py): learning rate, forward + backward over the micro-batches, clip, the
        # NaN/inf, stop and save flags of every rank (this step's, or on a GPU the previous step's), the update
        try:
            out = train_step(step, run.loader, requests.next)
        except StepInterrupted:  # a stop signal cut the step short: nothing of it kept, the last one saved
            verdict = train_step.settle()
            if verdict.bad_step is not None:
                raise NonFiniteError(verdict) from None
            stop_run(run, step, best_val, start_step)
            stopped = True
            break
        if out.verdict.bad_step is not None:  # that step's update was not applied, nor this one's
            raise NonFiniteError(out.verdict)
        step += 1
        metrics.step_done()
        if step == start_step + 1:
            metrics.start_timing()  # the first step compiles and warms up: it is left out of the rates

        # ---- log (the loss is read every log_interval steps only: on a GPU the loop's one host sync)
        if step % cfg.log_interval == 0 or step == cfg.max_iters:
            loss, grad_norm, extra = out.read(d)
            metrics.log_step(step, loss, out.lr, grad_norm, run.loader.epoch, extra)
        if out.verdict.stop:  # a signal on any rank: every rank leaves after this same step
            stop_run(run, step, best_val, start_step)
            stopped = True
            break
        save_asked = out.verdict.save  # SIGUSR1 or the clock, on any rank: save last.pt, then go on
        if save_asked and step % cfg.eval_interval and step < cfg.max_iters:  # (else with the evaluation)
            save(run, "last.pt", step, best_val, requests, asked=requests.why_saved())
            save_asked = False
    return {"step": step, "val_loss": val_loss, "best_val_loss": best_val, "stopped": stopped}


def train(cfg: TrainConfig, ckpt: dict | None, argv: list[str], d: Dist, rt: Runtime,
          threads: Threads | None = None) -> dict:
    """Run the training loop; returns a summary (final step, last val loss, best val loss). `threads`: torch's
    CPU threads, applied by the caller."""
    data_dir, meta = load_dataset(cfg, d)
    startup.mark("data")
    objective = make_objective(cfg)
    objective.check_dataset(meta, repr(cfg.dataset))  # pairs for DPO, token windows for the next token
    cfg = fit_base_context(cfg, argv, say=d.master)  # a config file's block_size past a fine-tune's base's context
    cfg = objective.fit_block_size(cfg, data_dir, meta, say=d.master)
    hellaswag_items = load_hellaswag(cfg, meta, d)  # now: no network is an error at the start, not at step 5000
    # the plan's peak for one step against this machine's memory, before anything is built or allocated
    check_run_fits(cfg, ckpt, meta, rt.device, rt.dtype, d.world_size,
                   compile=resolve_compile(cfg.compile, rt.device)[0])
    # rank 0: until the first checkpoint, a failure or a stop puts out_dir back as it was (checkpoint/run_files.py)
    files = RunFiles(cfg.out_dir, new=cfg.init_from != "resume") if d.master else None
    try:
        with lock_out_dir(cfg.out_dir, d):
            summary, stop, aside = train_in(cfg, ckpt, argv, d, rt, threads, data_dir, meta, hellaswag_items, files)
    except BaseException:
        if files is not None:
            files.remove_if_empty()  # (the lock released: a folder this run made and left empty)
        raise
    if summary["stopped"]:  # by a signal (on this rank or another): exit as the signal would have
        if files is not None:
            files.remove_if_empty()
        raise SystemExit(stop.exit_code)
    if d.master and not cfg.eval_only:
        chat = bool(meta.get("chat")) or objective.chat  # (a chat model: chat.py is the next step)
        print(where_checkpoints_are(cfg.out_dir, summary, aside, chat=chat))
    return summary


def train_in(cfg: TrainConfig, ckpt: dict | None, argv: list[str], d: Dist, rt: Runtime, threads: Threads | None,
             data_dir: Path, meta: dict, hellaswag_items, files: RunFiles | None) -> tuple[dict, StopFlag, Path | None]:
    """The run, holding out_dir's lock: its summary, its stop flag, and where a damaged best checkpoint was set
    aside. An error or a stop before the first checkpoint leaves out_dir as it found it (`files`, rank 0's)."""
    start, metrics = int((ckpt or {}).get("step", 0)), None
    try:
        check_out_dir(cfg)
        # a resumed run checks best.pt as it checked last.pt: a damaged one is set aside, said in one line
        aside = set_aside_damaged_best(cfg.out_dir, ckpt["best_val_loss"]) if ckpt is not None and d.master else None
        run, step, best_val = setup_run(cfg, ckpt, argv, d, rt, data_dir, meta, threads, files)
        run.hellaswag = hellaswag_items
        metrics = make_metrics(run, step)
        try:
            # (leaving, on a signal or an error too: waits for a pending save)
            with StopFlag(cuts_steps=cuts_steps(run)) as stop, run.saver:
                requests = StepRequests(stop, cfg.checkpoint_interval_s, owns_clock=d.master)
                summary = train_loop(run, step, best_val, metrics, requests)
        except torch.OutOfMemoryError:
            raise TrainError(oom_message(run)) from None
        finally:
            metrics.close()
    except BaseException:
        if files is not None:
            files.failed(trained=metrics is not None and metrics.step > start)
        raise
    if files is not None:  # (a stop, or an eval_only run: no checkpoint saved, an earlier run's files back)
        files.failed(trained=summary["step"] > start or not summary["stopped"])
    return summary, stop, aside


def plan_run(cfg: TrainConfig, ckpt: dict | None, argv: list[str]) -> dict:
    """--plan: print the run's memory, FLOPs, time and cost per device (gptkit/plan_report.py) and return them;
    nothing is trained, written or loaded but configs (and a resumed checkpoint's config)."""
    world_size = cfg.plan_gpus or int(os.environ.get("WORLD_SIZE", 1))
    cfg = fit_base_context(cfg, argv, say=False)  # as the run would
    report = make_plan(cfg, ckpt, world_size)
    title = " ".join(["train.py", *(a for a in argv if a.split("=")[0] != "--plan")])
    print(format_plan(report, title))
    return report


@cli.entry_point(oom_hint="lower --batch_size and raise --gradient_accumulation_steps to keep the same tokens "
                          "per step")
def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    startup.begin()
    cfg, ckpt = resolve_config(argv)
    make_objective(cfg).check_config(cfg)  # the objective's own settings, before anything is read or written
    startup.mark("config")
    if cfg.plan:
        return plan_run(cfg, ckpt, argv)
    check_accumulation(cfg, int(os.environ.get("WORLD_SIZE", 1)))
    with distributed(cfg.device, cfg.dtype, cfg.backend) as (d, rt):
        startup.mark("device", rt.device)
        with resolve_threads(cfg.threads, rt.device_type).applied() as threads:  # (left as they were on return)
            return train(cfg, ckpt, argv, d, rt, threads)


if __name__ == "__main__":
    main()
