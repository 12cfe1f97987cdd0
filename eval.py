"""Evaluate a model: HellaSwag accuracy, or loss, perplexity and bits per byte on a dataset split.

    python eval.py --init_from gpt2 --task hellaswag                  # acc_norm 0.2955 (GPT-2 124M)
    python eval.py --ckpt out-gpt2-124m --task hellaswag --limit 1000
    python eval.py --ckpt out --task loss --dataset shakespeare_char  # loss, ppl, bpb of the val split
    torchrun --standalone --nproc_per_node=8 eval.py --init_from gpt2-xl --task hellaswag

What was loaded, a progress bar and a readable summary go to stderr; the last line on stdout is one JSON object
with the results (`... | tail -n 1 | jq .acc_norm`). Every bad input ends in a one-line `error: ...`.

--task hellaswag: the 10,042 validation items, scored by completion (gptkit/hellaswag.py says how, where the file is
  cached and what happens to contexts longer than the model's); --input PATH reads a local copy instead.
  Result: {"task", "n", "acc", "acc_norm"}.
--task loss: the split in contiguous windows of the model's block_size that do not overlap, so every token but
  the first is predicted exactly once: {"task", "dataset", "split", "loss", "ppl", "bpb", "tokens", "bytes"}.
  loss is the mean cross-entropy in nats over the `tokens` predicted tokens and ppl = exp(loss). bpb, bits per
  byte, is their total loss / ln 2 / the `bytes` of UTF-8 text they stand for: a tokenizer with longer tokens
  predicts fewer of them, so bpb (unlike loss) compares models with different tokenizers. End-of-text tokens
  stand for no text: they count in loss, but neither their loss nor any byte counts in bpb.

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
from gptkit.checkpoint import load_model
from gptkit.config import InferenceSettings
from gptkit.options import ConfigError, load_config, setting
from gptkit.runtime import Dist, Runtime, distributed, resolve_compile
from gptkit.shards import TokenDataset, require_dataset
from gptkit.tokenizer import Tokenizer
from model import GPT, bucketed_forward

LOGITS_BUDGET = 1 << 26  # floats of logits at a time when scoring windows (256 MB in fp32)


class EvalError(cli.UserError):
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
    task: str = setting("hellaswag", "hellaswag (accuracy) or loss (loss, perplexity, bits per byte)", ("hellaswag", "loss"))
    # --task hellaswag
    input: str = setting("", "HellaSwag: a local hellaswag_val.jsonl instead of the cached download")
    limit: int = setting(0, "HellaSwag: score only the first N items (0 = all 10,042)")
    # --task loss
    dataset: str = setting("", "loss: dataset name under data_root, or a path to a prepared dataset folder")
    data_root: str = setting("data", "loss: folder holding the prepared datasets")
    split: str = setting("val", "loss: the split to evaluate", ("train", "val"))
    limit_tokens: int = setting(0, "loss: predict only the first N tokens of the split (0 = all)")
    # how to run
    batch_size: int = setting(16, "HellaSwag items (4 sequences each) or loss windows per forward pass")
    compile: bool | None = setting(None, "torch.compile the model's forward: True, False or auto (None: on for CUDA)")

    def validate(self) -> None:
        super().validate()  # what to load
        for name in ("limit", "limit_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (0 = no limit), got {getattr(self, name)}")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.task == "loss" and not self.dataset:
            raise ConfigError("--task loss needs --dataset NAME (a prepared dataset, e.g. shakespeare_char)")
        if self.task == "hellaswag" and self.dataset:
            raise ConfigError("--dataset is for --task loss; HellaSwag brings its own items")


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


@torch.no_grad()
def evaluate_loss(model: GPT, tokenizer: Tokenizer, ds: TokenDataset, rt: Runtime, d: Dist, *, limit_tokens: int = 0,
                  batch_size: int = 16, hidden: Callable | None = None, progress: bool = False) -> dict:
    """Loss, perplexity and bits per byte over the split (its first limit_tokens + 1 tokens when limited)."""
    hidden = hidden or model.hidden_states
    block = model.config.block_size
    predicted = len(ds) - 1 if not limit_tokens else min(len(ds) - 1, limit_tokens)
    if predicted < 1:
        raise EvalError(f"the {ds.split} split of {ds.data_dir} has fewer than 2 tokens: nothing to predict")
    # Window i reads tokens [i * block, i * block + block) and predicts the next token at each position.
    starts = np.arange(0, predicted, block)[d.rank :: d.world_size]
    full, last = starts[starts + block <= predicted], starts[starts + block > predicted]  # last: 0 or 1 window
    batches = [(full[i : i + batch_size], block) for i in range(0, len(full), batch_size)]
    batches += [(last, predicted - int(last[0]))] if len(last) else []
    byte_len = torch.from_numpy(tokenizer.token_bytes()).to(rt.device)
    sums = np.zeros(4)  # nats (all tokens), nats of the tokens that stand for text, bytes, tokens
    with tqdm(total=sum(len(s) for s, _ in batches), desc="loss", unit="window", disable=not progress) as bar:
        for batch_starts, length in batches:
            tokens = torch.from_numpy(ds.windows(batch_starts, length + 1)).to(rt.device)
            x, y = tokens[:, :-1], tokens[:, 1:]
            losses = window_losses(model, x, y, rt, hidden)
            nbytes = byte_len[y.flatten()]
            sums += [losses.double().sum().item(), losses[nbytes > 0].double().sum().item(),
                     nbytes.sum().item(), y.numel()]
            bar.update(len(batch_starts))
    if d.enabled:
        total = torch.tensor(sums, dtype=torch.float64, device=rt.device)
        dist.all_reduce(total)
        sums = total.cpu().numpy()
    nats, text_nats, nbytes, ntokens = sums
    loss = nats / ntokens
    return {"loss": loss, "ppl": math.exp(loss), "bpb": text_nats / math.log(2) / nbytes if nbytes else None,
            "tokens": int(ntokens), "bytes": int(nbytes)}


# ----------------------------------------------------------------------------- the script


def run(cfg: EvalConfig, d: Dist, rt: Runtime, err=None) -> dict:
    err = err if err is not None else sys.stderr
    log = (lambda text: print(text, file=err, flush=True)) if d.master else (lambda text: None)
    model, tokenizer, what = load_model(cfg.ckpt, cfg.init_from)
    # The task's input before the weights move: a missing file or a wrong tokenizer fails fast.
    if cfg.task == "hellaswag":
        hellaswag.check_tokenizer(tokenizer)  # before any download
        path = hellaswag.obtain_once(d, cfg.input or None)
        encoded = hellaswag.encode(hellaswag.read_items(path, cfg.limit or None), tokenizer, model.config.block_size)
    else:
        ds = TokenDataset(require_dataset(cfg.dataset, cfg.data_root), cfg.split)
        check_same_tokenizer(tokenizer, ds, cfg.dataset)
    model.to(rt.device)
    use_compile, why = resolve_compile(cfg.compile, rt.device)
    # Sequence lengths vary from batch to batch: compiled for dynamic shapes, so it does not recompile each time.
    hidden = torch.compile(model.hidden_states, dynamic=True) if use_compile else None
    log(f"eval.py: {what}, {model.num_params(non_embedding=False) / 1e6:.2f}M parameters, {tokenizer.kind} tokenizer; {d.world_size} "
        f"process(es) on {rt.device} {rt.dtype_name}; {why}")
    started = time.perf_counter()
    if cfg.task == "hellaswag":
        scores = hellaswag.score(model, encoded, rt, d, batch_items=cfg.batch_size, hidden=hidden, progress=d.master)
        seconds = time.perf_counter() - started
        result = {"task": "hellaswag", **scores}
        log(f"hellaswag: acc {scores['acc']:.4f}, acc_norm {scores['acc_norm']:.4f} over {scores['n']} items "
            f"({seconds:.1f} s, {scores['n'] / seconds:.1f} items/s)")
    else:
        scores = evaluate_loss(model, tokenizer, ds, rt, d, limit_tokens=cfg.limit_tokens, batch_size=cfg.batch_size,
                               hidden=hidden, progress=d.master)
        seconds = time.perf_counter() - started
        result = {"task": "loss", "dataset": cfg.dataset, "split": cfg.split, **scores}
        bpb = "n/a" if scores["bpb"] is None else f"{scores['bpb']:.4f}"
        log(f"{cfg.dataset} {cfg.split}: loss {scores['loss']:.4f}, ppl {scores['ppl']:.2f}, bpb {bpb} over "
            f"{scores['tokens']:,} tokens / {scores['bytes']:,} bytes ({seconds:.1f} s, "
            f"{scores['tokens'] / seconds:,.0f} tokens/s)")
    return result


@cli.entry_point(oom_hint="lower --batch_size")
def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = load_config(EvalConfig, argv, allow_files=False, prog="eval.py")
    with distributed(cfg.device, cfg.dtype) as (d, rt):
        result = run(cfg, d, rt)
    if d.master:
        print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
