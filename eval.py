"""Evaluate a model: HellaSwag accuracy, or loss, perplexity and bits per byte on a dataset split.

    python eval.py --init_from gpt2 --task hellaswag                  # acc_norm 0.2955 (GPT-2 124M)
    python eval.py --ckpt out-gpt2-124m --task hellaswag --limit 1000
    python eval.py --ckpt out --task loss                             # loss, ppl, bpb of its dataset's val split
    python eval.py --ckpt out-dpo --task preference --dataset mypairs --reference out-chat   # pairs' accuracy
    python eval.py --ckpt out-grpo --task checker --checker_task tasks/arithmetic.py --pass_k 8   # a task's
    torchrun --standalone --nproc_per_node=8 eval.py --init_from gpt2-xl --task hellaswag

What was loaded, a progress bar and a readable summary go to stderr; the last line on stdout is one JSON object
with the results (`... | tail -n 1 | jq .acc_norm`). Every bad input ends in a one-line `error: ...`.

--task hellaswag: the 10,042 validation items, scored by completion (gptkit/hellaswag.py says how, where the file is
  cached and what happens to contexts longer than the model's); --input PATH reads a local copy instead.
  Result: {"task", "n", "acc", "acc_norm"}.
--task loss: the split in contiguous windows of the model's block_size that do not overlap, so every token but
  the first is predicted exactly once: {"task", "dataset", "split", "loss_on", "loss", "ppl", "bpb", "tokens",
  "bytes"}. The dataset is --dataset, by default the one the checkpoint's run trained on (GPT-2's weights
  record none). --limit N reads the first N windows (as for HellaSwag, the first N items), --limit_tokens N the
  first N tokens. loss is the mean cross-entropy in nats over the `tokens` counted and ppl = exp(loss). Which
  tokens count (loss_on): on a chat dataset (prepare/chat.py) the assistant's replies, as its training logged
  ("answers"; the windows then start where conversations start, as training's do, so that a reply is predicted
  after its question), or with --loss_on=all every token, the prompts and the template's markers too; on other
  text, every token. bpb,
  bits per byte, is their total loss / ln 2 / the `bytes` of UTF-8 text they stand for: a tokenizer with
  longer tokens predicts fewer of them, so bpb (unlike loss) compares models with different tokenizers.
  End-of-text tokens stand for no text: they count in loss, but neither their loss nor any byte counts in bpb.
  A preference dataset's pairs are scored by --task preference.
--task preference: the pairs of a preference dataset (prepare/preference.py), each scored once:
  {"task", "dataset", "split", "against", "pairs", "accuracy", "ties", "margin_nats", "chosen_logp",
  "rejected_logp"}. margin_nats is the model's mean lead of the chosen reply in nats: by log-probability,
  log p(chosen) - log p(rejected), or with --reference CKPT (the model it was tuned from) by DPO's implicit
  reward over beta, the chosen reply's log-probability gain over the reference minus the rejected one's
  ("against" says which; training's log has reward_margin = dpo_beta x this). A pair whose margin is exactly 0
  is a tie (the reference against itself ties all): accuracy is the share of the other pairs whose chosen reply
  the model prefers (null when all tie), ties the tied share. chosen_logp and rejected_logp are the replies'
  mean log-probabilities, so base, SFT and DPO models can be compared on the same pairs (gptkit/objectives/preference_losses.py's
  score_pairs).
--task checker: a checkable task's held-out prompts (--checker_task, e.g. tasks/arithmetic.py, split by
  --task_seed as the GRPO run's grpo_task_seed), each reply scored by the task's reward (or --checker
  FILE.py:FUNCTION): {"task", "checker_task", "prompts", "accuracy", "mean_reward"} and with --pass_k K
  {"pass_at_k", "k", "temperature"}. accuracy is the share of prompts whose greedy reply is right (reward >= 1),
  pass_at_k the share with a right reply among K drawn at --pass_k_temperature (gptkit/task_eval.py). --limit N
  scores the first N prompts. One process: under torchrun every process scores them all.

Under torchrun the items (windows) are split over the processes and the counts (sums) added up.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from gptkit import cli, hellaswag
from gptkit.checker import load_checker, load_task
from gptkit.checkpoint import load_model, load_model_and_settings
from gptkit.config import InferenceSettings
from gptkit.data.pairs import Pairs
from gptkit.data.shards import TokenDataset, require_dataset
from gptkit.errors import ConfigError, UserError
from gptkit.objectives.preference_losses import evaluate_preference
from gptkit.options import Alias, load_config, setting
from gptkit.runtime import Dist, Runtime, distributed, resolve_compile
from gptkit.task_eval import score_task
from gptkit.threads import Threads, resolve_threads
from gptkit.tokenizer import Tokenizer
from model import GPT, bucketed_forward

LOGITS_BUDGET = 1 << 26  # floats of logits at a time when scoring windows (256 MB in fp32)


class EvalError(UserError):
    """A model and a task that do not go together."""


@dataclass
class EvalConfig(InferenceSettings):
    # the model's weights stay in float32: dtype is the precision of autocast
    dtype: str = setting(
        "auto",
        "autocast precision: auto (bf16 on CUDA, fp16 where bf16 is unsupported; fp32 elsewhere), float32, bfloat16, float16",
        ("auto", "float32", "bfloat16", "float16"),
    )
    # what to evaluate
    task: str = setting("hellaswag", "hellaswag (accuracy), loss (loss, perplexity, bits per byte), preference "
                                     "(a preference dataset's accuracy and margin) or checker (a checkable task's "
                                     "held-out accuracy and pass@k)", ("hellaswag", "loss", "preference", "checker"))
    # --task hellaswag
    input: str = setting("", "HellaSwag: a local hellaswag_val.jsonl instead of the cached download")
    limit: int = setting(0, "score only the first N items: HellaSwag's (of 10,042), or loss windows of block_size "
                            "tokens (0 = all)")
    # --task loss and --task preference
    dataset: str = setting("", "loss: dataset name under data_root, or a path to a prepared dataset folder; '' = "
                               "the one the checkpoint's run trained on. preference: pairs prepared with "
                               "prepare/preference.py (required)")
    data_root: str = setting("data", "loss, preference: folder holding the prepared datasets")
    split: str = setting("val", "loss, preference: the split to evaluate", ("train", "val"))
    limit_tokens: int = setting(0, "loss: predict only the first N tokens of the split (0 = all)")
    loss_on: str = setting("auto", "loss: the tokens whose loss counts. auto: a chat dataset's answers (the "
                                   "assistant's replies, as training's loss), else all; answers; all (every "
                                   "token, prompts and template markers too)", ("auto", "answers", "all"))
    # --task preference
    reference: str = setting("", "preference: a checkpoint (the model tuned from) to score against; '' = by the "
                                 "model's own log-probabilities")
    # --task checker
    checker_task: str = setting("tasks/arithmetic.py", "checker: the task (a file or module with prompts and reward)")
    checker: str = setting("", "checker: the reward function, FILE.py:FUNCTION ('' = the task's reward)")
    task_seed: int = setting(0, "checker: the seed of the task's train/held-out split (the GRPO run's grpo_task_seed)")
    pass_k: int = setting(0, "checker: also pass@k, from k replies per prompt drawn at --pass_k_temperature (0 = greedy only)")
    pass_k_temperature: float = setting(1.0, "checker: the temperature pass@k draws its replies at")
    max_tokens: int = setting(16, "checker: the most tokens of a reply")
    # how to run
    batch_size: int = setting(16, "HellaSwag items (4 sequences each), loss windows or preference pairs per forward "
                                  "pass")
    compile: bool | None = setting(None, "torch.compile the model's forward: True, False or auto (None: on for CUDA)")
    # nanoGPT's spelling of the run's folder, as sample.py takes it
    ALIASES_TITLE = "nanoGPT's spellings"
    ALIASES = {"out_dir": Alias("ckpt", "the run's folder (its best.pt or last.pt, or nanoGPT's ckpt.pt)")}

    def validate(self) -> None:
        super().validate()  # what to load
        for name in ("limit", "limit_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (0 = no limit), got {getattr(self, name)}")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.task == "loss" and not self.dataset and self.init_from:  # a checkpoint's is read after it loads
            raise ConfigError("--task loss needs --dataset NAME with --init_from: GPT-2 weights record no dataset "
                              "(a prepared one with their tokenizer, e.g. --dataset shakespeare)")
        if self.task == "hellaswag" and self.dataset:
            raise ConfigError("--dataset is for --task loss; HellaSwag brings its own items")
        if self.pass_k < 0 or self.max_tokens < 1 or not self.pass_k_temperature > 0:
            raise ConfigError("pass_k must be >= 0, max_tokens >= 1 and pass_k_temperature > 0 (pass@k draws its replies)")
        if self.task != "loss" and self.loss_on != "auto":
            raise ConfigError(f"--loss_on is for --task loss, not --task {self.task}")


# ----------------------------------------------------------------------------- --task loss


def check_same_tokenizer(model_tok: Tokenizer, ds: TokenDataset, label: str) -> None:
    data_tok = Tokenizer.from_meta(ds.meta)
    if data_tok.to_meta() != model_tok.to_meta():
        raise EvalError(f"dataset {label!r} is tokenized with {describe(data_tok)} but the model with "
                        f"{describe(model_tok)}; evaluate on a dataset prepared with the model's tokenizer")


def describe(tok: Tokenizer) -> str:
    if tok.kind == "char":
        return f"a {tok.vocab_size}-character vocabulary"
    return f"the {tok.to_meta().get('name')} BPE"


def window_losses(model: GPT, x: torch.Tensor, y: torch.Tensor, rt: Runtime, hidden: Callable) -> torch.Tensor:
    """Cross-entropy of every target in y (B, T) given x (B, T), float32 (B * T,). The head runs in float32 over
    a few rows at a time, so a 50K-word vocabulary never needs the whole (B, T, V) logits at once."""
    with rt.autocast():
        h = bucketed_forward(hidden, x, model.config.block_size).flatten(0, 1)  # (B * T, C)
    targets = y.flatten()
    rows = max(1, LOGITS_BUDGET // model.config.vocab_size)
    out = torch.empty(len(targets), device=h.device)
    for lo in range(0, len(targets), rows):
        logits = model.head(h[lo : lo + rows], fp32=True)  # full fp32 (no TF32), even under bf16 autocast
        out[lo : lo + rows] = F.cross_entropy(logits, targets[lo : lo + rows], reduction="none")
    return out


def loss_tokens(ds: TokenDataset, asked: str, label: str = "") -> str:
    """Which tokens --task loss counts on this dataset: "answers" (a chat dataset's trained tokens, by its loss
    mask: what its training's loss is over) or "all"; asked: --loss_on; label: the dataset as the user named it."""
    if "preference" in ds.meta:
        raise EvalError(f"{ds.data_dir} holds preference pairs (prepare/preference.py), not text to predict; "
                        f"score them with --task preference --dataset {label or ds.data_dir}")
    chat = ds.meta.get("chat") or {}
    has_answers = ds.masks is not None and chat.get("train_on") != "all"
    if asked == "answers" and not has_answers:
        raise EvalError(f"--loss_on=answers needs a chat dataset that trains on the assistant's replies "
                        f"(prepare/chat.py), and {ds.data_dir} has none; use --loss_on=all")
    return "answers" if has_answers and asked != "all" else "all"


@torch.no_grad()
def evaluate_loss(model: GPT, tokenizer: Tokenizer, ds: TokenDataset, rt: Runtime, d: Dist, *, limit_tokens: int = 0,
                  batch_size: int = 16, hidden: Callable | None = None, progress: bool = False,
                  loss_on: str = "all") -> dict:
    """Loss, perplexity and bits per byte over the split (its first limit_tokens + 1 tokens when limited), of
    every predicted token (loss_on="all") or of a chat dataset's answers alone (those its loss mask trains)."""
    hidden = hidden or model.hidden_states
    block = model.config.block_size
    predicted = len(ds) - 1 if not limit_tokens else min(len(ds) - 1, limit_tokens)
    if predicted < 1:
        raise EvalError(f"the {ds.split} split of {ds.data_dir} has fewer than 2 tokens: nothing to predict")
    # Window i reads block tokens from starts[i] and predicts the next token at each position, counting the first
    # counts[i] of them: the windows tile the split, every token but the first predicted once.
    starts = conversation_windows(ds, block, predicted) if loss_on == "answers" else np.arange(0, predicted, block)
    counts = np.minimum(np.append(starts[1:], predicted) - starts, block)
    starts, counts = starts[d.rank :: d.world_size], counts[d.rank :: d.world_size]
    full = starts + block <= predicted  # all but the last window, which reads only what it counts
    batches = [(starts[full][i : i + batch_size], counts[full][i : i + batch_size], block)
               for i in range(0, int(full.sum()), batch_size)]
    batches += [(starts[~full], counts[~full], int(counts[~full][0]))] if (~full).any() else []
    byte_len = torch.from_numpy(tokenizer.token_bytes()).to(rt.device)
    sums = np.zeros(4)  # nats (the counted tokens), nats of those that stand for text, bytes, tokens
    with tqdm(total=len(starts), desc="loss", unit="window", disable=not progress) as bar:
        for batch_starts, batch_counts, length in batches:
            tokens = torch.from_numpy(ds.windows(batch_starts, length + 1)).to(rt.device)
            x, y = tokens[:, :-1], tokens[:, 1:]
            losses = window_losses(model, x, y, rt, hidden)
            counted = np.arange(length)[None, :] < batch_counts[:, None]
            if loss_on == "answers":  # the targets the loss mask trains
                counted &= ds.masks.windows(batch_starts, length + 1)[:, 1:] != 0
            counted = torch.from_numpy(counted).to(rt.device).flatten()
            losses, nbytes = losses[counted], byte_len[y.flatten()][counted]
            sums += [losses.double().sum().item(), losses[nbytes > 0].double().sum().item(),
                     nbytes.sum().item(), len(losses)]
            bar.update(len(batch_starts))
    if d.enabled:
        total = torch.tensor(sums, dtype=torch.float64, device=rt.device)
        dist.all_reduce(total)
        sums = total.cpu().numpy()
    nats, text_nats, nbytes, ntokens = sums
    if not ntokens:
        raise EvalError(f"the tokens read of the {ds.split} split of {ds.data_dir} hold no answer to score; read "
                        f"more of it (--limit, --limit_tokens) or use --loss_on=all")
    loss = nats / ntokens
    return {"loss": loss, "ppl": math.exp(loss), "bpb": text_nats / math.log(2) / nbytes if nbytes else None,
            "tokens": int(ntokens), "bytes": int(nbytes)}


def conversation_windows(ds: TokenDataset, block: int, predicted: int) -> np.ndarray:
    """Where --task loss's windows start on a chat dataset, as training's validation windows do: at a
    conversation's start (its <|endoftext|>), so that every reply is predicted after its question. Each window
    holds the conversations that fit whole in block_size tokens after its start and the next begins with the
    first that does not; a conversation longer than block_size goes on in the next window, from where this one
    ends. The windows tile the first `predicted` + 1 tokens."""
    eot = ds.meta.get("eot_id")
    found = [np.flatnonzero(np.asarray(shard) == eot) + offset for offset, shard in zip(ds.offsets, ds.shards)]
    conversations = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
    starts = [0]
    while starts[-1] + block < predicted:
        end = starts[-1] + block  # the window predicts the tokens after starts[-1] up to end
        j = int(np.searchsorted(conversations, end, side="right")) - 1  # the last conversation starting by then
        starts.append(int(conversations[j]) if j >= 0 and conversations[j] > starts[-1] else end)
    return np.array(starts, dtype=np.int64)


def loss_dataset(settings: dict, what: str) -> str:
    """--task loss's dataset when --dataset is not given: the one the checkpoint's run trained on."""
    dataset = settings.get("dataset")
    if not isinstance(dataset, str) or not dataset:
        raise EvalError(f"--task loss needs --dataset NAME: {what} records no dataset (a prepared one with the "
                        f"model's tokenizer, e.g. --dataset shakespeare_char)")
    return dataset


def loss_limit(cfg: EvalConfig, block_size: int) -> int:
    """The tokens --task loss predicts at most: --limit windows of block_size and --limit_tokens, the tighter
    (0 = all)."""
    return min([n for n in (cfg.limit * block_size, cfg.limit_tokens) if n], default=0)


# ----------------------------------------------------------------------------- --task preference


def preference_inputs(cfg: EvalConfig, tokenizer: Tokenizer) -> tuple[GPT | None, str]:
    """The reference model (None without --reference) and the pairs' folder, checked against the model."""
    if not cfg.dataset:
        raise ConfigError("--task preference needs --dataset NAME (pairs prepared with prepare/preference.py)")
    data = require_dataset(cfg.dataset, cfg.data_root)
    check_same_tokenizer(tokenizer, Pairs(data, cfg.split).dataset, cfg.dataset)
    if not cfg.reference:
        return None, str(data)
    reference, ref_tokenizer, _ = load_model(cfg.reference)
    if ref_tokenizer.to_meta() != tokenizer.to_meta():
        raise EvalError(f"--reference {cfg.reference} has another tokenizer than the model; give the checkpoint "
                        f"the model was tuned from")
    return reference, str(data)


def describe_accuracy(scores: dict) -> str:
    """The accuracy for the summary line, with the ties apart: "n/a (every pair tied)" when there is none."""
    ties = round(scores["ties"] * scores["pairs"])
    if scores["accuracy"] is None:
        return "n/a (every pair tied: margin 0)"
    return f"{scores['accuracy']:.4f}" + (f" of the {scores['pairs'] - ties:,} pairs not tied ({ties:,} tied)"
                                          if ties else "")


# ----------------------------------------------------------------------------- the script


def run(cfg: EvalConfig, d: Dist, rt: Runtime, err=None, threads: Threads | None = None) -> dict:
    """The task's result; `threads`: torch's CPU threads, applied by the caller (said on the CPU)."""
    err = err if err is not None else sys.stderr
    log = (lambda text: print(text, file=err, flush=True)) if d.master else (lambda text: None)
    model, tokenizer, what, settings = load_model_and_settings(cfg.ckpt, cfg.init_from)
    # The task's input before the weights move: a missing file or a wrong tokenizer fails fast.
    if cfg.task == "hellaswag":
        hellaswag.check_tokenizer(tokenizer)  # before any download
        path = hellaswag.obtain_once(d, cfg.input or None)
        encoded = hellaswag.encode(hellaswag.read_items(path, cfg.limit or None), tokenizer, model.config.block_size)
    elif cfg.task == "preference":
        reference, pairs = preference_inputs(cfg, tokenizer)
    elif cfg.task == "checker":
        task = load_task(cfg.checker_task)
        checker = load_checker(cfg.checker or f"{cfg.checker_task}:reward")
        task.stop_ids(tokenizer)  # (a STOP this tokenizer cannot end on: said before the weights move)
    else:
        dataset = cfg.dataset or loss_dataset(settings, what)
        ds = TokenDataset(require_dataset(dataset, cfg.data_root), cfg.split)
        loss_on = loss_tokens(ds, cfg.loss_on, dataset)
        check_same_tokenizer(tokenizer, ds, dataset)
    model.to(rt.device)
    use_compile, why = resolve_compile(cfg.compile, rt.device)
    # Sequence lengths vary from batch to batch: compiled for dynamic shapes, so it does not recompile each time.
    hidden = torch.compile(model.hidden_states, dynamic=True) if use_compile else None
    on = f"{rt.device} {rt.dtype_name}" + (f", {threads.describe()}" if threads and rt.device_type == "cpu" else "")
    log(f"eval.py: {what}, {model.num_params(non_embedding=False) / 1e6:.2f}M parameters, {tokenizer.kind} tokenizer; {d.world_size} "
        f"process(es) on {on}; {why}")
    started = time.perf_counter()
    if cfg.task == "hellaswag":
        scores = hellaswag.score(model, encoded, rt, d, batch_items=cfg.batch_size, hidden=hidden, progress=d.master)
        seconds = time.perf_counter() - started
        result = {"task": "hellaswag", **scores}
        log(f"hellaswag: acc {scores['acc']:.4f}, acc_norm {scores['acc_norm']:.4f} over {scores['n']} items "
            f"({seconds:.1f} s, {scores['n'] / seconds:.1f} items/s)")
    elif cfg.task == "preference":
        reference = reference.to(rt.device) if reference is not None else None
        with tqdm(desc="pairs", unit="pair", disable=not d.master) as bar:
            scores = evaluate_preference(model, pairs, cfg.split, batch_size=cfg.batch_size, reference=reference,
                                             autocast=rt.autocast, rank=d.rank, world_size=d.world_size,
                                             progress=bar.update)
        against = f"reference {cfg.reference}" if reference is not None else "none (the model's log-probabilities)"
        result = {"task": "preference", "dataset": cfg.dataset, "split": cfg.split, "against": against, **scores}
        log(f"{cfg.dataset} {cfg.split}: accuracy {describe_accuracy(scores)}, margin {scores['margin_nats']:.3f} "
            f"nats (not beta-scaled) over {scores['pairs']:,} pairs, against {against}; chosen log-prob "
            f"{scores['chosen_logp']:.3f}, rejected {scores['rejected_logp']:.3f} "
            f"({time.perf_counter() - started:.1f} s)")
    elif cfg.task == "checker":
        scores = score_task(model, tokenizer, task, checker, k=cfg.pass_k, temperature=cfg.pass_k_temperature,
                            max_tokens=cfg.max_tokens, limit=cfg.limit, task_seed=cfg.task_seed,
                            max_batch=cfg.batch_size * 4)
        result = {"task": "checker", "checker_task": cfg.checker_task, **scores}
        passk = f", pass@{cfg.pass_k} {scores['pass_at_k']:.3f} at temperature {cfg.pass_k_temperature:g}" if cfg.pass_k else ""
        log(f"{cfg.checker_task} held-out: greedy accuracy {scores['accuracy']:.3f}, mean reward "
            f"{scores['mean_reward']:.3f}{passk} over {scores['prompts']} prompts ({time.perf_counter() - started:.1f} s)")
    else:
        scores = evaluate_loss(model, tokenizer, ds, rt, d, limit_tokens=loss_limit(cfg, model.config.block_size),
                               batch_size=cfg.batch_size, hidden=hidden, progress=d.master, loss_on=loss_on)
        seconds = time.perf_counter() - started
        result = {"task": "loss", "dataset": dataset, "split": cfg.split, "loss_on": loss_on, **scores}
        bpb = "n/a" if scores["bpb"] is None else f"{scores['bpb']:.4f}"
        what = "loss"
        if loss_on == "answers":
            what = "answer loss (the assistant's replies, as training's; --loss_on=all for every token)"
        elif loss_tokens(ds, "auto") == "answers":
            what = "loss over all tokens (training's is over the answers: --loss_on=answers)"
        log(f"{dataset} {cfg.split}: {what} {scores['loss']:.4f}, ppl {scores['ppl']:.2f}, bpb {bpb} over "
            f"{scores['tokens']:,} {'answer ' if loss_on == 'answers' else ''}tokens / {scores['bytes']:,} bytes "
            f"({seconds:.1f} s, {scores['tokens'] / seconds:,.0f} tokens/s)")
    return result


@cli.entry_point(oom_hint="lower --batch_size")
def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = load_config(EvalConfig, argv, allow_files=False, prog="eval.py")
    with distributed(cfg.device, cfg.dtype) as (d, rt):
        with resolve_threads(cfg.threads, rt.device_type).applied() as threads:  # (left as they were on return)
            result = run(cfg, d, rt, threads=threads)
    if d.master:
        print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
