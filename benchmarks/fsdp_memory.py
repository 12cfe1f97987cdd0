"""Per-process memory of the parameters, gradients and optimizer states under FSDP, measured against the plan.

    python -m benchmarks.fsdp_memory                                    # 1, 2 and 4 processes on the CPU (gloo)
    python -m benchmarks.fsdp_memory --ranks=1,2 --shape=tiny --json=out.json

For each number of processes N, a job of N processes (torchrun, or this process alone for N = 1) builds the
shape, wraps it as train.py does (gptkit/parallel.py: FSDP for N > 1), takes one training step on random tokens
(the run's step, gptkit/step_factory.py's make_step: forward, backward, clip, AdamW's step, whose states then
exist) and counts, on every process, the bytes of the tensors it holds: its shards of the parameters, of the
gradients (as they are when the optimizer steps: the step frees them after) and of the optimizer states
(parallel.local_bytes).
Beside them: the plan's figures for the same setup (gptkit/plan/__init__.py's memory: weights, gradients, optimizer)
and the largest FSDP unit's parameters gathered whole (what a process holds on top, while that unit runs).
The bound tests/test_fsdp.py checks: every process holds at most 1/N of one process' bytes plus that unit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file (and as torchrun's workers): this checkout's gptkit, not an installed one

from gptkit import cli  # noqa: E402

# name -> GPTConfig options: "tiny" for the tests, "small" for BENCHMARKS.md (a baby GPT with GPT-2's vocabulary)
SHAPES = {
    "tiny": dict(vocab_size=67, n_layer=2, n_head=2, n_embd=32, block_size=32, dropout=0.0),
    "small": dict(vocab_size=50257, vocab_multiple=64, n_layer=6, n_head=6, n_embd=384, block_size=256,
                  dropout=0.0),
}
BATCH = 2


def measure(shape: str) -> dict:
    """In this process of a job (or alone): one FSDP-wrapped training step, and what this process holds."""
    sys.path.insert(0, str(ROOT))
    from gptkit import parallel, plan
    from gptkit.config import TrainConfig
    from gptkit.runtime import distributed
    from gptkit.step_factory import OneBatch, make_step
    from model import GPT, GPTConfig

    options = SHAPES[shape]
    cfg = TrainConfig(parallel="fsdp", block_size=options["block_size"], batch_size=BATCH,
                      gradient_accumulation_steps=int(os.environ.get("WORLD_SIZE", 1)), compile=False)
    with distributed("cpu", "float32") as (d, rt):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**options))
        units = [sum(p.numel() * p.element_size() for p in unit) for unit in plan.fsdp_units(model)]
        setup = plan.Setup("cpu", torch.float32, options["block_size"], world_size=d.world_size,
                           parallel="fsdp" if d.enabled else "ddp")
        planned = plan.memory(model, setup, BATCH)
        wrapped = parallel.wrap(model, plan.decide_parallel(model, cfg, d, rt, False)[0], rt, use_compile=False)
        train_step = make_step(wrapped, cfg, rt, d, accum=1, raw_model=model)
        optimizer, grads = train_step.optimizer, []
        update = optimizer.step

        def step(*args, **kwargs):  # the gradients' bytes as the optimizer steps (freed after the step)
            grads.append(parallel.local_bytes(model, optimizer)["grads"])
            return update(*args, **kwargs)

        optimizer.step = step
        x = torch.randint(options["vocab_size"], (BATCH, options["block_size"]))
        train_step(0, OneBatch((x, x)))
        held = {**parallel.local_bytes(model, optimizer), "grads": grads[0]}
        everyone = [held]
        if d.enabled:
            everyone = [None] * d.world_size
            torch.distributed.all_gather_object(everyone, held)
    return {"world_size": d.world_size, "ranks": everyone, "largest_unit": max(units),
            "plan": {"params": planned.weights, "grads": planned.gradients, "optimizer": planned.optimizer}}


def run(world_size: int, shape: str) -> dict:
    """measure() in a job of world_size processes; rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        job = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}"]
               if world_size > 1 else [sys.executable])
        env = dict(os.environ, OMP_NUM_THREADS="1")
        done = subprocess.run([*job, __file__, "--worker", "--shape", shape, "--result", str(out)], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"the {world_size}-process job failed:\n{done.stdout}\n{done.stderr}")
        return json.loads(out.read_text())


def table(results: list[dict]) -> str:
    mb = lambda n: f"{n / 2**20:.2f}"  # noqa: E731
    lines = ["| processes | params (MiB) | grads | optimizer | total per process | plan's total | 1/N of one "
             "process + largest unit |", "|---|---|---|---|---|---|---|"]
    single = sum(results[0]["ranks"][0].values())
    for r in results:
        n, worst = r["world_size"], max(sum(x.values()) for x in r["ranks"])
        one = max(r["ranks"], key=lambda x: sum(x.values()))
        lines.append(f"| {n} | {mb(one['params'])} | {mb(one['grads'])} | {mb(one['optimizer'])} | {mb(worst)} | "
                     f"{mb(sum(r['plan'].values()))} | {mb(single / n + (r['largest_unit'] if n > 1 else 0))} |")
    return "\n".join(lines)


@cli.entry_point()
def main(argv: list[str] | None = None) -> None:
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1,2,4", help="the job sizes to measure, comma-separated")
    parser.add_argument("--shape", default="small", choices=sorted(SHAPES))
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        result = measure(args.shape)
        if int(os.environ.get("RANK", 0)) == 0:
            Path(args.result).write_text(json.dumps(result))
        return
    results = [run(int(n), args.shape) for n in args.ranks.split(",")]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
