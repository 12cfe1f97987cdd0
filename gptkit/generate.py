"""Decoding: continuing prompts with a GPT (model.py), one token at a time, in reading order.

    SamplingOptions          how to pick tokens: temperature, top-k, top-p, stop token, window shift
    logits_to_probs          logits (B, V) -> probabilities (B, V) after temperature, top-k, top-p
    candidates               the same, as the candidate tokens (most likely first) and their probabilities
    exponential_noise        the randomness of one step: Exp(1) noise (B, V), drawn from a seeded generator
    sample_token             probabilities (B, V) and noise (B, V) -> one drawn token per row (B,)
    inverse_cdf_draw         probabilities (B, n) and one uniform per row (B,) -> one drawn index per row (B,)
    next_token               logits (B, V) -> the next token (B,): the argmax at temperature 0, else a draw
    prefill                  one forward over a window (B, T) that fills the KV cache -> logits (B, V)
    decode_one_token         one cached step: tokens (B, 1) at position pos (1,) or (B, 1) -> logits (B, V)
    decode_step              decode_one_token and next_token: the whole step, tokens (B, 1) -> next tokens (B,)
    compile_decode_step      decode_step and its windows compiled (a CUDA graph on a GPU), and when --compile=auto
                             does it
    decode_window            K decode_steps in one function, the state on the device -> K tokens (K, B)
    DecodeWindow             decode_window for one model, batch size, options and K, eager or compiled
    CapturedWindow           a compiled window's K steps recorded as one CUDA graph, replayed per K tokens
    generate_blocks          the loop: yields the next tokens of every sequence, (B, 1) a step or (B, K) a window
    generate_stream          the same a token at a time, (B,)
    generate                 the prompts with their continuations, (B, T + n)
    check_decode_memory      before sizing buffers from a user's max_new_tokens: a one-line error saying what fits
    TextStream               streamed token ids -> text that can be printed at once (whole characters)

Shapes use B = batch (sequences decoded together), T = tokens in the model's window, V = vocab_size.

Every function takes the model as an argument and keeps no state of its own: the KV cache lives in the model
(`GPT.setup_kv_cache`). `decode_step` always sees the same shapes (one token per sequence, a (1,) position,
the noise, the preallocated cache), so it compiles to one graph, which mode="reduce-overhead" replays as one
CUDA graph per token: the model's forward and the choice of the token (temperature, top-k, top-p, the draw)
with no host synchronisation and no kernel launches of its own (see compile_decode_step).

Many tokens per call: a window (`window=K` in generate, sample.py's DECODE_WINDOW when compiled) is K
decode_steps in one function, each step's token fed to the next, the positions advanced and the stop token
masked on the device, its state (the last token, the position, the finished rows, the K steps' noise) in
device buffers that never move. Compiled, its step is compiled once and, on a GPU, the window's K calls are
recorded as one CUDA graph (CapturedWindow): the host does per K tokens what it did per token (one replay, the
noise's draws, one copy of the K tokens out), and Dynamo's guards run only while the graph is recorded. Windows
run where K cached steps fit before the context must move; the other steps go one token at a time
(generate_blocks). The tokens are those of one step at a time, bit for bit where the same kernels run
(eagerly; the CPU tests).

Drawing a token: the Gumbel-max trick in its exponential form. With E_i ~ Exp(1) independent,
argmax_i p_i / E_i is token i with probability p_i (the smallest of the "arrival times" E_i / p_i wins), so a
draw is an argmax over the probabilities and a noise tensor: a few fused element-wise kernels, unlike
torch.multinomial (a dozen kernels and a host-side check). The noise comes from the caller's seeded
torch.Generator, drawn outside the compiled step into one buffer per generation (one kernel per token; a
window's K buffers before it) and passed in: a torch.Generator cannot be used inside a compiled graph, and
inductor's own in-graph RNG would give other numbers than eager. So a seed gives the same tokens eagerly and
compiled, cached and uncached, a token or a window at a time, on a given device. Logits are float32
(`GPT.head(fp32=True)`) from the head on.

The window: the model learned positions 0..block_size-1 only, so it sees at most the last block_size tokens,
with positions counted from the window's start. `prefill` fills the cache from the whole window; each new
token then costs one `decode_step`. When one more token would not fit, the window moves forward by
`window_shift` tokens and `prefill` rebuilds the cache from the tokens it kept. Without the cache
(use_cache=False) every token is a full forward over the same windows, so both paths give the same tokens.

By default the window moves one token at a time: every token is predicted from exactly the last block_size
tokens, as nanoGPT's sample.py and model.generate do, so their tokens are ours. Past block_size that costs a
forward over the whole window per token (moving the window moves every kept token's position, so no cached key
stays valid), which is what nanoGPT pays for every token. A larger window_shift rebuilds the cache once per
`window_shift` tokens instead (BENCHMARKS.md: 500 tokens of the baby model on a CPU at 4.6 ms a token with a
shift of 64, against 26.5 with 1), but is an approximation: after a move the newest tokens see fewer than
block_size tokens before them, so the text past block_size differs from nanoGPT's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from gptkit.errors import UserError
from gptkit.runtime import ram, resolve_compile
from gptkit.settings import SamplingOptions, is_int
from model import GPT, no_tf32

# ----------------------------------------------------------------------------- options


# ----------------------------------------------------------------------------- sampling: logits -> a token


def logits_to_probs(logits: torch.Tensor, options: SamplingOptions) -> torch.Tensor:
    """Next-token logits (B, V) -> a probability distribution (B, V) after temperature, top-k and top-p.

    temperature 0 means greedy: all mass on the argmax. top_k keeps exactly the k largest logits; top_p keeps
    the smallest set of most likely tokens whose total probability reaches p (always at least one token).
    """
    logits = logits.float()
    if options.temperature == 0:
        return F.one_hot(logits.argmax(dim=-1), logits.size(-1)).to(logits.dtype)
    probs, order = candidates(logits, options)
    if order is None:
        return probs
    return torch.zeros_like(logits).scatter_(-1, order, probs)  # back to vocabulary order, (B, V)


def candidates(logits: torch.Tensor, options: SamplingOptions) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The tokens a draw can pick (temperature > 0), and their probabilities after temperature, top-k and
    top-p: (probs (B, n), order (B, n)), candidate j being token order[:, j], most likely first; or, without
    top-k and top-p, (probs (B, V), None): every token, in vocabulary order."""
    top_k, top_p = options.top_k, options.top_p
    logits = logits.float() / options.temperature
    use_k = top_k is not None and top_k < logits.size(-1)
    use_p = top_p is not None and top_p < 1.0
    if not (use_k or use_p):
        return F.softmax(logits, dim=-1), None
    # The candidates, most likely first: topk is sorted, and on a 50K vocabulary much cheaper than a full sort
    # (top-p alone has to sort them all: which tokens reach p can only be known in order).
    if use_k:
        values, order = torch.topk(logits, top_k, dim=-1)  # (B, k)
    else:
        values, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
    probs = F.softmax(values, dim=-1)
    if use_p:
        # Mass strictly before each candidate: it is kept while the ones before it have not reached p.
        before = torch.cumsum(probs, dim=-1) - probs
        probs = probs.masked_fill(before >= top_p, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs, order


def exponential_noise(
    shape: tuple[int, ...], device: torch.device | str = "cpu", generator: torch.Generator | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exp(1) noise of `shape` (float32) for sample_token, from `generator` (None: torch's default one),
    written into `out` when given (a buffer reused every step)."""
    out = out if out is not None else torch.empty(shape, device=device, dtype=torch.float32)
    return out.exponential_(generator=generator)


def sample_token(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Draw one token per row from probs (B, V) -> (B,), using Exp(1) noise (B, V): argmax(probs / noise),
    which picks token i with probability probs_i (the exponential race; see the module docstring). Tokens of
    probability 0 (cut by top-k/top-p) are never drawn. All on the device: no host synchronisation."""
    # An Exp(1) draw can be exactly 0 on some devices: 0/0 would be a NaN, which argmax would pick.
    return (probs / noise.clamp_min(1e-30)).argmax(dim=-1)


def inverse_cdf_draw(probs: torch.Tensor, uniform: torch.Tensor, block: int = 256) -> torch.Tensor:
    """Draw one index per row from probs (B, n) with one uniform draw in [0, 1) per row, uniform (B,): the
    first index whose cumulative probability exceeds u times the row's total (inverse transform sampling), so
    index i with probability probs_i / total. The rows need not sum to 1, and indices of probability 0 (cut
    by top-k/top-p) are never drawn. One random number per row instead of sample_token's noise over the whole
    row: what a server drawing each row from its own generator wants (the serving engine's sampler).
    Cumulated in float64, so that the last of 50K probabilities still moves the sum.

    A long row is searched in two steps, blocks of `block` indices then the index within the block found:
    the float64 cumulative sum of a whole 50K vocabulary per row was most of the sampler's time (16 rows:
    ~5 ms of a 6.8 ms draw on a 2-core CPU; 0.7 ms in two steps). Everything is summed in float64: summed in
    float32, a block's mass lost the last tokens of 1e-9 (a tested case), which a draw then never reached."""
    B, n = probs.shape
    if n <= 4 * block:
        cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # (B, n)
        return torch.searchsorted(cdf, _target(cdf[:, -1:], uniform), right=True)[:, 0]
    full = n // block * block
    sums = probs[:, :full].unflatten(-1, (-1, block)).sum(dim=-1, dtype=torch.float64)  # (B, n // block): a view
    if full < n:
        sums = torch.cat([sums, probs[:, full:].sum(dim=-1, keepdim=True, dtype=torch.float64)], dim=-1)
    cdf = F.pad(sums.cumsum(dim=-1), (1, 0))  # (B, blocks + 1): the mass before each, then the total
    target = _target(cdf[:, -1:], uniform)  # (B, 1)
    # The block whose mass holds the target: the last one that starts at or below it.
    b = (torch.searchsorted(cdf, target, right=True) - 1).clamp_(0, sums.size(1) - 1)  # (B, 1)
    offsets = torch.arange(block, device=probs.device)
    index = b * block + offsets  # (B, block): the block's indices
    inner = probs.gather(1, index.clamp(max=n - 1)).masked_fill_(index >= n, 0.0)
    j = torch.searchsorted(inner.cumsum(dim=-1, dtype=torch.float64), target - cdf.gather(1, b), right=True)
    # The block's sum and its running sum round differently: a target past the running sum's end takes the
    # block's last index of probability > 0 (one with some is always there: the block's mass held the target).
    last = torch.where(inner > 0, offsets, -1).amax(dim=-1, keepdim=True)
    return (b * block + torch.minimum(j, last))[:, 0]


def _target(total: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """uniform (B,) times each row's total (B, 1), in float64, kept below the total: u * total rounds up to
    the total itself for u within 2^-53 of 1, so the largest double below it stands in."""
    return torch.minimum(uniform.double()[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))


def next_token(logits: torch.Tensor, options: SamplingOptions, noise: torch.Tensor | None = None) -> torch.Tensor:
    """logits (B, V) -> the next token (B,): the argmax when temperature is 0 (no need to build a one-hot
    distribution and draw from it), else a draw from logits_to_probs with `noise` (B, V) from
    exponential_noise (needed then).

    With top-k or top-p the race is run among the candidates only, with their own noise (the noise of token
    i is noise[:, i] either way): the same token as sample_token(logits_to_probs(...), noise) (bar exact
    ties), without writing (B, V) probabilities back in vocabulary order and reading them again."""
    if options.temperature == 0:
        return logits.argmax(dim=-1)
    if noise is None:
        raise ValueError("next_token: sampling (temperature > 0) needs the noise, from exponential_noise")
    probs, order = candidates(logits, options)
    if order is None:
        return sample_token(probs, noise)
    pick = sample_token(probs, noise.gather(-1, order))  # (B,): a candidate's index
    return order.gather(-1, pick[:, None])[:, 0]


# ----------------------------------------------------------------------------- the model calls


def prefill(model: GPT, idx: torch.Tensor, pos: torch.Tensor, *, rows: slice | None = None,
            length: int | None = None) -> torch.Tensor:
    """One forward over the window idx (B, T) at positions pos (T,) (0..T-1) that writes every token's keys
    and values into the KV cache (its rows `rows`, default all; see GPT.hidden_states for `length`); returns
    the float32 logits of the last position only, (B, V): the head's matmul is not spent on the T - 1
    positions nobody samples from."""
    h = model.hidden_states(idx, pos, rows=rows, length=length)  # (B, T, C)
    return model.head(h[:, -1], fp32=True)  # (B, C) -> (B, V)


def decode_one_token(model: GPT, token: torch.Tensor, pos: torch.Tensor, *, rows: slice | None = None,
                     length: int | None = None, exact: bool = False) -> torch.Tensor:
    """One cached forward: tokens (B, 1) at position pos, (1,) for every row or (B, 1) for each its own,
    attending over the cache (its rows `rows`, its first `length` slots, exactly those with `exact`; see
    GPT.hidden_states) -> float32 logits (B, V)."""
    h = model.hidden_states(token, pos, rows=rows, length=length, exact=exact)  # (B, 1, C)
    return model.head(h[:, -1], fp32=True)  # (B, C) -> (B, V)


def decode_step(
    model: GPT, token: torch.Tensor, pos: torch.Tensor, options: SamplingOptions, noise: torch.Tensor | None,
    length: int | None = None,
) -> torch.Tensor:
    """The whole one-token step: tokens (B, 1) at position pos (1,) -> the next tokens (B,), chosen by
    `options` with `noise` (B, V) from exponential_noise (None when greedy). This is the function to compile:
    without `length` its shapes never change from one token to the next (see compile_decode_step). With
    `length` (> pos) attention reads only the cache's first `length` slots: what an eager step does, since
    reading the empty rest of the cache costs memory traffic and buys nothing outside a static graph."""
    return next_token(decode_one_token(model, token, pos, length=length), options, noise)


# ----------------------------------------------------------------------------- compiling the step

# What compiling decode_step costs and saves, per device type: (seconds to compile it, milliseconds it saves
# per token). --compile=auto compiles when the decode has enough tokens to repay the compile time:
# max_new_tokens >= seconds / saved. (The samples are decoded together, one batch: their number does not
# multiply the steps, and at small batches a step's cost barely depends on it.)
# CUDA: an assumption for GPT-2 124M at batch 1, kept until it is re-derived from measured costs (gpu_check
# reports them: decode_compile_cost): ~40 s to compile and record the CUDA graph with cold caches; eager
# ~5 ms/token (launch-bound: ~250 kernels at ~20 us of Python and launch each), compiled ~0.5 ms/token: ~4.5 ms
# saved, so from ~9,000 tokens. The first measurement (an H200, torch 2.11, before the decode attention's length
# buckets; BENCHMARKS.md): compiled 0.57 ms/token after a 12.2 s compile, eager 4.4-4.5 ms/token where the
# attention does not re-plan per token (57 ms where it did): ~3.9 ms saved, from ~3,100 tokens. Re-measure
# both sides with this code before changing the numbers here.
# Other devices never compile by default. On the CPU (measured: BENCHMARKS.md, "Compiling the decode step")
# compiling the baby model's step took ~60 s (~10 s with inductor's on-disk cache warm) and saved ~2.4 of
# ~15 ms per token: it repays itself only after ~5,000-25,000 tokens, and inductor there needs a C++ compiler
# that a CPU-only machine may lack.
# sample.py compiles a window of DECODE_WINDOW steps, not one step: a larger graph, longer to compile (on this
# project's shared 2-core CPU inductor took ~2.5x a step's time for 4 steps); bench.py's compile_s per
# --decode_window row measures both sides on the GPU.
DECODE_COMPILE_COST = {"cuda": (40.0, 4.5)}


def compile_decision(device: torch.device, compile: bool | None, new_tokens: int) -> tuple[bool, str]:
    """Whether to compile the decode step for `new_tokens` tokens, and why, in a few words.

    compile True / False: as asked (True where torch.compile can run at all; see runtime.resolve_compile).
    None (auto): only when the decode is long enough to repay the compile time (DECODE_COMPILE_COST)."""
    if compile is False:
        return False, "decode step not compiled (--compile=False)"
    possible, why = resolve_compile(True, device)
    if not possible:  # e.g. CUDA without Triton
        return False, why
    if compile:
        return True, "compiling the decode step (asked for)"
    if device.type not in DECODE_COMPILE_COST:
        return False, f"decode step not compiled: not by default on {device.type} (--compile=True to force)"
    seconds, saved_ms = DECODE_COMPILE_COST[device.type]
    needed = math.ceil(seconds / (saved_ms / 1000))
    if new_tokens < needed:
        return False, (f"decode step not compiled: {new_tokens} tokens are too few to repay compiling it "
                       f"(~{seconds:.0f} s; pays from ~{needed:,} tokens; --compile=True to force)")
    return True, f"compiling the decode step (~{seconds:.0f} s; pays from ~{needed:,} tokens)"


def decode_compiler(device: torch.device) -> Callable[[Callable], Callable]:
    """How the one-token decode step is compiled: fullgraph=True and static shapes (dynamic=False: a new batch
    size or sampling option is a new static graph, never a symbolic-shape one); on CUDA mode="reduce-overhead",
    which records the step once as a CUDA graph and replays it with one launch per call."""
    mode = "reduce-overhead" if device.type == "cuda" else None
    return lambda fn: torch.compile(fn, mode=mode, fullgraph=True, dynamic=False)


def window_step_compiler(fn: Callable) -> Callable:
    """How a window's one-token step is compiled: as decode_compiler's, but without CUDA graphs of its own (the
    window records its K calls as one: CapturedWindow)."""
    return torch.compile(fn, fullgraph=True, dynamic=False)


class CompiledDecode:
    """The decode compiled: called as decode_step (generate_stream's `step_fn`), and, for generate_stream's
    windows, `window(...)`'s DecodeWindow for a model, batch size, options and window size, made and compiled on
    first use and kept for the next generations (a new one would be a new recording).

    On CUDA the one-token step is replayed as one CUDA graph per token (mode="reduce-overhead"), and a window's K
    steps as one CUDA graph per K tokens (CapturedWindow): the model's forward and the choice of the token,
    instead of hundreds of small kernel launches. Elsewhere it is inductor's code without CUDA graphs. The
    prompt's forward (varying length) stays eager. compiler: what compiles both the step and a window's step
    (default decode_compiler's and window_step_compiler's torch.compile; tests pass a cheaper backend)."""

    def __init__(self, device: torch.device | str, compiler: Callable[[Callable], Callable] | None = None):
        self.device = torch.device(device)
        self.compiler = compiler if compiler is not None else decode_compiler(self.device)
        self.window_compiler = compiler if compiler is not None else window_step_compiler
        self._step: Callable | None = None
        self._windows: dict[tuple, DecodeWindow] = {}

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        if self._step is None:
            self._step = self.compiler(decode_step)
        # Inductor's matmuls follow the TF32 flag in force at the call, not the model's no_tf32 inside the
        # head: float32 weights get a float32 head here too (and float32 blocks; bf16 weights are unaffected).
        with no_tf32():
            return self._step(*args, **kwargs)

    def window(self, model: GPT, batch: int, options: SamplingOptions, steps: int) -> DecodeWindow:
        key = (model, batch, options, steps)
        if key not in self._windows:
            self._windows[key] = DecodeWindow(model, batch, options, steps, self.device,
                                              compiler=self.window_compiler)
        return self._windows[key]


def compile_decode_step(device: torch.device, compiler: Callable[[Callable], Callable] | None = None) -> CompiledDecode:
    """The decode step (and its windows) compiled: pass it to generate_stream as `step_fn` (CompiledDecode)."""
    return CompiledDecode(device, compiler)


class CapturedWindow:
    """A CUDA graph of `fn`, a window: K calls of a compiled one-token step that take no input and read and
    update buffers that never move. The first call runs the window for real (compiling the step: Dynamo, the
    kernels' autotuning and cuBLAS's set-up all need to run, not to be recorded), on a side stream as CUDA
    graph capture wants, then records the same calls without running them: the recording starts from the
    buffers as the real run left them, so every call, first or replayed, is the next window. A replay is one
    launch for the K steps' kernels: no Python, no guards, no copies per token.

    Why record K calls of a step rather than compile one function of K steps: inductor's compile time grows with
    the graph, K times a step's (on the CPU, 16 steps took ~15x one step's compile), while the recording of K
    calls of one compiled step costs a step's compile and K steps' launches, once."""

    def __init__(self, fn: Callable[[], torch.Tensor], watch: Callable[[], tuple] | None = None):
        self.fn = fn
        # The addresses of what the graph reads that its owner may replace (a KV cache made anew for another
        # batch size, weights moved): when they change, the graph would read freed memory, so it is recorded again.
        self.watch = watch or (lambda: ())
        self.graph: torch.cuda.CUDAGraph | None = None
        self.recorded_on: tuple = ()
        self.out: torch.Tensor | None = None  # the recorded output: rewritten by every replay

    def __call__(self) -> torch.Tensor:
        if self.graph is None or self.watch() != self.recorded_on:
            return self._record()
        self.graph.replay()
        return self.out.clone()

    def _record(self) -> torch.Tensor:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            first = self.fn()
        torch.cuda.current_stream().wait_stream(side)
        first = first.clone()  # (on this stream: the side stream's memory is not used past here)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a server's other threads may use CUDA meanwhile (they must not be recorded, nor fail it)
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.out = self.fn()
        self.graph, self.recorded_on = graph, self.watch()
        return first


def model_addresses(model: GPT) -> tuple:
    """Where a decode step reads the model's weights and KV cache from (a CapturedWindow's `watch`): a cache
    made anew (setup_kv_cache for another batch size) or weights moved give other addresses."""
    caches = [b.attn.kv_cache for b in model.transformer.h]
    return (model.transformer.wte.weight.data_ptr(),
            *(t.data_ptr() for c in caches if c is not None for t in (c.k, c.v)))


# ----------------------------------------------------------------------------- K tokens per call: the window

# Tokens per window where the decode is compiled (sample.py). 16 is a first pick, not a measurement: gpu_check's
# decode rows (bench.py --decode_window=1,8,16,32) decide it.
DECODE_WINDOW = 16


class WindowState(torch.nn.Module):
    """What a decode window reads and leaves for the next, in device buffers that never move: the token each
    row feeds in next (last, (B, 1)), its position (pos, (1,)), which rows are finished (finished, (B,)), and
    the noise of the window's K draws (noise, (K, B, V); None when greedy). The window reaches them through its
    closure, and a CUDA graph of it (CapturedWindow) reads and updates them where they are: no copy in or out
    per call."""

    def __init__(self, batch: int, steps: int, vocab_size: int, device: torch.device, sampled: bool):
        super().__init__()
        self.register_buffer("last", torch.zeros(batch, 1, dtype=torch.long, device=device), persistent=False)
        self.register_buffer("pos", torch.zeros(1, dtype=torch.long, device=device), persistent=False)
        self.register_buffer("finished", torch.zeros(batch, dtype=torch.bool, device=device), persistent=False)
        noise = torch.empty(steps, batch, vocab_size, dtype=torch.float32, device=device) if sampled else None
        self.register_buffer("noise", noise, persistent=False)


def stop_mask(nxt: torch.Tensor, finished: torch.Tensor, stop_token: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens (B,) with every finished row's replaced by the stop token (a finished sequence keeps emitting
    it, so the batch stays rectangular), and the rows finished after them (B,)."""
    if stop_token is None:
        return nxt, finished
    nxt = torch.where(finished, torch.full_like(nxt, stop_token), nxt)
    return nxt, finished | (nxt == stop_token)


def decode_window(model: GPT, state: WindowState, options: SamplingOptions, steps: int,
                  length: int | None = None, step: Callable = decode_step) -> torch.Tensor:
    """`steps` one-token steps (K) in one function -> their tokens (K, B): each step's token fed to the next,
    positions advanced and the stop test made on the device, from the state's buffers, which it leaves ready
    for the next window (the last token, its position, the finished rows). The noise of step k is
    state.noise[k]. No host synchronisation: on a GPU its K steps record as one CUDA graph (CapturedWindow).
    `step`: decode_step, or the same compiled (its shapes never change from one call to the next). With
    `length` (eagerly) step k reads the cache's first length + k slots, as decode_step's eager calls do;
    without, the whole cache, masked past each position."""
    token, finished, tokens = state.last, state.finished, []
    for k in range(steps):
        noise = state.noise[k] if state.noise is not None else None
        nxt = step(model, token, state.pos + k, options, noise, length=None if length is None else length + k)
        nxt, finished = stop_mask(nxt, finished, options.stop_token)
        tokens.append(nxt)
        token = nxt[:, None]
    state.last.copy_(token)
    state.finished.copy_(finished)
    state.pos.add_(steps)
    return torch.stack(tokens)


def window_step(*args, **kwargs) -> torch.Tensor:
    """decode_step under a name of its own: compiled for windows (without CUDA graphs of its own), it keeps its
    compiled graphs apart from the one-token step's (a function's compiled graphs are kept by its code)."""
    return decode_step(*args, **kwargs)


class DecodeWindow:
    """decode_window for one model, batch size, sampling options and K: its state, and the function itself,
    eager or with its step compiled (`compiler`, e.g. window_step_compiler), on a GPU recorded as one CUDA graph
    (CapturedWindow). The model, the state and the options are in the window's closure: it takes no input, so
    a replay copies nothing in.

    The noise: `draw_noise` fills state.noise with K successive draws from the caller's generator, outside the
    graph, one call per window: the numbers K one-token steps would draw, so a seed gives the same tokens with
    windows or without, eagerly or compiled. (A generator registered with the CUDA graph would draw inside it,
    but its numbers come from the graph's own offsets, not the eager path's: the same seed would give other
    tokens.)"""

    def __init__(self, model: GPT, batch: int, options: SamplingOptions, steps: int, device: torch.device | str,
                 compiler: Callable[[Callable], Callable] | None = None):
        self.steps, self.device = steps, torch.device(device)
        self.state = WindowState(batch, steps, model.config.vocab_size, self.device, options.temperature > 0)
        state = self.state
        self.eager = lambda length: decode_window(model, state, options, steps, length)
        self.compiled = None
        if compiler is not None:
            step = compiler(window_step)

            def window() -> torch.Tensor:
                return decode_window(model, state, options, steps, step=step)

            self.compiled = (CapturedWindow(window, watch=lambda: model_addresses(model))
                             if self.device.type == "cuda" else window)

    def draw_noise(self, generator: torch.Generator | None) -> None:
        noise = self.state.noise
        if noise is not None:
            for k in range(self.steps):
                exponential_noise(noise[k].shape, generator=generator, out=noise[k])

    def __call__(self, length: int) -> torch.Tensor:
        """The window's K tokens (K, B), a tensor of their own; `length`: the cache slots filled before it (the
        eager window reads those and the new ones; the compiled one always the whole cache, masked)."""
        if self.compiled is None:
            return self.eager(length)
        with no_tf32():  # (see CompiledDecode.__call__)
            return self.compiled()


# ----------------------------------------------------------------------------- how long a decode may be

TOKEN_BYTES = 8  # a token id in the decoding buffers: int64, torch's index type
# Buffers up to this size are not worth asking the system about: anything that holds a model holds them.
UNCHECKED_BYTES = 64 * 2**20
# The share of the free memory a decode's tokens may take: the rest is the model's, its KV cache's and the
# process' (and on a CPU the freed memory that glibc keeps resident; gptkit/plan/__init__.py sizes CPU runs the same way).
MEMORY_SHARE = 0.5


class DecodeTooLong(UserError, ValueError):
    """A max_new_tokens whose tokens cannot fit in memory, found before anything is allocated; the message
    names the largest value that fits."""


def check_decode_memory(
    batch: int, prompt_tokens: int, max_new_tokens: int, device: torch.device | str, *,
    device_bytes: int = TOKEN_BYTES, host_bytes: int = 0, option: str = "max_new_tokens", batch_option: str = "",
) -> None:
    """Raise DecodeTooLong when `batch` sequences of prompt_tokens + max_new_tokens tokens, at `device_bytes` a
    token on `device` and `host_bytes` a token in RAM (a CPU's are one memory), would take more than
    MEMORY_SHARE of the free memory. The message names `option` (and `batch_option`, the caller's name for the
    batch) and the largest value that fits. What asks for a buffer sized by a user's number calls this first."""
    device = torch.device(device)
    per_token = {"RAM": host_bytes + (device_bytes if device.type != "cuda" else 0)}
    if device.type == "cuda":
        per_token[f"{device} memory"] = device_bytes
    tokens = batch * (prompt_tokens + max_new_tokens)
    for memory, cost in per_token.items():
        need = tokens * cost
        if need <= UNCHECKED_BYTES:
            continue
        free = _free_memory(device if memory != "RAM" else torch.device("cpu"))
        if free is None or need <= free * MEMORY_SHARE:
            continue
        fits = max(0, int(free * MEMORY_SHARE) // (batch * cost) - prompt_tokens)
        rows = f" with {batch_option}={batch}" if batch_option else f" for {batch} sequence{'s' * (batch != 1)}"
        advice = (f"at most {option}={fits} fits{rows}" if fits else
                  f"not one token fits{rows}: free some memory{' or lower ' + batch_option if batch_option else ''}")
        raise DecodeTooLong(f"{option}={max_new_tokens}{rows} needs ~{_size(need)} of {memory} for its tokens "
                            f"({cost} bytes each), more than half of the {_size(free)} free: {advice}")


def _free_memory(device: torch.device) -> int | None:
    """Bytes free for new tensors: a GPU's free memory plus what torch's allocator holds unused; on the CPU the
    machine's available RAM (Linux's MemAvailable, else its total); None where it cannot be known."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        return ram()[1]
    except (AttributeError, ValueError, OSError):  # no sysconf either (Windows)
        return None


def _size(n: float) -> str:
    return f"{n / 2**40:,.1f} TiB" if n >= 2**40 else f"{n / 2**30:,.1f} GiB"


# ----------------------------------------------------------------------------- the decoding loop


@torch.no_grad()
def generate_blocks(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    options: SamplingOptions | None = None,
    *,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    step_fn: Callable | None = None,
    window: int = 1,
) -> Iterator[torch.Tensor]:
    """Yield the next tokens of every sequence, (B, n), a block at a time: one token per step (n = 1), or with
    window = K > 1 a window's K tokens at once (see `generate` for the rest). Puts the model in eval mode:
    dropout while sampling would make the cached and uncached paths disagree.

    A window (decode_window) makes K cached steps in one call: compiled (step_fn from compile_decode_step), one
    CUDA graph replay per K tokens. A window is used only where K cached steps fit before the model's window
    must move (window_shift); elsewhere (the prompt's forward, the refills, the < K steps before a move) one
    token per step, eagerly: compiling the one-token step as well would cost a second compilation for fewer
    than K tokens at a time. At the end up to K - 1 tokens past max_new_tokens are computed and never yielded,
    and a window in which every sequence has drawn the stop token yields up to that step only."""
    opts = options if options is not None else SamplingOptions()
    if not (is_int(window) and window >= 1):
        raise ValueError(f"window must be an integer >= 1 (1 = a token per step), got {window!r}")
    model.eval()
    B, T0 = idx.shape
    if T0 == 0:
        raise ValueError("generate needs at least one prompt token per sequence")
    block = model.config.block_size
    shift = opts.shift_for(block)
    check_decode_memory(B, T0, max_new_tokens, idx.device)
    # All tokens, preallocated: buf[:, :length] is the sequence so far.
    buf = torch.empty(B, T0 + max_new_tokens, dtype=idx.dtype, device=idx.device)
    buf[:, :T0] = idx
    length = T0
    # Start of the model's window: positions are relative to it (the model learned positions 0..block-1).
    # When the window is full it moves forward by `shift` tokens and the cache is rebuilt from the kept ones.
    start = max(0, T0 - block)
    if use_cache and model.kv_cache_batch_size != B:
        model.setup_kv_cache(B)
    refill = True  # the cache must be (re)built from the whole window
    win = None
    if use_cache and window > 1:
        win = (step_fn.window(model, B, opts, window) if isinstance(step_fn, CompiledDecode)
               else DecodeWindow(model, B, opts, window, idx.device))
    # The position of the next cached step lives on the device and is advanced in place: building it from a
    # Python int every token would be a host-to-device copy that waits for the GPU. One noise buffer, refilled
    # every single step from the generator (the same draws whichever path runs). With windows these are the
    # window's buffers, where the token fed in next and the finished rows go before a window runs.
    state = win.state if win is not None else WindowState(B, 1, model.config.vocab_size, idx.device,
                                                          opts.temperature > 0)
    step_pos, stop = state.pos, opts.stop_token
    noise = state.noise[0] if state.noise is not None else None
    last = buf[:, T0 - 1 : T0].clone()  # (B, 1), a fresh tensor: the compiled step sees fixed strides
    finished = torch.zeros(B, dtype=torch.bool, device=idx.device)
    # Checking "all stopped" after a single step reads a flag back to the host; on an accelerator do it only
    # every 8 tokens. (A window reads its tokens' stops once, after it.)
    check_every = 1 if idx.device.type == "cpu" else 8
    n = 0
    while n < max_new_tokens:
        if length - start > block:  # one token too many for the window: move it forward by `shift`
            start += shift
            refill = True
        if win is not None and not refill and block - (length - start) + 1 >= window:  # K cached steps fit
            if last is not state.last:  # (single steps ran since the last window)
                state.last.copy_(last)
                state.finished.copy_(finished)
            win.draw_noise(generator)
            tokens = win(length - start).t()  # (B, K)
            last, finished = state.last, state.finished
            take = min(window, max_new_tokens - n)
            stopped = _first_all_stopped(tokens[:, :take], stop) if stop is not None else 0
            take, done = stopped or take, stopped > 0
        else:
            if noise is not None:
                exponential_noise(noise.shape, generator=generator, out=noise)
            nxt = _one_token(model, buf, start, length, refill, use_cache, step_fn if win is None else None,
                             last, step_pos, opts, noise)
            refill = False
            nxt, finished = stop_mask(nxt, finished, stop)
            last = tokens = nxt[:, None]  # (B,) -> (B, 1)
            take = 1
            done = stop is not None and n % check_every == check_every - 1 and bool(finished.all())
        buf[:, length : length + take] = tokens[:, :take]
        length += take
        n += take
        yield tokens[:, :take]
        if done:
            return


def _one_token(model: GPT, buf: torch.Tensor, start: int, length: int, refill: bool, use_cache: bool,
               step_fn: Callable | None, last: torch.Tensor, step_pos: torch.Tensor, opts: SamplingOptions,
               noise: torch.Tensor | None) -> torch.Tensor:
    """One step of generate_blocks: the next token of every sequence (B,) after buf[:, :length], the model's
    window starting at `start`; a refill also sets step_pos, a cached step advances it."""
    if not use_cache:  # a full forward over the window; the head only at its last position
        logits = model.head(model.hidden_states(buf[:, start:length])[:, -1], fp32=True)
        return next_token(logits, opts, noise)
    if refill:  # one batched forward over the window fills the cache
        logits = prefill(model, buf[:, start:length], torch.arange(length - start, device=buf.device),
                         length=length - start)
        step_pos.fill_(length - start)
        return next_token(logits, opts, noise)
    if step_fn is not None:  # one new token at position step_pos, through a compiled (static) step
        # A compiled step's output may live in CUDA-graph memory that its next replay overwrites.
        nxt = step_fn(model, last, step_pos, opts, noise).clone()
    else:  # the same eagerly, attention reading only the filled slots: 0..step_pos = length - start - 1
        nxt = decode_step(model, last, step_pos, opts, noise, length=length - start)
    step_pos += 1
    return nxt


def _first_all_stopped(tokens: torch.Tensor, stop: int) -> int:
    """1 + the first step of tokens (B, n) at which every sequence has stopped (a finished row keeps emitting
    the stop token), or 0 when none: one host synchronisation."""
    steps = (tokens == stop).all(dim=0).nonzero()
    return int(steps[0, 0]) + 1 if len(steps) else 0


@torch.no_grad()
def generate_stream(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    options: SamplingOptions | None = None,
    *,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    step_fn: Callable | None = None,
    window: int = 1,
) -> Iterator[torch.Tensor]:
    """Yield the next token of every sequence, (B,), one step at a time (see `generate`; with window > 1
    they are computed a window at a time, see generate_blocks)."""
    for tokens in generate_blocks(model, idx, max_new_tokens, options, generator=generator, use_cache=use_cache,
                                  step_fn=step_fn, window=window):
        for j in range(tokens.size(1)):
            yield tokens[:, j]


@torch.no_grad()
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    options: SamplingOptions | None = None,
    *,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    step_fn: Callable | None = None,
    window: int = 1,
) -> torch.Tensor:
    """Continue the prompts idx (B, T) by up to max_new_tokens tokens; returns (B, T + n).

    options: see SamplingOptions (None: temperature 1, no top-k/top-p, no stop token, the exact window).
    Sequences that draw the stop token are padded with it until all sequences have stopped (or
    max_new_tokens is reached), so n can be smaller than max_new_tokens. generator: the random stream of the
    draws (the same seed gives the same tokens, with or without the cache, a compiled step or windows).
    use_cache=False recomputes the whole window for every token (same tokens, slower). step_fn replaces
    decode_step for the cached one-token steps, with its signature (e.g. compile_decode_step's). window: K > 1
    decodes K tokens per call where they fit (generate_blocks), compiled when step_fn is compile_decode_step's
    (DECODE_WINDOW is sample.py's choice); the same tokens as one at a time. The model's train/eval mode is
    restored afterwards.
    """
    was_training = model.training
    B, T0 = idx.shape
    # This buffer and generate_blocks': the tokens' bytes twice (a list of per-step tensors cost ~0.5 KB a step).
    check_decode_memory(B, T0, max_new_tokens, idx.device, device_bytes=2 * TOKEN_BYTES)
    out = torch.empty(B, T0 + max_new_tokens, dtype=idx.dtype, device=idx.device)
    out[:, :T0] = idx
    n = 0
    try:
        for tokens in generate_blocks(model, idx, max_new_tokens, options, generator=generator,
                                      use_cache=use_cache, step_fn=step_fn, window=window):
            out[:, T0 + n : T0 + n + tokens.size(1)] = tokens
            n += tokens.size(1)
    finally:
        model.train(was_training)
    return out if n == max_new_tokens else out[:, : T0 + n].clone()  # stopped early: not a view of the rest


# ----------------------------------------------------------------------------- streamed text


class TextStream:
    """Turns token ids, fed one at a time, into text that can be printed at once and never needs taking back.

    A BPE token is a run of bytes, and a character of several UTF-8 bytes (é, 世, emoji) is often split across
    tokens: decoding a token on its own would print U+FFFD garbage. So tokens are held back while their text
    ends in U+FFFD (an incomplete character), and released together once the character is complete. Released
    text always ends on a character boundary, so decoding the held-back tokens alone gives the same text as
    decoding everything: the streamed pieces add up exactly to the final decode.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.pending: list[int] = []

    def push(self, token_id: int) -> str:
        self.pending.append(token_id)
        text = self.tokenizer.decode(self.pending)
        if text.endswith("\ufffd"):
            return ""  # maybe a character still missing bytes: wait for the next token
        self.pending.clear()
        return text

    def flush(self) -> str:
        """Whatever is held back (at the end of a sample: a genuinely invalid byte sequence prints as U+FFFD)."""
        text = self.tokenizer.decode(self.pending) if self.pending else ""
        self.pending.clear()
        return text
