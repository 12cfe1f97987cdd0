"""How much one training step grows the process: a 1-layer, 128-wide GPT with GPT-2's vocabulary (padded to
50,304), B x 1024 tokens, fp32 on the CPU, one training step as a run takes it (gptkit/step_factory.py's make_step:
forward, backward, clip, AdamW's step). Nearly all of its memory is the head and the loss, so this measures how
the loss is computed.

    python -m benchmarks.loss_memory --batch_size 8            # from the repository root

To measure an older checkout (from before make_step), copy this file there and build its step as that
checkout's train.py does (its forward_backward, then the optimizer step).
Prints the step's loss (equal before and after: the same computation), the process' resident memory before
the step, its peak, their difference, and the step's wall time.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from gptkit import cli
from gptkit.config import TrainConfig
from gptkit.runtime import Dist, setup_runtime
from gptkit.step_factory import OneBatch, make_step
from model import GPT, GPTConfig


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise cli.UserError("no VmRSS in /proc/self/status: this benchmark reads Linux's /proc (Linux only)")


@cli.entry_point()
def main(argv: list[str] | None = None) -> None:
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--steps", type=int, default=1, help="steps to time (the memory is the peak over all)")
    args = p.parse_args(argv)
    rt = setup_runtime("cpu", "float32")
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=1024, vocab_size=50257, n_layer=1, n_head=2, n_embd=128, vocab_multiple=64))
    train_step = make_step(model, TrainConfig(weight_decay=0.1, learning_rate=6e-4, grad_clip=1.0), rt, Dist(),
                           accum=1)
    x = torch.randint(0, 50257, (args.batch_size, 1024))
    y = torch.randint(0, 50257, (args.batch_size, 1024))
    loader = OneBatch((x, y))
    before = rss_mb()
    times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        loss = train_step(step, loader).loss
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux
    print(f"batch {args.batch_size} x 1024: loss {loss.item():.4f} | RSS before {before:,.0f} MB, peak {peak:,.0f} MB, "
          f"grew {peak - before:,.0f} MB | step {sorted(times)[len(times) // 2]:.2f} s")


if __name__ == "__main__":
    main()
