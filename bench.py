"""Benchmark: training throughput and decoding speed, printed as a table.

    python bench.py                                   # CPU: small defaults, under a minute
    python bench.py --device=cuda --models=baby,gpt2  # one GPU: the figures in BENCHMARKS.md

Training uses the project's real step (train.forward_backward + the AdamW/GradScaler update, with autocast,
torch.compile and fused AdamW where train.py would use them) on random tokens or a prepared dataset.
Decoding times generate.py's loop with and without the KV cache, and its prefill of a prompt. Warm-up is
excluded; each figure is the median of several repeats, timed with CUDA events on a GPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch

import cli
from config import TrainConfig
from generate import SamplingOptions, generate_stream, prefill
from metrics import flops_per_token, peak_flops
from model import GPT, GPTConfig
from optim import make_optimizer
from runtime import Runtime, resolve_compile, setup_runtime
from shards import read_meta, require_dataset
from train import forward_backward

# Model sizes by name: (n_layer, n_head, n_embd, block_size, vocab_size, vocab_multiple)
MODELS = {
    "tiny": (2, 2, 64, 64, 65, 1),  # for tests of this script
    "baby": (6, 6, 384, 256, 65, 1),  # configs/shakespeare.py
    "gpt2": (12, 12, 768, 1024, 50257, 64),  # GPT-2 124M, vocab padded to 50304
}


def build(name: str, rt: Runtime) -> GPT:
    n_layer, n_head, n_embd, block, vocab, multiple = MODELS[name]
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=block, vocab_size=vocab, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                    dropout=0.0, bias=name != "baby", vocab_multiple=multiple)
    return GPT(cfg).to(rt.device)


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


def bench_train(name: str, rt: Runtime, args) -> dict:
    model = build(name, rt)
    cfg = model.config
    batch = args.batch_size or (4 if rt.device_type == "cpu" else {"gpt2": 16, "baby": 64}.get(name, 16))
    use_compile, _ = resolve_compile(args.compile, rt.device)
    train_cfg = TrainConfig(weight_decay=0.1, learning_rate=6e-4)
    optimizer = make_optimizer(model, train_cfg, rt.device_type)
    scaler = torch.amp.GradScaler(rt.device_type, enabled=rt.needs_grad_scaler)
    step_model = torch.compile(model) if use_compile else model
    if args.data:
        from loader import BatchLoader

        loader = BatchLoader(args.data, "train", batch_size=batch, block_size=cfg.block_size, device=rt.device)
        next_batch = loader.next_batch
    else:  # a few random batches, rotated so nothing is served from a cache
        g = torch.Generator().manual_seed(0)
        pool = [torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g).to(rt.device)
                for _ in range(4)]
        counter = iter(range(10**12))

        def next_batch():
            b = pool[next(counter) % len(pool)]
            return b[:, :-1], b[:, 1:]

    def step():
        forward_backward(step_model, optimizer, scaler, next_batch, args.accum, rt, 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    if rt.device_type == "cuda":
        torch.cuda.reset_peak_memory_stats(rt.device)
    times = timed(step, rt, args.warmup, args.repeats)
    sec = statistics.median(times)
    tokens = batch * cfg.block_size * args.accum
    tok_s = tokens / sec
    peak = peak_flops(rt.device)
    return {
        "kind": "train", "model": name, "params_M": round(model.num_params() / 1e6, 2), "T": cfg.block_size,
        "batch": f"{batch}x{args.accum}", "ms_per_step": sec * 1000, "tokens_per_s": tok_s,
        "mfu": flops_per_token(model) * tok_s / peak if peak else None,
        "peak_mem_mb": torch.cuda.max_memory_allocated(rt.device) / 2**20 if rt.device_type == "cuda" else None,
        "compile": use_compile,
    }


def bench_decode(name: str, rt: Runtime, args) -> list[dict]:
    """Decoding tokens/s at batch 1 and 8, with and without the KV cache, and the prefill time."""
    from sample import decode_step_fn

    model = build(name, rt).eval()
    if rt.device_type == "cuda" and rt.dtype != torch.float32:
        model.to(rt.dtype)  # decoding is memory-bound: bf16 weights halve the bytes read per token
    step_fn = decode_step_fn(rt.device, args.compile)
    cfg = model.config
    new = args.decode_tokens or (100 if rt.device_type == "cpu" else 500)
    if args.compare_windows:
        print(f"{name}: {new} new tokens, batch 1\n" + compare_table(
            decode_benchmark(model, new, repeats=args.decode_repeats, step_fn=step_fn)), flush=True)
        return []
    rows = []
    for batch in (1, 8):
        for use_cache in (True, False):
            if not use_cache and args.skip_nocache:
                continue
            # Without the cache: nanoGPT's decoder, a full forward over the last block_size tokens per token.
            # With it: one-token steps; past block_size the window moves by block_size // 4 (generate.py).
            options = SamplingOptions(window_shift=None if use_cache else 1)
            sec = statistics.median(time_decode(
                model, new, options, batch_size=batch, prompt_tokens=16, use_cache=use_cache,
                step_fn=step_fn if use_cache else None, repeats=args.decode_repeats))
            rows.append({"kind": "decode", "model": name, "batch": batch, "kv_cache": use_cache,
                         "new_tokens": new, "tokens_per_s": batch * new / sec, "ms_per_token": sec / new * 1000})
    # prefill: the whole prompt in one forward that also fills the cache
    n_prompt = min(args.prefill_tokens, cfg.block_size)
    prompt = torch.randint(0, cfg.vocab_size, (1, n_prompt), device=rt.device)
    model.setup_kv_cache(1)
    pos = torch.arange(n_prompt, device=rt.device)

    @torch.no_grad()
    def fill():
        prefill(model, prompt, pos)  # what generate does before the first token

    sec = statistics.median(timed(fill, rt, 2, args.decode_repeats * 3))
    model.clear_kv_cache()
    rows.append({"kind": "prefill", "model": name, "batch": 1, "prompt_tokens": n_prompt, "ms": sec * 1000})
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
) -> list[dict]:
    """Time decoding with and without the KV cache; one dict per variant: name, use_cache, window_shift,
    seconds (median of `repeats`), tokens_per_s (all batch rows), ms_per_token (per step), speedup (over row 0).

    Rows: recomputing the last block_size tokens every step (classic nanoGPT: no cache, window_shift=1); no
    cache with generate's sliding window (window_shift=block_size//4); the KV cache with window_shift=1 (past
    block_size every step refills the cache, so it is no faster than no cache there); the KV cache with the
    default window; and, when step_fn is given (e.g. from decode_step_fn), the KV cache with that compiled step.
    The repeats are interleaved across the variants, so a slow spell on a shared machine hits all of them alike.
    """
    shift = max(1, model.config.block_size // 4)
    variants = [
        ("no cache, window_shift=1 (nanoGPT)", False, 1, None),
        (f"no cache, window_shift={shift}", False, shift, None),
        ("KV cache, window_shift=1", True, 1, None),
        (f"KV cache, window_shift={shift} (default)", True, shift, None),
    ]
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
    lines = []
    train_rows = [r for r in rows if r["kind"] == "train"]
    if train_rows:
        lines.append(f"{'train':<8}{'params':>9}{'T':>6}{'batch':>9}{'ms/step':>10}{'tokens/s':>12}{'MFU':>7}"
                     f"{'peak mem':>11}")
        for r in train_rows:
            mfu = f"{r['mfu'] * 100:.1f}%" if r["mfu"] else "n/a"
            mem = f"{r['peak_mem_mb']:,.0f} MB" if r["peak_mem_mb"] else "n/a"
            lines.append(f"{r['model']:<8}{r['params_M']:>8.2f}M{r['T']:>6}{r['batch']:>9}{r['ms_per_step']:>10.1f}"
                         f"{r['tokens_per_s']:>12,.0f}{mfu:>7}{mem:>11}")
    dec = [r for r in rows if r["kind"] == "decode"]
    if dec:
        lines.append("")
        lines.append(f"{'decode':<8}{'batch':>6}{'KV cache':>10}{'new tokens':>12}{'tokens/s':>12}{'ms/token':>10}")
        for r in dec:
            lines.append(f"{r['model']:<8}{r['batch']:>6}{'yes' if r['kv_cache'] else 'no':>10}{r['new_tokens']:>12}"
                         f"{r['tokens_per_s']:>12,.1f}{r['ms_per_token']:>10.2f}")
    pre = [r for r in rows if r["kind"] == "prefill"]
    if pre:
        lines.append("")
        lines.append(f"{'prefill':<8}{'prompt tokens':>14}{'ms':>10}")
        for r in pre:
            lines.append(f"{r['model']:<8}{r['prompt_tokens']:>14}{r['ms']:>10.2f}")
    return "\n".join(lines)


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
    p.add_argument("--decode_tokens", type=int, default=0, help="new tokens per decode run (0: 100 CPU, 500 GPU)")
    p.add_argument("--decode_repeats", type=int, default=3, help="timed decode runs per row (median)")
    p.add_argument("--prefill_tokens", type=int, default=1000, help="prompt length for the prefill timing")
    p.add_argument("--skip_train", action="store_true", help="only decoding")
    p.add_argument("--skip_decode", action="store_true", help="only training")
    p.add_argument("--skip_nocache", action="store_true", help="skip the (slow) decoding without KV cache")
    p.add_argument("--compare_windows", action="store_true",
                   help="decode table instead: no cache vs KV cache, each with window_shift 1 and block_size//4")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    args.compile = {"auto": None, "True": True, "False": False}[args.compile]
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
    device_name = torch.cuda.get_device_name(rt.device) if on_gpu else platform.processor() or platform.machine()
    print(f"device {rt.device} ({device_name}) | {rt.dtype_name} | torch {torch.__version__} | "
          f"{time.strftime('%Y-%m-%d')}", flush=True)
    rows: list[dict] = []
    for name in models:  # a DataError (--data: e.g. a split too short for the block_size) is a one-line exit
        if not args.skip_train:
            rows.append(bench_train(name, rt, args))
        if not args.skip_decode:
            rows.extend(bench_decode(name, rt, args))
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device_name, "dtype": rt.dtype_name, "torch": str(torch.__version__), "rows": rows},
                      f, indent=2)
    return rows


if __name__ == "__main__":
    main()
