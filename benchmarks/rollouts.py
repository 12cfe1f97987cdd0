"""GRPO's rollouts and step: what a user needs to plan a run. Rollout tokens/s drawn by the serving engine
(gptkit/objectives/grpo_rollouts.py: every reply of the step decoded together, a prompt's n replies prefilled
once) against a plain loop of one-reply-at-a-time `generate` calls at the same n, then a whole GRPO step (rollouts, rewards,
forward and backward on the rollouts, the optimizer step): its time and the peak memory.

    python -m benchmarks.rollouts                                  # a 6-layer 256-wide model, 16 prompts x 8
    python -m benchmarks.rollouts --shape tiny --rounds 1          # a check that it runs, in seconds
    python -m benchmarks.rollouts --device cuda --shape gpt2

The model has random weights and tasks/arithmetic.py's characters as its vocabulary, its prompts are the
task's; random weights rarely draw the newline that ends a reply, so replies run to --max_tokens on both
sides alike (each side's tokens are counted as drawn, stops included). Both sides draw at temperature 1 with
their own seeded streams. The rows run interleaved over --rounds (benchmarks/rounds.py): each cell is the
median with its range, the ratio computed round by round. Peak memory: on CUDA the allocator's peak during
the step; on the CPU the process' peak resident set so far (the OS's count: it includes the model's load).
"""

from __future__ import annotations

import resource
import sys
import time

import torch

from benchmarks.rounds import cell, interleave, ratio_cell
from gptkit import cli
from gptkit.checker import load_checker, load_task
from gptkit.generate import SamplingOptions, generate
from gptkit.objectives.grpo_loss import GRPOObjective, GRPOSettings
from gptkit.objectives.grpo_rollouts import RolloutLoader, draw
from gptkit.tokenizer import Tokenizer
from model import GPT, GPTConfig

SHAPES = {"tiny": (2, 2, 64), "small": (6, 4, 256), "gpt2": (12, 12, 768)}  # n_layer, n_head, n_embd
TASK = "tasks/arithmetic.py"


def parse(argv):
    p = cli.ArgumentParser(prog="python -m benchmarks.rollouts", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=SHAPES, default="small")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="replies per prompt")
    p.add_argument("--max_tokens", type=int, default=16, help="the most tokens of a reply")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch's CPU threads (0: torch's default)")
    return p.parse_args(argv)


def engine_rate(model, prompts, args, stop) -> float:
    began = time.perf_counter()
    replies, stopped = draw(model, prompts, args.n, max_tokens=args.max_tokens,
                            sampling=SamplingOptions(temperature=1.0), stop_ids=frozenset({stop}),
                            generator=torch.Generator().manual_seed(0), max_batch=len(prompts) * args.n)
    seconds = time.perf_counter() - began
    tokens = sum(len(r) + s for group, ends in zip(replies, stopped) for r, s in zip(group, ends))
    return tokens / seconds


def plain_rate(model, prompts, args, stop) -> float:
    options = SamplingOptions(temperature=1.0, stop_token=stop)
    g = torch.Generator(device=args.device).manual_seed(0)
    tokens, began = 0, time.perf_counter()
    for p in prompts:
        idx = torch.tensor([p], device=args.device)
        for _ in range(args.n):
            out = generate(model, idx, args.max_tokens, options, generator=g)[0, len(p):].tolist()
            tokens += out.index(stop) + 1 if stop in out else len(out)
    return tokens / (time.perf_counter() - began)


def step_time(model, args, tokenizer, stop) -> tuple[float, float, float]:
    """(seconds of one GRPO step, of it the rollouts' seconds, peak memory in MB)."""
    loader = RolloutLoader(model, load_task(TASK), load_checker(TASK), tokenizer, n=args.n,
                           batch_size=args.prompts * args.n, accum=1, max_tokens=args.max_tokens,
                           sampling=SamplingOptions(temperature=1.0), stop_ids=frozenset({stop}), seed=0,
                           device=args.device, max_batch=args.prompts * args.n)
    objective = GRPOObjective(GRPOSettings(n=args.n))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    loss, _ = objective(model, loader.next_batch())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return time.perf_counter() - began, loader.last["rollout_s"], peak


@cli.entry_point()
def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = Tokenizer.char_from_text("0123456789+=\n")
    stop = tokenizer.encode("\n")[0]
    layers, heads, width = SHAPES[args.shape]
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=tokenizer.vocab_size, n_layer=layers, n_head=heads,
                          n_embd=width, dropout=0.0)).to(args.device)
    stream = load_task(TASK).prompts("train", 0)
    prompts = [tokenizer.encode(next(stream)) for _ in range(args.prompts)]
    engine_rate(model, prompts[:2], args, stop)  # (warm-up: first calls allocate)
    rates: dict[str, list[float]] = {"engine": [], "plain": []}
    steps: list[tuple[float, float, float]] = []
    for _, name in interleave(["engine", "plain", "step"], args.rounds):
        if name == "step":
            steps.append(step_time(model, args, tokenizer, stop))
        else:
            rates[name].append((engine_rate if name == "engine" else plain_rate)(model, prompts, args, stop))
    print(f"GRPO rollouts: {args.shape} model ({layers}x{width}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
          f"parameters) on {args.device}, {torch.get_num_threads()} threads; {args.prompts} prompts x n={args.n}, "
          f"replies up to {args.max_tokens} tokens; {args.rounds} rounds, median (range)")
    print(f"| rollouts | tokens/s |\n|---|---|\n| engine (all {args.prompts * args.n} replies together) | "
          f"{cell(rates['engine'])} |\n| plain generate, one reply at a time | {cell(rates['plain'])} |\n"
          f"| engine / plain | {ratio_cell(rates['engine'], rates['plain'])} |")
    print(f"| GRPO step | seconds | of it rollouts | peak memory MB |\n|---|---|---|---|\n"
          f"| {args.prompts} x {args.n} rollouts, one update | {cell([s[0] for s in steps], 3)} | "
          f"{cell([s[1] for s in steps], 3)} | {cell([s[2] for s in steps], 0)} |")
    sys.stdout.flush()
    return {"engine": rates["engine"], "plain": rates["plain"], "steps": steps}


if __name__ == "__main__":
    main()
