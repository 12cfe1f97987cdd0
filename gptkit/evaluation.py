"""A training run's evaluations: the objective's loss (and its metrics) over the fixed validation batches,
and HellaSwag's accuracy when the run asks for it (hellaswag_interval). train.py's loop calls them at every
eval_interval; eval.py evaluates a saved model on its own.

    val_loss, val_metrics = evaluate(model, val_batches, rt, d, stop, objective)   # None: cut short by a stop
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from tqdm import tqdm

from gptkit import hellaswag, parallel
from gptkit.cli import UserError
from gptkit.loader import ValBatches
from gptkit.metrics import LineProgress
from gptkit.preference import ValPairs
from gptkit.runtime import Dist, Runtime
from gptkit.step import Objective, StopFlag, next_token_loss
from gptkit.tokenizer import Tokenizer
from model import GPT

if TYPE_CHECKING:
    from gptkit.config import TrainConfig


class HellaSwagSettingError(UserError):
    """hellaswag_interval on a dataset HellaSwag cannot be scored in."""


@torch.no_grad()
def evaluate(model, batches: ValBatches | ValPairs, rt: Runtime, d: Dist, stop: StopFlag | None = None,
             objective: Objective = next_token_loss) -> tuple[float, dict[str, float]] | None:
    """The objective's mean loss over the fixed validation batches, and the means of its metrics ({} for the
    next-token loss), each rank taking its share; None when a stop signal cut it short on any rank (a preempted
    job has seconds, not the minutes an evaluation may take). Token windows count a batch each (all have the
    same size); the objective may weigh its batches otherwise (its batch_items: preference pairs count a pair
    each), and a metric over a part of them (DPO's accuracy) the pairs of that part. `objective`: the run's
    (gptkit/objectives/), or any micro-batch loss with the same attributes (none: a batch each, no metrics). A progress bar shows on a terminal when an evaluation takes more than a few seconds. Under
    FSDP the model holds its whole weights meanwhile (parallel.gathered): its forwards gather nothing, so the
    ranks' counts may differ."""
    model.eval()
    names = getattr(objective, "metric_names", ())
    # A metric that is a mean over a part of a batch (DPO's accuracy, over the pairs not tied) is weighed by that
    # part (the objective's metric_over: its share of the batch), so its mean is exact; NaN when no batch has any.
    over = getattr(objective, "metric_over", {})
    # [sum of losses, count, cut short, the sums of the metrics, the weights they are over]
    total = torch.zeros(3 + 2 * len(names), device=rt.device, dtype=torch.float64)
    k = len(names)
    quiet = not (d.master and sys.stdout.isatty())
    # not on a terminal (a log file, a pipe): plain lines instead of the bar, when it takes more than seconds
    lines = LineProgress("evaluating", len(batches), "batches") if quiet and d.master else None
    with parallel.gathered(model):
        for i, batch in enumerate(tqdm(batches, desc="evaluating", unit="batch", leave=False, delay=3,
                                       disable=quiet)):
            if stop is not None and stop.requested:
                total[2] = 1
                break
            with rt.autocast():  # (the next-token loss: no logits with targets, computed a slice at a time)
                loss, metrics = objective(model, batch)
            n = objective.batch_items(batch) if hasattr(objective, "batch_items") else 1
            total[0] += loss.double() * n
            total[1] += n
            for j, name in enumerate(names):
                share = over[name](metrics).double() if name in over else total.new_ones(())
                value = metrics[name].double() * share * n
                total[3 + j] += torch.where(share > 0, value, 0.0)  # (a part of none is NaN, weighed 0)
                total[3 + k + j] += share * n
            if lines is not None:
                lines.update(i + 1)  # (on a GPU the batches are only queued: the lines show the host's pace)
    if d.enabled:
        dist.all_reduce(total)  # evaluation's one collective: ranks agree on the loss and on a cut
    model.train()
    if total[2]:
        return None
    sums = total.tolist()
    means = [s / w if w else float("nan") for s, w in zip(sums[3 : 3 + k], sums[3 + k :])]
    return sums[0] / sums[1], dict(zip(names, means))


def load_hellaswag(cfg: TrainConfig, meta: dict, d: Dist) -> list[hellaswag.Encoded] | None:
    """HellaSwag's items in the dataset's tokens, when hellaswag_interval asks for them: the file is obtained
    (downloaded once into the cache) and read before the run starts."""
    if not cfg.hellaswag_interval:
        return None
    tokenizer = Tokenizer.from_meta(meta)
    if tokenizer.kind == "char":
        raise HellaSwagSettingError(f"hellaswag_interval needs a BPE dataset such as GPT-2's, and {cfg.dataset!r} is "
                         f"character-level; set --hellaswag_interval=0")
    items = hellaswag.read_items(hellaswag.obtain_once(d), cfg.hellaswag_limit or None)
    return hellaswag.encode(items, tokenizer, cfg.block_size)


def hellaswag_scores(model: torch.nn.Module, raw_model: GPT, items: list[hellaswag.Encoded] | None,
                     cfg: TrainConfig, step: int, rt: Runtime, d: Dist) -> dict[str, float]:
    """HellaSwag accuracies for this evaluation's log line when they are due at `step`, else nothing. The
    plain model (raw_model) is scored, not its DDP or compiled wrapper (under FSDP with its whole weights
    gathered); each rank scores its share of the items."""
    if items is None or not (step % cfg.hellaswag_interval == 0 or step >= cfg.max_iters or cfg.eval_only):
        return {}
    quiet = not (d.master and sys.stdout.isatty())
    with parallel.gathered(model):
        scores = hellaswag.score(raw_model, items, rt, d, progress=not quiet)
    return {"hellaswag_acc": scores["acc"], "hellaswag_acc_norm": scores["acc_norm"]}
