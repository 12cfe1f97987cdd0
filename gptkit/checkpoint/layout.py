"""Where a run's checkpoints are: a file (out_dir/best.pt, last.pt), a sharded folder (out_dir/best/, last/, a
run under FSDP: gptkit/checkpoint/sharded.py), or nanoGPT's out_dir/ckpt.pt; finding the one to read, removing
one, and naming the others of a run when one is damaged. Nothing here reads a checkpoint's content."""

from __future__ import annotations

import shutil
from pathlib import Path

from gptkit import nanogpt
from gptkit.errors import UserError

TRAIN_HINT = "train one with: python train.py configs/shakespeare.py"
RECORD = "record.pt"  # a sharded folder's file with every entry but the model's and the optimizer's tensors
TMP, OLD = ".tmp", ".old"  # the suffixes of a folder being written, and of the one it replaces


class CheckpointError(UserError):
    """A missing, unreadable or incompatible checkpoint; the message names the path and the fix."""


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether `path` is a complete sharded checkpoint folder."""
    p = Path(path)
    return (p / RECORD).is_file() and (p / ".metadata").is_file()


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint file or sharded folder as given, or in a run's folder its best checkpoint if present, else
    its last (saved_checkpoint: best.pt or best/, last.pt or last/), else nanoGPT's ckpt.pt."""
    p = Path(path)
    if p.is_file() or is_sharded_checkpoint(p):
        return p
    if p.is_dir():
        for name in ("best", "last"):
            found = saved_checkpoint(p, name)
            if found is not None:
                return found
        if (p / nanogpt.CKPT_NAME).is_file():
            return p / nanogpt.CKPT_NAME
        raise CheckpointError(f"no checkpoint (best.pt or last.pt, or a sharded best/ or last/, or nanoGPT's "
                              f"ckpt.pt) in {p}/; {TRAIN_HINT}")
    raise CheckpointError(f"checkpoint {p} does not exist; {TRAIN_HINT}")


def holds_checkpoint(path: str | Path) -> bool:
    """Whether `path` is a checkpoint (a file, a sharded folder) or a run's folder holding one."""
    p = Path(path)
    return p.is_file() or (p.is_dir() and (is_sharded_checkpoint(p) or (p / nanogpt.CKPT_NAME).is_file() or any(
        saved_checkpoint(p, n) is not None for n in ("best", "last"))))


def saved_checkpoint(out_dir: str | Path, name: str) -> Path | None:
    """A run's checkpoint `name` ("last" or "best"): the file name.pt, or the sharded folder name/ (or name.old/,
    the previous one, when a save was killed between its two renames); the newer when there are both. None
    when there is none."""
    out_dir = Path(out_dir)
    folder = out_dir / name
    if not is_sharded_checkpoint(folder):
        folder = out_dir / f"{name}{OLD}"
    found = [p for p in (out_dir / f"{name}.pt", folder) if p.is_file() or is_sharded_checkpoint(p)]
    return max(found, key=lambda p: (p / RECORD if p.is_dir() else p).stat().st_mtime_ns, default=None)


def remove_checkpoint(out_dir: str | Path, name: str) -> None:
    """Remove a run's checkpoint `name` ("last", "best") in either form: name.pt, a sharded name/ and what a
    killed save of it left (name.tmp/, name.old/)."""
    (Path(out_dir) / f"{name}.pt").unlink(missing_ok=True)
    remove_folders(Path(out_dir) / name)


def remove_folders(folder: Path) -> None:
    """A sharded folder, with what a killed save of it left (FOLDER.tmp/, FOLDER.old/)."""
    for path in (folder, folder.with_name(folder.name + TMP), folder.with_name(folder.name + OLD)):
        shutil.rmtree(path, ignore_errors=True)


def others_of_the_run(p: Path) -> list[Path]:
    """The other checkpoints beside `p` that a user could take instead of it: the previous save of a sharded
    folder (NAME.old/, left by a save killed between its renames), then the run's best and last."""
    out_dir = p.parent
    name = p.name.removesuffix(OLD) if p.is_dir() else p.stem
    others = []
    old = out_dir / f"{name}{OLD}"
    if p.is_dir() and p != old and is_sharded_checkpoint(old):
        others.append(old)
    for other in ("best", "last"):
        found = saved_checkpoint(out_dir, other) if other != name else None
        if found is not None and found not in others:
            others.append(found)
    return others
