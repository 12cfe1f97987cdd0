"""Typed run configuration: a dataclass, filled from plain-Python config files and --key=value overrides.

    python train.py configs/shakespeare.py --batch_size=32 --compile=False

The parser (config files, --key=value, --help, aliases) is gptkit/options.py's: the scripts import it from
there. A config file holds assignments only (`lr_decay_iters = max_iters`), parsed, never executed; the
command line wins over the files, and a file's lines see its values.

The model's settings are GPTConfig's (model.py declares each once, with its help): TrainConfig inherits them.
What sample.py, chat.py, serve.py and eval.py share (checkpoint, device, dtype, threads, quantize, sampling) is
declared once here too, in InferenceSettings and the classes that extend it; each script's config extends one.
The features' own settings objects (DPOSettings, LoRASettings, SamplingOptions) and the names their checks
need are gptkit/settings.py's: this module imports no feature module it configures (tests/test_imports.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from gptkit.errors import ConfigError, LoRAError
from gptkit.options import setting, settings_of
from gptkit.settings import (
    QUANTIZE,
    THREADS_HELP,
    LoRASettings,
    SamplingOptions,
    refuse_uncapturable,
)
from model import GPTConfig

# ----------------------------------------------------------------------------- the training run

# The objectives a run may train toward (gptkit/objectives/: each one's class, registered by the same name). Their
# own settings are checked by the objective at the run's start (Objective.check_config), before anything is written.
OBJECTIVE_NAMES = ("next_token", "dpo", "kto", "grpo")

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
    # what the run trains for (README.md "Chat", preference tuning): the next token, or DPO on preference pairs
    objective: str = setting("next_token", "next_token (the language-model loss on the dataset's tokens), dpo "
                                           "(preference pairs, prepare/preference.py, tuned against the model the "
                                           "run starts from; batch_size counts pairs), kto (unpaired rows: a "
                                           "prompt, one completion labelled desirable or not, prepare/preference.py; "
                                           "batch_size counts rows) or grpo (replies drawn by the "
                                           "model to a task's prompts, rewarded by its checker; batch_size counts "
                                           "replies)", OBJECTIVE_NAMES)
    dpo_beta: float = setting(0.1, "dpo and kto: how far the model may move from its reference (larger keeps it "
                                   "closer); KTO's beta is DPO's, the implicit reward's scale")
    dpo_loss: str = setting(
        "sigmoid", "dpo: the loss, by TRL's names. sigmoid: DPO's, the usual start. hinge: SLiC's max(0, 1 - beta "
        "h), which stops pushing a pair once its margin passes 1/beta. robust: DPO unbiased for a share "
        "dpo_label_smoothing of flipped labels (noisy preferences). ipo: IPO's squared loss on the summed "
        "log-probabilities (the paper's), when DPO overfits pairs it already orders. ipo_per_token: IPO on "
        "log-probabilities averaged over each reply's tokens, TRL's ipo: a beta copied from TRL's ipo goes with "
        "this one. simpo: SimPO, reference-free and length-normalised with the margin dpo_simpo_gamma: no "
        "reference to compute, and replies' lengths do not count. orpo: ORPO's odds-ratio term (weight "
        "dpo_beta) plus the chosen replies' NLL, reference-free: a preference tune and an SFT in one",
        ("sigmoid", "hinge", "robust", "ipo", "ipo_per_token", "simpo", "orpo"))
    dpo_label_smoothing: float = setting(0.0, "dpo: the share of pairs assumed mislabelled, in [0, 0.5) "
                                              "(sigmoid: conservative DPO; robust; simpo)")
    dpo_simpo_gamma: float = setting(0.5, "dpo, simpo loss: the margin (in beta x nats per token) the chosen "
                                          "reply should win by; TRL's simpo_gamma")
    dpo_nll_weight: float = setting(0.0, "dpo: add this times the chosen replies' negative log-likelihood per "
                                         "token (an anchor that keeps them likely); 0 = plain DPO")
    # objective=kto (README.md "Preference tuning"; gptkit/objectives/kto.py): beta is dpo_beta
    kto_desirable_weight: float = setting(1.0, "kto: the weight of the desirable rows' loss (TRL's desirable_weight); "
                                               "keep weight x rows of desirable / of undesirable in [1, 4/3]")
    kto_undesirable_weight: float = setting(1.0, "kto: the weight of the undesirable rows' loss (TRL's "
                                                 "undesirable_weight)")
    # objective=grpo (README.md "Learning from a checker"; gptkit/objectives/grpo.py)
    grpo_task: str = setting("tasks/arithmetic.py", "grpo: the task, a file or module with prompts(split, seed) and "
                                                    "reward(prompt, reply) (one file a task, under tasks/)")
    grpo_reward: str = setting("", "grpo: the checker, FILE.py:FUNCTION or MODULE:FUNCTION ('' = the task's reward)")
    grpo_reward_timeout: float = setting(5.0, "grpo: seconds one checker call may take; longer stops the run with "
                                               "an error naming the prompt (its checkpoints kept)")
    grpo_task_seed: int = setting(0, "grpo: the seed of the task's train/held-out split (eval.py --task_seed)")
    grpo_n: int = setting(8, "grpo: replies drawn per prompt and compared with each other (the group); batch_size "
                             "x gradient_accumulation_steps must be a multiple")
    grpo_max_tokens: int = setting(16, "grpo: the most tokens of a reply")
    grpo_temperature: float = setting(1.0, "grpo: the rollouts' sampling temperature")
    grpo_clip: float = setting(0.2, "grpo: the probability ratio to the drawing model is clipped to 1 +- this")
    grpo_kl: float = setting(0.0, "grpo: the weight of the KL penalty to the starting model (0 = none; > 0 without "
                                  "LoRA keeps a copy of the starting weights)")
    grpo_averaging: str = setting("token", "grpo: the loss' mean over every reply token of a micro-batch (token: "
                                           "long replies weigh per token what short ones do) or over replies of "
                                           "each one's mean (sequence: the paper's)", ("token", "sequence"))
    grpo_eval_prompts: int = setting(100, "grpo: held-out prompts answered greedily at each evaluation (val "
                                          "reward: their mean reward; val loss: minus it)")
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
    threads: int = setting(0, THREADS_HELP)  # gptkit/threads.py's resolve_threads; recorded in runs.jsonl
    compile: bool | None = setting(None, "torch.compile the model: True, False, or auto (None: on for CUDA)")
    compile_scope: str = setting("model", "what torch.compile compiles: model (one graph with the head and loss: "
                                          "the fastest steps) or blocks (each transformer block on its own, the "
                                          "rest eager: compile time no longer grows with n_layer)",
                                 ("model", "blocks"))
    cuda_graphs: bool | None = setting(None, "replay the whole training step (forward, backward, clip, AdamW) as one "
                                             "CUDA graph after a few warm-up steps: no kernel launches on the host. "
                                             "True, False, or auto (None: off); one CUDA process, bf16/fp32, AdamW")
    fp8_head: bool = setting(False, "the training loss' head matmuls (logits and both gradients) in FP8 with "
                                    "per-tensor scales, the weights kept in their precision (gptkit/fp8.py); "
                                    "CUDA with compute capability >= 8.9 only, objective=next_token; evaluation "
                                    "and sampling unchanged")
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
        if self.init_from == "resume" and self.overwrite:
            raise ConfigError("init_from=resume continues the run in out_dir, and overwrite=True is for a new run "
                              "that replaces it: drop --overwrite=True to continue it, or --init_from=resume to "
                              "start again")
        if self.threads < 0:
            raise ConfigError(f"threads must be >= 0 (0 = auto), got {self.threads}")
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
        # what a capture of the whole step cannot record: refused now, not at the capture
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
    threads: int = setting(0, THREADS_HELP)  # gptkit/threads.py's resolve_threads

    def validate(self) -> None:
        if self.threads < 0:
            raise ConfigError(f"threads must be >= 0 (0 = auto), got {self.threads}")
        if self.ckpt and self.init_from:
            raise ConfigError("give either --ckpt or --init_from, not both")
        if self.init_from in ("scratch", "resume"):
            raise ConfigError(f"--init_from={self.init_from} is a train.py option; to load a trained run use "
                              f"--ckpt=OUT_DIR")


@dataclass
class DecodeSettings(InferenceSettings):
    """...and how to decode on the CPU (gptkit/inference.py's setup_inference)."""

    quantize: str = setting("auto", "the Linear layers' weights for decoding on the CPU: auto (float32 on the CPU "
                                    "with float32 weights, q4_0 for a q4_0 GGUF file, else none), none (the model as loaded), float32 (the "
                                    "same weights, faster kernels), float16 (half the bytes), int8 (8 bits and a "
                                    "scale per 32) or q4_0 (4 bits and an fp16 scale per 32, llama.cpp's Q4_0; "
                                    "the head and token embedding in llama.cpp's Q6_K where n_embd is a multiple of "
                                    "256, else q8_0)", QUANTIZE)


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
