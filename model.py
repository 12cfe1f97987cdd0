"""The GPT-2 language model, in reading order.

    KVCache -> CausalSelfAttention -> MLP -> Block -> GPTConfig -> GPT -> sampling functions

Shapes use B = batch, T = sequence length, C = n_embd, H = n_head, D = C // H, V = vocab.
Parameter names follow OpenAI's GPT-2 (wte, wpe, h.N.ln_1, attn.c_attn, ...) so its weights map one to one.
Nothing here knows about optimizers, data or training loops.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

# ----------------------------------------------------------------------------- building blocks


class KVCache(nn.Module):
    """Preallocated keys and values of one attention layer, for incremental decoding.

    The buffers have a fixed shape (B, H, max_len, D) so that a decode step always sees the same tensor
    shapes and addresses: that is what lets `torch.compile(mode="reduce-overhead")` capture it as a CUDA graph.
    """

    def __init__(self, batch_size: int, n_head: int, max_len: int, head_dim: int, device, dtype):
        super().__init__()
        shape = (batch_size, n_head, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)

    def update(self, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, H, T, D) at positions `pos` (T,) and return the whole cache (B, H, max_len, D)."""
        self.k.index_copy_(2, pos, k.to(self.k.dtype))
        self.v.index_copy_(2, pos, v.to(self.v.dtype))
        return self.k, self.v


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # fused q, k, v
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.kv_cache: KVCache | None = None  # set by GPT.setup_kv_cache for incremental decoding

    def forward(
        self, x: torch.Tensor, pos: torch.Tensor | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        B, T, C = x.shape
        # (B, T, 3C) -> 3 x (B, T, C) -> each (B, T, H, D) -> (B, H, T, D)
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        dropout_p = self.dropout if self.training else 0.0

        if pos is None:
            # Plain causal attention over the T tokens of x (training, full forward).
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        else:
            # Incremental decoding: x holds the tokens at absolute positions `pos` (T,). Store their keys and
            # values, then attend over the whole fixed-size cache; `mask` (T, max_len) lets query i see cached
            # key j only when j <= pos[i] (earlier tokens and itself), which also hides the unwritten slots.
            k_all, v_all = self.kv_cache.update(pos, k, v)  # (B, H, max_len, D)
            y = F.scaled_dot_product_attention(q, k_all.to(q.dtype), v_all.to(q.dtype), attn_mask=mask)

        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, H, T, D) -> (B, T, H, D) -> (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GPT-2 uses the tanh approximation of GELU; the exact erf form would change its pretrained outputs.
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.ln_eps, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.ln_eps, bias=config.bias)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, pos: torch.Tensor | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), pos, mask)
        return x + self.mlp(self.ln_2(x))


# ----------------------------------------------------------------------------- the model


@dataclass
class GPTConfig:
    block_size: int = 1024  # longest sequence the model sees (rows of the position embedding)
    vocab_size: int = 50257  # tokenizer vocabulary; logits have exactly this many columns
    n_layer: int = 12  # transformer blocks
    n_head: int = 12  # attention heads per block; must divide n_embd
    n_embd: int = 768  # residual stream width C
    dropout: float = 0.0  # dropout after attention/MLP/embeddings while training; 0 for pretraining
    bias: bool = True  # biases in Linear and LayerNorm layers (GPT-2 has them)
    ln_eps: float = 1e-5  # LayerNorm epsilon (GPT-2: 1e-5)
    # The embedding table gets rows up to a multiple of this (e.g. 50257 -> 50304 with 64): matmuls with
    # a round width run faster on GPUs. The extra rows are never returned as logits, so never sampled.
    vocab_multiple: int = 1

    def __post_init__(self):
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "vocab_multiple"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); "
                f"each head gets n_embd // n_head channels"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if not self.ln_eps > 0:
            raise ValueError(f"GPTConfig.ln_eps must be positive, got {self.ln_eps!r}")

    @property
    def padded_vocab_size(self) -> int:
        return math.ceil(self.vocab_size / self.vocab_multiple) * self.vocab_multiple

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> GPTConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown GPTConfig field(s): {', '.join(unknown)}")
        return cls(**d)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.padded_vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, eps=config.ln_eps, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        # Weight tying: the output projection is the token embedding (GPT-2 does this; saves V*C parameters).
        self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        # GPT-2 scales the init of the projections that write into the residual stream by 1/sqrt(2 * n_layer)
        # (two per block), so the residual's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; by default without the position embedding (the token embedding is shared with
        the head, so it does its work as a weight and is counted)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, pos: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx (B, T) token ids -> logits (B, T, vocab_size) for every position, and the mean cross-entropy
        against targets (B, T) when given (targets of -1 are ignored).

        `pos` (T,) is only for incremental decoding with a KV cache (see `setup_kv_cache`): the absolute
        positions of the tokens in idx.
        """
        B, T = idx.shape
        padded = self.lm_head(self.hidden_states(idx, pos))  # (B, T, padded V)
        loss = None
        if targets is not None:
            # The loss uses the contiguous padded logits (a view, no copy); the padding columns are never a
            # target, so training simply pushes them down. (B, T, Vp) -> (B*T, Vp)
            loss = F.cross_entropy(padded.view(B * T, -1).float(), targets.reshape(B * T), ignore_index=-1)
        return padded[..., : self.config.vocab_size], loss  # (B, T, V): the padding is never returned

    def hidden_states(self, idx: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        """idx (B, T) -> the final LayerNorm's output (B, T, C), the input of the head."""
        B, T = idx.shape
        if pos is None:
            if T > self.config.block_size:
                raise ValueError(
                    f"input has {T} tokens but the model's block_size is {self.config.block_size}; "
                    f"crop the input to its last {self.config.block_size} tokens"
                )
            pos = torch.arange(T, device=idx.device)
            x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C) + (T, C)
            for block in self.transformer.h:
                x = block(x)
        else:
            cache = self.transformer.h[0].attn.kv_cache
            if cache is None:
                raise RuntimeError("forward(pos=...) needs a KV cache: call model.setup_kv_cache(...) first")
            # Which cache slots each query may see, built once for all layers: (T, max_len) boolean.
            mask = torch.arange(cache.k.size(2), device=idx.device)[None, :] <= pos[:, None]
            x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
            for block in self.transformer.h:
                x = block(x, pos, mask)
        return self.transformer.ln_f(x)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """(..., C) -> logits (..., V). The padding columns of a padded vocabulary are dropped (a view): they are
        never a prediction, so never sampled."""
        return self.lm_head(x)[..., : self.config.vocab_size]

    # ------------------------------------------------------------------------- KV cache

    def setup_kv_cache(self, batch_size: int, device=None, dtype: torch.dtype | None = None) -> None:
        """Give every attention layer a preallocated cache for `block_size` positions."""
        p = self.transformer.wte.weight
        device = device if device is not None else p.device
        dtype = dtype if dtype is not None else p.dtype
        c = self.config
        for block in self.transformer.h:
            block.attn.kv_cache = KVCache(batch_size, c.n_head, c.block_size, c.n_embd // c.n_head, device, dtype)

    def clear_kv_cache(self) -> None:
        for block in self.transformer.h:
            block.attn.kv_cache = None

    @property
    def kv_cache_batch_size(self) -> int | None:
        cache = self.transformer.h[0].attn.kv_cache
        return None if cache is None else cache.k.size(0)

    def crop_block_size(self, block_size: int) -> None:
        """Shrink the context, e.g. to fine-tune GPT-2 (1024) at 256: keeps the first position embeddings."""
        if not 0 < block_size <= self.config.block_size:
            raise ValueError(
                f"crop_block_size: block_size must be in 1..{self.config.block_size}, got {block_size}"
            )
        self.clear_kv_cache()
        self.config.block_size = block_size
        self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size].detach().clone())

    # ------------------------------------------------------------------------- generation

    @torch.no_grad()
    def generate_stream(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        stop_token: int | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
        window_shift: int | None = None,
        step_fn=None,
    ) -> Iterator[torch.Tensor]:
        """Yield the next token of every sequence, (B,), one step at a time (see `generate`). Puts the model in
        eval mode: dropout while sampling would make the cached and uncached paths disagree."""
        self.eval()
        B, T0 = idx.shape
        if T0 == 0:
            raise ValueError("generate needs at least one prompt token per sequence")
        block = self.config.block_size
        shift = window_shift if window_shift is not None else max(1, block // 4)
        if not 1 <= shift <= block:
            raise ValueError(f"window_shift must be in 1..{block}, got {shift}")
        # All tokens, preallocated: buf[:, :length] is the sequence so far.
        buf = torch.empty(B, T0 + max_new_tokens, dtype=idx.dtype, device=idx.device)
        buf[:, :T0] = idx
        length = T0
        # Start of the model's window: positions are relative to it (the model learned positions 0..block-1).
        # When the window is full it moves forward by `shift` tokens and the cache is rebuilt from the kept ones.
        start = max(0, T0 - block)
        if use_cache and self.kv_cache_batch_size != B:
            self.setup_kv_cache(B)
        step = step_fn if step_fn is not None else self.forward
        refill = True  # the cache must be (re)built from the whole window
        # The position of the next cached step lives on the device and is advanced in place: building it from a
        # Python int every token would be a host-to-device copy that waits for the GPU.
        step_pos = torch.zeros(1, dtype=torch.long, device=idx.device)
        last = buf[:, T0 - 1 : T0].clone()  # (B, 1), a fresh tensor: the compiled step sees fixed strides
        finished = torch.zeros(B, dtype=torch.bool, device=idx.device)
        # Checking "all stopped" reads a flag back to the host; on an accelerator do it only every 8 tokens.
        check_every = 1 if idx.device.type == "cpu" else 8
        for i in range(max_new_tokens):
            if length - start > block:  # one token too many for the window: move it forward by `shift`
                start += shift
                refill = True
            if not use_cache:
                logits = self.forward(buf[:, start:length])[0][:, -1]
            elif refill:  # one batched forward over the window fills the cache
                pos = torch.arange(length - start, device=idx.device)
                logits = self.head(self.hidden_states(buf[:, start:length], pos)[:, -1])  # last position only
                step_pos.fill_(length - start)
                refill = False
            else:  # one new token at position step_pos
                logits = step(last, pos=step_pos)[0][:, -1]
                step_pos += 1
            nxt = next_token(logits, temperature, top_k, top_p, generator)  # (B,)
            if stop_token is not None:
                # A finished sequence keeps emitting the stop token, so the batch stays rectangular.
                nxt = torch.where(finished, torch.full_like(nxt, stop_token), nxt)
                finished = finished | (nxt == stop_token)
            buf[:, length] = nxt
            length += 1
            last = nxt[:, None]  # (B,) -> (B, 1)
            yield nxt
            if stop_token is not None and i % check_every == check_every - 1 and bool(finished.all()):
                return

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        stop_token: int | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
        window_shift: int | None = None,
        step_fn=None,
    ) -> torch.Tensor:
        """Continue the prompts idx (B, T) by up to max_new_tokens tokens; returns (B, T + n).

        temperature 0 is greedy decoding. Sequences that emit `stop_token` are padded with it until all
        sequences have stopped (or max_new_tokens is reached). With the KV cache each step runs the model on one
        token. Past block_size the context window slides forward by `window_shift` tokens (default block_size
        // 4) and the cache is rebuilt from the kept tokens; use_cache=False follows the same windows, so both
        paths give the same tokens. window_shift=1 is the classic "always the last block_size tokens" window,
        at the price of a full forward per token once the window is full. `step_fn` replaces self.forward for
        the single-token cached steps (e.g. a CUDA-graph-compiled forward; see sample.py).
        """
        was_training = self.training
        self.eval()
        out = [idx]
        try:
            for nxt in self.generate_stream(
                idx, max_new_tokens, temperature, top_k, top_p, stop_token, generator, use_cache, window_shift,
                step_fn,
            ):
                out.append(nxt[:, None])
        finally:
            self.train(was_training)
        return torch.cat(out, dim=1)


# ----------------------------------------------------------------------------- sampling: small pure functions


def logits_to_probs(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """Next-token logits (B, V) -> a probability distribution (B, V) after temperature, top-k and top-p.

    temperature == 0 means greedy: all mass on the argmax. top_k keeps exactly the k largest logits; top_p keeps
    the smallest set of most likely tokens whose total probability reaches p (always at least one token).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    logits = logits.float()
    if temperature == 0:
        return F.one_hot(logits.argmax(dim=-1), logits.size(-1)).to(logits.dtype)
    logits = logits / temperature
    use_k = top_k is not None and top_k < logits.size(-1)
    use_p = top_p is not None and top_p < 1.0
    if not (use_k or use_p):
        return F.softmax(logits, dim=-1)
    # The candidates, most likely first: topk is sorted, and on a 50K vocabulary much cheaper than a full sort.
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
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def next_token(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits (B, V) -> the next token (B,): the argmax when temperature is 0 (no need to build a one-hot
    distribution and draw from it), else a draw from logits_to_probs."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    return sample_token(logits_to_probs(logits, temperature, top_k, top_p), generator)
