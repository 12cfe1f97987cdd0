"""The continuous-batching engine: many requests decoded together by one model. A request joins the running
batch between two decode steps and leaves it as soon as it is done, so nobody waits for anybody else's reply.

    engine = Engine(model, max_batch=16, max_queue=64).start()     # the decode loop, in a thread of its own
    request = engine.submit(Request(prompt_ids, max_tokens=100, emit=on_event))
    request.cancel()                                               # the client left: its row is freed at once
    engine.stop()                                                  # finish what was accepted, then end

One iteration of the loop (`Engine.step`):
    1. admit   waiting requests take the free rows of the KV cache: each prompt's longest prefix whose keys and
               values the engine still holds (the prefix cache, below) is copied into its row, and the rest of
               the prompts admitted together are prefilled together, one forward over them all (right-padded,
               in groups of similar lengths), each into its own row at its own positions; each request's first
               token is drawn from its prompt's last logits;
    2. decode  one forward over all active rows, each row at its own position (one token each), then one
               token per row, drawn with that request's own options and random stream: one uniform number
               from the request's generator, placed in its filtered distribution (inverse_cdf_draw);
    3. retire  finished and cancelled requests leave; the last active row moves into the hole, so the active
               rows are always rows 0..A-1 of the cache and the forward reads views of it, never copies.
With window=K (chat.py: when compiled), step 2 decodes K tokens per row in one call wherever every active row
allows it (Engine._windowable): each row's K uniforms drawn first, its tokens fed back on the device, then told
one by one up to its stop token or max_tokens (the later ones, computed, are never told); new requests join
between windows.
Each request is told its tokens, one by one, and then how it finished, through its `emit` callback (called on
the engine's thread: a server hands them over to its event loop).

The prefix cache (gptkit/serving/prefix_cache.py; `prefix_cache`: its bound in bytes, 0 = off): every prompt's
keys and values, and every finished reply's with its prompt, are kept (copied out of the row, only what is not
held yet) while the bound allows, least recently used out first. A conversation's next message arrives with
its whole history: only the new tokens are computed. A prompt that continues what a free row still holds (one
client, chat.py: the row its last reply left) uses it in place, without a copy. Requests with the same prompt
admitted together (a request's n choices) compute it once, and the others copy its row. Keys and values
computed for a prefix in another forward (a decode step, another batch) equal those of one whole prefill to
float rounding: a reply with reuse is the reply without it, up to the rounding of batched matmuls, as below.

A request's reply does not depend on who else is being served: its rows of the cache are its own, its draws
come from its own generator (seeded from `seed`), and each row's attention sees only its own slots. Only the
rounding of the batched matmuls differs from decoding it alone.

The decode step, eager or compiled (`compile`: auto = compiled on CUDA where torch.compile can run):
    eager      rows 0..A-1 only, attending over the slots filled so far (in the model's length buckets);
    compiled   a step over a bucket of rows and a bucket of slots (Engine.buckets): the fewest rows of the
               row buckets that hold the A active ones, and the fewest slots of the length buckets that hold
               the longest row's next position (the mask hides what a row has not written), so the work
               follows the live rows and tokens instead of reading the whole cache every step. Compiled with
               fullgraph=True and static shapes, one graph per bucket (a few: 4 for max_batch 16), on CUDA
               each replayed as a CUDA graph (mode="reduce-overhead"). The active rows feed their tokens at
               their own positions; each free row of the bucket is fed token 0 at position 0 of its own row, a
               slot that the prefill of that row's next request overwrites before anything reads it (a
               retired row is copied away before the step, and copy_cache_row copies filled slots only). Only
               the active rows' logits are sampled.
It is compiled, and every bucket run, on the engine's thread (CUDA graphs belong to the thread that records
them) when the engine starts, before the server says it is ready: no request waits for the compiler.

The engine knows nothing of HTTP nor of text (gptkit/serving/routes.py has both): prompts and replies are
token ids.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from gptkit.generate import (
    CapturedWindow,
    SamplingOptions,
    candidates,
    decode_one_token,
    inverse_cdf_draw,
    model_addresses,
    window_step_compiler,
)
from gptkit.runtime import resolve_compile
from gptkit.serving.prefix_cache import Match, PrefixCache, auto_bound, common_length
from model import GPT, bucketed_forward, bucketed_length, no_tf32

# ----------------------------------------------------------------------------- what the engine says


@dataclass(frozen=True)
class Logprob:
    """How likely the model found a token: its log-probability under the model's own distribution (the
    log-softmax of its logits, before temperature, penalties and logit_bias), and the `logprobs` likeliest
    tokens' (id, log-probability), likeliest first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Token:
    """The request's next token; with `logprob` for a request that asked for logprobs. final: the stop token
    that ended the reply, told (to a request that asked for logprobs only) for its logprob: not part of the
    reply, and a Finished("stop") follows."""

    id: int
    logprob: Logprob | None = None
    final: bool = False


@dataclass(frozen=True)
class PromptLogprobs:
    """Told first, to a request with prompt_logprobs: each prompt token's Logprob given the tokens before it
    (None for the first, which nothing predicts)."""

    logprobs: tuple[Logprob | None, ...]


@dataclass(frozen=True)
class Finished:
    """The request is done. reason: "stop" (it drew one of its stop tokens, which is not emitted), "length"
    (max_tokens, or the model's context is full), "cancelled" (Request.cancel), "error" (the step failed; the
    engine logs why and goes on serving). completion_tokens: the tokens emitted."""

    reason: str
    completion_tokens: int


Event = Token | Finished | PromptLogprobs


class EngineError(Exception):
    """A request the engine cannot take now."""


class QueueFull(EngineError):
    """Every row is busy and max_queue requests are already waiting."""


class EngineStopped(EngineError):
    """The engine is stopping (or stopped) and accepts no new request."""


# ----------------------------------------------------------------------------- a request

def _alike(a: SamplingOptions, b: SamplingOptions) -> bool:
    """Whether two requests' tokens are drawn alike (the engine's sampling: temperature, top-k, top-p)."""
    return (a.temperature, a.top_k, a.top_p) == (b.temperature, b.top_k, b.top_p)


BAN = -100.0  # a logit_bias of -100 bans its token (OpenAI: "should result in a ban"): its logit becomes -inf


@dataclass(eq=False)
class Request:
    """One reply to decode. prompt: its token ids (1 .. block_size of them); max_tokens: the most tokens to
    emit (0 only with prompt_logprobs: the prompt is scored, nothing is decoded); sampling: temperature, top_k,
    top_p (its stop_token and window_shift are not used here: stop_ids); stop_ids: tokens that end the reply;
    seed: the random stream of the draws (None: a fresh one); emit: called with each Event, on the engine's
    thread.

    Applied to a row's logits before temperature, top-k and top-p, as OpenAI defines them: logit_bias (token
    id -> bias added to its logit; BAN, -100, bans it), frequency_penalty (minus the penalty times the number
    of times the token is in the reply so far) and presence_penalty (minus the penalty once it is there).
    logprobs: each token comes with its Logprob and the `logprobs` likeliest tokens' (None: no Logprob);
    prompt_logprobs: the prompt's PromptLogprobs are told first (with logprobs' likeliest tokens)."""

    prompt: list[int]
    max_tokens: int
    emit: Callable[[Event], None]
    sampling: SamplingOptions = field(default_factory=lambda: SamplingOptions(temperature=0))
    stop_ids: frozenset[int] = frozenset()
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: bool = False
    cancelled: bool = False
    cached_tokens: int = 0  # set by the engine when it admits the request: the prompt's tokens not computed

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.logit_bias) or self.frequency_penalty != 0 or self.presence_penalty != 0

    def cancel(self) -> None:
        """Stop decoding this request: its row is given up before the next decode step. (Setting a flag is
        safe from any thread; the engine reads it between steps.)"""
        self.cancelled = True


@dataclass(eq=False)
class _Row:
    """A request in the running batch: its row of the cache holds `length` tokens (the prompt and every token
    fed back since); `last` is the token the next decode step feeds in."""

    request: Request
    length: int
    generator: torch.Generator
    last: int = -1
    emitted: int = 0
    finish: str | None = None
    # What _sample keeps for the request's sampling parameters (made on first use, on the logits' device):
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # logit_bias as (ids, biases); a ban is -inf
    counts: torch.Tensor | None = None  # (V,) float32: each token's count in the reply, for the penalties
    logprob: Logprob | None = None  # the Logprob of the token _sample just drew, for _deliver
    scored: bool = False  # the prompt's PromptLogprobs were told
    reply: list[int] = field(default_factory=list)  # the tokens emitted (fed back but the last)
    start: int = 0  # the prompt's first tokens whose keys and values are reused, not computed
    found: Match | None = None  # where in the prefix cache they are (None: already in the row, or none)


# ----------------------------------------------------------------------------- the compiled step


def decode_all_rows(model: GPT, tokens: torch.Tensor, pos: torch.Tensor, length: int) -> torch.Tensor:
    """The compiled decode step: one token for each of the KV cache's first R rows, tokens (R, 1) each at its
    row's own position pos (R, 1), attending over the first `length` slots (masked past each position) ->
    float32 logits (R, V). R and length are a bucket's (Engine.buckets): a few shapes, one graph each."""
    return decode_one_token(model, tokens, pos, rows=slice(0, tokens.size(0)), length=length)


class WindowInputs(torch.nn.Module):
    """The inputs of the engine's K-token windows, in buffers that never move (static inputs of their CUDA
    graphs, reached through the window's closure: a replay copies nothing in): each row's token (R, 1) and
    position (R, 1), 1 for an active row and 0 for a free one of the bucket (R, 1), which stays at position 0,
    and the K steps' uniform draws (K, R), float64 as each row's generator gives them."""

    def __init__(self, max_batch: int, steps: int, device: torch.device):
        super().__init__()
        for name, shape, dtype in (("tokens", (max_batch, 1), torch.long), ("pos", (max_batch, 1), torch.long),
                                   ("active", (max_batch, 1), torch.long),
                                   ("uniform", (steps, max_batch), torch.float64)):
            self.register_buffer(name, torch.zeros(shape, dtype=dtype, device=device), persistent=False)


def draw(logits: torch.Tensor, options: SamplingOptions, uniform: torch.Tensor | None) -> torch.Tensor:
    """One token per row of logits (n, V), the rows drawn alike with `options`: the argmax at temperature 0,
    else each row's uniform (n,) placed in its filtered distribution (its candidates, likeliest first, or the
    whole vocabulary: inverse_cdf_draw)."""
    if options.temperature == 0:
        return logits.argmax(dim=-1)
    probs, order = candidates(logits, options)
    picked = inverse_cdf_draw(probs, uniform)
    return picked if order is None else order.gather(-1, picked[:, None])[:, 0]


def decode_rows_step(model: GPT, token: torch.Tensor, pos: torch.Tensor, options: SamplingOptions,
                     uniform: torch.Tensor | None, rows: int, length: int) -> torch.Tensor:
    """One step of a window: the next tokens (rows,) of the cache's first `rows` rows, tokens (rows, 1) at their
    positions pos (rows, 1), attending over the first `length` slots, drawn alike (`draw`) with `uniform`. The
    function a compiled window compiles (one graph per bucket and options) and calls K times."""
    logits = decode_one_token(model, token, pos, rows=slice(0, rows), length=length)
    return draw(logits, options, uniform)


def decode_rows_window(model: GPT, inputs: WindowInputs, options: SamplingOptions, steps: int, rows: int,
                       length: int, grow: bool, step: Callable = decode_rows_step) -> torch.Tensor:
    """K = steps decode steps of the cache's first `rows` rows in one function -> their tokens (K, rows): each
    step's tokens drawn alike (`draw`, step k with inputs.uniform[k]) and fed to the next, each active row one
    position further. Attention reads the first `length` slots (grow: length + k at step k, what an eager
    window reads; else a bucket's, the same every step: `step` compiled, one graph per bucket). No host
    synchronisation: on a GPU its K steps record as one CUDA graph (generate.CapturedWindow)."""
    pos, active, tokens = inputs.pos[:rows], inputs.active[:rows], []
    # A copy made here, as the later steps' tokens are: under inference mode the buffer (made outside it) and
    # the steps' tokens are tensors of two kinds, and the compiled step would be compiled once for each.
    token = inputs.tokens[:rows].clone()
    for k in range(steps):
        uniform = inputs.uniform[k, :rows] if options.temperature > 0 else None
        nxt = step(model, token, pos + k * active, options, uniform, rows, length + k if grow else length)
        tokens.append(nxt)
        token = nxt[:, None]
    return torch.stack(tokens)


def default_compiler(device: torch.device) -> Callable[[Callable], Callable]:
    """How Engine compiles decode_all_rows: fullgraph, static shapes (one graph per bucket), and on CUDA
    mode="reduce-overhead" (each bucket's step recorded once as a CUDA graph, then one launch per step instead
    of hundreds of small kernels). (dynamic=True would compile fewer graphs, but torch 2.13 specialises the
    rows and the mask's length of this step anyway: measured, 7 graphs for 9 buckets.)"""
    mode = "reduce-overhead" if device.type == "cuda" else None
    return lambda fn: torch.compile(fn, mode=mode, fullgraph=True, dynamic=False)


def row_buckets(max_batch: int) -> tuple[int, ...]:
    """The compiled step's numbers of rows: powers of 4 from 4 below max_batch, and max_batch (16: 4, 16;
    64: 4, 16, 64). A decode step reads every weight whatever its rows, so fewer than 4 would save little."""
    return (*[4**i for i in range(1, 8) if 4**i < max_batch], max_batch)


def length_buckets(block_size: int) -> tuple[int, ...]:
    """The compiled step's numbers of slots: a quarter of the context (in the model's length buckets) and all
    of it (1,024: 256, 1,024): a reply of ~100 tokens reads a quarter of the cache, not all of it."""
    return tuple(sorted({bucketed_length(max(1, block_size // 4), block_size), block_size}))


def prefill_groups(lengths: list[int], waste: float = 0.25, starts: list[int] | None = None,
                   room: int | None = None) -> list[list[int]]:
    """The prompts admitted together (the lengths to compute), as groups to prefill together (indices into
    lengths): shortest first, a group taking the next prompt while padding every prompt to the longest adds
    at most `waste` of the group's real tokens (a prompt of 1,000 tokens does not make fifteen of 10 cost
    1,000). With starts (each prompt's first position: the tokens before it are reused) and room (the
    context), a prompt's padding never runs past the context: start + the group's longest <= room."""
    groups: list[list[int]] = []
    real = top = 0  # the group's real tokens and its latest start
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        start = starts[i] if starts else 0
        if groups and (len(groups[-1]) + 1) * lengths[i] <= (1 + waste) * (real + lengths[i]) and \
                (room is None or max(top, start) + lengths[i] <= room):
            groups[-1].append(i)
            real, top = real + lengths[i], max(top, start)
        else:
            groups.append([i])
            real, top = lengths[i], start
    return groups


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> list[Logprob]:
    """Each row's Logprob of its token: logits (n, V) float32 as the model gave them, tokens (n,), with the k
    likeliest tokens' (one host synchronisation)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, tokens[:, None])[:, 0].tolist()
    if k == 0:
        return [Logprob(c) for c in chosen]
    values, ids = logp.topk(min(k, logp.size(1)), dim=-1)
    return [Logprob(c, tuple(zip(i, v))) for c, i, v in zip(chosen, ids.tolist(), values.tolist())]


# ----------------------------------------------------------------------------- the engine


class Engine:
    """Decodes the submitted requests together: at most max_batch at a time (the KV cache's rows), at most
    max_queue more waiting for a row (submit raises QueueFull beyond: max_batch + max_queue in all).

    compile: the static compiled decode step (see the module docstring): True, False or None (auto: on CUDA
    where torch.compile can run; runtime.resolve_compile). Under auto a step that fails to compile at start
    falls back to the eager one (decode_mode says why); under True start() raises. compiler: what compiles
    decode_all_rows (default: default_compiler's torch.compile; tests pass a cheaper backend). buckets: the
    compiled step's (numbers of rows, numbers of slots), each ascending and ending at max_batch and
    block_size (default: row_buckets and length_buckets).

    prefix_cache: the prefix cache's bound in bytes (see the module docstring; 0 turns it off, and with it
    every reuse; None: prefix_cache.auto_bound, a quarter of the memory available now, at most 4 GiB).

    threads: torch's CPU threads, set on the engine's thread when it starts (default: torch.get_num_threads()
    when the engine is made). The engine's thread should be the only one that runs torch's parallel work: a
    second thread's OpenMP team (the main thread's, had it loaded the model with several threads) makes GNU
    OpenMP manage more threads than there are cores, and then every parallel region of a step wakes sleeping
    threads instead of spinning ones (GPT-2 small in int8 on 2 cores: 9 ms a token against 6). serve.py loads
    the model with one thread and gives the engine the count.

    window: K > 1 decodes K tokens per call where every active row allows it (_windowable: no logit_bias,
    penalties nor logprobs, the same temperature, top-k and top-p, K positions left in the context), else one
    token per step; each request's tokens are the same either way (its own generator's draws, K at a time).
    Compiled, a window is one graph per bucket and sampling options (on CUDA one CUDA graph replay per K
    tokens), compiled at start for window_sampling (chat.py: its one), on first use for others.
    """

    def __init__(self, model: GPT, *, max_batch: int = 16, max_queue: int = 64, compile: bool | None = None,
                 compiler: Callable[[Callable], Callable] | None = None,
                 buckets: tuple[tuple[int, ...], tuple[int, ...]] | None = None, threads: int | None = None,
                 prefix_cache: int | None = None, window: int = 1, window_sampling: SamplingOptions | None = None):
        if max_batch < 1 or max_queue < 0:
            raise ValueError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch}, {max_queue}")
        if not (isinstance(window, int) and window >= 1):
            raise ValueError(f"window must be an integer >= 1 (1 = a token per step), got {window!r}")
        self.model = model.eval()
        self.max_batch, self.max_queue = max_batch, max_queue
        self.threads = threads or torch.get_num_threads()
        self.block_size = model.config.block_size
        self.device = model.transformer.wte.weight.device
        self.waiting: collections.deque[Request] = collections.deque()
        self.active: list[_Row] = []  # active[i] holds row i of the cache
        self._cond = threading.Condition()
        self._accepting = True
        self._thread: threading.Thread | None = None
        self._seeds = torch.Generator().manual_seed(torch.seed())  # the streams of requests without a seed
        model.setup_kv_cache(max_batch)
        bound = auto_bound(self.device) if prefix_cache is None else prefix_cache
        self.prefix = PrefixCache(model, bound) if bound > 0 else None  # None: off
        self._parked: dict[int, list[int]] = {}  # a free row -> the tokens its slots still hold, from their 0
        # The compiled step (made on first use, on the engine's thread) and its inputs: tokens, positions.
        self.compiled, why = resolve_compile(compile, self.device)
        self.decode_mode = "decode step compiled on first use" if self.compiled else f"decode step eager ({why})"
        self._compile_asked = bool(compile)
        self._compiler = compiler or default_compiler(self.device)
        self._step_fn: Callable | None = None
        self._inputs = torch.zeros(2, max_batch, 1, dtype=torch.long, device=self.device)  # (2, R, 1)
        self.buckets = buckets or (row_buckets(max_batch), length_buckets(self.block_size))
        self._ran: set[tuple[int, int]] = set()  # the buckets whose step has run (so is compiled)
        # K-token windows (see _decode_window): their inputs, and the compiled ones by (rows, slots, options).
        self.window, self.window_sampling = window, window_sampling
        self._window_inputs = WindowInputs(max_batch, window, self.device) if window > 1 else None
        self._windows: dict[tuple, Callable] = {}
        self._window_compiler = compiler or window_step_compiler  # (a window's step: no CUDA graph of its own)
        self._window_step: Callable | None = None
        rows, lengths = self.buckets
        if list(rows) != sorted(set(rows)) or rows[-1] != max_batch or rows[0] < 1 or \
                list(lengths) != sorted(set(lengths)) or lengths[-1] != self.block_size or lengths[0] < 1:
            raise ValueError(f"buckets must be ascending numbers of rows up to {max_batch} and of slots up to "
                             f"{self.block_size}, got {self.buckets}")

    # ---- the outside: submit, start, stop

    def check(self, request: Request) -> None:
        """A ValueError saying what is wrong with a request the engine could never decode."""
        n = len(request.prompt)
        if not 1 <= n <= self.block_size:
            raise ValueError(f"the prompt has {n} tokens; it must have 1 to {self.block_size} (the model's "
                             f"context)")
        if request.max_tokens < (0 if request.prompt_logprobs else 1):
            raise ValueError(f"max_tokens must be at least 1 (0 only with prompt_logprobs), got "
                             f"{request.max_tokens}")
        vocab = self.model.config.vocab_size
        if min(request.prompt) < 0 or max(request.prompt) >= vocab:
            raise ValueError(f"the prompt holds a token id outside the vocabulary [0, {vocab})")
        if any(not 0 <= t < vocab for t in request.logit_bias):
            raise ValueError(f"logit_bias holds a token id outside the vocabulary [0, {vocab})")
        if request.logprobs is not None and not 0 <= request.logprobs <= vocab:
            raise ValueError(f"logprobs must be in 0..{vocab}, got {request.logprobs}")

    def submit(self, request: Request) -> Request:
        """Queue a request (it joins the batch at the next step with a free row); returns it, for cancel().
        Raises ValueError (see check), QueueFull or EngineStopped."""
        self.check(request)
        with self._cond:
            if not self._accepting:
                raise EngineStopped("the server is shutting down and takes no new requests")
            if len(self.active) + len(self.waiting) >= self.max_batch + self.max_queue:
                raise QueueFull(f"all {self.max_batch} rows are busy and {self.max_queue} requests are already "
                                f"waiting; try again later")
            self.waiting.append(request)
            self._cond.notify()
        return request

    def start(self) -> Engine:
        """Run the decode loop in a daemon thread (until stop). A compiled step is compiled there first, and
        start returns once it is ready (or, under compile=True, raises what compiling it raised)."""
        ready, failed = threading.Event(), []
        self._thread = threading.Thread(target=self._run, args=(ready, failed), name="gptkit-engine",
                                        daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            raise failed[0]
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Accept no more requests, finish every accepted one (waiting ones included), then end the loop."""
        with self._cond:
            self._accepting = False
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def load(self) -> tuple[int, int]:
        """(requests being decoded, requests waiting for a row)."""
        with self._cond:
            return len(self.active), len(self.waiting)

    def _run(self, ready: threading.Event, failed: list[Exception]) -> None:
        torch.set_num_threads(self.threads)  # (per thread in OpenMP: this one's is the engine's)
        try:
            if self.device.type == "cuda":  # the current device is per thread: this one's is the model's
                torch.cuda.set_device(self.device)
            self._warm_up()
        except Exception as e:  # compile=True and it cannot compile (or no such device): start() raises it
            failed.append(e)
            return
        finally:
            ready.set()
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not (self.waiting or self.active):
                        if not self._accepting:
                            return
                        self._cond.wait()
                try:
                    self.step()
                except Exception:  # never leave clients hanging: fail what was in flight, keep serving
                    traceback.print_exc()
                    self._fail_all()

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """Compile the static step and run it until it replays (CUDA graph trees: a warm-up run, the recording,
        a replay), before any request is served: every row is free, so the step writes only their slot 0.
        Under auto a failure falls back to the eager step."""
        if not self.compiled or self.active:  # (rows already decoding: it compiles on the first step instead)
            return
        began = time.perf_counter()
        try:
            for bucket in itertools.product(*self.buckets):
                for _ in range(3):
                    self._forward_static([], bucket)
            if self.window > 1 and self.window_sampling is not None:  # (every row free: each writes its slot 0)
                o = self.window_sampling
                options = SamplingOptions(temperature=o.temperature, top_k=o.top_k, top_p=o.top_p)
                for buffer in self._window_inputs.buffers():
                    buffer.zero_()
                for n, length in itertools.product(*self.buckets):
                    for _ in range(3):
                        self._run_window(n, length, options)
        except Exception as e:
            if self._compile_asked:
                raise
            self.compiled, self._step_fn = False, None
            self._windows.clear()
            self._window_step = None
            first = (str(e).strip().splitlines() or [""])[0][:200]
            self.decode_mode = (f"decode step eager: compiling it failed ({type(e).__name__}: {first}; "
                                f"compile=True raises it)")
            return
        rows, lengths = self.buckets
        where = "CUDA graphs" if self.device.type == "cuda" else "shapes"
        windows = f", and as many of {self.window} tokens" if self._windows else ""
        self.decode_mode = (f"decode step compiled in {time.perf_counter() - began:.1f} s ({len(rows) * len(lengths)} "
                            f"{where}: rows {', '.join(map(str, rows))} x slots {', '.join(map(str, lengths))}"
                            f"{windows})")

    # ---- one iteration

    @torch.inference_mode()
    def step(self) -> None:
        """Admit waiting requests into free rows, decode one token for every active row, retire the finished."""
        self._admit()
        if self.active:
            self._decode()
        self._retire()

    def _admit(self) -> None:
        """Waiting requests take the free rows. Each prompt reuses the longest prefix the engine holds
        (_plan_reuse); the rest of the prompts admitted together are prefilled together (_prefill, in groups
        of similar lengths: prefill_groups), and each one's first token is drawn from its prompt's last
        logits. A prompt admitted twice (n choices) is computed once: the others copy its row and logits."""
        admitted, cancelled = [], []
        with self._cond:
            while self.waiting and len(self.active) + len(admitted) < self.max_batch:
                request = self.waiting.popleft()
                (cancelled if request.cancelled else admitted).append(request)
        for request in cancelled:
            request.emit(Finished("cancelled", 0))
        try:
            self._place(admitted)
        except BaseException:  # a failed prefill: the admitted requests it left out of the active rows are told
            placed = {id(row.request) for row in self.active}  # here (the active ones by _fail_all)
            for request in admitted:
                if id(request) not in placed:
                    request.emit(Finished("error", 0))
            raise

    def _place(self, admitted: list[Request]) -> None:
        """The admitted requests' rows: their prompts computed (or copied), their first tokens drawn."""
        leaders: dict[tuple[int, ...], _Row] = {}  # a prompt -> the row that computes it
        rows, copies = [], collections.defaultdict(list)  # the rows computed; a leader -> the rows that copy it
        for request in admitted:
            seed = request.seed if request.seed is not None else int(torch.randint(2**62, (1,),
                                                                                   generator=self._seeds))
            row = _Row(request, len(request.prompt), torch.Generator(self.device).manual_seed(seed))
            key = tuple(request.prompt)
            leader = leaders.get(key) if self.prefix is not None else None
            if leader is None:
                leaders[key] = row
                rows.append(row)
            else:
                copies[leader].append(row)
                row.start = request.cached_tokens = row.length
                self.prefix.count(row.length, row.length)
        self._plan_reuse(rows)
        where = {}  # a computed row -> its row of the cache
        for group in prefill_groups([r.length - r.start for r in rows], starts=[r.start for r in rows],
                                    room=self.block_size):
            computed, first = [rows[i] for i in group], len(self.active)
            logits = self._prefill(computed)
            self.active += computed
            members, picks = list(computed), list(range(len(computed)))  # the rows, their logits' rows
            for i, row in enumerate(computed):
                where[row] = first + i
                for copy in copies[row]:
                    self._parked.pop(len(self.active), None)
                    self.model.copy_cache_row(first + i, len(self.active), row.length)
                    self.active.append(copy)
                    members.append(copy)
                    picks.append(i)
            # (A request cancelled while its prompt was computed draws nothing: it leaves at the next retire.)
            drawn = [(row, i) for row, i in zip(members, picks) if not row.request.cancelled]
            if drawn:
                tokens = self._sample(logits[[i for _, i in drawn]], [row for row, _ in drawn])
                for (row, _), token in zip(drawn, tokens):
                    self._deliver(row, token)
        if self.prefix is not None:
            for row in rows:  # the prompts, for the requests to come (what is not held yet)
                self.prefix.insert(row.request.prompt, where[row])

    def _plan_reuse(self, rows: list[_Row]) -> None:
        """Each row's start: the longest prefix of its prompt (all but its last token, whose logits are
        needed) held in the prefix cache, or, for a request admitted alone, in the free row it is about to
        take, left as it was (then nothing is copied)."""
        if self.prefix is None:
            return
        for row in rows:
            row.found = self.prefix.match(row.request.prompt[:-1])
            row.start = row.found.length
        held = self._parked.get(len(self.active)) if len(rows) == 1 else None
        if held is not None and (here := common_length(held, rows[0].request.prompt[:-1])) >= rows[0].start:
            rows[0].start, rows[0].found = here, None
        for row in rows:
            row.request.cached_tokens = row.start
            self.prefix.count(row.length, row.start)

    def _prefill(self, rows: list[_Row]) -> torch.Tensor:
        """One forward over the prompts of `rows` into the next free rows of the cache, each row's prompt
        from its start (the tokens before it reused: copied in from the prefix cache first) -> the (k, V)
        logits of each prompt's last token. The prompts are right-padded to the longest: attention is causal,
        so a prompt's tokens never see the padding after them, and the padding's slots (inside the context:
        prefill_groups) are rewritten by the row's next steps before anything reads them."""
        first, k = len(self.active), len(rows)
        for i, r in enumerate(rows):
            self._parked.pop(first + i, None)
            if r.found is not None and r.found.length:
                self.prefix.load(r.found, first + i)
        computed = [r.length - r.start for r in rows]
        tokens = torch.zeros(k, max(computed), dtype=torch.long)
        for i, r in enumerate(rows):
            tokens[i, : computed[i]] = torch.tensor(r.request.prompt[r.start:])
        tokens = tokens.to(self.device)
        T = tokens.size(1)
        if not any(r.start for r in rows):  # every prompt from slot 0: plain causal attention
            pos, length = torch.arange(T, device=self.device), T
        else:  # each row at its own positions, attending over its reused slots too
            starts = torch.tensor([r.start for r in rows])
            pos = (starts[:, None] + torch.arange(T)).to(self.device)  # (k, T)
            length = int(starts.max()) + T
        h = self.model.hidden_states(tokens, pos, rows=slice(first, first + k), length=length)  # (k, T, C)
        last = torch.tensor(computed, device=self.device) - 1
        return self.model.head(h[torch.arange(len(rows), device=self.device), last], fp32=True)  # (k, V)

    def _decode(self) -> None:
        rows = [r for r in self.active if r.finish is None and not r.request.cancelled]
        if len(rows) < len(self.active):  # someone left since the last step: close the gaps first
            self._retire()
            rows = self.active
            if not rows:
                return
        if self._windowable(rows):
            self._decode_window(rows)
            return
        logits = self._forward_static(rows) if self.compiled else self._forward_eager(rows)  # (A, V)
        for r in rows:
            r.length += 1
        for r, token in zip(rows, self._sample(logits, rows)):
            self._deliver(r, token)

    def _windowable(self, rows: list[_Row]) -> bool:
        """Whether these rows' next tokens can come K at a time: no row adjusts its logits or asks for logprobs
        (those need the host between tokens), all are drawn alike, and each has K positions left."""
        if self.window == 1:
            return False
        first = rows[0].request.sampling
        return all(not r.request.adjusts_logits and r.request.logprobs is None and _alike(r.request.sampling, first)
                   and r.length + self.window <= self.block_size for r in rows)

    def _decode_window(self, rows: list[_Row]) -> None:
        """K tokens of every active row in one call (decode_rows_window), then told row by row as K steps
        would: a row that finishes in the window (its stop token, max_tokens) is told nothing after, nor is one
        cancelled meanwhile. Each row's K uniforms are drawn first from its generator, one by one: K draws of
        one are what K steps draw (on a GPU one draw of K would be other numbers)."""
        A, K, inputs = len(rows), self.window, self._window_inputs
        o = rows[0].request.sampling
        options = SamplingOptions(temperature=o.temperature, top_k=o.top_k, top_p=o.top_p)
        n, length = self.window_bucket(rows) if self.compiled else (A, max(r.length for r in rows) + 1)
        host = torch.zeros(3, n, 1, dtype=torch.long)
        host[:, :A, 0] = torch.tensor([[r.last for r in rows], [r.length for r in rows], [1] * A])
        for i, dst in enumerate((inputs.tokens, inputs.pos, inputs.active)):
            dst[:n].copy_(host[i])
        if options.temperature > 0:
            uniform = torch.cat([torch.rand(1, generator=r.generator, dtype=torch.float64, device=self.device)
                                 for r in rows for _ in range(K)])
            inputs.uniform[:, :A].copy_(uniform.view(A, K).t())
        if self.compiled:
            tokens = self._run_window(n, length, options)
        else:
            tokens = decode_rows_window(self.model, inputs, options, K, A, length, grow=True)
        for step in tokens[:, :A].tolist():  # (the one host synchronisation of the window)
            for r, token in zip(rows, step):
                if r.finish is None and not r.request.cancelled:
                    r.length += 1
                    self._deliver(r, token)

    def window_bucket(self, rows: list[_Row]) -> tuple[int, int]:
        """A compiled window's (rows, slots): the smallest buckets that hold the rows and each row's K next
        positions."""
        n_rows, lengths = self.buckets
        longest = max((r.length for r in rows), default=0) + self.window - 1
        return (next(n for n in n_rows if n >= len(rows)), next(n for n in lengths if n > longest))

    def _run_window(self, n: int, length: int, options: SamplingOptions) -> torch.Tensor:
        """The compiled window of a bucket (n rows, `length` slots) and options, made on first use -> (K, n)
        tokens, a tensor of their own: its step compiled (one graph per bucket and options), and on a GPU its K
        calls recorded as one CUDA graph (generate.CapturedWindow), replayed per window. The bucket's free rows
        write their slot 0 (see _forward_static)."""
        for r in range(len(self.active), n):
            self._parked.pop(r, None)
        key = (n, length, options)
        first = key not in self._windows
        if first:
            model, inputs, steps = self.model, self._window_inputs, self.window
            if self._window_step is None:
                self._window_step = self._window_compiler(decode_rows_step)
            step = self._window_step

            def window() -> torch.Tensor:
                return decode_rows_window(model, inputs, options, steps, n, length, grow=False, step=step)

            self._windows[key] = (CapturedWindow(window, watch=lambda: model_addresses(model))
                                  if self.device.type == "cuda" else window)
        # Each bucket and options a graph of the same step: more than Dynamo's default limit of 8, maybe.
        limit = contextlib.nullcontext() if not first else torch._dynamo.config.patch(
            recompile_limit=max(8, 2 * len(self._windows) * len(self.buckets[0]) * len(self.buckets[1])))
        with no_tf32(), limit:
            return self._windows[key]()

    def _forward_eager(self, rows: list[_Row]) -> torch.Tensor:
        """Rows 0..A-1, each at its own position, reading the slots filled so far (the longest row's) -> the
        logits (A, V) of their next tokens. On the CPU exactly those slots, not the model's length bucket
        above them: at a full batch the cache's reads outweigh the weights' (BENCHMARKS.md, "A full batch on
        the CPU"), and the CPU's attention plans nothing per length."""
        inputs = torch.tensor([[[r.last] for r in rows], [[r.length] for r in rows]], device=self.device)
        return decode_one_token(self.model, inputs[0], inputs[1], rows=slice(0, len(rows)),  # (A, 1) each
                                length=max(r.length for r in rows) + 1, exact=self.device.type == "cpu")

    def bucket(self, rows: list[_Row]) -> tuple[int, int]:
        """The compiled step's (rows, slots) for these active rows: the smallest buckets that hold them all and
        every row's next position (row.length)."""
        n_rows, lengths = self.buckets
        longest = max((r.length for r in rows), default=0)
        return (next(n for n in n_rows if n >= len(rows)), next(n for n in lengths if n > longest))

    def _forward_static(self, rows: list[_Row], bucket: tuple[int, int] | None = None) -> torch.Tensor:
        """The compiled step over a bucket of rows and slots (default: self.bucket(rows)) -> the logits (A, V)
        of the active rows 0..A-1. The bucket's free rows are fed token 0 at position 0 (the module docstring
        says why that is harmless)."""
        n, length = bucket or self.bucket(rows)
        free = n - len(rows)
        for r in range(len(rows), n):  # (the step writes slot 0 of the bucket's free rows)
            self._parked.pop(r, None)
        host = torch.tensor([[r.last for r in rows] + [0] * free, [r.length for r in rows] + [0] * free])
        inputs = self._inputs[:, :n]
        inputs.copy_(host[..., None])  # one copy to the device: tokens and positions, (2, n, 1)
        if self._step_fn is None:
            self._step_fn = self._compiler(decode_all_rows)
        if self.device.type == "cuda":  # a new step: the CUDA graph may overwrite the last step's outputs
            torch.compiler.cudagraph_mark_step_begin()
        # A bucket's first step compiles its graph: maybe more graphs than Dynamo's default limit of 8.
        first = contextlib.nullcontext() if (n, length) in self._ran else torch._dynamo.config.patch(
            recompile_limit=max(8, len(self.buckets[0]) * len(self.buckets[1])))
        # Inductor's matmuls follow the TF32 flag in force at the call (see generate.compile_decode_step).
        with no_tf32(), first:
            logits = self._step_fn(self.model, inputs[0], inputs[1], length)  # (n, V)
        self._ran.add((n, length))
        # A CUDA graph's outputs live in memory its next replay rewrites: keep a copy of what is used.
        return logits[: len(rows)].clone()

    def _deliver(self, row: _Row, token: int) -> None:
        request = row.request
        if request.prompt_logprobs and not row.scored:  # before the request's first token
            row.scored = True
            request.emit(PromptLogprobs(self._prompt_logprobs(request)))
        logprob, row.logprob = row.logprob, None
        if row.emitted >= request.max_tokens:  # max_tokens=0: the prompt was only to be scored
            row.finish = "length"
            return
        if token in request.stop_ids:
            row.finish = "stop"
            if logprob is not None:
                request.emit(Token(token, logprob, final=True))
            return
        request.emit(Token(token, logprob))
        row.emitted += 1
        row.last = token
        row.reply.append(token)
        # The next step would feed `token` in at position row.length: there must be a slot for it.
        if row.emitted >= request.max_tokens or row.length >= self.block_size:
            row.finish = "length"

    def _retire(self) -> None:
        """Finished and cancelled rows leave (what their rows hold kept in the prefix cache); the last active
        row moves into each hole."""
        i = 0
        while i < len(self.active):
            row = self.active[i]
            reason = row.finish or ("cancelled" if row.request.cancelled else None)
            if reason is None:
                i += 1
                continue
            last = len(self.active) - 1
            moved = self.active.pop()
            if i != last:
                self.active[i] = moved
            if self.prefix is not None:  # (row i still holds it: the moved row's slots come after)
                held = (row.request.prompt + row.reply)[: row.length]  # the prompt and the tokens fed back
                self.prefix.insert(held, i)  # (only the reply's tokens are new: a copy of ~1 ms)
                if i == last:  # the row stays as it is until another request takes it
                    self._parked[i] = held
            row.request.emit(Finished(reason, row.emitted))  # (once held: the next turn finds it)
            if i != last:
                self.model.copy_cache_row(last, i, moved.length)

    def _sample(self, logits: torch.Tensor, rows: list[_Row]) -> list[int]:
        """One token per row of logits (n, V), each drawn with its request's options and generator; the one
        host synchronisation of a step (the tokens are needed on the host to be sent). Rows whose requests
        ask for them get their logit_bias and penalties first (_adjusted), and their drawn token's Logprob
        (row.logprob, from the logits as the model gave them)."""
        raw, logits = logits, self._adjusted(logits, rows)
        out = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        groups: dict[tuple, list[int]] = collections.defaultdict(list)  # rows drawn alike, drawn together
        for i, r in enumerate(rows):
            o = r.request.sampling
            groups[(o.temperature, o.top_k, o.top_p)].append(i)
        for idx in groups.values():
            options = rows[idx[0]].request.sampling
            alike = len(idx) == len(rows)  # (every row: no gathering, no scattering)
            sel = None if alike else torch.tensor(idx, device=logits.device)
            group = logits if alike else logits[sel]
            # One uniform per row from its own generator (none when greedy).
            uniform = None if options.temperature == 0 else torch.cat(
                [torch.rand(1, generator=rows[i].generator, dtype=torch.float64, device=logits.device) for i in idx])
            picked = draw(group, options, uniform)
            if alike:
                out = picked
            else:
                out[sel] = picked
        tokens = out.tolist()
        for r, token in zip(rows, tokens):
            if r.counts is not None:
                r.counts[token] += 1
        asking = [i for i, r in enumerate(rows) if r.request.logprobs is not None]
        if asking:
            k = max(rows[i].request.logprobs for i in asking)
            found = _logprobs(raw[asking], out[asking], k)
            for i, logprob in zip(asking, found):
                rows[i].logprob = Logprob(logprob.logprob, logprob.top[: rows[i].request.logprobs])
        return tokens

    def _adjusted(self, logits: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
        """The logits (n, V) with each row's logit_bias added and its frequency and presence penalties taken
        away (a copy; the logits themselves when no row has any)."""
        changed = [i for i, r in enumerate(rows) if r.request.adjusts_logits]
        if not changed:
            return logits
        logits = logits.clone()
        for i in changed:
            r, request = rows[i], rows[i].request
            if request.logit_bias and r.bias is None:
                ids = torch.tensor(list(request.logit_bias), dtype=torch.long, device=logits.device)
                bias = torch.tensor([float("-inf") if b <= BAN else b for b in request.logit_bias.values()],
                                    device=logits.device)
                r.bias = ids, bias
            if r.bias is not None:
                logits[i].index_add_(0, *r.bias)
            if request.frequency_penalty or request.presence_penalty:
                if r.counts is None:  # the reply's first token: nothing to take away yet
                    r.counts = torch.zeros(logits.size(1), device=logits.device)
                else:
                    logits[i] -= (r.counts * request.frequency_penalty
                                  + (r.counts > 0).float() * request.presence_penalty)
        return logits

    def _prompt_logprobs(self, request: Request) -> tuple[Logprob | None, ...]:
        """Each prompt token's Logprob given the ones before it: one forward over the prompt that leaves the
        KV cache alone (the prefill filled it already), its head taken a slice of positions at a time."""
        n = len(request.prompt)
        prompt = torch.tensor([request.prompt], dtype=torch.long, device=self.device)  # (1, n)
        h = bucketed_forward(self.model.hidden_states, prompt, self.block_size)[0]  # (n, C): i predicts i + 1
        found: list[Logprob | None] = [None]
        chunk = max(1, (1 << 24) // self.model.config.vocab_size)  # positions whose float32 logits take 64 MB
        for lo in range(0, n - 1, chunk):
            hi = min(lo + chunk, n - 1)
            logits = self.model.head(h[lo:hi], fp32=True)  # (hi - lo, V)
            found += _logprobs(logits, prompt[0, lo + 1: hi + 1], request.logprobs or 0)
        return tuple(found)

    def _fail_all(self) -> None:
        self._parked.clear()
        if self.prefix is not None:  # (a step that failed half-way through an insertion: start afresh)
            self.prefix.reset()
        with self._cond:
            waiting, self.waiting = list(self.waiting), collections.deque()
        for row in self.active:
            row.request.emit(Finished("error", row.emitted))
        self.active = []
        for request in waiting:
            request.emit(Finished("error", 0))
