"""Scoring a model on a checkable task's held-out prompts (eval.py --task checker), with the checker GRPO
trains from: greedy accuracy, and pass@k from k replies drawn at a temperature.

    scores = score_task(model, tokenizer, load_task("tasks/arithmetic.py"), checker, k=8, temperature=1.0)
    # {"prompts": 200, "accuracy": 0.43, "mean_reward": 0.43, "pass_at_k": 0.81, "k": 8}

A reply is right when its reward is at least 1 (a task's full reward: tasks/arithmetic.py gives 1 or 0).
accuracy: the share of prompts whose greedy reply is right; mean_reward: the greedy replies' mean reward;
pass_at_k: the share of prompts with at least one right reply among k drawn (each prompt's k replies from its
own seeded streams: the same seed gives the same figure). The replies are drawn by the serving engine, as
GRPO's rollouts are (gptkit/objectives/grpo_rollouts.py).
"""

from __future__ import annotations

import itertools

import torch

from gptkit.checker import Checker, Task
from gptkit.generate import SamplingOptions
from gptkit.objectives.grpo_rollouts import draw
from model import GPT


def score_task(model: GPT, tokenizer, task: Task, checker: Checker, *, k: int = 0, temperature: float = 1.0,
               max_tokens: int = 16, limit: int = 0, task_seed: int = 0, seed: int = 0, max_batch: int = 64) -> dict:
    prompts = list(itertools.islice(task.prompts("heldout", task_seed), limit or None))
    ids = [tokenizer.encode(p) for p in prompts]
    stop_ids = task.stop_ids(tokenizer)
    generator = torch.Generator().manual_seed(seed)

    def rewards(n: int, options: SamplingOptions) -> list[list[float]]:
        replies, _ = draw(model, ids, n, max_tokens=max_tokens, sampling=options, stop_ids=stop_ids,
                          generator=generator, max_batch=max_batch)
        return [checker.score([p] * n, [tokenizer.decode(r) for r in group]) for p, group in zip(prompts, replies)]

    greedy = [g[0] for g in rewards(1, SamplingOptions(temperature=0))]
    scores = {"prompts": len(prompts), "accuracy": sum(r >= 1 for r in greedy) / len(prompts),
              "mean_reward": sum(greedy) / len(prompts)}
    if k:
        drawn = rewards(k, SamplingOptions(temperature=temperature))
        scores.update(pass_at_k=sum(any(r >= 1 for r in group) for group in drawn) / len(prompts), k=k,
                      temperature=temperature)
    return scores
