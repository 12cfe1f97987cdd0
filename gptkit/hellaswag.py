"""HellaSwag: its validation items, and the completion scoring that GPT-2 reproductions report.

    items = read_items(obtain())                              # hellaswag_val.jsonl, downloaded once
    encoded = encode(items, tokenizer, model.config.block_size)
    score(model, encoded, rt)                                 # {"n": 10042, "acc": ..., "acc_norm": ...}

An item is a context (`ctx`) and four `endings`, one of them right (`label`). Completion scoring, the way
llm.c and build-nanogpt evaluate during training (the paper's setup and the Eleuther harness differ a little):
each ending follows the context after a space, and the model's cross-entropy is summed over the ending's
tokens only. `acc` counts the items whose right ending has the lowest total loss; `acc_norm`, the figure
usually quoted, those whose right ending has the lowest loss per token (long endings are not penalised).
Scored this way GPT-2 124M reaches acc_norm 0.2955 and gpt2-xl 0.4893 over the 10,042 items; chance is 0.25.

Tokens: the context and " " + ending are encoded separately and joined, so an ending's tokens are exactly those
of " " + ending. A sequence longer than the model's context keeps its last block_size + 1 tokens (the model
reads block_size of them and predicts the last block_size): the context is cut from the left, and only an
ending longer than the whole context would lose its first tokens. HellaSwag's items are under 200 GPT-2
tokens, so GPT-2 (1024) never cuts anything.

The file is https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl (10,042 items,
11 MB), downloaded on first use into the cache folder: $GPTKIT_CACHE_DIR if set, else $XDG_CACHE_HOME/gptkit,
else ~/.cache/gptkit. Offline, put a copy there (or give eval.py --input PATH).
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from gptkit.cli import one_line
from gptkit.errors import UserError
from gptkit.files import atomic_write
from gptkit.runtime import Dist, Runtime
from gptkit.tokenizer import Tokenizer
from model import bucketed_forward

URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
FILENAME = "hellaswag_val.jsonl"
N_ENDINGS = 4
# Published completion-style scores of OpenAI's GPT-2 over the full validation set (build-nanogpt's figures).
REFERENCE_ACC_NORM = {"gpt2": 0.2955, "gpt2-xl": 0.4893}


class HellaSwagError(UserError):
    """The HellaSwag file cannot be had or read, or the model cannot be scored on it."""


@dataclass(frozen=True)
class Item:
    ctx: str
    endings: tuple[str, ...]  # four of them
    label: int  # index of the right ending


@dataclass(frozen=True)
class Encoded:
    """One item as the model sees it: four token rows (context + ending, at most block_size + 1 long) and how
    many of each row's last tokens are the ending's, the ones scored."""

    rows: tuple[tuple[int, ...], ...]
    ending_lengths: tuple[int, ...]
    label: int


# ----------------------------------------------------------------------------- the file


def cache_dir() -> Path:
    """Where downloads are kept: $GPTKIT_CACHE_DIR, else $XDG_CACHE_HOME/gptkit, else ~/.cache/gptkit."""
    if os.environ.get("GPTKIT_CACHE_DIR"):
        return Path(os.environ["GPTKIT_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gptkit"


def obtain(input_path: str | os.PathLike | None = None) -> Path:
    """The HellaSwag validation file: `input_path` when given, else the cached copy, downloaded on first use."""
    if input_path:
        path = Path(input_path)
        if not path.is_file():
            raise HellaSwagError(f"HellaSwag file {path} does not exist; give the path of {FILENAME}")
        return path
    dest = cache_dir() / FILENAME
    if not dest.is_file():
        _download(dest)
    return dest


def obtain_once(d: Dist, input_path: str | os.PathLike | None = None) -> Path:
    """`obtain` for every rank of a job: rank 0 downloads, the others wait and learn whether it worked (a
    failure is the same one-line error on every rank, not a hang)."""
    if not d.enabled:
        return obtain(input_path)
    outcome: list = [None]  # the path, or the error message
    if d.master:
        try:
            outcome[0] = str(obtain(input_path))
        except HellaSwagError as e:
            outcome[0] = HellaSwagError(str(e))
    dist.broadcast_object_list(outcome, src=0)
    if isinstance(outcome[0], HellaSwagError):
        raise outcome[0]
    return Path(outcome[0])


def _download(dest: Path) -> None:
    print(f"downloading the HellaSwag validation set to {dest}", file=sys.stderr, flush=True)
    try:
        # urllib.request.urlopen is looked up at call time so that tests can replace it.
        with atomic_write(dest) as tmp, urllib.request.urlopen(URL, timeout=60) as resp, open(tmp, "wb") as f:
            total = int(resp.headers.get("Content-Length") or 0) or None
            with tqdm(total=total, unit="B", unit_scale=True, desc=FILENAME, leave=False) as bar:
                while chunk := resp.read(1 << 20):
                    f.write(chunk)
                    bar.update(len(chunk))
    except (urllib.error.URLError, OSError) as e:  # URLError, HTTPError and timeouts are OSErrors
        reason = getattr(e, "reason", None) or e
        raise HellaSwagError(
            f"could not download {URL} ({one_line(reason)}); without network, put a copy of {FILENAME} at "
            f"{dest} (or give its path with eval.py --input PATH)"
        ) from None


def read_items(path: str | os.PathLike, limit: int | None = None) -> list[Item]:
    """The items of a HellaSwag jsonl file (the first `limit` of them); a bad line is an error naming it."""
    path = Path(path)
    items = []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if limit is not None and len(items) >= limit:
                    break
                if line.strip():
                    items.append(_parse(line, f"{path} line {lineno}"))
    except UnicodeDecodeError as e:
        raise HellaSwagError(f"{path} is not UTF-8 text ({one_line(e)}); is it {FILENAME}?") from None
    except OSError as e:
        raise HellaSwagError(f"cannot read {path}: {e.strerror or one_line(e)}") from None
    if not items:
        raise HellaSwagError(f"{path} holds no HellaSwag items")
    return items


def _parse(line: str, where: str) -> Item:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise HellaSwagError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise HellaSwagError(f"{where}: expected a JSON object with ctx, endings and label")
    ctx, endings, label = obj.get("ctx"), obj.get("endings"), obj.get("label")
    if not isinstance(ctx, str):
        raise HellaSwagError(f"{where}: 'ctx' must be a string")
    if not (isinstance(endings, list) and len(endings) == N_ENDINGS and all(isinstance(e, str) for e in endings)):
        raise HellaSwagError(f"{where}: 'endings' must be a list of {N_ENDINGS} strings")
    if label is None:
        raise HellaSwagError(f"{where}: no 'label' (the test split is unlabelled; use the validation set)")
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < N_ENDINGS:
        raise HellaSwagError(f"{where}: 'label' must be an integer 0..{N_ENDINGS - 1}, got {label!r}")
    return Item(ctx=ctx, endings=tuple(endings), label=label)


# ----------------------------------------------------------------------------- scoring


def check_tokenizer(tokenizer: Tokenizer) -> None:
    """HellaSwag is English prose: a character-level model's vocabulary (Shakespeare's) cannot even encode it."""
    if tokenizer.kind == "char":
        raise HellaSwagError(
            "HellaSwag is scored with a BPE model such as GPT-2; this model's tokenizer is character-level"
        )


def encode(items: Sequence[Item], tokenizer: Tokenizer, block_size: int) -> list[Encoded]:
    """Token rows for every item, cut to the model's context (see the module docstring)."""
    check_tokenizer(tokenizer)
    keep = block_size + 1
    encoded = []
    for i, item in enumerate(items):
        ctx = tokenizer.encode(item.ctx)
        rows, lengths = [], []
        for ending in item.endings:
            end = tokenizer.encode(" " + ending)
            row = (ctx + end)[-keep:]
            rows.append(tuple(row))
            lengths.append(min(len(end), len(row) - 1))  # the first token of a row is never predicted
        if min(lengths) < 1:
            raise HellaSwagError(f"item {i + 1} has an empty context: its first token cannot be scored")
        encoded.append(Encoded(rows=tuple(rows), ending_lengths=tuple(lengths), label=item.label))
    return encoded


def ending_losses(model, batch: Sequence[Encoded], rt: Runtime,
                  hidden: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(total, mean per token) cross-entropy of every ending, each (items, 4) float32 on the CPU.

    The 4 * items rows are padded to one length (padding sits after each row's tokens, where causal attention
    never lets it change them), and the head runs only at the positions that predict an ending's token, in
    float32 (bf16 logits would be rounded by up to ~0.25 where endings differ by less). `hidden` replaces
    model.hidden_states (e.g. a compiled one)."""
    rows = [row for e in batch for row in e.rows]
    lengths = [n for e in batch for n in e.ending_lengths]
    width = max(len(row) for row in rows) - 1
    x = torch.zeros(len(rows), width, dtype=torch.long)
    y = torch.zeros(len(rows), width, dtype=torch.long)
    scored = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (row, n) in enumerate(zip(rows, lengths)):
        t = len(row) - 1
        x[i, :t] = torch.tensor(row[:-1])
        y[i, :t] = torch.tensor(row[1:])
        scored[i, t - n : t] = True
    x, y, scored = x.to(rt.device), y.to(rt.device), scored.to(rt.device)
    with rt.autocast():
        h = bucketed_forward(hidden or model.hidden_states, x, model.config.block_size)  # (R, T, C)
    logits = model.head(h[scored], fp32=True)  # (N, V) in full float32, no TF32: the scored positions only
    losses = F.cross_entropy(logits, y[scored], reduction="none")
    row_of = scored.nonzero()[:, 0]
    totals = torch.zeros(len(rows), device=rt.device).index_add_(0, row_of, losses)
    means = totals / scored.sum(dim=1)
    return totals.view(-1, N_ENDINGS).cpu(), means.view(-1, N_ENDINGS).cpu()


@torch.no_grad()
def score(model, encoded: Sequence[Encoded], rt: Runtime, d: Dist | None = None, *, batch_items: int = 16,
          hidden: Callable | None = None, progress: bool = False) -> dict:
    """{"n", "acc", "acc_norm"} over `encoded`. Under torchrun each rank scores every world_size-th item and
    the counts are summed over the ranks; every rank gets the totals. The model is put in eval mode for the
    scoring and back after."""
    d = d if d is not None else Dist()
    mine = list(encoded[d.rank :: d.world_size])
    mine.sort(key=lambda e: max(len(row) for row in e.rows))  # similar lengths together: little padding
    counts = torch.zeros(3, dtype=torch.int64)  # items, right by total loss, right by loss per token
    was_training = model.training
    model.eval()
    try:
        with tqdm(total=len(mine), desc="hellaswag", unit="item", disable=not progress, leave=False) as bar:
            for lo in range(0, len(mine), batch_items):
                batch = mine[lo : lo + batch_items]
                totals, means = ending_losses(model, batch, rt, hidden)
                labels = torch.tensor([e.label for e in batch])
                counts += torch.stack([torch.tensor(len(batch)), (totals.argmin(1) == labels).sum(),
                                       (means.argmin(1) == labels).sum()])
                bar.update(len(batch))
    finally:
        model.train(was_training)
    if d.enabled:
        counts = counts.to(rt.device)
        dist.all_reduce(counts)
    n, right, right_norm = counts.tolist()
    if n == 0:
        raise HellaSwagError("no HellaSwag items to score")
    return {"n": n, "acc": right / n, "acc_norm": right_norm / n}
