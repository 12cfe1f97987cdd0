"""This checkout's CPU decoding kernels against another checkout's (main's, say), both in one process and timed
interleaved, so that a shared machine's noise falls on both alike: int8 and q4_0 (its head in q8_0, and in q6_k:
pack_for_cpu's q4_head), batch 1, GPT-2 small's shape, random weights. Prints two markdown tables.

    git worktree add /tmp/main main                     # the kernels to compare against
    python benchmarks/kernels_ab.py --baseline /tmp/main --threads 1
    python benchmarks/kernels_ab.py --threads 2         # this checkout alone: q4_0 (both heads) against int8

1. A decode step's products: the 48 block matrices of 12 layers (768 x 2304, 768 x 768, 768 x 3072, 3072 x 768,
   each layer's its own weights) and the head (50,257 x 768: int8's own format for int8, q8_0 or q6_k for
   q4_0), one activation row, called in a decode step's order: about 139 MB (int8), 89 MB (q4_0, head q8_0)
   and 80 MB (q4_0, head q6_k) a step, read from memory as a token reads them. The steps of every (kernels,
   format) pair run in turn, --steps times each; each cell is the 10th percentile and the median of its
   steps, MB the step's bytes (weights and scales, as that side stores them) and GB/s those over the 10th
   percentile, and each ratio is taken step by step (neighbours in time) and shown as its 10th, 50th and
   90th percentiles.
2. Whole decodes: the packed model (pack_for_cpu) decoding --tokens greedy tokens through generate_stream, as
   sample.py does, --rounds interleaved rounds (benchmarks/rounds.py): tokens/s, median (range).

The baseline: its gptkit/csrc sources, the operators' namespaces renamed (gptkit_base_avx512, ...), compiled once
by the same build function (gptkit.cpu_decode.build_library) and loaded beside this checkout's. It is given the
weights in the layout pack_for_cpu made before float16 scales and the huge-page arena (main's on 2026-11-28):
the same values, the scales as float32, each tensor in huge pages only where it is 2 MiB or more (base_layout);
this checkout's side reads them as pack_for_cpu lays them out now. --variant picks the instruction set (default:
the best this CPU runs). A baseline without the q6_k kernel (before it) times the formats it has.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: gptkit is in the checkout

import torch  # noqa: E402

from benchmarks.rounds import cell, interleave, ratio_cell  # noqa: E402
from gptkit import cli, cpu_decode  # noqa: E402
from gptkit.errors import UserError  # noqa: E402
from gptkit.generate import SamplingOptions, generate_stream  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

SHAPES = ((2304, 768), (768, 768), (3072, 768), (768, 3072))  # a GPT-2 small layer's matrices (out, in)
VOCAB = 50257
# The formats compared: (the blocks' format, the head's), by the name the tables give them; the first is the one
# the others' speed is compared with.
FORMATS = {"int8": ("int8", "int8"), "q4_0 (head q8_0)": ("q4_0", "q8_0"), "q4_0 (head q6_k)": ("q4_0", "q6_k")}
OPS = {"q4_0": "linear_q4", "q6_k": "linear_q6k"}  # each packed format's operator (else linear_q8)


def build_baseline(checkout: Path) -> str:
    """Compile `checkout`'s kernels under the namespace prefix gptkit_base (once per machine: cached like ours),
    load them, and return the prefix."""
    csrc = checkout / "gptkit" / "csrc"
    if not (csrc / "kernels.h").is_file():
        raise UserError(f"--baseline {checkout}: no gptkit/csrc/kernels.h there; give a checkout of this project")
    folder = Path(tempfile.mkdtemp(prefix="kernels_ab_"))
    for name in cpu_decode.SOURCES:
        text = (csrc / name).read_text()
        (folder / name).write_text(text.replace("gptkit_avx", "gptkit_base_avx"))
    library = cpu_decode.build_library("gptkit_base_decode", [folder / s for s in cpu_decode.SOURCES],
                                       cpu_decode.CFLAGS)
    torch.ops.load_library(str(library))
    return "base"


class Side:
    """One set of kernels, this checkout's ("new") or the baseline's ("base"): torch.ops.gptkit_[base_]<variant>."""

    def __init__(self, name: str, variant: str):
        self.name, self.variant = name, variant
        self.ops = getattr(torch.ops, f"gptkit_{variant}" if name == "new" else f"gptkit_{name}_{variant}")
        self.active = variant if name == "new" else f"{name}_{variant}"  # cpu_decode's name for it
        # the formats whose operators these kernels have (a baseline from before q6_k has no linear_q6k)
        self.formats = [f for f, (_, head) in FORMATS.items() if hasattr(self.ops, OPS.get(head, "linear_q8"))]

    @contextmanager
    def in_use(self):
        """The packed layers call these kernels meanwhile (cpu_decode.kernels() gives them)."""
        saved = cpu_decode._active, cpu_decode._status
        cpu_decode._active = self.active
        try:
            yield
        finally:
            cpu_decode._active, cpu_decode._status = saved


def quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[round(q * (len(values) - 1))]


def base_layout(layers: list) -> None:
    """In place: float32 scales (q6_k's stay float16) and every tensor copied out of any shared arena, into huge
    pages only where it is 2 MiB or more by itself (huge_page_copy), as pack_for_cpu laid a model out before."""
    for m in layers:
        m.weight = cpu_decode.huge_page_copy(m.weight.clone())
        if m.scale is not None:  # (q6_k's d's are float16 in every checkout that has it)
            m.scale = m.scale.clone() if m.fmt == "q6_k" else m.scale.float().clone()
        if m.bias is not None:
            m.bias = m.bias.clone()


def step_layers(fmt: str, layers: int, vocab: int, g: torch.Generator) -> list[cpu_decode.PackedLinear]:
    blocks, head = FORMATS[fmt]
    out = [cpu_decode.PackedLinear(torch.randn(n, k, generator=g) * 0.02, torch.randn(n, generator=g), blocks)
           for _ in range(layers) for n, k in SHAPES]
    return out + [cpu_decode.PackedLinear(torch.randn(vocab, 768, generator=g) * 0.02, None, head)]


def products_table(sides: list[Side], layers: int, steps: int, vocab: int = VOCAB) -> str:
    g = torch.Generator().manual_seed(0)
    weights = {}
    for fmt in FORMATS:
        made = step_layers(fmt, layers, vocab, g)
        for side in (s for s in sides if fmt in s.formats):
            these = [SimpleNamespace(weight=m.weight, scale=m.scale, bias=m.bias, fmt=m.fmt,  # its own tensors
                                     in_features=m.in_features, out_features=m.out_features) for m in made]
            if side.name == "new":  # the blocks' tensors in one arena, as gather_in_huge_pages lays them out
                slots = [(m, n) for m in these[:-1] for n in ("weight", "scale", "bias")
                         if not cpu_decode.in_huge_pages(getattr(m, n))]
                for (m, n), t in zip(slots, cpu_decode.huge_page_arena([getattr(m, n) for m, n in slots])):
                    setattr(m, n, t)
            else:
                base_layout(these)
            weights[(side.name, fmt)] = these
    x = {k: torch.randn(1, k, generator=g) for k in (768, 3072)}

    def step(side: Side, fmt: str) -> None:
        for m in weights[(side.name, fmt)]:
            op = getattr(side.ops, OPS.get(m.fmt, "linear_q8"))
            op(x[m.in_features], m.weight, m.scale, m.bias, m.out_features)

    def nbytes(side: Side, fmt: str) -> int:
        return sum(m.weight.numel() * m.weight.element_size() + m.scale.numel() * m.scale.element_size()
                   for m in weights[(side.name, fmt)])

    pairs = [(s, fmt) for s in sides for fmt in s.formats]
    for side, fmt in pairs:
        step(side, fmt)  # warm-up
    times: dict[tuple[str, str], list[float]] = {(s.name, f): [] for s, f in pairs}
    for _ in range(steps):
        for side, fmt in pairs:
            start = time.perf_counter()
            step(side, fmt)
            times[(side.name, fmt)].append(time.perf_counter() - start)

    def ratios(a: list[float], b: list[float]) -> str:
        r = [x / y for x, y in zip(a, b)]
        return f"{quantile(r, 0.1):.2f} / **{quantile(r, 0.5):.2f}x** / {quantile(r, 0.9):.2f}"

    first, *others = FORMATS
    rows = ["| kernels | " + " | ".join(f"{f} ms (p10 / median) | {f} MB, GB/s" for f in FORMATS) + " | "
            + " | ".join(f"{f}'s speed / {first}'s (p10 / median / p90)" for f in others) + " |",
            "|---|" + "--:|" * (2 * len(FORMATS) + len(others))]
    for side in sides:
        cells = []
        for fmt in FORMATS:
            t = times.get((side.name, fmt))
            cells += ([f"{quantile(t, 0.1) * 1e3:.2f} / {quantile(t, 0.5) * 1e3:.2f}",
                       f"{nbytes(side, fmt) / 1e6:.1f}, {nbytes(side, fmt) / quantile(t, 0.1) / 1e9:.1f}"]
                      if t else ["-", "-"])
        cells += [ratios(times[(side.name, first)], times[(side.name, f)]) if f in side.formats else "-"
                  for f in others]
        rows.append(f"| {side.name} | " + " | ".join(cells) + " |")
    if len(sides) == 2:
        for fmt in (f for f in FORMATS if f in sides[0].formats):
            rows.append(f"| new's speed / base's, {fmt} |" + " |" * (2 * len(FORMATS))
                        + f" {ratios(times[('base', fmt)], times[('new', fmt)])} |" + " |" * (len(others) - 1))
    return "\n".join(rows)


def packed_models(sides: list[Side]) -> dict[tuple[str, str], GPT]:
    """GPT-2 small's shape, random weights, packed in each format (pack_for_cpu); for the baseline, packed
    again and laid out as before (base_layout)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_multiple=64, dropout=0.0)).eval()
    out = {}
    for fmt, (blocks, head) in FORMATS.items():
        for side in (s for s in sides if fmt in s.formats):
            q4_head = head if blocks == "q4_0" else cpu_decode.Q4_HEADS[0]
            packed = cpu_decode.pack_for_cpu(copy.deepcopy(model), blocks, q4_head=q4_head)
            if side.name != "new":
                base_layout([m for m in packed.modules() if isinstance(m, cpu_decode.PackedLinear)])
                for block in packed.transformer.h:
                    block._params = None  # gathered again at the first step, from the tensors as they are now
            out[(side.name, fmt)] = packed
    return out


def decode_table(sides: list[Side], tokens: int, rounds: int) -> str:
    models = packed_models(sides)
    prompt = torch.randint(VOCAB, (1, 16), generator=torch.Generator().manual_seed(1))
    greedy = SamplingOptions(temperature=0)

    def rate(side: Side, fmt: str, n: int) -> tuple[float, list[int]]:
        with side.in_use():
            out, start = [], 0.0
            for nxt in generate_stream(models[(side.name, fmt)], prompt, n, greedy):
                out.append(int(nxt[0]))
                if len(out) == 1:
                    start = time.perf_counter()  # after the prompt's forward and the first token
            return (n - 1) / (time.perf_counter() - start), out

    pairs = [(s, f) for s in sides for f in s.formats]
    for side, fmt in pairs:
        rate(side, fmt, 8)  # warm-up
    rates: dict[tuple[str, str], list[float]] = {(s.name, f): [] for s, f in pairs}
    made: dict[tuple[str, str], list[int]] = {}
    for _, (side, fmt) in interleave(pairs, rounds):
        r, made[(side.name, fmt)] = rate(side, fmt, tokens)
        rates[(side.name, fmt)].append(r)

    first, *others = FORMATS
    rows = ["| kernels | " + " | ".join(f"{f} tok/s" for f in FORMATS) + " | "
            + " | ".join(f"{f} / {first}, by round" for f in others) + " |",
            "|---|" + "--:|" * (len(FORMATS) + len(others))]
    for side in sides:
        cells = [cell(rates[(side.name, f)]) if f in side.formats else "-" for f in FORMATS]
        cells += [ratio_cell(rates[(side.name, f)], rates[(side.name, first)], word=False) if f in side.formats
                  else "-" for f in others]
        rows.append(f"| {side.name} | " + " | ".join(cells) + " |")
    if len(sides) == 2:
        both = [f for f in FORMATS if f in sides[0].formats]
        same = all(made[("base", f)] == made[("new", f)] for f in both)
        for fmt in both:
            rows.append(f"| new / base, {fmt} |" + " |" * len(FORMATS)
                        + f" {ratio_cell(rates[('new', fmt)], rates[('base', fmt)])} |" + " |" * (len(others) - 1))
        rows.append(f"\nThe same greedy tokens from both kernels, each format: {'yes' if same else 'NO'}.")
    return "\n".join(rows)


@cli.entry_point()
def main(argv: list[str] | None = None) -> None:
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", default="", help="a checkout whose kernels to compare against (none: this "
                   "checkout's alone)")
    p.add_argument("--threads", type=int, default=1, help="torch's threads (default 1)")
    p.add_argument("--variant", default="", help="avx512 or avx2 (default: the best this CPU runs)")
    p.add_argument("--steps", type=int, default=60, help="decode steps' products timed per kernels and format")
    p.add_argument("--layers", type=int, default=12, help="layers of block matrices in a step (GPT-2 small: 12)")
    p.add_argument("--vocab", type=int, default=VOCAB, help=f"the products' head rows (default {VOCAB}, GPT-2's)")
    p.add_argument("--tokens", type=int, default=128, help="greedy tokens per decode (0: no decodes)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds of decodes")
    args = p.parse_args(argv)
    if min(args.threads, args.steps, args.layers, args.rounds, args.vocab) < 1 or args.tokens < 0:
        raise UserError("--threads, --steps, --layers, --rounds and --vocab must be positive, --tokens at least 0")
    runnable = cpu_decode.runnable_variants()
    variant = args.variant or (runnable[0] if runnable else "")
    if variant not in runnable:
        raise UserError(f"this CPU runs the kernels {runnable or 'of no variant'}; --variant {args.variant!r}")
    if cpu_decode.kernels() is None:
        raise UserError(f"the CPU kernels cannot run here: {cpu_decode.kernels_status()}")
    sides = [Side("new", variant)]
    if args.baseline:
        build_baseline(Path(args.baseline))
        sides.insert(0, Side("base", variant))
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"kernels_ab: {cpu_decode.VARIANTS[variant][1]}, {args.threads} thread(s), load average {load:.1f} at "
          f"the start; new: this checkout" + (f", base: {args.baseline}" if args.baseline else "") + "\n")
    print(f"**A decode step's products** ({args.layers} layers' block matrices and the head, one row; "
          f"{args.steps} steps each, interleaved)\n")
    print(products_table(sides, args.layers, args.steps, args.vocab) + "\n", flush=True)
    if args.tokens:
        print(f"**Decoding** (GPT-2 small's shape, {args.tokens} greedy tokens after a 16-token prompt; "
              f"{args.rounds} interleaved rounds, median (range))\n")
        print(decode_table(sides, args.tokens, args.rounds) + "\n")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"load average {load:.1f} at the end")


if __name__ == "__main__":
    main()
