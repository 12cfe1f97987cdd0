"""The GPT-2 language model, in reading order.

    KVCache -> CausalSelfAttention -> MLP -> Block -> GPTConfig -> GPT

Shapes use B = batch, T = sequence length, C = n_embd, H = n_head, D = C // H, V = vocab.
Parameter names follow OpenAI's GPT-2 (wte, wpe, h.N.ln_1, attn.c_attn, ...) so its weights map one to one.
GPTConfig's architecture options (arch="modern": RoPE, RMSNorm, QK-norm, ReLU², an untied zero-init head,
zero-init projections, logit soft-capping) are all off by default, and then the model is exactly GPT-2.
GPTConfig declares each model setting once, with its help and allowed values: the training config, its --help,
the resume check and the Hugging Face export derive theirs from it.
Nothing here knows about optimizers, data or training loops, nor about decoding: gptkit/generate.py turns the model's
logits into tokens, using the KV cache and the `pos`-based cached forward defined here.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

# ----------------------------------------------------------------------------- building blocks


class KVCache(nn.Module):
    """Preallocated keys and values of one attention layer, for incremental decoding.

    The buffers have a fixed shape (B, H, max_len, D) so that a decode step always sees the same tensor
    shapes and addresses: that is what lets `torch.compile(mode="reduce-overhead")` capture it as a CUDA graph.
    Row b holds sequence b; a forward may use some rows only (a serving engine's requests: CacheSlice.rows).
    """

    def __init__(self, batch_size: int, n_head: int, max_len: int, head_dim: int, device, dtype):
        super().__init__()
        shape = (batch_size, n_head, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)

    def update(self, at: CacheSlice, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, H, T, D) at the rows and positions of `at`; return the keys and values the queries
        attend over: those rows' first at.length slots, (B, H, length, D) (views, no copy)."""
        # Row b's tokens go to slots pos (T,) or pos[b] (B, T): advanced indices (B, 1) and pos broadcast to
        # (B, T), so the values are (B, T, H, D). The rows' absolute indices into the whole buffer: a compiled
        # step writes it in place (one index_put each), never a copy of a slice of it.
        k, v = k.to(self.k.dtype).transpose(1, 2), v.to(self.v.dtype).transpose(1, 2)  # (B, T, H, D)
        b = at.row_ids[:, None]
        self.k[b, :, at.pos] = k
        self.v[b, :, at.pos] = v
        return self.k[at.rows, :, : at.length], self.v[at.rows, :, : at.length]


@dataclass
class CacheSlice:
    """Where the tokens of a cached forward sit in the KV cache, and the attention's shape over it, worked out
    once for all layers (GPT._cache_slice builds it: the one place that decides the decode attention's shape).

    pos: the tokens' absolute positions, (T,) for every row alike or (B, T) for each row its own.
    rows: the cache rows the B sequences occupy, slice(start, stop) (the rows' buffers stay views); row_ids:
        the same as a tensor (B,), start..stop-1, for writing into them.
    length: the cache slots read: the first `length` (> every position in pos). The whole cache keeps one
        shape for every step (CUDA graphs); only the filled part reads less (the CPU's decode is bound by
        reading memory).
    mask: None, or (T, length) / (B, 1, T, length) booleans: query t sees slot j only when j <= its position:
        earlier tokens and itself, never an unwritten slot (nor a slot past the filled ones that `length`'s
        rounding up to a bucket added).
    causal: no mask, plain causal attention: the T tokens are a window's first T, at slots 0..T-1 (a prompt's
        forward), and `length` is T.
    """

    pos: torch.Tensor
    rows: slice
    row_ids: torch.Tensor
    length: int
    mask: torch.Tensor | None
    causal: bool = False
    _additive: dict = field(default_factory=dict)  # dtype -> the mask as 0 / -inf, made by the first layer

    def attn_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The mask as scaled_dot_product_attention adds it, 0 where seen and -inf where hidden, in the
        queries' dtype: converted once for all layers (from booleans, every layer's attention would convert
        it again)."""
        if self.mask is None:
            return None
        if dtype not in self._additive:
            self._additive[dtype] = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device).masked_fill_(
                ~self.mask, float("-inf"))
        return self._additive[dtype]


# The decode attention's shape. A cached forward that reads exactly the filled slots has a new key length every
# token; a backend that plans per shape then plans per token (cuDNN's attention, which torch picks by default
# on Hopper when there is a mask, measured at ~45 ms a token for GPT-2 on an H200 instead of ~4.5 ms). So:
# - the slots read are rounded up to a multiple of KV_LENGTH_BUCKET (at most the cache's), and the mask hides
#   the extra ones: at most block_size / 64 key lengths (16 for GPT-2), whatever the decode's length;
# - a prompt's forward from slot 0 (the window's first T tokens, reading T slots) is plain causal attention,
#   no mask (flash attention takes it);
# - on a GPU the cached forwards run with CACHED_ATTENTION_BACKENDS only: flash where there is no mask,
#   memory-efficient attention where there is one (it takes masks of any length and builds no plans), never
#   cuDNN's per-shape plans. (On the CPU the list changes nothing: its kernels are flash and math.)
KV_LENGTH_BUCKET = 64
CACHED_ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def bucketed_length(length: int, max_len: int) -> int:
    """The slots a cached forward reads when `length` are filled: length rounded up to a multiple of
    KV_LENGTH_BUCKET, at most max_len (the cache's slots)."""
    return min(max_len, -(-length // KV_LENGTH_BUCKET) * KV_LENGTH_BUCKET)


def bucketed_forward(hidden, idx: torch.Tensor, block_size: int) -> torch.Tensor:
    """hidden(idx) for an uncached forward of idx (B, T) of any length (hidden: model.hidden_states or a compiled
    one), with the decode's policy for the attention's shapes: the rows are right-padded with token 0 to
    bucketed_length(T, block_size) and the padding's outputs cut off, so that prompts and windows of every
    length give attention at most block_size / KV_LENGTH_BUCKET shapes, not one per length (cuDNN's attention
    plans per shape: ~45 ms per new length for GPT-2 on an H200). Causal attention never lets a later position
    change an earlier one: the T outputs are those of the unpadded forward (to float rounding)."""
    T = idx.size(-1)
    padded = max(T, bucketed_length(T, block_size))  # (T > block_size: hidden_states' own error)
    if padded > T:
        idx = F.pad(idx, (0, padded - T))
    return hidden(idx)[:, :T]


# The modern block's pieces (GPTConfig's options; all off for GPT-2): small functions, so that the blocks below
# read as GPT-2 with a few one-line choices.


def make_norm(config: GPTConfig) -> nn.Module:
    """GPT-2's LayerNorm (a gain and, with bias, a bias), or with norm="rmsnorm" a parameter-free RMSNorm."""
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.n_embd, eps=config.ln_eps, elementwise_affine=False)
    return nn.LayerNorm(config.n_embd, eps=config.ln_eps, bias=config.bias)


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    # GPT-2 uses the tanh approximation of GELU; the exact erf form would change its pretrained outputs.
    return F.gelu(x, approximate="tanh")


def gelu_exact(x: torch.Tensor) -> torch.Tensor:
    # nanoGPT's MLP (nn.GELU()): x * Phi(x) with the erf. Its checkpoints' logits move by ~1e-4 to 1e-3 with tanh.
    return F.gelu(x)


# GPTConfig.activation -> the MLP's nonlinearity
ACTIVATIONS = {"gelu_tanh": gelu_tanh, "gelu": gelu_exact, "relu2": relu_squared}


def rotary_angles(pos: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE: the cos and sin (T, D/2) of the angles pos * base^(-2i/D) by which channel pair (i, i + D/2) of
    the tokens at positions pos (T,) is turned; (B, 1, T, D/2) for positions per row, pos (B, T). Computed
    from pos on every call: no buffers, so nothing for DDP to broadcast and nothing to move between devices."""
    inv_freq = base ** -(torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float32) / head_dim)
    angle = pos.float()[..., None] * inv_freq  # (T, D/2) or (B, T, D/2)
    if angle.dim() == 3:
        angle = angle[:, None]  # (B, 1, T, D/2): the same angles for every head
    return angle.cos(), angle.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Turn the channel pairs of x (B, H, T, D) by the angles of rotary_angles: a query-key dot product then
    depends on the distance of their positions only."""
    x1, x2 = x.float().chunk(2, dim=-1)  # (B, H, T, D/2) each
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.qk_norm = config.qk_norm
        self.rope_base = config.rope_base if config.rope else None
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # fused q, k, v
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.kv_cache: KVCache | None = None  # set by GPT.setup_kv_cache for incremental decoding

    def forward(self, x: torch.Tensor, cache: CacheSlice | None = None) -> torch.Tensor:
        B, T, C = x.shape
        # (B, T, 3C) -> 3 x (B, T, C) -> each (B, T, H, D) -> (B, H, T, D)
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.qk_norm:  # unit-RMS queries and keys per head: the attention logits cannot blow up
            q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))
        if self.rope_base is not None:  # positions enter here, as rotations, instead of through wpe
            positions = cache.pos if cache is not None else torch.arange(T, device=x.device)
            cos, sin = rotary_angles(positions, C // self.n_head, self.rope_base)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        dropout_p = self.dropout if self.training else 0.0

        if cache is None:
            # Plain causal attention over the T tokens of x (training, full forward).
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        else:
            # Incremental decoding: x holds the tokens at the positions cache.pos. Store their keys and values,
            # then attend over the first cache.length slots, the mask (if any) hiding later and unwritten ones.
            k_all, v_all = self.kv_cache.update(cache, k, v)  # (B, H, length, D)
            y = F.scaled_dot_product_attention(q, k_all.to(q.dtype), v_all.to(q.dtype),
                                               attn_mask=cache.attn_mask(q.dtype), is_causal=cache.causal)

        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, H, T, D) -> (B, T, H, D) -> (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)
        self.act = ACTIVATIONS[config.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = make_norm(config)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cache: CacheSlice | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache)
        return x + self.mlp(self.ln_2(x))


# ----------------------------------------------------------------------------- the model


# The architecture presets: GPTConfig.arch names one, and it fills in every option below that is left None.
# "gpt2" is OpenAI's GPT-2. "modern" is the block of modded-nanogpt's speedrun and nanochat: with the Muon
# optimizer (gptkit/optim.py) it reaches a given loss several times sooner (README.md, "The modern recipe").
ARCH_PRESETS = {
    "gpt2": dict(bias=True, rope=False, norm="layernorm", qk_norm=False, activation="gelu_tanh",
                 tie_embeddings=True, zero_init_proj=False, logit_softcap=0.0),
    "modern": dict(bias=False, rope=True, norm="rmsnorm", qk_norm=True, activation="relu2",
                   tie_embeddings=False, zero_init_proj=True, logit_softcap=15.0),
}


def option(default, help: str, choices: tuple | None = None, *, setting: bool = True, shape: bool = True,
           gpt2: bool = True):
    """A GPTConfig field, declared once with what the rest of the project derives from it.

    help: the one-line description that train.py --help shows; choices: the allowed values (None: any).
    setting: a training run sets it, train.py --NAME=VALUE (False: the data or the loaded weights set it).
    shape: a resumed run must keep it (False: it may change between runs, like dropout).
    gpt2: a Hugging Face GPT-2 can hold any value of it (False: only GPT-2's, ARCH_PRESETS["gpt2"], and for
        the activation also exact gelu: gptkit/hf_gpt2.py's HF_ACTIVATIONS).
    """
    return field(default=default, metadata=dict(help=help, choices=choices, setting=setting, shape=shape,
                                                gpt2=gpt2))


@dataclass
class GPTConfig:
    """The model's settings. A new option is written here (and in ARCH_PRESETS if the presets set it): the
    training config, --help, the resume check and the export derive from these declarations."""

    block_size: int = option(1024, "context length in tokens")
    vocab_size: int = option(50257, "tokenizer vocabulary; logits have exactly this many columns", setting=False)
    n_layer: int = option(12, "transformer blocks")
    n_head: int = option(12, "attention heads per block; must divide n_embd")
    n_embd: int = option(768, "model width")
    dropout: float = option(0.0, "dropout probability; 0.0 for pretraining, 0.1+ for fine-tuning", shape=False)
    bias: bool | None = option(None, "biases in Linear and LayerNorm layers (auto: the arch's; GPT-2 has them)")
    ln_eps: float = option(1e-5, "LayerNorm (or RMSNorm) epsilon (GPT-2: 1e-5)", setting=False, shape=False)
    # Matmuls with a round width run faster on GPUs (50257 -> 50304 with 64). The extra rows are never returned
    # as logits, so never sampled.
    vocab_multiple: int = option(1, "the embedding table's rows are rounded up to a multiple of this",
                                 setting=False)
    # ---- architecture options: each None (auto) takes the value of the preset `arch`; GPT-2 has them all
    # off, and the GPT-2 weights need them off.
    arch: str = option("gpt2", "preset for the options left auto: gpt2 (all off) or modern (all on)",
                       tuple(ARCH_PRESETS))
    # Attention then sees only the distance between positions; there is no position table wpe.
    rope: bool | None = option(None, "rotary position embeddings instead of the learned position table",
                               gpt2=False)
    rope_base: float = option(10000.0, "RoPE base: channel pair i turns by pos * rope_base^(-2i / head size)")
    norm: str | None = option(None, "layernorm (GPT-2) or rmsnorm (parameter-free)", ("layernorm", "rmsnorm"),
                              gpt2=False)
    # Unit-RMS queries and keys: the attention logits cannot blow up.
    qk_norm: bool | None = option(None, "RMS-normalise queries and keys per head before attention", gpt2=False)
    # GPT-2's weights need gelu_tanh; nanoGPT's checkpoints were trained with gelu. A Hugging Face GPT-2 holds
    # either (activation_function gelu_new / gelu), llama.cpp's gpt2 graph only gelu_tanh.
    activation: str | None = option(None, "MLP nonlinearity: gelu_tanh (GPT-2's tanh approximation), gelu "
                                          "(exact erf, nanoGPT's) or relu2 (relu(x)**2)", tuple(ACTIVATIONS),
                                    gpt2=False)
    # Untied, the head starts at zero: the first predictions are exactly uniform.
    tie_embeddings: bool | None = option(None, "the head is the token embedding (GPT-2); False: its own, "
                                               "zero-initialised weight", gpt2=False)
    # Every block starts as the identity. Initialisation only: the function is GPT-2's, so the model exports.
    zero_init_proj: bool | None = option(None, "initialise the attention and MLP output projections to zero")
    logit_softcap: float | None = option(None, "logits -> cap * tanh(logits / cap); 0 = off", gpt2=False)

    @classmethod
    def setting_names(cls) -> tuple[str, ...]:
        """The fields a training run sets; gptkit/config.py's TrainConfig has each, with its help."""
        return tuple(f.name for f in fields(cls) if f.metadata["setting"])

    @classmethod
    def shape_names(cls) -> tuple[str, ...]:
        """The settings a resumed run must keep: the model's shape and architecture."""
        return tuple(f.name for f in fields(cls) if f.metadata["setting"] and f.metadata["shape"])

    @classmethod
    def non_gpt2_names(cls) -> tuple[str, ...]:
        """The options a Hugging Face GPT-2 can hold only at GPT-2's value."""
        return tuple(f.name for f in fields(cls) if not f.metadata["gpt2"])

    def __post_init__(self):
        self._check_choice("arch")  # before the preset it names is read
        for name, value in ARCH_PRESETS[self.arch].items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        for f in fields(self):
            self._check_choice(f.name)
            value, kind = getattr(self, f.name), f.type.partition(" |")[0]  # a string, "bool | None": postponed
            if kind == "int" and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"GPTConfig.{f.name} must be a positive integer, got {value!r}")
            if kind == "bool" and not isinstance(value, bool):
                raise ValueError(f"GPTConfig.{f.name} must be True or False, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); "
                f"each head gets n_embd // n_head channels"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if not self.ln_eps > 0:
            raise ValueError(f"GPTConfig.ln_eps must be positive, got {self.ln_eps!r}")
        if not (_is_finite(self.logit_softcap) and self.logit_softcap >= 0):
            raise ValueError(f"GPTConfig.logit_softcap must be a number >= 0 (0 = off), got {self.logit_softcap!r}")
        if not (_is_finite(self.rope_base) and self.rope_base > 1):
            raise ValueError(f"GPTConfig.rope_base must be a number > 1, got {self.rope_base!r}")
        if self.rope and (self.n_embd // self.n_head) % 2:
            raise ValueError(f"GPTConfig.rope needs an even head size (n_embd // n_head), got "
                             f"{self.n_embd // self.n_head}")

    def _check_choice(self, name: str) -> None:
        choices, value = self.__dataclass_fields__[name].metadata["choices"], getattr(self, name)
        if choices is not None and value not in choices:
            raise ValueError(f"GPTConfig.{name} must be one of {', '.join(choices)}, got {value!r}")

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


def _is_finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        # Training only: keep each block's input, recompute the block's inside in the backward pass (far less
        # activation memory for about one more forward's compute). Set by train.py's activation_checkpointing.
        self.activation_checkpointing = False
        # The KV cache's dtype (setup_kv_cache's default); None: the embedding's. Set by gptkit/cpu_decode.py's
        # pack_for_cpu to float16 for weights rounded to 16 bits or fewer, as llama.cpp keeps its cache.
        self.kv_cache_dtype: torch.dtype | None = None
        layers = dict(wte=nn.Embedding(config.padded_vocab_size, config.n_embd))
        if not config.rope:  # learned positions; with RoPE the attention rotates queries and keys instead
            layers["wpe"] = nn.Embedding(config.block_size, config.n_embd)
        layers.update(
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=make_norm(config),
        )
        self.transformer = nn.ModuleDict(layers)
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        # How the training loss multiplies by the head (see HeadMatmuls): in autocast's precision, unless a
        # trainer swaps in another (train.py's fp8_head: gptkit/fp8.py's FP8 matmuls).
        self.head_matmuls: type[HeadMatmuls] = HeadMatmuls
        if config.tie_embeddings:
            # Weight tying: the output projection is the token embedding (GPT-2 does this; saves V*C parameters).
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        # GPT-2 scales the init of the projections that write into the residual stream by 1/sqrt(2 * n_layer)
        # (two per block), so the residual's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        # The modern options' initialisation: zeros where the output is better off starting silent.
        for name, p in self.named_parameters():
            if (name.endswith("c_proj.weight") and config.zero_init_proj) or (
                name == "lm_head.weight" and not config.tie_embeddings
            ):
                nn.init.zeros_(p)

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
        the head, so it does its work as a weight and is counted; an untied head is counted too)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and "wpe" in self.transformer:
            n -= self.transformer.wpe.weight.numel()
        return n

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        pos: torch.Tensor | None = None,
        *,
        return_logits: bool = False,
        head_loss: Callable[[GPT, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """idx (B, T) token ids -> (logits, loss).

        Without targets: the logits (B, T, vocab_size) of every position, and None.
        With targets (B, T) (-1 = ignored): None and the mean cross-entropy; the logits too only with
        return_logits=True. A training step never looks at the logits, and with a 50K vocabulary they are its
        largest tensors (16 x 1024 tokens: 3.3 GB in fp32, plus the softmax autograd keeps for backward), so the
        loss is computed from the hidden states a slice of the sequence at a time (`linear_cross_entropy`):
        the full logits never exist, and nothing of them outlives the call.

        `pos` (T,) is only for incremental decoding with a KV cache (see `setup_kv_cache`): the absolute
        positions of the tokens in idx.

        head_loss(model, hidden (B, T, C), targets) replaces the mean cross-entropy with another function of
        the hidden states and the head (gptkit/objectives/preference_losses.py's per-sequence log-probabilities): run inside the forward,
        so that DDP, FSDP and torch.compile wrappers see the head used as in any forward.
        """
        x = self.hidden_states(idx, pos)  # (B, T, C)
        if head_loss is not None:
            return None, head_loss(self, x, targets)
        if targets is None:
            return self.head(x), None
        if not return_logits:
            return None, self.loss_from_hidden(x, targets)
        logits = self._logits(x)[..., : self.config.vocab_size]  # (B, T, V): the padding is never returned
        # Nor is it in the softmax: the loss is over the real vocabulary. (B*T, V) vs (B*T,)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)
        return logits, loss

    def loss_from_hidden(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of the head's predictions from hidden states x (B, T, C) against targets
        (B, T) (-1 = ignored): the same value and gradients as F.cross_entropy on the logits, without ever
        holding all of them (see linear_cross_entropy)."""
        return linear_cross_entropy(
            x.flatten(0, 1), self.lm_head.weight, targets.flatten(), softcap=self.config.logit_softcap,
            vocab_size=self.config.vocab_size, matmuls=self.head_matmuls,
        )

    def hidden_states(self, idx: torch.Tensor, pos: torch.Tensor | None = None, *, rows: slice | None = None,
                      length: int | None = None, exact: bool = False) -> torch.Tensor:
        """idx (B, T) -> the final LayerNorm's output (B, T, C), the input of the head.

        With `pos` the forward is cached (see setup_kv_cache): the tokens sit at the absolute positions pos,
        (T,) for every row or (B, T) per row; their keys and values are written into the cache rows `rows`
        (default: all of them, B must then be the cache's batch size), and attention reads the first `length`
        slots of those rows (default: all block_size; `length` must exceed every position in pos), rounded up
        to KV_LENGTH_BUCKET unless `exact` (see _cache_slice)."""
        B, T = idx.shape
        if pos is None:
            if T > self.config.block_size:
                raise ValueError(
                    f"input has {T} tokens but the model's block_size is {self.config.block_size}; "
                    f"crop the input to its last {self.config.block_size} tokens"
                )
            x = self.transformer.drop(self._embed(idx, torch.arange(T, device=idx.device)))
            recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
            for block in self.transformer.h:
                x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        else:
            cache = self._cache_slice(B, pos, rows, length, exact)
            x = self.transformer.drop(self._embed(idx, pos))
            with sdpa_kernel(CACHED_ATTENTION_BACKENDS):  # (see KV_LENGTH_BUCKET)
                for block in self.transformer.h:
                    x = block(x, cache)
        return self.transformer.ln_f(x)

    def _cache_slice(self, B: int, pos: torch.Tensor, rows: slice | None, length: int | None,
                     exact: bool = False) -> CacheSlice:
        """The CacheSlice of a cached forward of B sequences at positions pos, built once for all layers.
        exact: read `length` slots as asked, not rounded up to KV_LENGTH_BUCKET: for an eager step on the CPU,
        whose attention kernels plan nothing per shape and where every slot read is memory traffic (a serving
        engine's 64-row step reads more bytes of the cache than of int8 weights: BENCHMARKS.md, "A full batch
        on the CPU")."""
        cache = self.transformer.h[0].attn.kv_cache
        if cache is None:
            raise RuntimeError("forward(pos=...) needs a KV cache: call model.setup_kv_cache(...) first")
        n_rows, max_len = cache.k.size(0), cache.k.size(2)
        rows = rows if rows is not None else slice(0, n_rows)
        # Plain arithmetic on the slice's ends: Dynamo (torch 2.11) cannot trace slice.indices.
        start, stop = (rows.start or 0), (n_rows if rows.stop is None else rows.stop)
        if rows.step not in (None, 1) or not 0 <= start <= stop <= n_rows or stop - start != B:
            raise ValueError(f"{B} sequences do not fit the cache rows {rows} of a cache with {n_rows} rows "
                             f"(rows must be a contiguous slice of B rows inside the cache)")
        length = max_len if length is None else length
        if not 0 < length <= max_len:
            raise ValueError(f"length must be in 1..{max_len} (the cache's slots), got {length}")
        rows, row_ids = slice(start, stop), torch.arange(start, stop, device=pos.device)
        T = pos.size(-1)
        if pos.dim() == 1 and T > 1 and length == T:  # a prompt from slot 0: T positions < T are 0..T-1
            return CacheSlice(pos, rows, row_ids, length, None, causal=True)
        if not exact:
            length = bucketed_length(length, max_len)  # (see KV_LENGTH_BUCKET)
        slots = torch.arange(length, device=pos.device)
        mask = slots <= pos[..., None]  # (T, length) or (B, T, length)
        return CacheSlice(pos, rows, row_ids, length, mask if pos.dim() == 1 else mask[:, None])

    def _embed(self, idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) at positions pos (T,) or (B, T) -> the residual stream's input (B, T, C): the token
        embedding plus the learned position embedding, (T, C) or (B, T, C); with RoPE the positions act in the
        attention instead."""
        if "wpe" not in self.transformer:
            return self.transformer.wte(idx)
        return self.transformer.wte(idx) + self.transformer.wpe(pos)

    def _logits(self, x: torch.Tensor, fp32: bool = False) -> torch.Tensor:
        """The output head: (..., C) -> logits over the padded vocabulary (..., Vp), soft-capped to
        (-logit_softcap, logit_softcap) when that is set. Every path to logits goes through here (the training
        loss, linear_cross_entropy, applies the same cap). The cap is computed in float32, so capped logits
        are float32 whatever the matmul's precision. fp32=True: computed in float32 over the real vocabulary
        only, (..., V) (see `head`)."""
        if fp32 and isinstance(self.lm_head, nn.Linear):
            logits = linear_fp32(x, self.lm_head.weight[: self.config.vocab_size])  # rows 0..V-1: a view
        else:  # (also an inference-only head of another kind, e.g. gptkit/cpu_decode.py's: float32 logits)
            logits = self.lm_head(x)
        cap = self.config.logit_softcap
        return cap * torch.tanh(logits.float() / cap) if cap else logits  # fp32, as the loss caps

    def head(self, x: torch.Tensor, *, fp32: bool = False) -> torch.Tensor:
        """(..., C) -> logits (..., V). The padding columns of a padded vocabulary are dropped (a view): they are
        never a prediction, so never sampled.

        fp32=True (what sampling uses): float32 logits, also from bf16/fp16 weights and under autocast. GPT-2's
        logits reach ~100, where bf16 values are 0.25-0.5 apart: rounded logits would shift the probabilities
        that temperature and top-p work with. The padding rows of the weight are not even read."""
        return self._logits(x, fp32)[..., : self.config.vocab_size]

    # ------------------------------------------------------------------------- KV cache

    def setup_kv_cache(self, batch_size: int, device=None, dtype: torch.dtype | None = None) -> None:
        """Give every attention layer a preallocated cache for `block_size` positions, in `dtype` (default:
        cache_dtype())."""
        p = self.transformer.wte.weight
        device = device if device is not None else p.device
        dtype = dtype if dtype is not None else self.cache_dtype()
        c = self.config
        for block in self.transformer.h:
            block.attn.kv_cache = KVCache(batch_size, c.n_head, c.block_size, c.n_embd // c.n_head, device, dtype)

    def cache_dtype(self) -> torch.dtype:
        """The KV cache's dtype when setup_kv_cache is given none: kv_cache_dtype, else the embedding's."""
        return self.kv_cache_dtype or self.transformer.wte.weight.dtype

    def copy_cache_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` slots of row src of every layer's KV cache into row dst (a serving engine
        moving a sequence into the row another one left)."""
        for block in self.transformer.h:
            cache = block.attn.kv_cache
            cache.k[dst, :, :length] = cache.k[src, :, :length]
            cache.v[dst, :, :length] = cache.v[src, :, :length]

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
        if "wpe" in self.transformer:  # (with RoPE there is no table: any position up to block_size works)
            self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size].detach().clone())

    @torch.no_grad()
    def grow_vocab(self, vocab_size: int) -> None:
        """Add token ids vocab_size_old .. vocab_size - 1 (a tokenizer's new special tokens, for fine-tuning).
        Their embedding rows (and an untied head's) start at the mean of the existing rows: the new tokens'
        logits start at the average logit, neither dominant (a zero padding row of GPT-2 would score 0, far
        above its real logits of about -60) nor negligible. GPT-2's padding rows (50257..50303) take the first
        new ids, so its weights keep their shapes; past the padding, the tables get new rows."""
        c = self.config
        if vocab_size <= c.vocab_size:
            raise ValueError(f"grow_vocab: {vocab_size} is not larger than the vocabulary's {c.vocab_size}")
        old, rows = c.vocab_size, math.ceil(vocab_size / c.vocab_multiple) * c.vocab_multiple
        tables = [self.transformer.wte] + ([] if c.tie_embeddings else [self.lm_head])
        for module in tables:
            weight = module.weight
            if rows > weight.size(0):  # (rows, C): the old rows, then room for the new ones
                grown = weight.new_zeros(rows, weight.size(1))
                grown[: weight.size(0)] = weight
                module.weight = nn.Parameter(grown, requires_grad=weight.requires_grad)
            module.weight[old:vocab_size] = module.weight[:old].mean(dim=0)
        if isinstance(self.transformer.wte, nn.Embedding):
            self.transformer.wte.num_embeddings = self.transformer.wte.weight.size(0)
        self.lm_head.out_features = self.lm_head.weight.size(0)
        if c.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        c.vocab_size = vocab_size

    # ------------------------------------------------------------------------- nanoGPT compatibility
    # nanoGPT's two most used calls, with its signatures, so that notebooks and scripts written for it run
    # unchanged. Both delegate to the library (gptkit/hf_gpt2.py loads, gptkit/generate.py decodes), imported
    # inside the call: importing model.py imports nothing of the project, so this file still works on its own.

    @classmethod
    def from_pretrained(cls, model_type: str, override_args: dict | None = None) -> GPT:
        """nanoGPT's loader: a GPT with the weights of 'gpt2', 'gpt2-medium', 'gpt2-large' or 'gpt2-xl' (from the
        Hugging Face Hub, or its local cache), or of a local Hugging Face GPT-2 folder. override_args may hold
        only dropout (default 0.0), as in nanoGPT; like nanoGPT's, the model comes in training mode (call .eval()
        to sample). Unlike nanoGPT's, its vocabulary is padded to a multiple of 64 rows (50304 for GPT-2), which
        never shows: see gptkit.hf_gpt2.load_pretrained, which this calls."""
        from gptkit.hf_gpt2 import HFGPT2Error, load_pretrained

        override_args = override_args or {}
        other = sorted(map(str, set(override_args) - {"dropout"}))
        if other:
            raise HFGPT2Error(f"GPT.from_pretrained: override_args may hold only dropout (as in nanoGPT), got "
                              f"{', '.join(other)}; gptkit.hf_gpt2.load_pretrained also takes block_size")
        return load_pretrained(model_type, **override_args).train()

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None
    ) -> torch.Tensor:
        """nanoGPT's sampler: the prompts idx (B, T) continued by max_new_tokens tokens, (B, T + max_new_tokens).
        Each token is drawn from softmax(logits / temperature), over the top_k likeliest tokens when top_k is
        set, given the last block_size tokens (nanoGPT's window, which slides one token at a time).

        temperature=0 is greedy (the argmax), where nanoGPT would divide by zero. The draws use torch's global
        generator, so torch.manual_seed repeats them (but picks other tokens than nanoGPT for a seed: it draws
        differently). Dropout is off while it runs, in either mode; the KV cache makes it faster than nanoGPT's.
        The same as gptkit.generate.generate(model, idx, max_new_tokens, SamplingOptions(temperature=...,
        top_k=..., window_shift=1)), which also offers top-p, stop tokens and a seeded generator."""
        from gptkit.generate import SamplingOptions, generate

        options = SamplingOptions(temperature=temperature, top_k=top_k, window_shift=1)
        return generate(self, idx, max_new_tokens, options)


# ----------------------------------------------------------------------------- the head's arithmetic
#
# The training loss and the sampling head, as functions of the hidden states and the head's weight.

# Logit elements (rows x padded vocabulary) the loss computes at once, by device type (others: the CPU's).
# Up to one slice's worth of rows the loss is one plain F.cross_entropy on the logits (the char models:
# 64 x 256 x 65 = 1M); beyond, a slice of rows at a time. CPU: 2**25 elements = 128 MiB in fp32, 512 rows of
# GPT-2's 50,304-column head. CUDA: 2**28, 4,096 rows (0.8 GiB of fp32 logits), because every slice re-reads
# and re-writes the fp32 (V, C) weight gradient (154 MB for GPT-2): at 32 x 1024 tokens, 512-row slices would
# move ~20 GB per micro-batch for it, 4,096-row ones 2.5 GB. `bench.py --loss_chunk=...` compares sizes.
LOSS_CHUNK_ELEMENTS = {"cpu": 2**25, "cuda": 2**28}


def loss_chunk_rows(n_columns: int, device_type: str, chunk_elements: int | None = None) -> int:
    """Rows of logits one slice of the loss holds for a head of n_columns: the largest power of two (round
    shapes for the matmuls) whose logits fit in chunk_elements, by default the device type's
    LOSS_CHUNK_ELEMENTS; at least 1."""
    elements = chunk_elements or LOSS_CHUNK_ELEMENTS.get(device_type, LOSS_CHUNK_ELEMENTS["cpu"])
    return 1 << (max(1, elements // n_columns).bit_length() - 1)


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    softcap: float = 0.0,
    chunk_elements: int | None = None,
    vocab_size: int | None = None,
    matmuls: type[HeadMatmuls] | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of the logits x @ weight.T (soft-capped by `softcap` when > 0) against targets;
    x (N, C), weight (V, C), targets (N,) with -1 = ignored. The same value and gradients as
    F.cross_entropy(logits.float(), targets, ignore_index=-1), with autocast's precision when it is on.

    vocab_size: the real vocabulary when the weight has padding rows after it. Their columns are computed (the
    matmuls keep the round width) but kept out of the softmax, whatever those rows hold: a loaded GPT-2's are
    zero, a logit far above its real ones (around -60), which would otherwise take nearly all the probability.

    Problems of at most one slice's rows (loss_chunk_rows: chunk_elements, by default the device type's
    LOSS_CHUNK_ELEMENTS) take that plain path. Larger ones go through _ChunkedLinearCrossEntropy: a slice of
    rows of logits at a time, so memory stays at a few slices of logits however long the batch is. The cap is
    applied in fp32 on both paths (tanh has no autocast policy: under autocast it would run in bf16).

    matmuls: a HeadMatmuls subclass that computes the chunked path's matmuls otherwise (gptkit/fp8.py's FP8
    ones). It is used only where a backward will follow, and then always (the chunked path, however small):
    evaluation's loss stays that of the weights as they are saved and sampled."""
    device_type = x.device.type
    rows = loss_chunk_rows(weight.size(0), device_type, chunk_elements)
    grad_on = torch.is_grad_enabled()
    needs_grad = (grad_on and x.requires_grad, grad_on and weight.requires_grad)
    special = matmuls not in (None, HeadMatmuls) and any(needs_grad)
    if x.size(0) <= rows and not special:
        logits = F.linear(x, weight)
        if softcap:
            logits = softcap * torch.tanh(logits.float() / softcap)
        return F.cross_entropy(logits[:, :vocab_size].float(), targets, ignore_index=-1)
    # Under autocast the plain path's matmul runs in autocast's dtype: so do the chunks (cast inside).
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
    # Only the gradients autograd will ask for (needs_grad): a frozen head (LoRA's tied wte) needs no (V, C) one.
    n_real = vocab_size or weight.size(0)
    return _ChunkedLinearCrossEntropy.apply(x, weight, targets, rows, float(softcap), dtype, needs_grad,
                                            n_real, matmuls if special else HeadMatmuls)


class HeadMatmuls:
    """The chunked loss's matmuls with the head's weight, in `dtype` (autocast's when it is on): a slice's
    logits, and from its dloss/dlogits the slice's gradient of x and its share of the weight's gradient.
    GPT.head_matmuls names the class the training loss uses; gptkit/fp8.py's subclass computes them in FP8."""

    def __init__(self, x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype):
        self.x, self.w, self.dtype = x.to(dtype), weight.to(dtype), dtype

    def logits(self, rows: slice) -> torch.Tensor:
        """x[rows] @ W^T as float32 (r, V)."""
        return (self.x[rows] @ self.w.t()).float()

    def gradients(self, g: torch.Tensor, rows: slice, need_x: bool, grad_w: torch.Tensor | None):
        """g (r, V) float32 = dloss/dlogits of x[rows]: adds g^T @ x[rows] to grad_w (V, C, float32) unless it
        is None, and returns g @ W (r, C) in dtype, or None unless need_x."""
        g = g.to(self.dtype)
        if grad_w is not None and self.dtype == torch.float32:
            grad_w.addmm_(g.t(), self.x[rows])
        elif grad_w is not None:
            grad_w += (g.t() @ self.x[rows]).float()
        return g @ self.w if need_x else None


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """linear_cross_entropy over slices of `rows` rows, with the gradients computed during the forward.

    For each slice: logits s = x_c @ W^T (in `dtype`, then fp32), z = softcap * tanh(s / softcap) (or z = s),
    loss += logsumexp(z) - z[target]; and, when a backward will follow, dloss/dz = softmax(z) - onehot(target)
    (times 1 - tanh^2 with the cap), then grad_x_c = dz @ W and grad_W += dz^T @ x_c (these three matmuls by
    `matmuls`, a HeadMatmuls: in `dtype`, or in FP8). The slice's logits are then dropped: what is kept for
    backward is grad_x (N, C) and grad_W (V, C), the size of x and of W. The
    backward only scales them by d(total)/d(loss) / n_valid. So the head costs its usual three matmuls (no
    recomputation, unlike checkpointing each slice) and memory holds at most a couple of slices of logits.
    `needs_grad` (x's, W's) says which gradients a backward will ask for: the others are neither computed
    nor kept (a frozen head: two matmuls per slice and no (V, C) buffer).

    The per-row gradients are formed unscaled (values in [-1, 1]) and scaled by 1 / n_valid only in the
    backward, in fp32: with fp16 the tiny scaled values would otherwise underflow before the loss scaler's
    factor reaches them. The loss must be used as a scalar (a mean), which is what training does.
    """

    @staticmethod
    def forward(ctx, x, weight, targets, rows: int, softcap: float, dtype: torch.dtype,
                needs_grad: tuple[bool, bool], n_real: int, matmuls: type[HeadMatmuls]):
        N = x.size(0)
        need_x, need_w = needs_grad
        with_grad = need_x or need_w
        with torch.autocast(x.device.type, enabled=False):
            mm = matmuls(x, weight, dtype)
            valid = targets != -1
            safe = targets.clamp(min=0)[:, None]  # ignored rows pick column 0, then count for nothing
            loss_sum = torch.zeros((), device=x.device, dtype=torch.float32)
            grad_x = []
            grad_w = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if need_w else None
            for lo in range(0, N, rows):
                part = slice(lo, lo + rows)
                tc, vc = safe[part], valid[part, None]
                z = mm.logits(part)  # (r, V) float32
                if softcap:
                    cap = torch.tanh(z / softcap)
                    z = cap * softcap
                if n_real < z.size(1):
                    z[:, n_real:] = float("-inf")  # the vocabulary's padding: probability 0, so gradient 0
                lse = torch.logsumexp(z, dim=-1, keepdim=True)  # (r, 1)
                loss_sum = loss_sum + ((lse - z.gather(1, tc)) * vc).sum()
                if not with_grad:
                    continue
                g = z.sub_(lse).exp_()  # the softmax, in place of z
                g.scatter_add_(1, tc, -vc.float())  # minus the one-hot of the target
                g.mul_(vc)  # ignored rows: no gradient
                if softcap:
                    g.mul_(1 - cap * cap)  # d(cap * tanh(s / cap)) / ds
                grad_xc = mm.gradients(g, part, need_x, grad_w)  # adds to grad_w
                if need_x:
                    grad_x.append(grad_xc)  # (r, C)
            n_valid = valid.sum().float()
        if with_grad:
            ctx.save_for_backward(torch.cat(grad_x) if need_x else None, grad_w, n_valid)
            ctx.dtypes = (x.dtype, weight.dtype)
        return loss_sum / n_valid

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w, n_valid = ctx.saved_tensors
        scale = grad_loss.float() / n_valid
        x_dtype, w_dtype = ctx.dtypes
        dx = None if grad_x is None else (grad_x.float() * scale).to(x_dtype)
        dw = None if grad_w is None else (grad_w * scale).to(w_dtype)
        nothing = (None,) * 7  # targets and the settings have no gradient
        return dx, dw, *nothing


@contextlib.contextmanager
def no_tf32():
    """Full-precision float32 matmuls on CUDA inside the block, whatever the global setting (setup_runtime
    turns TF32 on for speed): TF32 keeps 10 mantissa bits, ~1e-3 relative error, ~0.1 on a logit of 100.

    Switched eagerly, around the call. Inside a torch.compile'd function Dynamo records the switch, but
    inductor's matmul runs under the flag in force when the compiled function is called: a compiled caller
    has to call it inside this block."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def linear_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (..., C) @ weight (N, C)^T as float32 (..., N), whatever the dtype of the weight, with autocast off.

    float32 weights: a full-precision float32 matmul, also on CUDA where TF32 is on (no_tf32): these are the
    evaluation's and sampling's logits. bf16/fp16 weights on CUDA: one matmul that accumulates and writes in
    fp32 (torch.mm's out_dtype), so the weights are read once, in their own precision, as decoding needs.
    Elsewhere (CPU, MPS) such weights are upcast first, which is slower but exact."""
    with torch.autocast(x.device.type, enabled=False):
        if weight.dtype == torch.float32:
            with no_tf32():
                return F.linear(x.float(), weight)
        if x.device.type == "cuda":
            flat = torch.mm(x.reshape(-1, x.size(-1)).to(weight.dtype), weight.t(), out_dtype=torch.float32)
            return flat.view(*x.shape[:-1], weight.size(0))
        return F.linear(x.float(), weight.float())
