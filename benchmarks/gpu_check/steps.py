"""The steps part (not in the default run): the small model's ms per step early and late in a long run without
evaluations, graphed and as train.py runs it."""

from __future__ import annotations

from pathlib import Path

from benchmarks.gpu_check.check import Check, outcome
from benchmarks.gpu_check.common import option, read_metrics, shown
from benchmarks.gpu_check.figures import h200, on_h200
from benchmarks.gpu_check.shakespeare import shakespeare_command, shakespeare_data, train_py_need

# The steps part (--parts=steps, not in the default run): train.py's options for each run (a run each, the graphed
# one first: its late window is the figure the part exists for), its log interval, and the two steps whose
# ms/step (each over the log interval before it) it reports: the early window starts after the graphed run's
# warm-up steps and capture (gptkit/cudagraph.py: 3 warm-up steps, captured at the 4th), which the first interval
# holds; the late one is the last that every run reached, at most the second.
STEP_RUNS = (("one CUDA graph", ["--cuda_graphs=True"]), ("as train.py runs it", []))
STEP_LOG, STEP_AT = 100, (200, 1000)
SMOKE_STEP_LOG, SMOKE_STEP_AT = 10, (20, 60)


def steps_command(smoke: bool, data_root: Path, out_dir: Path, extra: list[str]) -> list[str]:
    """A run of the steps part: no evaluations, a log line every STEP_LOG steps, until the last of STEP_AT."""
    log, at = (SMOKE_STEP_LOG, SMOKE_STEP_AT) if smoke else (STEP_LOG, STEP_AT)
    return shakespeare_command(smoke, data_root, out_dir, f"--max_iters={at[-1]}", "--eval_interval=1000000",
                               "--eval_iters=1", f"--log_interval={log}", *extra)


def part_steps(check: Check, args) -> dict:
    """The small model's ms per step early (over the log interval before STEP_AT[0], after the graphed run's
    warm-up and capture) and late in a long run without evaluations (over the interval before STEP_AT[1], or
    the last interval that every run reached), with --cuda_graphs=True first (skipped on the CPU, where there is
    no graph to capture) and as train.py runs it. Each run may use the part's time less what the next needs."""
    data_root, runs, why = shakespeare_data(check, args)
    if data_root is None:
        return {"status": "skipped", "runs": [r.record() for r in runs], "reason": why}
    log, at = (SMOKE_STEP_LOG, SMOKE_STEP_AT) if check.smoke else (STEP_LOG, STEP_AT)
    wanted = [(label, extra) for label, extra in STEP_RUNS if not (check.smoke and extra)]
    needs = [need for _, need in run_needs(check.smoke)][-len(wanted):]  # (less the data's preparation)
    results, done = [], []
    for label, extra in STEP_RUNS:
        if (label, extra) not in wanted:
            results.append({"run": label, "skipped": "--smoke: no CUDA graph on the CPU"})
            continue
        i = len(done)
        out_dir = check.tmp / f"steps_{i}"
        command = steps_command(check.smoke, data_root, out_dir, extra)
        done.append(check.run(f"steps: {label}", command, limit_s=check.share(needs[i], sum(needs[i + 1:]))))
        ms = {e["step"]: e["ms_per_step"] for e in read_metrics(out_dir / "metrics.jsonl")
              if e.get("ms_per_step") is not None and e["step"] % log == 0}
        results.append({"run": label, "ms_per_step": {str(step): ms[step] for step in sorted(ms)}})
    status, reason = outcome(done, [label for label, _ in wanted])
    return {"status": status, "reason": reason, "runs": [r.record() for r in runs + done if r],
            "windows": step_windows(results, at, log), "steps": results}


def step_windows(results: list[dict], at: tuple[int, int], log: int) -> dict:
    """The windows the steps part compares (first and last step of each): the early one, before at[0], and the
    late one, before at[1] or else the last log step after at[0] that every run with figures reached (a run
    with none, one that failed at once, does not take the other's away: without a common window each run's
    late one is its own last). Each run's ms/step over them (early_ms, late_ms at late_step, and their ratio)
    is added to its result."""
    measured = [r for r in results if r.get("ms_per_step")]
    reached = [set(map(int, r["ms_per_step"])) for r in measured]
    late = max((step for step in set.intersection(*reached) if at[0] < step <= at[1]), default=None) if reached else None
    for r in results:
        if "ms_per_step" not in r:
            continue
        steps = set(map(int, r["ms_per_step"]))
        own = late or max((step for step in steps if at[0] < step <= at[1]), default=None)
        early, last = r["ms_per_step"].get(str(at[0])), r["ms_per_step"].get(str(own))
        r.update(late_step=own, early_ms=early, late_ms=last, late_over_early=last / early if early and last else None)
    return {"early": [at[0] - log + 1, at[0]], "late": [late - log + 1, late] if late else None,
            "late_wanted": [at[1] - log + 1, at[1]]}


def run_needs(smoke: bool) -> list[tuple[str, float]]:
    """The data's preparation (where the shakespeare part has not prepared it), then each run: train.py's start,
    compiles and steps."""
    needs = [("prepare shakespeare_char", h200("prepare_s"))]
    for label, extra in STEP_RUNS:
        if not (smoke and extra):
            command = steps_command(smoke, Path("data"), Path("out"), extra)
            needs.append((label, train_py_need(command, float(option(command, "max_iters")), 2,
                                               float(option(command, "eval_iters")))))
    return on_h200(needs, smoke)


def commands(smoke: bool) -> list[str]:
    tmp = Path("TMP")
    return [shown(steps_command(smoke, tmp / "data", tmp / f"steps_{i}", extra))
            for i, (_, extra) in enumerate(STEP_RUNS) if not (smoke and extra)]
