"""What a decode window costs to compile: the first generation's seconds (compiling and, on a GPU, recording
the window's CUDA graph) for windows of K tokens, each K in a fresh process with an empty inductor cache, so
that no K reuses another's compiled code.

    python benchmarks/window_compile.py                       # CPU, a 2-layer 64-wide model, K = 1, 8, 16
    python benchmarks/window_compile.py --device=cuda --model=gpt2 --windows=1,16,32

A window records K calls of one compiled step (gptkit/generate.py's CapturedWindow): its compile time should
be one step's whatever K, where a function of K unrolled steps took K times longer to compile.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a file: gptkit from this checkout

from gptkit import cli  # noqa: E402
from gptkit.errors import UsageError  # noqa: E402

MODELS = {"small": dict(block_size=128, vocab_size=256, n_layer=2, n_head=2, n_embd=64),
          "gpt2": dict(block_size=1024, vocab_size=50257, n_layer=12, n_head=12, n_embd=768)}


def first_generation(device: str, model: str, window: int) -> float:
    """In this process: the seconds of the first compiled generation of window + 2 greedy tokens."""
    import torch

    from gptkit.generate import SamplingOptions, compile_decode_step, generate
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    gpt = GPT(GPTConfig(**MODELS[model])).to(device).eval()
    prompt = torch.randint(0, gpt.config.vocab_size, (1, 4), device=device)
    step = compile_decode_step(torch.device(device))
    began = time.perf_counter()
    generate(gpt, prompt, window + 2, SamplingOptions(temperature=0), step_fn=step, window=window)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - began


def parse_args(argv: list[str] | None):
    parser = cli.ArgumentParser(prog="benchmarks/window_compile.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--model", default="small", choices=sorted(MODELS), help="the model's shape")
    parser.add_argument("--windows", default="1,8,16", help="the windows' sizes K, a comma list")
    parser.add_argument("--one", type=int, default=0, help="measure this one K in this process (what each of the "
                                                           "fresh processes runs)")
    return parser.parse_args(argv)


@cli.entry_point()
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.one:
        print(f"{first_generation(args.device, args.model, args.one):.2f}")
        return
    try:
        windows = [int(k) for k in args.windows.split(",")]
    except ValueError:
        raise UsageError(f"--windows must be a comma list of integers, got {args.windows!r}") from None
    print(f"| K | first generation, s ({args.model}, {args.device}) |\n|---:|---:|")
    for k in windows:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
            out = subprocess.run([sys.executable, __file__, f"--device={args.device}", f"--model={args.model}",
                                  f"--one={k}"], env=env, capture_output=True, text=True, check=True)
        print(f"| {k} | {float(out.stdout.split()[-1]):.1f} |", flush=True)


if __name__ == "__main__":
    main()
