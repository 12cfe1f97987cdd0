"""Know before you run: a training run's FLOPs and memory worked out from its shape alone, the largest micro-batch
that fits a device, and what --parallel=auto chooses. (The `train.py --plan` report built on it, the run's model
from its config without weights and the table, is gptkit/plan_report.py.)

    fpt = flops_per_token(model, seq_len)                 # what the logs' MFU divides by, too
    setup = Setup.of_run(cfg, "cuda", torch.bfloat16)     # how one process runs the step
    mem = memory(model, setup, batch_size)                # bytes: weights, gradients, optimizer, activations...
    largest_batch(model, setup, capacity_bytes)           # the largest micro-batch whose peak fits
    largest_valid_batch(model, setup, capacity, sequences)   # batch_size=auto's choice: it also keeps the tokens
    choose_parallel(model, setup, capacity_bytes)         # ("ddp" or "fsdp", why): what --parallel=auto runs

The model given is usually on the meta device (shapes, dtypes and requires_grad, no storage): the counts
(weights, gradients, optimizer states) are then exact, and the activations are the tensors autograd saves
for the backward pass, enumerated op by op below for model.py's forward (checked against autograd's own
saved tensors by tests/test_plan.py, and the peak against measurements by benchmarks/plan_memory.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, NamedTuple

import torch

from gptkit.lora import LoRALinear
from gptkit.optim import block_matrices
from gptkit.runtime import ram
from model import loss_chunk_rows

if TYPE_CHECKING:  # annotations only
    from gptkit.config import TrainConfig

GiB = 2**30
FP32 = 4  # bytes: the weights, gradients and optimizer states of every run, the residual stream, the norms

# ----------------------------------------------------------------------------- FLOPs


def matmul_weights(model) -> tuple[int, int]:
    """(trainable, frozen) weights that multiply activations: every 2-D parameter but the embedding tables,
    which are lookups; the head's weight counts once, tied to wte or not; wpe never. Biases and norm gains
    are not matmul work."""
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = model.lm_head.weight
    trainable = frozen = 0
    for p in model.parameters():  # a shared (tied) parameter is listed once
        if p.dim() == 2 and (id(p) not in lookups or p is head):
            if p.requires_grad:
                trainable += p.numel()
            else:
                frozen += p.numel()
    return trainable, frozen


def attention_flops_per_token(model, seq_len: int | None = None) -> float:
    """Forward + backward FLOPs of attention itself (no weights) per token: PaLM appendix B's 12 * L * C * T.
    Per layer and token the forward multiplies the query by T keys and the weights by T values: 2 matmuls of
    2 * C * T FLOPs; the backward costs twice the forward. T is the run's sequence length (block_size), which
    for a LoRA run on a longer base is shorter than the model's own context."""
    c = model.config
    return 12 * c.n_layer * c.n_embd * (seq_len or c.block_size)


def flops_per_token(model, seq_len: int | None = None) -> float:
    """Training FLOPs per token (forward + backward), PaLM appendix B, counting the matmul weights only:
    6 per trainable weight (forward 2, input gradient 2, weight gradient 2), 4 per frozen one (LoRA's base:
    no weight gradient), plus the attention's 12 * L * C * T (attention_flops_per_token). The model FLOPs
    that MFU counts: activation checkpointing's recomputation is not in it (recompute_flops_per_token)."""
    trainable, frozen = matmul_weights(model)
    return 6 * trainable + 4 * frozen + attention_flops_per_token(model, seq_len)


def forward_flops_per_token(model, seq_len: int | None = None) -> float:
    """One forward pass per token (evaluation): 2 per matmul weight and a third of the attention's FLOPs."""
    return 2 * sum(matmul_weights(model)) + attention_flops_per_token(model, seq_len) / 3


def recompute_flops_per_token(model, seq_len: int | None = None) -> float:
    """What activation checkpointing adds: each block's forward again during the backward, 2 per matmul
    weight of the blocks and the attention's forward third (the head and the loss are not recomputed)."""
    block_weights = sum(p.numel() for block in model.transformer.h for p in block.parameters() if p.dim() == 2)
    return 2 * block_weights + attention_flops_per_token(model, seq_len) / 3


# ----------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class Setup:
    """How one process runs a training step: what, besides the model and the micro-batch, decides memory."""

    device_type: str  # cpu, cuda or mps
    dtype: torch.dtype  # the compute dtype: float32 (no autocast), or bfloat16/float16 under autocast
    seq_len: int  # tokens per sequence (block_size)
    optimizer: str = "adamw"  # adamw, or muon (Muon for the blocks' matrices + AdamW for the rest)
    accum: int = 1  # micro-batches per optimizer step, per process
    world_size: int = 1  # processes (devices) the step is spread over
    compile: bool = False
    checkpointing: bool = False  # activation checkpointing
    # ddp: every process holds the whole model (with world_size 1: a plain run); fsdp: FSDP2 (fully_shard), every
    # process holds 1/world_size of each parameter, gradient and optimizer state (see `memory`)
    parallel: str = "ddp"
    # fsdp, accum > 1: True (what gptkit/parallel.py does) reduce-scatters the gradients after every micro-batch,
    # so no process ever holds them whole; False: the micro-batches before a step's last keep their gradients
    # whole on each process, in fp32, and reduce-scatter them once per step (FSDP2's
    # set_requires_gradient_sync(False): less communication, DDP's gradient memory)
    reduce_every_micro_batch: bool = True
    # what the loss holds (the run's objective's plan_loss): next_token, the sliced cross-entropy
    # (model.linear_cross_entropy); sequence_logps, each sequence's summed log-probability of its reply
    # (gptkit/objectives/preference_losses.py's chunked_sequence_logps)
    loss: str = "next_token"
    # the sequences of one micro-batch item (the objective's sequences_per_item): 1, a preference pair's 2; a
    # micro-batch is whole items
    sequences_per_item: int = 1

    def __post_init__(self):
        if self.parallel not in PARALLEL:
            raise ValueError(f"Setup.parallel must be one of {', '.join(PARALLEL)}, not {self.parallel!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"Setup.loss must be one of {', '.join(LOSSES)}, not {self.loss!r}")
        if self.sequences_per_item < 1:
            raise ValueError(f"Setup.sequences_per_item must be >= 1, not {self.sequences_per_item!r}")

    @classmethod
    def of_run(cls, cfg: TrainConfig, device_type: str, dtype: torch.dtype, world_size: int = 1, *,
               accum: int = 1, compile: bool = False, parallel: str = "ddp", objective=None) -> Setup:
        """The Setup of a training run's config (its block_size, optimizer and activation checkpointing) on
        `world_size` processes of `device_type`, computing in `dtype`; the rest as the caller decides.
        `objective`: the run's (gptkit/objectives/: its plan_loss and sequences_per_item), None: the next-token
        loss."""
        return cls(device_type, dtype, cfg.block_size, cfg.optimizer, accum=accum, world_size=world_size,
                   compile=compile, checkpointing=cfg.activation_checkpointing, parallel=parallel,
                   loss=getattr(objective, "plan_loss", "next_token"),
                   sequences_per_item=getattr(objective, "sequences_per_item", 1))

    @property
    def autocast(self) -> bool:
        return self.dtype != torch.float32

    @property
    def shards(self) -> int:
        """The pieces each parameter, gradient and optimizer state is cut into: world_size under FSDP, else 1."""
        return self.world_size if self.parallel == "fsdp" else 1

    @property
    def fsdp_mixed_precision(self) -> bool:
        """FSDP with the mixed-precision policy, on CUDA in bf16: bf16 parameters gathered for the compute, the
        fp32 ones sharded (the master copy the optimizer updates), gradients reduced in fp32. Elsewhere FSDP
        gathers the parameters in their own dtype and autocast casts them, as without FSDP."""
        return self.parallel == "fsdp" and self.device_type == "cuda" and self.dtype == torch.bfloat16


PARALLEL = ("ddp", "fsdp")
LOSSES = ("next_token", "sequence_logps")  # what Setup.loss may be


@dataclass
class Memory:
    """One process' memory for a training step, in bytes. `peak` is what the device must hold: the weights and
    optimizer states all the time, plus the largest of the step's phases (see `memory`)."""

    weights: int
    gradients: int
    optimizer: int
    activations: int  # what the blocks, embeddings and final norm save for the backward of one micro-batch
    loss: int  # what the loss keeps for its backward (the sliced loss: its gradients, computed in the forward)
    autocast_copies: int  # bf16/fp16 copies of the matmul weights that autocast makes and the backward keeps
    gathered: int  # FSDP: the unsharded (all-gathered) parameters live at once; 0 under DDP
    accumulated: int  # FSDP, accum > 1: the whole fp32 gradients the micro-batches accumulate before the reduction
    working: int  # the largest transient on top of them: loss slices, a block's backward, the optimizer's
    peak: int

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def shard_numel(p, shards: int = 1) -> int:
    """Elements of the largest piece of `p` one of `shards` processes holds. FSDP2 cuts every parameter along
    its first dimension into `shards` pieces of ceil(rows / shards) rows (the last ones shorter or empty, the
    first always full: the rank a plan sizes); 1: the whole parameter. A 0-d parameter counts as one row."""
    rows = p.shape[0] if p.dim() else 1
    return -(-rows // shards) * (p.numel() // rows if rows else 0)


def weights_bytes(model, shards: int = 1) -> int:
    """Exact: every parameter once (a tied head is wte), in its own dtype (a LoRA base on CUDA: bf16); under
    FSDP (shards = world size) one process' piece of each (shard_numel)."""
    return sum(shard_numel(p, shards) * p.element_size() for p in model.parameters())


def gradients_bytes(model, shards: int = 1) -> int:
    """Exact: one gradient per trainable parameter, in the parameter's dtype (fp32). Under DDP they live in
    its all-reduce buckets (train.py's gradient_as_bucket_view): the same bytes, held for the whole run. Under
    FSDP (shards = world size) one process' piece of each, reduce-scattered in fp32 into the sharded parameter's
    dtype."""
    return sum(shard_numel(p, shards) * p.element_size() for p in model.parameters() if p.requires_grad)


def optimizer_bytes(model, optimizer: str, shards: int = 1) -> int:
    """Exact: the optimizer states of gptkit/optim.py. AdamW keeps exp_avg and exp_avg_sq (2 x the parameter,
    fp32) and a 4-byte step counter per parameter; Muon one momentum buffer per matrix it updates (the 2-D
    weights inside the blocks, optim.block_matrices), AdamW the rest. Under FSDP (shards = world size) the
    states are the size of the process' piece of each parameter (the step counter stays whole)."""
    muon, adamw = _optimized(model, optimizer)
    return (sum(shard_numel(p, shards) * p.element_size() for p in muon)
            + sum(2 * shard_numel(p, shards) * p.element_size() + 4 for p in adamw))


def _optimized(model, optimizer: str) -> tuple[list, list]:
    """The trainable parameters Muon updates and those AdamW does, as gptkit/optim.py splits them."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if optimizer != "muon":
        return [], trainable
    muon = {id(p) for p in block_matrices(model)}
    return [p for p in trainable if id(p) in muon], [p for p in trainable if id(p) not in muon]


class _Saved:
    """Bytes autograd keeps for the backward, per token (most tensors) and per micro-batch (the rest)."""

    def __init__(self):
        self.per_token = 0.0
        self.per_batch = 0.0
        self.recomputable = 0.0  # per token: pointwise results a compiled step recomputes instead of keeping

    def __iadd__(self, other: _Saved) -> _Saved:
        self.per_token += other.per_token
        self.per_batch += other.per_batch
        self.recomputable += other.recomputable
        return self

    def total(self, n_tokens: int, compiled: bool) -> int:
        per_token = self.per_token - (self.recomputable if compiled else 0)
        return int(per_token * n_tokens + self.per_batch)


class _Walk:
    """What model.py's forward saves for the backward, op by op, for one Setup. Each rule names the op and
    what PyTorch's derivative of it keeps (torch/csrc/autograd/derivatives.yaml): a Linear keeps its input
    when its weight trains, and its weight when its input needs a gradient; LayerNorm its input, mean and
    rstd; RMSNorm its input and rstd; GELU its input; ReLU its output; dropout its mask; attention q, k, v,
    its output and the log-sum-exp. A tensor kept by two ops is counted once. An op none of whose inputs
    needs a gradient keeps nothing (LoRA's frozen base below its first adapter).

    Under autocast (bf16/fp16) a matmul's fp32 input is cast, and the copy is kept, not the original; the
    outputs of matmuls and of the attention are in the compute dtype already ("low" below). The norms run in
    fp32 (autocast's fp32 op list), so the residual stream and the norms' inputs stay fp32, as in every run.
    The fp32 weights are cast too: those copies are counted apart (`copies`); not under FSDP's mixed-precision
    policy, whose gathered weights are bf16 already (counted as `gathered` in `memory`).
    """

    def __init__(self, model, setup: Setup):
        c = model.config
        self.c, self.s = c, setup
        self.C, self.H = c.n_embd, c.n_head
        self.e = 2 if setup.autocast else FP32  # bytes of an element in the compute dtype
        self.p = c.dropout
        # Without dropout PyTorch's CPU attention runs its fused (flash) kernel; with it, the math path, which
        # keeps the (T, T) attention probabilities. CUDA's flash kernel applies dropout itself.
        self.math_attention = self.p > 0 and setup.device_type != "cuda"
        self.copies = 0  # bytes of the weights' autocast copies that the backward keeps

    def mask(self, low: bool) -> int:
        """A dropout mask's bytes per element: CPU's native dropout keeps a mask of its input's dtype, CUDA's
        a bool one."""
        if self.s.device_type == "cuda":
            return 1
        return self.e if low else FP32

    def weight_copy(self, weight, kept: bool) -> None:
        """Autocast's cast of an fp32 weight, kept for the backward when a gradient flows through it."""
        if self.s.autocast and weight.dtype == torch.float32 and kept and not self.s.fsdp_mixed_precision:
            self.copies += weight.numel() * self.e

    def linear(self, layer, in_grad: bool, width: int, *, low: bool, kept: bool,
               recomputable: bool = False) -> tuple[_Saved, bool]:
        """A Linear (or LoRALinear) on an input of `width` features per token. low: the input is in the
        compute dtype already (else autocast casts a copy); kept: another op keeps this very tensor already;
        recomputable: it is a pointwise function of a kept tensor (a norm's or the activation's output)."""
        s = _Saved()
        own = 0 if (low and kept) else width * self.e  # the input as this layer keeps it
        trains = layer.weight.requires_grad
        if trains:
            s.per_token += own
            s.recomputable += own if recomputable else 0
        self.weight_copy(layer.weight, trains or in_grad)
        if isinstance(layer, LoRALinear):
            rank, q = layer.lora_A.size(0), layer.lora_dropout.p
            if q > 0:  # the dropped input is a new tensor, which A keeps (under autocast: its cast copy)
                s.per_token += width * self.e + (width * self.mask(low) if in_grad else 0)
            else:
                s.per_token += own
            s.per_token += rank * self.e  # A's output, kept by B
            self.weight_copy(layer.lora_A, in_grad)
            self.weight_copy(layer.lora_B, True)
            trains = True
        return s, in_grad or trains

    def norm(self, module, in_grad: bool) -> tuple[_Saved, bool]:
        """LayerNorm keeps its fp32 input, mean and rstd; RMSNorm (no weight here) its input and rstd."""
        s = _Saved()
        trains = any(p.requires_grad for p in module.parameters())
        if in_grad or trains:
            stats = 1 if isinstance(module, torch.nn.RMSNorm) else 2
            s.per_token += self.C * FP32 + stats * FP32
        return s, in_grad or trains

    def attention(self, qkv_grad: bool) -> tuple[_Saved, bool]:
        """From qkv (B, T, 3C) to the output (B, H, T, D); returns whether the output is a tensor it keeps."""
        C, H, T, e, c = self.C, self.H, self.s.seq_len, self.e, self.c
        s = _Saved()
        if not qkv_grad:
            return s, False
        qkv_kept = False
        if c.qk_norm:  # rms_norm keeps its input (views of qkv; fp32 copies under autocast) and rstd
            if self.s.autocast:
                s.per_token += 2 * C * FP32
            else:
                qkv_kept = True
            s.per_token += 2 * H * FP32
        if c.rope:  # rotate() keeps its layer's cos and sin tables (T, D/2)
            s.per_batch += T * (C // H) * FP32
        if self.math_attention:
            # scaled q and k, a copy of v; the probabilities, the dropout mask and the dropped probabilities,
            # all in fp32 (the CPU's math path computes bf16 attention in fp32)
            s.per_token += 3 * C * FP32 + 3 * H * T * FP32
            out_kept = False
        else:
            # flash: q, k (views of qkv unless QK-norm or RoPE made new ones), v (a view), output, log-sum-exp
            qkv_kept = True
            s.per_token += (2 * C * e if (c.rope or c.qk_norm) else 0) + C * e + H * FP32
            out_kept = True
        if qkv_kept:
            s.per_token += 3 * C * e
        return s, out_kept

    def block(self, block, in_grad: bool) -> tuple[_Saved, bool]:
        C, c = self.C, self.c
        s, h_grad = self.norm(block.ln_1, in_grad)
        part, qkv_grad = self.linear(block.attn.c_attn, h_grad, C, low=not self.s.autocast, kept=False,
                                     recomputable=True)
        s += part
        part, out_kept = self.attention(qkv_grad)
        s += part
        # c_proj's input is the attention output moved to (B, T, C): the very tensor the attention keeps when
        # its kernel wrote it in that layout (CUDA's flash always does, CPU's when q is a view of qkv), else
        # a copy
        same = self.s.device_type == "cuda" or not (c.rope or c.qk_norm)
        part, proj_grad = self.linear(block.attn.c_proj, qkv_grad, C, low=True, kept=out_kept and same)
        s += part
        if self.p > 0 and proj_grad:
            s.per_token += C * self.mask(True)  # resid_dropout
        x_grad = in_grad or proj_grad
        part, h_grad = self.norm(block.ln_2, x_grad)
        s += part
        part, fc_grad = self.linear(block.mlp.c_fc, h_grad, C, low=not self.s.autocast, kept=False,
                                    recomputable=True)
        s += part
        if fc_grad:  # GELU keeps its input; ReLU² its relu's output (which square reads)
            s.per_token += 4 * C * self.e
        part, mlp_grad = self.linear(block.mlp.c_proj, fc_grad, 4 * C, low=True, kept=False, recomputable=True)
        s += part
        if self.p > 0 and mlp_grad:
            s.per_token += C * self.mask(True)
        return s, x_grad or mlp_grad


def _embedding_saved(model, walk: _Walk) -> tuple[_Saved, bool]:
    """wte and wpe keep their indices (int64) when they train; the embedding dropout its mask."""
    s = _Saved()
    t = model.transformer
    wte_grad = t.wte.weight.requires_grad
    wpe_grad = "wpe" in t and t.wpe.weight.requires_grad
    s.per_token += 8 if wte_grad else 0
    s.per_batch += walk.s.seq_len * 8 if wpe_grad else 0
    grad = wte_grad or wpe_grad
    if walk.p > 0 and grad:
        s.per_token += walk.C * walk.mask(False)
    return s, grad


def loss_rows(model, setup: Setup) -> int:
    """Rows of logits one slice of model.linear_cross_entropy computes at once on this device type."""
    return loss_chunk_rows(model.config.padded_vocab_size, setup.device_type)


def _loss(model, setup: Setup, n: int) -> tuple[int, int, int]:
    """Bytes of model.loss_from_hidden on n tokens: (kept for the backward, transient at the largest in the
    forward, transient in its backward besides the head's new gradient).

    Sliced (n above one slice of rows): _ChunkedLinearCrossEntropy computes the gradients during the forward
    and keeps grad_x (n, C) in the compute dtype and, when the head trains, grad_W (Vp, C) in fp32. While it
    runs, a slice of rows x Vp fp32 logits is live a few times over (see `slices`), grad_x exists twice
    during its final torch.cat, and under autocast the bf16 copies of x and of the head's weight; its
    backward scales grad_x into a new fp32 tensor. Plain (the char models): F.linear, then F.cross_entropy,
    which keeps its log-softmax (n, V) in fp32 (and, soft-capped, the tanh); its backward makes the
    gradients of the log-softmax, of its input and of the logits."""
    if setup.loss == "sequence_logps":
        return _sequence_logps(model, setup, n)
    c = model.config
    C, V, Vp = c.n_embd, c.vocab_size, c.padded_vocab_size
    e = 2 if setup.autocast else FP32
    head_trains = model.lm_head.weight.requires_grad
    # the head's weight cast to the compute dtype: under FSDP's mixed precision it is gathered in bf16 already
    head_copy = Vp * C * e if e != FP32 and not setup.fsdp_mixed_precision else 0
    rows = loss_rows(model, setup)
    cap = c.logit_softcap > 0
    if n <= rows:
        kept = n * V * FP32 + n * 8 + FP32  # log-softmax output, targets, the count of targets
        kept += n * C * e if head_trains else 0  # F.linear's input (the cast copy under autocast)
        kept += head_copy  # autocast's copy of the head's weight
        kept += n * Vp * FP32 if cap else 0  # tanh keeps its output
        # the logits, their fp32 copy under autocast, the cap's fp32 temporaries
        forward = n * Vp * e + (n * V * FP32 if e != FP32 else 0) + (2 * n * Vp * FP32 if cap else 0)
        return kept, forward, 2 * n * V * FP32 + n * Vp * e
    grad_w = Vp * C * FP32 if head_trains else 0
    kept = n * C * e + grad_w + FP32  # grad_x, grad_W, the count of targets
    slice_fp32 = rows * Vp * FP32
    # In units of one fp32 slice, counted from the loop in model.py and checked against torch's allocator:
    # fp32 3 (the previous slice's softmax, the new product and logsumexp's temporary), soft-capped 5 (the
    # raw and capped logits, the tanh and its input); under (CPU) autocast 3 and 4.5.
    slices = {(False, False): 3, (False, True): 5, (True, False): 3, (True, True): 4.5}[(e != FP32, cap)]
    forward = int(slices * slice_fp32) + n * C * e  # + the grad_x pieces during the cat
    if e != FP32:
        forward += n * C * e + head_copy  # the bf16 copies of x and of the head's weight
    return kept, forward, n * C * FP32 * (2 if e != FP32 else 1)


def _sequence_logps(model, setup: Setup, n: int) -> tuple[int, int, int]:
    """Bytes of DPO's per-sequence log-probabilities on n tokens (gptkit/objectives/preference_losses.py's _ChunkedSequenceLogps), as
    `_loss` counts the next-token loss: it keeps its input, the final norm's output (n, C) in fp32, and the
    targets; its forward and its backward each compute the slices' logits (the slices as `_loss` counts them),
    under autocast from bf16 copies of x and of the head's weight. The backward adds grad_x's pieces and their
    torch.cat (n, C) twice in the compute dtype and the sequences' factors per token, and sums the head's
    gradient in an fp32 (Vp, C) buffer of its own: counted here when the head's gradient already exists
    (accumulation, DDP), where it is otherwise the new gradient itself (memory's new_head_grad)."""
    c = model.config
    C, Vp = c.n_embd, c.padded_vocab_size
    e = 2 if setup.autocast else FP32
    cap = c.logit_softcap > 0
    copies = (n * C * e + (Vp * C * e if not setup.fsdp_mixed_precision else 0)) if e != FP32 else 0
    slices = int({(False, False): 3, (False, True): 5, (True, False): 3, (True, True): 4.5}[(e != FP32, cap)]
                 * min(n, loss_rows(model, setup)) * Vp * FP32)
    kept = n * C * FP32 + n * 8
    forward = copies + slices + n * FP32  # + each token's log-probability
    head_grad = Vp * C * FP32 if model.lm_head.weight.requires_grad and (setup.accum > 1 or setup.world_size > 1) else 0
    backward = copies + slices + n * FP32 + 2 * n * C * e + head_grad
    return kept, forward, backward


def _optimizer_working(model, setup: Setup) -> int:
    """The optimizer step's largest temporaries. CPU AdamW (single-tensor: torch uses its fused and foreach
    kernels on CUDA) computes sqrt(exp_avg_sq) / bias_correction, two tensors the size of the largest
    parameter (under FSDP: of the largest piece); fused CUDA AdamW none. optim.Muon, for the largest matrix
    it updates (whole matrices: it orthogonalizes a matrix, not a piece of one): the float32 update and the
    iteration's result cast back, plus the Newton-Schulz iteration's three copies and Gram matrices in its
    dtype (float32 on the CPU, bf16 on CUDA), which outweighs the masked step's two float32 copies."""
    muon, adamw = _optimized(model, setup.optimizer)
    largest = max((shard_numel(p, setup.shards) for p in adamw), default=0)
    work = 0 if setup.device_type == "cuda" else 2 * largest * FP32
    if muon:
        largest = max(muon, key=lambda p: p.numel())
        small = min(largest.shape)
        e = 2 if setup.device_type == "cuda" else FP32
        work = max(work, 2 * largest.numel() * FP32 + 3 * largest.numel() * e + 2 * small * small * e)
    return work


def memory(model, setup: Setup, batch_size: int) -> Memory:
    """The memory of one process for a training step at `batch_size` sequences per micro-batch.

    The weights and optimizer states are held throughout (exact counts). The rest peaks in one of the step's
    phases, each of which this adds up and takes the largest of:
      forward: the activations of the micro-batch, the loss's working memory at its end, and the gradients
        when they are already there (accumulation over micro-batches, or DDP's buckets);
      backward: at its start what the loss kept, the first gradients it makes (a copy of grad_x, and of
        grad_W: the head's gradient) and a block's working memory (the gradients of its 4C-wide MLP
        activations); at its end all gradients and, with a tied head, the embedding's gradient before it is
        added to the head's;
      optimizer: all gradients and the optimizer's temporaries.
    Activation checkpointing keeps only each block's input (its full activations exist for one block at a
    time, while it is recomputed in the backward). A compiled step (torch.compile, CUDA) keeps less: its
    partitioner recomputes pointwise results (the norms' outputs, the MLP's activation) and the weight casts
    in the backward instead of keeping them: an estimate, until measured on a GPU.

    Under DDP (setup.parallel "ddp", world_size > 1) the gradients live in its all-reduce buckets
    (gradient_as_bucket_view), made once when the model is wrapped: they are there in every phase.

    Under FSDP (setup.parallel "fsdp": FSDP2's fully_shard on each transformer block, then on the whole model,
    the root unit holding the rest: see fsdp_units) the weights, gradients and optimizer states are one
    process' pieces (shard_numel); the activations and the loss are the micro-batch's, as under DDP. On top:
      gathered: the unsharded parameters of the units running, in the compute dtype under the mixed-precision
        policy (Setup.fsdp_mixed_precision), else in their own: the root's, which FSDP2 keeps gathered from
        its forward to the end of its backward, and two blocks' worth, the running one and the next (FSDP2
        prefetches one unit ahead, in the forward and the backward). An assumption, an upper bound for the
        blocks: the flat all-gather buffers, freed as each unit's parameters are copied out of them, are not
        counted apart. It replaces autocast's copies of the weights, which the mixed-precision policy makes
        unnecessary (bf16 weights to begin with);
      unsharded gradients: a block's backward makes its gradients whole (in the gathered dtype) and copies
        them into an fp32 buffer for the reduce-scatter, whose output is one piece of them (fp32): counted
        together, for one block at a time; the root's (the head's, tied or not, from the loss on) live until
        the end of the backward, when they are reduce-scattered in turn;
      accumulated: with Setup.reduce_every_micro_batch (what gptkit/parallel.py does) every micro-batch's
        gradients are reduce-scattered, and only the sharded ones are there; without it (FSDP2's gradient
        sync off before a step's last micro-batch) a replica's gradients are held whole, in fp32 (the reduce
        dtype), from the second micro-batch's forward to the reduce-scatter after the last's backward.
    """
    c, s = model.config, setup
    n = batch_size * s.seq_len
    walk = _Walk(model, s)
    weights, grads = weights_bytes(model, s.shards), gradients_bytes(model, s.shards)
    optim = optimizer_bytes(model, s.optimizer, s.shards)

    saved, grad = _embedding_saved(model, walk)
    blocks = []
    for block in model.transformer.h:
        part, grad = walk.block(block, grad)
        blocks.append(part.total(n, s.compile))
    final, grad = walk.norm(model.transformer.ln_f, grad)
    final_kept = final.total(n, s.compile)
    if s.checkpointing:
        # checkpoint(block, x) keeps x (fp32, the residual stream); the block inside is recomputed in the
        # backward, its activations live while it runs
        inputs = len(blocks) * n * c.n_embd * FP32
        activations = saved.total(n, s.compile) + final_kept + inputs
        recomputing = max(blocks, default=0)
    else:
        activations = saved.total(n, s.compile) + final_kept + sum(blocks)
        recomputing = 0
    loss_kept, loss_forward, loss_backward = _loss(model, s, n)
    # autocast's weight copies; a compiled step recomputes the casts in its backward instead (an estimate)
    copies = 0 if s.compile else walk.copies
    t = _fsdp_terms(model, s, grads, n) if s.parallel == "fsdp" else _ddp_terms(model, s, grads, n)
    # The last block's backward, once the loss and the final norm have let go of what they kept: its output's
    # gradient (fp32) and the gradient of the MLP's 4C-wide hidden tensor (in the compute dtype), while all its
    # own activations are still there, plus weight gradients: under DDP c_proj's (checked against torch's
    # allocator on the CPU), under FSDP all the block's, whole, with the reduce-scatter's buffers (its end).
    block_work = n * c.n_embd * (FP32 + 4 * walk.e) + t.block_grads
    before = t.held + t.gathered + activations + copies  # what every phase of the forward and backward holds
    phases = {
        "forward": before + loss_kept + loss_forward,
        "loss backward": before + loss_kept + loss_backward + t.new_head_grad,
        "block backward": before - final_kept + recomputing + t.new_head_grad + block_work,
        **t.ends,
        "optimizer": grads + _optimizer_working(model, s),
    }
    step_peak = max(phases.values())
    working = step_peak - activations - copies - loss_kept - t.held - t.gathered
    return Memory(weights=weights, gradients=grads, optimizer=optim, activations=activations, loss=loss_kept,
                  autocast_copies=copies, gathered=t.gathered, accumulated=t.accumulated, working=max(0, working),
                  peak=weights + optim + step_peak)


class _Terms(NamedTuple):
    """What the way the processes share the model (DDP or FSDP) adds to a step's phases (see `memory`)."""

    gathered: int  # FSDP: the unsharded parameters of the units running
    accumulated: int  # FSDP without a reduce-scatter per micro-batch: the whole gradients held between them
    held: int  # gradients already there during the forward
    new_head_grad: int  # what the loss' backward adds: the head's gradient (DDP), the root's whole ones (FSDP)
    block_grads: int  # a block's backward: its weight gradients (and FSDP's reduce-scatter buffers)
    ends: dict[str, int]  # the phases at the end of the backward


def _ddp_terms(model, s: Setup, grads: int, n: int) -> _Terms:
    head = model.lm_head.weight
    tied = head is model.transformer.wte.weight
    head_grad = head.numel() * FP32 if head.requires_grad else 0
    held = grads if (s.accum > 1 or s.world_size > 1) else 0  # gradients already there during the forward
    c_proj = max((p.numel() * FP32 for b in model.transformer.h for p in b.parameters()
                  if p.dim() == 2 and p.requires_grad), default=0)  # c_proj's, the largest matrix
    # the end of the backward: every gradient, and with a tied head the embedding's, before it is added
    ends = {"backward end": grads + (head_grad if tied else 0) + n * model.config.n_embd * FP32}
    return _Terms(gathered=0, accumulated=0, held=held, new_head_grad=0 if held else head_grad,
                  block_grads=c_proj, ends=ends)


def _fsdp_terms(model, s: Setup, grads: int, n: int) -> _Terms:
    head = model.lm_head.weight
    tied = head is model.transformer.wte.weight
    units = [_unsharded(unit, s) for unit in fsdp_units(model)]
    root, block_units = units[-1], units[:-1]
    gathered = root.params + 2 * max((b.params for b in block_units), default=0)
    # gradients already there during the forward, from the second micro-batch on: whole or sharded
    accumulated = sum(u.reduce for u in units) if s.accum > 1 and not s.reduce_every_micro_batch else 0
    held = accumulated or (grads if s.accum > 1 else 0)
    root_accumulated = root.reduce if accumulated else 0
    # the end: the embedding's backward (with a tied head its own gradient, before it is added), then the
    # root's gradients copied for their reduce-scatter
    tied_grad = head.numel() * root.grad_size if tied and head.requires_grad else 0
    residual = n * model.config.n_embd * FP32
    ends = {"backward end": grads + root_accumulated + root.params + root.grads + tied_grad + residual,
            "root's reduce-scatter": grads + root_accumulated + root.grads + root.reduce + root.reduced}
    return _Terms(gathered=gathered, accumulated=accumulated, held=held,
                  new_head_grad=root.grads,  # the root's whole gradients, from the loss' backward to the end
                  block_grads=max((b.grads + b.reduce + b.reduced for b in block_units), default=0), ends=ends)


def fsdp_units(model) -> list[list[torch.nn.Parameter]]:
    """The parameters of FSDP2's units, as a run under FSDP wraps the model: fully_shard on each transformer
    block (its LoRA adapters too), then on the whole model, whose root unit holds the rest: the embeddings
    (wte, the head's weight when tied), wpe, the final norm and an untied head. The blocks first, the root
    last. A shared parameter is listed once."""
    in_blocks = [list(block.parameters()) for block in model.transformer.h]
    seen = {id(p) for unit in in_blocks for p in unit}
    return [*in_blocks, [p for p in model.parameters() if id(p) not in seen]]


@dataclass(frozen=True)
class _Unit:
    params: int  # bytes of the unit's parameters, gathered whole
    grads: int  # bytes of its whole gradients, as the backward makes them (the gathered dtype)
    reduce: int  # bytes of the fp32 copy of them that the reduce-scatter takes
    reduced: int  # bytes of what it gives back: one process' piece of them, in fp32
    grad_size: int  # bytes of an element of those gradients


def _unsharded(params: list, setup: Setup) -> _Unit:
    """An FSDP unit's whole parameters and gradients on one process, each padded to world_size pieces."""
    N = setup.world_size
    size = lambda p: 2 if setup.fsdp_mixed_precision else p.element_size()  # noqa: E731
    whole = [(shard_numel(p, N) * N, size(p), p.requires_grad) for p in params]
    grad_size = max((e for _, e, trains in whole if trains), default=FP32)
    return _Unit(params=sum(numel * e for numel, e, _ in whole),
                 grads=sum(numel * e for numel, e, trains in whole if trains),
                 reduce=sum(numel * FP32 for numel, _, trains in whole if trains),
                 reduced=sum(shard_numel(p, N) * FP32 for p in params if p.requires_grad), grad_size=grad_size)


def largest_batch(model, setup: Setup, capacity: float, limit: int = 1 << 16) -> int:
    """The largest micro-batch (sequences) whose peak fits in `capacity` bytes; 0 when not even one does.
    The peak grows with the batch, so a binary search (a plan for gpt2-xl takes milliseconds)."""
    if memory(model, setup, 1).peak > capacity:
        return 0
    lo, hi = 1, 2
    while hi <= limit and memory(model, setup, hi).peak <= capacity:
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if memory(model, setup, mid).peak <= capacity:
            lo = mid
        else:
            hi = mid
    return lo


def choose_parallel(model, setup: Setup, capacity: float, batch_size: int | None = None) -> tuple[str, str]:
    """What --parallel=auto runs: ("ddp", why) when a whole replica fits each device, else ("fsdp", why); `why`
    is one line, with the figures.

    model: the run's model; the meta device will do (only shapes, dtypes and requires_grad are read).
    setup: the step as each process runs it; setup.world_size is the number of processes (devices), and
      setup.parallel does not matter (both are tried).
    capacity: the bytes one device gives the run's tensors (a GPU's: Device(...).capacity, its memory less the
      CUDA context and fragmentation; or what torch.cuda.mem_get_info says is free).
    batch_size: the micro-batch; None (batch_size=auto) sizes the run at 1 sequence, the least it can take.

    A replica fits when the plan's peak under DDP (weights, gradients, optimizer states, activations, the
    step's working memory: `memory`) is within capacity: DDP then, which gathers nothing and communicates
    least. Otherwise FSDP; when even FSDP's peak is over capacity, "fsdp" still (the smaller of the two), and
    the reason says that neither fits and what would help.
    """
    batch = batch_size or 1
    ddp = memory(model, replace(setup, parallel="ddp"), batch).peak
    at = f"at micro-batch {batch}" + (" (batch_size=auto's least)" if batch_size is None else "")
    if ddp <= capacity:
        return "ddp", (f"a whole replica fits each device: {format_bytes(ddp)} of {format_bytes(capacity)} {at}; "
                       f"DDP gathers nothing and communicates least")
    fsdp = memory(model, replace(setup, parallel="fsdp"), batch).peak
    n = setup.world_size
    over = f"FSDP over {n} device{'s' if n > 1 else ''}"
    if fsdp <= capacity:
        return "fsdp", (f"a whole replica needs {format_bytes(ddp)} per device {at}, more than its "
                        f"{format_bytes(capacity)}; {over} needs {format_bytes(fsdp)}")
    helps = ["more devices", *([] if setup.checkpointing else ["--activation_checkpointing=True"]),
             "--lora_rank", "a smaller block_size or model"]
    return "fsdp", (f"neither fits {format_bytes(capacity)} per device {at}: a whole replica needs "
                    f"{format_bytes(ddp)}, {over} {format_bytes(fsdp)}; use {', '.join(helps[:-1])} or {helps[-1]}")


def valid_batches(sequences_per_step: int, world_size: int, per_item: int = 1) -> list[int]:
    """The micro-batch sizes (sequences) that keep a step's sequences exactly: those dividing the sequences each
    process takes per step (the accumulation then is a whole number), in whole items of per_item sequences
    (DPO's pairs: 2)."""
    per_process = sequences_per_step // per_item // world_size
    return [b * per_item for b in range(1, per_process + 1) if per_process % b == 0]


def largest_valid_batch(model, setup: Setup, capacity: float, sequences_per_step: int,
                        limit: int = 1 << 16) -> tuple[int, int]:
    """batch_size=auto by the plan: (batch, fits). `fits` is the largest micro-batch whose peak fits `capacity`
    in a step with gradient accumulation (largest_batch up to `limit`; the micro-batches before a step's last
    keep their gradients), `batch` the largest of valid_batches (those that keep the step's sequences) up to
    it, 0 when not even one sequence fits. Under DPO (setup.sequences_per_item) both count sequences, the batch whole
    pairs (an even number)."""
    fits = largest_batch(model, replace(setup, accum=2), capacity, limit)
    valid = valid_batches(sequences_per_step, setup.world_size, setup.sequences_per_item)
    return max([b for b in valid if b <= fits], default=0), fits


def search_batch(candidates: list[int], start: int, fits) -> int | None:
    """The largest of the ascending `candidates` for which fits(b) holds (None if none does), assuming it
    holds up to some size and fails beyond: a binary search whose first try is the candidate nearest
    `start` from below (the plan's estimate). Each fits(b) is a real training step on a GPU: few tries."""
    lo, hi = -1, len(candidates)  # candidates[lo] fits (lo = -1: none known to); candidates[hi] does not
    i = max([k for k, b in enumerate(candidates) if b <= start], default=0)
    while hi - lo > 1:
        if fits(candidates[i]):
            lo = i
        else:
            hi = i
        i = (lo + hi) // 2
    return candidates[lo] if lo >= 0 else None


# ----------------------------------------------------------------------------- devices and time

# The CPU has no MFU: the time uses the FLOP/s this code measured on the 2-core development VM, per core.
# BENCHMARKS.md: configs/shakespeare_cpu.py trains at ~17,800 tokens/s of 5.16 MFLOP each (0.8M parameters,
# T = 64): 9.2e10 FLOP/s on 2 cores. (bench.py's 10.7M baby model reached 1.6e11: bigger matmuls run better.)
CPU_FLOPS_PER_CORE = 17_800 * 5.16e6 / 2
# What a GPU's memory holds besides the run's tensors: the CUDA context and the cuBLAS/NCCL workspaces
# (~1 GiB), and the caching allocator's fragmentation (5% assumed). On the CPU: the process' own memory
# (Python, torch's libraries: ~0.5 GiB), and freed tensors that glibc's malloc keeps resident for reuse
# (its mmap threshold grows as large blocks are freed): benchmarks/plan_memory.py measured the process' peak
# at 1.1x to 2.2x its tensors' (the LoRA shape), so a CPU run is sized for half the RAM left.
GPU_RESERVED, GPU_FRAGMENTATION, CPU_RESERVED, CPU_MALLOC_FACTOR = 1 * GiB, 0.05, GiB // 2, 2.0


@dataclass(frozen=True)
class Device:
    """A device the plan sizes the run for: its memory (bytes) and the FLOP/s the time assumes."""

    name: str
    kind: str  # cpu or cuda
    memory: float
    flops: float | None  # None: not known (a --device_memory_gb device)
    flops_note: str

    @property
    def capacity(self) -> float:
        """The bytes the run's tensors may take."""
        if self.kind != "cuda":
            return (self.memory - CPU_RESERVED) / CPU_MALLOC_FACTOR
        return (self.memory - GPU_RESERVED) * (1 - GPU_FRAGMENTATION)


def cpu_device() -> Device:
    cores = os.cpu_count() or 1
    _, available = ram()
    return Device(f"this CPU ({cores} cores, RAM available)", "cpu", available, CPU_FLOPS_PER_CORE * cores,
                  "measured on a 2-core VM, per core")


def process_capacity(device: torch.device, world_size: int = 1) -> float:
    """The bytes one process may give the run's tensors: its GPU's memory less the CUDA context and
    fragmentation (Device.capacity), or on the CPU its share of the free RAM (a CPU job's processes share it)."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return Device("this GPU", "cuda", total, None, "").capacity
    return cpu_device().capacity / world_size


def run_flops(model, cfg, tokens_per_step: int, checkpointing: bool, done: int = 0) -> tuple[float, float]:
    """(training, evaluation) FLOPs of the run's steps after `done` (a resumed run's): flops_per_token for
    every token of every step, plus the recomputed forward with activation checkpointing; a forward over
    eval_iters micro-batches every eval_interval steps and at the end (HellaSwag not counted)."""
    T = cfg.block_size
    per_token = flops_per_token(model, T) + (recompute_flops_per_token(model, T) if checkpointing else 0)
    steps = 0 if cfg.eval_only else max(0, cfg.max_iters - done)
    evals = 1 if cfg.eval_only else steps // cfg.eval_interval + 1 + (1 if steps % cfg.eval_interval else 0)
    eval_tokens = evals * cfg.eval_iters * (cfg.batch_size or 1) * T
    return per_token * tokens_per_step * steps, forward_flops_per_token(model, T) * eval_tokens


def format_bytes(n: float) -> str:
    return f"{n / GiB:,.2f} GiB" if n >= GiB / 4 else f"{n / 2**20:,.1f} MiB"


def format_seconds(s: float) -> str:
    if s < 120:
        return f"{s:.0f} s"
    if s < 2 * 3600:
        return f"{s / 60:.0f} min"
    if s < 3 * 86400:
        return f"{s / 3600:.1f} h"
    if s < 365 * 86400:
        return f"{s / 86400:.1f} days"
    return f"{s / (365 * 86400):.1f} years"
