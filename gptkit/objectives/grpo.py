"""GRPO, `objective=grpo`: learning from a checker. Each step draws replies to a task's prompts with the model
as it is, rewards them with the task's checker, and takes the clipped policy-gradient loss on them:

    prompt -> rollouts (grpo_rollouts.draw: the serving engine, the live weights) -> reward (gptkit/checker.py)
           -> advantages (grpo_loss.group_advantages) -> loss (grpo_loss.grpo_loss) -> the one training step

    python train.py configs/grpo_arithmetic.py       # a model fine-tuned on the task first (README's recipe)

What it asks of a run:
- init_from: a trained model (a run's folder) whose tokenizer writes the task's prompts; the dataset is the
  one it was trained on (for its tokenizer only: GRPO reads no tokens of it).
- batch_size counts replies (rollouts) per micro-batch; each process draws batch_size x accumulation / grpo_n
  prompts' groups per step, process r taking every world_size-th prompt of the task's stream from the r-th.
- the evaluation: grpo_eval_prompts held-out prompts answered greedily, scored by the checker; val_reward is
  their mean reward (the greedy accuracy for a 0/1 reward), and the val loss is minus it, so best.pt keeps
  the best held-out reward.
- the KL penalty (grpo_kl > 0) is to the starting model: a LoRA run's adapters off (no copy), a full
  fine-tune's frozen copy of the starting weights (the weights once more, in memory and in each checkpoint,
  which a resumed run reads back).
- not graphable (the rollouts run between steps: cuda_graphs=True is refused), not under FSDP (the engine
  runs the whole model), no batch_size=auto (a step's memory follows its replies' lengths).
- its state: the loader's (prompts taken, the draws' generator), saved with the run's; --resume=auto goes on
  bit-exact on the CPU.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import torch

from gptkit import parallel
from gptkit.checker import load_checker, load_task
from gptkit.data.pairs import is_preference_dataset
from gptkit.data.shards import read_meta
from gptkit.errors import ConfigError, DataError
from gptkit.generate import SamplingOptions
from gptkit.objectives.base import Objective, ObjectiveError
from gptkit.objectives.grpo_loss import (
    AdapterOffReference,
    CopyReference,
    GRPOError,
    GRPOObjective,
    GRPOSettings,
)
from gptkit.objectives.grpo_rollouts import RolloutLoader, draw
from gptkit.runtime import Dist, Runtime
from gptkit.tokenizer import Tokenizer


def grpo_settings(cfg) -> GRPOSettings:
    try:
        return GRPOSettings(n=cfg.grpo_n, clip=cfg.grpo_clip, kl=cfg.grpo_kl, averaging=cfg.grpo_averaging)
    except GRPOError as e:
        raise ConfigError(str(e)) from None


@dataclass
class HeldOut:
    """A validation batch: held-out prompts (text and ids), answered greedily at each evaluation."""

    texts: list[str]
    ids: list[list[int]]

    def __len__(self) -> int:
        return len(self.texts)


class GRPO(Objective):
    name = "grpo"
    metric_names = GRPOObjective.metric_names
    graphable = False

    def __init__(self, cfg):
        super().__init__(cfg)
        self.loss: GRPOObjective | None = None
        self.reference = None
        self.model = None  # the raw model, set by start(): the rollouts' and the evaluation's
        self.task = self.checker = self.tokenizer = None
        self.stop_ids: frozenset[int] = frozenset()

    @property
    def state_key(self) -> str:
        """A full fine-tune with a KL penalty saves its copy of the starting weights; nothing else is saved."""
        return "grpo_reference" if self.cfg.grpo_kl and not self.cfg.lora_rank else ""

    def prepare_kind(self) -> str | None:
        """Its dataset is the task's worked problems as text (README's recipe), in the starting model's tokenizer:
        the prompts come from the task, the dataset gives the vocabulary and the evaluation's split."""
        return "text"

    def check_config(self, cfg) -> None:
        super().check_config(cfg)
        grpo_settings(cfg)
        if cfg.init_from == "scratch":
            raise ConfigError("objective=grpo tunes a model that already answers the task sometimes: set --init_from "
                              "to its run's folder (README's recipe: a short fine-tune on worked problems first)")
        if cfg.batch_size is None:
            raise ConfigError("batch_size=auto is not for objective=grpo (a step's memory follows its replies' "
                              "lengths): set --batch_size to the replies per micro-batch")
        if (cfg.batch_size * cfg.gradient_accumulation_steps) % cfg.grpo_n:
            raise ConfigError(f"batch_size x gradient_accumulation_steps ({cfg.batch_size} x "
                              f"{cfg.gradient_accumulation_steps}) must be a multiple of grpo_n ({cfg.grpo_n}): a "
                              f"step draws whole groups of grpo_n replies")
        for name, ok in (("grpo_max_tokens", cfg.grpo_max_tokens >= 1), ("grpo_eval_prompts", cfg.grpo_eval_prompts >= 1),
                         ("grpo_temperature", cfg.grpo_temperature > 0),
                         ("grpo_reward_timeout", cfg.grpo_reward_timeout > 0)):
            if not ok:
                raise ConfigError(f"{name} must be positive, got {getattr(cfg, name)!r}")
        if cfg.parallel == "fsdp":
            raise ConfigError("objective=grpo draws its rollouts with the whole model, which FSDP shards: use "
                              "--parallel=ddp (or auto)")

    def check_dataset(self, meta: dict, label: str) -> None:
        if is_preference_dataset(meta):
            raise ObjectiveError(f"dataset {label} holds preference pairs; objective=grpo needs only the tokenizer "
                                 f"of the model it tunes: give the dataset that model was trained on")

    def start(self, cfg, raw_model: torch.nn.Module, data_dir: Path, state: dict | None, d: Dist,
              rt: Runtime) -> str:
        settings = grpo_settings(cfg)
        if parallel.is_sharded(raw_model):
            raise ObjectiveError("objective=grpo cannot run under FSDP: use --parallel=ddp")
        self.model = raw_model
        self.task = load_task(cfg.grpo_task)
        self.checker = load_checker(cfg.grpo_reward or f"{cfg.grpo_task}:reward", cfg.grpo_reward_timeout)
        self.tokenizer = Tokenizer.from_meta(read_meta(data_dir))
        self.stop_ids = self.task.stop_ids(self.tokenizer)
        seen = [*itertools.islice(self.task.prompts("train", cfg.grpo_task_seed), 64),
                *itertools.islice(self.task.prompts("heldout", cfg.grpo_task_seed), cfg.grpo_eval_prompts)]
        try:  # the task's prompts in this model's tokens: a character it lacks is said now, not at step 40
            longest = max(len(self.tokenizer.encode(text)) for text in seen)
        except DataError as e:
            raise ObjectiveError(f"task {cfg.grpo_task!r}: {e} (the model's tokenizer must write its prompts)") from None
        context = raw_model.config.block_size
        if longest + cfg.grpo_max_tokens > context:
            raise ObjectiveError(f"task {cfg.grpo_task!r} has prompts of {longest} tokens, and {longest} + "
                                 f"grpo_max_tokens ({cfg.grpo_max_tokens}) exceeds the model's context of {context}; "
                                 f"lower grpo_max_tokens")
        if not settings.kl:
            self.reference, against = None, "no KL penalty"
        elif cfg.lora_rank:
            self.reference = AdapterOffReference(raw_model)
            against = f"KL {settings.kl:g} to the model with its LoRA adapters off (no copy)"
        else:
            self.reference = CopyReference(raw_model)
            if state is not None:
                self.reference.model.load_state_dict(state["weights"])
            elif cfg.init_from == "resume":
                raise ObjectiveError(f"{cfg.out_dir}/last.pt holds no starting weights for grpo_kl (it was not a "
                                     f"GRPO run with grpo_kl > 0)")
            against = f"KL {settings.kl:g} to a copy of the starting weights (kept in each checkpoint)"
        self.loss = GRPOObjective(settings, self.reference)
        reward = cfg.grpo_reward or f"{cfg.grpo_task}:reward"
        return (f"objective: GRPO on {cfg.grpo_task} rewarded by {reward}: {settings.n} replies a prompt at "
                f"temperature {cfg.grpo_temperature:g}, up to {cfg.grpo_max_tokens} tokens, drawn by the serving "
                f"engine from the live weights; clip {settings.clip:g}, {settings.averaging} averaging, {against}; "
                f"val: {cfg.grpo_eval_prompts} held-out prompts answered greedily (val loss = -their mean reward)")

    def notes(self, cfg) -> list[str]:
        if cfg.dropout:
            return [f"note: dropout={cfg.dropout:g} with objective=grpo: the rollouts are drawn without dropout and "
                    f"the loss taken with it, so the ratio to the drawing model is not 1 and clipping acts on noise"]
        return []

    def batches(self, cfg, data_dir: Path, d: Dist, rt: Runtime):
        accum = cfg.gradient_accumulation_steps // d.world_size
        if (cfg.batch_size * accum) % cfg.grpo_n:
            raise ObjectiveError(f"each of the {d.world_size} processes takes batch_size x {accum} = "
                                 f"{cfg.batch_size * accum} replies a step, not a multiple of grpo_n ({cfg.grpo_n})")
        loader = RolloutLoader(self.model, self.task, self.checker, self.tokenizer, n=cfg.grpo_n,
                               batch_size=cfg.batch_size, accum=accum, max_tokens=cfg.grpo_max_tokens,
                               sampling=SamplingOptions(temperature=cfg.grpo_temperature), stop_ids=self.stop_ids,
                               seed=cfg.grpo_task_seed, rank=d.rank, world_size=d.world_size, device=rt.device,
                               max_batch=cfg.batch_size * accum, draw_seed=cfg.seed)
        texts = list(itertools.islice(self.task.prompts("heldout", cfg.grpo_task_seed), cfg.grpo_eval_prompts))
        mine = texts[d.rank::d.world_size]
        val = [HeldOut(mine[k: k + cfg.batch_size], [self.tokenizer.encode(t) for t in mine[k: k + cfg.batch_size]])
               for k in range(0, len(mine), cfg.batch_size)]
        return loader, val

    def __call__(self, model: torch.nn.Module, batch):
        if self.loss is None:
            raise RuntimeError("GRPO.start() readies the task and checker before the first micro-batch")
        if isinstance(batch, HeldOut):
            return self.held_out(batch)
        return self.loss(model, batch)

    def held_out(self, batch: HeldOut):
        """The evaluation: greedy replies to held-out prompts; loss = -their mean reward."""
        replies, _ = draw(self.model, batch.ids, 1, max_tokens=self.cfg.grpo_max_tokens,
                          sampling=SamplingOptions(temperature=0), stop_ids=self.stop_ids,
                          generator=torch.Generator().manual_seed(0), max_batch=len(batch))
        self.model.eval()  # (evaluate's mode: draw put back the mode it found)
        device = self.model.transformer.wte.weight.device  # (the evaluation sums on the run's device)
        rewards = torch.tensor(self.checker.score(batch.texts, [self.tokenizer.decode(r[0]) for r in replies]),
                               device=device)
        lengths = torch.tensor([float(len(r[0])) for r in replies], device=device)
        zero = torch.zeros((), device=device)
        return -rewards.mean(), {"reward": rewards.mean(), "no_signal": zero, "reply_tokens": lengths.mean(),
                                 "kl": zero, "clip_fraction": zero}

    def batch_items(self, batch) -> int:
        return len(batch)

    def trial_batch(self, cfg, raw_model: torch.nn.Module, batch_size: int, device: torch.device):
        raise ObjectiveError("batch_size=auto is not for objective=grpo: set --batch_size")

    def describe_batch(self, cfg) -> str:
        return f"{cfg.batch_size} replies (groups of {cfg.grpo_n})"

    def state_dict(self) -> dict | None:
        if isinstance(self.reference, CopyReference):
            return {"weights": self.reference.model.state_dict()}
        return None

