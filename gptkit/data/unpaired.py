"""Unpaired preference rows as batches, for KTO (gptkit/objectives/kto.py): a dataset prepared by
prepare/preference.py from rows of a prompt, one completion and a label (meta.json's "format": "unpaired"),
read row by row with each row's mismatched sequence beside it.

    rows = Rows("data/myrows", "train")                         # where each row's sequence and reply are
    loader = RowLoader("data/myrows", "train", batch_size=8, block_size=1024, seed=1337)
    batch = loader.next_batch()        # RowBatch: x, y (2B, T); labels (B,); pairs (B,): which rows of the split
    for batch in ValRows("data/myrows", "val", batch_size=8, block_size=1024): ...

Each row's sequence starts with <|endoftext|> (as a pair's do: how they are found), then the prompt rendered by
the chat template up to <|assistant|> (loss mask 0), then the completion and its <|end|> (mask 1, the reply).

KTO's reference point needs the model's log-probability of completions given prompts they do not belong to
(the "KL" sequences). The pairing is fixed, so that a full fine-tune's reference can score them once, before
the first step, as DPO's does: the KL sequence of row i is row i's prompt followed by the completion of row
i - 1 of the same split in its prepared order (row 0: the last row's). TRL's KTOTrainer also gives each row the
completion of the row before it, within each batch of its dataset's preprocessing. A file with both labels of
one prompt on consecutive lines pairs the second with the first's completion, a matched pair: shuffle such a
file before preparing it. A KL sequence longer than block_size + 1 tokens loses prompt tokens from its start,
just after <|endoftext|>, as prepare/preference.py cuts a row's.

A batch has the layout of gptkit/data/pairs.py's (fixed shapes, the targets -1 off the reply): x and y are
(2B, T), rows 0..B-1 the B rows' sequences and rows B..2B-1 their KL sequences in the same order; `labels` (B,)
float32 on the device, 1.0 for a desirable completion. The order and resume are PairLoader's (epochs of
np.random.default_rng([seed, e]) permutations of the rows).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import numpy as np
import torch

from gptkit.data.pairs import (
    PairBatch,
    PairLoader,
    ValPairs,
    is_preference_dataset,
    is_unpaired_dataset,
    unpaired_labels,
)
from gptkit.data.shards import TokenDataset, require_dataset
from gptkit.errors import DataError


def check_unpaired_dataset(meta: dict, label: str) -> None:
    """A one-line DataError unless the meta is an unpaired preference dataset with rows of both labels."""
    if not is_unpaired_dataset(meta):
        what = ("preference pairs (train on them with --objective=dpo)" if is_preference_dataset(meta) else
                "conversations (prepare/chat.py)" if "chat" in meta else "text")
        raise DataError(f"dataset {label} holds {what}, not unpaired rows; prepare rows of a prompt, a completion "
                        f"and a label (true: desirable) with python prepare/preference.py --input ROWS.jsonl")
    counts = meta["preference"].get("labels", {})
    desirable, undesirable = counts.get("desirable", 0), counts.get("undesirable", 0)
    if not (desirable and undesirable):
        has, lacks = ("desirable", "undesirable") if desirable else ("undesirable", "desirable")
        raise DataError(f"dataset {label} holds {desirable + undesirable:,} {has} rows and no {lacks} one: KTO "
                        f"weighs each kind against the other; add rows labelled {str(lacks == 'desirable').lower()}"
                        + (", or fine-tune on the completions alone (prepare/chat.py, objective=next_token)"
                           if desirable else ""))


@dataclass
class RowBatch(PairBatch):
    """B rows: x, y (2B, T) int64 (the rows' sequences, then their KL sequences), `pairs` (B,) int64: the rows'
    indices in `split` (PairBatch's name, what a precomputed reference is looked up by), `labels` (B,) float32
    on x's device (1.0: desirable), and `ref` (2B,) as PairBatch's (the reference's log-probabilities of the
    rows' replies, then of their KL sequences' replies)."""

    labels: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """x, y, labels and ref when it is there: what a CUDA graph copies into its static buffers."""
        return (self.x, self.y, self.labels) + (() if self.ref is None else (self.ref,))

    def with_tensors(self, tensors: tuple[torch.Tensor, ...]) -> RowBatch:
        return dataclasses.replace(self, x=tensors[0], y=tensors[1], labels=tensors[2],
                                   ref=tensors[3] if len(tensors) > 3 else None)

    def half(self, kl: bool) -> PairBatch:
        """The rows' sequences (kl=False) or their KL sequences as a batch of B sequences (x, y views)."""
        B = len(self)
        part = slice(B, 2 * B) if kl else slice(0, B)
        return PairBatch(self.x[part], self.y[part], self.pairs, self.split)


class Rows:
    """The rows of one split of an unpaired dataset: starts (n,), lengths (n,) and heads (n,) (the prompt's
    tokens, <|endoftext|> to <|assistant|>: the reply starts at start + head) of each row's sequence in the
    split's token stream, and labels (n,) bool. The interface of gptkit/data/pairs.py's Pairs, so that the
    pair loaders read rows (RowLoader, ValRows)."""

    noun = "rows"

    def __init__(self, data_dir: str | os.PathLike, split: str, chunk: int = 1 << 24):
        self.dataset = TokenDataset(require_dataset(data_dir), split)
        self.split = split
        meta = self.dataset.meta
        check_unpaired_dataset(meta, str(data_dir))
        n = meta["preference"]["rows"][split]
        self.labels = unpaired_labels(data_dir, split)
        eot = meta["eot_id"]
        masks = self.dataset.masks
        starts = _joined([np.flatnonzero(shard[lo : lo + chunk] == eot) + offset + lo
                          for offset, shard in zip(self.dataset.offsets, self.dataset.shards)
                          for lo in range(0, len(shard), chunk)])
        replies = []
        previous = False  # the mask of the token before each chunk: a reply starts where the mask turns 1
        for offset, mask in zip(masks.offsets, masks.shards) if masks is not None else ():
            for lo in range(0, len(mask), chunk):
                on = mask[lo : lo + chunk] != 0
                turned = on & ~np.concatenate([[previous], on[:-1]])
                replies.append(np.flatnonzero(turned) + offset + lo)
                previous = bool(on[-1]) if len(on) else previous
        replies = _joined(replies)
        ends = np.append(starts[1:], len(self.dataset))
        if (len(starts) != n or len(replies) != n or masks is None or (n and starts[0] != 0)
                or np.any(replies <= starts) or np.any(replies >= ends)):
            raise DataError(f"the {split} split of {self.dataset.data_dir} should hold {n} rows, each a prompt and "
                            f"a reply, but its shards hold {len(starts)} sequences and {len(replies)} replies; "
                            f"prepare it again with prepare/preference.py")
        self.starts, self.lengths, self.heads = starts, ends - starts, replies - starts
        self.eot = eot

    def __len__(self) -> int:
        return len(self.starts)

    def partner(self, indices: np.ndarray) -> np.ndarray:
        """The rows whose completions follow the prompts of rows `indices` in their KL sequences: i - 1 (row 0:
        the last row)."""
        return (np.asarray(indices, dtype=np.int64) - 1) % len(self)

    def kl_lengths(self) -> np.ndarray:
        """Each row's KL sequence's tokens, before any cut: its prompt's and its partner's reply's."""
        other = self.partner(np.arange(len(self)))
        return self.heads + self.lengths[other] - self.heads[other]

    @property
    def longest(self) -> int:
        """The longest sequence's tokens, rows and KL sequences (a batch needs T >= longest - 1, or cuts the KL
        sequences' prompts)."""
        return int(max(self.lengths.max(initial=0), self.kl_lengths().max(initial=0)))

    def check_fits(self, block_size: int) -> None:
        """The rows' own sequences must fit (prepare/preference.py cut them to its --block_size); a KL sequence
        that does not is cut from its prompt's start when read."""
        longest = int(self.lengths.max(initial=0))
        if longest > block_size + 1:
            raise DataError(f"the {self.split} split of {self.dataset.data_dir} has sequences of up to {longest} "
                            f"tokens, more than block_size + 1 = {block_size + 1}; prepare the rows again with "
                            f"--block_size {block_size}")

    def _sequence(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        start, n = int(self.starts[i]), int(self.lengths[i])
        return self.dataset.window(start, n).astype(np.int64), self.dataset.masks.window(start, n) != 0

    def read(self, indices: np.ndarray, block_size: int, device: torch.device | str = "cpu") -> RowBatch:
        """The rows `indices` and their KL sequences as a RowBatch of T = block_size (the module docstring)."""
        indices = np.asarray(indices, dtype=np.int64)
        B, T = len(indices), block_size
        x = np.full((2 * B, T), self.eot, dtype=np.int64)
        y = np.full((2 * B, T), -1, dtype=np.int64)
        for row, (i, j) in enumerate(zip(indices.tolist(), self.partner(indices).tolist())):
            ids, trained = self._sequence(i)
            other, other_trained = self._sequence(j)
            head, reply = int(self.heads[i]), int(self.heads[j])
            keep = max(1, min(head, T + 1 - (len(other) - reply)))  # the prompt's tokens kept: <|endoftext|> ...
            kl = np.concatenate([ids[:1], ids[1 + head - keep : head], other[reply:]])
            kl_trained = np.concatenate([trained[:1], trained[1 + head - keep : head], other_trained[reply:]])
            for r, (seq, on) in ((row, (ids, trained)), (B + row, (kl, kl_trained))):
                n = len(seq)
                x[r, : n - 1] = seq[:-1]
                y[r, : n - 1] = np.where(on[1:], seq[1:], -1)
        labels = torch.from_numpy(self.labels[indices].astype(np.float32))
        batch = PairBatch(_to_device(x, device), _to_device(y, device), torch.from_numpy(indices), self.split)
        return RowBatch(batch.x, batch.y, batch.pairs, batch.split, labels=_to_device(labels, device))


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


def _to_device(t, device) -> torch.Tensor:
    t = torch.from_numpy(t) if isinstance(t, np.ndarray) else t
    device = torch.device(device)
    if device.type == "cuda":  # pinned: the copy runs asynchronously with the GPU's current work
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class RowLoader(PairLoader):
    """Training batches of rows with their KL sequences, in epochs: PairLoader's order and state over rows."""

    MODE = "unpaired rows"
    ITEMS = Rows
    READS = "unpaired preference rows"


class ValRows(ValPairs):
    """Fixed batches of a split's rows with their KL sequences: ValPairs' batches over rows."""

    ITEMS = Rows
