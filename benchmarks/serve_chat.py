"""Conversations against serve.py, and against llama.cpp's llama-server with its prompt cache: each client holds
a conversation of --turns turns, every request sending the whole history (as every chat client does), which
grows by the reply and the next message until it nears the model's context. Prints each turn's time to first
token (the median over clients and rounds), the tokens/s of the replies, and serve.py's prefix cache figures
from its /metrics (hit rate, tokens reused, memory held).

    python benchmarks/serve_chat.py --n_layer 2 --turns 3                    # a rehearsal on a small CPU
    python benchmarks/serve_chat.py --clients 1,4 --turns 11 --rounds 3 \\
        --serve_args="--threads=2 --quantize=int8" --llama_type q8_0 \\
        --llama_server build/llama-native/bin/llama-server                   # the table in BENCHMARKS.md

llama-server is built by `GGML_NATIVE=ON bash benchmarks/llama_server.sh build/llama-native`, which prints
the binary's path (here, relative to the checkout).

The model is benchmarks/serve_load.py's gpt2-random: GPT-2 small's shape (1,024 tokens of context) and
vocabulary size with random weights, and a character tokenizer, so that a reply's text is exactly its tokens
on both servers (llama-server reads the same vocabulary from the GGUF export): the history a client sends back
starts with the tokens each server computed. A conversation opens with a character no other conversation of
the run starts with (nothing is shared between conversations, also across rounds) and --system characters;
each turn adds --user characters of the user's message, and the reply is --max_tokens tokens (temperature 1,
a seed per conversation and turn; llama-server is told to ignore its end-of-text, which this model has not).
The run is refused if the last turn would not fit the context.

--rounds R (default 3) starts every server at once and runs the clients' conversations on each server in
turn, R times, the order rotated each round (benchmarks/rounds.py: a shared machine's speed drifts, and all
servers get the same drift); each turn's time to first token is the median over the clients and rounds, the
replies' tokens/s the median with its range over the rounds, and each ratio the median and range of the
rounds' own ratios, "at parity" where the two servers' ranges overlap. Without llama-server, only serve.py is measured (--url: a serve.py already
running on 127.0.0.1, started on the same kind of model).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import os
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a file from anywhere: the scripts and gptkit are in the checkout

from benchmarks.rounds import DEFAULT_ROUNDS, cell, ratio_cell, rotation  # noqa: E402
from benchmarks.servers import (  # noqa: E402
    RETRIES,
    LlamaServer,
    LoadError,
    LocalServer,
    check_url,
    prefix_metrics,
    served_model,
    write_checkpoint,
)
from gptkit import cli  # noqa: E402

CONTEXT = 1024  # gpt2-random's
FIRST = 0x4E00  # the conversations' first characters: U+4E00 on, each a token of gpt2-random's vocabulary
WORDS = ("the quick brown fox jumps over the lazy dog while five wizards box and a sphinx of black quartz "
         "judges my vow ")


# ----------------------------------------------------------------------------- a conversation


@dataclass
class Conversation:
    """One client's conversation: the text sent so far (a character a token). number: which conversation of
    the run (its first character)."""

    number: int
    system: int  # characters of the opening after the first one
    user: int  # characters of each user message

    def __post_init__(self):
        self.history = chr(FIRST + self.number) + text(self.system, self.number)

    def ask(self, turn: int) -> str:
        """The prompt of this turn: the history and the next user message."""
        self.history += "\nUser: " + text(self.user - 7, self.number + turn)  # ("\nUser: " is 7 characters)
        return self.history

    def answered(self, reply: str) -> None:
        self.history += reply


def text(n: int, offset: int) -> str:
    """n characters of plain text, starting at a place that depends on offset."""
    start = (offset * 7) % len(WORDS)
    return ((WORDS[start:] + WORDS) * (n // len(WORDS) + 2))[:n]


def tokens_at_last_turn(turns: int, system: int, user: int, max_tokens: int) -> int:
    """The last turn's prompt and reply, in tokens: what must fit the context."""
    return 1 + system + turns * user + turns * max_tokens


# ----------------------------------------------------------------------------- the clients


@dataclass
class Turn:
    turn: int
    first_token_s: float | None
    tokens: int
    seconds: float
    retries: int = 0  # connections closed before any answer, and the request sent again


async def converse(client, model: str, conversation: Conversation, turns: int, max_tokens: int,
                   extra: dict | None) -> list[Turn]:
    """The conversation's turns, one after another: each a streamed completion of the whole history. A
    connection the server closes before answering is sent again, at most RETRIES times (llama-server closes a
    kept-alive connection after a few requests, and a request already on its way gets no answer); the turn's
    time to first token counts from the first attempt."""
    import openai

    out = []
    for turn in range(turns):
        prompt = conversation.ask(turn)
        start = time.perf_counter()
        for attempt in range(RETRIES + 1):
            first, pieces, tokens = None, [], None
            try:
                stream = await client.completions.create(
                    model=model, prompt=prompt, max_tokens=max_tokens, temperature=1.0,
                    seed=conversation.number * 100 + turn, stream=True, stream_options={"include_usage": True},
                    extra_body=extra)
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].text:
                        first = first if first is not None else time.perf_counter() - start
                        pieces.append(chunk.choices[0].text)
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                break
            except openai.APIConnectionError:
                if pieces or tokens is not None or attempt == RETRIES:
                    raise
        reply = "".join(pieces)
        conversation.answered(reply)
        out.append(Turn(turn, first, len(reply) if tokens is None else tokens, time.perf_counter() - start,
                        attempt))
    return out


async def run_clients(url: str, model: str, conversations: list[Conversation], args: argparse.Namespace,
                      extra: dict | None, turns: int | None = None) -> tuple[list[Turn], float]:
    """Every conversation at once, one client each: all their turns (--turns), and the wall time."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=args.timeout)
    start = time.perf_counter()
    try:
        done = await asyncio.gather(*(converse(client, model, c, turns or args.turns, args.max_tokens, extra)
                                      for c in conversations))
    finally:
        await client.close()
    return [t for turns in done for t in turns], time.perf_counter() - start


# ----------------------------------------------------------------------------- the measurement


@dataclass
class Row:
    """One server at one number of clients: every turn measured, over the rounds."""

    server: str
    clients: int
    turns: list[Turn]
    tokens: int = 0
    seconds: float = 0.0
    rounds: list[tuple[list[Turn], int, float]] = field(default_factory=list)  # each round's turns, tokens, s

    def ttft(self, turn: int) -> float:
        firsts = [t.first_token_s for t in self.turns if t.turn == turn and t.first_token_s is not None]
        return statistics.median(firsts) if firsts else float("nan")

    def ttft_rounds(self, turn: int) -> list[float]:
        """Each round's median time to first token at this turn (over the clients), in round order."""
        out = []
        for turns, _, _ in self.rounds:
            firsts = [t.first_token_s for t in turns if t.turn == turn and t.first_token_s is not None]
            out.append(statistics.median(firsts) if firsts else float("nan"))
        return out

    def rates(self) -> list[float]:
        """Each round's replies' tokens/s."""
        return [tokens / seconds for _, tokens, seconds in self.rounds]


def measure(servers: list[tuple[str, str, dict | None]], levels: list[int], args: argparse.Namespace) -> list[Row]:
    """Every level on every server, --rounds times, each level on each server in turn, the servers' order
    rotated each round (benchmarks/rounds.py); each row keeps its rounds apart too, for the ranges."""
    models = [served_model(url) for _, url, _ in servers]
    rows = {(name, clients): Row(name, clients, []) for name, _, _ in servers for clients in levels}
    number = 0  # conversations so far: each starts with a character of its own
    for (_, url, extra), model in zip(servers, models):  # one-off costs (the first request's), not measured
        asyncio.run(run_clients(url, model, [Conversation(number, args.system, args.user)], args, extra, turns=1))
        number += 1
    for r in range(args.rounds):
        for clients in levels:
            for (name, url, extra), model in rotation(list(zip(servers, models)), r):
                conversations = [Conversation(number + c, args.system, args.user) for c in range(clients)]
                number += clients
                turns, wall = asyncio.run(run_clients(url, model, conversations, args, extra))
                row = rows[(name, clients)]
                row.turns += turns
                row.tokens += sum(t.tokens for t in turns)
                row.seconds += wall
                row.rounds.append((turns, sum(t.tokens for t in turns), wall))
                retried = sum(t.retries for t in turns)
                print(f"  {name}, {clients} client(s): {len(turns)} turns, {sum(t.tokens for t in turns)} tokens "
                      f"in {wall:.1f} s" + (f" ({retried} sent again: the connection was closed before any answer)"
                                            if retried else ""), file=sys.stderr, flush=True)
    return list(rows.values())


def print_tables(rows: list[Row], args: argparse.Namespace, metrics: dict[str, dict[str, float] | None]) -> None:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    last = tokens_at_last_turn(args.turns, args.system, args.user, args.max_tokens)
    print(f"serve_chat: gpt2-random, {args.turns} turns, {args.user} tokens a message, {args.max_tokens} a reply "
          f"(the last turn's prompt and reply: {last} tokens), {args.rounds} round(s), cpu count {os.cpu_count()}, "
          f"load average {load}")
    for clients in sorted({r.clients for r in rows}):
        level = [r for r in rows if r.clients == clients]
        print(f"\n{clients} client(s): time to first token by turn (median), and the replies' tokens/s (median "
              f"(range) over the rounds); the ratios taken round by round: median (range)")
        print("| server | " + " | ".join(f"turn {t + 1}" for t in range(args.turns)) + " | tokens/s |")
        print("|---|" + "--:|" * (args.turns + 1))
        for r in level:
            print(f"| {r.server} | " + " | ".join(f"{r.ttft(t) * 1000:.0f} ms" for t in range(args.turns))
                  + f" | {cell(r.rates(), 1)} |")
        base = level[0]
        print(f"| {base.server}: against its turn 1 | "
              + " | ".join(ratio_cell(base.ttft_rounds(t), base.ttft_rounds(0), word=False)
                           for t in range(args.turns)) + " | |")
        for other in level[1:]:
            print(f"| {base.server} / {other.server} | "
                  + " | ".join(ratio_cell(base.ttft_rounds(t), other.ttft_rounds(t), higher_is_better=False)
                               for t in range(args.turns))
                  + f" | {ratio_cell(base.rates(), other.rates())} |")
    for name, values in metrics.items():
        if values:
            print(f"\n{name}'s prefix cache (/metrics): hit rate {values['prefix_cache_hit_rate']:.3f} of "
                  f"{values['prompt_tokens_total']:.0f} prompt tokens, {values['prompt_tokens_cached_total']:.0f} "
                  f"reused; {values['prefix_cache_bytes'] / 2**20:.0f} MiB held "
                  f"({values['prefix_cache_tokens']:.0f} tokens, bound "
                  f"{values['prefix_cache_bound_bytes'] / 2**20:.0f} MiB), "
                  f"{values['prefix_cache_evicted_tokens_total']:.0f} tokens evicted")


@cli.entry_point()
def main(argv: list[str] | None = None) -> None:
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="", help="a running serve.py, http://127.0.0.1:PORT (default: start one)")
    p.add_argument("--clients", default="1", help="comma-separated numbers of concurrent conversations")
    p.add_argument("--turns", type=int, default=11, help="turns of each conversation")
    p.add_argument("--system", type=int, default=40, help="characters (tokens) of a conversation's opening")
    p.add_argument("--user", type=int, default=30, help="characters (tokens) of each user message")
    p.add_argument("--max_tokens", type=int, default=56, help="tokens of each reply")
    p.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="run every level on every server this many "
                   "times, the servers' order rotated each round; figures with their ranges over the rounds")
    p.add_argument("--timeout", type=float, default=600, help="seconds a request may take")
    p.add_argument("--max_batch", type=int, default=16, help="the started serve.py's --max_batch (llama-server's -np)")
    p.add_argument("--n_layer", type=int, default=None, help="the started model's layers (default: GPT-2's 12)")
    p.add_argument("--serve_args", default="", help="more options for the started serve.py, e.g. "
                   "\"--quantize=int8 --threads=2\"")
    p.add_argument("--llama_server", default="", help="also measure llama.cpp's llama-server, this binary (bash "
                   "benchmarks/llama_server.sh builds it), with its prompt cache")
    p.add_argument("--llama_type", choices=("f32", "f16", "q8_0", "q4_0"), default="f32",
                   help="llama-server's weights (f32 beside --quantize=float32, q8_0 beside int8, q4_0 beside q4_0)")
    p.add_argument("--llama_args", default="-t 2", help="more options for llama-server (default: -t 2)")
    args = p.parse_args(argv)
    try:
        levels = [int(c) for c in args.clients.split(",")]
    except ValueError:
        raise LoadError(f"--clients {args.clients!r}: comma-separated integers, e.g. 1,4") from None
    if min(levels) < 1 or min(args.turns, args.system, args.max_tokens, args.rounds) < 1 or args.user < 8 or \
            args.timeout <= 0 or (args.n_layer is not None and args.n_layer < 1):
        raise LoadError("--clients, --turns, --system, --max_tokens, --rounds, --timeout and --n_layer must be "
                        "positive, and --user at least 8")
    last = tokens_at_last_turn(args.turns, args.system, args.user, args.max_tokens)
    if last > CONTEXT:
        raise LoadError(f"the last turn would take {last} tokens, over the model's {CONTEXT}: fewer --turns, or a "
                        f"shorter --user, --system or --max_tokens")
    if args.llama_server and (args.url or not Path(args.llama_server).is_file()):
        raise LoadError(f"--llama_server {args.llama_server!r}: the llama-server binary (bash "
                        f"benchmarks/llama_server.sh builds it), without --url")
    if args.url and (args.serve_args or args.n_layer is not None):
        raise LoadError("--serve_args and --n_layer are for the server this benchmark starts, not for --url")
    if importlib.util.find_spec("openai") is None:
        raise LoadError("the benchmark's clients need the openai package: pip install -e \".[dev]\"")

    with tempfile.TemporaryDirectory(prefix="serve_chat-") as scratch, contextlib.ExitStack() as stack:
        if args.url:
            servers = [("serve.py", check_url(args.url), None)]
        else:
            ckpt = write_checkpoint(Path(scratch) / "gpt2-random", "gpt2-random", args.n_layer)
            local = LocalServer(ckpt, args.max_batch, shlex.split(args.serve_args))
            stack.callback(local.stop)
            servers = [("serve.py", local.url, None)]
            if args.llama_server:
                llama = LlamaServer(args.llama_server, ckpt, args.llama_type, args.max_batch,
                                    shlex.split(args.llama_args), http_threads=max(levels) + 2)
                stack.callback(llama.stop)
                servers.append((f"llama-server {args.llama_type}", llama.url, {"ignore_eos": True,
                                                                             "cache_prompt": True}))
        rows = measure(servers, levels, args)
        metrics = {name: prefix_metrics(url) for name, url, _ in servers}
        print_tables(rows, args, metrics)


if __name__ == "__main__":
    main()
