"""The features' settings, declared low: what gptkit/config.py's configs turn into each feature's own settings
object, and the names their checks need (LoRA's layers, DPO's losses and KTO's weights, the decoding formats, the threads' help,
the settings a CUDA graph cannot capture). Declared here, beside options.py, so that config.py stands below the
feature modules it configures (lora.py, dpo.py, generate.py, inference.py, runtime.py, threads.py) instead of
importing them; those modules import their settings from here.

Nothing here imports torch or any feature module: only gptkit.errors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gptkit.errors import DPOError, LoRAError, UsageError

# ----------------------------------------------------------------------------------------------------------
# Sampling (gptkit/generate.py)


@dataclass(frozen=True, kw_only=True)
class SamplingOptions:
    """How generate picks each next token; checked once, here, when made (a ValueError names the field)."""

    temperature: float = 1.0  # divides the logits: < 1 more conservative, > 1 wilder; 0 = greedy (argmax)
    top_k: int | None = None  # draw only from the k most likely tokens; None = no limit
    top_p: float | None = None  # draw only from the likeliest tokens whose probabilities sum to p; None/1 off
    stop_token: int | None = None  # a sequence that draws it is finished (and padded with it); None = never
    # Tokens the window moves forward by when it is full. 1 (nanoGPT's, exact): every token sees exactly the last
    # block_size tokens, at the price of a forward over the whole window per token past block_size. More is
    # faster and approximate: the tokens after a move see fewer (see gptkit/generate.py's docstring).
    window_shift: int = 1

    def __post_init__(self):
        t, k, p, stop, shift = self.temperature, self.top_k, self.top_p, self.stop_token, self.window_shift
        if not (is_number(t) and t >= 0):  # nan fails >= too
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {t!r}")
        if k is not None and not (is_int(k) and k >= 1):
            raise ValueError(f"top_k must be an integer >= 1 (None = no limit), got {k!r}")
        if p is not None and not (is_number(p) and 0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {p!r}")
        if stop is not None and not (is_int(stop) and stop >= 0):
            raise ValueError(f"stop_token must be a token id >= 0 (None = no stop token), got {stop!r}")
        if not (is_int(shift) and shift >= 1):
            raise ValueError(f"window_shift must be an integer >= 1 (1 = exact, nanoGPT's), got {shift!r}")

    def shift_for(self, block_size: int) -> int:
        """The window shift for a model of this block_size: window_shift, checked against it."""
        if self.window_shift > block_size:
            raise ValueError(f"window_shift must be in 1..{block_size} (the model's block_size), got "
                             f"{self.window_shift}")
        return self.window_shift


def is_int(x) -> bool:
    """An int and not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x) -> bool:
    """An int or float, not a bool, not NaN."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


# ----------------------------------------------------------------------------------------------------------
# Decoding on the CPU (gptkit/cpu_decode.py, gptkit/inference.py) and threads (gptkit/threads.py)

# gptkit/cpu_decode.py's packed weight formats for the Linear layers.
FORMATS = ("float32", "float16", "int8", "q4_0")
# The decoding scripts' --quantize: "none" runs the model as loaded; float32, float16, int8 and q4_0 are
# gptkit/cpu_decode.py's weight formats for the Linear layers (CPU only); "auto" (the default) is float32 on
# the CPU when the weights are float32 (the same weights and logits, read by faster kernels; q4_0 for a q4_0
# GGUF file of export.py's: the file's own blocks) and none elsewhere.
# (The setting itself, with its help, is gptkit/config.py's DecodeSettings.quantize.)
QUANTIZE = ("auto", "none", *FORMATS)

# The settings' help (train.py's, eval.py's and the decoding scripts'), one text for all of them.
THREADS_HELP = ("CPU threads; 0 = auto: OMP_NUM_THREADS if it is set, else the cores other processes leave free "
                "(on a GPU: torch's own count)")

# ----------------------------------------------------------------------------------------------------------
# CUDA graphs (gptkit/runtime.py, gptkit/cudagraph.py)

# torch.compile's modes that record CUDA graphs of their own: not inside a capture of the whole step.
GRAPHING_COMPILE_MODES = ("reduce-overhead", "max-autotune")


def refuse_uncapturable(cuda_graphs: bool | None, *, activation_checkpointing: bool = False,
                        compile_modes: tuple[str, ...] | list[str] = ()) -> None:
    """A one-line UsageError, before the first step, for settings the whole-step capture cannot record:
    activation checkpointing (recomputing a block saves and restores the CUDA random state, which a capture
    refuses) and torch.compile's modes that record CUDA graphs of their own (no graph inside a capture)."""
    if not cuda_graphs:
        return
    if activation_checkpointing:
        raise UsageError("--activation_checkpointing=True cannot run with --cuda_graphs=True (recomputing a block "
                         "reads the CUDA random state, which a graph capture refuses); drop one of the two")
    graphing = [mode for mode in compile_modes if mode in GRAPHING_COMPILE_MODES]
    if graphing:
        raise UsageError(f"--compile_mode={graphing[0]} records CUDA graphs of its own, which cannot sit inside "
                         f"--cuda_graphs=True's capture of the whole step; use --compile_mode=default or "
                         f"max-autotune-no-cudagraphs with --cuda_graphs=True, or --cuda_graphs=False")


# ----------------------------------------------------------------------------------------------------------
# LoRA (gptkit/lora.py)

# The Linear layers inside a block that LoRA can adapt, by their path in the block.
TARGETS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
# All four: adapting every projection (not only the attention's) gives the best quality per trainable
# parameter in the LoRA/QLoRA papers' ablations, and still trains ~1% of GPT-2's weights at rank 8.
DEFAULT_TARGETS = ",".join(TARGETS)


@dataclass(frozen=True)
class LoRASettings:
    rank: int  # the updates' rank r: A is (r, in), B (out, r)
    alpha: float = 16.0  # the updates are scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapters' input
    targets: str = DEFAULT_TARGETS  # the block's Linear layers adapted, comma-separated names from TARGETS

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise LoRAError(f"lora_rank must be a positive integer (0 turns LoRA off), got {self.rank!r}")
        if not self.alpha > 0:
            raise LoRAError(f"lora_alpha must be positive, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise LoRAError(f"lora_dropout must be in [0, 1), got {self.dropout!r}")
        self.target_list()  # checks the names

    def target_list(self) -> list[str]:
        names = [t.strip() for t in self.targets.split(",") if t.strip()]
        unknown = [t for t in names if t not in TARGETS]
        if unknown or not names:
            raise LoRAError(f"lora_targets: unknown layer(s) {', '.join(unknown) or '(none given)'}; "
                            f"choose from {', '.join(TARGETS)} (comma-separated)")
        return names

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "targets": self.targets}


# ----------------------------------------------------------------------------------------------------------
# DPO (gptkit/objectives/preference_losses.py; its losses are described in that module's docstring)

LOSSES = ("sigmoid", "hinge", "robust", "ipo", "ipo_per_token", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")  # losses of the model alone: no reference is computed
SMOOTHED = ("sigmoid", "robust", "simpo")  # the losses label_smoothing applies to
LENGTH_NORMALISED = ("ipo_per_token", "simpo", "orpo")  # on log-probabilities averaged over each reply's tokens


@dataclass(frozen=True)
class DPOSettings:
    beta: float = 0.1  # how far the tuned model may move from the reference: larger keeps it closer
    label_smoothing: float = 0.0  # the share of pairs assumed mislabelled, in [0, 0.5) (SMOOTHED losses)
    loss: str = "sigmoid"  # one of LOSSES (gptkit/objectives/preference_losses.py's docstring)
    nll_weight: float = 0.0  # > 0: add this times the chosen replies' NLL per token (keeps them likely)
    simpo_gamma: float = 0.5  # simpo: the margin, in beta x nats per token, the chosen reply should win by

    def __post_init__(self):
        if not (isinstance(self.beta, (int, float)) and math.isfinite(self.beta) and self.beta > 0):
            raise DPOError(f"dpo_beta must be a positive number, got {self.beta!r} (0.1 is usual; larger keeps "
                           f"the model closer to its reference)")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise DPOError(f"dpo_label_smoothing must be in [0, 0.5), got {self.label_smoothing!r}")
        if self.loss not in LOSSES:
            raise DPOError(f"dpo_loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        w = self.nll_weight
        if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0):
            raise DPOError(f"dpo_nll_weight must be a number >= 0 (0: plain DPO), got {self.nll_weight!r}")
        if self.loss == "ipo" and self.label_smoothing:
            raise DPOError("dpo_label_smoothing is for the sigmoid loss; IPO has none (set it to 0)")
        if self.label_smoothing and self.loss not in SMOOTHED:
            raise DPOError(f"dpo_label_smoothing is for the {', '.join(SMOOTHED)} losses; {self.loss} has none "
                           f"(set it to 0)")
        if self.loss == "orpo" and self.nll_weight:
            raise DPOError("the orpo loss has its own NLL term (weight 1, the odds ratio's weight is dpo_beta): "
                           "set dpo_nll_weight to 0")
        if not (isinstance(self.simpo_gamma, (int, float)) and math.isfinite(self.simpo_gamma)):
            raise DPOError(f"dpo_simpo_gamma must be a number, got {self.simpo_gamma!r}")

    @property
    def reference_free(self) -> bool:
        """Whether the loss is of the model alone (simpo, orpo): no reference is computed."""
        return self.loss in REFERENCE_FREE


# ----------------------------------------------------------------------------------------------------------
# KTO (gptkit/objectives/kto_loss.py: the loss; gptkit/objectives/kto.py: its data and reference)

# TRL's advice for the weights: desirable_weight x desirable rows / (undesirable_weight x undesirable rows) in
# this range (the KTO paper's, section 4.2), said in one line at a run's start when it does not hold
KTO_RATIO = (1.0, 4 / 3)


@dataclass(frozen=True)
class KTOSettings:
    beta: float = 0.1  # the implicit reward's scale, DPO's beta (dpo_beta): larger keeps the model closer
    desirable_weight: float = 1.0  # lambda_D: the weight of the desirable rows' loss
    undesirable_weight: float = 1.0  # lambda_U: the weight of the undesirable rows' loss

    def __post_init__(self):
        if not (is_number(self.beta) and math.isfinite(self.beta) and self.beta > 0):
            raise DPOError(f"dpo_beta must be a positive number, got {self.beta!r} (0.1 is usual; larger keeps "
                           f"the model closer to its reference)")
        for name in ("desirable_weight", "undesirable_weight"):
            w = getattr(self, name)
            if not (is_number(w) and math.isfinite(w) and w > 0):
                raise DPOError(f"kto_{name} must be a positive number, got {w!r} (1.0 is usual; see the "
                               f"desirable:undesirable ratio line at the run's start)")

    def ratio(self, desirable: int, undesirable: int) -> float:
        """lambda_D n_D / (lambda_U n_U): how much the desirable rows weigh against the undesirable ones."""
        return self.desirable_weight * desirable / (self.undesirable_weight * undesirable)
