"""Where a full batch's time goes in serve.py: the CPU time per streamed token of its main thread (the event
loop: HTTP, SSE framing, the socket's writes) and of its other threads (the engine's, its OpenMP workers), read
from /proc/<pid>/task/*/stat (user and system time: figures that hold on a shared machine, unlike wall time),
and the same requests' tokens/s through HTTP against a bare loop over the Engine in this process, in
interleaved rounds.

    python benchmarks/serve_cpu.py                                  # GPT-2 small's shape, int8, 64 clients
    python benchmarks/serve_cpu.py --n_layer 2 --rounds 2 --serve_args="--threads=2 --quantize=float32"

The load is serve_load.py's (the official openai client, streamed completions of fresh prompts, temperature 1):
--clients clients x --requests requests x --max_tokens tokens, at --max_batch rows; the bare loop submits as
many requests of the same prompts' lengths to an Engine with the same rows, threads and weights, --clients at a
time, and times them to the last token. The load generator's own CPU per token (this process's main thread)
is printed too: on a small machine it shares the cores with the server, as it does with llama-server's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a file from anywhere: the scripts and gptkit are in the checkout

from benchmarks.rounds import rotation  # noqa: E402
from benchmarks.servers import LoadError, LocalServer, served_model, write_checkpoint  # noqa: E402
from gptkit import cli  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_times(pid: int) -> dict[int, tuple[str, float, float]]:
    """Each thread of process pid: tid -> (its name, user seconds, system seconds), from /proc."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "stat").read_text()
        except OSError:  # a thread that ended meanwhile
            continue
        name = text[text.index("(") + 1: text.rindex(")")]
        fields = text[text.rindex(")") + 2:].split()  # from the state, field 3
        found[int(task.name)] = (name, int(fields[11]) / TICK, int(fields[12]) / TICK)  # utime 14, stime 15
    return found


def spent(before: dict, after: dict, pid: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """((main thread's user, system), (every other thread's user, system)) seconds between two readings."""
    main, rest = [0.0, 0.0], [0.0, 0.0]
    for tid, (_, user, system) in after.items():
        _, u0, s0 = before.get(tid, ("", 0.0, 0.0))
        into = main if tid == pid else rest
        into[0] += user - u0
        into[1] += system - s0
    return (main[0], main[1]), (rest[0], rest[1])


def http_round(url: str, model: str, args: argparse.Namespace, pid: int) -> dict[str, float]:
    from benchmarks.servers import run_level

    me = os.getpid()
    server0, client0 = thread_times(pid), thread_times(me)
    results, wall = asyncio.run(run_level(url, model, args.clients, args.requests, 3600, args.max_tokens))
    server1, client1 = thread_times(pid), thread_times(me)
    tokens = sum(r.tokens for r in results)
    (mu, ms), (eu, es) = spent(server0, server1, pid)
    (cu, cs), _ = spent(client0, client1, me)
    per = 1000 / tokens
    return {"tokens": tokens, "wall": wall, "tokens/s": tokens / wall, "main user": mu * per,
            "main sys": ms * per, "engine": (eu + es) * per, "client": (cu + cs) * per}


def bare_round(engine, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, float]:
    """The same requests to the Engine with no server around it: --clients at a time, each replaced by the
    next when it ends, as the clients do."""
    from gptkit.generate import SamplingOptions
    from gptkit.serving.engine import Finished, Request

    done, lock, tokens = threading.Event(), threading.Lock(), [0]
    queue = list(prompts)
    left = [len(prompts)]

    def submit() -> None:
        prompt = queue.pop()
        engine.submit(Request(prompt, args.max_tokens, emit=emit, sampling=SamplingOptions(temperature=1.0)))

    def emit(event) -> None:  # on the engine's thread
        if isinstance(event, Finished):
            tokens[0] += event.completion_tokens
            with lock:
                left[0] -= 1
                if queue:
                    submit()
                elif not left[0]:
                    done.set()

    me = os.getpid()
    before = thread_times(me)
    start = time.perf_counter()
    with lock:
        for _ in range(min(args.clients, len(queue))):
            submit()
    done.wait()
    wall = time.perf_counter() - start
    after = thread_times(me)
    (mu, ms), (eu, es) = spent(before, after, me)
    return {"tokens": tokens[0], "wall": wall, "tokens/s": tokens[0] / wall, "engine": (eu + es) * 1000 / tokens[0]}


def bare_engine(ckpt: Path, args: argparse.Namespace):
    """An Engine over the checkpoint with serve.py's settings (--threads, --quantize), as serve.py makes it."""
    import torch

    from gptkit import checkpoint
    from gptkit.inference import setup_inference
    from gptkit.serving.engine import Engine

    opts = dict(a.removeprefix("--").split("=", 1) for a in shlex.split(args.serve_args))
    inference = setup_inference("cpu", "auto", opts.get("quantize", "auto"), int(opts.get("threads", 0)),
                                set_threads=False)
    torch.set_num_threads(1)
    model, tokenizer, _ = checkpoint.load_model(str(ckpt), None)
    inference.place(model)
    engine = Engine(model, max_batch=args.max_batch, max_queue=10**6, threads=inference.n_threads, prefix_cache=0)
    return engine.start(), tokenizer


def bare_worker(conn, ckpt: Path, args: argparse.Namespace) -> None:
    """A child process: the bare Engine, a round of `kind` for each kind received, its figures sent back; None
    ends it. (Apart from the process that made the checkpoint and runs the clients: in a process whose main
    thread has run torch's parallel work, a second thread's OpenMP team makes every thread slower.)"""
    from benchmarks.servers import fresh_prompt

    engine, tokenizer = bare_engine(ckpt, args)
    try:
        while (kind := conn.recv()) is not None:
            prompts = [tokenizer.encode(fresh_prompt()) for _ in range(args.clients * args.requests)]
            with bucketed_steps(kind == "bare-bucketed"):
                conn.send(bare_round(engine, prompts, args))
    finally:
        engine.stop()


NAMES = {"http": "serve.py over HTTP", "bare": "Engine, no server",
         "bare-bucketed": "Engine, no server, steps reading length buckets"}


@contextlib.contextmanager
def bucketed_steps(on: bool):
    """With on, the engine's eager steps read the model's length buckets of slots (as before they read
    exactly the filled ones), for a comparison in one process."""
    from gptkit.serving import engine as engine_module

    real = engine_module.decode_one_token
    if on:
        engine_module.decode_one_token = lambda *a, **k: real(*a, **{**k, "exact": False})
    try:
        yield
    finally:
        engine_module.decode_one_token = real


@cli.entry_point()
def main(argv: list[str] | None = None) -> dict:
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=64, help="concurrent streaming clients")
    p.add_argument("--requests", type=int, default=2, help="requests per client")
    p.add_argument("--max_tokens", type=int, default=64, help="tokens per reply")
    p.add_argument("--max_batch", type=int, default=64, help="the server's and the bare engine's rows")
    p.add_argument("--model", choices=("gpt2", "gpt2-random"), default="gpt2", help="GPT-2 small's shape with "
                   "GPT-2's BPE (tiktoken's files: TIKTOKEN_CACHE_DIR offline) or a character tokenizer as large")
    p.add_argument("--n_layer", type=int, default=None, help="layers of the GPT-2-shaped model (default 12)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, HTTP and bare loop in turn")
    p.add_argument("--kinds", default="http,bare", help="what each round runs, in turn: http (serve.py), bare "
                   "(the Engine in this process), bare-bucketed (the same, its eager steps reading the model's "
                   "length buckets of slots instead of the filled ones: the engine before it read exactly those)")
    p.add_argument("--serve_args", default="--threads=2 --quantize=int8", help="serve.py's options (and the "
                   "bare engine's --threads and --quantize)")
    args = p.parse_args(argv)
    from benchmarks.servers import run_level

    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not kinds or not set(kinds) <= set(NAMES):
        raise LoadError(f"--kinds {args.kinds!r}: comma-separated {', '.join(NAMES)}")
    results: dict[str, list[dict]] = {kind: [] for kind in kinds}
    with tempfile.TemporaryDirectory(prefix="serve_cpu-") as scratch, contextlib.ExitStack() as stack:
        ckpt = write_checkpoint(Path(scratch) / f"{args.model}-random", args.model, args.n_layer)
        if "http" in kinds:
            server = LocalServer(ckpt, args.max_batch, ["--prefix_cache=0", *shlex.split(args.serve_args)])
            stack.callback(server.stop)
            model = served_model(server.url)
            asyncio.run(run_level(server.url, model, 1, 1, 60, 8))  # one-off costs
        if set(kinds) - {"http"}:  # the bare engine in a process of its own, as serve.py's is
            import multiprocessing

            conn, theirs = multiprocessing.get_context("spawn").Pipe()
            child = multiprocessing.get_context("spawn").Process(target=bare_worker, args=(theirs, ckpt, args))
            child.start()
            stack.callback(child.join)
            stack.callback(conn.send, None)
        for r in range(args.rounds):
            for kind in rotation(kinds, r):
                if kind == "http":
                    row = http_round(server.url, model, args, server.proc.pid)
                else:
                    conn.send(kind)
                    row = conn.recv()
                results[kind].append(row)
                print(f"  round {r + 1} {kind}: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items()),
                      file=sys.stderr, flush=True)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"serve_cpu: {args.model} random weights ({args.n_layer or 12} layers), {args.serve_args}, {args.clients} clients x "
          f"{args.requests} requests x {args.max_tokens} tokens, {args.max_batch} rows; load average {load}; "
          f"median (range) of {args.rounds} interleaved rounds; CPU in ms per streamed token")
    print("| | tokens/s | main thread user | main thread system | engine's threads | load generator |")
    print("|---|--:|--:|--:|--:|--:|")
    for kind, rows in results.items():
        def cell(key: str, digits: int = 3, rows: list[dict] = rows) -> str:
            values = [row[key] for row in rows if key in row]
            if not values:
                return ""
            return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"
        print(f"| {NAMES[kind]} | {cell('tokens/s', 0)} | "
              f"{cell('main user')} | {cell('main sys')} | {cell('engine')} | {cell('client')} |")
    return results


if __name__ == "__main__":
    main()
