"""The whole training step as one CUDA graph: captured once, replayed every step, so that the host launches one
graph instead of every kernel of the forward, the backward, the clipping and the optimizer step.

    graphed = GraphedStep(model, optimizer, rt, accum=4, batch_size=16, block_size=256, grad_clip=1.0)
    loss, grad_norm, flags = graphed(loader, stop_requested)   # device tensors; read them a step later

A small model's step is bound by the host (Python, guards, kernel launches), not by the GPU: replaying a graph
removes that. What a graph needs, this module provides:
- static inputs: each micro-batch is copied into a fixed buffer (`x`, `y`) before the replay;
- a learning rate that lives on the device (a tensor the graph reads; optim.set_lr fills it) and fused AdamW
  with capturable=True (optim.make_adamw(..., graphable=True));
- the flags on the device: [a NaN/inf this step or any earlier one, a stop signal], the stop signal passed in
  through a device tensor. The optimizer step is masked on the device by the first (optim.step_unless), so a
  non-finite step is never applied, nor any step after it, until train.py reads the flags and stops.

The first `warmup` steps run the same step eagerly on a side stream, one stream made once (they are real
training steps, and torch.compile compiles in them), then it is captured, and replayed from there on. (The
capture itself hands the warm-up's cached blocks back first, torch.cuda.graph's empty_cache.) From then on the
graph's private pool keeps a whole step's gradients and working memory for good, beside the regular pool, where
the evaluations then run: batch_size=auto keeps a margin for that (graph_batch_reserve). On a device other than
CUDA the step always runs eagerly: the same arithmetic, which is how the tests check it on a CPU.

Settings that cannot be captured are refused before the first step (refuse_uncapturable), not at the capture.
"""

from __future__ import annotations

import torch

from gptkit import parallel
from gptkit.cli import UsageError
from gptkit.optim import step_unless

# torch.compile's modes that record CUDA graphs of their own: not inside a capture of the whole step.
GRAPHING_COMPILE_MODES = ("reduce-overhead", "max-autotune")

# batch_size=auto with cuda_graphs: the share of the free memory held back from the trial step (train.py's
# fits_on_gpu). A margin, not a trial with graphs: a trial capture per candidate batch would cost three warm-up
# steps and a capture each, and a capture that runs out of memory leaves the device in a state a clean retry
# cannot count on. What the margin covers: the graph's pool keeps the step's memory for good, so an evaluation's
# forward (in the regular pool) comes on top of it instead of reusing it, and the two pools cannot share
# blocks (rounding, fragmentation). 10% is an estimate, not a measurement: a GPU run with --cuda_graphs=True and
# batch_size=auto (its peak memory, metrics.jsonl's peak_mem_mb) is what should set it.
GRAPH_MEMORY_MARGIN = 0.10


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


def graph_batch_reserve(free_bytes: int) -> int:
    """Bytes to hold back from a batch_size=auto trial step when the run replays its step as a CUDA graph."""
    return int(free_bytes * GRAPH_MEMORY_MARGIN)


class GraphedStep:
    def __init__(self, model: torch.nn.Module, optimizer, device: torch.device, *, accum: int, batch_size: int,
                 block_size: int, grad_clip: float, autocast, warmup: int = 3):
        self.model, self.optimizer, self.device = model, optimizer, device
        self.accum, self.grad_clip, self.autocast, self.warmup = accum, grad_clip, autocast, warmup
        shape = (accum, batch_size, block_size)
        self.x = torch.zeros(shape, dtype=torch.long, device=device)  # the step's micro-batches, copied in
        self.y = torch.zeros(shape, dtype=torch.long, device=device)
        self.stop_in = torch.zeros((), device=device)  # 1.0: a stop signal was asked for before this step
        self.halted = torch.zeros((), device=device)  # 1.0 once any step was non-finite: every later one is masked
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.capture = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.capture else None  # the warm-up steps' stream, made once
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.steps = 0

    def __call__(self, loader, stop_requested: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One training step on the loader's next accum micro-batches: (mean loss, gradient norm, flags), as
        device tensors that a replay overwrites (copy or read them before the next call)."""
        for micro in range(self.accum):
            x, y = loader.next_batch()
            self.x[micro].copy_(x, non_blocking=True)
            self.y[micro].copy_(y, non_blocking=True)
        self.stop_in.fill_(float(stop_requested))  # a scalar fill: no host-to-device copy
        if not self.capture:
            outputs = self.body()
            self.optimizer.zero_grad(set_to_none=True)
        elif self.steps < self.warmup:
            outputs = self._warm_up_step()
        else:
            if self.graph is None:
                self._capture()
            self.graph.replay()
            outputs = self.outputs
        loader.prefetch()  # the next step's first batch, read while the device runs this one
        self.steps += 1
        return outputs

    def body(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step itself, on the static tensors only (what the graph records): forward and backward over the
        micro-batches, the clip, the flags, the masked optimizer step. Gradients are None before it runs."""
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(self.accum):
            with self.autocast():
                loss = self.model(self.x[micro], self.y[micro])[1] / self.accum
            loss.backward()
            loss_sum += loss.detach()
        grad_norm = parallel.clip_grad_norm_(self.params, self.grad_clip if self.grad_clip > 0 else float("inf"))
        bad = (~torch.isfinite(loss_sum) | ~torch.isfinite(grad_norm)).float()
        self.halted.copy_(torch.maximum(self.halted, bad))
        flags = torch.stack([self.halted, self.stop_in])
        step_unless(self.optimizer, self.halted)
        return loss_sum, grad_norm, flags

    def _warm_up_step(self):
        """An eager step on a side stream (as CUDA graphs want their warm-up: the caching allocator and cuBLAS
        settle there, away from the capture)."""
        side = self.side
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            outputs = self.body()
            self.optimizer.zero_grad(set_to_none=True)
        torch.cuda.current_stream(self.device).wait_stream(side)
        return outputs

    def _capture(self) -> None:
        """Record body() once (nothing runs during the capture: the replay that follows is this step). Its
        gradients are allocated inside the graph's memory pool, and stay there for every replay."""
        self.optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize(self.device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = self.body()
