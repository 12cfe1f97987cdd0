"""Benchmark: training throughput and decoding speed, printed as a table, each row as soon as it is measured.

    python bench.py                                   # CPU: small defaults, under a minute
    python bench.py --device=cuda --models=baby,gpt2  # one GPU: the figures in BENCHMARKS.md
    python bench.py --device=cuda --models=gpt2nobias --skip_decode --batch_size=12,16,32 --sdpa=default,flash,cudnn

Training times the step as train.py runs it: gptkit/step.py's TrainStep itself (the learning rate, forward +
backward over the micro-batches, clip, the NaN/stop flags, the AdamW or Muon + AdamW update, with autocast,
torch.compile and fused AdamW where train.py would use them), on random tokens or a prepared dataset (then with
the loader's prefetch). The steps of a row are timed as one window, synchronised with the device once at each
end, as train.py's loop lets the host run ahead of the GPU (on a GPU the flags are read a step late); ms/step is
the window's time over its steps, the plain and the graphed step alike. The "optimizer" column is the share of
the optimizer step (optimizer.step() alone, timed with CUDA events inside the window, which need no host
synchronisation, or the host's clock on the CPU; n/a on MPS, where it would need one every step). --loss_chunk=plain,2**25,2**28
gives one training row per size of the loss' slices (model.LOSS_CHUNK_ELEMENTS), "plain" being one
F.cross_entropy on all the logits: the "loss by" column says which ran.

Training variants, so that one run measures them side by side (A/B) before a default changes. Each option
takes a comma list, and the run times every combination, one row each (a plain product, in the order of the
options below); the table's "variant" column says how the step ran (eager or compiled, and every choice
that is not the default), the JSON rows carry every value:
  --batch_size=12,16,32          the micro-batch
  --loss_chunk=...               the loss' slice size (above)
  --sdpa=default,flash,cudnn,efficient,math   the attention kernel, torch.nn.attention.sdpa_kernel around the
                                 whole timed loop (compilation included: inductor picks the kernel when it
                                 traces). A backend that cannot run the model's attention here (tried first on
                                 one sequence, forward and backward) gives a row marked skipped, with the reason.
  --compile_mode=default,max-autotune-no-cudagraphs,reduce-overhead,max-autotune   torch.compile's mode for
                                 the model. reduce-overhead replays the forward and the backward as CUDA graphs.
  --compile_optimizer=False,True  optimizer.step through torch.compile. AdamW then runs its foreach code, which
                                 inductor fuses into a few kernels (compiling the fused CUDA kernel would only
                                 call it). Not under float16's GradScaler (a skipped row). The learning rate is
                                 a Python float that dynamo specialises on: a real run, whose rate changes every
                                 step, would need it as a tensor; here every step has the same rate.
  --compile_scope=model,blocks   what torch.compile compiles: the whole model (with the head and the loss), or each
                                 block on its own (train.py --compile_scope=blocks); the row's first_step_s is the
                                 first step's wall time, compilation included
  --cuda_graphs=False,True       the whole step (forward, backward, clip, flags, fused AdamW with a tensor learning
                                 rate) captured as one CUDA graph after warm-up steps and replayed (train.py
                                 --cuda_graphs, gptkit/cudagraph.py); the optimizer's share is then not separable
                                 ("in graph").
                                 Where it cannot run (not CUDA, float16, Muon) the row is skipped, saying why.
  --fp8_head=False,True          the head's three matmuls in the loss (logits, grad_x, grad_W) in FP8 through
                                 torch._scaled_mm, per-tensor scales (gptkit/fp8.py; the weights stay bf16/fp32).
                                 Only on CUDA with compute capability >= 8.9: elsewhere the row is skipped, saying
                                 why. With --loss_chunk=plain the FP8 loss takes all the rows as one slice.
--profile_step=True: each training row also runs a few more steps (3, or --repeats if fewer) after its timed
window under torch.profiler and reports `profile`, {kind: ms per step} for matmul, attention, head_loss,
optimizer and other (gptkit/step_profile.py: the GPU's kernel time on CUDA, operators' self time on the CPU),
printed under the row.
The bias: a model name with "nobias" appended (gpt2nobias) is the same shape
without biases, as nanoGPT's bench.py (bias=False) times it.

Decoding times gptkit/generate.py's loop with and without the KV cache (with the compiled one-token step of
generate.compile_decode_step when compile is on), at batch sizes --decode_batch, with the cache a row per
--decode_window K (K tokens per call: K calls of the compiled step recorded as one CUDA graph; each K compiled
afresh), --profile_decode adding a step's host and device kernel microseconds (--hf_reference: beside
transformers' eager generate of the same GPT-2 shape, the reference), and its prefill of a prompt
(--prefill_tokens, 1,000 by default: ms per prefill). Warm-up and compilation are excluded (a compiled row
says its compile time, compile_s); each figure is the median of several repeats, timed with CUDA events on a
GPU, and a row stops repeating once its timed runs pass --row_budget_s. On CUDA the default decode (200 new
tokens) ends within a minute eagerly; compiling adds its compile time per batch size.

Every model, every variant and every decode batch size is compiled afresh (torch._dynamo.reset(),
dynamic=False): in one process Dynamo would otherwise treat the second model's sizes as dynamic and time a
symbolic-shape graph. --keep_going: a row that fails (out of memory, a compiler error) is printed and saved
as failed, with the error (its traceback on stderr), and the run goes on with the next.

--json=FILE writes the rows, one dict each, so results can be kept (benchmarks/) and compared; it is
rewritten after every row, so a run cut short keeps what it measured: kind (train, decode, prefill), model,
batch_size, seq_len (train: the context T; decode: new tokens per run; prefill: prompt tokens), tokens_per_s,
ms (train: per step; decode: per token; prefill: per prompt), mfu, peak_mem_mb (CUDA: the allocator's peak;
CPU: the process's peak resident memory during the row), device, device_name, dtype, torch, compile (and
compile_s, the compile time of a compiled decode step), status (ok, skipped or failed; the measurements None
unless ok) and reason, plus a few per kind (train: optimizer, optimizer_ms, optimizer_share,
loss_slice_rows: rows per slice of the loss, None if plain, flops_per_token, profile (--profile_step, else
None), and the variant's sdpa, compile_mode, compile_optimizer, compile_scope, cuda_graphs, fp8_head; decode:
decode_window, and host_us_per_token and gpu_us_per_token, None unless --profile_decode: see profile_decode).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import json
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.rounds import cell, interleave, ratio_cell, ratios, verdict
from gptkit import cli, fp8
from gptkit.config import TrainConfig
from gptkit.data.shards import read_meta, require_dataset
from gptkit.errors import ConfigError
from gptkit.generate import SamplingOptions, compile_decode_step, generate_blocks, prefill
from gptkit.metrics import peak_flops
from gptkit.options import load_config, setting
from gptkit.plan import flops_per_token
from gptkit.runtime import (
    DeviceError,
    Dist,
    Runtime,
    resolve_compile,
    resolve_cuda_graphs,
    setup_runtime,
)
from gptkit.settings import refuse_uncapturable
from gptkit.step_factory import make_step
from gptkit.step_profile import format_profile, profile_steps
from model import GPT, LOSS_CHUNK_ELEMENTS, GPTConfig, loss_chunk_rows

# Model sizes by name: (n_layer, n_head, n_embd, block_size, vocab_size, vocab_multiple)
MODELS = {
    "tiny": (2, 2, 64, 64, 65, 1),  # for tests of this script
    "baby": (6, 6, 384, 256, 65, 1),  # configs/shakespeare.py
    "gpt2": (12, 12, 768, 1024, 50257, 64),  # GPT-2 124M, vocab padded to 50304
    "modern": (12, 12, 768, 1024, 50257, 64),  # GPT-2 124M's shape, arch="modern", trained with Muon
    # one thin layer under GPT-2's vocabulary: the head and the loss are nearly all of the work and memory
    "widevocab": (1, 2, 128, 1024, 50257, 64),
}
# A model name with this appended is the same shape without biases (gpt2nobias: nanoGPT bench.py's bias=False).
NO_BIAS = "nobias"
# A loss slice larger than any batch: --loss_chunk=plain, one F.cross_entropy on all the logits.
PLAIN_LOSS = 2**62
# --sdpa: the attention kernel (torch.nn.attention.SDPBackend's member), "default" letting torch choose.
SDPA_BACKENDS = {"default": None, "flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                 "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}
# --profile_step: steps profiled per training row (fewer if --repeats is).
PROFILED_STEPS = 3
# --compile_mode: torch.compile's modes ("default" is mode=None).
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune")


def base_model(name: str) -> str:
    """The MODELS entry a name stands for: gpt2nobias -> gpt2."""
    return name.removesuffix(NO_BIAS) if name.endswith(NO_BIAS) and name != NO_BIAS else name


def model_names() -> list[str]:
    """Every name --models takes: MODELS' and, for those with biases, the same name + "nobias"."""
    return [*MODELS, *(name + NO_BIAS for name in MODELS if name not in ("baby", "modern"))]


def build(name: str, rt: Runtime) -> GPT:
    base = base_model(name)
    n_layer, n_head, n_embd, block, vocab, multiple = MODELS[base]
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=block, vocab_size=vocab, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                    dropout=0.0, bias=base not in ("baby", "modern") and base == name, vocab_multiple=multiple,
                    arch="modern" if base == "modern" else "gpt2")
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


def timed(fn: Callable[[], None], rt: Runtime, warmup: int, repeats: int, budget_s: float = 0) -> list[float]:
    """Seconds per call of fn, after `warmup` untimed calls; CUDA events on a GPU, else a host clock. With
    budget_s, no new call once the timed ones add up to that many seconds (at least one is timed)."""
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
        if budget_s and sum(times) >= budget_s:
            break
    return times


def timed_window(step: Callable[[], None], rt: Runtime, warmup: int, steps: int) -> float:
    """Seconds per call of step over one window of `steps` calls, after `warmup` untimed ones: the device is
    synchronised once before the window and once after it, never in between (CUDA events on a GPU, else a host
    clock), so the host runs ahead of the device within it as it does in train.py's loop."""
    for _ in range(warmup):
        step()
    rt.synchronize()
    if rt.device_type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000 / steps
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    rt.synchronize()
    return (time.perf_counter() - t0) / steps


def device_name(rt: Runtime) -> str:
    return torch.cuda.get_device_name(rt.device) if rt.device_type == "cuda" else platform.processor() or platform.machine()


def make_row(kind: str, name: str, rt: Runtime, status: str = "ok", reason: str | None = None, **fields) -> dict:
    """One result: what was measured, then where and how (device, dtype, torch), so rows stand on their own.
    status: ok, or skipped / failed with the reason (then the measurements are None)."""
    return {"kind": kind, "model": name, **fields, "device": str(rt.device), "device_name": device_name(rt),
            "dtype": rt.dtype_name, "torch": str(torch.__version__), "status": status, "reason": reason}


# The measured fields of a training row: None in a skipped or failed one.
TRAIN_MEASURES = ("params_M", "tokens_per_s", "ms", "mfu", "peak_mem_mb", "optimizer", "optimizer_ms",
                  "optimizer_share", "loss_slice_rows", "flops_per_token", "first_step_s", "profile")
# ... and of a decode or prefill row.
DECODE_MEASURES = ("tokens_per_s", "ms", "mfu", "peak_mem_mb", "compile_s", "host_us_per_token", "gpu_us_per_token")


def unmeasured_row(kind: str, name: str, rt: Runtime, status: str, reason: str, **fields) -> dict:
    """A row that says why it has no figures: skipped (the variant cannot run here) or failed."""
    measures = TRAIN_MEASURES if kind == "train" else DECODE_MEASURES
    return make_row(kind, name, rt, status, reason, **fields, **dict.fromkeys(m for m in measures if m not in fields))


def failed_row(error: Exception, kind: str, name: str, rt: Runtime, **fields) -> dict:
    """--keep_going: the row of a measurement that raised `error`; its traceback goes to stderr, and the memory
    it held is released for the next row."""
    traceback.print_exc()
    reason = f"{type(error).__name__}: {cli.one_line(error)}"[:400]
    traceback.clear_frames(error.__traceback__)  # the failed row's tensors, held by its frames' locals
    gc.collect()
    if rt.device_type == "cuda":
        torch.cuda.empty_cache()
    return unmeasured_row(kind, name, rt, "failed", reason, **fields)


class Span:
    """The duration of one stretch of a step, e.g. the optimizer's, with no host synchronisation: CUDA events on a
    GPU (read with seconds() once the device is synchronised), the host's clock on the CPU (which runs in
    order)."""

    def __init__(self, rt: Runtime):
        self.cuda = rt.device_type == "cuda"
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self.end.record()
        else:
            self.t1 = time.perf_counter()

    def seconds(self) -> float:
        if self.cuda:
            return self.start.elapsed_time(self.end) / 1000
        return self.t1 - self.t0


def time_optimizer_steps(optimizer, rt: Runtime) -> list[Span] | None:
    """From now on every optimizer.step() of `optimizer` (whoever calls it: the GradScaler, optim.step_unless)
    is timed by a Span, appended to the list returned; None where that would need a host synchronisation per
    step (MPS), and nothing is timed then."""
    if rt.device_type not in ("cuda", "cpu"):
        return None
    spans: list[Span] = []
    inner = optimizer.step

    def step(*args, **kwargs):
        span = Span(rt)
        result = inner(*args, **kwargs)
        span.stop()
        spans.append(span)
        return result

    optimizer.step = step
    return spans


class RandomBatches:
    """A few random batches already on the device, served in rotation (so nothing is served from a cache), as a
    loader is used by the step: next_batch(), and prefetch(), which has nothing to do here."""

    def __init__(self, cfg: GPTConfig, batch: int, rt: Runtime):
        g = torch.Generator().manual_seed(0)
        self.pool = [torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g).to(rt.device)
                     for _ in range(4)]
        self.served = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.pool[self.served % len(self.pool)]
        self.served += 1
        return b[:, :-1], b[:, 1:]

    def prefetch(self) -> None:
        pass


def train_batches(args, cfg: GPTConfig, batch: int, rt: Runtime):
    """What the training step reads its micro-batches from: train.py's loader on --data, else RandomBatches."""
    if args.data:
        from gptkit.data.loader import BatchLoader

        return BatchLoader(args.data, "train", batch_size=batch, block_size=cfg.block_size, device=rt.device)
    return RandomBatches(cfg, batch, rt)


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


@dataclasses.dataclass(frozen=True)
class Variant:
    """One training row's choices (the module docstring's variants): the micro-batch, the loss' slice size in
    logit elements (see loss_slices), the attention kernel, torch.compile's mode for the model (when it is
    compiled) and whether the optimizer step is compiled."""

    batch_size: int
    loss_chunk: int | None = None
    sdpa: str = "default"
    compile_mode: str = "default"
    compile_optimizer: bool = False
    compile_scope: str = "model"
    cuda_graphs: bool = False
    fp8_head: bool = False

    def fields(self) -> dict:
        """What a row records of it (the loss' slicing is recorded as loss_slice_rows)."""
        return {"batch_size": self.batch_size, "sdpa": self.sdpa, "compile_mode": self.compile_mode,
                "compile_optimizer": self.compile_optimizer, "compile_scope": self.compile_scope,
                "cuda_graphs": self.cuda_graphs, "fp8_head": self.fp8_head}


def default_batch(name: str, rt: Runtime) -> int:
    """--batch_size=0: 4 on the CPU; on a GPU 64 for baby, 16 for the others."""
    return 4 if rt.device_type == "cpu" else {"gpt2": 16, "baby": 64}.get(base_model(name), 16)


def train_variants(name: str, rt: Runtime, args) -> list[Variant]:
    """Every combination of the variant options, in their order: a plain product."""
    batches = [b or default_batch(name, rt) for b in args.batch_size]
    loss_chunks = [parse_loss_chunk(value) for value in args.loss_chunk]
    return [Variant(*combo) for combo in itertools.product(
        batches, loss_chunks, args.sdpa, args.compile_mode, args.compile_optimizer, args.compile_scope,
        args.cuda_graphs, args.fp8_head)]


def sdpa_backend(name: str) -> contextlib.AbstractContextManager:
    """--sdpa's context: torch.nn.attention.sdpa_kernel limited to that backend ("default": torch's choice)."""
    if SDPA_BACKENDS[name] is None:
        return contextlib.nullcontext()
    return sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[name]))


def sdpa_problem(name: str, cfg: GPTConfig, rt: Runtime) -> str | None:
    """Why --sdpa=name cannot run this model's training attention here, or None when it can: tried on one
    sequence's causal attention at the model's shapes, in the step's precision, forward and backward. The
    reason is torch's own (its warnings say why a kernel was not used; on a CPU only the error says it)."""
    if SDPA_BACKENDS[name] is None:
        return None
    q = torch.randn(1, cfg.n_head, cfg.block_size, cfg.n_embd // cfg.n_head, device=rt.device, dtype=rt.dtype,
                    requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_backend(name):
                F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
            return None
        except RuntimeError as e:
            why = [cli.one_line(w.message) for w in caught] or [cli.one_line(e)]
    return f"--sdpa={name} cannot run this model's attention on {rt.device} ({rt.dtype_name}): {'; '.join(why)}"[:400]


def compile_optimizer_step(optimizer) -> None:
    """--compile_optimizer=True: the optimizer's step replaced, on this object, by the same step through
    torch.compile, so that whatever calls optimizer.step() (the GradScaler, step.StepGuard) runs it. A fused
    AdamW first switches to its foreach code, which inductor fuses into a few kernels; it then cannot skip
    a step on the device, so step.StepGuard reads its flags before the update, as on the CPU, and the row
    times that too."""
    adamw = getattr(optimizer, "adamw", optimizer)  # MuonAdamW's AdamW, or the AdamW itself
    if isinstance(adamw, torch.optim.AdamW) and adamw.defaults.get("fused"):
        for settings in (adamw.defaults, *adamw.param_groups):
            settings.update(fused=False, foreach=True)
    eager_step = optimizer.step
    compiled = torch.compile(lambda: eager_step())
    optimizer.step = lambda closure=None: compiled()


def compiled(model: GPT, v: Variant, use_compile: bool) -> torch.nn.Module:
    """What the row's steps call: the model, or with compile the model compiled whole (static shapes, the
    variant's mode) or, with compile_scope blocks, the model with each block compiled in place."""
    if not use_compile:
        return model
    mode = None if v.compile_mode == "default" else v.compile_mode
    if v.compile_scope == "model":
        return torch.compile(model, dynamic=False, mode=mode)
    for block in model.transformer.h:
        block.compile(dynamic=False, mode=mode)
    return model


def bench_train(name: str, rt: Runtime, args, variant: Variant) -> dict:
    """One training step as train.py runs it (gptkit/step.py's TrainStep) with the variant's choices, timed over
    one window of args.repeats steps; also the optimizer step's own time. A variant that cannot run here gives
    a skipped row that says why."""
    v = variant
    model = build(name, rt)
    cfg = model.config
    use_compile, _ = resolve_compile(args.compile, rt.device)
    slice_rows = loss_chunk_rows(cfg.padded_vocab_size, rt.device_type, v.loss_chunk)
    n_tokens = v.batch_size * cfg.block_size
    # None: plain. The FP8 head always slices (one slice of all the rows, at most).
    sliced = min(slice_rows, n_tokens) if v.fp8_head else slice_rows if n_tokens > slice_rows else None
    fields = dict(**v.fields(), accum=args.accum, seq_len=cfg.block_size, compile=use_compile,
                  loss_slice_rows=sliced)
    problem = sdpa_problem(v.sdpa, cfg, rt)
    if v.fp8_head and not problem:
        problem = fp8.fp8_problem(rt.device) or fp8.shape_problem(n_tokens, cfg.n_embd, cfg.padded_vocab_size)
    if v.compile_optimizer and rt.needs_grad_scaler:
        problem = "--compile_optimizer=True is not measured under float16's GradScaler (use bfloat16 or float32)"
    batch = v.batch_size
    train_cfg = TrainConfig(weight_decay=0.1, learning_rate=6e-4,
                            optimizer="muon" if cfg.arch == "modern" else "adamw")  # Muon + AdamW for modern
    if v.cuda_graphs and not problem:
        try:
            resolve_cuda_graphs(True, rt, world_size=1, optimizer=train_cfg.optimizer, compiled=use_compile)
        except DeviceError as e:
            problem = str(e)
        if v.compile_optimizer:
            problem = "--cuda_graphs=True records the fused AdamW step in the graph: not with --compile_optimizer"
    if problem:
        return unmeasured_row("train", name, rt, "skipped", problem, **fields)
    if v.fp8_head:
        fp8.use_fp8_head(model, rt.device)
    torch._dynamo.reset()  # this row's own static graphs, not dynamic ones from the last row's sizes
    step_model = compiled(model, v, use_compile)
    batches = train_batches(args, cfg, batch, rt)
    # train.py's step, built as the run builds it; with --cuda_graphs its optimizer step is inside the graph
    # (not timed apart)
    train_step = make_step(step_model, train_cfg, rt, Dist(), accum=args.accum, raw_model=model, graphs=v.cuda_graphs,
                           adapt_optimizer=compile_optimizer_step if v.compile_optimizer else None)
    optimizer_spans = None if v.cuda_graphs else time_optimizer_steps(train_step.optimizer, rt)

    def step():
        # train.py's step, at step 0's learning rate every time (see --compile_optimizer). Its verdict (on a GPU
        # the flags of the step before) is not acted on: random tokens give finite losses.
        train_step(0, batches)

    reset_peak_memory(rt)
    # both read when the step runs (or is traced, when compiling)
    with loss_slices(v.loss_chunk, rt.device_type), sdpa_backend(v.sdpa):
        first_step_s = None  # the first warm-up step's wall time: compilation included
        if args.warmup:
            t0 = time.perf_counter()
            step()
            rt.synchronize()
            first_step_s = time.perf_counter() - t0
        sec = timed_window(step, rt, max(0, args.warmup - 1), args.repeats)
        opt_sec = statistics.median(s.seconds() for s in optimizer_spans[args.warmup:]) if optimizer_spans else None
        profile = (profile_steps(step, rt.device_type, min(PROFILED_STEPS, args.repeats), cfg.padded_vocab_size)
                   if args.profile_step else None)
    tokens = batch * cfg.block_size * args.accum
    tok_s = tokens / sec
    peak = peak_flops(rt.device, rt.dtype)
    fpt = flops_per_token(model)
    return make_row(
        "train", name, rt, params_M=round(model.num_params(non_embedding=False) / 1e6, 2), **fields, tokens_per_s=tok_s,
        ms=sec * 1000, mfu=fpt * tok_s / peak if peak else None, peak_mem_mb=peak_memory_mb(rt),
        optimizer=train_cfg.optimizer, optimizer_ms=opt_sec and opt_sec * 1000,
        optimizer_share=opt_sec and opt_sec / sec, flops_per_token=fpt, first_step_s=first_step_s,
        profile=profile,
    )


def bench_decode(name: str, rt: Runtime, args) -> Iterator[dict]:
    """Decoding tokens/s at each --decode_batch size, with and without the KV cache, then the prefill time: the
    rows one at a time, as each is measured. With --keep_going a batch size (or the prefill) that fails gives
    a failed row and the next goes on."""
    model = build(name, rt).eval()
    if rt.device_type == "cuda" and rt.dtype != torch.float32:
        model.to(rt.dtype)  # decoding is memory-bound: bf16 weights halve the bytes read per token
    use_compile, _ = resolve_compile(args.compile, rt.device)
    new = args.decode_tokens or (100 if rt.device_type == "cpu" else 200)
    if args.compare_windows:
        step_fn = None
        if use_compile:
            torch._dynamo.reset()
            step_fn = compile_decode_step(rt.device)
        print(f"{name}: {new} new tokens, batch 1\n" + compare_table(
            decode_benchmark(model, new, repeats=args.decode_repeats, step_fn=step_fn,
                             nocache=not args.skip_nocache)), flush=True)
        return
    for batch in args.decode_batch:
        try:
            yield from decode_rows(model, name, rt, args, batch, new, use_compile)
        except Exception as e:
            if not recoverable(e, args):
                raise
            yield failed_row(e, "decode", name, rt, batch_size=batch, seq_len=new, compile=use_compile,
                             decode_window=None)
    if args.hf_reference:
        try:
            yield hf_reference_row(model, name, rt, args, new)
        except Exception as e:
            if not recoverable(e, args):
                raise
            yield failed_row(e, "decode", f"{name} (transformers)", rt, batch_size=1, seq_len=new, compile=False)
    n_prompt = min(args.prefill_tokens, model.config.block_size)
    try:
        yield prefill_row(model, name, rt, args, n_prompt)
    except Exception as e:
        if not recoverable(e, args):
            raise
        yield failed_row(e, "prefill", name, rt, batch_size=1, seq_len=n_prompt, compile=False)


def hf_reference_row(model: GPT, name: str, rt: Runtime, args, new: int) -> dict:
    """The reference for our eager decoding: transformers' GPT2LMHeadModel of the same shape (random weights:
    the speed does not depend on them), in the same dtype, its eager greedy `generate` with its KV cache at
    batch 1 from a 16-token prompt, exactly `new` tokens (min_new_tokens, no end token), timed as our rows."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        raise cli.UsageError("--hf_reference needs transformers: pip install transformers") from None

    c = model.config
    if c.arch != "gpt2":
        raise ValueError(f"--hf_reference compares GPT-2's architecture; {name!r} is {c.arch}")
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=c.vocab_size, n_positions=c.block_size, n_embd=c.n_embd,
                                    n_layer=c.n_layer, n_head=c.n_head)).to(rt.device, next(model.parameters()).dtype)
    hf.eval()
    prompt = torch.randint(c.vocab_size, (1, 16), device=rt.device)

    @torch.no_grad()
    def run() -> None:
        hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new,
                    do_sample=False, eos_token_id=None, pad_token_id=0)

    times = timed(run, rt, warmup=1, repeats=args.decode_repeats, budget_s=args.row_budget_s)
    sec = statistics.median(times)
    return make_row("decode", f"{name} (transformers)", rt, batch_size=1, seq_len=new, prompt_tokens=16,
                    kv_cache=True, tokens_per_s=new / sec, ms=sec / new * 1000, mfu=None,
                    peak_mem_mb=peak_memory_mb(rt), compile=False, compile_s=None)


def decode_rows(model: GPT, name: str, rt: Runtime, args, batch: int, new: int, use_compile: bool) -> Iterator[dict]:
    """The decode rows of one batch size: with the KV cache, a row per --decode_window K (K tokens per call, through
    the compiled step or window when compiling, whose compile time is the row's compile_s) and, unless
    --skip_nocache, without it (one token per step). With --profile_decode each row also says where a token's
    time goes (profile_decode)."""
    for window in args.decode_window:
        yield decode_row(model, name, rt, args, batch, new, use_compile, window)
    if not args.skip_nocache:
        yield decode_row(model, name, rt, args, batch, new, False, 1, use_cache=False)


def decode_row(model: GPT, name: str, rt: Runtime, args, batch: int, new: int, use_compile: bool, window: int,
               use_cache: bool = True) -> dict:
    """One decode row: `new` tokens per run for `batch` random 16-token prompts, `window` tokens per call.
    Without the cache it is nanoGPT's decoder, a full forward over the last block_size tokens per token; with
    it, one-token steps or windows. Past block_size both slide the window one token at a time (the default)."""
    step_fn, compile_s = None, None
    if use_compile:  # a fresh static graph for this batch size and window (a recompile would be counted, not timed)
        torch._dynamo.reset()
        step_fn = compile_decode_step(rt.device)
        t0 = time.perf_counter()  # the first steps compile the step or window: timed apart, as compile_s
        time_decode(model, 4 if window == 1 else window + 1, batch_size=batch, prompt_tokens=16, step_fn=step_fn,
                    window=window, repeats=1, warmup_tokens=0)
        compile_s = time.perf_counter() - t0
    options = SamplingOptions()
    reset_peak_memory(rt)
    sec = statistics.median(time_decode(
        model, new, options, batch_size=batch, prompt_tokens=16, use_cache=use_cache, step_fn=step_fn,
        window=window, repeats=args.decode_repeats, budget_s=args.row_budget_s))
    peak = peak_memory_mb(rt)
    host_us = gpu_us = None
    if args.profile_decode:
        host_us, gpu_us = profile_decode(model, new, options, batch_size=batch, prompt_tokens=16,
                                         use_cache=use_cache, step_fn=step_fn, window=window)
    return make_row(
        "decode", name, rt, batch_size=batch, seq_len=new, prompt_tokens=16, kv_cache=use_cache,
        decode_window=window, tokens_per_s=batch * new / sec, ms=sec / new * 1000, mfu=None, peak_mem_mb=peak,
        compile=use_compile, compile_s=compile_s, host_us_per_token=host_us, gpu_us_per_token=gpu_us,
    )


def prefill_row(model: GPT, name: str, rt: Runtime, args, n_prompt: int) -> dict:
    """The prefill of an n_prompt-token prompt: the whole prompt in one (eager) forward that also fills the
    cache, what generate does before the first token; ms per prefill."""
    prompt = torch.randint(0, model.config.vocab_size, (1, n_prompt), device=rt.device)
    model.setup_kv_cache(1)
    pos = torch.arange(n_prompt, device=rt.device)

    @torch.no_grad()
    def fill():
        prefill(model, prompt, pos)

    reset_peak_memory(rt)
    sec = statistics.median(timed(fill, rt, 2, args.decode_repeats * 3, args.row_budget_s))
    model.clear_kv_cache()
    return make_row(
        "prefill", name, rt, batch_size=1, seq_len=n_prompt, tokens_per_s=n_prompt / sec, ms=sec * 1000, mfu=None,
        peak_mem_mb=peak_memory_mb(rt), compile=False,
    )


def time_decode(
    model: GPT,
    max_new_tokens: int = 500,
    options: SamplingOptions | None = None,
    *,
    batch_size: int = 1,
    prompt_tokens: int = 1,
    use_cache: bool = True,
    step_fn: Callable | None = None,
    window: int = 1,
    repeats: int = 3,
    warmup_tokens: int = 8,
    seed: int = 0,
    budget_s: float = 0,
) -> list[float]:
    """Wall-clock seconds of `repeats` runs, each generating max_new_tokens tokens for batch_size random prompts
    (with budget_s, no new run once the runs add up to that many seconds; at least one runs).

    options: how to sample (None: temperature 1, the default window). It must have no stop token, so that
    every run decodes exactly max_new_tokens tokens. window: tokens per call (generate.generate_blocks). A short
    warm-up run first takes one-off costs (allocations, compilation, CUDA graph recording) out of the timing.
    """
    decode, device = decoder(model, options, batch_size=batch_size, prompt_tokens=prompt_tokens,
                             use_cache=use_cache, step_fn=step_fn, window=window, seed=seed)
    if warmup_tokens:
        decode(warmup_tokens)
        synchronize(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        decode(max_new_tokens)
        synchronize(device)
        times.append(time.perf_counter() - t0)
        if budget_s and sum(times) >= budget_s:
            break
    return times


def decoder(model: GPT, options: SamplingOptions | None, *, batch_size: int, prompt_tokens: int, use_cache: bool,
            step_fn: Callable | None, window: int, seed: int = 0) -> tuple[Callable[[int], None], torch.device]:
    """decode(n): n tokens of generate's loop for batch_size random prompts, without waiting for the device at
    the end; and the device. options must have no stop token, so that every run decodes exactly n tokens."""
    options = options if options is not None else SamplingOptions()
    if options.stop_token is not None:
        raise ValueError("time_decode: options.stop_token must be None (a stop would end runs early)")
    model.eval()
    device = model.transformer.wte.weight.device
    generator = torch.Generator(device=device).manual_seed(seed)
    prompt = torch.randint(model.config.vocab_size, (batch_size, prompt_tokens), generator=generator, device=device)

    def decode(n: int) -> None:
        for _ in generate_blocks(model, prompt, n, options, generator=generator, use_cache=use_cache,
                                 step_fn=step_fn, window=window):
            pass

    return decode, device


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_decode(model: GPT, new: int, options: SamplingOptions | None = None, *, batch_size: int = 1,
                   prompt_tokens: int = 16, use_cache: bool = True, step_fn: Callable | None = None,
                   window: int = 1) -> tuple[float, float | None]:
    """Where a decode step's time goes (a token of every row), in microseconds: (host, kernels).

    host: the Python side, the wall time of the decode's loop up to its last launch, before waiting for the
    device at the end (with no stop token the loop never waits for the device, bar a full launch queue); on a
    CPU, which computes as it goes, that is all of it. kernels: the device's kernel time by torch.profiler (the
    sum of every CUDA kernel's), on a CPU the operators' own CPU time (their self time, so none counted twice).
    On a GPU host >> kernels says the host is the bottleneck; on the CPU host - kernels is Python's share.
    One untimed run first (allocations, compilation), then one of each."""
    decode, device = decoder(model, options, batch_size=batch_size, prompt_tokens=prompt_tokens,
                             use_cache=use_cache, step_fn=step_fn, window=window)
    decode(new)
    synchronize(device)
    t0 = time.perf_counter()
    decode(new)
    host = time.perf_counter() - t0
    synchronize(device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        decode(new)
        synchronize(device)
    kind = torch.autograd.DeviceType.CUDA if device.type == "cuda" else torch.autograd.DeviceType.CPU
    events = [e for e in prof.key_averages() if e.device_type == kind]
    kernels = sum(e.self_device_time_total if device.type == "cuda" else e.self_cpu_time_total for e in events)
    return host / new * 1e6, (kernels / new if kernels else None)  # (None: the profiler saw no kernel)


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
    cache with a faster window (window_shift=block_size//4); the KV cache with window_shift=1 (the default, exact:
    past block_size every step refills the cache, so it is no faster than no cache there); the KV cache with
    window_shift=block_size//4 (sample.py --window_shift, approximate); and, when step_fn is given (e.g.
    compile_decode_step's), the KV cache with that compiled step.
    The repeats are interleaved across the variants, the order rotated each round, so a slow spell on a shared
    machine hits all of them alike (benchmarks/rounds.py); each row keeps its rounds' seconds (seconds_rounds)
    and its speedup's range over them (speedup_range: the rounds' own ratios).
    """
    shift = max(1, model.config.block_size // 4)
    variants = [
        ("no cache, window_shift=1 (nanoGPT)", False, 1, None),
        (f"no cache, window_shift={shift}", False, shift, None),
        ("KV cache, window_shift=1 (default)", True, 1, None),
        (f"KV cache, window_shift={shift}", True, shift, None),
    ][0 if nocache else 2 :]
    if step_fn is not None:
        variants.append((f"KV cache, window_shift={shift}, compiled step", True, shift, step_fn))
    times: list[list[float]] = [[] for _ in variants]
    for r, i in interleave(range(len(variants)), repeats):  # the order rotated each round: none always first
        _, use_cache, window_shift, fn = variants[i]
        times[i] += time_decode(model, max_new_tokens, SamplingOptions(window_shift=window_shift),
                                batch_size=batch_size, use_cache=use_cache, step_fn=fn, repeats=1,
                                warmup_tokens=8 if r == 0 else 0)
    rows = []
    for (name, use_cache, window_shift, _), t in zip(variants, times):
        seconds = statistics.median(t)
        speedups = ratios(times[0], t)  # round by round: nanoGPT's decoder's seconds over this one's
        rows.append({
            "name": name,
            "use_cache": use_cache,
            "window_shift": window_shift,
            "seconds": seconds,
            "seconds_rounds": t,
            "tokens_per_s": batch_size * max_new_tokens / seconds,
            "ms_per_token": 1000 * seconds / max_new_tokens,
            "speedup": statistics.median(speedups),
            "speedup_range": (min(speedups), max(speedups)),
        })
    return rows


def compare_table(rows: list[dict]) -> str:
    """decode_benchmark's rows as a Markdown table: seconds as the median (range) of the rounds; the speedup over
    the first row (nanoGPT's decoder) taken round by round, median (range), and "at parity" where the two
    rows' ranges overlap."""
    lines = ["| decoder | seconds | ms/token | tokens/s | speedup |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        rounds = r["seconds_rounds"]
        versus = ratio_cell(rows[0]["seconds_rounds"], rounds, word=False)
        if r is not rows[0] and len(rounds) > 1:
            versus += f", {verdict(rounds, rows[0]['seconds_rounds'], higher_is_better=False)}"
        lines.append(
            f"| {r['name']} | {cell(rounds, 2)} | {r['ms_per_token']:.2f} | {r['tokens_per_s']:.0f} | {versus} |"
        )
    return "\n".join(lines)


def table_header(kind: str) -> str:
    """The header line of a kind's section of the table."""
    if kind == "train":
        return (f"{'train':<12}{'params':>9}{'T':>6}{'batch':>9}{'loss by':>11}{'ms/step':>10}{'tokens/s':>12}"
                f"{'MFU':>7}{'optimizer':>16}{'peak mem':>11}  variant")
    if kind == "decode":
        return (f"{'decode':<12}{'batch':>6}{'KV cache':>10}{'window':>8}{'compiled':>10}{'new tokens':>12}"
                f"{'tokens/s':>12}{'ms/token':>10}{'peak mem':>11}{'host us':>9}{'gpu us':>8}")
    return f"{'prefill':<12}{'prompt tokens':>14}{'ms':>10}{'tokens/s':>12}"


def variant_text(r: dict) -> str:
    """How a training row's step ran: eager or compiled (and the mode), and the other variants' non-defaults."""
    parts = ["eager" if not r["compile"] else
             "compiled" if r["compile_mode"] == "default" else f"compiled {r['compile_mode']}"]
    if r["sdpa"] != "default":
        parts.append(f"sdpa {r['sdpa']}")
    if r["compile_optimizer"]:
        parts.append("optimizer compiled")
    if r.get("compile_scope", "model") != "model" and r["compile"]:
        parts.append(f"{r['compile_scope']} compiled")
    if r.get("cuda_graphs"):
        parts.append("one CUDA graph")
    if r.get("fp8_head"):
        parts.append("fp8 head")
    return ", ".join(parts)


def table_line(r: dict) -> str:
    """One row of the table; a skipped or failed one says why."""
    mem = f"{r['peak_mem_mb']:,.0f} MB" if r.get("peak_mem_mb") else "n/a"
    if r["status"] != "ok":
        what = [f"batch {r['batch_size']}"] if r["batch_size"] is not None else []
        what += [variant_text(r), r["status"]] if r["kind"] == "train" else [r["status"]]
        return f"{r['model']:<12}{', '.join(what)}: {r['reason']}"
    if r["kind"] == "train":
        mfu = f"{r['mfu'] * 100:.1f}%" if r["mfu"] else "n/a"
        batch = f"{r['batch_size']}x{r['accum']}"
        loss_by = f"{r['loss_slice_rows']} rows" if r["loss_slice_rows"] else "plain"
        share = (f"{r['optimizer_share'] * 100:.0f}%" if r["optimizer_share"] is not None else
                 "in graph" if r.get("cuda_graphs") else "n/a")
        opt = f"{r['optimizer']} {share}"  # its share of the step time
        return (f"{r['model']:<12}{r['params_M']:>8.2f}M{r['seq_len']:>6}{batch:>9}{loss_by:>11}{r['ms']:>10.1f}"
                f"{r['tokens_per_s']:>12,.0f}{mfu:>7}{opt:>16}{mem:>11}  {variant_text(r)}")
    if r["kind"] == "decode":
        compiled = f"{r['compile_s']:.0f} s" if r["compile"] else "no"  # with the compile time
        host, gpu = (f"{r[k]:,.0f}" if r.get(k) is not None else "-" for k in ("host_us_per_token",
                                                                               "gpu_us_per_token"))
        return (f"{r['model']:<12}{r['batch_size']:>6}{'yes' if r['kv_cache'] else 'no':>10}"
                f"{r.get('decode_window') or 1:>8}{compiled:>10}{r['seq_len']:>12}{r['tokens_per_s']:>12,.1f}"
                f"{r['ms']:>10.2f}{mem:>11}{host:>9}{gpu:>8}")
    return f"{r['model']:<12}{r['seq_len']:>14}{r['ms']:>10.2f}{r['tokens_per_s']:>12,.0f}"


def format_table(rows: list[dict]) -> str:
    """The rows as one table: a section per kind (train, decode, prefill), each under its header."""
    sections = []
    for kind in ("train", "decode", "prefill"):
        lines = [table_line(r) for r in rows if r["kind"] == kind]
        if lines:
            sections.append("\n".join([table_header(kind), *lines]))
    return "\n\n".join(sections)


class RowPrinter:
    """Takes the rows as they are measured: prints each at once (flushed), under its kind's header, and with
    --json rewrites the file after each, so a run cut short (a crash, a timeout) keeps what it measured."""

    def __init__(self, json_path: str | None, argv: list[str]):
        self.json_path, self.argv = json_path, argv
        self.rows: list[dict] = []
        self.kind: str | None = None

    def __call__(self, row: dict) -> None:
        self.rows.append(row)
        if row["kind"] != self.kind:
            print(("\n" if self.kind else "") + table_header(row["kind"]))
            self.kind = row["kind"]
        print(table_line(row), flush=True)
        if row.get("profile"):
            print(format_profile(row["profile"]), flush=True)
        if self.json_path:
            self.write()

    def write(self) -> None:
        """The JSON file, replaced whole (written beside it first): never a half-written file."""
        partial = Path(f"{self.json_path}.partial")
        partial.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "argv": self.argv, "rows": self.rows},
                                      indent=2))
        os.replace(partial, self.json_path)


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


@dataclasses.dataclass
class BenchConfig:
    models: list[str] | None = setting(None, "model sizes, comma-separated: tiny, baby, gpt2, modern, widevocab, and "
                                             "those with biases with nobias appended (auto: baby on CPU, baby,gpt2 "
                                             "on a GPU)")
    device: str = setting("auto", "auto, cpu, cuda, cuda:N or mps")
    dtype: str = setting("auto", "auto (bf16 on CUDA), float32, bfloat16 or float16",
                         ("auto", "float32", "bfloat16", "float16"))
    compile: bool | None = setting(None, "torch.compile the training step and the decode step: True, False or auto "
                                         "(None: on for CUDA)")
    # training: each variant option takes a comma list, a row per combination
    batch_size: list[int] = setting([0], "training micro-batches, a row each (0: 4 on CPU; 64 baby / 16 gpt2)")
    sdpa: list[str] = setting(["default"], f"attention kernels for training, a row each: {', '.join(SDPA_BACKENDS)} "
                                           f"(default: torch's choice)", tuple(SDPA_BACKENDS))
    compile_mode: list[str] = setting(["default"], f"torch.compile modes for the training step, a row each: "
                                                   f"{', '.join(COMPILE_MODES)}", COMPILE_MODES)
    compile_optimizer: list[bool] = setting([False], "compile the optimizer step too: False, True or False,True "
                                                     "(a row each)")
    compile_scope: list[str] = setting(["model"], "what torch.compile compiles, a row each: model, blocks",
                                       ("model", "blocks"))
    cuda_graphs: list[bool] = setting([False], "the whole step as one CUDA graph: False, True or False,True "
                                               "(a row each)")
    fp8_head: list[bool] = setting([False], "the head's matmuls in the training loss in FP8 (CUDA, compute "
                                            "capability >= 8.9): False, True or False,True (a row each)")
    profile_step: bool = setting(False, "each training row also profiles a few steps: ms per step by kind "
                                        "(matmul, attention, head_loss, optimizer, other)")
    loss_chunk: list[str] = setting(["default"], "one training row per loss slice size: plain (one "
                                                 "F.cross_entropy on all the logits), default (the device's), or "
                                                 "logit elements per slice, e.g. plain,2**25,2**28")
    accum: int = setting(1, "gradient-accumulation micro-batches per step")
    warmup: int | None = setting(None, "untimed training steps first (auto: 1 CPU, 5 GPU)")
    repeats: int | None = setting(None, "timed training steps, one window (auto: 3 CPU, 20 GPU)")
    data: str = setting("", "a prepared dataset folder to read batches from ('' = random tokens)")
    # decoding
    decode_batch: list[int] = setting([1, 8], "decode batch sizes, a row each")
    decode_tokens: int = setting(0, "new tokens per decode run (0: 100 CPU, 200 GPU)")
    decode_repeats: int = setting(3, "timed decode runs per row (median)")
    decode_window: list[int] = setting([1], "decode tokens per call with the KV cache, a row each: 1 = a token per "
                                            "step, K > 1 = K steps in one function (one CUDA graph compiled)")
    profile_decode: bool = setting(False, "decode rows also say a step's host microseconds (host_us_per_token) and "
                                          "device kernel microseconds by torch.profiler (gpu_us_per_token; on the "
                                          "CPU the operators' CPU time)")
    prefill_tokens: int = setting(1000, "prompt length for the prefill timing")
    row_budget_s: float = setting(10.0, "decode and prefill: no new timed run once a row's add up to this many "
                                        "seconds (at least one; 0: --decode_repeats always)")
    # what to run, and the results
    skip_train: bool = setting(False, "only decoding")
    skip_decode: bool = setting(False, "only training")
    skip_nocache: bool = setting(False, "skip the (slow) decoding without KV cache")
    hf_reference: bool = setting(False, "also time transformers' eager generate of the same GPT-2 shape at batch 1 "
                                        "(the reference for the eager decode rows; needs transformers)")
    compare_windows: bool = setting(False, "decode table instead: no cache vs KV cache, each with window_shift 1 "
                                           "and block_size//4")
    keep_going: bool = setting(False, "a row that fails (out of memory, a compiler error) is reported as failed, "
                                      "with the error, and the run goes on")
    json: str = setting("", "also write the rows to this JSON file (e.g. benchmarks/NAME.json), rewritten after "
                            "every row")

    def validate(self) -> None:
        for value in self.loss_chunk:
            parse_loss_chunk(value)  # a one-line error naming --loss_chunk
        # Out-of-range counts would otherwise fail deep inside (a median of no timings, empty batches) with a
        # traceback. None means "not given": main picks the device's default.
        for name, low in (("batch_size", 0), ("decode_batch", 1), ("decode_window", 1), ("accum", 1), ("warmup", 0),
                          ("repeats", 1),
                          ("decode_tokens", 0), ("decode_repeats", 1), ("prefill_tokens", 1), ("row_budget_s", 0)):
            value = getattr(self, name)
            for v in value if isinstance(value, list) else [value]:
                if v is not None and v < low:
                    raise ConfigError(f"--{name} must be >= {low}, got {v}")


def parse_args(argv: list[str]) -> BenchConfig:
    return load_config(BenchConfig, argv, allow_files=False, prog="bench.py", description=__doc__)


def check_models(models: list[str], args) -> None:
    """Unknown names, and with --data a vocabulary smaller than the dataset's: a one-line UsageError."""
    unknown = [m for m in models if m not in model_names()]
    if unknown:
        raise cli.UsageError(f"unknown model size(s) {', '.join(unknown)}; choose from {', '.join(model_names())}")
    if args.data:
        data_vocab = read_meta(require_dataset(args.data))["vocab_size"]  # or a DataError
        # Token ids past the model's vocabulary would index outside its embedding (a crash mid-benchmark).
        too_small = [f"{m} ({MODELS[base_model(m)][4]})" for m in models if MODELS[base_model(m)][4] < data_vocab]
        if too_small:
            fix = "pick --models=gpt2 or" if data_vocab <= MODELS["gpt2"][4] else "pick"
            raise cli.UsageError(f"--data={args.data} has vocab_size {data_vocab}, more than the vocabulary of "
                                 f"model {', '.join(too_small)}; {fix} a dataset with a matching vocabulary")


def recoverable(error: Exception, args) -> bool:
    """Whether a row's error becomes a failed row (--keep_going) rather than the end of the run: never a
    UserError (a bad dataset, say), which is the run's one-line exit."""
    return args.keep_going and not isinstance(error, cli.UserError)


def decode_rows_of(name: str, rt: Runtime, args) -> Iterator[dict]:
    """bench_decode's rows; with --keep_going a failure outside its rows (building the model) is a failed row."""
    try:
        yield from bench_decode(name, rt, args)
    except Exception as e:
        if not recoverable(e, args):
            raise
        yield failed_row(e, "decode", name, rt, batch_size=None, seq_len=None,
                         compile=resolve_compile(args.compile, rt.device)[0])


def train_rows(name: str, rt: Runtime, args) -> Iterator[dict]:
    """The training rows of one model, a variant at a time."""
    for variant in train_variants(name, rt, args):
        try:
            yield bench_train(name, rt, args, variant)
        except Exception as e:
            if not recoverable(e, args):
                raise
            yield failed_row(e, "train", name, rt, **variant.fields(), accum=args.accum,
                             seq_len=MODELS[base_model(name)][3], compile=resolve_compile(args.compile, rt.device)[0])


@cli.entry_point(oom_hint="use a smaller --batch_size or --models, or --keep_going")
def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    refuse_uncapturable(True in args.cuda_graphs, compile_modes=args.compile_mode)  # before any row runs
    rt = setup_runtime(args.device, args.dtype)  # a DeviceError (a UserError) is the one-line exit
    on_gpu = rt.device_type == "cuda"
    models = args.models or (["baby", "gpt2"] if on_gpu else ["baby"])
    check_models(models, args)
    use_compile, why = resolve_compile(args.compile, rt.device)
    if not use_compile and args.compile_mode != ["default"]:
        raise cli.UsageError(f"--compile_mode={','.join(args.compile_mode)} needs the model compiled, and here "
                             f"{why}; add --compile=True")
    args.warmup = args.warmup if args.warmup is not None else (5 if on_gpu else 1)
    args.repeats = args.repeats if args.repeats is not None else (20 if on_gpu else 3)
    print(f"device {rt.device} ({device_name(rt)}) | {rt.dtype_name} | torch {torch.__version__} | "
          f"{time.strftime('%Y-%m-%d')}", flush=True)
    emit = RowPrinter(args.json, argv if argv is not None else sys.argv[1:])
    for name in models:  # a DataError (--data: e.g. a split too short for the block_size) is a one-line exit
        rows = itertools.chain(train_rows(name, rt, args) if not args.skip_train else (),
                               decode_rows_of(name, rt, args) if not args.skip_decode else ())
        for row in rows:
            emit(row)
    if args.json and not emit.rows:
        emit.write()  # (--compare_windows: no rows, an empty list)
    return emit.rows


if __name__ == "__main__":
    main()
