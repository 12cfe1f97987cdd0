"""What is wrong with a checkpoint, found and said in one place: its checksums checked (gptkit/checksum.py), its
zip container inspected without torch, and every message about damage (the one-line CorruptCheckpointError
naming the file, the tensor and the checkpoint to use instead; the notes for what loads but cannot be trusted)."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

from gptkit import checksum
from gptkit.checkpoint.layout import OLD, CheckpointError, holds_checkpoint, others_of_the_run
from gptkit.errors import UserError
from gptkit.options import read_config_file

# What a checkpoint file can be named; a file that is not a zip archive and is named otherwise (or holds text)
# is taken for something else given by mistake (a config.json), not for a damaged checkpoint.
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".tar")
ZIP_MAGIC = b"PK"


class CorruptCheckpointError(CheckpointError):
    """A checkpoint whose bytes changed since it was saved (a checksum does not match, or it is cut short)."""

    what = ""  # what is wrong, in a few words (corrupt() sets it)


def corrupt(p: Path, what: str) -> CorruptCheckpointError:
    """The one-line error for a damaged checkpoint: what is wrong, that nothing was changed, what to try. Its
    `what` keeps the first part alone."""
    error = CorruptCheckpointError(f"{_shown(p)} is corrupt: {what}; nothing on disk was changed; {fallback(p)}")
    error.what = what
    return error


def _shown(p: Path) -> str:
    return f"{p}{'/' * p.is_dir()}"


def fallback(p: Path) -> str:
    """Which other checkpoint of the run to use instead of the damaged `p`, and how to resume from it."""
    others = others_of_the_run(p)
    if not others:
        return "restore it from a copy (no other checkpoint is beside it)"
    shown = [_shown(o) for o in others]
    resume = ""
    name = p.name.removesuffix(OLD) if p.is_dir() else p.stem
    if name == "last":
        target = p.parent / ("last" if others[0].is_dir() else "last.pt")
        resume = (f" (to resume from it: move {_shown(p)} aside, copy {shown[0]} to "
                  f"{target}{'/' * others[0].is_dir()}, then --init_from=resume)")
    return f"try {' or '.join(shown)} instead{resume}"


def not_a_checkpoint(p: Path, what: str) -> CheckpointError:
    """The error for a file given as a checkpoint that is something else: a config file (train.py's: the run's
    out_dir is what to pass, which the file may name), a config.json or a text file in a run's folder (that
    folder), or anything else."""
    if p.suffix == ".py":
        return CheckpointError(f"{p} is a config file, not a checkpoint; pass its run's out_dir{_out_dir_of(p)}")
    run = f"the run's folder ({p.parent}/) or " if _is_run_folder(p.parent) else "a run's out_dir or "
    return CheckpointError(f"{p} is not a checkpoint ({what}); pass {run}a checkpoint file such as best.pt or "
                           f"last.pt")


def _out_dir_of(config: Path) -> str:
    """Where a config file's run writes its checkpoints, in a few words: its out_dir, when the file names one."""
    try:
        out_dir = read_config_file(str(config)).get("out_dir")
    except UserError:  # a line that reads the command line's values, say
        out_dir = None
    if not isinstance(out_dir, str) or not out_dir:
        return " (the folder holding best.pt or last.pt)"
    if holds_checkpoint(out_dir):
        return f": {out_dir.rstrip('/')}/"
    return f" ({out_dir.rstrip('/')}/, which holds no checkpoint yet: python train.py {config} writes one)"


def _is_run_folder(folder: Path) -> bool:
    """A run's out_dir: it holds a checkpoint or what every run writes first."""
    return holds_checkpoint(folder) or any((folder / name).is_file() for name in ("config.json", "runs.jsonl"))


def check_container(p: Path) -> None:
    """Raise when the file `p` is not a readable checkpoint container: a CheckpointError for something that is
    no checkpoint at all (text, a safetensors file, a zip archive without torch's data.pkl), a
    CorruptCheckpointError for a checkpoint cut short or with damaged metadata."""
    problem = container_problem(p)
    if problem is not None:
        damaged, what = problem
        raise corrupt(p, what) if damaged else not_a_checkpoint(p, what)


def container_problem(p: Path) -> tuple[bool, str] | None:
    """What is wrong with a checkpoint file's zip container, read without torch, as (damaged, what): damaged
    False for a file that is something else, True for a checkpoint cut short or whose pickled entries (data.pkl,
    the keys and settings) fail the CRC the zip stores for them, checked first: a damaged pickle can fail in any
    way. None when neither. (A CRC of 0 is what torch writes when told not to compute them.)"""
    with open(p, "rb") as f:
        head = f.read(4096)
    if not head.startswith(ZIP_MAGIC):
        kind = _kind_of(head)
        if kind is not None or p.suffix.lower() not in CHECKPOINT_SUFFIXES:
            return False, kind or "not the zip archive that torch.save writes"
    try:
        with zipfile.ZipFile(p) as z:
            infos = z.infolist()
            if not any(i.filename.endswith("data.pkl") for i in infos):
                return False, "a zip archive without torch's data.pkl"
            for info in infos:
                if info.filename.endswith(".pkl") and info.CRC:
                    z.read(info)  # raises BadZipFile on a CRC mismatch
    except zipfile.BadZipFile as e:
        if "CRC" in str(e):
            return True, "its metadata (data.pkl) does not match the CRC stored in the file"
        return True, "it is not a complete checkpoint file (cut short, or not a checkpoint at all)"
    except (OSError, EOFError, ValueError, NotImplementedError) as e:
        return True, f"its zip container cannot be read ({first_sentence(e)})"
    return None


def _kind_of(head: bytes) -> str | None:
    """What the first bytes of a file that is not a zip archive say it is, when they say so clearly."""
    if len(head) > 8 and head[8:10] == b'{"':
        return "a safetensors file: load its folder as Hugging Face weights with --init_from"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 4:  # not a character cut by the 4096-byte read
            return None
        text = head[: e.start].decode("utf-8")
    if not text or any(c < " " and c not in "\t\r\n" for c in text):
        return None
    return "a JSON file" if text.lstrip()[:1] in ("{", "[") else "a text file"


def first_sentence(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return text.split(". ")[0].rstrip(".")


def verify(ckpt: dict, p: Path, damaged_optimizer: str = "error", copy: bool = False) -> None:
    """Check a loaded checkpoint dict against its checksums, removing them from it. A change in the weights or
    the metadata is a CorruptCheckpointError; one in the optimizer state too with damaged_optimizer="error" (a
    resumed run), and with "note" (a reader of the weights alone) a one-line note, the optimizer state dropped
    from the dict (so that no later save stamps it with fresh checksums). One written before checksums were
    recorded gets a note. copy: the dict's tensors (memory-mapped) are replaced by copies in ordinary memory,
    made in the same pass as their checksums (a resumed run's load reads the file once)."""
    if checksum.KEY not in ckpt:
        print(f"note: {p} carries no checksums (it was saved before they were recorded): damage to it cannot be "
              f"detected; saving it again (e.g. export.py --format pt) adds them", file=sys.stderr)
        if copy:
            ckpt.update(checksum.replace_tensors(ckpt, {k: t.clone() for k, t in checksum.tensors(ckpt)}))
        return
    rec = ckpt.pop(checksum.KEY)
    copies = {} if copy else None
    wrong = checksum.mismatch(ckpt, rec, skip=("optimizer",), copies=copies)
    if wrong is None:
        wrong = checksum.mismatch(ckpt, rec, only=("optimizer",), structure=False, copies=copies)
        if wrong is not None and damaged_optimizer == "note":
            del ckpt["optimizer"]
            print(damaged_optimizer_note(p, f"{wrong} does not match the checksum saved with it"), file=sys.stderr)
            wrong = None
    if wrong is not None:
        raise corrupt(p, f"{wrong} does not match the checksum saved with it")
    if copies:
        ckpt.update(checksum.replace_tensors(ckpt, copies))


def damaged_optimizer_note(p: Path, what: str) -> str:
    """The note for a checkpoint whose optimizer state only is damaged, to a reader that needs its weights."""
    return (f"note: {_shown(p)} is damaged in its optimizer state ({what}): the weights used here are intact, "
            f"but resuming from it will be refused; {fallback(p)}")
