"""The one training step: what train.py's loop runs every step, what bench.py's training rows time, and the
pieces gptkit/cudagraph.py's GraphedStep records as one CUDA graph.

    train_step = TrainStep(model, optimizer, scaler, rt, d, cfg, accum=4)
    out = train_step(step, loader, requests.next)     # the learning rate, forward + backward over the
                                                      # micro-batches, clip, the flags, the optimizer step
    if out.verdict.bad_step is not None:              # a NaN/inf step: never applied
        raise NonFiniteError(out.verdict)
    loss, grad_norm, metrics = out.read(d)            # when the step is logged: the loop's one host sync

One step: `accum` micro-batches, each the objective's loss divided by accum and its backward (under DDP the
gradients are all-reduced on the last micro-batch only); then the gradients unscaled (float16's GradScaler),
the global gradient norm clipped to grad_clip (0: an infinite bound, so the norm is still computed, for the log
and the non-finite check), the flags, the optimizer step and zero_grad. A graphed step (TrainStep's `graphed`,
a cudagraph.GraphedStep) is the same function (step_body), recorded once and replayed. A run's step is built by
gptkit/step_factory.py's make_step (the optimizer, the scaler, the graphed variant and TrainStep).

The objective: the loss of one micro-batch is one small function (or an object with __call__, holding what it
needs besides the model, a reference model say), objective(model, batch) -> (loss, metrics). `batch` is what
the loader gives (next_token_loss, the default, takes x, y and returns model(x, y)[1], the mean next-token
cross-entropy); `metrics` is a dict of scalar device tensors that the objective wants logged beside the loss
(a preference loss's reward margin and accuracy, say; {} for next_token_loss). They are averaged over the
micro-batches as the loss is, and read to the host only when a step is logged (StepResult.read).

The flags (StepGuard): a NaN/inf step is never applied, and a stop signal or a save asked for on any process
acts on every process after the same step, with no host synchronisation in the step on a GPU. StopFlag turns
SIGTERM, Ctrl-C and SIGUSR1 into such requests; StepRequests adds rank 0's clock (checkpoint_interval_s).
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from gptkit import parallel
from gptkit.errors import UserError
from gptkit.optim import can_mask, set_lr, step_unless
from gptkit.runtime import Dist, Runtime

if TYPE_CHECKING:
    from gptkit.config import TrainConfig

# A micro-batch as the loader gives it (x, y: token windows and their targets; or the objective's own kind, a
# gptkit/data/pairs.py PairBatch for DPO), and the objective: its loss, and the scalar metrics to log beside it
# (device tensors).
Batch = Any
Objective = Callable[[torch.nn.Module, Batch], tuple[torch.Tensor, dict[str, torch.Tensor]]]

# Where the flags are read a step late (the step masked on the device instead): where the host would wait.
DEFERRED_DEVICE_TYPES = ("cuda",)
# What a process asks of the next step boundary, sent with the step's flags (step_flags): the largest request
# over the processes wins, so every process saves, or stops, after the same step.
GO_ON, SAVE, STOP = 0.0, 0.5, 1.0


class StepInterrupted(Exception):
    """A stop signal during a step that can be cut short (TrainStep's `interrupt`): raised out of the forward
    and backward; the step's micro-batches are given back to the loader and nothing of it is applied."""


class NonFiniteError(UserError):
    """A step whose loss or gradient norm was NaN or infinite: its update was not applied, and the run stops."""

    def __init__(self, v: Verdict):
        super().__init__(
            f"non-finite loss or gradient norm at step {v.bad_step} (loss {v.loss:.4g}, grad norm {v.grad_norm:.4g}); "
            f"its update was not applied and checkpoints were left as they were. Try a lower --learning_rate, "
            f"--grad_clip=1.0, or --dtype=bfloat16/float32")


# ----------------------------------------------------------------------------- the objective


def next_token_loss(model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The default objective: the mean next-token cross-entropy of the micro-batch (x, y), and no other metric.
    With targets the model returns no logits (None): the loss is computed without ever holding them."""
    x, y = batch
    return model(x, y)[1], {}


# ----------------------------------------------------------------------------- the gradients


def accumulate(model: torch.nn.Module, next_batch: Callable[[], Batch], accum: int, autocast, device: torch.device,
               *, objective: Objective = next_token_loss, scale=None, prefetch=None, interrupt=None,
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward and backward over `accum` micro-batches (next_batch() each): their mean loss and mean metrics, as
    device tensors (nothing is read to the host). `autocast`: a function giving the forward's autocast context;
    `scale`: what the loss is multiplied by for its backward (the GradScaler's scale; None: nothing);
    `prefetch` (the loader's) reads the next batch while the device runs the forward just queued: after the
    last micro-batch that is the next step's first, read while the device still runs this step. `interrupt`:
    called before each micro-batch (it raises StepInterrupted after a stop signal). A metric that is a mean over
    a part of each micro-batch (the objective's metric_over gives that part's share, as for the evaluation: KTO's
    mean reward of the desirable rows) is weighed by it, so its mean is over the step's part, NaN only when no
    micro-batch has any."""
    loss_sum = torch.zeros((), device=device)
    metric_sums: dict[str, torch.Tensor] = {}
    over = getattr(objective, "metric_over", {})
    shares: dict[str, torch.Tensor] = {}
    for micro in range(accum):
        if interrupt is not None:
            interrupt()
        batch = next_batch()
        # Under DDP gradients are all-reduced on the last micro-batch only (the others accumulate locally); under
        # FSDP every micro-batch's are reduce-scattered, so none is ever held whole (gptkit/parallel.py's no_sync).
        with parallel.no_sync(model) if micro < accum - 1 else contextlib.nullcontext():
            with autocast():
                loss, metrics = objective(model, batch)
                loss = loss / accum
            if prefetch is not None:
                prefetch()
            (loss if scale is None else scale(loss)).backward()
        loss_sum += loss.detach()
        for name, value in metrics.items():
            if name in over:
                share = over[name](metrics).detach().float()
                value = torch.where(share > 0, value.detach().float() * share, 0.0)  # (a part of none: NaN, 0 here)
                shares[name] = shares.get(name, 0) + share
            metric_sums[name] = metric_sums.get(name, 0) + value.detach().float() / accum
    for name, share in shares.items():
        metric_sums[name] = metric_sums[name] * accum / share  # (0 / 0 = NaN: no part in any micro-batch)
    return loss_sum, metric_sums


def trained_parameters(optimizer) -> list[torch.nn.Parameter]:
    """Every parameter the optimizer updates: those whose gradients are clipped."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def clip_gradients(params: list[torch.nn.Parameter], grad_clip: float) -> torch.Tensor:
    """The global gradient norm (a device tensor, also from FSDP's sharded gradients), the gradients clipped to
    grad_clip; grad_clip 0 clips nothing (an infinite bound: the norm is still computed)."""
    return parallel.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))


def non_finite(loss: torch.Tensor, grad_norm: torch.Tensor, *, gradients: bool = True) -> torch.Tensor:
    """A () bool device tensor: the loss, or (with `gradients`) the gradient norm, is NaN or infinite."""
    bad = ~torch.isfinite(loss)
    if gradients:
        bad = bad | ~torch.isfinite(grad_norm)
    return bad


class Gradients(NamedTuple):
    """What forward_backward leaves for the optimizer step, as device tensors."""

    loss: torch.Tensor  # the mean loss over the micro-batches
    grad_norm: torch.Tensor  # before clipping
    metrics: dict[str, torch.Tensor]  # the objective's, averaged over the micro-batches


class OnDevice(NamedTuple):
    """What a step reads of its Runtime: the device and the autocast context. A CUDA graph's step gives its own
    (gptkit/cudagraph.py: autocast without its cache of cast weights, which a graph would read after it is freed)."""

    device: torch.device
    autocast: Callable[[], Any]


def forward_backward(model, optimizer, scaler, next_batch, accum: int, rt: Runtime | OnDevice, grad_clip: float,
                     prefetch=None, objective: Objective = next_token_loss, interrupt=None) -> Gradients:
    """The gradient half of a training step: `accum` micro-batches of forward + backward (accumulate), then
    unscale and clip. `scaler` None: no loss scaling (a graphed step's). Reading the returned tensors would sync
    the host."""
    loss, metrics = accumulate(model, next_batch, accum, rt.autocast, rt.device, objective=objective,
                               scale=None if scaler is None else scaler.scale, prefetch=prefetch,
                               interrupt=interrupt)
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = clip_gradients(trained_parameters(optimizer), grad_clip)  # (FSDP: sharded)
    return Gradients(loss, grad_norm, metrics)


# What a step's `decide` gives for its update: True, not applied (decided on the host); False, applied; a () float
# device tensor, applied unless it is nonzero (decided on the device: optim.step_unless, no host sync).
Skip = bool | torch.Tensor


def step_body(model, optimizer, scaler, next_batch, accum: int, rt: Runtime | OnDevice, grad_clip: float, *,
              decide: Callable[[torch.Tensor, torch.Tensor], Skip], objective: Objective = next_token_loss,
              prefetch=None, interrupt=None) -> Gradients:
    """The one training step, as the plain step runs it and a CUDA graph records it (TrainStep and
    cudagraph.GraphedStep both call this): forward + backward over the micro-batches, unscale and clip
    (forward_backward), then `decide(loss, grad_norm)` (the flags: StepGuard's for the plain step, the graph's own
    on the device) and the optimizer step as it says (apply_update). No zero_grad: a graph keeps its gradients'
    memory, the plain step frees it. Capturable where `decide` is: nothing here reads a device value."""
    loss, grad_norm, metrics = forward_backward(model, optimizer, scaler, next_batch, accum, rt, grad_clip,
                                                prefetch=prefetch, objective=objective, interrupt=interrupt)
    apply_update(optimizer, scaler, decide(loss, grad_norm))
    return Gradients(loss, grad_norm, metrics)


def apply_update(optimizer, scaler, skip: Skip) -> None:
    """The optimizer step as `skip` says (Skip): masked on the device for a tensor; through the GradScaler (which
    with float16 skips a step of inf gradients and lowers its scale) when applied on the host's word."""
    if isinstance(skip, torch.Tensor):
        step_unless(optimizer, skip)
    elif not skip:
        scaler.step(optimizer)
        scaler.update()


# ----------------------------------------------------------------------------- the flags


def step_flags(loss: torch.Tensor, grad_norm: torch.Tensor, request: float, rt: Runtime,
               d: Dist) -> torch.Tensor:
    """The step's flags on the device, (2,) float32: [a NaN/inf anywhere, the largest request of any rank for
    the step boundary (StepRequests: GO_ON, SAVE or STOP; a bool: a stop signal or none)], one small reduction
    deciding for all ranks. Nothing is read to the host here. With fp16 an inf gradient is routine (the
    GradScaler skips that step and lowers its scale): only a non-finite loss is an error there."""
    flags = torch.zeros(2, device=rt.device)
    flags[0] = non_finite(loss, grad_norm, gradients=not rt.needs_grad_scaler)
    flags[1].fill_(float(request))  # a scalar fill: no host-to-device copy
    if d.enabled:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return flags


@dataclass
class Verdict:
    """What a step's flags say, once read: `bad_step` the step whose loss or gradients were not finite (its
    update was not applied), with its loss and gradient norm on this rank; `stop` a stop signal on any rank;
    `save` a save asked for on any rank (SIGUSR1, or rank 0's clock: checkpoint_interval_s), and no stop."""

    bad_step: int | None = None
    loss: float = 0.0
    grad_norm: float = 0.0
    stop: bool = False
    save: bool = False


class StepGuard:
    """The guarantees of every step, a NaN/inf step is never applied and a stop signal on any rank stops every
    rank at the same step boundary, with no host synchronisation in the step on a GPU.

    On CUDA (where the optimizer can skip its update on the device: fused AdamW, Muon; optim.can_mask) the
    step is applied unless its flag is set (`optim.step_unless`), and the flags are copied to pinned host
    memory without blocking and read one step later, after the next step's forward and backward are queued:
    the GPU never idles waiting for the host, as nanoGPT's loop. A bad step stops the run one step later (that
    step not applied either), a stop signal one step later, at the same step on every rank.
    Elsewhere the flags are read at once, before the optimizer step: on the CPU nothing runs ahead of the host,
    so reading costs nothing; with fp16 the GradScaler reads its own flags anyway."""

    def __init__(self, optimizer, rt: Runtime, d: Dist):
        self.rt, self.d = rt, d
        self.deferred = rt.device_type in DEFERRED_DEVICE_TYPES and not rt.needs_grad_scaler and can_mask(optimizer)
        self.pending: tuple[int, torch.Tensor, torch.cuda.Event | None] | None = None
        # Deferred, one pinned host buffer and one event serve every step (the previous step's values are read
        # before this step's are copied in): nothing is allocated per step, so the host's work stays flat.
        cuda = rt.device_type == "cuda"
        self.host = torch.zeros(4, pin_memory=cuda) if self.deferred else None
        self.event = torch.cuda.Event() if self.deferred and cuda else None

    def check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, request: float = GO_ON,
              flags: torch.Tensor | None = None) -> Verdict:
        """Called after the step's backward, before its optimizer step: what is known so far (this step's
        flags, or when deferred the previous step's). `flags`: the step's own, when it computed them (a CUDA
        graph's step, already applied or masked)."""
        self.flags = step_flags(loss, grad_norm, request, self.rt, self.d) if flags is None else flags
        values = torch.cat([self.flags, loss.detach().float().reshape(1), grad_norm.detach().float().reshape(1)])
        if not self.deferred:
            self.pending = (step, values, None)
            return self.settle()
        verdict = self.settle()  # the previous step's: finished, or nearly (this step is queued behind it)
        self.host.copy_(values, non_blocking=True)
        if self.event is not None:
            self.event.record()
        self.pending = (step, self.host, self.event)
        return verdict

    def optimizer_step(self, optimizer, scaler: torch.amp.GradScaler) -> None:
        """The optimizer step of a step whose flags were checked and let it through: skipped on the device when
        deferred and this step's flag is set."""
        apply_update(optimizer, scaler, self.flags[0] if self.deferred else False)

    def skip(self, verdict: Verdict) -> Skip:
        """Whether the step just checked is applied (step_body's `decide`): not after a NaN/inf step (this one's,
        or when deferred the previous one's: the run stops after this call); when deferred, unless this step's
        flag is set, on the device."""
        if verdict.bad_step is not None:
            return True
        return self.flags[0] if self.deferred else False

    def settle(self) -> Verdict:
        """The flags of the last checked step, read now (waiting for that step if needed); a Verdict of nothing
        when none is pending."""
        if self.pending is None:
            return Verdict()
        step, host, event = self.pending
        self.pending = None
        if event is not None:
            event.synchronize()
        bad, request, loss, grad_norm = host.tolist()
        return Verdict(bad_step=step if bad else None, loss=loss, grad_norm=grad_norm, stop=request >= STOP,
                       save=SAVE <= request < STOP)


# ----------------------------------------------------------------------------- the step


@dataclass
class StepResult:
    """One step's outcome: its learning rate, and as device tensors its mean loss, gradient norm and the
    objective's metrics (a graphed step's are overwritten by the next replay: read them before the next call),
    and the Verdict known after it (this step's flags, or when deferred the previous step's)."""

    lr: float
    loss: torch.Tensor
    grad_norm: torch.Tensor
    metrics: dict[str, torch.Tensor]
    verdict: Verdict

    def read(self, d: Dist) -> tuple[float, float, dict[str, float]]:
        """(loss, gradient norm, metrics) on the host, for a log line: the loss and the metrics averaged over the
        processes (the gradient norm is the same on every one). Reading waits for the step: on a GPU the
        loop's one host synchronisation, every log_interval steps."""
        loss = mean_over_ranks(self.loss, d)
        grad_norm = self.grad_norm.item()
        return loss, grad_norm, {name: mean_over_ranks(value, d) for name, value in self.metrics.items()}


def mean_over_ranks(value: torch.Tensor, d: Dist) -> float:
    if d.enabled:
        value = value.clone()
        dist.all_reduce(value)  # a sum: gloo has no AVG
        value /= d.world_size
    return value.item()


class TrainStep:
    """The one training step (this module's docstring), as train.py's loop runs it and bench.py times it: the
    learning rate for the step, forward + backward over `accum` micro-batches of the loader (objective), clip,
    the flags, then the optimizer step unless the flags already say the run stops with a non-finite step, and
    zero_grad. With `graphed` (a cudagraph.GraphedStep over the same model and optimizer) the step runs as one
    CUDA graph instead, its update masked on the device from a bad step on.

    `stop` (a StopFlag, on a run of one process whose model runs uncompiled and ungraphed: `blocks`, its
    transformer blocks): a stop signal cuts the step short instead of waiting for its end (a GPU-sized step on
    a CPU takes minutes). The flag is checked before each micro-batch and before each block's forward and
    backward; once set, StepInterrupted is raised out of the step before its optimizer step, with the loader
    and the RNG put back where the step started, so that a save then holds the last finished step exactly."""

    def __init__(self, model: torch.nn.Module, optimizer, scaler: torch.amp.GradScaler, rt: Runtime, d: Dist,
                 cfg: TrainConfig, *, accum: int, objective: Objective = next_token_loss, graphed=None,
                 stop: StopFlag | None = None, blocks: list[torch.nn.Module] | None = None):
        self.model, self.optimizer, self.scaler, self.rt, self.cfg = model, optimizer, scaler, rt, cfg
        self.accum, self.objective, self.graphed = accum, objective, graphed
        self.d, self.guard = d, StepGuard(optimizer, rt, d)
        self.stop, self.running = None, False
        if stop is not None:
            self.cut_by(stop, blocks or [])

    def cut_by(self, stop: StopFlag, blocks: list[torch.nn.Module]) -> None:
        """From now on a stop signal cuts the step short (this class's docstring), where a step can be: one
        process, not graphed. For a step built before its run's StopFlag (gptkit/step_factory.py's make_step)."""
        if self.graphed is not None or self.d.enabled:
            return
        self.stop = stop
        for block in blocks:  # (hooks that do nothing outside a step: evaluations run their own check)
            block.register_forward_pre_hook(lambda module, args: self._check())
            block.register_forward_hook(lambda module, args, out: self._check_backward(out))

    def _check(self, *_) -> None:
        if self.running and self.stop.requested:
            raise StepInterrupted

    def _check_backward(self, out) -> None:
        if self.running and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._check)  # before this block's backward

    def __call__(self, step: int, loader, requests: Callable[[], float] | None = None) -> StepResult:
        """Step `step` on the loader's next micro-batches (loader.next_batch(), and loader.prefetch() to read
        ahead). `requests`: this process' request for the step boundary (StepRequests.next), asked as late as
        the step allows (after the backward; before a graphed step, whose flags go in with its inputs), so a
        signal that comes during the step is this step's."""
        lr = set_lr(self.optimizer, step, self.cfg)
        ask = requests or (lambda: GO_ON)
        if self.graphed is not None:  # the flags computed and the update masked inside the graph
            loss, grad_norm, flags = self.graphed(loader, ask())
            verdict = self.guard.check(step, loss, grad_norm, flags=flags)
            return StepResult(lr, loss, grad_norm, self.graphed.metrics, verdict)
        verdicts = []

        def decide(loss: torch.Tensor, grad_norm: torch.Tensor) -> Skip:
            # NaN/inf, a stop or a save asked for on any rank (this step's flags, or on a GPU the previous step's)
            verdicts.append(self.guard.check(step, loss, grad_norm, ask()))
            return self.guard.skip(verdicts[-1])  # on a GPU skipped on the device if flagged

        if self.stop is None:
            loss, grad_norm, metrics = step_body(self.model, self.optimizer, self.scaler, loader.next_batch,
                                                 self.accum, self.rt, self.cfg.grad_clip, decide=decide,
                                                 prefetch=loader.prefetch, objective=self.objective)
        else:
            loss, grad_norm, metrics = self._interruptible(loader, decide)
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(lr, loss, grad_norm, metrics, verdicts[0])

    @contextlib.contextmanager
    def cut_short(self):
        """Inside it, a stop signal leaves the forwards of the blocks too (StepInterrupted), as in a step: for an
        evaluation, whose batches take as long as a step's (nothing to put back: it changes no state but the
        model's train/eval mode, which the next evaluation or step sets). Does nothing where steps are not cut."""
        if self.stop is None:
            yield
            return
        self.running = True
        try:
            yield
        finally:
            self.running = False

    def _interruptible(self, loader, decide) -> Gradients:
        """step_body, cut short by a stop signal (StepInterrupted) before its optimizer step, with the loader and
        the RNG put back."""
        position = loader.state_dict()
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(self.rt.device) if self.rt.device_type == "cuda" else None
        self.running = True
        try:
            return step_body(self.model, self.optimizer, self.scaler, loader.next_batch, self.accum, self.rt,
                             self.cfg.grad_clip, decide=decide, prefetch=loader.prefetch, objective=self.objective,
                             interrupt=self._check)
        except StepInterrupted:
            self.optimizer.zero_grad(set_to_none=True)
            loader.load_state_dict(position)
            torch.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng, self.rt.device)
            raise
        finally:
            self.running = False

    def settle(self) -> Verdict:
        """The last step's flags, read now (StepGuard.settle): before an evaluation or a save."""
        return self.guard.settle()


# ----------------------------------------------------------------------------- stop signals and save requests


class StopFlag:
    """SIGTERM / Ctrl-C set a flag instead of killing the process: a training loop finishes its step (or cuts
    an evaluation short), saves and exits with `exit_code`. A second Ctrl-C interrupts at once. SIGUSR1 asks for
    a save and no stop: `save_requested`, until a StepRequests sends it (Unix only)."""

    def __init__(self, cuts_steps: bool = False):
        # what a stop does to the step under way: cut short (TrainStep's `stop`), or finished
        self.stopping = ("cutting this step (or the evaluation) short" if cuts_steps else
                         "finishing this step (or cutting the evaluation short)")
        self.requested = False
        self.save_requested = False
        self.signum: int | None = None  # the signal that asked to stop, once one has
        self.previous = {}

    @property
    def exit_code(self) -> int:
        """128 + the signal's number (143 for SIGTERM, 130 for Ctrl-C), as a shell reports a process killed
        by it: a scheduler sees a run that was stopped, not one that finished, and can requeue it."""
        return 128 + (self.signum or signal.SIGTERM)

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.previous[sig] = signal.signal(sig, self._handle)
        if hasattr(signal, "SIGUSR1"):
            self.previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._handle_save)
        return self

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested, self.signum = True, signum
        print(f"\n{signal.Signals(signum).name} received: {self.stopping}, then saving last.pt (once a step has "
              f"finished)", flush=True)

    def _handle_save(self, signum, frame):
        self.save_requested = True
        print("\nSIGUSR1 received: saving last.pt after this step, then going on", flush=True)

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


class StepRequests:
    """This process' request for the next step boundary: STOP after a stop signal; SAVE (last.pt, then go on)
    after a SIGUSR1 here or, on the process that owns the clock (rank 0: one clock decides for the job), once
    `interval_s` seconds have passed since the last save; else GO_ON. A request is sent once: `next()` forgets
    a SIGUSR1 and restarts the clock as it returns SAVE. `clock`: seconds, monotonic (tests pass their own).
    `asked`: what asked for the last SAVE sent, until the save is done (`why_saved()`)."""

    def __init__(self, stop: StopFlag, interval_s: float = 0.0, owns_clock: bool = True, clock=time.monotonic):
        self.stop, self.interval_s, self.owns_clock, self.clock = stop, interval_s, owns_clock, clock
        self.since = clock() if owns_clock and interval_s else 0.0
        self.asked = ""

    def next(self) -> float:
        if self.stop.requested:
            return STOP
        due = self.owns_clock and self.interval_s > 0 and self.clock() - self.since >= self.interval_s
        if self.stop.save_requested or due:
            self.asked = "SIGUSR1" if self.stop.save_requested else f"every checkpoint_interval_s={self.interval_s:g}"
            self.stop.save_requested = False
            self.saved()
            return SAVE
        return GO_ON

    def why_saved(self) -> str:
        """What asked for the save being done, in a few words (another process' SIGUSR1 when not this one's),
        and forget it."""
        asked, self.asked = self.asked or "a SIGUSR1 to another process", ""
        return asked

    def saved(self) -> None:
        """last.pt was just saved (or a save is on its way): the clock starts again."""
        if self.owns_clock and self.interval_s:
            self.since = self.clock()
