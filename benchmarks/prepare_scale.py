"""Data preparation at scale: GPT-2 BPE end to end on generated corpora, 1 vs 2 processes, peak memory.

    python benchmarks/prepare_scale.py --dir /tmp/prepare_bench                       # 100 MB and 1 GB
    python benchmarks/prepare_scale.py --dir /tmp/pb --sizes 20M,80M                  # a quick check
    python benchmarks/prepare_scale.py --dir /tmp/pb --sizes 100M --executor thread   # threads instead

Each corpus is a folder of documents, each a copy of tiny Shakespeare with its lines shuffled and varied
(seeded: the same bytes every time), written once into --dir and reused. Each run is
``python prepare/text.py --input CORPUS --num_proc N --overwrite`` in a child process, timed from start to
exit (imports, the worker processes' start-up and writing included); "CPU s" is the CPU time of the child
and its workers (a figure the other jobs on a shared machine disturb far less than the wall time); its peak
memory is the largest sum of the resident set sizes of the child and all its descendants, sampled every
50 ms from /proc (Linux).
Targets (issue 22): 2 processes >= 1.6x one process's tokens/s; the largest corpus's peak RSS within 1.3x of
the smallest's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gptkit import cli  # noqa: E402
from gptkit.data.prepare import local  # noqa: E402
from gptkit.data.prepare.tiny_shakespeare import URL  # noqa: E402
from gptkit.errors import UserError  # noqa: E402

# The child: prepare/text.py, with the parallel executor chosen by the benchmark.
CHILD = ("import sys; sys.path.insert(0, sys.argv[1]); from gptkit.data.prepare import pool; "
         "pool.EXECUTOR = sys.argv[2]; from prepare import text; text.main(sys.argv[3:])")


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def varied_copy(lines: list[str], rng: random.Random, copy: int) -> str:
    """Tiny Shakespeare's lines in a seeded order, about a third of them varied (upper case, words reversed,
    the copy's number added), so the BPE never sees the same document twice."""
    order = list(range(len(lines)))
    rng.shuffle(order)
    out = []
    for i in order:
        line = lines[i]
        r = rng.random()
        if r < 0.1:
            line = line.upper()
        elif r < 0.2:
            line = " ".join(reversed(line.split())) + "\n"
        elif r < 0.3:
            line = f"{copy} {line}"
        out.append(line)
    return "".join(out)


def make_corpus(folder: Path, size: int, text: str) -> Path:
    """A folder of varied copies of `text` adding up to at least `size` bytes (kept for later runs)."""
    done = folder / "COMPLETE"
    if done.exists() and json.loads(done.read_text()) == {"size": size, "text_bytes": len(text.encode())}:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    lines = text.splitlines(keepends=True)
    rng = random.Random(size)
    written, copy = 0, 0
    while written < size:
        data = varied_copy(lines, rng, copy).encode("utf-8")
        (folder / f"{copy:06d}.txt").write_bytes(data)
        written += len(data)
        copy += 1
    done.write_text(json.dumps({"size": size, "text_bytes": len(text.encode())}))
    return folder


def tree_rss(root: int) -> int:
    """Resident bytes of a process and all its descendants (Linux /proc)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    family, frontier = {root}, [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p and c not in family]
        family.update(kids)
        frontier.extend(kids)
    total = 0
    for pid in family:
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024
        except (OSError, StopIteration):
            pass
    return total


def run_prepare(corpus: Path, out: Path, num_proc: int, executor: str) -> dict:
    """One end-to-end run in a child process: wall seconds, CPU seconds (the child and its workers), tokens,
    peak RSS of the process tree."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-c", CHILD, str(REPO), executor, "--input", str(corpus), "--out_dir", str(out),
           "--num_proc", str(num_proc), "--overwrite"]
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    log = out.parent / "prepare.log"  # the child's stderr (its progress bar), read back when it fails
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, tree_rss(proc.pid))
            time.sleep(0.05)
    seconds = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime
    summary = proc.stdout.read().strip().splitlines()
    if proc.returncode != 0:
        last = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no message)"]
        raise UserError(f"the prepare run failed (exit {proc.returncode}): {last[0]}")
    meta = json.loads((out / "meta.json").read_text())
    tokens = sum(s["tokens"] for s in meta["splits"].values())
    return {"seconds": seconds, "cpu": cpu, "tokens": tokens, "peak_rss": peak,
            "summary": summary[-1] if summary else ""}


@cli.entry_point()
def main(argv: list[str] | None = None) -> None:
    parser = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="folder for the generated corpora and the outputs")
    parser.add_argument("--sizes", default="100M,1G", help="corpus sizes, smallest first (K/M/G suffixes)")
    parser.add_argument("--procs", default="1,2", help="--num_proc values to compare, the baseline first")
    parser.add_argument("--executor", choices=["process", "thread"], default="process")
    parser.add_argument("--repeats", type=int, default=1, help="runs per row (the best is kept)")
    parser.add_argument("--text", default=None, help="tiny Shakespeare (default: downloaded into --dir)")
    parser.add_argument("--keep", action="store_true", help="keep the prepared outputs")
    args = parser.parse_args(argv)
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    source = Path(args.text) if args.text else local.download(URL, root / "tinyshakespeare.txt")
    text = source.read_text(encoding="utf-8")
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    procs = [int(p) for p in args.procs.split(",")]
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, executor {args.executor}, "
          f"load average {os.getloadavg()[0]:.1f}")
    header = f"{'corpus':>8} {'MB':>8} {'procs':>5} {'tokens':>13} {'seconds':>8} {'M tok/s':>8} {'vs 1st':>6} " \
             f"{'CPU s':>7} {'peak RSS MB':>11}"
    print(header)
    rows = {}
    for size in sizes:
        corpus = make_corpus(root / f"corpus_{size}", size, text)
        corpus_mb = sum(p.stat().st_size for p in corpus.glob("*.txt")) / 1e6
        for n in procs:
            runs = [run_prepare(corpus, root / "out", n, args.executor) for _ in range(args.repeats)]
            best = min(runs, key=lambda r: r["seconds"])
            best["peak_rss"] = max(r["peak_rss"] for r in runs)
            rows[size, n] = best
            rate = best["tokens"] / best["seconds"]
            ratio = rate / (rows[size, procs[0]]["tokens"] / rows[size, procs[0]]["seconds"])
            print(f"{args.sizes.split(',')[sizes.index(size)]:>8} {corpus_mb:>8.1f} {n:>5} {best['tokens']:>13,} "
                  f"{best['seconds']:>8.1f} {rate / 1e6:>8.2f} {ratio:>5.2f}x {best['cpu']:>7.1f} "
                  f"{best['peak_rss'] / 1e6:>11.0f}")
            if not args.keep:
                shutil.rmtree(root / "out", ignore_errors=True)
    small, large = sizes[0], sizes[-1]
    for n in procs:
        print(f"peak RSS, {n} process(es): largest corpus / smallest = "
              f"{rows[large, n]['peak_rss'] / rows[small, n]['peak_rss']:.2f} (target <= 1.3)")
    print(f"last summary line: {rows[large, procs[-1]]['summary']}")


if __name__ == "__main__":
    main()
