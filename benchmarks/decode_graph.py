"""What the compiled decode step is made of, counted on the CPU (no GPU needed): the operators of the graph
inductor receives (Dynamo's graph after AOT autograd and inductor's decompositions, as aten calls) and, with
--kernels, the kernels inductor generates for it (fused kernels plus calls of library kernels: matmuls,
attention). Launch-bound on a GPU, a decode step costs about one launch per kernel; a CUDA graph replays them
all with one launch, but each still runs, a few microseconds apiece.

    python benchmarks/decode_graph.py                    # operators: sample.py's step, the engine's step
    python benchmarks/decode_graph.py --kernels          # and inductor's kernels (C++ on the CPU: minutes)
    python benchmarks/decode_graph.py --kernels --device=cuda --dtype=bfloat16   # Triton's on a GPU

Each count is taken for GPT-2 small's width and vocabulary at 1 and 2 layers (random weights, float32): the
difference is one block's share, and the table extrapolates to GPT-2's 12 layers, fixed + 12 x per block.
The steps: generate.decode_step at batch 1 over the whole static cache (sample.py's), greedy, top-k (200,
sample.py's default, temperature 0.8), top-k+top-p (and top-p 0.95), top-p (0.95 alone); and engine: the
engine's decode_all_rows over 4 rows and 256 slots (its logits; the engine draws outside the graph).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the scripts and gptkit

from gptkit import cli  # noqa: E402
from gptkit.errors import UserError

OPTIONS = {  # step name -> SamplingOptions keywords (None: the engine's step, 4 rows x 256 slots: logits only)
    "greedy": dict(temperature=0),
    "top-k": dict(temperature=0.8, top_k=200),
    "top-k+top-p": dict(temperature=0.8, top_k=200, top_p=0.95),
    "top-p": dict(temperature=0.8, top_p=0.95),
    "engine": None,
}


def step_and_inputs(name: str, n_layer: int, device: str = "cpu", dtype: str = "float32"):
    """The function to compile and its arguments, for a fresh GPT-2-wide model of n_layer blocks."""
    import torch

    from gptkit.generate import SamplingOptions, decode_step
    from gptkit.serving.engine import decode_all_rows
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=n_layer, vocab_multiple=64)).eval().to(device, getattr(torch, dtype))
    options = OPTIONS[name]
    if options is None:
        model.setup_kv_cache(4)
        tokens, pos = torch.zeros(4, 1, dtype=torch.long, device=device), torch.tensor([[5], [9], [0], [0]],
                                                                                       device=device)
        if "length" not in inspect.signature(decode_all_rows).parameters:  # (the code before buckets: all rows
            model.setup_kv_cache(4)                                          # and slots; for the comparison)
            return decode_all_rows, (model, tokens, pos)
        return decode_all_rows, (model, tokens, pos, 256)
    model.setup_kv_cache(1)
    options = SamplingOptions(**options)
    noise = None if options.temperature == 0 else torch.rand(1, model.config.vocab_size, device=device) + 0.1
    token, pos = torch.zeros(1, 1, dtype=torch.long, device=device), torch.tensor([7], device=device)
    return decode_step, (model, token, pos, options, noise)


# Operators that only make views (no kernel, no memory traffic): left out of the counts.
VIEWS = {"view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand", "alias", "slice", "select",
         "split", "unsqueeze", "squeeze", "as_strided"}


def count_operators(name: str, n_layer: int, device: str, dtype: str) -> collections.Counter:
    """The aten operators of the graph inductor receives (after functionalisation and its decompositions), views
    left out."""
    import torch
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    counts: collections.Counter = collections.Counter()

    def count(gm, example_inputs):
        for node in gm.graph.nodes:
            op = str(node.target).removeprefix("aten.")
            if node.op == "call_function" and "getitem" not in op and op.split(".")[0] not in VIEWS:
                counts[op] += 1
        return gm.forward

    torch._dynamo.reset()
    fn, args = step_and_inputs(name, n_layer, device, dtype)
    compiled = torch.compile(fn, backend=aot_autograd(fw_compiler=count, decompositions=select_decomp_table()),
                             fullgraph=True, dynamic=False)
    with torch.inference_mode():
        compiled(*args)
    return counts


def count_kernels(name: str, n_layer: int, device: str, dtype: str) -> int:
    """The kernels inductor's code for the step runs: its fused kernels (C++ or Triton) and the library
    calls."""
    import torch
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    fn, args = step_and_inputs(name, n_layer, device, dtype)
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        _, code = run_and_get_code(compiled, *args)
    source = "\n".join(code)
    body = source[source.index("def call("):]
    body = body[: body.index("\n\n\n")] if "\n\n\n" in body else body
    launch = r"^\s+(?:cpp_fused_\w+|\w+\.run|extern_kernels\.\w+|torch\.ops\.\w+\.\w+(?:\.\w+)?)\("
    return len(re.findall(launch, body, re.MULTILINE))


@cli.entry_point()
def main(argv: list[str] | None = None) -> None:
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", action="store_true", help="also compile with inductor and count its kernels")
    p.add_argument("--steps", default=",".join(OPTIONS), help="comma-separated step names (see above)")
    p.add_argument("--device", default="cpu", help="where to compile: cpu or cuda (Triton's kernels)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the weights' dtype")
    p.add_argument("--show", action="store_true", help="print each step's operators by kind: the fixed ones and "
                   "one block's")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.steps.split(",")]
    unknown = [n for n in names if n not in OPTIONS]
    if unknown:
        raise UserError(f"--steps: unknown {', '.join(unknown)}; choose from {', '.join(OPTIONS)}")
    print("| step | aten ops: fixed + per block | GPT-2 (12 blocks) |" + (" kernels: fixed + per block | GPT-2 |"
                                                                       if args.kernels else ""))
    print("|---|--:|--:|" + ("--:|--:|" if args.kernels else ""))
    for name in names:
        one, two = (count_operators(name, n, args.device, args.dtype) for n in (1, 2))
        block = sum(two.values()) - sum(one.values())
        fixed = sum(one.values()) - block
        line = f"| {name} | {fixed} + {block} | {fixed + 12 * block} |"
        if args.kernels:
            k1, k2 = (count_kernels(name, n, args.device, args.dtype) for n in (1, 2))
            line += f" {2 * k1 - k2} + {k2 - k1} | {2 * k1 - k2 + 12 * (k2 - k1)} |"
        print(line, flush=True)
        if args.show:
            per_block = two - one
            print("    fixed: " + ", ".join(f"{op} {n}" for op, n in sorted((one - per_block).items())))
            print("    per block: " + ", ".join(f"{op} {n}" for op, n in sorted(per_block.items())), flush=True)


if __name__ == "__main__":
    main()
