"""The continuous-batching engine: many requests decoded together by one model. A request joins the running
batch between two decode steps and leaves it as soon as it is done, so nobody waits for anybody else's reply.

    engine = Engine(model, max_batch=16, max_queue=64).start()     # the decode loop, in a thread of its own
    request = engine.submit(Request(prompt_ids, max_tokens=100, emit=on_event))
    request.cancel()                                               # the client left: its row is freed at once
    engine.stop()                                                  # finish what was accepted, then end

One iteration of the loop (`Engine.step`):
    1. admit   waiting requests take the free rows of the KV cache: each prompt is prefilled alone into its
               row, and the request's first token is drawn from the prompt's last logits;
    2. decode  one forward over all active rows, each row at its own position (one token each), then one
               token per row, drawn with that request's own options and random stream;
    3. retire  finished and cancelled requests leave; the last active row moves into the hole, so the active
               rows are always rows 0..A-1 of the cache and the forward reads views of it, never copies.
Each request is told its tokens, one by one, and then how it finished, through its `emit` callback (called on
the engine's thread: a server hands them over to its event loop).

A request's reply does not depend on who else is being served: its rows of the cache are its own, its draws
come from its own generator (seeded from `seed`), and each row's attention sees only its own slots. Only the
rounding of the batched matmuls differs from decoding it alone.

The decode step, eager or compiled (`compile`: auto = compiled on CUDA where torch.compile can run):
    eager      rows 0..A-1 only, attending over the slots filled so far: its shapes change every step;
    compiled   one static step over all max_batch rows of the cache and all its block_size slots (the mask
               hides what a row has not written), compiled once with fullgraph=True and static shapes, on
               CUDA as one CUDA graph that replays every step (mode="reduce-overhead"). The active rows
               feed their tokens at their own positions; each free row is fed token 0 at position 0 of its
               own row, a slot that the prefill of that row's next request overwrites before anything reads
               it (a retired row is copied away before the step, and copy_cache_row copies filled slots
               only). Only the active rows' logits are sampled.
It is compiled on the engine's thread (CUDA graphs belong to the thread that records them) when the engine
starts, before the server says it is ready: no request waits for the compiler.

The engine knows nothing of HTTP nor of text (gptkit/serving/routes.py has both): prompts and replies are
token ids.
"""

from __future__ import annotations

import collections
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gptkit.generate import SamplingOptions, decode_one_token, logits_to_probs, prefill, sample_token
from gptkit.runtime import resolve_compile
from model import GPT, no_tf32

# ----------------------------------------------------------------------------- what the engine says


@dataclass(frozen=True)
class Token:
    """The request's next token."""

    id: int


@dataclass(frozen=True)
class Finished:
    """The request is done. reason: "stop" (it drew one of its stop tokens, which is not emitted), "length"
    (max_tokens, or the model's context is full), "cancelled" (Request.cancel), "error" (the step failed; the
    engine logs why and goes on serving). completion_tokens: the tokens emitted."""

    reason: str
    completion_tokens: int


Event = Token | Finished


class EngineError(Exception):
    """A request the engine cannot take now."""


class QueueFull(EngineError):
    """Every row is busy and max_queue requests are already waiting."""


class EngineStopped(EngineError):
    """The engine is stopping (or stopped) and accepts no new request."""


# ----------------------------------------------------------------------------- a request


@dataclass(eq=False)
class Request:
    """One reply to decode. prompt: its token ids (1 .. block_size of them); max_tokens: the most tokens to
    emit; sampling: temperature, top_k, top_p (its stop_token and window_shift are not used here: stop_ids);
    stop_ids: tokens that end the reply; seed: the random stream of the draws (None: a fresh one);
    emit: called with each Event, on the engine's thread."""

    prompt: list[int]
    max_tokens: int
    emit: Callable[[Event], None]
    sampling: SamplingOptions = field(default_factory=lambda: SamplingOptions(temperature=0))
    stop_ids: frozenset[int] = frozenset()
    seed: int | None = None
    cancelled: bool = False

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


# ----------------------------------------------------------------------------- the compiled step


def decode_all_rows(model: GPT, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The static decode step: one token for every row of the KV cache, tokens (R, 1) each at its row's own
    position pos (R, 1), attending over all block_size slots (masked past each position) -> float32 logits
    (R, V). Its shapes never change from one step to the next: it compiles to one graph."""
    return decode_one_token(model, tokens, pos)


def default_compiler(device: torch.device) -> Callable[[Callable], Callable]:
    """How Engine compiles decode_all_rows: fullgraph, static shapes, and on CUDA mode="reduce-overhead" (the
    step recorded once as a CUDA graph, then one launch per step instead of hundreds of small kernels)."""
    mode = "reduce-overhead" if device.type == "cuda" else None
    return lambda fn: torch.compile(fn, mode=mode, fullgraph=True, dynamic=False)


# ----------------------------------------------------------------------------- the engine


class Engine:
    """Decodes the submitted requests together: at most max_batch at a time (the KV cache's rows), at most
    max_queue more waiting for a row (submit raises QueueFull beyond: max_batch + max_queue in all).

    compile: the static compiled decode step (see the module docstring): True, False or None (auto: on CUDA
    where torch.compile can run; runtime.resolve_compile). Under auto a step that fails to compile at start
    falls back to the eager one (decode_mode says why); under True start() raises. compiler: what compiles
    decode_all_rows (default: default_compiler's torch.compile; tests pass a cheaper backend)."""

    def __init__(self, model: GPT, *, max_batch: int = 16, max_queue: int = 64, compile: bool | None = None,
                 compiler: Callable[[Callable], Callable] | None = None):
        if max_batch < 1 or max_queue < 0:
            raise ValueError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch}, {max_queue}")
        self.model = model.eval()
        self.max_batch, self.max_queue = max_batch, max_queue
        self.block_size = model.config.block_size
        self.device = model.transformer.wte.weight.device
        self.waiting: collections.deque[Request] = collections.deque()
        self.active: list[_Row] = []  # active[i] holds row i of the cache
        self._cond = threading.Condition()
        self._accepting = True
        self._thread: threading.Thread | None = None
        self._seeds = torch.Generator().manual_seed(torch.seed())  # the streams of requests without a seed
        model.setup_kv_cache(max_batch)
        # The compiled step (made on first use, on the engine's thread) and its inputs: tokens, positions.
        self.compiled, why = resolve_compile(compile, self.device)
        self.decode_mode = "decode step compiled on first use" if self.compiled else f"decode step eager ({why})"
        self._compile_asked = bool(compile)
        self._compiler = compiler or default_compiler(self.device)
        self._step_fn: Callable | None = None
        self._inputs = torch.zeros(2, max_batch, 1, dtype=torch.long, device=self.device)  # (2, R, 1)

    # ---- the outside: submit, start, stop

    def check(self, request: Request) -> None:
        """A ValueError saying what is wrong with a request the engine could never decode."""
        n = len(request.prompt)
        if not 1 <= n <= self.block_size:
            raise ValueError(f"the prompt has {n} tokens; it must have 1 to {self.block_size} (the model's "
                             f"context)")
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {request.max_tokens}")
        vocab = self.model.config.vocab_size
        if min(request.prompt) < 0 or max(request.prompt) >= vocab:
            raise ValueError(f"the prompt holds a token id outside the vocabulary [0, {vocab})")

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
            for _ in range(3):
                self._forward_static([])
        except Exception as e:
            if self._compile_asked:
                raise
            self.compiled, self._step_fn = False, None
            first = (str(e).strip().splitlines() or [""])[0][:200]
            self.decode_mode = (f"decode step eager: compiling it failed ({type(e).__name__}: {first}; "
                                f"compile=True raises it)")
            return
        where = "one CUDA graph" if self.device.type == "cuda" else "one graph"
        self.decode_mode = (f"decode step compiled in {time.perf_counter() - began:.1f} s ({where} over all "
                            f"{self.max_batch} rows)")

    # ---- one iteration

    @torch.inference_mode()
    def step(self) -> None:
        """Admit waiting requests into free rows, decode one token for every active row, retire the finished."""
        self._admit()
        if self.active:
            self._decode()
        self._retire()

    def _admit(self) -> None:
        while len(self.active) < self.max_batch:
            with self._cond:
                if not self.waiting:
                    return
                request = self.waiting.popleft()
            if request.cancelled:
                request.emit(Finished("cancelled", 0))
                continue
            row, n = len(self.active), len(request.prompt)
            prompt = torch.tensor([request.prompt], dtype=torch.long, device=self.device)  # (1, n)
            # The prompt alone into its row, attending over its own n slots: (1, V) logits of its last token.
            logits = prefill(self.model, prompt, torch.arange(n, device=self.device), rows=slice(row, row + 1),
                             length=n)
            seed = request.seed if request.seed is not None else int(torch.randint(2**62, (1,),
                                                                                   generator=self._seeds))
            state = _Row(request, n, torch.Generator(self.device).manual_seed(seed))
            self.active.append(state)
            self._deliver(state, self._sample(logits, [state])[0])

    def _decode(self) -> None:
        rows = [r for r in self.active if r.finish is None and not r.request.cancelled]
        if len(rows) < len(self.active):  # someone left since the last step: close the gaps first
            self._retire()
            rows = self.active
            if not rows:
                return
        logits = self._forward_static(rows) if self.compiled else self._forward_eager(rows)  # (A, V)
        for r in rows:
            r.length += 1
        for r, token in zip(rows, self._sample(logits, rows)):
            self._deliver(r, token)

    def _forward_eager(self, rows: list[_Row]) -> torch.Tensor:
        """Rows 0..A-1, each at its own position, reading the slots filled so far (the longest row's) -> the
        logits (A, V) of their next tokens."""
        tokens = torch.tensor([[r.last] for r in rows], dtype=torch.long, device=self.device)  # (A, 1)
        pos = torch.tensor([[r.length] for r in rows], dtype=torch.long, device=self.device)  # (A, 1)
        return decode_one_token(self.model, tokens, pos, rows=slice(0, len(rows)),
                                length=max(r.length for r in rows) + 1)

    def _forward_static(self, rows: list[_Row]) -> torch.Tensor:
        """The compiled step over all max_batch rows -> the logits (A, V) of the active rows 0..A-1. The free
        rows are fed token 0 at position 0 (the module docstring says why that is harmless)."""
        free = self.max_batch - len(rows)
        host = torch.tensor([[r.last for r in rows] + [0] * free, [r.length for r in rows] + [0] * free])
        self._inputs.copy_(host[..., None])  # one copy to the device: tokens and positions, (2, R, 1)
        if self._step_fn is None:
            self._step_fn = self._compiler(decode_all_rows)
        if self.device.type == "cuda":  # a new step: the CUDA graph may overwrite the last step's outputs
            torch.compiler.cudagraph_mark_step_begin()
        # Inductor's matmuls follow the TF32 flag in force at the call (see generate.compile_decode_step).
        with no_tf32():
            logits = self._step_fn(self.model, self._inputs[0], self._inputs[1])  # (R, V)
        # A CUDA graph's outputs live in memory its next replay rewrites: keep a copy of what is used.
        return logits[: len(rows)].clone()

    def _deliver(self, row: _Row, token: int) -> None:
        request = row.request
        if token in request.stop_ids:
            row.finish = "stop"
            return
        request.emit(Token(token))
        row.emitted += 1
        row.last = token
        # The next step would feed `token` in at position row.length: there must be a slot for it.
        if row.emitted >= request.max_tokens or row.length >= self.block_size:
            row.finish = "length"

    def _retire(self) -> None:
        """Finished and cancelled rows leave; the last active row moves into each hole."""
        i = 0
        while i < len(self.active):
            row = self.active[i]
            reason = row.finish or ("cancelled" if row.request.cancelled else None)
            if reason is None:
                i += 1
                continue
            last = len(self.active) - 1
            if i != last:
                moved = self.active[last]
                self.model.copy_cache_row(last, i, moved.length)
                self.active[i] = moved
            self.active.pop()
            row.request.emit(Finished(reason, row.emitted))

    def _sample(self, logits: torch.Tensor, rows: list[_Row]) -> list[int]:
        """One token per row of logits (n, V), each drawn with its request's options and generator; the one
        host synchronisation of a step (the tokens are needed on the host to be sent)."""
        out = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        groups: dict[tuple, list[int]] = collections.defaultdict(list)  # rows drawn alike, drawn together
        for i, r in enumerate(rows):
            o = r.request.sampling
            groups[(o.temperature, o.top_k, o.top_p)].append(i)
        for (temperature, top_k, top_p), idx in groups.items():
            sel = torch.tensor(idx, device=logits.device)
            if temperature == 0:
                out[sel] = logits[sel].argmax(dim=-1)
                continue
            probs = logits_to_probs(logits[sel], SamplingOptions(temperature=temperature, top_k=top_k,
                                                                 top_p=top_p))
            noise = torch.stack([torch.empty(logits.size(1), device=logits.device).exponential_(
                generator=rows[i].generator) for i in idx])  # each request's own stream, (m, V)
            out[sel] = sample_token(probs, noise)
        return out.tolist()

    def _fail_all(self) -> None:
        with self._cond:
            waiting, self.waiting = list(self.waiting), collections.deque()
        for row in self.active:
            row.request.emit(Finished("error", row.emitted))
        self.active = []
        for request in waiting:
            request.emit(Finished("error", 0))
