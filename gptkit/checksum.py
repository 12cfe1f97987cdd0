"""Checksums of what a checkpoint holds, so that a byte changed on disk (a bad disk, a copy cut short and
resumed, a sync gone wrong) is an error at load time instead of a silently different model.

Every tensor gets a CRC-32C of its raw bytes (in its own dtype, element order row-major), named by its path in
the checkpoint ("model/transformer.h.0.attn.c_attn.weight", "optimizer/state/3/exp_avg"); everything else (the
keys, the config, the step, the tensors' dtypes and shapes) gets one CRC of its printed form (canonical(): the
same in every process, whatever PYTHONHASHSEED). CRC-32C because it is fast: the `crc32c` package computes
it with the CPU's CRC instruction, straight from the tensor's memory (no copy; on a memory-mapped tensor this
is what reads it from disk), and releases the GIL, so several tensors are checked at once. benchmarks/checkpoint_io.py measures it against zlib.crc32 (BENCHMARKS.md).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import crc32c
import torch

ALGORITHM = "crc32c"
KEY = "checksums"  # the entry of a checkpoint dict that holds its record (see record())
# Tensors are checked in parallel by this many threads (the CRC releases the GIL); a few are enough to reach
# the memory's or the disk's speed.
THREADS = min(8, os.cpu_count() or 1)


def crc(data, value: int = 0) -> int:
    """CRC-32C of a bytes-like object (bytes, memoryview, a numpy array), continuing from `value`."""
    return crc32c.crc32c(data, value)


def tensor_crc(t: torch.Tensor) -> int:
    """CRC-32C of a tensor's bytes, read in place when it is on the CPU and contiguous (else from a copy)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.numel() == 0:
        return crc(b"")
    return crc(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def tensors(obj, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor in a nest of dicts, lists and tuples; a path joins the keys with '/'."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, f"{prefix}/{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{prefix}/{i}" if prefix else str(i))


def _skeleton(obj):
    """The nest with each tensor replaced by its dtype and shape: what the structure's CRC covers."""
    if isinstance(obj, torch.Tensor):
        return f"tensor({obj.dtype}, {tuple(obj.shape)})"
    if isinstance(obj, dict):
        return {k: _skeleton(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_skeleton(v) for v in obj)
    return obj


def canonical(obj) -> str:
    """repr() of a nest of dicts, lists, tuples, sets and plain values, but the same in every process: a set's
    elements in sorted order (repr's follows their hashes, which PYTHONHASHSEED changes from run to run for
    strings). For a nest without sets it is repr() itself, so checkpoints saved before match as they were.
    repr is exact for the floats, ints and strings saved."""
    if isinstance(obj, dict):
        return "{" + ", ".join(f"{canonical(k)}: {canonical(v)}" for k, v in obj.items()) + "}"
    if isinstance(obj, list):
        return "[" + ", ".join(canonical(v) for v in obj) + "]"
    if isinstance(obj, tuple):
        return "(" + ", ".join(canonical(v) for v in obj) + ("," if len(obj) == 1 else "") + ")"
    if isinstance(obj, (set, frozenset)):
        inner = ", ".join(sorted(canonical(v) for v in obj))
        if isinstance(obj, frozenset):
            return f"frozenset({{{inner}}})" if obj else "frozenset()"
        return f"{{{inner}}}" if obj else "set()"
    return repr(obj)


def structure_crc(obj: dict) -> int:
    """CRC-32C of everything but the tensors' bytes: the canonical form of the nest, each tensor as its dtype and
    shape."""
    return crc(canonical(_skeleton({k: v for k, v in obj.items() if k != KEY})).encode("utf-8"))


def _repr_crc(obj: dict) -> int:
    """The structure's CRC as it was computed before canonical() (repr: a set in its process' order), so that
    a checkpoint with a set saved then loads where it loaded before."""
    return crc(repr(_skeleton({k: v for k, v in obj.items() if k != KEY})).encode("utf-8"))


COPY_CHUNK = 4 << 20  # bytes read, checked and copied at a time by copy_and_crc: they stay in the CPU's cache


def copy_and_crc(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A copy of a CPU tensor in ordinary memory and the CRC-32C of its bytes, both from one pass over it, a
    cache-sized chunk at a time: for a memory-mapped tensor, one read of its pages instead of a copy and then a
    second pass for the CRC."""
    t = t.detach()
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
        return t.clone(), tensor_crc(t)
    copy = torch.empty_like(t)
    src, dst = t.reshape(-1).view(torch.uint8), copy.reshape(-1).view(torch.uint8)
    value = 0
    for i in range(0, src.numel(), COPY_CHUNK):
        part = src[i: i + COPY_CHUNK]
        value = crc(part.numpy(), value)
        dst[i: i + COPY_CHUNK].copy_(part)
    return copy, value


def tensor_crcs(named: list[tuple[str, torch.Tensor]], copies: dict[str, torch.Tensor] | None = None
                ) -> dict[str, int]:
    """{path: CRC} of the tensors, computed in parallel, each storage once (a tied weight appears twice). Given
    a dict `copies`, each tensor is also copied in the same pass (copy_and_crc) into copies[path] (a tied
    weight's paths share their copy)."""
    unique: dict[tuple, torch.Tensor] = {}
    keys = {}
    for path, t in named:
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.storage_offset()) if t.numel() else path
        keys[path] = key
        unique.setdefault(key, t)
    order = sorted(unique, key=lambda k: -unique[k].numel() * unique[k].element_size())  # the big ones first
    work = (lambda k: copy_and_crc(unique[k])) if copies is not None else (lambda k: (None, tensor_crc(unique[k])))
    if THREADS > 1 and len(order) > 1:
        with ThreadPoolExecutor(THREADS) as pool:
            done = dict(zip(order, pool.map(work, order)))
    else:
        done = {k: work(k) for k in order}
    if copies is not None:
        copies.update({path: done[keys[path]][0] for path, _ in named})
    return {path: done[keys[path]][1] for path, _ in named}


def replace_tensors(obj, new: dict[str, torch.Tensor], prefix: str = ""):
    """The nest `obj` with the tensor at each path of `new` (paths as tensors() names them) replaced."""
    if isinstance(obj, torch.Tensor):
        return new.get(prefix, obj)
    if isinstance(obj, dict):
        return {k: replace_tensors(v, new, f"{prefix}/{k}" if prefix else str(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(replace_tensors(v, new, f"{prefix}/{i}" if prefix else str(i)) for i, v in enumerate(obj))
    return obj


def record(obj: dict) -> dict:
    """The checksum record of a checkpoint dict, to store under obj[KEY]."""
    named = [(p, t) for p, t in tensors(obj) if not p.startswith(KEY + "/")]
    return {"algorithm": ALGORITHM, "structure": structure_crc(obj), "tensors": tensor_crcs(named)}


def mismatch(obj: dict, rec, skip: tuple[str, ...] = (), only: tuple[str, ...] | None = None,
             structure: bool = True, copies: dict[str, torch.Tensor] | None = None) -> str | None:
    """What in `obj` does not match its record `rec` (None when everything does): 'its metadata' or
    'tensor PATH'. Tensors under the top-level keys `skip` are not read (nor checked); with `only`, only those
    under these keys are. structure=False leaves the metadata out (checked by an earlier call). Given a dict
    `copies`, the tensors checked are copied into it in the same pass (tensor_crcs)."""
    if not isinstance(rec, dict) or rec.get("algorithm") != ALGORITHM or not isinstance(rec.get("tensors"), dict):
        return "its checksum record"
    if structure and rec.get("structure") != structure_crc(obj) and rec.get("structure") != _repr_crc(obj):
        return "its metadata (keys, settings, or a tensor's shape)"
    named = [(p, t) for p, t in tensors(obj) if p.partition("/")[0] not in skip and not p.startswith(KEY + "/")
             and (only is None or p.partition("/")[0] in only)]
    expected = rec["tensors"]
    missing = [p for p, _ in named if p not in expected]
    if missing:
        return f"tensor {missing[0]} (it has no checksum)"
    found = tensor_crcs(named, copies)
    bad = [p for p, _ in named if found[p] != expected[p]]
    return f"tensor {bad[0]}" if bad else None


def file_range_crc(path, offset: int, length: int, chunk: int = 64 << 20) -> int:
    """CRC-32C of `length` bytes of a file from `offset`, read in chunks."""
    value = 0
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        buf = bytearray(min(chunk, max(length, 1)))
        view = memoryview(buf)
        while length > 0:
            n = f.readinto(view[: min(chunk, length)])
            if not n:
                break  # a short file: the CRC of what is there will not match
            value = crc(view[:n], value)
            length -= n
    return value


# ----------------------------------------------------------------------------- safetensors files

# A .safetensors file has room for string metadata only: the tensors' CRCs go there, as JSON, under this key.
SAFETENSORS_KEY = "gptkit_crc32c"


def safetensors_metadata(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """The metadata entry recording the CRC of every tensor of a state dict about to be saved as safetensors."""
    return {SAFETENSORS_KEY: json.dumps(tensor_crcs(list(state.items())), sort_keys=True)}


def safetensors_mismatch(state: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> str | None:
    """What in a loaded safetensors state dict does not match the CRCs of its metadata: 'tensor NAME', or its
    checksum record; None when everything matches. Call only when the metadata has SAFETENSORS_KEY."""
    try:
        expected = json.loads((metadata or {})[SAFETENSORS_KEY])
    except (KeyError, ValueError):
        return "its checksum record"
    if not isinstance(expected, dict) or set(expected) != set(state):
        return "its checksum record (it lists other tensors than the file holds)"
    found = tensor_crcs(list(state.items()))
    bad = [k for k in state if found[k] != expected[k]]
    return f"tensor {bad[0]}" if bad else None
