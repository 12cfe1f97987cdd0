"""The decode part (batch-1 compiled decoding of GPT-2's shape in windows of K tokens a CUDA graph launch, each
row profiled, and the prefill) and decode_more (eager decoding beside transformers' eager generate): bench.py's
decode rows, through benchmarks/gpu_check/bench_runs.py."""

from __future__ import annotations

from benchmarks.gpu_check import bench_runs
from benchmarks.gpu_check.check import Check

# The decode part: batch-1 decoding compiled, in windows of K tokens a CUDA graph (a row each, K=1 the per-token
# step; the last two if time holds them), each row profiled (host and GPU microseconds per token), and the
# 1,000-token prefill. Eager decoding and transformers' eager generate beside it (--hf_reference) are the
# decode_more part (ours was 1.28x transformers' on the H200 of 2026-11-28).
DECODE_RUNS = (("compiled, in windows of 1, 16, 8, 32 tokens, profiled",
                ["--compile=True", "--decode_window=1,16,8,32", "--profile_decode=True"], 2),)
DECODE_MORE_RUNS = (("eager, beside transformers' eager generate", ["--compile=False", "--hf_reference"], 0),)
SMOKE_DECODE_RUNS = (("eager, in windows of 1 and 4 tokens, profiled",
                      ["--compile=False", "--hf_reference", "--decode_window=1,4", "--profile_decode=True"], 0),)


def table(kind: str, smoke: bool) -> tuple[tuple, list[str]]:
    """The decode (or decode_more) part's bench.py runs as written ((what, options, extra rows) each), and the
    options they share (--smoke: one run of the tiny model, eager, for either)."""
    if smoke:
        return SMOKE_DECODE_RUNS, ["--device=cpu", "--models=tiny", "--skip_train", "--skip_nocache",
                                   "--decode_batch=1", "--decode_tokens=16", "--decode_repeats=2", "--prefill_tokens=64"]
    return (DECODE_MORE_RUNS if kind == "decode_more" else DECODE_RUNS,
            ["--device=cuda", "--models=gpt2", "--skip_train", "--skip_nocache", "--decode_batch=1"])


def part_decode(check: Check, args) -> dict:
    return bench_runs.part(check, "decode", table("decode", check.smoke))


def part_decode_more(check: Check, args) -> dict:
    return bench_runs.part(check, "decode_more", table("decode_more", check.smoke))
