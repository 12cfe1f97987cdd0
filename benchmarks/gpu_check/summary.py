"""The summary: the figures BENCHMARKS.md's GPU targets ask for, read from the report's rows and parts, each with
its target and whether it was met, and the readings that tell whether the device gave its best; rewritten into
the JSON with every snapshot, and printed at the end."""

from __future__ import annotations

from benchmarks.gpu_check.common import NOT_ASKED
from benchmarks.gpu_check.figures import H200

# BENCHMARKS.md's GPU targets (vs_nanogpt: x nanoGPT's bench.py tokens/s, measured in the same call).
TARGETS = {"vs_nanogpt": 1.15, "tokens_per_s": {"H200": 600_000, "H100": 550_000}, "decode_tokens_per_s": 4000,
           "prefill_ms": 10.0, "plan_error": 0.20, "shakespeare_s": 30.0, "small_step_ms": 4.0}


def add_measured_mfu(report: dict) -> None:
    """Each row's MFU against the measured dense peak (the peak part's), beside bench.py's datasheet one."""
    peak = (report["device"].get("peak") or {}).get("tflops_measured")
    for row in report["rows"]:
        ok = peak and row.get("flops_per_token") and row.get("tokens_per_s")
        row["mfu_measured_peak"] = row["flops_per_token"] * row["tokens_per_s"] / (peak * 1e12) if ok else None


def figure(value, target, met) -> dict:
    return {"value": value, "target": target, "met": met if value is not None else None}


def bench_variant(row: dict) -> dict:
    """A bench.py training row's variant: what the summary says it measured."""
    return {k: row.get(k) for k in ("model", "batch_size", "sdpa", "compile_mode", "compile_optimizer",
                                    "compile_scope", "cuda_graphs", "fp8_head", "loss_slice_rows")}


def peak_figure(peak: dict | None) -> dict:
    """A matmul peak of the device part: TFLOP/s beside the datasheet's, with NVML's readings taken during it."""
    peak = peak or {}
    value = peak.get("tflops_measured")
    return figure(value, peak.get("tflops_datasheet"), None) | {
        "shape": peak.get("shape"), "clocks": peak.get("clocks"),
        "line": peak.get("clocks_line") and f"during it: {peak['clocks_line']}"}


def decode_summary(rows: list[dict]) -> dict:
    """Batch-1 compiled decoding: the best window's tokens/s against the target, every window's, and K=1's host
    and GPU microseconds per token (--profile_decode)."""
    compiled = [r for r in rows if r["kind"] == "decode" and r["compile"] and r["batch_size"] == 1]
    best = max(compiled, key=lambda r: r["tokens_per_s"], default=None)
    by_window = {str(r.get("decode_window", 1)): r["tokens_per_s"] for r in compiled}
    k1 = next((r for r in compiled if r.get("decode_window", 1) == 1), None) or {}
    target = TARGETS["decode_tokens_per_s"]
    return figure(best and best["tokens_per_s"], target, best and best["tokens_per_s"] >= target) | {
        "decode_window": best and best.get("decode_window", 1), "by_window": by_window,
        "compile_s": k1.get("compile_s"), "k1_host_us_per_token": k1.get("host_us_per_token"),
        "k1_gpu_us_per_token": k1.get("gpu_us_per_token"),
        "note": "the best decode window (K tokens a CUDA graph launch); K=1's host and GPU microseconds a token"}


def shakespeare_summary(report: dict) -> dict:
    """configs/shakespeare.py to the val loss from the process start: the graphed run, the plain one where it
    ran, train.py's start-up trace, and nanoGPT's: from nanogpt_train where it ran, else its recorded figure."""
    part = report["parts"].get("shakespeare", {})
    shakespeare, plain = part.get("reached"), (part.get("plain") or {})
    nanogpt = report["parts"].get("nanogpt_train", {})
    nanogpt_train = nanogpt.get("train") or {}
    nanogpt_val = nanogpt_train.get("reached") or nanogpt_train.get("best")
    recorded = H200["nanogpt_to_val_s"]
    if nanogpt_val is None and (not nanogpt or nanogpt.get("reason") == NOT_ASKED):
        nanogpt_val = {"wall_s": recorded.value, "val_loss": 1.4696, "step": 1750, "recorded": recorded.where}
        note = ("seconds from train.py's process start; nanogpt: its train_shakespeare_char's, recorded (not run: "
                "--parts=nanogpt_train runs it)")
    else:
        note = nanogpt_note(nanogpt, "train") or ("seconds from train.py's process start; nanogpt: its "
                                                  "train_shakespeare_char in this call, the first val at or below "
                                                  "the threshold (else its best), with the wall seconds from its start")
    value = shakespeare and shakespeare["elapsed_s"]
    plain_reached = plain.get("reached") or {}
    return figure(value, TARGETS["shakespeare_s"], shakespeare and value <= TARGETS["shakespeare_s"]) | {
        "val_loss": shakespeare and shakespeare["val_loss"], "step": shakespeare and shakespeare["step"],
        "wall_s": shakespeare and shakespeare["wall_s"], "start": part.get("start"),
        "plain_elapsed_s": plain_reached.get("elapsed_s"), "plain_step": plain_reached.get("step"),
        "plain_start": plain.get("start"), "plain_note": plain.get("skipped"), "nanogpt": nanogpt_val,
        "note": note}


def summarise(report: dict, smoke: bool) -> dict:
    """The figures BENCHMARKS.md's GPU targets ask for, each with its target and whether it was met, and the
    readings that tell whether the device gave its best."""
    rows = [r for r in report["rows"] if r.get("status") == "ok"]
    train = [r for r in rows if r["kind"] == "train"]
    nobias = "tinynobias" if smoke else "gpt2nobias"
    at_12 = [r for r in train if r["model"] == nobias and r["batch_size"] == (2 if smoke else 12)]
    best_12 = min(at_12, key=lambda r: r["ms"], default=None)
    default_12 = next((r for r in at_12 if r.get("profile") and not r.get("fp8_head")), None)  # (the bf16 head's)
    best = max((r for r in train if r["model"] in (nobias, nobias.removesuffix("nobias"))),
               key=lambda r: r["tokens_per_s"], default=None)
    name = report["device"].get("name") or ""
    floor = next((v for k, v in TARGETS["tokens_per_s"].items() if k in name), None)
    decode = [r for r in rows if r["kind"] == "decode" and r["compile"] and r["batch_size"] == 1]
    reference = [r for r in rows if r["kind"] == "decode" and r.get("model", "").endswith("(transformers)")]
    eager = [r for r in rows if r["kind"] == "decode" and not r["compile"] and r["batch_size"] == 1
             and r.get("kv_cache", True) and r not in reference]
    vs_hf = (max(r["tokens_per_s"] for r in eager) / reference[0]["tokens_per_s"]) if eager and reference else None
    # sample.py --compile=auto's threshold (gptkit/generate.py's DECODE_COMPILE_COST): the compile time, and the
    # milliseconds the compiled step saves per token; it compiles from compile_s / saved tokens on.
    k1 = [r for r in decode if r.get("decode_window", 1) == 1]
    saved_ms = (min(r["ms"] for r in eager) - min(r["ms"] for r in k1)) if k1 and eager else None
    compile_s = k1[0].get("compile_s") if k1 else None
    prefill = [r for r in rows if r["kind"] == "prefill"]
    plan = report["parts"].get("plan", {}).get("rows") or []
    steps_part = report["parts"].get("steps", {})
    steps = {s["run"]: s for s in steps_part.get("steps") or [] if "ms_per_step" in s}
    late = [(s["late_ms"], s["late_over_early"]) for s in steps.values() if s.get("late_ms") is not None]
    best_late = min(late, default=None)
    window = (steps_part.get("windows") or {}).get("late")
    nanogpt = report["parts"].get("nanogpt", {})
    nanogpt_ms = (nanogpt.get("bench") or {}).get("ms")
    nanogpt_iter = ((report["parts"].get("nanogpt_train") or {}).get("train") or {}).get("iter_ms_median")
    readings = report.get("readings") or {}
    tests = report["parts"].get("tests") or {}
    counts = tests.get("counts") or {}

    speedup = nanogpt_ms / best_12["ms"] if best_12 and nanogpt_ms else None
    summary = {
        "gpu_readings": figure(None, None, None) | {"line": readings.get("line"), "start": readings.get("start")},
        "matmul_peak_8192_tflops": peak_figure((report["device"].get("peaks") or [None])[0]),
        "matmul_gpt2_mlp_tflops": peak_figure((report["device"].get("peaks") or [None, None])[-1]),
        "train_12x1024_no_bias": figure(speedup, TARGETS["vs_nanogpt"], speedup and speedup >= TARGETS["vs_nanogpt"])
        | {"ms": best_12 and best_12["ms"], "nanogpt_ms": nanogpt_ms, "variant": best_12 and bench_variant(best_12),
           "tokens_per_s": best_12 and best_12["tokens_per_s"], "profile": best_12 and best_12.get("profile"),
           "profile_default": default_12 and default_12.get("profile"),
           "rows": [{**bench_variant(r), "ms": r["ms"], "vs_nanogpt": nanogpt_ms / r["ms"] if nanogpt_ms else None}
                    for r in at_12],
           "note": nanogpt_note(nanogpt, "bench") or "the best row at 12 x 1024: x nanoGPT's bench.py tokens/s, run "
                                                     "in this call on this device"},
        "train_best_tokens_per_s": figure(best and best["tokens_per_s"], floor,
                                          floor and best and best["tokens_per_s"] >= floor)
        | {"variant": best and bench_variant(best), "mfu_datasheet": best and best["mfu"],
           "mfu_measured_peak": best and best.get("mfu_measured_peak"),
           "at_12_tokens_per_s": best_12 and best_12["tokens_per_s"],
           "note": "the best micro-batch that fits, beside the best row at 12 x 1024 (at_12_tokens_per_s)"},
        "decode_compiled_batch1_tokens_per_s": decode_summary(rows),
        "decode_eager_vs_transformers": figure(vs_hf, 1.0, vs_hf and vs_hf >= 1.0)
        | {"note": "our eager batch-1 decode's tokens/s over transformers' eager generate, same shape and dtype"
                   + ("" if reference else "; not measured: the default run leaves it to --parts=decode_more "
                      "(1.28 on the H200 of 2026-11-28)")},
        "decode_compile_cost": figure(
            round(compile_s / (saved_ms / 1000)) if compile_s and saved_ms and saved_ms > 0 else None, None, None)
        | {"compile_s": compile_s, "saved_ms_per_token": saved_ms,
           "note": "value: the tokens from which compiling pays; (compile_s, saved_ms_per_token) is "
                   "gptkit/generate.py's DECODE_COMPILE_COST['cuda'] (needs the eager rows: --parts=decode_more)"},
        "prefill_ms": figure(min((r["ms"] for r in prefill), default=None), TARGETS["prefill_ms"],
                             any(r["ms"] < TARGETS["prefill_ms"] for r in prefill))
        | {"prompt_tokens": prefill[0]["seq_len"] if prefill else None},
        "shakespeare_s_to_val": shakespeare_summary(report),
        "shakespeare_ms_per_step_late": figure(best_late and best_late[0], TARGETS["small_step_ms"],
                                               best_late and best_late[0] <= TARGETS["small_step_ms"])
        | {"late_over_early": best_late and best_late[1], "runs": steps, "window": window,
           "nanogpt_iter_ms": nanogpt_iter,
           "note": "ms/step over the late window (steps window[0]-window[1], the last that both runs reached), "
                   "the fastest way (the steps part, --parts=steps); flat: late_over_early <= 1.1; nanogpt_iter_ms: "
                   "the median of its iter lines (--parts=nanogpt_train)"},
        "cuda_tests_passed": figure(counts.get("passed") if counts else None, None,
                                    None if not counts else not (counts.get("failed") or counts.get("error")))
        | {"counts": counts, "not_run": tests.get("not_run")},
    }
    if "plan" in report["parts"] and report["parts"]["plan"]["status"] != "skipped":
        summary["plan_worst_error"] = figure(max((abs(r["error"]) for r in plan), default=None), TARGETS["plan_error"],
                                             bool(plan) and all(abs(r["error"]) <= TARGETS["plan_error"] for r in plan))
    return summary


def print_summary(report: dict) -> None:
    print("\nparts:")
    for name, part in report["parts"].items():
        print(f"  {name:<14}{part['status']:<9}{part['seconds']:>6.0f} s  {part['reason'] or ''}")
    print("summary:")
    for name, entry in report["summary"].items():
        if not isinstance(entry, dict) or "value" not in entry:
            print(f"  {name:<38}{entry}")
            continue
        value = entry["value"]
        shown = "" if value is None and entry.get("line") else "n/a" if value is None else (
            f"{value:,.0f}" if value >= 100 else f"{value:.3g}")
        met = {True: "met", False: "NOT met", None: ""}[entry["met"]]
        target = "" if entry["target"] is None else f" (target {entry['target']:,})"
        print(f"  {name:<38}{shown:>12}{target} {met}")
        if entry.get("line"):
            print(f"  {'':<38}{entry['line']}")


def nanogpt_note(part: dict, key: str) -> str | None:
    """Why the summary has no nanoGPT figure from its `key` run ("bench" or "train"), in one line: "no anchor:
    ..." where nanoGPT was not run, "nanoGPT failed: ..." with its last lines where it ran (or its preparation)
    and gave none; None where it gave one."""
    record = part.get(key) or {}
    if record.get("ms") or record.get("reached") or record.get("best"):
        return None
    if not part or part.get("status") == "skipped":
        return "no anchor: " + ((part or {}).get("reason") or "nanoGPT was not run").removeprefix("no anchor: ")
    if "skipped" in record:
        return "no anchor: " + record["skipped"]
    label = {"bench": "bench.py", "train": "train_shakespeare_char"}[key]
    ran = next((r for r in part.get("runs", []) if r["command"] == record.get("command")), None)
    failed = ran if ran and ran.get("last_lines") else next((r for r in part.get("runs", []) if r.get("last_lines")),
                                                            None)
    if failed is not None:
        how = f"{failed['label']} {failed['status']} (exit code {failed['returncode']}, {failed['seconds']:.0f} s)"
        return f"nanoGPT failed: {how}; its last lines: " + " | ".join(failed["last_lines"])
    if ran is not None:
        return f"nanoGPT failed: its {label} gave no figure ({ran['status']}; see the log)"
    return f"nanoGPT failed: its {label} did not run ({part.get('reason') or record.get('status') or 'see the log'})"
