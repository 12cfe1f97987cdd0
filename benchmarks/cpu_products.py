"""The packed products of gptkit/cpu_decode.py against torch's, by number of activation rows: GPT-2 small's
four matrices and its head, random weights, the kernels this CPU runs. Prints a markdown table: the kernel's
time, torch's (F.linear on the float32 weight; for int8, on the weight widened to float32 each call, as a
packed layer would have to without its kernel), their ratio, and the kernel's GFLOP/s. What FLOAT32_KERNEL_ROWS
and int8's "any number of rows" were chosen from.

    python benchmarks/cpu_products.py                         # float32 and int8, 1 to 352 rows
    python benchmarks/cpu_products.py --formats float32 --rows 4,16,64,96 --threads 2
    python benchmarks/cpu_products.py --formats int8,q4_0 --rows 1,2,3,4,8,16 --threads 2

Rows: 1 (batch-1 decoding), 4 and 16 (serve.py's batches), 22 to 352 (prompts' prefills: 16 prompts of 22
tokens are 352 rows). float32 above FLOAT32_KERNEL_ROWS (64) rows: the kernel library itself hands the
product to torch's, so both columns time the same product there. The weights are the same every call, so the smaller matrices are read from the CPU's
caches, not from memory: this compares the arithmetic; a whole model's decode step (500 MB in float32) is
what benchmarks/cpu_decode.py measures.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: gptkit is in the checkout

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gptkit import cli, cpu_decode  # noqa: E402
from gptkit.errors import UserError
from gptkit.threads import choose_threads  # noqa: E402

SHAPES = ((2304, 768, "attn.c_attn"), (768, 768, "attn.c_proj"), (3072, 768, "mlp.c_fc"), (768, 3072, "mlp.c_proj"),
          (50257, 768, "head"))


def widened(x: torch.Tensor, layer: cpu_decode.PackedLinear) -> torch.Tensor:
    """int8 (q4_0) without its kernel: the weight widened to float32, then torch's product."""
    return F.linear(x, layer.dense_weight(), layer.bias)


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


@cli.entry_point()
def main(argv: list[str] | None = None) -> None:
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default="float32,int8", help="comma-separated: float32, int8, q4_0")
    p.add_argument("--rows", default="1,4,8,16,22,64,96,352", help="comma-separated numbers of activation rows")
    p.add_argument("--threads", type=int, default=0, help="torch's threads (0: gptkit.threads.choose_threads())")
    p.add_argument("--repeats", type=int, default=15, help="timed calls per figure (the median is shown)")
    args = p.parse_args(argv)
    formats = args.formats.split(",")
    if not set(formats) <= {"float32", "int8", "q4_0"}:
        raise UserError(f"--formats {args.formats!r}: float32, int8, q4_0, or several of them")
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        raise UserError(f"--rows {args.rows!r}: comma-separated integers, e.g. 1,4,16") from None
    if min(rows) < 1 or args.repeats < 1 or args.threads < 0:
        raise UserError("--rows and --repeats must be positive, --threads at least 0")
    kernels = cpu_decode.kernels()
    if kernels is None:
        raise UserError("the CPU kernels cannot run here (see python -m gptkit.cpu_decode --build)")
    torch.set_num_threads(args.threads or choose_threads()[0])
    print(f"cpu_products: {cpu_decode.kernels_status()}, {torch.get_num_threads()} threads; ms per product "
          f"(median of {args.repeats})")
    print("| format | matrix (out x in) | rows | kernel ms | torch ms | torch / kernel | kernel GFLOP/s |")
    print("|---|---|--:|--:|--:|--:|--:|")
    g = torch.Generator().manual_seed(0)
    for fmt in formats:
        for n, k, name in SHAPES:
            layer = cpu_decode.PackedLinear(torch.randn(n, k, generator=g) * 0.02, torch.randn(n, generator=g), fmt)
            for m in rows:
                x = torch.randn(m, k, generator=g)
                if fmt == "float32":
                    kernel = functools.partial(kernels.linear_f32, x, layer.weight, layer.bias)
                    reference = functools.partial(F.linear, x, layer.weight, layer.bias)
                else:
                    op = kernels.linear_q4 if fmt == "q4_0" else kernels.linear_q8
                    kernel = functools.partial(op, x, layer.weight, layer.scale, layer.bias, n)
                    reference = functools.partial(widened, x, layer)
                repeats = max(3, args.repeats // 3) if n * m > 1_000_000 else args.repeats
                ours, theirs = median_ms(kernel, repeats), median_ms(reference, repeats)
                print(f"| {fmt} | {name} {n} x {k} | {m} | {ours:.3f} | {theirs:.3f} | {theirs / ours:.2f}x | "
                      f"{2 * m * n * k / ours / 1e6:.0f} |", flush=True)


if __name__ == "__main__":
    main()
