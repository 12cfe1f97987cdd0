"""Sharded checkpoints, the form a run under FSDP writes: a folder (out_dir/last/, out_dir/best/) of
torch.distributed.checkpoint (DCP) files, each process writing its own shards of the model and the optimizer
state, plus RECORD (record.pt), every other entry of a checkpoint (gptkit/checkpoint/file.py's build_checkpoint).

DCP's files are .metadata and one __R_0.distcp per process R, holding {"model": the model's state dict,
"optimizer": the optimizer's (get_optimizer_state_dict: keyed by parameter name)}. DCP writes .metadata last,
once every process has written its part; the folder is written as NAME.tmp/ and renamed to NAME/ once complete.
RECORD carries the CRC-32C (gptkit/checksum.py) of .metadata and of each item of the shard files, which
read() verifies. Saving (every process at once), reading the weights whole in one process, and restoring the
optimizer state into a run of any number of processes (DCP reshards) are here.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from gptkit import checksum, lora
from gptkit.checkpoint.damage import container_problem, corrupt, damaged_optimizer_note, verify
from gptkit.checkpoint.layout import OLD, RECORD, TMP, CheckpointError
from gptkit.cli import one_line
from gptkit.optim import keeping_implementation

SHARDS_KEY = "shard_checksums"  # RECORD's entry with the CRC-32C of .metadata and of every item of the shards


def _optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside ours (optim.MuonAdamW holds two)."""
    return [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else [optimizer.muon, optimizer.adamw]


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_sharded(folder: str | Path, record: dict | None, model: torch.nn.Module, optimizer, *,
                 adapters_only: bool = False, asynchronous: bool = False):
    """Write a sharded checkpoint. Every process calls this at once, each writing its own shards of the model
    (a LoRA run's adapters only, with adapters_only) and of the optimizer state, in parallel; the process
    that passes `record` (rank 0; None on the others) writes it and renames the folder into place.

    Atomic: the files go into FOLDER.tmp/; once complete, FOLDER/ is renamed to FOLDER.old/ and FOLDER.tmp/ to
    FOLDER/, then FOLDER.old/ is removed. A save killed before the renames leaves FOLDER/ as it was (the next
    save clears the partial FOLDER.tmp/); one killed between them leaves FOLDER.old/, which saved_checkpoint
    falls back to.

    asynchronous: DCP's async_save copies this process' shards to CPU memory and writes them from a thread;
    returns (its future, and on rank 0 the function that finishes the folder once the future is done: the
    checksums, the record, the renames; None on the others) instead of waiting."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    folder = Path(folder)
    tmp, old = folder.with_name(folder.name + TMP), folder.with_name(folder.name + OLD)
    if record is not None:
        shutil.rmtree(tmp, ignore_errors=True)  # what a killed save left
        tmp.mkdir(parents=True)
    _barrier()  # no process writes into FOLDER.tmp/ before it is clean
    weights = lora.adapter_state_dict(model) if adapters_only else model.state_dict()  # (this process' shards)
    state = {"model": weights, "optimizer": get_optimizer_state_dict(model, _optimizers(optimizer))}

    def finish() -> None:
        _finish(folder, tmp, old, record)

    if asynchronous:
        import torch.distributed as dist

        alone = not (dist.is_available() and dist.is_initialized())
        with _alone_quietly():
            future = dcp.async_save(state, checkpoint_id=tmp, process_group=_cpu_group(), no_dist=alone)
        return future, (finish if record is not None else None)
    with _alone_quietly():  # (one process alone: no process group)
        dcp.save(state, checkpoint_id=tmp)  # each process its part; .metadata last, once all have written
    if record is not None:
        finish()
    return None


_CPU_GROUP = {}


def _cpu_group():
    """The process group for DCP's async_save: a gloo group of the same processes (async_save needs one that
    talks over the CPU), made once (every process calls this at the same point), and not the default group,
    whose collectives the training steps issue meanwhile from the main thread (two threads' collectives on one
    group could be matched in different orders on different processes). None without a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    if "gloo" not in _CPU_GROUP:
        _CPU_GROUP["gloo"] = dist.new_group(backend="gloo")
    return _CPU_GROUP["gloo"]


def _finish(folder: Path, tmp: Path, old: Path, record: dict) -> None:
    """Rank 0, once every process has written its shards into FOLDER.tmp/: the record with the checksums, then
    the renames that put the folder in place."""
    record = {**record, SHARDS_KEY: _shard_checksums(tmp)}
    record = {**record, checksum.KEY: checksum.record(record)}
    with open(tmp / RECORD, "wb") as f:
        torch.save(record, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync(tmp)
    shutil.rmtree(old, ignore_errors=True)
    if folder.exists():
        os.replace(folder, old)
    os.replace(tmp, folder)
    _fsync(folder.parent)
    shutil.rmtree(old, ignore_errors=True)
    folder.with_name(folder.name + ".pt").unlink(missing_ok=True)  # the file of a run that went on under FSDP


def _shard_checksums(folder: Path) -> dict:
    """CRC-32C of the .metadata file and of every item DCP wrote (each process' part of each tensor, and the
    optimizer's other entries), read back from the files: {"metadata": crc, "items": {item: crc}}."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    items = _storage_items(metadata)
    with ThreadPoolExecutor(checksum.THREADS) as pool:
        crcs = pool.map(lambda loc: checksum.file_range_crc(folder / loc[0], loc[1], loc[2]), items.values())
        found = dict(zip(items, crcs))
    meta_file = folder / ".metadata"
    return {"metadata": checksum.file_range_crc(meta_file, 0, meta_file.stat().st_size), "items": found}


def _storage_items(metadata) -> dict[str, tuple[str, int, int]]:
    """{item: (file, offset, length)} of a DCP checkpoint's metadata; an item is a tensor's name and the offset
    of one process' part of it ("model.transformer.wte.weight@0,0"), or the name of a non-tensor entry."""
    items = {}
    for index, info in metadata.storage_data.items():
        where = "" if index.offset is None else "@" + ",".join(map(str, index.offset))
        items[f"{index.fqn}{where}"] = (info.relative_path, info.offset, info.length)
    return items


def _verify_shards(folder: Path, record: dict, metadata, prefix: str) -> str | None:
    """Which item of the DCP files whose names start with `prefix` does not match the record's checksums, in
    words (None when all do)."""
    expected = record[SHARDS_KEY]["items"]
    items = {k: v for k, v in _storage_items(metadata).items() if k.startswith(prefix)}
    missing = [k for k in items if k not in expected]
    if missing:
        return f"its .metadata lists {missing[0]}, which was not saved"
    with ThreadPoolExecutor(checksum.THREADS) as pool:
        crcs = pool.map(lambda loc: checksum.file_range_crc(folder / loc[0], loc[1], loc[2]), items.values())
        bad = [k for k, c in zip(items, crcs) if c != expected[k]]
    if bad:
        return f"tensor {bad[0]} in {items[bad[0]][0]} does not match the checksum saved with it"
    return None


def verify_folder(folder: Path, map_location: str | torch.device = "cpu", damaged_optimizer: str = "error"):
    """Check a sharded checkpoint against its checksums without loading its tensors (the shards' bytes are read
    and checked in place): its record and .metadata, then the model's items and the optimizer's (damage there:
    an error with damaged_optimizer="error", a note with "note"). Returns the record (its checksums removed)
    and DCP's metadata; raises a CheckpointError (CorruptCheckpointError for damage)."""
    import torch.distributed.checkpoint as dcp

    problem = container_problem(folder / RECORD)
    if problem:
        raise corrupt(folder, f"{RECORD}: {problem[1]}")
    try:
        record = torch.load(folder / RECORD, map_location=map_location, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"cannot read sharded checkpoint {folder}/: {one_line(e)}") from None
    if isinstance(record, dict) and checksum.KEY in record:
        verify(record, folder / RECORD)
        meta_file = folder / ".metadata"
        if checksum.file_range_crc(meta_file, 0, meta_file.stat().st_size) != record[SHARDS_KEY]["metadata"]:
            raise corrupt(folder, ".metadata (the index of the shards) does not match the checksum saved with it")
    elif isinstance(record, dict):
        verify(record, folder)  # the note: saved before checksums were recorded
    try:
        metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"cannot read sharded checkpoint {folder}/: {one_line(e)}") from None
    if isinstance(record, dict) and SHARDS_KEY in record:
        wrong = _verify_shards(folder, record, metadata, "model.")
        if wrong:
            raise corrupt(folder, wrong)
        wrong = _verify_shards(folder, record, metadata, "optimizer.")
        if wrong and damaged_optimizer == "note":
            print(damaged_optimizer_note(folder, wrong), file=sys.stderr)
        elif wrong:
            raise corrupt(folder, wrong)
    return record, metadata


def read(folder: Path, map_location: str | torch.device = "cpu", damaged_optimizer: str = "error") -> dict:
    """A sharded checkpoint as load_checkpoint returns a file's: its record, the model's weights whole (read
    from every process' shards, in this process alone: no process group is needed), and "sharded": the folder.
    The optimizer state is not returned (load_sharded_optimizer restores it into a run), but its checksums are
    verified: damage there is an error with damaged_optimizer="error" (a resumed run), a note with "note"."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    record, metadata = verify_folder(folder, map_location, damaged_optimizer)
    weights = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
            weights[key.removeprefix("model.")] = torch.empty(meta.size, dtype=meta.properties.dtype)
    try:
        with _alone_quietly():
            dcp.load({"model": weights}, checkpoint_id=folder, no_dist=True)
    except Exception as e:  # DCP wraps a missing or truncated shard file in its own exception types
        raise CheckpointError(f"cannot read sharded checkpoint {folder}/: {one_line(e)}; a shard file may be "
                              f"missing or truncated") from None
    if not isinstance(record, dict) or "model_config" not in record:
        raise CheckpointError(f"{folder}/ is not a checkpoint written by train.py (no model_config in {RECORD})")
    record = {k: v for k, v in record.items() if k != SHARDS_KEY}
    return {**record, "model": {k: v.to(map_location) for k, v in weights.items()}, "sharded": str(folder)}


@contextlib.contextmanager
def _alone_quietly():
    """Around a DCP load or save: without a process group it warns that it works in this one process, which is
    what we ask of it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def load_sharded_optimizer(folder: str | Path, model: torch.nn.Module, optimizer) -> None:
    """Restore the optimizer state of a sharded checkpoint into a run's optimizer, whatever the run's number
    of processes and wrapper: sharded (each process reads the parts of the saved shards its own shards cover:
    torch.distributed.checkpoint reshards on load), or whole (one process, or DDP). Every process calls it.
    The implementation settings of this machine (fused, foreach) are kept, as load_optimizer_state does."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    optimizers = _optimizers(optimizer)
    state = {"optimizer": get_optimizer_state_dict(model, optimizers)}
    with _alone_quietly():
        dcp.load(state, checkpoint_id=Path(folder))  # (a collective under torchrun)
    with keeping_implementation(optimizer):
        set_optimizer_state_dict(model, optimizers, state["optimizer"])


def load_whole_optimizer(model: torch.nn.Module, optimizer, state: dict) -> None:
    """Restore a single-file checkpoint's optimizer state (torch's own form, keyed by the position of each
    parameter in its optimizer) into a sharded run: keyed by name instead, then cut into this process'
    shards by set_optimizer_state_dict. Every process calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    optimizers = _optimizers(optimizer)
    parts = [state] if len(optimizers) == 1 else [state["muon"], state["adamw"]]
    names = {id(p): name for name, p in model.named_parameters()}
    by_name = {"state": {}, "param_groups": []}
    for o, saved in zip(optimizers, parts, strict=True):
        for group, saved_group in zip(o.param_groups, saved["param_groups"], strict=True):
            fqns = [names[id(p)] for p in group["params"]]
            by_name["param_groups"].append({**saved_group, "params": fqns})
            for index, fqn in zip(saved_group["params"], fqns, strict=True):
                if index in saved["state"]:
                    by_name["state"][fqn] = saved["state"][index]
    with keeping_implementation(optimizer):
        set_optimizer_state_dict(model, optimizers, by_name, options=StateDictOptions(full_state_dict=True))


