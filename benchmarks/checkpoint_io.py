"""What checkpoint checksums cost: save and load of a GPT-2 124M checkpoint (random weights and AdamW state, fp32)
with and without them, the CRCs' speed on this machine, and how long a save stalls the training loop,
synchronous against asynchronous (train.py --async_save).

    python benchmarks/checkpoint_io.py                  # GPT-2 124M; --small for a quick look
    python benchmarks/checkpoint_io.py --repeat 5

Rows: "save" writes the checkpoint atomically (torch.save alone, vs save_checkpoint: the checksums, then
torch.save); "load (sample)" is what sample/eval/chat/serve/export do: a memory-mapped load (with checksums: the
verification of everything, the optimizer state's pages read for it), then the model built from it; "load (resume)" reads
everything (mmap=False) and verifies everything, in one pass that copies and checks each tensor (the row "two
passes" is how it was done before: torch.load, then the checksums over the loaded tensors). "checksums alone" times the checksum work by itself (steadier
than the difference of two timings on a busy machine), "share" is it over the time without. Files are read
from the page cache (just written): the CPU's cost, not the disk's. The best of --repeat runs is shown.

The stall table: the time save() keeps the caller (the step loop) waiting, synchronous (the whole atomic write)
against asynchronous (the copy of the state into CPU memory kept from the save before; the write goes on in a
background thread, its time shown beside).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gptkit import checksum, cli  # noqa: E402
from gptkit.checkpoint import load_checkpoint, model_from_checkpoint, save_checkpoint  # noqa: E402
from gptkit.checkpoint.background import CheckpointSaver  # noqa: E402
from gptkit.checkpoint.damage import container_problem  # noqa: E402
from gptkit.files import atomic_write  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402


def best_of(n: int, fn) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def make_state(config: GPTConfig) -> dict:
    torch.manual_seed(0)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    return {"format": 1, "model_config": config.to_dict(), "model": model.state_dict(),
            "optimizer": optimizer.state_dict(), "step": 1, "best_val_loss": 3.0,
            "tokenizer": {"tokenizer": {"kind": "tiktoken", "name": "gpt2"}, "vocab_size": 50257}}


def crc_speeds(repeat: int) -> list[tuple[str, float]]:
    """GB/s of each CRC over a 256 MB tensor's bytes (read in place where the library can)."""
    data = torch.randn(64 << 20).view(torch.uint8).numpy()
    rows = [("zlib.crc32 (in place)", lambda: zlib.crc32(data)),
            ("crc32c package, CRC-32C (in place)", lambda: checksum.crc(data))]
    try:
        import google_crc32c

        # its C extension takes only bytes: a copy first
        rows.append(("google-crc32c (needs a bytes copy)", lambda: google_crc32c.value(data.tobytes())))
    except ImportError:
        pass
    return [(name, data.nbytes / best_of(repeat, fn) / 1e9) for name, fn in rows]


def save_stalls(state: dict, path: Path, repeat: int) -> list[tuple[str, float, float | None]]:
    """(name, seconds save() blocks, seconds the background write takes) for a synchronous and an asynchronous
    CheckpointSaver, their rounds interleaved; the asynchronous saver's first save (which allocates its CPU
    copy) is left out, as in a run it happens once."""
    sync, background = CheckpointSaver(background=False), CheckpointSaver(background=True)
    background.save(state, path)
    background.wait()
    times = {"sync": [], "async": [], "write": []}
    for _ in range(repeat):
        t0 = time.perf_counter()
        sync.save(state, path)
        times["sync"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        background.save(state, path)
        times["async"].append(time.perf_counter() - t0)
        background.wait()
        times["write"].append(time.perf_counter() - t0)
    med = statistics.median
    return [("synchronous (save_checkpoint)", med(times["sync"]), None),
            ("asynchronous (--async_save)", med(times["async"]), med(times["write"]))]


@cli.entry_point()
def main(argv: list[str] | None = None) -> None:
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="a 6-layer, 384-wide model instead of GPT-2 124M")
    args = parser.parse_args(argv)
    config = GPTConfig(n_layer=6, n_head=6, n_embd=384) if args.small else GPTConfig()
    state = make_state(config)
    n_bytes = sum(t.numel() * t.element_size() for _, t in checksum.tensors(state))
    print(f"{'GPT-2 124M' if not args.small else 'small'} state: {n_bytes / 1e9:.2f} GB of tensors "
          f"(model + AdamW), {torch.get_num_threads()} torch threads, {checksum.THREADS} CRC threads, "
          f"{os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as tmp:
        plain, checked = Path(tmp) / "plain.pt", Path(tmp) / "checked.pt"

        def save_plain():  # save_checkpoint as it was before checksums: atomic, torch.save alone
            with atomic_write(plain) as tmp_path, open(tmp_path, "wb") as f:
                torch.save(state, f)

        rows = [("save", best_of(args.repeat, save_plain),
                 best_of(args.repeat, lambda: save_checkpoint(state, checked)),
                 best_of(args.repeat, lambda: checksum.record(state)))]

        def sample_plain():
            ckpt = torch.load(plain, map_location="cpu", weights_only=True, mmap=True)
            model_from_checkpoint(ckpt)

        def sample_checked():
            model_from_checkpoint(load_checkpoint(checked, mmap=True))

        def verify(mmap: bool) -> float:  # the verification alone, on a fresh load (mmap: pages not yet read)
            ckpt = torch.load(checked, map_location="cpu", weights_only=True, mmap=mmap)
            t0 = time.perf_counter()
            container_problem(checked)
            assert checksum.mismatch(ckpt, ckpt[checksum.KEY]) is None  # (the optimizer state too, since mmap)
            return time.perf_counter() - t0

        rows.append(("load (sample): mmap + build the model", best_of(args.repeat, sample_plain),
                     best_of(args.repeat, sample_checked), min(verify(True) for _ in range(args.repeat))))
        def two_passes():  # the resume load as it was: torch.load into memory, then the checksums over it
            ckpt = torch.load(checked, map_location="cpu", weights_only=True)
            container_problem(checked)
            assert checksum.mismatch(ckpt, ckpt.pop(checksum.KEY)) is None

        plain_resume = best_of(args.repeat, lambda: torch.load(plain, map_location="cpu", weights_only=True))
        rows.append(("load (resume): two passes (before)", plain_resume, best_of(args.repeat, two_passes), None))
        rows.append(("load (resume): one pass", plain_resume,
                     best_of(args.repeat, lambda: load_checkpoint(checked, mmap=False)), None))
        stalls = save_stalls(state, Path(tmp) / "stall.pt", args.repeat)
    print()
    print(f"{'':40s} {'without':>9s} {'with':>9s} {'checksums alone':>16s} {'share':>7s}")
    for name, without, with_, alone in rows:
        alone = with_ - without if alone is None else alone  # (the one-pass load: only the difference is there)
        print(f"{name:40s} {without:8.3f}s {with_:8.3f}s {alone:15.3f}s {100 * alone / without:6.1f}%")
    print()
    print(f"{'the step loop waits per save':40s} {'stall':>9s} {'write (background)':>19s}")
    for name, stall, write in stalls:
        print(f"{name:40s} {stall:8.3f}s {'' if write is None else f'{write:18.3f}s':>19s}")
    print()
    print(f"{'CRC of 256 MB, one thread':40s} {'GB/s':>9s}")
    for name, speed in crc_speeds(args.repeat):
        print(f"{name:40s} {speed:9.2f}")


if __name__ == "__main__":
    main()
