"""Loss curves of one or more runs, as a PNG, from the metrics.jsonl that train.py writes in each out_dir.

    python plot.py out/                                   # -> loss.png
    python plot.py out-a/ out-b/ --out compare.png --x tokens --logy

Each run gets one colour: its training loss as a thin line, its validation loss as a thicker line with dots.
When a run logged HellaSwag (hellaswag_interval), a second panel shows its acc_norm beside the references.
--x step | tokens | time: optimizer steps; tokens seen (steps x batch_size x block_size x
gradient_accumulation_steps, from the run's config.json); or training time, the sum of the logged ms_per_step
(evaluation and start-up left out). A resumed run's lines replace those its predecessor logged after the step it
resumed from, so a curve never doubles back.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gptkit import cli
from gptkit.errors import ConfigError, UserError
from gptkit.files import atomic_write
from gptkit.options import load_config, setting

REFERENCES = {"chance": 0.25, "GPT-2 124M": 0.2955}  # HellaSwag acc_norm, completion scoring (gptkit/hellaswag.py)


class PlotError(UserError):
    """A run folder or option plot.py cannot use."""


@dataclass
class RunCurves:
    label: str
    train: list[dict] = field(default_factory=list)  # training lines: step, loss, ms_per_step, ...
    evals: list[dict] = field(default_factory=list)  # evaluation lines: step, val_loss, hellaswag_acc_norm, ...
    tokens_per_step: int | None = None  # from config.json, when it is there
    skipped: int = 0  # unreadable lines left out (only ever the last: a line being written)

    @property
    def has_hellaswag(self) -> bool:
        return any("hellaswag_acc_norm" in e for e in self.evals)


def read_run(folder: str | Path, label: str) -> RunCurves:
    folder = Path(folder)
    path = folder / "metrics.jsonl"
    if not path.is_file():
        what = "does not exist" if not folder.exists() else "has no metrics.jsonl"
        raise PlotError(f"{folder} {what}; give the out_dir of a train.py run")
    lines = path.read_text(encoding="utf-8").splitlines()
    run = RunCurves(label)
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            if lineno == len(lines):
                run.skipped += 1  # the last line of a run being written right now
                break
            raise PlotError(f"{path} line {lineno} is not JSON; the file is damaged") from None
        if not isinstance(entry, dict) or not isinstance(entry.get("step"), int):
            raise PlotError(f"{path} line {lineno} is not a metrics entry (no step)")
        if entry.get("loss") is not None:
            _append(run.train, entry)
        if entry.get("val_loss") is not None:
            _append(run.evals, entry)
    if not run.train and not run.evals:
        raise PlotError(f"{path} holds no losses yet")
    config = folder / "config.json"
    if config.is_file():
        try:
            c = json.loads(config.read_text(encoding="utf-8"))
            run.tokens_per_step = c["batch_size"] * c["block_size"] * c["gradient_accumulation_steps"]
        except (ValueError, KeyError, TypeError):
            pass  # only --x tokens needs it, and says so
    return run


def _append(rows: list[dict], entry: dict) -> None:
    """Add an entry in file order; a resumed run restarts at an earlier step, and its lines replace the later
    ones of the run it continues."""
    while rows and rows[-1]["step"] >= entry["step"]:
        rows.pop()
    rows.append(entry)


def x_values(run: RunCurves, rows: list[dict], x: str) -> np.ndarray:
    steps = np.array([r["step"] for r in rows], dtype=np.float64)
    if x == "step":
        return steps
    if x == "tokens":
        if run.tokens_per_step is None:
            raise PlotError(f"--x tokens needs the batch size from {run.label}/config.json, which is missing or "
                            f"unreadable; use --x step")
        return steps * run.tokens_per_step
    # time: minutes of training, from each logged interval's mean step time (None for the first step)
    t_steps = np.array([0.0] + [r["step"] for r in run.train])
    ms = np.array([0.0] + [r.get("ms_per_step") or 0.0 for r in run.train])
    minutes = np.cumsum(ms * np.diff(t_steps, prepend=0.0)) / 60_000
    return np.interp(steps, t_steps, minutes)


def draw(runs: list[RunCurves], out: Path, x: str = "step", logy: bool = False) -> None:
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import EngFormatter, FormatStrFormatter
    except ModuleNotFoundError:
        raise PlotError("plot.py needs matplotlib: pip install matplotlib") from None
    hellaswag = any(run.has_hellaswag for run in runs)
    fig = Figure(figsize=(11 if hellaswag else 7, 4.2), dpi=100, layout="constrained")
    axes = fig.subplots(1, 2 if hellaswag else 1, squeeze=False)[0]
    loss_ax = axes[0]
    xlabel = {"step": "step", "tokens": "tokens", "time": "training time (minutes)"}[x]
    for i, run in enumerate(runs):
        color = f"C{i}"
        if run.train:
            loss_ax.plot(x_values(run, run.train, x), [r["loss"] for r in run.train], color=color, alpha=0.45,
                         linewidth=0.8, label=f"{run.label} train")
        if run.evals:
            loss_ax.plot(x_values(run, run.evals, x), [r["val_loss"] for r in run.evals], color=color,
                         linewidth=2, marker="o", markersize=3, label=f"{run.label} val")
    loss_ax.set(xlabel=xlabel, ylabel="loss (nats per token)", title="loss")
    if logy:
        loss_ax.set_yscale("log")
        for set_formatter in (loss_ax.yaxis.set_major_formatter, loss_ax.yaxis.set_minor_formatter):
            set_formatter(FormatStrFormatter("%g"))  # 2, 3, 4 rather than 2x10^0
    loss_ax.legend(fontsize=8)
    loss_ax.grid(alpha=0.3)
    if hellaswag:
        hs_ax = axes[1]
        for i, run in enumerate(runs):
            rows = [e for e in run.evals if "hellaswag_acc_norm" in e]
            if rows:
                hs_ax.plot(x_values(run, rows, x), [e["hellaswag_acc_norm"] for e in rows], color=f"C{i}",
                           linewidth=2, marker="o", markersize=3, label=run.label)
        for j, (name, value) in enumerate(REFERENCES.items()):
            hs_ax.axhline(value, color="gray", linestyle=":" if j == 0 else "--", linewidth=1,
                          label=f"{name} ({value})")
        hs_ax.set(xlabel=xlabel, ylabel="acc_norm", title="HellaSwag")
        hs_ax.legend(fontsize=8)
        hs_ax.grid(alpha=0.3)
    if x == "tokens":
        for ax in axes:
            ax.xaxis.set_major_formatter(EngFormatter())
    with atomic_write(out) as tmp:
        fig.savefig(tmp, format="png")


def labels_for(folders: list[str]) -> list[str]:
    """Each run's folder name, or the path as given when two runs share a name."""
    names = [Path(f).resolve().name for f in folders]
    return names if len(set(names)) == len(names) else [f.rstrip("/") for f in folders]


@dataclass
class PlotConfig:
    runs: list[str] = setting([], "run folders (train.py's out_dir) holding metrics.jsonl; the bare arguments")
    out: str = setting("loss.png", "the PNG to write")
    x: str = setting("step", "x axis: optimizer steps, tokens seen, or training time", ("step", "tokens", "time"))
    logy: bool = setting(False, "logarithmic loss axis")
    POSITIONAL = "runs"  # python plot.py out-a/ out-b/

    def validate(self) -> None:
        if not self.runs:
            raise ConfigError("give at least one run folder: python plot.py OUT_DIR [OUT_DIR ...]")


@cli.entry_point()
def main(argv: list[str] | None = None) -> Path:
    args = load_config(PlotConfig, sys.argv[1:] if argv is None else list(argv), allow_files=False,
                       prog="plot.py", description=__doc__)
    runs = [read_run(folder, label) for folder, label in zip(args.runs, labels_for(args.runs))]
    for folder, run in zip(args.runs, runs):
        if run.skipped:
            print(f"note: skipped {run.skipped} unreadable line of {Path(folder) / 'metrics.jsonl'} (its last: "
                  f"a run still writing it?)", file=sys.stderr)
    out = Path(args.out)
    draw(runs, out, x=args.x, logy=args.logy)
    print(f"wrote {out} ({len(runs)} run{'s' if len(runs) > 1 else ''})", file=sys.stderr)
    return out

if __name__ == "__main__":
    main()
