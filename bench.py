"""Benchmark: training throughput and decoding speed, printed as a table.

    python bench.py                                   # CPU: small defaults, under a minute
    python bench.py --device=cuda --models=baby,gpt2  # one GPU: the figures in BENCHMARKS.md

Training times the step as train.py runs it (set_lr, train.forward_backward, train.check_step's host sync,
then the AdamW or Muon + AdamW update, with autocast, torch.compile and fused AdamW where train.py would use
them) on random tokens or a prepared dataset (then with the loader's prefetch). It also times the optimizer
step alone (after that sync): the "optimizer" column is its share of the step. --loss_chunk=plain,2**25,2**28
gives one training row per size of the loss' slices (model.LOSS_CHUNK_ELEMENTS), "plain" being one
F.cross_entropy on all the logits: the "loss by" column says which ran.
Decoding times gptkit/generate.py's loop with and without the KV cache (with the compiled one-token step of
generate.compile_decode_step when compile is on), and its prefill of a prompt. Warm-up and compilation are
excluded; each figure is the median of several repeats, timed with CUDA events on a GPU.

Every model, and every decode batch size, is compiled afresh (torch._dynamo.reset(), dynamic=False): in one
process Dynamo would otherwise treat the second model's sizes as dynamic and time a symbolic-shape graph.

--json=FILE writes the rows, one dict each, so results can be kept (benchmarks/) and compared: kind (train,
decode, prefill), model, batch_size, seq_len (train: the context T; decode: new tokens per run; prefill:
prompt tokens), tokens_per_s, ms (train: per step; decode: per token; prefill: per prompt), mfu, peak_mem_mb
(CUDA: the allocator's peak; CPU: the process's peak resident memory during the row), device, device_name,
dtype, torch, compile (and compile_s, the compile time of a compiled decode step), plus a few per kind
(train: optimizer, optimizer_ms, optimizer_share, loss_slice_rows: rows per slice of the loss, None if plain).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from gptkit import cli
from gptkit.config import TrainConfig
from gptkit.generate import SamplingOptions, compile_decode_step, generate_stream, prefill
from gptkit.metrics import peak_flops
from gptkit.optim import make_optimizer, set_lr
from gptkit.plan import flops_per_token
from gptkit.runtime import Dist, Runtime, resolve_compile, setup_runtime
from gptkit.shards import read_meta, require_dataset
from model import GPT, LOSS_CHUNK_ELEMENTS, GPTConfig, loss_chunk_rows
from train import check_step, forward_backward

# Model sizes by name: (n_layer, n_head, n_embd, block_size, vocab_size, vocab_multiple)
MODELS = {
    "tiny": (2, 2, 64, 64, 65, 1),  # for tests of this script
    "baby": (6, 6, 384, 256, 65, 1),  # configs/shakespeare.py
    "gpt2": (12, 12, 768, 1024, 50257, 64),  # GPT-2 124M, vocab padded to 50304
    "modern": (12, 12, 768, 1024, 50257, 64),  # GPT-2 124M's shape, arch="modern", trained with Muon
    # one thin layer under GPT-2's vocabulary: the head and the loss are nearly all of the work and memory
    "widevocab": (1, 2, 128, 1024, 50257, 64),
}
# A loss slice larger than any batch: --loss_chunk=plain, one F.cross_entropy on all the logits.
PLAIN_LOSS = 2**62


def build(name: str, rt: Runtime) -> GPT:
    n_layer, n_head, n_embd, block, vocab, multiple = MODELS[name]
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=block, vocab_size=vocab, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                    dropout=0.0, bias=name not in ("baby", "modern"), vocab_multiple=multiple,
                    arch="modern" if name == "modern" else "gpt2")
    return GPT(cfg).to(rt.device)


def reset_peak_memory(rt: Runtime) -> None:
    """Start a new peak-memory measurement (see peak_memory_mb)."""
    if rt.device_type == "cuda":
        torch.cuda.reset_peak_memory_stats(rt.device)
    elif rt.device_type == "cpu":
        try:  # Linux: writing 5 resets the process' peak resident set size (VmHWM)
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass


def peak_memory_mb(rt: Runtime) -> float | None:
    """MiB at the peak since reset_peak_memory: on CUDA the caching allocator's peak of allocated memory, on
    the CPU (Linux) the process' peak resident set; None where neither can be read."""
    if rt.device_type == "cuda":
        return torch.cuda.max_memory_allocated(rt.device) / 2**20
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return None


def timed(fn: Callable[[], None], rt: Runtime, warmup: int, repeats: int) -> list[float]:
    """Seconds per call of fn, after `warmup` untimed calls; CUDA events on a GPU, else a host clock."""
    for _ in range(warmup):
        fn()
    rt.synchronize()
    times = []
    for _ in range(repeats):
        if rt.device_type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            rt.synchronize()
            times.append(time.perf_counter() - t0)
    return times


def device_name(rt: Runtime) -> str:
    return torch.cuda.get_device_name(rt.device) if rt.device_type == "cuda" else platform.processor() or platform.machine()


def make_row(kind: str, name: str, rt: Runtime, **fields) -> dict:
    """One result: what was measured, then where and how (device, dtype, torch), so rows stand on their own."""
    return {"kind": kind, "model": name, **fields, "device": str(rt.device), "device_name": device_name(rt),
            "dtype": rt.dtype_name, "torch": str(torch.__version__)}


class Span:
    """The duration of one stretch of a step, e.g. the optimizer's: CUDA events on a GPU (read with seconds()
    once the step is synchronised), else a host clock (after a synchronise: MPS runs asynchronously too)."""

    def __init__(self, rt: Runtime):
        self.rt = rt
        if rt.device_type == "cuda":
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            rt.synchronize()
            self.t0 = time.perf_counter()

    def stop(self) -> None:
        if self.rt.device_type == "cuda":
            self.end.record()
        else:
            self.rt.synchronize()
            self.t1 = time.perf_counter()

    def seconds(self) -> float:
        if self.rt.device_type == "cuda":
            return self.start.elapsed_time(self.end) / 1000
        return self.t1 - self.t0


def train_batches(args, cfg: GPTConfig, batch: int, rt: Runtime) -> tuple[Callable, Callable | None]:
    """(next_batch, prefetch) for the training step: train.py's loader on --data, else a few random batches
    already on the device, rotated so nothing is served from a cache (and no prefetch)."""
    if args.data:
        from gptkit.loader import BatchLoader

        loader = BatchLoader(args.data, "train", batch_size=batch, block_size=cfg.block_size, device=rt.device)
        return loader.next_batch, loader.prefetch
    g = torch.Generator().manual_seed(0)
    pool = [torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g).to(rt.device)
            for _ in range(4)]
    counter = iter(range(10**12))

    def next_batch():
        b = pool[next(counter) % len(pool)]
        return b[:, :-1], b[:, 1:]

    return next_batch, None


@contextlib.contextmanager
def loss_slices(elements: int | None, device_type: str):
    """Inside the block the training loss takes `elements` logit elements per slice on this device type
    (PLAIN_LOSS: one F.cross_entropy on all the logits; None: the model's own setting)."""
    saved = dict(LOSS_CHUNK_ELEMENTS)
    if elements is not None:
        LOSS_CHUNK_ELEMENTS[device_type] = elements
    try:
        yield
    finally:
        LOSS_CHUNK_ELEMENTS.clear()
        LOSS_CHUNK_ELEMENTS.update(saved)


def bench_train(name: str, rt: Runtime, args, loss_chunk: int | None = None) -> dict:
    """One training step as train.py runs it (set_lr, forward_backward, check_step's host sync, the optimizer
    step), timed over args.repeats steps; also the optimizer step's own time. loss_chunk: the loss' slice
    size in logit elements (see loss_slices)."""
    model = build(name, rt)
    cfg = model.config
    batch = args.batch_size or (4 if rt.device_type == "cpu" else {"gpt2": 16, "baby": 64}.get(name, 16))
    use_compile, _ = resolve_compile(args.compile, rt.device)
    train_cfg = TrainConfig(weight_decay=0.1, learning_rate=6e-4,
                            optimizer="muon" if cfg.arch == "modern" else "adamw")  # Muon + AdamW for modern
    optimizer = make_optimizer(model, train_cfg, rt.device_type)
    scaler = torch.amp.GradScaler(rt.device_type, enabled=rt.needs_grad_scaler)
    if use_compile:
        torch._dynamo.reset()  # this model's own static graph, not a dynamic one from the last model's sizes
        step_model = torch.compile(model, dynamic=False)
    else:
        step_model = model
    next_batch, prefetch = train_batches(args, cfg, batch, rt)
    optimizer_spans: list[Span] = []

    def step():
        set_lr(optimizer, 0, train_cfg)
        loss, grad_norm = forward_backward(step_model, optimizer, scaler, next_batch, args.accum, rt, 1.0,
                                           prefetch=prefetch)
        # train.py's one host sync per step: the GPU's queue drains here, before the optimizer's kernels are
        # launched. (The flags are not acted on: random tokens give finite losses.)
        check_step(loss, grad_norm, False, rt, Dist())
        span = Span(rt)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        span.stop()
        optimizer_spans.append(span)

    reset_peak_memory(rt)
    with loss_slices(loss_chunk, rt.device_type):  # read when the loss runs (or is traced, when compiling)
        times = timed(step, rt, args.warmup, args.repeats)
    sec = statistics.median(times)
    opt_sec = statistics.median(s.seconds() for s in optimizer_spans[args.warmup:])
    tokens = batch * cfg.block_size * args.accum
    tok_s = tokens / sec
    peak = peak_flops(rt.device, rt.dtype)
    slice_rows = loss_chunk_rows(cfg.padded_vocab_size, rt.device_type, loss_chunk)
    return make_row(
        "train", name, rt, params_M=round(model.num_params() / 1e6, 2), batch_size=batch, accum=args.accum,
        seq_len=cfg.block_size, tokens_per_s=tok_s, ms=sec * 1000,
        mfu=flops_per_token(model) * tok_s / peak if peak else None, peak_mem_mb=peak_memory_mb(rt),
        compile=use_compile, optimizer=train_cfg.optimizer, optimizer_ms=opt_sec * 1000,
        optimizer_share=opt_sec / sec,
        loss_slice_rows=slice_rows if batch * cfg.block_size > slice_rows else None,  # None: the plain path
    )


def bench_decode(name: str, rt: Runtime, args) -> list[dict]:
    """Decoding tokens/s at batch 1 and 8, with and without the KV cache, and the prefill time."""
    model = build(name, rt).eval()
    if rt.device_type == "cuda" and rt.dtype != torch.float32:
        model.to(rt.dtype)  # decoding is memory-bound: bf16 weights halve the bytes read per token
    use_compile, _ = resolve_compile(args.compile, rt.device)
    cfg = model.config
    new = args.decode_tokens or (100 if rt.device_type == "cpu" else 500)
    if args.compare_windows:
        step_fn = None
        if use_compile:
            torch._dynamo.reset()
            step_fn = compile_decode_step(rt.device)
        print(f"{name}: {new} new tokens, batch 1\n" + compare_table(
            decode_benchmark(model, new, repeats=args.decode_repeats, step_fn=step_fn,
                             nocache=not args.skip_nocache)), flush=True)
        return []
    rows = []
    for batch in (1, 8):
        step_fn, compile_s = None, None
        if use_compile:  # a fresh static graph for this batch size (a recompile would be counted, not timed)
            torch._dynamo.reset()
            step_fn = compile_decode_step(rt.device)
            t0 = time.perf_counter()  # the first steps compile the step: timed apart, as compile_s
            time_decode(model, 4, batch_size=batch, prompt_tokens=16, step_fn=step_fn, repeats=1, warmup_tokens=0)
            compile_s = time.perf_counter() - t0
        for use_cache in (True, False):
            if not use_cache and args.skip_nocache:
                continue
            # Without the cache: nanoGPT's decoder, a full forward over the last block_size tokens per token.
            # With it: one-token steps; past block_size the window moves by block_size // 4 (gptkit/generate.py).
            options = SamplingOptions(window_shift=None if use_cache else 1)
            reset_peak_memory(rt)
            sec = statistics.median(time_decode(
                model, new, options, batch_size=batch, prompt_tokens=16, use_cache=use_cache,
                step_fn=step_fn if use_cache else None, repeats=args.decode_repeats))
            compiled = use_compile and use_cache
            rows.append(make_row(
                "decode", name, rt, batch_size=batch, seq_len=new, prompt_tokens=16, kv_cache=use_cache,
                tokens_per_s=batch * new / sec, ms=sec / new * 1000, mfu=None, peak_mem_mb=peak_memory_mb(rt),
                compile=compiled, compile_s=compile_s if compiled else None,
            ))
    # prefill: the whole prompt in one forward that also fills the cache
    n_prompt = min(args.prefill_tokens, cfg.block_size)
    prompt = torch.randint(0, cfg.vocab_size, (1, n_prompt), device=rt.device)
    model.setup_kv_cache(1)
    pos = torch.arange(n_prompt, device=rt.device)

    @torch.no_grad()
    def fill():
        prefill(model, prompt, pos)  # what generate does before the first token

    reset_peak_memory(rt)
    sec = statistics.median(timed(fill, rt, 2, args.decode_repeats * 3))
    model.clear_kv_cache()
    rows.append(make_row(
        "prefill", name, rt, batch_size=1, seq_len=n_prompt, tokens_per_s=n_prompt / sec, ms=sec * 1000, mfu=None,
        peak_mem_mb=peak_memory_mb(rt), compile=False,
    ))
    return rows


def time_decode(
    model: GPT,
    max_new_tokens: int = 500,
    options: SamplingOptions | None = None,
    *,
    batch_size: int = 1,
    prompt_tokens: int = 1,
    use_cache: bool = True,
    step_fn: Callable | None = None,
    repeats: int = 3,
    warmup_tokens: int = 8,
    seed: int = 0,
) -> list[float]:
    """Wall-clock seconds of `repeats` runs, each generating max_new_tokens tokens for batch_size random prompts.

    options: how to sample (None: temperature 1, the default window). It must have no stop token, so that
    every run decodes exactly max_new_tokens tokens. A short warm-up run first takes one-off costs
    (allocations, compilation, CUDA graph recording) out of the timing.
    """
    options = options if options is not None else SamplingOptions()
    if options.stop_token is not None:
        raise ValueError("time_decode: options.stop_token must be None (a stop would end runs early)")
    model.eval()
    device = model.transformer.wte.weight.device
    generator = torch.Generator(device=device).manual_seed(seed)
    prompt = torch.randint(model.config.vocab_size, (batch_size, prompt_tokens), generator=generator, device=device)

    def decode(n: int) -> None:
        stream = generate_stream(model, prompt, n, options, generator=generator, use_cache=use_cache, step_fn=step_fn)
        for _ in stream:
            pass
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    if warmup_tokens:
        decode(warmup_tokens)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        decode(max_new_tokens)
        times.append(time.perf_counter() - t0)
    return times


def decode_benchmark(
    model: GPT,
    max_new_tokens: int = 500,
    *,
    batch_size: int = 1,
    repeats: int = 3,
    step_fn: Callable | None = None,
    nocache: bool = True,
) -> list[dict]:
    """Time decoding with and without the KV cache (without: only when `nocache`); one dict per variant: name, use_cache, window_shift,
    seconds (median of `repeats`), tokens_per_s (all batch rows), ms_per_token (per step), speedup (over row 0).

    Rows: recomputing the last block_size tokens every step (classic nanoGPT: no cache, window_shift=1); no
    cache with generate's sliding window (window_shift=block_size//4); the KV cache with window_shift=1 (past
    block_size every step refills the cache, so it is no faster than no cache there); the KV cache with the
    default window; and, when step_fn is given (e.g. compile_decode_step's), the KV cache with that compiled step.
    The repeats are interleaved across the variants, so a slow spell on a shared machine hits all of them alike.
    """
    shift = max(1, model.config.block_size // 4)
    variants = [
        ("no cache, window_shift=1 (nanoGPT)", False, 1, None),
        (f"no cache, window_shift={shift}", False, shift, None),
        ("KV cache, window_shift=1", True, 1, None),
        (f"KV cache, window_shift={shift} (default)", True, shift, None),
    ][0 if nocache else 2 :]
    if step_fn is not None:
        variants.append((f"KV cache, window_shift={shift}, compiled step", True, shift, step_fn))
    times: list[list[float]] = [[] for _ in variants]
    for r in range(repeats):
        for i, (_, use_cache, window_shift, fn) in enumerate(variants):
            times[i] += time_decode(model, max_new_tokens, SamplingOptions(window_shift=window_shift),
                                    batch_size=batch_size, use_cache=use_cache, step_fn=fn, repeats=1,
                                    warmup_tokens=8 if r == 0 else 0)
    rows = []
    for (name, use_cache, window_shift, _), t in zip(variants, times):
        seconds = statistics.median(t)
        rows.append({
            "name": name,
            "use_cache": use_cache,
            "window_shift": window_shift,
            "seconds": seconds,
            "tokens_per_s": batch_size * max_new_tokens / seconds,
            "ms_per_token": 1000 * seconds / max_new_tokens,
            "speedup": rows[0]["seconds"] / seconds if rows else 1.0,
        })
    return rows


def compare_table(rows: list[dict]) -> str:
    """decode_benchmark's rows as a Markdown table."""
    lines = ["| decoder | seconds | ms/token | tokens/s | speedup |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['seconds']:.2f} | {r['ms_per_token']:.2f} | {r['tokens_per_s']:.0f} | {r['speedup']:.1f}x |"
        )
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    def mem(r):
        return f"{r['peak_mem_mb']:,.0f} MB" if r.get("peak_mem_mb") else "n/a"

    lines = []
    train_rows = [r for r in rows if r["kind"] == "train"]
    if train_rows:
        lines.append(f"{'train':<10}{'params':>9}{'T':>6}{'batch':>9}{'loss by':>11}{'ms/step':>10}"
                     f"{'tokens/s':>12}{'MFU':>7}{'optimizer':>16}{'peak mem':>11}")
        for r in train_rows:
            mfu = f"{r['mfu'] * 100:.1f}%" if r["mfu"] else "n/a"
            batch = f"{r['batch_size']}x{r['accum']}"
            loss_by = f"{r['loss_slice_rows']} rows" if r["loss_slice_rows"] else "plain"
            opt = f"{r['optimizer']} {r['optimizer_share'] * 100:.0f}%"  # its share of the step time
            lines.append(f"{r['model']:<10}{r['params_M']:>8.2f}M{r['seq_len']:>6}{batch:>9}{loss_by:>11}"
                         f"{r['ms']:>10.1f}{r['tokens_per_s']:>12,.0f}{mfu:>7}{opt:>16}{mem(r):>11}")
    dec = [r for r in rows if r["kind"] == "decode"]
    if dec:
        lines.append("")
        lines.append(f"{'decode':<10}{'batch':>6}{'KV cache':>10}{'compiled':>10}{'new tokens':>12}{'tokens/s':>12}"
                     f"{'ms/token':>10}{'peak mem':>11}")
        for r in dec:
            compiled = f"{r['compile_s']:.0f} s" if r["compile"] else "no"  # with the compile time
            lines.append(f"{r['model']:<10}{r['batch_size']:>6}{'yes' if r['kv_cache'] else 'no':>10}{compiled:>10}"
                         f"{r['seq_len']:>12}{r['tokens_per_s']:>12,.1f}{r['ms']:>10.2f}{mem(r):>11}")
    pre = [r for r in rows if r["kind"] == "prefill"]
    if pre:
        lines.append("")
        lines.append(f"{'prefill':<10}{'prompt tokens':>14}{'ms':>10}")
        for r in pre:
            lines.append(f"{r['model']:<10}{r['seq_len']:>14}{r['ms']:>10.2f}")
    return "\n".join(lines)


def parse_loss_chunk(value: str) -> int | None:
    """One --loss_chunk value: PLAIN_LOSS, None (the device's default) or a number of logit elements."""
    value = value.strip()
    if value in ("plain", "default"):
        return PLAIN_LOSS if value == "plain" else None
    base, power, exponent = value.partition("**")
    try:
        elements = int(base) ** min(int(exponent), 62) if power else int(value)  # 2**62: past any batch
    except ValueError:
        elements = 0
    if elements < 1:
        raise cli.UsageError(f"--loss_chunk: {value!r} is not plain, default or a number of logit elements "
                             f"(e.g. 33554432 or 2**25)")
    return elements


def parse_args(argv: list[str] | None):
    p = cli.ArgumentParser(prog="bench.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=None,
                   help=f"comma-separated sizes from {', '.join(MODELS)} (default: baby on CPU, baby,gpt2 on a GPU)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA), float32, bfloat16 or float16")
    p.add_argument("--compile", default="auto", choices=("auto", "True", "False"),
                   help="torch.compile the training step and the decode step (auto: on for CUDA)")
    p.add_argument("--batch_size", type=int, default=0, help="training micro-batch (0: 4 on CPU; 64 baby / 16 gpt2)")
    p.add_argument("--accum", type=int, default=1, help="gradient-accumulation micro-batches per step")
    p.add_argument("--warmup", type=int, default=None, help="untimed training steps first (default 1 CPU, 5 GPU)")
    p.add_argument("--repeats", type=int, default=None, help="timed training steps (median; default 3 CPU, 20 GPU)")
    p.add_argument("--data", default=None, help="a prepared dataset folder to read batches from (default: random)")
    p.add_argument("--loss_chunk", default="default",
                   help="one training row per loss slice size, comma-separated: plain (one F.cross_entropy "
                        "on all the logits), default (the device's), or logit elements per slice, e.g. "
                        "plain,2**25,2**28")
    p.add_argument("--decode_tokens", type=int, default=0, help="new tokens per decode run (0: 100 CPU, 500 GPU)")
    p.add_argument("--decode_repeats", type=int, default=3, help="timed decode runs per row (median)")
    p.add_argument("--prefill_tokens", type=int, default=1000, help="prompt length for the prefill timing")
    p.add_argument("--skip_train", action="store_true", help="only decoding")
    p.add_argument("--skip_decode", action="store_true", help="only training")
    p.add_argument("--skip_nocache", action="store_true", help="skip the (slow) decoding without KV cache")
    p.add_argument("--compare_windows", action="store_true",
                   help="decode table instead: no cache vs KV cache, each with window_shift 1 and block_size//4")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file (e.g. benchmarks/NAME.json)")
    args = p.parse_args(argv)
    args.compile = {"auto": None, "True": True, "False": False}[args.compile]
    args.loss_chunk = [parse_loss_chunk(value) for value in args.loss_chunk.split(",")]
    # Out-of-range counts would otherwise fail deep inside (a median of no timings, empty batches) with a
    # traceback. None means "not given": main picks the device's default.
    for name, low in (("batch_size", 0), ("accum", 1), ("warmup", 0), ("repeats", 1), ("decode_tokens", 0),
                      ("decode_repeats", 1), ("prefill_tokens", 1)):
        value = getattr(args, name)
        if value is not None and value < low:
            raise cli.UsageError(f"--{name} must be >= {low}, got {value}")
    return args


@cli.entry_point(oom_hint="use a smaller --batch_size or --models")
def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    rt = setup_runtime(args.device, args.dtype)  # a DeviceError (a UserError) is the one-line exit
    on_gpu = rt.device_type == "cuda"
    models = (args.models or ("baby,gpt2" if on_gpu else "baby")).split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise cli.UsageError(f"unknown model size(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    if args.data:
        data_vocab = read_meta(require_dataset(args.data))["vocab_size"]  # or a DataError
        # Token ids past the model's vocabulary would index outside its embedding (a crash mid-benchmark).
        too_small = [f"{m} ({MODELS[m][4]})" for m in models if MODELS[m][4] < data_vocab]
        if too_small:
            fix = "pick --models=gpt2 or" if data_vocab <= MODELS["gpt2"][4] else "pick"
            raise cli.UsageError(f"--data={args.data} has vocab_size {data_vocab}, more than the vocabulary of "
                                 f"model {', '.join(too_small)}; {fix} a dataset with a matching vocabulary")
    args.warmup = args.warmup if args.warmup is not None else (5 if on_gpu else 1)
    args.repeats = args.repeats if args.repeats is not None else (20 if on_gpu else 3)
    print(f"device {rt.device} ({device_name(rt)}) | {rt.dtype_name} | torch {torch.__version__} | "
          f"{time.strftime('%Y-%m-%d')}", flush=True)
    rows: list[dict] = []
    for name in models:  # a DataError (--data: e.g. a split too short for the block_size) is a one-line exit
        if not args.skip_train:
            rows.extend(bench_train(name, rt, args, chunk) for chunk in args.loss_chunk)
        if not args.skip_decode:
            rows.extend(bench_decode(name, rt, args))
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "argv": argv if argv is not None else sys.argv[1:],
                       "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
