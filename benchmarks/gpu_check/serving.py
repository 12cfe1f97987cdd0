"""The serve part (not in the default run): benchmarks/serve_load.py on GPT-2 small's shape, eager and compiled,
where starlette, uvicorn and openai are installed (else skipped)."""

from __future__ import annotations

import importlib.util

from benchmarks.gpu_check.check import Check, outcome
from benchmarks.gpu_check.common import python, shown
from benchmarks.gpu_check.figures import h200, on_h200

# The packages serving needs beyond the project's (the part is skipped, saying so, without them).
SERVE_PACKAGES = ("starlette", "uvicorn", "openai")
SERVE_COMMAND = python("benchmarks/serve_load.py", "--model=gpt2-random", "--compile=False,True", "--clients=1,16,64",
                       "--max_batch=64", "--requests=2", "--seconds=8", "--max_tokens=128",
                       "--rounds=1", "--min_seconds=0")  # (one round: the part's budget, not a ratio's range)


def part_serve(check: Check, args) -> dict:
    missing = [name for name in SERVE_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        return {"status": "skipped", "runs": [], "reason": f"serving needs {', '.join(SERVE_PACKAGES)} "
                f"(pip install -e '.[serve,dev]'); not installed here: {', '.join(missing)}"}
    if check.smoke:
        return {"status": "skipped", "runs": [], "reason": "smoke: serving is not rehearsed on the CPU"}
    # GPT-2 small's shape, 64 rows, eager and compiled (the compiled one's buckets compile before its figures).
    # (The char model's figures are known from the H200 run of 2026-11-26: flat past 16 clients.)
    gpt2 = check.run("serve.py under load, GPT-2's shape", SERVE_COMMAND)
    runs = [r for r in (gpt2,) if r]
    status, reason = outcome([gpt2], ["benchmarks/serve_load.py --model=gpt2-random"])
    return {"status": status, "reason": reason, "runs": [r.record() for r in runs],
            "output": [line for r in runs for line in r.output.splitlines()[-12:]]}


def run_needs(smoke: bool) -> list[tuple[str, float]]:
    return on_h200([("serve.py under load", h200("serve_s"))], smoke)


def commands(smoke: bool) -> list[str]:
    return [shown(SERVE_COMMAND)] if not smoke else ["nothing in --smoke"]
