"""The plan's peak memory (gptkit/plan/__init__.py, what `train.py --plan` prints) against the measured one.

    python -m benchmarks.plan_memory                     # CPU: the five shapes of issue 24 (a few minutes)
    python -m benchmarks.plan_memory --shapes=char,lora  # some of them
    python -m benchmarks.plan_memory --device=cuda       # GPU: GPT-2 124M at micro-batches 8, 16, 32 (bf16)
    python -m benchmarks.plan_memory --device=cuda --compile=True --batches=8,16,32,64

Each shape runs in a fresh subprocess: the run's own step (built as train.py builds it: gptkit/step_factory.py's
make_step) three times on random tokens, the first to create the optimizer states. Measured on the CPU, for the second
(steady-state) step:
  allocator: the peak of the live tensors, from torch's profiler (its memory timeline records every
    allocation and free of torch's CPU allocator) plus the weights and optimizer states that exist already:
    the figure the plan predicts;
  RSS: the process' peak resident memory during the step (VmHWM, reset just before it through
    /proc/self/clear_refs) less its resident memory before the model was built (Python and torch's libraries,
    warmed up on a tiny model first): what the machine actually gives, allocator overhead and all. Twice:
    with glibc's mmap threshold fixed at its 128 KiB default (MALLOC_MMAP_THRESHOLD_=131072), so that every
    tensor above it is returned to the system when freed, and with glibc as it comes, whose threshold grows
    (up to 32 MiB) as large blocks are freed, after which freed tensors stay in its heap, resident, for reuse:
    the difference is memory the process holds but does not use (up to 2x the step's in the LoRA shape).
On CUDA: torch.cuda.max_memory_allocated over the second step (reset before it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from gptkit import cli

ROOT = Path(__file__).resolve().parents[1]
GPT2_VOCAB = dict(vocab_size=50257, vocab_multiple=64)
# name -> (GPTConfig options, micro-batch, optimizer, LoRA rank, activation checkpointing)
SHAPES = {
    # configs/shakespeare.py's baby GPT: characters (the plain loss), its dropout 0.2 (CPU: the math attention)
    "char": (dict(vocab_size=65, n_layer=6, n_head=6, n_embd=384, block_size=256, dropout=0.2, bias=False), 16,
             "adamw", 0, False),
    # GPT-2's vocabulary: the loss computed a slice at a time
    "vocab": (dict(**GPT2_VOCAB, n_layer=6, n_head=6, n_embd=384, block_size=1024), 4, "adamw", 0, False),
    "vocab+ckpt": (dict(**GPT2_VOCAB, n_layer=6, n_head=6, n_embd=384, block_size=1024), 4, "adamw", 0, True),
    # configs/finetune_shakespeare_lora.py's run on GPT-2 124M's shape (random weights: memory does not care)
    "lora": (dict(**GPT2_VOCAB, n_layer=12, n_head=12, n_embd=768, block_size=1024), 2, "adamw", 8, True),
    # the modern recipe: RoPE, RMSNorm, QK-norm, ReLU², untied head, soft-capped logits; Muon + AdamW
    "modern": (dict(**GPT2_VOCAB, n_layer=6, n_head=8, n_embd=512, block_size=1024, arch="modern"), 2, "muon", 0,
               False),
}
GPT2_124M = dict(**GPT2_VOCAB, n_layer=12, n_head=12, n_embd=768, block_size=1024)


def status_kb(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def build(options: dict, rank: int, checkpointing: bool, device: str):
    from gptkit import lora
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**options))
    if rank:  # train.py's LoRA run: the base frozen, adapters on the four projections, lora_dropout 0.05
        lora.apply(model, lora.LoRASettings(rank=rank, alpha=16.0, dropout=0.05))
    model.activation_checkpointing = checkpointing
    return model.to(device).train()


def child(args) -> dict:
    """One shape in this (fresh) process; returns the plan's figures and the measured ones, in bytes."""
    from gptkit import lora, plan
    from gptkit.config import TrainConfig
    from gptkit.runtime import Dist, setup_runtime
    from gptkit.step_factory import OneBatch, make_step

    if args.device == "cuda":
        options, batch, optimizer, rank, checkpointing = GPT2_124M, args.batch, "adamw", 0, False
    else:
        options, batch, optimizer, rank, checkpointing = SHAPES[args.child]
    rt = setup_runtime(args.device, "auto")
    cpu = rt.device_type == "cpu"
    if cpu:  # load torch's kernels (and their libraries' pages) on a tiny model first, so that they are baseline
        warm = build(dict(vocab_size=65, n_layer=1, n_head=2, n_embd=32, block_size=16), 0, False, "cpu")
        make_step(warm, TrainConfig(), rt, Dist(), accum=1)(0, OneBatch((torch.zeros(2, 16, dtype=torch.long),) * 2))
        del warm
    base_rss = status_kb("VmRSS") * 1024 if cpu else 0
    model = build(options, rank, checkpointing, rt.device)
    if rank and rt.device_type == "cuda" and rt.dtype == torch.bfloat16:
        lora.cast_frozen_base(model, torch.bfloat16)  # as train.py does
    train_step = make_step(torch.compile(model) if args.compile else model, TrainConfig(optimizer=optimizer), rt,
                           Dist(), accum=1, raw_model=model)
    g = torch.Generator().manual_seed(0)
    T, V = options["block_size"], options["vocab_size"]
    loader = OneBatch(tuple(torch.randint(0, V, (batch, T), generator=g).to(rt.device) for _ in range(2)))
    steps = iter(range(3))

    def step():
        train_step(next(steps), loader)

    t0 = time.perf_counter()
    step()  # creates the optimizer states (and compiles)
    result = {"shape": args.child or f"gpt2 124M b{batch}", "batch": batch, "first_step_s": time.perf_counter() - t0}
    setup = plan.Setup(rt.device_type, rt.dtype, T, optimizer, compile=args.compile, checkpointing=checkpointing)
    mem = plan.memory(model, setup, batch)
    result.update(plan=mem.peak, weights=mem.weights, optimizer=mem.optimizer)
    if not cpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        result["allocator"] = torch.cuda.max_memory_allocated()
        return result
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak resident set size, to the current one
    step()
    result["rss"] = status_kb("VmHWM") * 1024 - base_rss
    # the allocator's timeline: torch.profiler's private memory profile (torch 2.x); tests/test_plan.py too
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler import _memory_profiler as mp

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as p:
        step()
    live = peak = 0
    for _, action, _, size in p._memory_profile().timeline:
        live += size if action == mp.Action.CREATE else -size if action == mp.Action.DESTROY else 0
        peak = max(peak, live)
    result["allocator"] = mem.weights + mem.optimizer + peak  # what existed before the step, and its peak
    return result


@cli.entry_point()
def main(argv: list[str] | None = None) -> None:
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--shapes", default=",".join(SHAPES), help="CPU: comma-separated names of SHAPES")
    p.add_argument("--batches", default="8,16,32", help="CUDA: GPT-2 124M's micro-batches")
    p.add_argument("--compile", default="False", choices=("True", "False"))
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.compile = args.compile == "True"
    if args.child or args.batch:
        print(json.dumps(child(args)))
        return
    runs = ([["--child", name] for name in args.shapes.split(",")] if args.device == "cpu"
            else [["--batch", b] for b in args.batches.split(",")])
    cpu = args.device == "cpu"
    print(f"{'shape':<16}{'batch':>6}{'plan peak':>12}{'allocator':>12}{'plan/alloc':>11}"
          + (f"{'RSS':>12}{'plan/RSS':>10}{'RSS, glibc':>12}{'plan/RSS':>10}" if cpu else "")
          + f"{'step 1 s':>10}", flush=True)
    for extra in runs:
        results = []
        for env in ({"MALLOC_MMAP_THRESHOLD_": "131072"}, {}) if cpu else ({},):
            done = subprocess.run([sys.executable, "-m", "benchmarks.plan_memory", f"--device={args.device}",
                                   f"--compile={args.compile}", *extra], cwd=ROOT, capture_output=True, text=True,
                                  env={**os.environ, **env})
            if done.returncode:
                print(f"{extra[-1]}: failed\n{done.stderr[-2000:]}", flush=True)
                break
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        else:
            r = results[0]
            line = (f"{r['shape']:<16}{r['batch']:>6}{mib(r['plan']):>12}{mib(r['allocator']):>12}"
                    f"{r['plan'] / r['allocator'] - 1:>+10.1%} ")
            for other in results if cpu else ():
                line += f"{mib(other['rss']):>12}{r['plan'] / other['rss'] - 1:>+9.1%} "
            print(line + f"{r['first_step_s']:>9.1f}", flush=True)


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


if __name__ == "__main__":
    main()
