"""Decoding: continuing prompts with a GPT (model.py), one token at a time, in reading order.

    SamplingOptions          how to pick tokens: temperature, top-k, top-p, stop token, window shift
    logits_to_probs          logits (B, V) -> probabilities (B, V) after temperature, top-k, top-p
    sample_token             probabilities (B, V) -> one drawn token per row (B,)
    next_token               logits (B, V) -> the next token (B,): the argmax at temperature 0, else a draw
    prefill                  one forward over a window (B, T) that fills the KV cache -> logits (B, V)
    decode_one_token         one cached step: tokens (B, 1) at position pos (1,) -> logits (B, V)
    generate_stream          the loop: yields the next token of every sequence, (B,), step by step
    generate                 the prompts with their continuations, (B, T + n)

Shapes use B = batch (sequences decoded together), T = tokens in the model's window, V = vocab_size.

Every function takes the model as an argument and keeps no state of its own: the KV cache lives in the model
(`GPT.setup_kv_cache`). `prefill` and `decode_one_token` are plain functions of the model and tensors, so
either can be wrapped in `torch.compile`; `decode_one_token` always sees the same shapes (one token per
sequence, a (1,) position, the preallocated cache), which is what lets mode="reduce-overhead" replay it as a
CUDA graph (see sample.decode_step_fn; generate_stream takes it as `step_fn`).

The window: the model learned positions 0..block_size-1 only, so it sees at most the last block_size tokens,
with positions counted from the window's start. `prefill` fills the cache from the whole window; each new
token then costs one `decode_one_token`. When one more token would not fit, the window moves forward by
`window_shift` tokens and `prefill` rebuilds the cache from the tokens it kept. Without the cache
(use_cache=False) every token is a full forward over the same windows, so both paths give the same tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model import GPT

# ----------------------------------------------------------------------------- options


@dataclass(frozen=True, kw_only=True)
class SamplingOptions:
    """How generate picks each next token; checked once, here, when made (a ValueError names the field)."""

    temperature: float = 1.0  # divides the logits: < 1 more conservative, > 1 wilder; 0 = greedy (argmax)
    top_k: int | None = None  # draw only from the k most likely tokens; None = no limit
    top_p: float | None = None  # draw only from the likeliest tokens whose probabilities sum to p; None/1 off
    stop_token: int | None = None  # a sequence that draws it is finished (and padded with it); None = never
    # Tokens the window moves forward by when it is full; None = block_size // 4 (at least 1). 1 keeps exactly
    # the last block_size tokens, at the price of rebuilding the whole cache for every token past block_size.
    window_shift: int | None = None

    def __post_init__(self):
        t, k, p, stop, shift = self.temperature, self.top_k, self.top_p, self.stop_token, self.window_shift
        if not (_is_number(t) and t >= 0):  # nan fails >= too
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {t!r}")
        if k is not None and not (_is_int(k) and k >= 1):
            raise ValueError(f"top_k must be an integer >= 1 (None = no limit), got {k!r}")
        if p is not None and not (_is_number(p) and 0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {p!r}")
        if stop is not None and not (_is_int(stop) and stop >= 0):
            raise ValueError(f"stop_token must be a token id >= 0 (None = no stop token), got {stop!r}")
        if shift is not None and not (_is_int(shift) and shift >= 1):
            raise ValueError(f"window_shift must be an integer >= 1 (None = block_size // 4), got {shift!r}")

    def shift_for(self, block_size: int) -> int:
        """The window shift for a model of this block_size: window_shift, or its default."""
        shift = self.window_shift if self.window_shift is not None else max(1, block_size // 4)
        if shift > block_size:
            raise ValueError(f"window_shift must be in 1..{block_size} (the model's block_size), got {shift}")
        return shift


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


# ----------------------------------------------------------------------------- sampling: logits -> a token


def logits_to_probs(logits: torch.Tensor, options: SamplingOptions) -> torch.Tensor:
    """Next-token logits (B, V) -> a probability distribution (B, V) after temperature, top-k and top-p.

    temperature 0 means greedy: all mass on the argmax. top_k keeps exactly the k largest logits; top_p keeps
    the smallest set of most likely tokens whose total probability reaches p (always at least one token).
    """
    temperature, top_k, top_p = options.temperature, options.top_k, options.top_p
    logits = logits.float()
    if temperature == 0:
        return F.one_hot(logits.argmax(dim=-1), logits.size(-1)).to(logits.dtype)
    logits = logits / temperature
    use_k = top_k is not None and top_k < logits.size(-1)
    use_p = top_p is not None and top_p < 1.0
    if not (use_k or use_p):
        return F.softmax(logits, dim=-1)
    # The candidates, most likely first: topk is sorted, and on a 50K vocabulary much cheaper than a full sort
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
    return torch.zeros_like(logits).scatter_(-1, order, probs)  # back to vocabulary order, (B, V)


def sample_token(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row from probs (B, V) -> (B,). Stays on the device: no host synchronisation."""
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)  # (B, 1) -> (B,)


def next_token(
    logits: torch.Tensor, options: SamplingOptions, generator: torch.Generator | None = None
) -> torch.Tensor:
    """logits (B, V) -> the next token (B,): the argmax when temperature is 0 (no need to build a one-hot
    distribution and draw from it), else a draw from logits_to_probs."""
    if options.temperature == 0:
        return logits.argmax(dim=-1)
    return sample_token(logits_to_probs(logits, options), generator)


# ----------------------------------------------------------------------------- the two model calls


def prefill(model: GPT, idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """One forward over the window idx (B, T) at positions pos (T,) (0..T-1) that writes every token's keys
    and values into the KV cache; returns the logits of the last position only, (B, V): the head's matmul is
    not spent on the T - 1 positions nobody samples from."""
    return model.head(model.hidden_states(idx, pos)[:, -1])  # (B, T, C) -> (B, C) -> (B, V)


def decode_one_token(model: GPT, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """One cached step: tokens (B, 1) at position pos (1,), attending over the cache -> logits (B, V).

    The shapes never change from one call to the next, so this is the function to compile (see the module
    docstring)."""
    return model.head(model.hidden_states(token, pos))[:, -1]  # (B, 1, C) -> (B, 1, V) -> (B, V)


# ----------------------------------------------------------------------------- the decoding loop


@torch.no_grad()
def generate_stream(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    options: SamplingOptions | None = None,
    *,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    step_fn: Callable[[GPT, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> Iterator[torch.Tensor]:
    """Yield the next token of every sequence, (B,), one step at a time (see `generate`). Puts the model in
    eval mode: dropout while sampling would make the cached and uncached paths disagree."""
    opts = options if options is not None else SamplingOptions()
    model.eval()
    B, T0 = idx.shape
    if T0 == 0:
        raise ValueError("generate needs at least one prompt token per sequence")
    block = model.config.block_size
    shift = opts.shift_for(block)
    # All tokens, preallocated: buf[:, :length] is the sequence so far.
    buf = torch.empty(B, T0 + max_new_tokens, dtype=idx.dtype, device=idx.device)
    buf[:, :T0] = idx
    length = T0
    # Start of the model's window: positions are relative to it (the model learned positions 0..block-1).
    # When the window is full it moves forward by `shift` tokens and the cache is rebuilt from the kept ones.
    start = max(0, T0 - block)
    if use_cache and model.kv_cache_batch_size != B:
        model.setup_kv_cache(B)
    step = step_fn if step_fn is not None else decode_one_token
    refill = True  # the cache must be (re)built from the whole window
    # The position of the next cached step lives on the device and is advanced in place: building it from a
    # Python int every token would be a host-to-device copy that waits for the GPU.
    step_pos = torch.zeros(1, dtype=torch.long, device=idx.device)
    last = buf[:, T0 - 1 : T0].clone()  # (B, 1), a fresh tensor: the compiled step sees fixed strides
    finished = torch.zeros(B, dtype=torch.bool, device=idx.device)
    # Checking "all stopped" reads a flag back to the host; on an accelerator do it only every 8 tokens.
    check_every = 1 if idx.device.type == "cpu" else 8
    stop = opts.stop_token
    for i in range(max_new_tokens):
        if length - start > block:  # one token too many for the window: move it forward by `shift`
            start += shift
            refill = True
        if not use_cache:  # a full forward over the window, (B, T, V) -> the last position (B, V)
            logits = model(buf[:, start:length])[0][:, -1]
        elif refill:  # one batched forward over the window fills the cache
            logits = prefill(model, buf[:, start:length], torch.arange(length - start, device=idx.device))
            step_pos.fill_(length - start)
            refill = False
        else:  # one new token at position step_pos
            logits = step(model, last, step_pos)
            step_pos += 1
        nxt = next_token(logits, opts, generator)  # (B,)
        if stop is not None:
            # A finished sequence keeps emitting the stop token, so the batch stays rectangular.
            nxt = torch.where(finished, torch.full_like(nxt, stop), nxt)
            finished = finished | (nxt == stop)
        buf[:, length] = nxt
        length += 1
        last = nxt[:, None]  # (B,) -> (B, 1)
        yield nxt
        if stop is not None and i % check_every == check_every - 1 and bool(finished.all()):
            return


@torch.no_grad()
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    options: SamplingOptions | None = None,
    *,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    step_fn: Callable[[GPT, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Continue the prompts idx (B, T) by up to max_new_tokens tokens; returns (B, T + n).

    options: see SamplingOptions (None: temperature 1, no top-k/top-p, no stop token, the default window).
    Sequences that draw the stop token are padded with it until all sequences have stopped (or
    max_new_tokens is reached), so n can be smaller than max_new_tokens. generator: the random stream of the
    draws (the same seed gives the same tokens). use_cache=False recomputes the whole window for every token
    (same tokens, slower). step_fn replaces decode_one_token for the cached one-token steps, with its
    signature (e.g. a compiled decode_one_token; see sample.decode_step_fn). The model's train/eval mode is
    restored afterwards.
    """
    was_training = model.training
    out = [idx]
    try:
        for nxt in generate_stream(
            model, idx, max_new_tokens, options, generator=generator, use_cache=use_cache, step_fn=step_fn
        ):
            out.append(nxt[:, None])  # (B,) -> (B, 1)
    finally:
        model.train(was_training)
    return torch.cat(out, dim=1)
