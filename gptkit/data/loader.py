"""Deterministic training and validation batches over a prepared token dataset.

The data is seen as an infinite stream of *global samples* k = 0, 1, 2, ...  Sample k is the window
``tokens[start_k : start_k + block_size + 1]`` (x is its first block_size tokens, y the same shifted by one),
and ``start_k`` is a pure function of (seed, k). The c-th call of ``next_batch()`` on rank r returns samples
``[(c * world_size + r) * batch_size, ... + batch_size)``.

Why this design: because nothing depends on hidden RNG state,
  * resuming only needs the index of the next sample (``state_dict`` is four plain values),
  * DDP ranks are disjoint by construction and, together, see exactly what one process with the same global
    batch would see (so a run's data does not depend on how many GPUs it used, and a resume may even change
    world_size as long as world_size * batch_size stays the same).

Modes:
  * "random": start_k = splitmix64(seed, k) mod (number of valid starts): i.i.d.-like windows, any offset.
  * "epoch":  the split is cut into n_win non-overlapping windows; epoch e visits all of them once in the order
    of a permutation drawn from ``np.random.default_rng([seed, e])``.

A chat dataset (prepare/chat.py) has a loss mask: y is -1 (no loss) wherever the target token is context (the
system and user turns, the template's markers) and the token itself where it is trained (the assistant's
replies). Its windows start where conversations start (at their <|endoftext|>), so a reply is always seen
after its question: "random" draws among those starts, "epoch" visits each once per epoch; a window holds
its conversation and, when that is shorter, the ones that follow.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from gptkit.data.shards import TokenDataset
from gptkit.errors import DataError

MODES = ("random", "epoch")
_MASK64 = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a cheap, well-mixed bijection on uint64 (vectorised, wrap-around arithmetic)."""
    x = x.copy()
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def random_starts(seed: int, ks: np.ndarray, n_starts: int) -> np.ndarray:
    """Counter-based window starts: the same (seed, k) always gives the same start, independent of order."""
    with np.errstate(over="ignore"):
        key = _splitmix64(np.array([seed & _MASK64], dtype=np.uint64))[0]
        # SplitMix64's own stream: state_k = key + (k + 1) * golden gamma, then finalise.
        state = key + (np.asarray(ks, dtype=np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        h = _splitmix64(state)
    # Modulo bias is at most n_starts / 2**64: negligible for any real corpus.
    return (h % np.uint64(n_starts)).astype(np.int64)


class EpochOrder:
    """Window indices for "epoch" mode (0..n_win-1, each once per epoch), caching the permutations of the
    epochs currently being read. (gptkit/data/pairs.py orders its pairs with it too.)"""

    def __init__(self, seed: int, n_win: int):
        self.seed, self.n_win = seed, n_win
        self._cache: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._cache:
            if len(self._cache) >= 2:  # a batch spans at most two epochs in practice; keep memory bounded
                self._cache.pop(min(self._cache))
            self._cache[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n_win)
        return self._cache[epoch]

    def windows(self, ks: np.ndarray) -> np.ndarray:
        ks = np.asarray(ks, dtype=np.int64)
        epochs, pos = np.divmod(ks, self.n_win)
        out = np.empty(len(ks), dtype=np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._perm(int(e))[pos[sel]]
        return out


def conversation_starts(dataset: TokenDataset, block_size: int, chunk: int = 1 << 24) -> np.ndarray:
    """The positions of a chat dataset's conversation starts (its <|endoftext|> tokens) from which a whole
    window of block_size + 1 tokens fits; a DataError if there is none."""
    eot = dataset.meta.get("eot_id")
    if not isinstance(eot, int):
        raise DataError(f"{dataset.data_dir} has a loss mask but no end-of-text token to find its conversations "
                        f"by; re-run prepare/chat.py")
    found = []
    for offset, shard in zip(dataset.offsets, dataset.shards):
        for lo in range(0, len(shard), chunk):
            found.append(np.flatnonzero(shard[lo : lo + chunk] == eot) + offset + lo)
    starts = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
    starts = starts[starts + block_size + 1 <= len(dataset)]
    if not len(starts):
        raise DataError(f"the {dataset.split} split of {dataset.data_dir} has no conversation start with "
                        f"block_size + 1 = {block_size + 1} tokens after it; use a smaller --block_size or more data")
    return starts.astype(np.int64)


def read_batch(dataset: TokenDataset, starts: np.ndarray, block_size: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The windows at `starts` as x, y (B, T) on device; y is -1 where a loss mask says the target is context."""
    windows = dataset.windows(starts, block_size + 1)
    if dataset.masks is not None:
        trained = dataset.masks.windows(starts, block_size + 1)[:, 1:] != 0
        targets = np.where(trained, windows[:, 1:], -1)
        windows = np.concatenate([windows[:, :-1], targets], axis=1)  # x, then y: split by _to_tensors
        return _to_tensors(windows, device, split_at=block_size)
    return _to_tensors(windows, device)


def _check_common(
    dataset: TokenDataset, batch_size: int, block_size: int, seed: int, rank: int, world_size: int
) -> None:
    if "preference" in dataset.meta:  # prepare/preference.py's pairs: read by gptkit/data/pairs.py instead
        raise DataError(f"{dataset.data_dir} holds preference pairs (prepare/preference.py): the language-model "
                        f"loss would learn the rejected replies too; tune on them with the DPO objective, or "
                        f"prepare conversations with prepare/chat.py to fine-tune on")
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise DataError(f"the data seed must be a non-negative integer, got {seed!r}")
    if batch_size < 1:
        raise DataError(f"batch_size must be at least 1, got {batch_size}")
    if block_size < 1:
        raise DataError(f"block_size must be at least 1, got {block_size}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise DataError(f"rank must be in [0, world_size), got rank={rank} world_size={world_size}")
    if len(dataset) < block_size + 1:
        raise DataError(
            f"{dataset.split} split of {dataset.data_dir} has {len(dataset)} tokens, fewer than "
            f"block_size+1 = {block_size + 1}; use a smaller --block_size or more data"
        )


def _to_tensors(windows: np.ndarray, device: torch.device,
                split_at: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T+1) int64 windows -> contiguous x, y (B, T) on device (x the first T, y the last T); or, with
    split_at=T, (B, 2T) rows that hold x and then y."""
    if split_at is None:
        x, y = windows[:, :-1], windows[:, 1:]
    else:
        x, y = windows[:, :split_at], windows[:, split_at:]
    x = torch.from_numpy(np.ascontiguousarray(x))
    y = torch.from_numpy(np.ascontiguousarray(y))
    if device.type == "cuda":
        # Pinned host memory lets the copy run asynchronously with the GPU's current work.
        x = x.pin_memory().to(device, non_blocking=True)
        y = y.pin_memory().to(device, non_blocking=True)
    elif device.type != "cpu":
        x, y = x.to(device), y.to(device)
    return x, y


class BatchLoader:
    """Training batches; see the module docstring for the exact sample schedule."""

    def __init__(
        self,
        data_dir: str | os.PathLike,
        split: str = "train",
        *,
        batch_size: int,
        block_size: int,
        seed: int = 1337,
        mode: str = "random",
        rank: int = 0,
        world_size: int = 1,
        device: str | torch.device = "cpu",
    ):
        if mode not in MODES:
            raise DataError(f"unknown loader mode {mode!r}; use one of {', '.join(MODES)}")
        self.dataset = TokenDataset(data_dir, split)
        _check_common(self.dataset, batch_size, block_size, seed, rank, world_size)
        self.batch_size, self.block_size, self.seed, self.mode = batch_size, block_size, seed, mode
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.calls = 0  # c: number of next_batch() calls made so far
        self._prefetched: tuple[torch.Tensor, torch.Tensor] | None = None  # the batch of call c, read early
        n = len(self.dataset)
        # A chat dataset's windows start at its conversations; others anywhere (random) or every block_size.
        self.conversations = conversation_starts(self.dataset, block_size) if self.dataset.masks else None
        if self.conversations is not None:
            self.n_starts = self.n_windows = len(self.conversations)
        else:
            self.n_starts = n - block_size  # valid random starts: 0 .. n - block_size - 1
            self.n_windows = (n - 1) // block_size  # non-overlapping windows of block_size + 1 tokens (epoch)
        self._epoch = EpochOrder(seed, self.n_windows) if mode == "epoch" else None

    def sample_starts(self, ks: np.ndarray) -> np.ndarray:
        """Start offsets of global samples ks (pure function of seed and k)."""
        if self._epoch is not None:
            index = self._epoch.windows(ks)
            return self.conversations[index] if self.conversations is not None else index * self.block_size
        index = random_starts(self.seed, ks, self.n_starts)
        return self.conversations[index] if self.conversations is not None else index

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self._prefetched if self._prefetched is not None else self._read(self.calls)
        self._prefetched = None
        self.calls += 1
        return batch

    def prefetch(self) -> None:
        """Read the batch the next next_batch() returns, now: called while the GPU is busy with the current
        micro-batch, the memmap read and the host-to-device copy are off the step's critical path (the data
        position, and so state_dict, still moves only with next_batch)."""
        if self._prefetched is None:
            self._prefetched = self._read(self.calls)

    def _read(self, call: int) -> tuple[torch.Tensor, torch.Tensor]:
        first = (call * self.world_size + self.rank) * self.batch_size
        ks = np.arange(first, first + self.batch_size, dtype=np.int64)
        return read_batch(self.dataset, self.sample_starts(ks), self.block_size, self.device)

    @property
    def epoch(self) -> float:
        """Fractional number of passes over the split's tokens so far (all ranks together), for logging."""
        seen = self.calls * self.world_size * self.batch_size * self.block_size
        return seen / max(1, len(self.dataset))

    def state_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "seed": int(self.seed),
            "block_size": int(self.block_size),
            "next_sample": int(self.calls * self.world_size * self.batch_size),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [k for k in ("mode", "seed", "block_size", "next_sample") if k not in state]
        if missing:
            raise DataError(f"loader state is missing {', '.join(missing)}; the checkpoint is not from this loader")
        for key in ("mode", "seed", "block_size"):
            if state[key] != getattr(self, key):
                raise DataError(
                    f"checkpoint's data loader used {key}={state[key]!r} but this run uses {getattr(self, key)!r}; "
                    f"resume with the same {key} to continue the same data order"
                )
        per_call = self.world_size * self.batch_size
        next_sample = int(state["next_sample"])
        if next_sample < 0 or next_sample % per_call:
            raise DataError(
                f"checkpoint's data position {next_sample} is not a multiple of world_size*batch_size = {per_call}; "
                "resume with the same global batch (world_size * batch_size) as the checkpointed run"
            )
        self.calls = next_sample // per_call
        self._prefetched = None


class ValBatches:
    """A fixed set of validation batches: the same windows every time, so val losses compare across runs.

    Global batch i holds samples [i*batch_size, (i+1)*batch_size) of the "random" schedule with ``seed``;
    rank r evaluates the batches with i % world_size == r (ranks may get one batch more than others when
    world_size does not divide n_batches, so reduce sums and counts, not per-rank means).
    """

    def __init__(
        self,
        data_dir: str | os.PathLike,
        split: str = "val",
        *,
        batch_size: int,
        block_size: int,
        n_batches: int,
        seed: int = 1234,
        rank: int = 0,
        world_size: int = 1,
        device: str | torch.device = "cpu",
    ):
        if n_batches < 1:
            raise DataError(f"n_batches for evaluation must be at least 1, got {n_batches}; raise --eval_iters")
        self.dataset = TokenDataset(data_dir, split)
        _check_common(self.dataset, batch_size, block_size, seed, rank, world_size)
        self.batch_size, self.block_size, self.n_batches, self.seed = batch_size, block_size, n_batches, seed
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.conversations = conversation_starts(self.dataset, block_size) if self.dataset.masks else None
        self.n_starts = len(self.dataset) - block_size if self.conversations is None else len(self.conversations)

    def __len__(self) -> int:
        """Number of batches this rank yields."""
        return len(range(self.rank, self.n_batches, self.world_size))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(self.rank, self.n_batches, self.world_size):
            ks = np.arange(i * self.batch_size, (i + 1) * self.batch_size, dtype=np.int64)
            starts = random_starts(self.seed, ks, self.n_starts)
            if self.conversations is not None:
                starts = self.conversations[starts]
            yield read_batch(self.dataset, starts, self.block_size, self.device)
