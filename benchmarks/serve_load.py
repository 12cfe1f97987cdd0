"""Serving throughput under load: 1, 4, 16 (and 64) concurrent streaming clients (the official `openai`
client) against serve.py on this machine; prints total generated tokens/s and the time to first token (median,
p99), for each --compile setting of the server.

    python benchmarks/serve_load.py                                   # starts serve.py on the baby model
    python benchmarks/serve_load.py --clients 1,4,16 --requests 4 --seconds 60 --max_tokens 128
    python benchmarks/serve_load.py --model gpt2 --serve_args="--quantize=int8"   # GPT-2 small's shape
    python benchmarks/serve_load.py --model gpt2-random --compile False,True --clients 1,16,64 --max_batch 64
    python benchmarks/serve_load.py --compile False,True --clients 1,4,16,64 --max_batch 64  # on a GPU
    python benchmarks/serve_load.py --url http://127.0.0.1:8000       # a server already running here
    python benchmarks/serve_load.py --model gpt2 --llama_server build/llama-server/bin/llama-server  # beside it
    python benchmarks/serve_load.py --model gpt2 --llama_server build/llama-native/bin/llama-server,build/llama-avx2/bin/llama-server

Without --url it writes a random-weights checkpoint (speed does not depend on the weights) into a temporary
folder, starts `serve.py --port 0` on it (127.0.0.1, --max_batch 16 by default, and --serve_args), and stops
it at the end; with --compile False,True it does so twice, one server for each setting, one after the other
(serve.py's --compile: auto, True or False; the compiled step is compiled before the server says it is ready,
so compiling is not in the figures). --model baby: configs/shakespeare.py's shape (6 layers, 6 heads, 384
wide, context 256, the 65 characters of tiny Shakespeare); --model gpt2: GPT-2 small's (124M, GPT-2's BPE,
whose files tiktoken must find: TIKTOKEN_CACHE_DIR offline); --model gpt2-random: GPT-2 small's shape and its
50,257-token vocabulary without any file to find: a character tokenizer over the prompt's characters and
50,257 - 95 others (the replies are random characters; the model's work per token is GPT-2's). --n_layer
shrinks the started model (a rehearsal on a CPU). A --url must be http://127.0.0.1:PORT: this load
generator is for one's own machine, never somebody else's. Each level runs `clients` clients, each sending up
to --requests streamed completions one after another (a new one only within --seconds of the level's start;
one in flight finishes), with a fresh prompt of ~65 characters (a number no other request had, then the same
text: no server has computed it before), temperature 1 and a seed of its own. The clients run in this process
on one event loop, so on a small machine they share its cores with the server. At the end, serve.py's
/metrics say how many prompt tokens its prefix cache reused (the numbers' first tokens, at most).
benchmarks/serve_chat.py measures conversations instead, whose prompts do repeat.

--llama_server: after serve.py, llama.cpp's llama-server (built by `bash benchmarks/llama_server.sh` from the
llama.cpp that llama-cpp-python vendors) on the same random model exported to GGUF (--llama_type; -np
--max_batch, --llama_args: -t 2), measured the same way; its rows in the same table. Several binaries,
comma-separated (a native build and an AVX2 one), are each measured in turn, named by their build folder.

A level's tokens/s is all the completion tokens it received over its wall time (first request sent to last
reply done); time to first token is from sending a request to its first piece of text, queueing included.
--rounds R (default 3; a machine's speed drifts: a shared VM's memory bandwidth moves by 1.5x within minutes)
starts every server at once and runs each level on each server in turn, R times, the servers' order rotated
each round (benchmarks/rounds.py); each row is then the median of its R rounds with their range, and each
ratio the median and range of the rounds' own ratios, "at parity" where the two servers' ranges overlap
(--rounds 1: one server after another, single figures). Every level runs at least --min_seconds (10): its
clients keep sending requests past --requests until then, so that one scheduler hiccup is not 20% of a cell.
The headline comparison (BENCHMARKS.md; benchmarks/reproduce.py runs it):

    python benchmarks/serve_load.py --model gpt2 --clients 1,4,16,64 --requests 2 --max_tokens 64 --rounds 3 \
        --serve_args="--threads=2 --quantize=int8" --llama_type q8_0 \
        --llama_server build/llama-native/bin/llama-server,build/llama-avx2/bin/llama-server
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a file from anywhere: the scripts and gptkit are in the checkout

from benchmarks.rounds import DEFAULT_ROUNDS, MIN_SECONDS, cell, ratio_cell, rotation  # noqa: E402
from benchmarks.servers import (  # noqa: E402, F401 (PROMPT, RETRIES, one_request: the tests' through here)
    PROMPT,
    RETRIES,
    LlamaServer,
    LoadError,
    LocalServer,
    check_url,
    fresh_prompt,
    one_request,
    prefix_metrics,
    run_level,
    served_model,
    write_checkpoint,
)
from gptkit import cli  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile: a value that was measured."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, int(-(-q * len(ordered) // 100)) - 1))]


def measure_level(url: str, model: str, clients: int, args: argparse.Namespace, extra: dict | None = None
                  ) -> tuple:
    """One level at url: (clients, requests, tokens, seconds, tokens/s, TTFT median, TTFT p99)."""
    results, wall = asyncio.run(run_level(url, model, clients, args.requests, args.seconds, args.max_tokens,
                                          extra, args.timeout, args.min_seconds, letters=args.model == "baby"))
    tokens = sum(r.tokens for r in results)
    firsts = [r.first_token_s for r in results if r.first_token_s is not None]
    retried = sum(r.retries for r in results)
    print(f"  {clients} clients: {len(results)} requests, {tokens} tokens in {wall:.1f} s"
          + (f" ({retried} sent again: the connection was closed before any answer)" if retried else ""),
          file=sys.stderr, flush=True)
    return (clients, len(results), tokens, wall, tokens / wall,
            statistics.median(firsts) if firsts else float("nan"), percentile(firsts, 99) if firsts else float("nan"))


def measure(servers: list[tuple[str, str, dict | None]], levels: list[int], args: argparse.Namespace,
            table: list[tuple]) -> None:
    """Measure every level on every server (setting, url, extra: more fields for every request's body), and
    append (setting, the served model's id, rows) to `table` for each, one row per level (a level that fails
    keeps the rows before it). With --rounds R the levels run R times, each level on every server in turn
    before the next, the servers' order rotated each round (benchmarks/rounds.py: a busy machine's drift falls
    on all of them alike, and none always goes first); a row holds the median of the rounds' tokens/s, TTFT
    median and TTFT p99, their requests, tokens and seconds summed, and last the rounds' tokens/s in round
    order (the table's ranges and per-round ratios)."""
    models, history, tables = [], [], []  # each server's model id, every level it has run, its table rows
    for setting, url, extra in servers:
        models.append(served_model(url))
        asyncio.run(run_level(url, models[-1], 1, 1, args.seconds, 8, extra, args.timeout,  # one-off costs
                              letters=args.model == "baby"))
        history.append([])
        tables.append([])
        table.append((setting, models[-1], tables[-1]))
    everything = list(zip(servers, models, history, tables))
    for r in range(args.rounds):
        for clients in levels:
            for (_, url, extra), model, measured, rows in rotation(everything, r):
                measured.append(measure_level(url, model, clients, args, extra))
                runs = [m for m in measured if m[0] == clients]
                row = (clients, *(sum(m[i] for m in runs) for i in (1, 2, 3)),
                       *(statistics.median(m[i] for m in runs) for i in (4, 5, 6)), [m[4] for m in runs])
                done = [r[0] for r in rows]
                if clients in done:  # a later round: the medians so far
                    rows[done.index(clients)] = row
                else:
                    rows.append(row)
    for setting, url, _ in servers:
        values = prefix_metrics(url)
        if values:
            print(f"  {setting}: its prefix cache reused {values['prompt_tokens_cached_total']:.0f} of "
                  f"{values['prompt_tokens_total']:.0f} prompt tokens", file=sys.stderr, flush=True)


def compile_settings(text: str) -> list[str]:
    """--compile's comma-separated serve.py settings, checked before any server starts."""
    settings = [c.strip() for c in text.split(",")]
    if not all(c.lower() in ("auto", "true", "false") for c in settings):
        raise LoadError(f"--compile {text!r}: comma-separated auto, True or False, e.g. False,True")
    return settings


@cli.entry_point()
def main(argv: list[str] | None = None) -> list[tuple]:
    """Prints the table; returns it: (setting or server name, model, rows), each row's last field its rounds'
    tokens/s."""
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="", help="a running server, http://127.0.0.1:PORT (default: start one)")
    p.add_argument("--clients", default="1,4,16", help="comma-separated numbers of concurrent clients")
    p.add_argument("--requests", type=int, default=4, help="requests per client per level (at most)")
    p.add_argument("--seconds", type=float, default=60, help="no new request after this long in a level")
    p.add_argument("--max_tokens", type=int, default=128, help="tokens per reply")
    p.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="run the levels this many times, every "
                   "server started at once and each level on each in turn (the order rotated each round); rows "
                   "are the rounds' medians with their ranges (1: one server at a time)")
    p.add_argument("--min_seconds", type=float, default=MIN_SECONDS, help="a level runs at least this long: "
                   "clients keep sending requests past --requests until then (a cell of ~1 s moves by 20%% with "
                   "one hiccup)")
    p.add_argument("--timeout", type=float, default=600, help="seconds a request may take (a busy machine's "
                   "64 clients wait long for a row)")
    p.add_argument("--max_batch", type=int, default=16, help="the started server's --max_batch")
    p.add_argument("--model", choices=("baby", "gpt2", "gpt2-random"), default="baby",
                   help="the started server's model shape (gpt2-random: GPT-2's without its BPE files)")
    p.add_argument("--n_layer", type=int, default=None, help="the started model's layers (default: the shape's)")
    p.add_argument("--compile", default="auto", help="the started server's --compile, or several to compare, "
                   "one server each: e.g. False,True")
    p.add_argument("--serve_args", default="", help="more options for the started serve.py, e.g. "
                   "\"--quantize=int8 --threads=2\"")
    p.add_argument("--llama_server", default="", help="also measure llama.cpp's llama-server, this binary "
                   "(bash benchmarks/llama_server.sh builds it; several: comma-separated), on the same model "
                   "exported to GGUF, -np max_batch")
    p.add_argument("--llama_type", choices=("f32", "f16", "q8_0", "q4_0"), default="f32",
                   help="llama-server's weights (f32 beside --quantize=float32, q8_0 beside int8, q4_0 beside q4_0)")
    p.add_argument("--json", default="", help="also write each server's rounds of tokens/s by level to this file "
                   "(benchmarks/reproduce.py reads it)")
    p.add_argument("--llama_args", default="-t 2", help="more options for llama-server (default: -t 2)")
    args = p.parse_args(argv)
    binaries = [b.strip() for b in args.llama_server.split(",") if b.strip()]
    for binary in binaries:
        if args.url or not Path(binary).is_file():
            raise LoadError(f"--llama_server {binary!r}: the llama-server binary (bash "
                            f"benchmarks/llama_server.sh builds it), without --url")
    args.llama_server = binaries
    try:
        levels = [int(c) for c in args.clients.split(",")]
    except ValueError:
        raise LoadError(f"--clients {args.clients!r}: comma-separated integers, e.g. 1,4,16") from None
    if min(levels) < 1 or args.requests < 1 or args.seconds <= 0 or args.max_tokens < 1 or args.timeout <= 0 or \
            (args.n_layer is not None and args.n_layer < 1) or args.rounds < 1 or args.min_seconds < 0:
        raise LoadError("--clients, --requests, --seconds, --max_tokens, --timeout, --n_layer and --rounds must "
                        "be positive, --min_seconds not negative")
    settings = compile_settings(args.compile)
    if importlib.util.find_spec("openai") is None:
        raise LoadError("the load generator's clients need the openai package: pip install -e \".[dev]\"")

    table = []  # (compile setting, model, rows)
    try:
        run_settings(table, settings, levels, args)
    finally:  # what was measured, even if a later server failed
        if any(rows for _, _, rows in table):
            print_table([t for t in table if t[2]], args.max_tokens)
        if args.json:
            Path(args.json).write_text(json.dumps([{"server": setting, "model": model,
                                                    "tokens_per_s": {str(row[0]): row[7] for row in rows}}
                                                   for setting, model, rows in table], indent=1) + "\n")
    return table


def run_settings(table: list[tuple], settings: list[str], levels: list[int], args: argparse.Namespace) -> None:
    """Measure every level at --url, or on a started server for each compile setting; append to `table`."""
    with tempfile.TemporaryDirectory(prefix="serve_load-") as scratch:
        if args.url:
            if args.serve_args or args.model != "baby" or args.compile != "auto" or args.n_layer is not None:
                raise LoadError("--serve_args, --model, --n_layer and --compile are for the server this "
                                "benchmark starts, not for --url")
            measure([("?", check_url(args.url), None)], levels, args, table)
        else:
            folder = Path(scratch) / f"{args.model.removesuffix('-random')}-random"
            ckpt = write_checkpoint(folder, args.model, args.n_layer)
            starts = [lambda setting=setting: local_server(ckpt, setting, args) for setting in settings]
            starts += [lambda binary=binary: llama_server(binary, ckpt, levels, args) for binary in args.llama_server]
            if args.rounds == 1:  # one server at a time
                for start in starts:
                    with start() as server:
                        measure([server], levels, args, table)
            else:  # all of them at once, the levels interleaved
                with contextlib.ExitStack() as stack:
                    measure([stack.enter_context(start()) for start in starts], levels, args, table)


@contextlib.contextmanager
def local_server(ckpt: Path, setting: str, args: argparse.Namespace):
    """serve.py with --compile=setting: (setting, url, None) while it runs."""
    server = LocalServer(ckpt, args.max_batch, [f"--compile={setting}", *shlex.split(args.serve_args)])
    try:
        yield setting, server.url, None
    finally:
        server.stop()


@contextlib.contextmanager
def llama_server(binary: str, ckpt: Path, levels: list[int], args: argparse.Namespace):
    """llama-server: (its name in the table, url, the fields its requests add) while it runs."""
    llama = LlamaServer(binary, ckpt, args.llama_type, args.max_batch, shlex.split(args.llama_args),
                        http_threads=max(levels) + 2)
    build = Path(binary).resolve().parent.parent.name  # build/llama-native/bin/llama-server
    name = f"llama-server {args.llama_type}" + (f" ({build})" if len(args.llama_server) > 1 else "")
    try:
        yield name, llama.url, {"ignore_eos": True, "cache_prompt": False}
    finally:
        llama.stop()


def print_table(table: list[tuple], max_tokens: int) -> None:
    """One row per (compile setting or server, level): tokens/s as the median with its range over the rounds,
    against the setting's first level and against the first setting's at the same level (1.00x when there is
    one setting), each ratio taken round by round with its range, and "at parity" where the two servers'
    ranges overlap (benchmarks/rounds.py)."""
    model = table[0][1]
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())  # a busy machine's figures are not a quiet one's
    rounds = max(len(row[7]) for _, _, rows in table for row in rows)
    print(f"serve_load: {model}, {max_tokens} tokens per reply, cpu count {os.cpu_count()}, load average {load}"
          + (f"; median (range) of {rounds} interleaved rounds" if rounds > 1 else ""))
    first = {row[0]: row[7] for row in table[0][2]}  # clients -> the first setting's tokens/s, round by round
    print("| compile | clients | requests | tokens | seconds | tokens/s | vs first level | vs first compile "
          "setting | TTFT median | TTFT p99 |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for setting, _, rows in table:
        base = rows[0][7]
        for clients, n, tokens, wall, _, median, p99, rates in rows:
            theirs = first.get(clients, rates)
            pairs = min(len(rates), len(theirs))  # a level cut short by a failure: the rounds both ran
            versus = ratio_cell(rates[:pairs], theirs[:pairs], word=theirs is not rates)
            print(f"| {setting} | {clients} | {n} | {tokens} | {wall:.1f} | {cell(rates, 0)} | "
                  f"{ratio_cell(rates[:len(base)], base[:len(rates)], word=False)} | {versus} | "
                  f"{median * 1000:.0f} ms | {p99 * 1000:.0f} ms |")


if __name__ == "__main__":
    main()
