"""GRPO's rollouts: n replies to each prompt, drawn by the serving engine (gptkit/serving/engine.py: a KV cache,
continuous batching, a prompt's n replies prefilled once) from the training model's current weights, scored by
the checker, and laid out as micro-batches for the loss (gptkit/objectives/grpo_loss.py).

    drawn = draw(model, prompt_ids, n=8, max_tokens=8, sampling=SamplingOptions(temperature=1.0),
                 stop_ids={newline}, generator=g)          # [[reply ids, ...] per prompt]
    batches = rollout_batches(prompt_ids, drawn, stopped, rewards, n, micro_batches=2)

No copy of the weights: the engine runs the model the step trains (its raw module, unwrapped from DDP or
torch.compile), in eval mode (no dropout) while it draws, then back in train mode with its KV cache freed. Its
prefix cache is off, as it must be: keys and values kept from an earlier step were computed by weights that
have moved since. (FSDP's shards cannot run a forward outside the wrapper: GRPO refuses FSDP.)

Every draw is reproducible: each reply's random stream is seeded from `generator` (RolloutLoader's: seeded
by the step, which its state saved in the run's checkpoints counts), and the engine's own fallback stream is made without touching torch's global generator (its
state is put back), so a resumed run draws what the uninterrupted one did, bit for bit on the CPU.
"""

from __future__ import annotations

import itertools
import time

import torch

from gptkit.generate import SamplingOptions
from gptkit.objectives.grpo_loss import RolloutBatch, group_advantages
from gptkit.serving.engine import Engine, Finished, Request, Token
from model import GPT


@torch.no_grad()
def draw(model: GPT, prompts: list[list[int]], n: int, *, max_tokens: int, sampling: SamplingOptions,
         stop_ids: frozenset[int], generator: torch.Generator, max_batch: int = 64
         ) -> tuple[list[list[list[int]]], list[list[bool]]]:
    """(replies, stopped): for each prompt its n replies' token ids (the stop token not included) and whether
    each ended on a stop token (else it ran to max_tokens or the model's context). At most max_batch replies
    are decoded together (the engine's KV cache rows); the rest wait for a row."""
    total = len(prompts) * n
    seeds = torch.randint(2**62, (total,), generator=generator).tolist()
    replies: list[list[list[int]]] = [[[] for _ in range(n)] for _ in prompts]
    stopped = [[False] * n for _ in prompts]
    was = model.training
    devices = [model.transformer.wte.weight.device] if model.transformer.wte.weight.is_cuda else []
    try:
        with torch.random.fork_rng(devices=devices):  # (the engine seeds a stream of its own from torch's)
            engine = Engine(model, max_batch=min(max_batch, total), max_queue=total, compile=False, prefix_cache=0)
        for k in range(total):
            i, j = divmod(k, n)

            def emit(event, i=i, j=j):
                if isinstance(event, Token):
                    replies[i][j].append(event.id)
                elif isinstance(event, Finished):
                    stopped[i][j] = event.reason == "stop"

            engine.submit(Request(prompts[i], max_tokens, emit, sampling=sampling, stop_ids=stop_ids,
                                  seed=seeds[k]))
        while engine.active or engine.waiting:
            engine.step()
    finally:
        model.clear_kv_cache()
        model.train(was)
    return replies, stopped


def rollout_batches(prompts: list[list[int]], replies: list[list[list[int]]], stopped: list[list[bool]],
                    rewards: list[list[float]], micro_batches: int, stop_id: int | None,
                    device: torch.device | str = "cpu") -> list[RolloutBatch]:
    """The step's rollouts as `micro_batches` RolloutBatches of equal size, in order (a prompt's group may span
    two: the advantages are computed over the whole step first). Each row is prompt + reply (+ the stop token
    when the reply drew it: stopping is an action too, and learnt as one), right-padded to the step's longest;
    its targets are the reply's tokens only."""
    n = len(replies[0])
    seqs, starts = [], []
    for p, group, ends in zip(prompts, replies, stopped):
        for reply, end in zip(group, ends):
            seqs.append(p + reply + ([stop_id] if end and stop_id is not None else []))
            starts.append(len(p))
    T = max(len(s) for s in seqs) - 1
    x = torch.zeros(len(seqs), T, dtype=torch.long)
    y = torch.full((len(seqs), T), -1, dtype=torch.long)
    for row, (s, start) in enumerate(zip(seqs, starts)):
        x[row, : len(s) - 1] = torch.tensor(s[:-1])
        y[row, start - 1: len(s) - 1] = torch.tensor(s[start:])
    flat_rewards = torch.tensor([r for group in rewards for r in group], dtype=torch.float32)
    advantages, no_signal = group_advantages(flat_rewards, n)
    lengths = torch.tensor([len(r) for group in replies for r in group], dtype=torch.float32)
    share = no_signal / len(prompts)
    size = len(seqs) // micro_batches
    return [RolloutBatch(x[k: k + size].to(device), y[k: k + size].to(device), advantages[k: k + size].to(device),
                         flat_rewards[k: k + size].to(device), lengths[k: k + size].to(device), share.to(device))
            for k in range(0, len(seqs), size)]


class RolloutLoader:
    """GRPO's batches, as a loader gives them to the training step: at the first micro-batch of each step it
    takes the step's prompts from the task's training stream (batch_size x accum / n of them on each process,
    process r taking every world_size-th from the r-th), draws n replies to each with the model as it is now,
    scores them with the checker and lays them out as `accum` micro-batches of batch_size rollouts.

    The draws of the k-th step of process r come from a generator seeded by (draw_seed, r, k): its state
    (state_dict, saved in the run's checkpoints, rank 0's for all) is the prompts taken and the steps drawn so
    far, the same on every process, and the micro-batches of a step under way (none between steps, where
    checkpoints are written)."""

    def __init__(self, model: GPT, task, checker, tokenizer, *, n: int, batch_size: int, accum: int,
                 max_tokens: int, sampling: SamplingOptions, stop_ids: frozenset[int], seed: int, rank: int = 0,
                 world_size: int = 1, device: torch.device | str = "cpu", max_batch: int = 64,
                 draw_seed: int | None = None):
        self.model, self.task, self.checker, self.tokenizer = model, task, checker, tokenizer
        self.n, self.accum, self.max_tokens, self.sampling, self.stop_ids = n, accum, max_tokens, sampling, stop_ids
        self.stop_id = min(stop_ids) if stop_ids else None
        self.prompts_per_step = batch_size * accum // n
        self.seed, self.rank, self.world_size, self.device, self.max_batch = seed, rank, world_size, device, max_batch
        self.draw_seed = seed if draw_seed is None else draw_seed  # the draws' (seed: the task's stream and split)
        self.taken = 0  # prompts this process has taken from the stream
        self.steps = 0  # steps drawn
        self.queue: list[RolloutBatch] = []
        self.last: dict[str, float] = {}  # the last step's rollouts, for the log (tokens drawn, seconds)
        self._stream = None

    def _prompts(self, count: int) -> list[str]:
        if self._stream is None:  # process rank's share of the stream, from where it stopped
            start = self.rank + self.world_size * self.taken
            self._stream = itertools.islice(self.task.prompts("train", self.seed), start, None, self.world_size)
        out = [next(self._stream) for _ in range(count)]
        self.taken += count
        return out

    def next_batch(self) -> RolloutBatch:
        if not self.queue:
            self.queue = self.draw_step()
        return self.queue.pop(0)

    def prefetch(self) -> None:
        """(Nothing to read ahead: a step's rollouts need the weights of the step before.)"""

    def draw_step(self) -> list[RolloutBatch]:
        texts = self._prompts(self.prompts_per_step)
        ids = [self.tokenizer.encode(t) for t in texts]
        began = time.perf_counter()
        generator = torch.Generator().manual_seed(((self.draw_seed * 1_000_003 + self.rank) * 1_000_003 + self.steps) % 2**62)
        self.steps += 1
        replies, stopped = draw(self.model, ids, self.n, max_tokens=self.max_tokens, sampling=self.sampling,
                                stop_ids=self.stop_ids, generator=generator, max_batch=self.max_batch)
        seconds = time.perf_counter() - began
        rewards = [self.checker.score([t] * self.n, [self.tokenizer.decode(r) for r in group])
                   for t, group in zip(texts, replies)]
        tokens = sum(len(r) for group in replies for r in group)
        self.last = {"rollout_tokens": tokens, "rollout_s": seconds}
        return rollout_batches(ids, replies, stopped, rewards, self.accum, self.stop_id, self.device)

    @property
    def epoch(self) -> float:
        """(An endless stream of prompts has no epochs: 0.)"""
        return 0.0

    def state_dict(self) -> dict:
        return {"taken": self.taken, "steps": self.steps,
                "queue": [{k: (None if v is None else v.cpu()) for k, v in vars(b).items()} for b in self.queue]}

    def load_state_dict(self, state: dict) -> None:
        self.taken = int(state["taken"])
        self.steps = int(state["steps"])
        self.queue = [RolloutBatch(**{k: (None if v is None else v.to(self.device)) for k, v in b.items()})
                      for b in state["queue"]]
        self._stream = None
