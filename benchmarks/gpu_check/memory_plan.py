"""The plan part (not in the default run): python -m benchmarks.plan_memory --device=cuda, the plan's peak memory
against the allocator's, its table read into rows."""

from __future__ import annotations

import re

from benchmarks.gpu_check.check import Check, outcome
from benchmarks.gpu_check.common import python, shown
from benchmarks.gpu_check.figures import h200, on_h200

PLAN_ROW = re.compile(r"^(?P<shape>\S.*?)\s+(?P<batch>\d+)\s+(?P<plan>[\d,]+) MiB\s+(?P<allocator>[\d,]+) MiB"
                      r"\s+(?P<error>[+-]\d+(?:\.\d+)?)%")
PLAN_FAILED = re.compile(r"^(?P<what>\S+): failed$")


def plan_rows(output: str) -> tuple[list[dict], list[str]]:
    """benchmarks/plan_memory.py's table: its rows (shape, batch, plan and allocator MiB, the plan's error as a
    fraction) and the shapes it says failed."""
    rows, failed = [], []
    for line in output.splitlines():
        if m := PLAN_ROW.match(line):
            rows.append({"shape": m["shape"], "batch": int(m["batch"]), "plan_mib": int(m["plan"].replace(",", "")),
                         "allocator_mib": int(m["allocator"].replace(",", "")), "error": float(m["error"]) / 100})
        elif m := PLAN_FAILED.match(line.strip()):
            failed.append(m["what"])
    return rows, failed


PLAN_COMMAND = python("-m", "benchmarks.plan_memory", "--device=cuda")


def part_plan(check: Check, args) -> dict:
    if check.smoke:
        return {"status": "skipped", "runs": [], "reason": "smoke: benchmarks.plan_memory's CPU shapes take "
                "minutes; on a GPU it measures GPT-2 124M at micro-batches 8, 16, 32"}
    run = check.run("memory plan", PLAN_COMMAND)
    rows, failed = plan_rows(run.output) if run else ([], [])
    status, reason = outcome([run], ["python -m benchmarks.plan_memory --device=cuda"])
    if status == "ok" and (failed or not rows):
        status, reason = "failed", f"plan_memory: {', '.join(failed) or 'no rows'} failed (see the log)"
    return {"status": status, "reason": reason, "runs": [run.record()] if run else [], "rows": rows}


def run_needs(smoke: bool) -> list[tuple[str, float]]:
    return on_h200([("memory plan", h200("plan_s"))], smoke)


def commands(smoke: bool) -> list[str]:
    return [shown(PLAN_COMMAND)] if not smoke else ["nothing in --smoke"]
