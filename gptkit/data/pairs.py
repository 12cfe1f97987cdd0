"""Preference pairs as batches: a preference dataset (prepare/preference.py) read whole pair by whole pair,
for DPO (gptkit/objectives/dpo.py) and for scoring pairs (eval.py --task preference).

    pairs = Pairs("data/mypairs", "train")                     # where each pair's two sequences are
    loader = PairLoader("data/mypairs", "train", batch_size=8, block_size=1024, seed=1337)
    batch = loader.next_batch()        # PairBatch: x, y (2B, T); pairs (B,): which pairs of the split
    for batch in ValPairs("data/mypairs", "val", batch_size=8, block_size=1024, n_batches=4): ...

A preference dataset is a chat dataset (token shards and a loss mask) whose meta.json has a "preference"
entry; its sequences come in pairs, the chosen one first, each starting with <|endoftext|>, which no text
encodes to, so the sequences are found by that token (their number is checked against meta.json). One whose
entry says "format": "unpaired" holds one sequence per prompt + completion row and a label each instead:
refused here, as DPO needs pairs (`unpaired_labels` reads its labels).

A batch has fixed shapes whatever its pairs, for torch.compile and CUDA graphs: x and y are (2B, T) with
T = block_size, rows 0..B-1 the chosen sequences of the B pairs and rows B..2B-1 their rejected ones in the
same order. Row r holds a sequence of n <= T + 1 tokens as x[r, :n-1] = its first n-1 tokens and y[r, :n-1] =
its last n-1 (the next token at each position), then padding: x <|endoftext|>, y -1. y is -1 too wherever the
next token is not a reply token (the prompt, the template's markers before the reply): a sum of log-probs
over the positions where y != -1 is the reply's log-probability given its prompt.

Order (PairLoader), as gptkit/data/loader.py's "epoch" mode: global sample k = 0, 1, 2, ... is pair
perm_e[k mod n] of epoch e = k // n, perm_e the permutation drawn from np.random.default_rng([seed, e]); the
c-th next_batch() of rank r returns samples [(c * world_size + r) * B, ... + B). Nothing depends on hidden
state: state_dict is the next sample's index (and what must match), so a resume continues with the exact
batches an uninterrupted run reads, and the ranks' batches are disjoint and together those of one process
with the same global batch. ValPairs reads the split's pairs in their order, the same ones every time.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gptkit.data.loader import EpochOrder
from gptkit.data.shards import TokenDataset, open_shard, read_meta, require_dataset
from gptkit.errors import DataError

KIND = "preference"  # the meta.json entry that makes a dataset a preference dataset
UNPAIRED = "unpaired"  # its "format" for prompt, completion, label rows (no "format", or "pairs": pairs)


def is_preference_dataset(meta: dict[str, Any]) -> bool:
    return KIND in meta


def is_unpaired_dataset(meta: dict[str, Any]) -> bool:
    """Whether the meta is an unpaired preference dataset's (prompt, completion, label rows: not pairs)."""
    return is_preference_dataset(meta) and meta[KIND].get("format") == UNPAIRED


def check_preference_dataset(meta: dict[str, Any], label: str) -> None:
    """A one-line DataError unless the meta is a preference dataset of pairs."""
    if not is_preference_dataset(meta):
        what = "conversations (prepare/chat.py)" if "chat" in meta else "text"
        raise DataError(f"dataset {label} holds {what}, not preference pairs; prepare pairs with "
                        f"python prepare/preference.py --input PAIRS.jsonl")
    if is_unpaired_dataset(meta):
        raise DataError(f"dataset {label} holds unpaired rows (a prompt, one completion and a label), not pairs: "
                        f"train on them with --objective=kto, or prepare rows with a prompt, a chosen and a "
                        f"rejected reply with python prepare/preference.py")


def unpaired_labels(data_dir: str | os.PathLike, split: str) -> np.ndarray:
    """The labels (bool, True: a desirable completion) of an unpaired dataset's split, one per sequence in
    order (each sequence starts with <|endoftext|>, as a pair's do)."""
    path = require_dataset(data_dir)
    meta = read_meta(path)
    if not is_unpaired_dataset(meta):
        raise DataError(f"dataset {data_dir} holds no unpaired rows (prompt, completion, label); prepare them "
                        f"with python prepare/preference.py")
    entry = meta["splits"].get(split, {})
    labels = [open_shard(path / name) for name in entry.get("labels", [])]
    out = np.concatenate(labels) if labels else np.zeros(0, np.uint16)
    n = meta[KIND]["rows"][split]
    if len(out) != n:
        raise DataError(f"the {split} split of {path} should hold {n} labels but holds {len(out)}; prepare it "
                        f"again with prepare/preference.py")
    return out != 0


@dataclass
class PairBatch:
    """B pairs: x, y (2B, T) int64 (the chosen sequences, then the rejected ones; y = -1 where not a reply
    token), `pairs` (B,) int64: their indices in `split` (what a precomputed reference is looked up by), and
    `ref` (2B,) float32 on x's device: the reference's log-probabilities of the replies when they were read
    with the batch (PairLoader's reference_logps), else None."""

    x: torch.Tensor
    y: torch.Tensor
    pairs: torch.Tensor
    split: str
    ref: torch.Tensor | None = None

    def __len__(self) -> int:  # pairs
        return len(self.pairs)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors a step computes with, on the device: x, y and ref when it is there (what a CUDA graph
        copies into its static buffers, gptkit/cudagraph.py)."""
        return (self.x, self.y) if self.ref is None else (self.x, self.y, self.ref)

    def with_tensors(self, tensors: tuple[torch.Tensor, ...]) -> PairBatch:
        """A batch of the same kind with other tensors of tensors()'s shapes (a graph's static buffers, which
        hold each step's pairs in turn: `pairs` and `split` stay this batch's, so what a step needs of a pair
        must come in the tensors, as ref does)."""
        return dataclasses.replace(self, x=tensors[0], y=tensors[1], ref=tensors[2] if len(tensors) > 2 else None)


class Pairs:
    """The pairs of one split of a preference dataset: starts (n, 2) and lengths (n, 2) of each pair's chosen
    and rejected sequence in the split's token stream."""

    noun = "pairs"  # what the loaders' messages call the items

    def __init__(self, data_dir: str | os.PathLike, split: str, chunk: int = 1 << 24):
        self.dataset = TokenDataset(require_dataset(data_dir), split)
        self.split = split
        meta = self.dataset.meta
        check_preference_dataset(meta, str(data_dir))
        n = meta[KIND]["pairs"][split]
        eot = meta["eot_id"]
        found = [np.flatnonzero(shard[lo : lo + chunk] == eot) + offset + lo
                 for offset, shard in zip(self.dataset.offsets, self.dataset.shards)
                 for lo in range(0, len(shard), chunk)]
        starts = np.concatenate(found).astype(np.int64) if found else np.zeros(0, dtype=np.int64)
        if len(starts) != 2 * n or self.dataset.masks is None or (n and starts[0] != 0):
            raise DataError(f"the {split} split of {self.dataset.data_dir} should hold {n} pairs but its shards "
                            f"hold {len(starts)} sequences; prepare it again with prepare/preference.py")
        ends = np.append(starts[1:], len(self.dataset))
        self.starts, self.lengths = starts.reshape(n, 2), (ends - starts).reshape(n, 2)
        self.eot = eot

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def longest(self) -> int:
        """The longest sequence's tokens (a batch needs T >= longest - 1)."""
        return int(self.lengths.max(initial=0))

    def check_fits(self, block_size: int) -> None:
        if self.longest > block_size + 1:
            raise DataError(f"the {self.split} split of {self.dataset.data_dir} has sequences of up to "
                            f"{self.longest} tokens, more than block_size + 1 = {block_size + 1}; prepare the "
                            f"pairs again with --block_size {block_size}")

    def read(self, indices: np.ndarray, block_size: int, device: torch.device | str = "cpu") -> PairBatch:
        """The pairs `indices` as a PairBatch of T = block_size (see the module docstring for the layout)."""
        indices = np.asarray(indices, dtype=np.int64)
        B, T = len(indices), block_size
        x = np.full((2 * B, T), self.eot, dtype=np.int64)
        y = np.full((2 * B, T), -1, dtype=np.int64)
        for side in (0, 1):  # chosen rows first, then rejected
            for row, i in enumerate(indices, start=side * B):
                start, n = int(self.starts[i, side]), int(self.lengths[i, side])
                ids = self.dataset.window(start, n).astype(np.int64)
                trained = self.dataset.masks.window(start, n)[1:] != 0
                x[row, : n - 1] = ids[:-1]
                y[row, : n - 1] = np.where(trained, ids[1:], -1)
        return PairBatch(_to_device(x, device), _to_device(y, device), torch.from_numpy(indices), self.split)


def _to_device(a: np.ndarray, device: torch.device | str) -> torch.Tensor:
    t = torch.from_numpy(a)
    device = torch.device(device)
    if device.type == "cuda":  # pinned: the copy runs asynchronously with the GPU's current work
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _check_batch(batch_size: int, rank: int, world_size: int) -> None:
    if batch_size < 1:
        raise DataError(f"batch_size must be at least 1 pair, got {batch_size}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise DataError(f"rank must be in [0, world_size), got rank={rank} world_size={world_size}")


class PairLoader:
    """Training batches of whole pairs, in epochs (see the module docstring for the exact order). A subclass may
    read other items of the same interface as Pairs (ITEMS: gptkit/data/unpaired.py's rows for KTO)."""

    MODE = "pairs"  # state_dict's "mode": a BatchLoader's state is refused, and the other way round
    ITEMS: type = Pairs
    READS = "preference pairs"  # what its errors say it reads

    def __init__(self, data_dir: str | os.PathLike, split: str = "train", *, batch_size: int, block_size: int,
                 seed: int = 1337, rank: int = 0, world_size: int = 1, device: str | torch.device = "cpu",
                 reference_logps: Callable[[PairBatch], torch.Tensor] | None = None):
        if not isinstance(seed, (int, np.integer)) or seed < 0:
            raise DataError(f"the data seed must be a non-negative integer, got {seed!r}")
        _check_batch(batch_size, rank, world_size)
        self.pairs = self.ITEMS(data_dir, split)
        if not len(self.pairs):
            raise DataError(f"the {split} split of {data_dir} holds no {self.pairs.noun}; prepare more "
                            f"{self.pairs.noun}")
        self.pairs.check_fits(block_size)
        self.batch_size, self.block_size, self.seed = batch_size, block_size, seed
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.order = EpochOrder(seed, len(self.pairs))
        self.calls = 0  # next_batch() calls so far
        self._prefetched: PairBatch | None = None
        # When given, each batch's reference log-probabilities, read with it into batch.ref (a precomputed
        # reference's table: gptkit/objectives/preference_losses.py), so that a step finds them on the device,
        # as a CUDA graph needs.
        self.reference_logps = reference_logps

    def next_batch(self) -> PairBatch:
        batch = self._prefetched if self._prefetched is not None else self._read(self.calls)
        self._prefetched = None
        self.calls += 1
        return batch

    def prefetch(self) -> None:
        """Read the batch the next next_batch() returns now (as BatchLoader.prefetch: off the critical path)."""
        if self._prefetched is None:
            self._prefetched = self._read(self.calls)

    def sample_pairs(self, ks: np.ndarray) -> np.ndarray:
        """The pair indices of global samples ks."""
        return self.order.windows(ks)

    def _read(self, call: int) -> PairBatch:
        first = (call * self.world_size + self.rank) * self.batch_size
        ks = np.arange(first, first + self.batch_size, dtype=np.int64)
        batch = self.pairs.read(self.sample_pairs(ks), self.block_size, self.device)
        if self.reference_logps is not None:
            batch.ref = self.reference_logps(batch)
        return batch

    @property
    def epoch(self) -> float:
        """Passes over the split's pairs so far (all ranks together), for logging."""
        return self.calls * self.world_size * self.batch_size / len(self.pairs)

    def state_dict(self) -> dict[str, Any]:
        return {"mode": self.MODE, "seed": int(self.seed), "block_size": int(self.block_size),
                "next_sample": int(self.calls * self.world_size * self.batch_size)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [k for k in ("mode", "seed", "block_size", "next_sample") if k not in state]
        if missing:
            raise DataError(f"loader state is missing {', '.join(missing)}; the checkpoint is not from this "
                            f"loader")
        if state["mode"] != self.MODE:
            raise DataError(f"the checkpoint's data loader read {state['mode']!r} batches, this run reads "
                            f"{self.READS}; resume it with its own objective and dataset")
        for key in ("seed", "block_size"):
            if state[key] != getattr(self, key):
                raise DataError(f"checkpoint's data loader used {key}={state[key]!r} but this run uses "
                                f"{getattr(self, key)!r}; resume with the same {key} to continue the same data "
                                f"order")
        per_call = self.world_size * self.batch_size
        next_sample = int(state["next_sample"])
        if next_sample < 0 or next_sample % per_call:
            raise DataError(f"checkpoint's data position {next_sample} is not a multiple of "
                            f"world_size*batch_size = {per_call}; resume with the same global batch "
                            f"(world_size * batch_size)")
        self.calls = next_sample // per_call
        self._prefetched = None


class ValPairs:
    """Fixed batches of a split's pairs, the same every time. n_batches=None: every pair once, in order (the
    last batch is short when B does not divide them); else n_batches batches of B pairs, global batch i holding
    pairs [i*B, (i+1)*B) modulo their number (fixed shapes). Rank r reads the batches i with
    i % world_size == r (so reduce sums and counts across ranks, not means). ITEMS: as PairLoader's."""

    ITEMS: type = Pairs

    def __init__(self, data_dir: str | os.PathLike, split: str = "val", *, batch_size: int, block_size: int,
                 n_batches: int | None = None, rank: int = 0, world_size: int = 1,
                 device: str | torch.device = "cpu", limit: int = 0):
        _check_batch(batch_size, rank, world_size)
        if n_batches is not None and n_batches < 1:
            raise DataError(f"n_batches must be at least 1, got {n_batches}")
        self.pairs = self.ITEMS(data_dir, split)
        self.n = min(len(self.pairs), limit) if limit else len(self.pairs)
        if not self.n:
            raise DataError(f"the {split} split of {data_dir} holds no {self.pairs.noun}")
        self.pairs.check_fits(block_size)
        self.batch_size, self.block_size = batch_size, block_size
        self.n_batches = -(-self.n // batch_size) if n_batches is None else n_batches
        self.wrap = n_batches is not None
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)

    def __len__(self) -> int:
        """Batches this rank reads."""
        return len(range(self.rank, self.n_batches, self.world_size))

    def first(self) -> PairBatch:
        """Global batch 0, whichever rank this is (a stand-in where a rank must run a forward it has no batch
        for)."""
        return self.pairs.read(np.arange(min(self.batch_size, self.n)), self.block_size, self.device)

    def __iter__(self) -> Iterator[PairBatch]:
        for i in range(self.rank, self.n_batches, self.world_size):
            ks = np.arange(i * self.batch_size, (i + 1) * self.batch_size, dtype=np.int64)
            ks = ks % self.n if self.wrap else ks[ks < self.n]
            yield self.pairs.read(ks, self.block_size, self.device)
