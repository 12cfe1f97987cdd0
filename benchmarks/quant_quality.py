"""What each CPU weight format costs in quality: a model's loss and bits per byte on the same text with its
Linear layers packed as float32, int8 and q4_0 (gptkit/cpu_decode.py, the kernels that sample.py, chat.py and
serve.py decode with, their quantized activations included), beside the model as loaded.

    python benchmarks/quant_quality.py --ckpt out-shakespeare-char --data data/shakespeare_char
    python benchmarks/quant_quality.py --ckpt out-shakespeare-char --data data/shakespeare_char --head_q4 \
        --llama f32,q8_0,q4_0 --threads 1
    python benchmarks/quant_quality.py --ckpt model.gguf --data data/shakespeare_char --formats q4_0

The text is the dataset's val split in windows of the model's block_size that do not overlap, every token
but the first predicted once (eval.py --task loss's windows); bits per byte = the nats of the tokens that
stand for text / ln 2 / their UTF-8 bytes. q4_0 packs its head in q6_k where n_embd is a multiple of 256, else
q8_0 (gptkit/cpu_decode.py's q4_head_format); also q4_0 with its head in q8_0 (--head_q8, where that differs)
and in q4_0 too (--head_q4), the measurements behind q4_0's head, and with --llama f32,q8_0,q4_0 llama.cpp
(llama-cpp-python) on the model's own GGUF files (export.py's: q4_0's token embedding as --quantize=q4_0
packs it), the same windows. The table goes to stdout
(BENCHMARKS.md, "Four-bit weights: quality").
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a file: gptkit from this checkout

from gptkit import cli, cpu_decode  # noqa: E402
from gptkit.checkpoint import load_model  # noqa: E402
from gptkit.data.shards import TokenDataset, require_dataset  # noqa: E402


@torch.no_grad()
def val_loss(model, ds: TokenDataset, token_bytes: np.ndarray, limit: int, batch: int = 8) -> tuple[float, float]:
    """(loss in nats per token, bits per byte) over the first `limit` predicted tokens of ds (0: all)."""
    block = model.config.block_size
    predicted = len(ds) - 1 if not limit else min(len(ds) - 1, limit)
    starts = np.arange(0, predicted - block + 1, block)  # whole windows only: the same text for every format
    nbytes = torch.from_numpy(token_bytes)
    nats = text_nats = n_bytes = n_tokens = 0.0
    for i in range(0, len(starts), batch):
        tokens = torch.from_numpy(ds.windows(starts[i : i + batch], block + 1))
        x, y = tokens[:, :-1], tokens[:, 1:]
        logits = model.head(model.hidden_states(x), fp32=True)
        losses = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="none").double()
        b = nbytes[y.flatten()]
        nats += losses.sum().item()
        text_nats += losses[b > 0].sum().item()
        n_bytes += b.sum().item()
        n_tokens += y.numel()
    return nats / n_tokens, text_nats / math.log(2) / n_bytes


def llama_loss(path: Path, model, ds: TokenDataset, token_bytes: np.ndarray, limit: int) -> tuple[float, float]:
    """val_loss's figures from llama.cpp (llama-cpp-python) running the GGUF file `path`, on the same windows:
    each window evaluated from an empty cache, its logits at every position."""
    import llama_cpp

    block = model.config.block_size
    predicted = len(ds) - 1 if not limit else min(len(ds) - 1, limit)
    starts = np.arange(0, predicted - block + 1, block)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=block, n_batch=block, logits_all=True, verbose=False,
                          n_threads=torch.get_num_threads(), n_threads_batch=torch.get_num_threads())
    nats = text_nats = n_bytes = n_tokens = 0.0
    for start in starts:
        tokens = ds.windows(np.array([start]), block + 1)[0]
        llm.reset()
        llm.eval(tokens[:-1].tolist())
        logits = torch.from_numpy(np.array(llm.scores[:block], dtype=np.float32))
        losses = F.cross_entropy(logits, torch.from_numpy(tokens[1:]), reduction="none").double()
        b = torch.from_numpy(token_bytes[tokens[1:]])
        nats += losses.sum().item()
        text_nats += losses[b > 0].sum().item()
        n_bytes += b.sum().item()
        n_tokens += block
    llm.close()
    return nats / n_tokens, text_nats / math.log(2) / n_bytes


def q4_head(model):
    """q4_0 packing with the head in q4_0 as well (the token embedding still q8_0's rows)."""
    rows = model.lm_head.weight[: model.config.vocab_size].detach().clone()
    packed = cpu_decode.pack_for_cpu(model, "q4_0")
    packed.lm_head = cpu_decode.PackedLinear(rows, None, "q4_0")
    return packed


@cli.entry_point()
def main(argv: list[str] | None = None) -> None:
    parser = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", required=True, help="a checkpoint (file or run folder) or an export.py GGUF file")
    parser.add_argument("--data", required=True, help="the prepared dataset folder whose val split is read")
    parser.add_argument("--formats", default="none,float32,int8,q4_0", help="comma-separated; none: as loaded")
    parser.add_argument("--head_q4", action="store_true", help="also q4_0 with the head in q4_0")
    parser.add_argument("--head_q8", action="store_true", help="also q4_0 with the head in q8_0 (where q4_0's "
                        "own is q6_k)")
    parser.add_argument("--limit", type=int, default=0, help="the first N tokens of the split (0: all)")
    parser.add_argument("--threads", type=int, default=0, help="torch's threads (0: torch's own count)")
    parser.add_argument("--llama", default="", help="also llama.cpp (llama-cpp-python) on the model exported "
                        "as GGUF in these dtypes, e.g. f32,q8_0,q4_0 (a checkpoint, not a GGUF file)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer, what = load_model(args.ckpt)
    ds = TokenDataset(require_dataset(args.data), "val")
    variants = {f: (lambda m, f=f: m if f == "none" else cpu_decode.pack_for_cpu(m, f)) for f in args.formats.split(",")}
    if args.head_q8:
        variants["q4_0, head q8_0"] = lambda m: cpu_decode.pack_for_cpu(m, "q4_0", q4_head="q8_0")
    if args.head_q4:
        variants["q4_0, head q4_0"] = q4_head
    print(f"# {what}; {ds.data_dir} val, {cpu_decode.kernels() and cpu_decode.kernels_status()}", flush=True)
    print("| weights | val loss (nats/token) | val bpb | vs float32 as loaded | weights in memory |")
    print("|---|---|---|---|---|")
    base = None
    for name, pack in variants.items():
        m = pack(copy.deepcopy(model))
        t0 = time.perf_counter()
        loss, bpb = val_loss(m, ds, tokenizer.token_bytes(), args.limit)
        base = bpb if base is None else base
        report = cpu_decode.weights_report(m).partition(":")[0].removeprefix("weights ") or "as loaded"
        if isinstance(getattr(m, "lm_head", None), cpu_decode.PackedLinear) and name.startswith("q4_0"):
            name += "" if "head" in name else f" (head {m.lm_head.fmt})"
        print(f"| {name} | {loss:.4f} | {bpb:.4f} | {bpb - base:+.4f} | {report} |  ({time.perf_counter() - t0:.0f} s)",
              flush=True)
    if args.llama:
        import tempfile

        from gptkit.checkpoint import find_checkpoint, load_checkpoint
        from gptkit.gguf import export_gguf

        meta = load_checkpoint(find_checkpoint(args.ckpt))["tokenizer"]
        with tempfile.TemporaryDirectory() as folder:
            for dtype in args.llama.split(","):
                path = Path(folder) / f"model-{dtype}.gguf"
                export_gguf(model, path, meta, dtype=dtype)
                t0 = time.perf_counter()
                loss, bpb = llama_loss(path, model, ds, tokenizer.token_bytes(), args.limit)
                print(f"| llama.cpp, GGUF {dtype} | {loss:.4f} | {bpb:.4f} | {bpb - base:+.4f} | "
                      f"{path.stat().st_size / 1e3:.1f} kB file |  ({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
