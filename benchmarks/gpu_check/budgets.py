"""The plan of a check: each part's budget (scaled to --total_s, each at least its floor), what its commands need
on an H200 (added up by the part itself, from the H200 table), the packages each part needs, and --dry_run's
table; a --total_s too short for a part's floor is refused here, before anything runs."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.gpu_check import (
    bench_runs,
    common,
    cuda_tests,
    decode,
    device,
    gpt2_step,
    memory_plan,
    nanogpt,
    serving,
    shakespeare,
    steps,
)
from benchmarks.gpu_check.check import GRACE_S
from benchmarks.gpu_check.serving import SERVE_PACKAGES
from gptkit import cli  # (standard library only)


@dataclass(frozen=True)
class Budget:
    gpu: float  # seconds planned on a GPU (at least what the part needs there: run_needs)
    gpu_floor: float  # the least it is started with on a GPU
    smoke: float  # ... and in --smoke
    smoke_floor: float

    def of(self, smoke: bool) -> tuple[float, float]:
        return (self.smoke, self.smoke_floor) if smoke else (self.gpu, self.gpu_floor)


# The device read comes first, on its own budget: no other part's share can skip it (4.5 s on 2026-11-26, 10.0 s
# with the matmul's 1 s of warm-up on 2026-11-28's slower host; now NVML's readings, 3 s of warm-up and two shapes).
DEVICE_BUDGET = Budget(18, 12, 25, 15)
# Each default part's budget is at least NEED_MARGIN x what its commands need on an H200 (run_needs; the test of
# the plan fails where one is not), so that a part measured as slow as the slower host was still ends in time.
NEED_MARGIN = 1.1
BUDGETS = {"decode": Budget(74, 50, 40, 20), "train": Budget(141, 90, 50, 25), "nanogpt": Budget(55, 50, 10, 5),
           "shakespeare": Budget(82, 60, 60, 30), "tests": Budget(182, 80, 30, 20),
           # not in the default run (--parts=...): each with its own time
           "nanogpt_train": Budget(120, 60, 40, 15), "steps": Budget(140, 50, 45, 20),
           "decode_more": Budget(53, 30, 10, 5), "plan": Budget(42, 40, 10, 5), "serve": Budget(165, 90, 10, 5),
           "train_more": Budget(280, 35, 10, 5)}
DEFAULT_PARTS = ("decode", "train", "nanogpt", "shakespeare", "tests")  # (in PARTS' order)
DEFAULT_TOTAL_S = {False: 578.0, True: 300.0}  # on a GPU (the default parts' budgets), and in --smoke

# The Python packages (beyond the standard library) each part's commands need. A part one of whose packages is
# not installed is skipped, saying which, instead of failing after its minutes (a GPU image may lack one of the
# project's dependencies: crc32c, carried as a wheel by the launch command in __init__.py). tests/test_gpu_check.py
# checks that train.py, bench.py and the CUDA test files import no other of the project's dependencies.
# (transformers, for decode's reference row only, is not one: without it that bench.py run keeps its eager
# rows and ends on its one-line error, and the compiled run goes on.)
OURS = ("torch", "numpy", "tiktoken", "tqdm", "crc32c")  # train.py, bench.py, prepare/, the tests
PART_MODULES = {"device": ("torch",), "tests": (*OURS, "pytest"), "train": OURS, "nanogpt": ("torch", "numpy"),
                "nanogpt_train": ("torch", "numpy"), "shakespeare": OURS, "steps": OURS, "decode": OURS,
                "decode_more": OURS, "plan": OURS, "serve": (*OURS, *SERVE_PACKAGES), "train_more": OURS}


# The parts in the order they run: the device first, then the most decisive; the tests last of the default
# parts, so that the time the parts before them left unused lets their last files run too.
PARTS: dict[str, Callable] = {
    "device": device.part_device, "decode": decode.part_decode, "train": gpt2_step.part_train,
    "nanogpt": nanogpt.part_nanogpt, "shakespeare": shakespeare.part_shakespeare, "tests": cuda_tests.part_tests,
    "nanogpt_train": nanogpt.part_nanogpt_train, "steps": steps.part_steps, "decode_more": decode.part_decode_more,
    "plan": memory_plan.part_plan, "serve": serving.part_serve, "train_more": gpt2_step.part_train_more}


def run_needs(name: str, smoke: bool = False) -> list[tuple[str, float]]:
    """What each run of a part needs on an H200, added up by the part from the figures of H200 for the very
    commands it runs, in the order it runs them (each 0 in --smoke: the CPU rehearsal's runs share their part's
    time as they come). A bench.py run's extra rows (measured if time holds them) are not in it; a run in
    OPTIONAL_RUNS is, but not in part_need."""
    if name in ("train", "train_more"):
        return bench_runs.needs(name, gpt2_step.table(name, smoke), smoke)
    if name in ("decode", "decode_more"):
        return bench_runs.needs(name, decode.table(name, smoke), smoke)
    if name in ("nanogpt", "nanogpt_train"):
        return nanogpt.run_needs(name, smoke)
    parts = {"device": device, "tests": cuda_tests, "shakespeare": shakespeare, "steps": steps, "plan": memory_plan,
             "serve": serving}
    if name not in parts:
        raise KeyError(name)
    return parts[name].run_needs(smoke)


# Runs that start only where their part's time left holds what they need, and are not in the part's need.
OPTIONAL_RUNS = cuda_tests.OPTIONAL_RUNS


def part_need(name: str) -> float:
    """What a part's commands need on an H200, by the figures of H200 (its budget should hold it): its runs'
    needs but those of OPTIONAL_RUNS."""
    return sum(seconds for label, seconds in run_needs(name) if label not in OPTIONAL_RUNS)


def make_plan(parts: list[str], total_s: float, smoke: bool) -> dict[str, float]:
    """Each part's budget in seconds, in the order they run: the device read's own, then the asked parts' shares
    of the rest of --total_s (less 2 x GRACE_S for stopping the last run), in proportion to their planned times.
    A --total_s that would give a part less than its floor is refused here, before anything runs."""
    device_s = DEVICE_BUDGET.of(smoke)[0]
    asked = [name for name in PARTS if name in parts and name != "device"]
    planned = {name: BUDGETS[name].of(smoke)[0] for name in asked}
    usable = total_s - 2 * GRACE_S - device_s
    scale = usable / sum(planned.values()) if planned else 1.0
    # the least --total_s at which every asked part gets its floor
    need = 2 * GRACE_S + device_s + sum(planned.values()) * max(
        [BUDGETS[name].of(smoke)[1] / planned[name] for name in asked], default=0)
    if total_s < need - 0.5:
        short = [name for name in asked if planned[name] * scale < BUDGETS[name].of(smoke)[1]] or ["device"]
        raise cli.UsageError(f"--total_s={total_s:g} is too short for --parts={','.join(asked)}: {', '.join(short)} "
                             f"would get less than the least it needs; use --total_s={math.ceil(need)} or more, or "
                             f"fewer --parts (--dry_run shows the plan)")
    return {"device": device_s, **{name: planned[name] * scale for name in asked}}


def plan_commands(name: str, smoke: bool, args) -> list[str]:
    """What a part runs, as text (paths in the check's temporary folder shown as TMP): --dry_run's column."""
    if name in ("train", "train_more"):
        return bench_runs.commands(name, gpt2_step.table(name, smoke))
    if name in ("decode", "decode_more"):
        return bench_runs.commands(name, decode.table(name, smoke))
    if name in ("nanogpt", "nanogpt_train"):
        return nanogpt.commands(name, smoke, args)
    if name == "shakespeare":
        return shakespeare.commands(smoke, args)
    parts = {"device": device, "tests": cuda_tests, "steps": steps, "plan": memory_plan, "serve": serving}
    if name not in parts:
        raise KeyError(name)
    return parts[name].commands(smoke)


# What the default run leaves out since budgets hold 1.1x each part's need, each with its own --parts=NAME.
LEFT_OUT = ("nanogpt_train (nanoGPT's time to val 1.47, recorded: 94.7 s on 2026-11-28), steps (the small model's "
            "ms/step early and late), decode_more (eager decoding beside transformers'), train_more (the step at "
            "12 x 1024 not graphed, blocks compiled, autotune, the optimizer compiled, GPT-2 with biases, the modern "
            "model), plan, serve")


def format_plan(budgets: dict[str, float], args) -> str:
    """--dry_run's table: each part, its budget and floor in seconds, what its commands need on an H200 (by the
    figures of H200; not in --smoke) and the budget over it, and what it runs; then what the default run
    leaves out."""
    lines = [f"gpu_check plan{' --smoke' if args.smoke else ''} at --total_s={args.total_s:g}:",
             f"{'part':<14}{'budget':>8}{'floor':>7}{'need':>7}{'x need':>7}  runs"]
    for name, budget in budgets.items():
        floor = (DEVICE_BUDGET if name == "device" else BUDGETS[name]).of(args.smoke)[1]
        need = part_need(name)
        needed = ("-", "-") if args.smoke else (f"{need:.0f} s", f"{budget / need:.2f}" if need else "-")
        commands = plan_commands(name, args.smoke, args)
        lines.append(f"{name:<14}{budget:>6.0f} s{floor:>5.0f} s{needed[0]:>7}{needed[1]:>7}  {commands[0]}")
        lines += [f"{'':<45}{command}" for command in commands[1:]]
    lines.append(f"{'(stopping)':<14}{2 * GRACE_S:>6.0f} s{'':>21}  kept back to stop the last run")
    lines.append(f"{'total':<14}{sum(budgets.values()) + 2 * GRACE_S:>6.0f} s")
    if set(budgets) == {"device", *DEFAULT_PARTS}:
        lines.append(f"not in the default run: {LEFT_OUT}")
    return "\n".join(lines)


def missing_modules(parts) -> dict[str, list[str]]:
    """Each package that the asked parts import and this Python lacks, with those parts."""
    missing: dict[str, list[str]] = {}
    for part in parts:
        for module in PART_MODULES[part]:
            if importlib.util.find_spec(module) is None:
                missing.setdefault(module, []).append(part)
    return missing


def missing_line(args, parts) -> str | None:
    """What the asked parts would look for and not find here, in one line (None: nothing): packages (those parts
    are skipped), tiny Shakespeare's text (prepared data aside, its parts would try a download, and nanoGPT is
    skipped), nanoGPT's code ("no anchor")."""
    said = [f"the package {module} ({', '.join(names)} skipped)" for module, names in missing_modules(parts).items()]
    if {"shakespeare", "steps", "nanogpt_train"} & set(parts) and common.shakespeare_text(args.shakespeare_text) is None:
        prepared = (common.ROOT / "data" / "shakespeare_char" / "meta.json").is_file()
        download = [p for p in ("shakespeare", "steps") if p in parts and not prepared]
        said.append("tiny Shakespeare's text, shared/data/tinyshakespeare.txt or --shakespeare_text=PATH ("
                    + "; ".join(([f"{', '.join(download)} would download it"] if download else [])
                                + (["nanogpt_train skipped"] if "nanogpt_train" in parts else [])) + ")")
    anchored = [p for p in ("nanogpt", "nanogpt_train") if p in parts]
    if anchored and nanogpt.nanogpt_dir(args.nanogpt) is None:
        said.append(f"nanoGPT's code, shared/anchors/nanoGPT or --nanogpt=PATH ({', '.join(anchored)} skipped: no "
                    f"anchor)")
    if not said:
        return None
    return (f"missing: {'; '.join(said)}. (shared/ in the checkout or beside it; the launch command in "
            f"python -m benchmarks.gpu_check --help copies it and carries the package)")

