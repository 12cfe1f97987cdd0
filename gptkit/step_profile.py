"""Where a training step's time goes, by kind of work: torch.profiler over a few steps, each kernel (on a GPU) or
each operator's own time (on the CPU) put in one of KINDS, in milliseconds per step.

    profile = profile_steps(step, "cuda", steps=3, head_width=model.config.padded_vocab_size)
    print(format_profile(profile))   # {"matmul": 12.1, "attention": 3.0, "head_loss": 4.2, ...}

On CUDA the time is the device's: each kernel's duration, so the sum is the GPU's busy time (less than the
step's wall time where the GPU waits on the host). On the CPU it is each operator's self time (the time not
spent in the operators it calls), so nothing is counted twice; inductor's generated CPU code runs outside any
operator and counts as "other" there.

A kernel is classified by its own name and by the operators that launched it (the launching op and those
around it, innermost first), in this order:
- optimizer: inside optimizer.step() (torch.optim's "Optimizer.step#..." range) or an Adam/Muon kernel;
- attention: scaled_dot_product_attention's ops and the flash, memory-efficient and cuDNN attention kernels;
- head_loss: the head and its loss: inside a "head_loss" profiler range or the chunked loss' autograd
  Function, an operator with an input as wide as the head (the padded vocabulary: the logits, the head's
  weight; not the token embedding's ops), or a loss kernel by name (logsumexp, log_softmax, nll_loss);
- matmul: the other matrix multiplications (cuBLAS/CUTLASS kernels, aten::mm and the like);
- other: the rest (elementwise, norms, copies, the embedding, clipping).
Inside a replayed CUDA graph the kernels are not linked to the operators that recorded them: the head's
matmuls then count as matmul, and only the loss's own kernels as head_loss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd import DeviceType

KINDS = ("matmul", "attention", "head_loss", "optimizer", "other")

_ATTENTION = ("attention", "flash", "fmha", "sdpa", "scaled_dot_product")
_LOSS = ("logsumexp", "log_softmax", "nll_loss", "cross_entropy", "head_loss", "linearcrossentropy")
_MATMUL_KERNELS = ("gemm", "cutlass", "xmma", "nvjet", "cublas", "wgmma", "matmul", "triton_tem")
_MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
               "aten::_scaled_mm", "aten::addmm_")


def _is_optimizer(names: list[str]) -> bool:
    return any(n.startswith("optimizer.step") or "adam" in n or "muon" in n for n in names)


def _is_head(names: list[str], shapes: list, head_width: int) -> bool:
    if any(any(key in n for key in _LOSS) for n in names):
        return True
    if any("embedding" in n for n in names):
        return False
    return any(isinstance(s, list) and head_width in s for s in shapes)


def classify(kernel: str, ops: list, head_width: int) -> str:
    """The kind of one kernel (or CPU operator) named `kernel`, launched inside `ops` (profiler events,
    innermost first; empty if unknown), for a head `head_width` columns wide."""
    names = [kernel.lower(), *(op.name.lower() for op in ops)]
    shapes = [s for op in ops[:1] for s in (op.input_shapes or [])]  # the launching op's inputs
    if _is_optimizer(names):
        return "optimizer"
    if any(key in n for n in names for key in _ATTENTION):
        return "attention"
    if _is_head(names, shapes, head_width):
        return "head_loss"
    if any(key in names[0] for key in _MATMUL_KERNELS) or any(n in _MATMUL_OPS for n in names[1:2] + names[:1]):
        return "matmul"
    return "other"


def _enclosing(event) -> list:
    """The event and the CPU ranges around it, innermost first."""
    chain = []
    while event is not None:
        chain.append(event)
        event = event.cpu_parent
    return chain


def classify_events(events, device_type: str, steps: int, head_width: int) -> dict[str, float]:
    """{kind: milliseconds per step} from a profile's events (prof.events()) over `steps` steps: CUDA kernels'
    durations on a GPU, CPU operators' self times elsewhere."""
    total = dict.fromkeys(KINDS, 0.0)
    if device_type == "cuda":
        cpu = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]
        launched_by = {e.id: e for e in cpu if getattr(e, "linked_correlation_id", 0) == 0 and e.id > 0}
        for e in events:
            if e.device_type != DeviceType.CUDA:
                continue
            op = launched_by.get(getattr(e, "linked_correlation_id", 0))
            kind = classify(e.name, _enclosing(op), head_width)
            total[kind] += e.time_range.elapsed_us()
    else:
        for e in events:
            if e.device_type != DeviceType.CPU or e.is_async:
                continue
            kind = classify(e.name, _enclosing(e), head_width)  # an operator "launches" itself
            total[kind] += e.self_cpu_time_total
    return {kind: us / 1000 / steps for kind, us in total.items()}


def profile_steps(step: Callable[[], None], device_type: str, steps: int, head_width: int) -> dict[str, float]:
    """Runs step() `steps` times under torch.profiler (the device synchronised at the end) and returns its
    time by kind, in ms per step (classify_events)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device_type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        for _ in range(steps):
            step()
        if device_type == "cuda":
            torch.cuda.synchronize()
    return classify_events(prof.events(), device_type, steps, head_width)


def format_profile(profile: dict[str, float], indent: str = "  ") -> str:
    """Two lines: the kinds, and their ms per step with each one's share of the total."""
    total = sum(profile.values()) or 1.0
    cells = [f"{profile[k]:.2f} ({profile[k] / total:.0%})" for k in KINDS]
    width = max(len(c) for c in [*cells, *KINDS]) + 2
    head = f"{indent}{'profile, ms/step':<18}" + "".join(f"{k:>{width}}" for k in KINDS) + f"{'total':>{width}}"
    values = f"{indent}{'':<18}" + "".join(f"{c:>{width}}" for c in cells) + f"{sum(profile.values()):>{width}.2f}"
    return f"{head}\n{values}"
