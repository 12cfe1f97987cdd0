"""What the parts that run bench.py share (decode, train and their _more parts): bench.py once per group of rows,
with --keep_going and --json, its rows joining the report as each run ends; the options this checkout's bench.py
lacks left out, saying so; each run's need on an H200 from the rows it times."""

from __future__ import annotations

import ast
import math
from pathlib import Path

from benchmarks.gpu_check import common
from benchmarks.gpu_check.check import Check, outcome
from benchmarks.gpu_check.common import option, python, read_rows, shown
from benchmarks.gpu_check.figures import h200, on_h200

# bench.py's variant options: a comma list each, one row per combination (bench_needs counts the rows; a decode
# row per window).
BENCH_VARIANTS = ("--models", "--batch_size", "--sdpa", "--compile_mode", "--compile_optimizer", "--compile_scope",
                  "--cuda_graphs", "--loss_chunk", "--fp8_head", "--decode_window")


def bench_command(options: list[str], extra: list[str], path: Path) -> list[str]:
    return python("bench.py", *options, *extra, "--keep_going", f"--json={path}")


def bench_flags() -> set[str] | None:
    """The options this checkout's bench.py accepts: the fields of its BenchConfig, read from its source (this
    check imports no torch); None where that cannot be read (then every option is passed as written)."""
    try:
        tree = ast.parse((common.ROOT / "bench.py").read_text())
    except (OSError, SyntaxError):
        return None
    config = next((node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "BenchConfig"), None)
    if config is None:
        return None
    return {node.target.id for node in config.body if isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)}


def accepted(options: list[str], flags: set[str] | None) -> tuple[list[str], list[str]]:
    """`options` split into those bench.py accepts and those it lacks (left out: a checkout older than the
    flag); with flags None, all accepted."""
    def known(option: str) -> bool:
        return flags is None or option.removeprefix("--").split("=", 1)[0] in flags

    return [o for o in options if known(o)], [o for o in options if not known(o)]


def bench_rows(options: list[str]) -> int:
    """How many rows a bench.py command times: one per combination of its variant options' comma lists."""
    return math.prod(len((option(options, name.removeprefix("--")) or "x").split(",")) for name in BENCH_VARIANTS)


def profiled(options: list[str]) -> float:
    """The profiler's seconds per row, where a bench.py run profiles its rows."""
    return h200("profile_s") if "--profile_step=True" in options or "--profile_decode=True" in options else 0.0


def usable(table: tuple[tuple, list[str]]) -> tuple[list[tuple[str, list[str], int]], list[str]]:
    """A bench.py part's runs (`table`: its runs as written, (what, options, extra rows) each, and the options
    they share), each with only the options this bench.py accepts (the last `extra` rows measured if time holds
    them), and the options they share."""
    runs, options = table
    flags = bench_flags()
    kept = []
    for label, extra, optional in runs:
        usable = accepted(extra, flags)[0]
        kept.append((label, usable, min(optional, bench_rows(options + usable) - 1)))
    return kept, options


def lacking(table: tuple[tuple, list[str]]) -> list[str]:
    """The options of a bench.py part's runs that this checkout's bench.py lacks (left out of its commands)."""
    flags = bench_flags()
    return sorted({o.split("=")[0] for _, extra, _ in table[0] for o in accepted(extra, flags)[1]})


def bench_needs(kind: str, runs: list[tuple[str, list[str], int]], options: list[str]) -> list[tuple[str, float]]:
    """What each bench.py run needs on an H200, by its rows (a training row's compile and steps; decode's
    compiled or eager run and each further window), its extra rows (measured if time holds them) left out."""
    needs = []
    for label, extra, optional in runs:
        if kind.startswith("train"):
            needs.append((label, h200("bench_start_s") + (bench_rows(options + extra) - optional)
                          * (h200("bench_row_s") + profiled(extra))))
            continue
        windows = len((option(extra, "decode_window") or "1").split(",")) - optional
        compiled = "--compile=True" in extra
        needs.append((label, h200("decode_compiled_s" if compiled else "decode_eager_s")
                      + (windows - 1) * h200("decode_window_s") + windows * profiled(extra)
                      + ("--hf_reference" in extra) * h200("hf_reference_s")))
    return needs


def needs(kind: str, table: tuple[tuple, list[str]], smoke: bool) -> list[tuple[str, float]]:
    return on_h200(bench_needs(kind, *usable(table)), smoke)


def commands(kind: str, table: tuple[tuple, list[str]]) -> list[str]:
    """--dry_run's lines: each bench.py command (paths in the check's folder as TMP), the rows measured as time
    allows said so, and the options left out."""
    runs, options = usable(table)
    left_out = lacking(table)
    return [shown(bench_command(options, extra, Path("TMP") / f"{kind}_{i}.json"))
            + (f"  (the last {optional} row(s) if time holds them)" if optional else "")
            for i, (_, extra, optional) in enumerate(runs)] + (
        [f"(left out: {', '.join(left_out)}, which this checkout's bench.py lacks)"] if left_out else [])


def part(check: Check, kind: str, table: tuple[tuple, list[str]]) -> dict:
    """A bench.py part: its runs with the options this bench.py has (bench_part)."""
    return bench_part(check, kind, *usable(table), lacking=lacking(table))


def bench_part(check: Check, kind: str, runs: list, options: list[str], lacking: list[str] = ()) -> dict:
    """bench.py once per group of rows (`runs`: (what, options, extra rows)), most wanted first, with --keep_going
    and --json; the rows join the report as each run ends (the JSON rewritten), each with the group's name in
    "run". A run stopped at its limit after all but its extra rows is "stopped" (what it was for is measured).
    A row that failed (which --keep_going reports as a row and bench.py's exit code hides) fails the part, named
    with its reason; `lacking`, the options left out (said in the part's record)."""
    needs = [need for _, need in on_h200(bench_needs(kind, runs, options), check.smoke)]
    done, failed_rows, cut = [], [], []
    for i, (label, extra, optional) in enumerate(runs):
        path = check.tmp / f"{kind}_{i}.json"
        run = check.run(f"{kind}: {label}", bench_command(options, extra, path),
                        limit_s=check.share(needs[i], sum(needs[i + 1:])))
        rows = read_rows(path)
        wanted = bench_rows(options + extra)  # (its rows of the part's kind: a decode run's prefill row aside)
        measured = sum(row.get("kind") == ("train" if kind.startswith("train") else "decode") for row in rows)
        if run is not None and run.status == "timeout" and optional and measured >= wanted - optional:
            run.status = "stopped"  # (its last rows were measured as time allowed)
            cut.append(f"{label}: {measured} of {wanted} rows (the last {optional} as time allowed)")
        done.append(run)
        for row in rows:
            check.report["rows"].append({"run": f"{kind}: {label}", **row})
            if row.get("status") == "failed":
                failed_rows.append(f"{row_name(row)}: {str(row.get('reason'))[:200]}")
        check.write()  # (a check cut short keeps these rows)
    status, reason = outcome(done, [label for label, _, _ in runs])
    if failed_rows:
        rows = f"failed rows: {'; '.join(failed_rows)}"
        status, reason = "failed", rows if reason is None else f"{rows}; {reason}"
    return {"status": status, "reason": reason, "runs": [r.record() for r in done if r], "cut_short": cut,
            "lacking_flags": list(lacking)}


def row_name(row: dict) -> str:
    """A bench.py row in a few words: its kind and model, micro-batch, and what its variant changes."""
    words = [row.get("kind", "?"), str(row.get("model")), f"batch {row.get('batch_size')}"]
    defaults = {"sdpa": "default", "compile_mode": "default", "compile_scope": "model", "compile_optimizer": False,
                "cuda_graphs": False, "fp8_head": False, "decode_window": 1}
    words += [f"{key}={row[key]}" for key, default in defaults.items() if row.get(key, default) != default]
    if row.get("kind") != "train" and "compile" in row:
        words.append("compiled" if row["compile"] else "eager")
    return " ".join(words)

