"""Typed run configuration: a dataclass, filled from plain-Python config files and --key=value overrides.

    python train.py configs/shakespeare.py --batch_size=32 --compile=False

A config file holds assignments only (`n_layer = 6`, `max_iters = 5 * 1000`, `lr_decay_iters = max_iters`);
it is parsed, never executed, and its arithmetic is bounded (64-bit integers, strings of at most MAX_STR_LEN
characters). The command line wins over the files, and a file's lines see its values: with --max_iters=2000,
`lr_decay_iters = max_iters` is 2000. Every value is converted to its field's type, and an unknown key or a
value of the wrong type is an error that names the key; a list field (list[int], list[str], list[bool]) takes a
comma list, `--batch_size=12,16,32`. A script's config may accept other spellings of its keys (Alias: nanoGPT's
`--out_dir` and `--start` for sample.py), which --help lists.

The model's settings are GPTConfig's (model.py declares each once, with its help): TrainConfig inherits them.
What sample.py, chat.py, serve.py and eval.py share (checkpoint, device, dtype, quantize, threads, sampling) is
declared once here too, in InferenceSettings and the classes that extend it; each script's config extends one.
"""

from __future__ import annotations

import ast
import difflib
import json
import math
import operator
import sys
import types
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any

from gptkit.cli import UserError
from gptkit.generate import SamplingOptions
from gptkit.lora import LoRAError, LoRASettings
from gptkit.runtime import QUANTIZE
from model import GPTConfig


class ConfigError(UserError):
    """A bad config file, key or value; the message says which and how to fix it."""


@dataclass(frozen=True)
class Alias:
    """Another spelling of a setting (nanoGPT's), accepted on the command line and in config files and listed
    by --help: `--name=VALUE` means `--key=VALUE`, or, with `resolve`, the (key, value) it makes of VALUE
    (nanoGPT's --start=FILE:prompt.txt is --prompt_file=prompt.txt). A config dataclass lists its aliases in
    a class attribute ALIASES = {name: Alias(...)}."""

    key: str
    help: str
    resolve: Any = None  # (value: str) -> (key, value)

    def apply(self, value: Any) -> tuple[str, Any]:
        return self.resolve(value) if self.resolve is not None and isinstance(value, str) else (self.key, value)


def _aliases(cls: type) -> dict[str, Alias]:
    return getattr(cls, "ALIASES", {})


def setting(default: Any, help: str, choices: tuple | None = None) -> Any:
    """A dataclass field with its one-line description (shown by --help) and, optionally, allowed values (for a
    list field: of each item)."""
    metadata = {"help": help, "choices": choices}
    if isinstance(default, list):  # a comma list (list[int], list[str], ...): each config gets its own copy
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def settings_of(config: type, names: tuple[str, ...], class_name: str) -> type:
    """A dataclass with the fields `names` of the dataclass `config`: their types, defaults, help and choices."""
    hints = typing.get_type_hints(config)
    declared = {f.name: f for f in fields(config)}
    return make_dataclass(class_name,
                          [(n, hints[n], field(default=declared[n].default, metadata=declared[n].metadata))
                           for n in names],
                          namespace={"__module__": __name__})


# ----------------------------------------------------------------------------- the training run

# The model's settings, first in --help: GPTConfig's fields that a run sets (not vocab_size and vocab_multiple,
# which the dataset's tokenizer sets, nor ln_eps, GPT-2's). On resume the checkpoint's shape is used.
ModelSettings = settings_of(GPTConfig, GPTConfig.setting_names(), "ModelSettings")


@dataclass
class TrainConfig(ModelSettings):
    # I/O and checkpoints
    out_dir: str = setting("out", "folder for checkpoints (last.pt, best.pt), config.json and metrics.jsonl")
    init_from: str = setting(
        "scratch", "'scratch', 'resume' (from out_dir), a GPT-2 name (gpt2, gpt2-medium, ...) or a local HF folder"
    )
    overwrite: bool = setting(False, "allow a scratch run to replace the checkpoints already in out_dir")
    # The same command for the first start and every restart (torchrun --max-restarts, a requeued SLURM job):
    # "auto" continues out_dir's last checkpoint when it holds one of this run (as init_from="resume" would; a
    # checkpoint of another model shape, dataset or tokenizer is an error), else starts as init_from says.
    resume: str = setting("off", "auto: continue out_dir's last checkpoint if it holds one of this run, else "
                                 "start as init_from says (one command for the first start and every restart); "
                                 "off: start as init_from says", ("off", "auto"))
    eval_interval: int = setting(2000, "evaluate on the validation batches every this many steps")
    eval_iters: int = setting(200, "validation batches per evaluation (a fixed, seeded set)")
    eval_only: bool = setting(False, "evaluate once and exit, without training")
    hellaswag_interval: int = setting(
        0, "also score HellaSwag (acc_norm) every this many steps, a multiple of eval_interval; 0 = off; BPE data only"
    )
    hellaswag_limit: int = setting(0, "HellaSwag items per evaluation: the first N of the 10,042 (0 = all)")
    always_save_checkpoint: bool = setting(True, "save last.pt at every evaluation, not only when val improves")
    checkpoint_interval_s: float = setting(0.0, "also save last.pt every this many seconds of wall time (rank 0's "
                                                "clock decides for every process), so that a preemption loses "
                                                "minutes, not an eval_interval; 0 = only at evaluations")
    async_save: bool = setting(False, "write checkpoints from a background thread: the loop waits only for the "
                               "copy of the state to CPU memory, not for the write (the file stays atomic)")
    log_interval: int = setting(1, "print and record training metrics every this many steps")
    # Weights & Biases
    wandb_log: bool = setting(False, "also log metrics to Weights & Biases (WANDB_MODE=offline works)")
    wandb_project: str = setting("gpt", "W&B project name")
    wandb_run_name: str = setting("", "W&B run name ('' = out_dir's name)")
    # data
    dataset: str = setting("openwebtext", "dataset name under data_root, or a path to a prepared dataset folder")
    data_root: str = setting("data", "folder holding the prepared datasets")
    data_mode: str = setting(
        "random", "'random' windows (nanoGPT style) or 'epoch' passes without replacement", ("random", "epoch")
    )
    batch_size: int | None = setting(12, "sequences per micro-batch, per process; auto: the largest that fits "
                                         "(sets gradient_accumulation_steps to keep tokens_per_step)")
    gradient_accumulation_steps: int = setting(
        40, "micro-batches per optimizer step, over ALL processes (divided by the DDP world size)"
    )
    tokens_per_step: int = setting(0, "tokens per optimizer step over all processes, which batch_size=auto keeps "
                                      "(0 = batch_size x block_size x gradient_accumulation_steps)")
    seed: int = setting(1337, "seed for initialisation, dropout and the data order")
    # AdamW
    learning_rate: float = setting(6e-4, "peak learning rate, reached after warmup")
    max_iters: int = setting(600000, "total optimizer steps")
    weight_decay: float = setting(0.1, "AdamW weight decay, applied to 2-D weights only")
    beta1: float = setting(0.9, "AdamW beta1")
    beta2: float = setting(0.95, "AdamW beta2")
    grad_clip: float = setting(1.0, "clip the global gradient norm to this; 0 disables")
    # Muon (optimizer = "muon"): Muon for the blocks' 2-D weight matrices; AdamW above for the rest
    optimizer: str = setting("adamw", "adamw (every weight; GPT-2's recipe) or muon (Muon for the blocks' "
                                      "matrices, AdamW for embeddings, head, gains and biases)", ("adamw", "muon"))
    muon_lr: float = setting(0.02, "Muon's peak learning rate (on the same schedule as learning_rate)")
    muon_momentum: float = setting(0.95, "Muon's Nesterov momentum")
    muon_weight_decay: float = setting(0.0, "Muon's decoupled weight decay (times its learning rate, per step)")
    # learning-rate schedule
    decay_lr: bool = setting(True, "linear warmup then lr_schedule's decay; False = constant learning rates")
    lr_schedule: str = setting("cosine", "after the warmup: cosine (down to min_lr at lr_decay_iters) or wsd "
                                         "(stable, then linear to min_lr over cooldown_frac)", ("cosine", "wsd"))
    cooldown_frac: float = setting(0.4, "wsd: fraction of lr_decay_iters spent in the final linear decay")
    warmup_iters: int = setting(2000, "steps of linear warmup")
    lr_decay_iters: int = setting(600000, "step at which the decay reaches min_lr (usually max_iters)")
    min_lr: float = setting(6e-5, "floor of the decay (usually learning_rate / 10; Muon's: in proportion)")
    # fine-tuning big models with little memory (README.md "Fine-tune with LoRA")
    lora_rank: int = setting(0, "LoRA: train rank-r updates of the lora_targets layers, base frozen; 0 = off")
    lora_alpha: float = setting(16.0, "LoRA: the updates are scaled by lora_alpha / lora_rank")
    lora_dropout: float = setting(0.05, "LoRA: dropout on the adapters' input")
    lora_targets: str = setting("attn.c_attn,attn.c_proj,mlp.c_fc,mlp.c_proj",
                                "LoRA: comma-separated Linear layers of each block to adapt (these four are all)")
    activation_checkpointing: bool = setting(False, "recompute each block in the backward pass: far less "
                                                    "activation memory for ~30% more compute")
    # system
    parallel: str = setting("auto", "under torchrun: ddp (every process holds the whole model), fsdp (parameters, "
                                    "gradients and optimizer states sharded over the processes) or auto (DDP when "
                                    "a whole replica fits each device, else FSDP)", ("auto", "ddp", "fsdp"))
    backend: str = setting("auto", "torchrun's backend (DDP, FSDP): auto (nccl on CUDA, gloo on CPU), nccl or gloo", ("auto", "nccl", "gloo"))
    device: str = setting("auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:N or mps")
    dtype: str = setting(
        "auto",
        "auto (bf16 on CUDA where supported, else fp16 + GradScaler; fp32 on CPU/MPS), float32, bfloat16, float16",
        ("auto", "float32", "bfloat16", "float16"),
    )
    compile: bool | None = setting(None, "torch.compile the model: True, False, or auto (None: on for CUDA)")
    compile_scope: str = setting("model", "what torch.compile compiles: model (one graph with the head and loss: "
                                          "the fastest steps) or blocks (each transformer block on its own, the "
                                          "rest eager: compile time no longer grows with n_layer)",
                                 ("model", "blocks"))
    cuda_graphs: bool | None = setting(None, "replay the whole training step (forward, backward, clip, AdamW) as one "
                                             "CUDA graph after a few warm-up steps: no kernel launches on the host. "
                                             "True, False, or auto (None: off); one CUDA process, bf16/fp32, AdamW")
    # know before you run (README.md "Plan a run"): python train.py CONFIG --plan
    plan: bool = setting(False, "print the run's memory, FLOPs, time and cost per device, then exit (builds nothing big)")
    plan_gpus: int = setting(0, "--plan: processes (GPUs) to plan for, per GPU under DDP and under FSDP; "
                                "0 = torchrun's WORLD_SIZE, else 1")
    device_memory_gb: float = setting(0.0, "--plan: also size the run for a GPU with this much memory (GiB)")
    usd_per_gpu_hour: float = setting(0.0, "--plan: price of one GPU hour, for the run's cost (0 = no cost)")

    def validate(self) -> None:
        for name in ("eval_interval", "eval_iters", "log_interval", "batch_size", "gradient_accumulation_steps"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:  # batch_size None: auto
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        self.validate_tokens_per_step()
        if self.resume == "auto" and self.overwrite:
            raise ConfigError("resume=auto continues the run in out_dir and overwrite=True replaces it: drop one")
        for name in ("plan_gpus", "device_memory_gb", "usd_per_gpu_hour", "checkpoint_interval_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (0 = unset), got {getattr(self, name)}")
        if self.learning_rate <= 0:  # first: a config's min_lr is often learning_rate / 10, blamed otherwise
            raise ConfigError(f"learning_rate must be positive, got {self.learning_rate}")
        for name in ("max_iters", "warmup_iters", "lr_decay_iters", "weight_decay", "grad_clip", "min_lr"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.decay_lr and self.lr_decay_iters < min(self.warmup_iters, self.max_iters):
            raise ConfigError(f"warmup_iters ({self.warmup_iters}) is past lr_decay_iters ({self.lr_decay_iters}): the "
                              f"learning rate would warm up, then drop at once to min_lr; use --warmup_iters="
                              f"{self.lr_decay_iters // 10} (or up to lr_decay_iters), or raise --lr_decay_iters")
        if self.decay_lr and self.min_lr > self.learning_rate:
            raise ConfigError(f"min_lr ({self.min_lr}) must not exceed learning_rate ({self.learning_rate})")
        if self.muon_lr <= 0 or self.muon_weight_decay < 0 or not 0 <= self.muon_momentum < 1:
            raise ConfigError(f"muon_lr must be positive, muon_weight_decay >= 0 and muon_momentum in [0, 1); got "
                              f"{self.muon_lr}, {self.muon_weight_decay}, {self.muon_momentum}")
        if not 0 <= self.cooldown_frac <= 1:
            raise ConfigError(f"cooldown_frac must be in [0, 1], got {self.cooldown_frac}")
        if self.hellaswag_interval < 0 or self.hellaswag_limit < 0:
            raise ConfigError(f"hellaswag_interval and hellaswag_limit must be >= 0 (0 = off / all), got "
                              f"{self.hellaswag_interval}, {self.hellaswag_limit}")
        if self.hellaswag_interval % self.eval_interval:  # HellaSwag runs with an evaluation, printed beside it
            raise ConfigError(f"hellaswag_interval ({self.hellaswag_interval}) must be a multiple of eval_interval "
                              f"({self.eval_interval})")
        if self.lora_rank < 0:
            raise ConfigError(f"lora_rank must be >= 0 (0 = off), got {self.lora_rank}")
        if self.lora_rank:
            lora_settings(self)  # names a bad lora_targets, lora_alpha or lora_dropout
        if self.cuda_graphs:  # what a capture of the whole step cannot record: refused now, not at the capture
            from gptkit.cudagraph import refuse_uncapturable  # (here: gptkit.cudagraph imports this module)

            refuse_uncapturable(self.cuda_graphs, activation_checkpointing=self.activation_checkpointing)
        self.model_config(vocab_size=1)  # the model's shape is checked by GPTConfig, its one validator

    def validate_tokens_per_step(self) -> None:
        """batch_size=auto keeps tokens_per_step, which must be whole sequences; with a set batch_size,
        tokens_per_step (when given) must be what the batch and the accumulation make."""
        tokens = self.tokens_per_step
        if tokens < 0:
            raise ConfigError(f"tokens_per_step must be >= 0 (0 = unset), got {tokens}")
        if self.batch_size is None:
            if not tokens:
                raise ConfigError("batch_size=auto keeps the tokens per optimizer step: set --tokens_per_step too "
                                  "(e.g. batch_size x block_size x gradient_accumulation_steps of the config, "
                                  "32 x 1024 x 16 = 524288 for configs/gpt2_124m.py)")
            if tokens % self.block_size:
                raise ConfigError(f"tokens_per_step ({tokens}) must be a multiple of block_size ({self.block_size}): "
                                  f"a step is made of whole sequences")
        elif tokens and tokens != self.batch_size * self.block_size * self.gradient_accumulation_steps:
            raise ConfigError(f"tokens_per_step ({tokens}) differs from batch_size x block_size x "
                              f"gradient_accumulation_steps ({self.batch_size} x {self.block_size} x "
                              f"{self.gradient_accumulation_steps}); set --batch_size=auto, or leave tokens_per_step 0")

    def model_config(self, vocab_size: int, vocab_multiple: int = 1) -> GPTConfig:
        """The GPTConfig of a model trained from scratch with these settings."""
        try:
            return GPTConfig(vocab_size=vocab_size, vocab_multiple=vocab_multiple,
                             **{k: getattr(self, k) for k in GPTConfig.setting_names()})
        except ValueError as e:
            raise ConfigError(str(e).removeprefix("GPTConfig.")) from None


def lora_settings(cfg: TrainConfig) -> LoRASettings | None:
    """The run's LoRA settings, or None when lora_rank is 0."""
    if not cfg.lora_rank:
        return None
    try:
        return LoRASettings(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets)
    except LoRAError as e:
        raise ConfigError(str(e)) from None


# ----------------------------------------------------------------------------- the inference scripts

# What the scripts that run a trained model share, declared once. Each script's config extends the class that
# holds what it takes, as TrainConfig extends ModelSettings: eval.py InferenceSettings, serve.py DecodeSettings,
# sample.py and chat.py SamplingSettings. A script that means something else by a setting declares it again.


@dataclass
class InferenceSettings:
    """What to load and where to run it."""

    ckpt: str = setting("", "checkpoint file, or an out_dir (best.pt if present, else last.pt); 'out' if neither "
                            "is given")
    init_from: str = setting("", "instead of --ckpt: OpenAI GPT-2 weights (gpt2, gpt2-medium, gpt2-large, gpt2-xl) "
                                 "or a local HF GPT-2 folder")
    device: str = setting("auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:N or mps")
    dtype: str = setting(
        "auto",
        "weights' precision: auto (bf16 on CUDA, fp16 where bf16 is unsupported; fp32 elsewhere), float32, "
        "bfloat16, float16",
        ("auto", "float32", "bfloat16", "float16"),
    )

    def validate(self) -> None:
        if self.ckpt and self.init_from:
            raise ConfigError("give either --ckpt or --init_from, not both")
        if self.init_from in ("scratch", "resume"):
            raise ConfigError(f"--init_from={self.init_from} is a train.py option; to load a trained run use "
                              f"--ckpt=OUT_DIR")


@dataclass
class DecodeSettings(InferenceSettings):
    """...and how to decode on the CPU (gptkit/runtime.py's setup_inference)."""

    quantize: str = setting("auto", "the Linear layers' weights for decoding on the CPU: auto (float32 on the CPU "
                                    "with float32 weights, else none), none (the model as loaded), float32 (the "
                                    "same weights, faster kernels), float16 (half the bytes) or int8 (8 bits and a "
                                    "scale per 32)", QUANTIZE)
    threads: int = setting(0, "CPU threads; 0 = auto: OMP_NUM_THREADS if it is set, else the cores other processes "
                              "leave free")


@dataclass
class SamplingSettings(DecodeSettings):
    """...and how to draw each token (gptkit/generate.py's SamplingOptions)."""

    temperature: float = setting(0.8, "divide the logits by this: < 1 is more conservative, > 1 wilder; 0 = greedy")
    top_k: int = setting(200, "sample only from the k most likely tokens; 0 = no limit")
    top_p: float = setting(1.0, "sample only from the most likely tokens whose probabilities add up to p; 1.0 = off")
    seed: int = setting(1337, "random seed: the same seed, input, options and device give the same text")

    def validate(self) -> None:
        super().validate()
        if self.top_k < 0:  # the command line's spelling of "no limit" is 0; SamplingOptions checks the rest
            raise ConfigError(f"top_k must be >= 0 (0 = no limit), got {self.top_k}")
        self.sampling()  # temperature and top_p
        # torch wraps negative seeds (-1 is 2**64 - 1: two spellings of one seed) and fails with a traceback
        # from 2**64 on; 2**63 also keeps the seed a signed 64-bit integer wherever it is recorded.
        if not 0 <= self.seed < 2**63:
            raise ConfigError(f"seed must be in [0, 2**63), got {self.seed}")

    def sampling(self, stop_token: int | None = None, **more) -> SamplingOptions:
        """The sampling options these settings mean (--top_k=0 is no limit; --top_p=1.0 is off); `more`: a
        script's own SamplingOptions fields (sample.py's window_shift)."""
        try:
            return SamplingOptions(
                temperature=self.temperature, top_k=self.top_k or None, top_p=self.top_p, stop_token=stop_token,
                **more,
            )
        except ValueError as e:  # SamplingOptions names the field and the values it takes
            raise ConfigError(str(e)) from None


def redefault(cls: type, name: str, default: Any) -> Any:
    """The field `name` of the dataclass `cls` (its help and choices) with a script's own default."""
    declared = next(f for f in fields(cls) if f.name == name)
    return field(default=default, metadata=declared.metadata)


# ----------------------------------------------------------------------------- loading


def load_config(cls: type, argv: list[str], allow_files: bool = True, prog: str = "train.py",
                description: str = ""):
    """Build `cls` from argv: config files (positional, applied in order), then --key=value / --key value
    overrides. `--help` prints `description`, then every field, and exits."""
    return build_config(cls, parse_args(cls, argv, allow_files, prog, description))


def parse_args(cls: type, argv: list[str], allow_files: bool = True, prog: str = "train.py",
               description: str = "") -> dict[str, Any]:
    """The values that argv sets explicitly, converted to the fields' types: the config files' (in order, a later
    file winning), then the --key=value overrides, which win wherever they stand and which the files' lines see."""
    if any(a in ("-h", "--help") for a in argv):
        print(config_help(cls, prog, allow_files, description))
        raise SystemExit(0)
    files, overrides = _split_args(cls, argv, allow_files)
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for path in files:
        for key, value in read_config_file(path, fixed=overrides).items():
            if key in _aliases(cls):
                key, value = _aliases(cls)[key].apply(value)
            _check_key(cls, key, path)
            values[key] = convert(key, hints[key], value, from_text=False)
    return {**values, **overrides}


def _split_args(cls: type, argv: list[str], allow_files: bool) -> tuple[list[str], dict[str, Any]]:
    """argv's config files, and its --key=value / --key value overrides converted to the fields' types."""
    hints = typing.get_type_hints(cls)
    files: list[str] = []
    overrides: dict[str, Any] = {}
    spelled: dict[str, str] = {}  # key -> the spelling that set it (--to for --out)
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--"):
            key, eq, raw = arg[2:].partition("=")
            alias = _aliases(cls).get(key)
            if not eq:  # "--key value", or a bare "--flag" for a boolean
                nxt = argv[i + 1] if i + 1 < len(argv) else None
                if alias is None and _is_flag(hints, key):
                    if nxt is not None and nxt.lower() in _BOOL_WORDS:
                        raw, i = nxt, i + 1
                    else:
                        raw = "True"
                elif nxt is not None and not nxt.startswith("--"):
                    raw, i = nxt, i + 1
                else:
                    if alias is None:
                        _check_key(cls, key, "the command line")
                    raise ConfigError(f"--{key} needs a value: --{key}=VALUE")
            name = key
            if alias is not None:
                key, raw = alias.apply(raw)
            _check_key(cls, key, "the command line")
            value = convert(key, hints[key], raw, from_text=True)
            if key in overrides and spelled[key] != name and overrides[key] != value:
                raise ConfigError(f"--{spelled[key]} and --{name} are two spellings of {key}, given different "
                                  f"values; give one of them")
            overrides[key], spelled[key] = value, name
        elif allow_files:
            files.append(arg)
        else:
            raise ConfigError(f"unexpected argument {arg!r}; options are written --key=value (see --help)")
        i += 1
    return files, overrides


def build_config(cls: type, values: dict[str, Any]):
    """Defaults updated with `values`, then checked: allowed choices and the class' own validate()."""
    cfg = cls(**values)
    for f in fields(cls):
        choices = f.metadata.get("choices")
        value = getattr(cfg, f.name)
        if not choices or value is None:  # None: auto
            continue
        for item in value if isinstance(value, list) else [value]:
            if item not in choices:
                raise ConfigError(f"{f.name} must be one of {', '.join(map(str, choices))}; got {item!r}")
    if hasattr(cfg, "validate"):
        cfg.validate()
    return cfg


def read_config_file(path: str, fixed: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `key = value` lines of a config file, parsed without executing it. Values may be literals, bounded
    arithmetic, and names assigned earlier in the file or in `fixed` (the command line's values): a fixed key
    keeps its value, its own line is skipped, and the lines after it read the fixed value."""
    fixed = fixed or {}
    names, values = dict(fixed), {}
    for node in _parse_file(path).body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            continue  # a docstring
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            raise ConfigError(f"{path} line {node.lineno}: only plain assignments `key = value` are allowed")
        key = node.targets[0].id
        if key in fixed:
            continue
        where = f"{path} line {node.lineno}, {key}"
        try:
            value = _evaluate(node.value, names, where)
        except RecursionError:
            raise ConfigError(f"{where}: the expression is nested too deeply") from None
        if isinstance(value, int) and not -INT64_LIMIT <= value < INT64_LIMIT:
            raise ConfigError(f"{where}: {_show(node.value)} is outside the 64-bit integer range")
        names[key] = values[key] = value
    return values


def _parse_file(path: str) -> ast.Module:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path!r} not found (config files live in configs/, e.g. configs/shakespeare.py)")
    try:
        text = p.read_text(encoding="utf-8-sig")  # -sig: a byte-order mark, as some editors write, is dropped
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start} is {e.object[e.start]:#04x}); "
                          f"save it as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    try:
        return ast.parse(text, filename=str(p))
    except SyntaxError as e:
        raise ConfigError(f"{path} line {e.lineno}: syntax error: {e.msg}") from None
    except (RecursionError, MemoryError):  # what the parser raises for expressions nested thousands deep
        raise ConfigError(f"{path}: an expression is nested too deeply to parse") from None


# A config's arithmetic is bounded, so that a typo cannot hang the parser (10**10**10) or fill the memory
# ("x" * 10**9): a value's integers lie in the 64-bit range of the tensors and step counters (on the way, up to
# +-2**64, for `2**63 - 1`), strings (paths, prompts, names) under MAX_STR_LEN characters, floats are finite.
# Each bound is checked before the operation that would break it.
INT64_LIMIT = 2**63
MAX_STR_LEN = 10_000
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARYOPS = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _evaluate(node: ast.AST, names: dict[str, Any], where: str) -> Any:
    if isinstance(node, ast.Constant):
        if not isinstance(node.value, (int, float, str, type(None))):  # bool is an int
            raise ConfigError(f"{where}: values must be numbers, strings, True/False or None, not "
                              f"{_show(node)}")
        return _bounded(node.value, node, where)
    if isinstance(node, ast.Name):
        if node.id not in names:
            raise ConfigError(f"{where}: {node.id!r} is not assigned earlier in the file nor on the command line")
        return names[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARYOPS:
        operands = [_evaluate(node.operand, names, where)]
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        operands = [_evaluate(node.left, names, where), _evaluate(node.right, names, where)]
        _check_size(node, *operands, where)
    else:
        raise ConfigError(f"{where}: values must be literals or arithmetic on numbers, not {_show(node)}")
    try:
        value = {**_BINOPS, **_UNARYOPS}[type(node.op)](*operands)
    except OverflowError:  # 10.0 ** 400
        raise ConfigError(f"{where}: {_show(node)} is outside the floating-point range") from None
    except Exception as e:  # e.g. division by zero, "a" * None
        raise ConfigError(f"{where}: cannot evaluate {_show(node)}: {e}") from None
    return _bounded(value, node, where)


def _check_size(node: ast.BinOp, left: Any, right: Any, where: str) -> None:
    """Refuse an operation whose result would break the bounds, before it is computed."""
    if isinstance(left, str) or isinstance(right, str):
        if isinstance(node.op, ast.Mult):
            text, count = (left, right) if isinstance(left, str) else (right, left)
            if isinstance(count, int) and len(text) * count > MAX_STR_LEN:
                raise ConfigError(f"{where}: {_show(node)} would be a string of {len(text) * count:,} characters; "
                                  f"at most {MAX_STR_LEN:,} are allowed")
        elif not isinstance(node.op, ast.Add):  # `%` would format ("%099999999d" % 1): strings only join, repeat
            raise ConfigError(f"{where}: cannot evaluate {_show(node)}: strings can only be joined (+) and "
                              f"repeated (*)")
    if (isinstance(node.op, ast.Pow) and isinstance(left, int) and isinstance(right, int) and abs(left) > 1
            and right > 64):  # |left| >= 2: over 2**64
        raise ConfigError(f"{where}: {_show(node)} is outside the 64-bit integer range")


def _bounded(value: Any, node: ast.AST, where: str) -> Any:
    if isinstance(value, int) and abs(value) > 2 * INT64_LIMIT:
        raise ConfigError(f"{where}: {_show(node)} is outside the 64-bit integer range")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}: {_show(node)} is not a finite number")
    if isinstance(value, str) and len(value) > MAX_STR_LEN:
        raise ConfigError(f"{where}: a string of {len(value):,} characters; at most {MAX_STR_LEN:,} are allowed")
    return value


def _show(node: ast.AST, limit: int = 60) -> str:
    text = ast.unparse(node)
    return repr(text if len(text) <= limit else text[:limit] + "...")


_BOOL_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _is_flag(hints: dict, key: str) -> bool:
    return key in hints and _base_type(hints[key]) is bool


def _list_item(tp) -> type | None:
    """list[int] -> int; None for a type that is not a list."""
    return typing.get_args(tp)[0] if typing.get_origin(tp) is list else None


def _type_name(tp) -> str:
    """What --help says a field takes: int, str, ..., or int,... for a comma list of ints."""
    base = _base_type(tp)
    item = _list_item(base)
    return f"{item.__name__},..." if item is not None else base.__name__


def _base_type(tp) -> type:
    """int | None -> int."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


def _check_key(cls: type, key: str, where: str) -> None:
    names = [f.name for f in fields(cls)]
    if key not in names:
        close = difflib.get_close_matches(key, names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else "; see --help for the valid keys"
        raise ConfigError(f"unknown config key {key!r} (in {where}){hint}")


def convert(key: str, tp, value: Any, from_text: bool) -> Any:
    """Convert a value for field `key` of type `tp`; `from_text` values come from the command line."""
    optional = _base_type(tp) is not tp
    base = _base_type(tp)
    # None means auto: written auto (or none, null) on the command line, "auto" (or None) in a file
    auto_words = ("none", "auto", "null") if from_text else ("auto",)
    if optional and (value is None or (isinstance(value, str) or from_text) and str(value).lower() in auto_words):
        return None
    item = _list_item(base)
    if item is not None:  # a comma list, "12,16,32" (in a file a string too, or one value)
        items = [v.strip() for v in value.split(",")] if isinstance(value, str) else [value]
        try:
            return [convert(key, item, v, from_text=from_text or isinstance(value, str)) for v in items]
        except ConfigError:
            raise ConfigError(f"{key} expects a comma-separated list of {item.__name__}, got {value!r}") from None
    expected = base.__name__ + (" or auto" if optional else "")
    bad = ConfigError(f"{key} expects {expected}, got {value!r}")
    if from_text:
        text = str(value).strip()
        try:
            if base is bool:
                if text.lower() not in _BOOL_WORDS:
                    raise bad
                return _BOOL_WORDS[text.lower()]
            if base is int:
                number = float(text) if any(c in text.lower() for c in ".e") else int(text)
                if isinstance(number, float) and not number.is_integer():
                    raise bad
                return _int64(key, number)
            if base is float:
                return float(text)
            return str(value)  # strings verbatim: a prompt's leading/trailing spaces matter
        except ValueError:
            raise bad from None
    # values from a config file are already Python objects: accept only the right kind
    if base is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if base is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        if isinstance(value, float) and not value.is_integer():
            raise bad
        return _int64(key, value)
    if base is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if not isinstance(value, str):
        raise bad
    return value


def _int64(key: str, number: int | float) -> int:
    if not -INT64_LIMIT <= number < INT64_LIMIT:
        raise ConfigError(f"{key} must lie in the 64-bit integer range (-2**63 to 2**63 - 1), got {number:.3g}")
    return int(number)


# ----------------------------------------------------------------------------- showing and saving


def config_help(cls: type, prog: str, allow_files: bool = True, description: str = "") -> str:
    """--help: the usage line, `description`, then a line per field and per alias (every script's, this one)."""
    files = "[CONFIG_FILE.py ...] " if allow_files else ""
    lines = [f"usage: python {prog} {files}[--key=value ...]", ""]
    if description:
        lines += [description.strip(), ""]
    lines.append("options (default, type, description):")
    hints = typing.get_type_hints(cls)
    rows = []
    for f in fields(cls):
        rows.append((f"--{f.name}={_show_default(f)}", _type_name(hints[f.name]), f.metadata.get("help", "")))
    aliases = [(f"--{name}=...", "alias", f"same as --{alias.key}: {alias.help}")
               for name, alias in _aliases(cls).items()]
    width = max(len(option) for option, _, _ in rows + aliases)
    tp_width = max(5, *(len(tp) for _, tp, _ in rows))
    lines += [f"  {option:<{width}}  {tp:<{tp_width}}  {text}" for option, tp, text in rows]
    if aliases:
        lines += ["", f"aliases ({getattr(cls, 'ALIASES_TITLE', 'other spellings')}):"]
        lines += [f"  {option:<{width}}  {tp:<{tp_width}}  {text}" for option, tp, text in aliases]
    return "\n".join(lines)


def _show_default(f) -> str:
    if f.default is not MISSING:
        return "auto" if f.default is None else str(f.default)
    if f.default_factory is not MISSING:  # a comma list's
        return ",".join(map(str, f.default_factory()))
    return "(required)"


def config_to_dict(cfg) -> dict[str, Any]:
    return asdict(cfg)


def config_to_json(cfg) -> str:
    return json.dumps(config_to_dict(cfg), indent=2)


def print_config(cfg, file=None) -> None:
    """One line per setting, on `file` (sys.stdout as it is when called: it may have been replaced since import)."""
    width = max(len(f.name) for f in fields(cfg))
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        print(f"  {f.name:<{width}} = {'auto' if value is None else value!r}", file=file or sys.stdout)
