"""The GPT-2 language model, in reading order.

    KVCache -> CausalSelfAttention -> MLP -> Block -> GPTConfig -> GPT

Shapes use B = batch, T = sequence length, C = n_embd, H = n_head, D = C // H, V = vocab.
Parameter names follow OpenAI's GPT-2 (wte, wpe, h.N.ln_1, attn.c_attn, ...) so its weights map one to one.
Nothing here knows about optimizers, data or training loops, nor about decoding: generate.py turns the model's
logits into tokens, using the KV cache and the `pos`-based cached forward defined here.
"""

from __future__ import annotations

import math
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
