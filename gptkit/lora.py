"""LoRA: fine-tune a big model by training small low-rank updates of some of its Linear layers.

    lora.apply(model, LoRASettings(rank=8, alpha=16, targets="attn.c_attn,attn.c_proj"))  # freezes the base
    lora.adapter_state_dict(model)      # only the adapters (and unfrozen tables): what a LoRA checkpoint stores
    lora.merge(model)                   # fold the updates into the weights: an ordinary GPT again
    lora.cast_frozen_base(model, torch.bfloat16)   # the blocks' frozen Linear weights in bf16 (train.py, CUDA)
    with lora.adapters_off(model): ...  # the base model's function again (DPO's reference), no second copy

A targeted layer y = x W^T + b becomes y = x W^T + b + (dropout(x) A^T B^T) * (alpha / rank), with A (rank, in)
and B (out, rank) trainable and W, b frozen. B starts at zero, so before the first step the model computes
exactly what the base model computes. The model does not know LoRA exists: `apply` swaps the targeted
nn.Linear modules for `LoRALinear`, a subclass that keeps the same `weight` and `bias` (so the base's
parameter names are unchanged) and adds `lora_A` and `lora_B`.

`fingerprint` identifies the base weights, so that a LoRA checkpoint whose base changed or went missing is
refused with a one-line error instead of producing garbage.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptkit.errors import LoRAError
from gptkit.settings import LoRASettings


class LoRALinear(nn.Linear):
    """A frozen nn.Linear plus a trainable low-rank update; same weight/bias names as the layer it replaces."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias  # the base's own parameters, not copies
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        device = base.weight.device
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, device=device))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, device=device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # nn.Linear's own init, for a (rank, in) weight
        self.scale = alpha / rank
        self.lora_dropout = nn.Dropout(dropout)
        self.enabled = True  # False: the base layer alone (adapters_off)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:  # exactly nn.Linear's forward on the base's weights: the base's bits
            return F.linear(x, self.weight, self.bias)
        update = F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B)  # (..., in) -> (..., rank) -> (..., out)
        return F.linear(x, self.weight, self.bias) + update * self.scale

    def merged_weight(self) -> torch.Tensor:
        """W + (B @ A) * scale, in the base weight's dtype: the weight of the equivalent plain Linear."""
        delta = (self.lora_B.float() @ self.lora_A.float()) * self.scale  # (out, rank) @ (rank, in)
        return (self.weight.float() + delta).to(self.weight.dtype)


def _targeted(model: nn.Module, settings: LoRASettings):
    """(block, path, the Linear) for every targeted layer of every block."""
    for block in model.transformer.h:
        for path in settings.target_list():
            parent_name, name = path.split(".")
            parent = getattr(block, parent_name)
            yield parent, name, getattr(parent, name)


def apply(model: nn.Module, settings: LoRASettings) -> nn.Module:
    """Freeze every parameter of `model` and give each targeted Linear a trainable low-rank update (in
    place; returns the model)."""
    for p in model.parameters():
        p.requires_grad_(False)
    for parent, name, linear in _targeted(model, settings):
        if isinstance(linear, LoRALinear):
            raise LoRAError("the model already has LoRA adapters")
        setattr(parent, name, LoRALinear(linear, settings.rank, settings.alpha, settings.dropout))
    return model


def unfreeze_embeddings(model: nn.Module) -> None:
    """Train the token embedding (and an untied head) too: a fine-tune that adds tokens (a chat model's special
    tokens) must learn their rows, which no adapter can stand in for. adapter_state_dict then saves them."""
    model.transformer.wte.weight.requires_grad_(True)
    model.lm_head.weight.requires_grad_(True)  # (the same tensor when tied)


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a LoRA run trains, under the model's own key names: the adapters (…attn.c_attn.lora_A, …) and any
    table unfreeze_embeddings made trainable."""
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in model.state_dict().items() if k.endswith((".lora_A", ".lora_B")) or k in trained}


def load_adapters(model: nn.Module, adapters: dict[str, torch.Tensor]) -> None:
    """Load adapter tensors saved by adapter_state_dict into a model that `apply` prepared the same way."""
    ours = adapter_state_dict(model)
    if set(adapters) != set(ours):
        missing, extra = sorted(set(ours) - set(adapters)), sorted(set(adapters) - set(ours))
        raise LoRAError(f"the saved adapters do not fit this model (missing {len(missing)}, unexpected "
                        f"{len(extra)}, e.g. {(missing or extra)[0]}); was it saved with other lora_targets?")
    for key, value in adapters.items():
        if value.shape != ours[key].shape:
            raise LoRAError(f"adapter {key} has shape {tuple(value.shape)}, the model needs "
                            f"{tuple(ours[key].shape)}; was it saved with another lora_rank or base model?")
    model.load_state_dict(adapters, strict=False)


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block the model computes what its base computes, bit for bit: every LoRALinear runs its frozen
    layer alone, the adapters are skipped (not multiplied by zero). Afterwards each adapter is on or off as it
    was before, also when the block raised. Nothing is copied: a reference model for free (DPO under LoRA).
    The base is only the base when nothing else was trained: see `trains_adapters_only`."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    before = [m.enabled for m in layers]
    for m in layers:
        m.enabled = False
    try:
        yield model
    finally:
        for m, was in zip(layers, before):
            m.enabled = was


def trains_adapters_only(model: nn.Module) -> bool:
    """Whether the model has adapters and they are all it trains (so adapters_off gives the model it started
    from; unfreeze_embeddings, for one, trains tables that adapters_off leaves as trained)."""
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    return bool(trained) and all(n.endswith((".lora_A", ".lora_B")) for n in trained)


@torch.no_grad()
def merge(model: nn.Module) -> nn.Module:
    """Fold every adapter into its weight and put plain nn.Linear layers back (in place; returns the model).
    Tensors that LoRA did not target are left exactly as they were."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, LoRALinear):
                plain = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                  device=child.weight.device, dtype=child.weight.dtype)
                plain.weight.copy_(child.merged_weight())
                if child.bias is not None:
                    plain.bias.copy_(child.bias)
                setattr(module, name, plain)
    return model


@torch.no_grad()
def cast_frozen_base(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Store the frozen weights and biases of the blocks' Linear layers in `dtype` (e.g. bf16: half their
    memory), in place; returns the model. The adapters stay as they are, and so do the embeddings (wte, wpe,
    an untied head) and the norms: an embedding's dtype is the residual stream's, which must stay fp32 as in
    every other run (autocast computes the matmuls in bf16 either way), and together they are a small part
    of the weights (gpt2-xl: 82M of 1.56B parameters)."""
    for block in model.transformer.h:
        for module in block.modules():
            if isinstance(module, nn.Linear):
                for p in (module.weight, module.bias):
                    if p is not None and not p.requires_grad:
                        p.data = p.data.to(dtype)
    return model


def trainable_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@torch.no_grad()
def fingerprint(state_dict: dict[str, torch.Tensor], samples: int = 4096) -> str:
    """A short hash of a model's weights: names, shapes, dtypes and an evenly spaced sample of each tensor's
    values. Reading a few thousand values per tensor keeps it instant for gpt2-xl; a fine-tuned or otherwise
    changed base differs in essentially every weight, so it cannot keep the fingerprint."""
    h = hashlib.sha256()
    for key in sorted(state_dict):
        t = state_dict[key].detach().flatten()
        h.update(f"{key}:{tuple(state_dict[key].shape)}:{t.dtype}".encode())
        step = max(1, t.numel() // samples)
        h.update(t[::step].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]
