"""What the parts' commands take on an H200, in one table (H200): each figure with where it was read, or why it
is an estimate. Each part adds up the figures for the very commands it runs (its `run_needs`), and the default budgets
hold NEED_MARGIN x what the default parts need (benchmarks/gpu_check/budgets.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Figure:
    value: float
    where: str  # which run's files it was read from (11-26: ../shared/gpu/2026-11-26/; 11-28: benchmarks/gpu/...)


# What the parts' commands take on an H200, in one table: each figure the slower of the two H200 runs, of
# 2026-11-26 (../shared/gpu/2026-11-26/: gpu_check.log, gpu_check.json, README.md) and of 2026-11-28
# (benchmarks/gpu/2026-11-28/: gpu_check.log and .json, the default run; rerun.log, a second call), or, where no
# run has measured it, estimated, and said so. The second machine's host was slower: Python's and CUDA's start,
# compiles and every launch-bound step took 1.3-2x the first's (nanoGPT's iter lines 15-17 ms against 8), and
# three parts ran out of budgets made from the first run alone. run_needs() adds the figures up for each run of
# a part, from the very commands the part runs (start + compile + steps x ms per step); the default budgets hold
# NEED_MARGIN x what the default parts need (tests/test_gpu_check.py fails where one does not), so that a change
# to a part cannot silently starve it.
H200 = {
    "torch_start_s": Figure(9.0, "11-28 gpu_check.log, device: a python with torch, CUDA's start and the matmul "
                                 "peak, 10.0 s, less the peak's 1 s of warm-up (11-26: 4.5 s in all)"),
    "pytest_start_s": Figure(6.5, "11-28 gpu_check.log, CUDA tests, the others: 42.0 s, pytest's own count 36.0 s"),
    "train_start_s": Figure(13.3, "11-28 rerun.log: train.py's config printed 13.3 s after its start (11-26: ~10.4 s "
                                  "to its clock's start)"),
    "train_eval_compile_s": Figure(19.0, "11-28 gpu_check.json, shakespeare: the step-0 evaluation done 29.1 s into "
                                         "train.py's clock, ~32.5 s after its start, less the start (11-26: 10.3 s)"),
    "train_compile_s": Figure(20.3, "11-28 gpu_check.json, shakespeare: the step-250 evaluation at 53.9 s = 29.1 s + "
                                    "250 steps x ~13.5 ms + one evaluation (1.2 s) + the step's compile (11-26: "
                                    "13.5 s; 11-28 rerun.log, graphed: 16.1 s)"),
    "train_compiles_warm_s": Figure(10.5, "11-28 gpu_check.log, steps: 32.0 s for 1,500 graphed steps and 40.5 s for "
                                          "1,500 plain ones, after the shakespeare part: start + both compiles (from "
                                          "inductor's cache, warm from that part's run of the same model) + steps"),
    "train_eval_s": Figure(1.2, "11-28 gpu_check.json, shakespeare: evaluations 4.6 s apart, 250 steps (~3.4 s) "
                                "and one evaluation of 200 batches (11-26: 0.8 s)"),
    "train_ms": Figure(14.0, "11-28 gpu_check.log, shakespeare: configs/shakespeare.py's ms/step as train.py runs "
                             "it, 12.6-16.7 (steps part 10.9-13.2; 11-26: 9-12.6)"),
    "train_graphed_ms": Figure(5.5, "11-28 gpu_check.log, steps: --cuda_graphs=True, 5.8 ms/step over steps 1-100 "
                                    "(warm-up and capture), 5.30-5.32 from then on; rerun.log 5.4-5.5"),
    "train_val_step": Figure(1750, "the first val <= 1.47: at step 1,500 on 11-26 (1.4673); nanoGPT's at 1,750 on "
                                   "11-28 (1.4777 at 1,500), and ours matched its val at steps 250 and 500"),
    "prepare_s": Figure(1.0, "gpu_check.log: prepare/shakespeare_char.py, 1.0 s (both runs)"),
    "bench_start_s": Figure(13.3, "as train_start_s (bench.py's imports and CUDA's start; 11-26: 9.5 s)"),
    "bench_row_s": Figure(31.0, "11-28 gpu_check.log, train: two gpt2nobias rows in one bench.py, 75.0 s, less the "
                                "start: a row's compile (~20 s) and its timed steps (11-26: 26 s)"),
    "decode_eager_s": Figure(28.0, "estimate: the compiled run (41.0 s on 11-28) less its compile (15.8 s), with 200 "
                                   "eager tokens (6.25 ms each) for 200 compiled (1.22 ms); with transformers' "
                                   "reference it took 47.0-47.5 s"),
    "decode_compiled_s": Figure(41.0, "11-28 gpu_check.log, decode: compiled (its compile 15.8 s), 41.0 s (11-26: "
                                      "27 s)"),
    "hf_reference_s": Figure(19.5, "11-28 gpu_check.log, decode: the eager run with transformers' eager generate "
                                   "beside it, 47.0-47.5 s, less decode_eager_s"),
    "decode_window_s": Figure(19.0, "estimate: each further decode window (K tokens a graph), compiled afresh as "
                                    "bench.py compiles every row (15.8 s on 11-28) and timed (~3 s)"),
    "profile_s": Figure(3.0, "estimate: torch.profiler over a few timed steps or tokens, and its table, per row"),
    "plan_s": Figure(37.5, "11-26 gpu_check.log, memory plan: 37.5 s"),
    "readings_s": Figure(1.0, "estimate: NVML's readings through nvidia-smi, three queries of ~0.1-0.3 s at the "
                              "start (pynvml's take milliseconds)"),
    "graph_tests_s": Figure(64.0, "11-28 gpu_check.log: tests/test_cudagraph_cuda.py's five tests, 54.4 s by "
                                  "pytest's count, ~4 s for the eager pair with dropout since added, and ~5 s "
                                  "(estimate) for the compiled dropout captured alone, since added"),
    "decode_window_tests_s": Figure(55.0, "estimate: tests/test_decode_window.py's two CUDA tests, each compiling "
                                          "(mode reduce-overhead) a tiny model's step and window for two samplings, "
                                          "or the engine's buckets: ~2x test_generate's decode graph test (19 s)"),
    "fp8_tests_s": Figure(30.0, "estimate: tests/test_fp8.py's two CUDA tests, 150 training steps of a small GPT "
                                "and one compile (fullgraph)"),
    "generate_loader_tests_s": Figure(19.0, "11-26 gpu_check.log, CUDA tests: test_generate's decode graph and "
                                            "test_loader's batches, 25.5 s, less pytest's start"),
    "engine_tests_s": Figure(10.0, "11-28 gpu_check.log: test_engine's, test_prefix_cache's, test_generate's and "
                                   "test_loader's CUDA tests, 36.0 s together; the rest after the 19 s above, split"),
    "prefix_tests_s": Figure(7.0, "as engine_tests_s: test_prefix_cache's graphed buckets with reuse, inductor's "
                                  "cache warm from test_engine"),
    "other_test_file_s": Figure(20.0, "estimate: a file of CUDA tests not named above"),
    "nanogpt_prepare_s": Figure(2.0, "estimate: its prepare.py on the 1.1M characters (1.0 s on both machines)"),
    "nanogpt_bench_s": Figure(49.0, "11-28 gpu_check.log: its bench.py, 48.5 s (26.68 ms/iter; 11-26: 26.35)"),
    "nanogpt_to_val_s": Figure(94.7, "11-28 rerun.log: its train_shakespeare_char's val 1.4696 at step 1,750, 94.7 s "
                                     "from its start (1.4777 at step 1,500, 87.9 s; 11-26: ~54 s on the faster host)"),
    "nanogpt_start_s": Figure(37.0, "11-28 gpu_check.json, nanogpt: its step-0 evaluation 37.0 s after its start "
                                    "(rerun.log 30.3 s; 11-26: ~19 s)"),
    "nanogpt_compile_s": Figure(20.6, "11-28 gpu_check.json, nanogpt: its step-250 evaluation at 64.6 s = 37.0 s + "
                                      "250 x 17.2 ms + an evaluation (2.7 s) + the training step's compile"),
    "nanogpt_ms": Figure(17.2, "11-28 gpu_check.json, nanogpt: the median of its iter lines (rerun.log 15.2; "
                               "11-26: ~8.0)"),
    "nanogpt_eval_s": Figure(2.7, "11-28 gpu_check.json, nanogpt: evaluations 7.0 s apart, 250 iterations (4.3 s) "
                                  "and one evaluation (11-26: ~1.6 s)"),
    "nanogpt_eval_interval": Figure(250, "nanoGPT's config/train_shakespeare_char.py: eval_interval = 250"),
    "serve_s": Figure(150.0, "estimate: GPT-2's shape compiles 6 buckets at ~12 s each before its load, then 8 s for "
                             "each of 3 client levels, eager and compiled"),
}


def h200(name: str) -> float:
    return H200[name].value


def on_h200(needs: list[tuple[str, float]], smoke: bool) -> list[tuple[str, float]]:
    """A part's runs' needs as given on an H200; each 0 in --smoke (the CPU rehearsal's runs share their part's
    time as they come)."""
    return [(label, 0.0 if smoke else seconds) for label, seconds in needs]
