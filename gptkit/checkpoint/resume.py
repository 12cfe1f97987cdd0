"""What a training run continues from: `--init_from=resume`, `--resume=auto` (continue out_dir's checkpoint if it
is one of this run, else start), the checks that a checkpoint belongs to the run, and that a new run never
replaces an earlier run's checkpoints.

    cfg, ckpt = resolve_config(argv)   # the run's config; the checkpoint it continues (None: a new run)
    check_out_dir(cfg)                 # a new run into an out_dir that holds checkpoints: an error, unless --overwrite
    set_aside_damaged_best(out_dir, ckpt["best_val_loss"])   # a resumed run: best.pt checked as last.pt was

A resumed run keeps its checkpoint's config, model shape and optimizer; what the command line sets explicitly
overrides the rest.
"""

from __future__ import annotations

import os
from pathlib import Path

from gptkit.checkpoint.damage import CorruptCheckpointError
from gptkit.checkpoint.file import RESUME_KEYS, load_checkpoint, verify_checkpoint
from gptkit.checkpoint.layout import CheckpointError, saved_checkpoint
from gptkit.cli import UserError
from gptkit.config import TrainConfig
from gptkit.options import build_config, command_line_values, parse_args
from gptkit.shards import dataset_dir
from model import GPTConfig

# The shape and architecture a resumed run must keep (model.py's GPTConfig says which settings they are).
MODEL_KEYS = GPTConfig.shape_names()
# How one invocation starts, not what the run is: a resumed run takes them from its own command line only, never
# from the checkpoint's config (a run started with --overwrite=True is continued without it).
INVOCATION_KEYS = ("overwrite", "resume", "plan")


class ResumeError(UserError):
    """A run that cannot continue (or start) as asked in its out_dir; the message says why and what to do."""


def resolve_config(argv: list[str]) -> tuple[TrainConfig, dict | None]:
    """The run's config and, when resuming, the checkpoint. A resumed run starts from the checkpoint's config;
    what argv sets explicitly overrides it, except the model's shape, which must match."""
    values = parse_args(TrainConfig, argv)
    out_dir = Path(values.get("out_dir", TrainConfig.out_dir))
    auto = values.get("init_from") != "resume" and values.get("resume") == "auto"
    if values.get("init_from") != "resume":
        asked = build_config(TrainConfig, values)  # the run as the command starts it
        if not (auto and auto_resumes(asked, out_dir)):
            return asked, None
    last = saved_checkpoint(out_dir, "last")  # last.pt, or a sharded last/ (a run under FSDP)
    if last is None:
        if (out_dir / "ckpt.pt").is_file():  # nanoGPT's: no data position or RNG state to resume exactly
            raise ResumeError(f"{out_dir}/ckpt.pt is nanoGPT's checkpoint, which cannot be resumed exactly here; "
                             f"continue from its weights with --init_from={out_dir} --out_dir=NEW_DIR")
        raise ResumeError(f"nothing to resume: {out_dir}/last.pt does not exist; start with --init_from=scratch")
    # Not memory-mapped: the optimizer state would otherwise keep pointing into the file that the next save
    # replaces. (A --plan reads only the config: memory-mapped, nothing else is read.)
    ckpt = load_checkpoint(last, mmap=bool(values.get("plan")))
    # (a sharded checkpoint's optimizer state is read into the run later: restore_state)
    missing = [k for k in RESUME_KEYS if k not in ckpt and not (k == "optimizer" and ckpt.get("sharded"))]
    if missing:
        raise ResumeError(f"{out_dir}/last.pt cannot be resumed: it has no {', '.join(missing)} (a weights-only "
                         f"checkpoint?); start a new run, or fine-tune from it")
    if auto:
        check_same_run(asked, values, ckpt, out_dir)
        if os.environ.get("RANK", "0") == "0":
            print(f"resume=auto: {last} holds step {ckpt['step']} of this run: continuing it", flush=True)
        if asked.init_from != "scratch":  # a fine-tune's block_size may have been fitted to its data: kept
            values.pop("block_size", None)
        values["init_from"] = "resume"
    base = {k: v for k, v in ckpt["config"].items() if k not in INVOCATION_KEYS}
    fitted = kept_block_size(argv, values, base, out_dir)
    # Through GPTConfig: a checkpoint older than an option has its default, and `auto` options their values.
    saved_model = GPTConfig.from_dict(ckpt["model_config"]).to_dict()
    saved_shape = {k: saved_model[k] for k in MODEL_KEYS}
    if base.get("block_size", saved_shape["block_size"]) < saved_shape["block_size"]:
        saved_shape["block_size"] = base["block_size"]  # the model has its base's positions (a LoRA run's, or
        # an objective's that keeps the base's context: DPO's); the run trained on sequences of block_size
    differing = [f"{k} (checkpoint {saved_shape[k]!r}, asked {values[k]!r})"
                 for k in MODEL_KEYS if values.get(k) is not None and values[k] != saved_shape[k]]
    if differing:
        raise ResumeError(f"cannot resume {out_dir}/last.pt with a different model shape: {'; '.join(differing)}")
    saved_optimizer = base.get("optimizer", "adamw")  # its state is that optimizer's
    if values.get("optimizer", saved_optimizer) != saved_optimizer:
        raise ResumeError(f"cannot resume {out_dir}/last.pt with --optimizer={values['optimizer']}: it was trained "
                         f"with {saved_optimizer}; start a new run, or fine-tune from it")
    base.update(values)
    base.update(saved_shape)
    cfg = build_config(TrainConfig, base)
    if not cfg.plan and os.environ.get("RANK", "0") == "0":
        if not auto:  # (resume=auto said which step it continues)
            print(f"resumed from step {ckpt['step']} of {last}", flush=True)
        for line in ([fitted] if fitted else []) + resume_notes(cfg, values, ckpt, out_dir):
            print(f"note: {line}")
    return cfg, ckpt


def kept_block_size(argv: list[str], values: dict, saved: dict, out_dir: Path) -> str | None:
    """A resumed run trains on its checkpoint's block_size, which its first run may have fitted to its data (a
    fine-tune on a small dataset, DPO's longest pair) or to its base's context, below what its config file
    says: a config file's value is taken as the run took it, so the command a stopped run prints continues it
    as printed. Only --block_size on the command line asks for another (and must then match the checkpoint).
    Drops a config file's block_size from `values`; returns the note to print when it differed."""
    if "block_size" not in values or "block_size" in command_line_values(TrainConfig, argv):
        return None
    asked, kept = values.pop("block_size"), saved.get("block_size")
    if asked is None or kept is None or asked == kept:
        return None
    return (f"block_size is the checkpoint's {kept}, the one its run trained with (the config file says "
            f"{asked}); continuing {out_dir}/last.pt with it")


def auto_resumes(asked: TrainConfig, out_dir: Path) -> bool:
    """resume=auto: whether out_dir holds a checkpoint to continue (last.pt, or a sharded last/), said in the
    run's first line (rank 0)."""
    last = saved_checkpoint(out_dir, "last")
    if last is None and os.environ.get("RANK", "0") == "0":
        start = "from scratch" if asked.init_from == "scratch" else f"from {asked.init_from}"
        print(f"resume=auto: no checkpoint in {out_dir}/ (no last.pt or last/): starting {start}", flush=True)
    return last is not None


def check_same_run(asked: TrainConfig, values: dict, ckpt: dict, out_dir: Path) -> None:
    """resume=auto continues a checkpoint of this run only: one of another dataset, or another model shape
    (all of it for a run from scratch; what the command sets explicitly for a fine-tune, whose base decides the
    rest) is a one-line error naming the difference. (The tokenizer is checked against the dataset's later.)"""
    saved = ckpt["config"]
    diffs = []
    here = dataset_dir(asked.dataset, asked.data_root).resolve()
    there = dataset_dir(saved.get("dataset", ""), saved.get("data_root", TrainConfig.data_root)).resolve()
    if here != there:
        diffs.append(f"dataset (checkpoint {str(there)!r}, this run {str(here)!r})")
    saved_model = GPTConfig.from_dict(ckpt["model_config"]).to_dict()
    wanted = asked.model_config(vocab_size=1).to_dict() if asked.init_from == "scratch" else values
    keys = [k for k in MODEL_KEYS if k in wanted and not (k == "block_size" and asked.init_from != "scratch")]
    diffs += [f"{k} (checkpoint {saved_model[k]!r}, this run {wanted[k]!r})"
              for k in keys if wanted[k] is not None and wanted[k] != saved_model[k]]
    if diffs:
        raise ResumeError(f"resume=auto: {out_dir}/ holds a checkpoint of another run: {'; '.join(diffs)}; choose "
                         f"another --out_dir (or, to replace it, drop --resume=auto and pass --overwrite=True)")


def resume_notes(cfg: TrainConfig, values: dict, ckpt: dict, out_dir: Path) -> list[str]:
    """What a resumed run does that its command line may not have meant: a run that is finished already, or a
    max_iters raised past the schedule's end (lr_decay_iters, kept from the checkpoint)."""
    notes, step = [], int(ckpt["step"])
    raised = values.get("max_iters", cfg.max_iters) > ckpt["config"].get("max_iters", cfg.max_iters)
    if step >= cfg.max_iters and not cfg.eval_only:
        notes.append(f"{out_dir}/last.pt is at step {step}, and max_iters is {cfg.max_iters}: the run is finished, "
                     f"so it is evaluated once and nothing is trained; to train on, raise --max_iters (and "
                     f"--lr_decay_iters with it)")
    elif raised and cfg.decay_lr and "lr_decay_iters" not in values and cfg.lr_decay_iters < cfg.max_iters:
        notes.append(f"max_iters is {cfg.max_iters} but lr_decay_iters stays the checkpoint's {cfg.lr_decay_iters}: "
                     f"from step {cfg.lr_decay_iters} on the learning rate stays at min_lr ({cfg.min_lr:g}); to "
                     f"decay over the longer run, add --lr_decay_iters={cfg.max_iters}")
    return notes


def check_out_dir(cfg: TrainConfig) -> None:
    """Never let a new run silently replace the checkpoints of an earlier one."""
    if cfg.init_from == "resume" or cfg.overwrite:
        return
    existing = [p.name + "/" * p.is_dir() for p in (saved_checkpoint(cfg.out_dir, n) for n in ("last", "best"))
                if p is not None]
    if existing:
        raise ResumeError(
            f"{cfg.out_dir}/ already holds {' and '.join(existing)}; continue it with --init_from=resume, "
            f"choose another --out_dir, or pass --overwrite=True to replace it"
        )


def set_aside_damaged_best(out_dir: str | Path, best_val_loss: float) -> Path | None:
    """A resumed run checks the run's best checkpoint (best.pt, or a sharded best/) as its load checked last.pt,
    checksums and all: a damaged one would be what sample.py, eval.py, chat.py and export.py take from the
    run's folder. It is renamed aside, NAME.damaged (nothing is deleted: a copy from elsewhere may still be
    compared with it), and a line says so. The run's best val loss stays the one that checkpoint reached: the
    next evaluation that beats it writes a new best.pt (atomically, as every save), and until then, or if none
    does, the folder's readers take last.pt (the run's last line says so again). Returns where it went, or None
    when there is no best checkpoint or it is whole (rank 0 calls this, holding out_dir's lock)."""
    best = saved_checkpoint(out_dir, "best")
    if best is None:
        return None
    try:
        verify_checkpoint(best)
        return None
    except CorruptCheckpointError as e:
        what = e.what or str(e)
    except (CheckpointError, OSError) as e:  # not readable as a checkpoint at all (a shard file missing, say)
        what = str(e)
    aside, n = best.with_name(f"{best.name}.damaged"), 2
    while aside.exists():  # an earlier one set aside stays too
        aside, n = best.with_name(f"{best.name}.damaged{n}"), n + 1
    os.replace(best, aside)
    print(f"note: {best}{'/' * aside.is_dir()} is damaged: {what}; set aside as {aside}; the next evaluation "
          f"below its val loss {best_val_loss:.4f} writes a new best.pt, and until then sample.py and the other "
          f"readers of {Path(out_dir)}/ take last.pt", flush=True)
    return aside
