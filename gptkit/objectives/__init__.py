"""What a training run trains toward, one class per objective, registered here by name (`--objective`):

    objective = make_objective(cfg)          # OBJECTIVES[cfg.objective](cfg)
    loss, metrics = objective(model, batch)  # what gptkit/step.py calls on each micro-batch

The protocol (gptkit/objectives/base.py's Objective, with the next-token loss' defaults) is what the loop, the
step, the evaluation, --plan, batch_size=auto and the checkpoints ask of a run's objective; none of them tests
which one it is. A new objective is a subclass in a module of this package and one line in OBJECTIVES (and its
name among config.py's OBJECTIVE_NAMES, which lists them for --help without importing them).

- next_token.py: the language-model loss on windows of tokens (pretraining, fine-tunes, LoRA).
- dpo.py: preference pairs against a reference (the losses and references: preference_losses.py).
- kto.py: unpaired rows (a prompt, a completion, a label) against a reference, DPO's sibling (the loss:
  kto_loss.py).
- grpo.py: replies drawn by the model to a task's prompts, rewarded by a checker (the loss: grpo_loss.py; the
  rollouts: grpo_rollouts.py).
"""

from __future__ import annotations

from gptkit.objectives.base import Objective, ObjectiveError
from gptkit.objectives.dpo import DPO
from gptkit.objectives.grpo import GRPO
from gptkit.objectives.kto import KTO
from gptkit.objectives.next_token import NextToken

OBJECTIVES: dict[str, type[Objective]] = {NextToken.name: NextToken, DPO.name: DPO, KTO.name: KTO, GRPO.name: GRPO}

__all__ = ["OBJECTIVES", "Objective", "ObjectiveError", "make_objective"]


def make_objective(cfg) -> Objective:
    """The run's objective, by its name (cfg.objective), holding the run's settings."""
    try:
        return OBJECTIVES[cfg.objective](cfg)
    except KeyError:
        raise ObjectiveError(f"objective must be one of {', '.join(OBJECTIVES)}, got {cfg.objective!r}") from None
