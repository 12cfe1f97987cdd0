"""bench.py runs end to end in a tiny mode and reports sane numbers."""

import json
import re

import pytest

import bench
from gptkit.data.shards import write_meta


def test_bench_tiny(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rows = bench.main(["--models=tiny", "--device=cpu", "--warmup=1", "--repeats=2", "--decode_tokens=8",
                       "--decode_repeats=1", "--prefill_tokens=32", "--accum=2", f"--json={out}"])
    kinds = [r["kind"] for r in rows]
    assert kinds.count("train") == 1 and kinds.count("decode") == 4 and kinds.count("prefill") == 1
    train_row = rows[0]
    assert train_row["tokens_per_s"] > 0 and (train_row["batch_size"], train_row["accum"]) == (4, 2)
    assert train_row["mfu"] is None and train_row["seq_len"] == 64
    # the optimizer step's share of the step, and the loss path (the tiny vocabulary: one plain cross-entropy)
    assert train_row["optimizer"] == "adamw" and 0 < train_row["optimizer_ms"] < train_row["ms"]
    assert 0 < train_row["optimizer_share"] < 1 and train_row["loss_slice_rows"] is None
    assert all(r["tokens_per_s"] > 0 for r in rows if r["kind"] == "decode")
    table = capsys.readouterr().out
    assert "tokens/s" in table and "prefill" in table and "n/a" in table
    assert "loss by" in table and "adamw" in table and "optimizer" in table
    saved = json.loads(out.read_text())["rows"]
    assert saved == json.loads(json.dumps(rows))  # every row, as returned
    for r in saved:  # each row says what, how fast, and where, on its own
        assert {"kind", "model", "batch_size", "seq_len", "tokens_per_s", "ms", "mfu", "peak_mem_mb", "device_name",
                "dtype", "torch", "compile"} <= set(r), r
        assert r["dtype"] == "float32" and r["compile"] is False and r["ms"] > 0


def test_each_model_and_batch_is_compiled_afresh_with_static_shapes(monkeypatch):
    """Two models of different sizes in one run, a one-token step and a 3-token window each: each is compiled as
    its own static graph (no recompile, which would make Dynamo's automatic dynamic shapes time a symbolic-shape
    graph for the second model). Checked with a backend that fails on any symbolic size, and error_on_recompile;
    fast, as it generates no code."""
    import torch
    import torch._dynamo

    graphs = []

    def static_only(gm, example_inputs):
        sizes = [s for t in example_inputs if isinstance(t, torch.Tensor) for s in t.shape]
        assert all(isinstance(s, int) for s in sizes), "a dynamic shape"
        assert not any(isinstance(t, torch.SymInt) for t in example_inputs), "a dynamic size"
        graphs.append(gm)
        return gm.forward

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, **kw: real_compile(fn, **kw, backend=static_only))
    monkeypatch.setitem(bench.MODELS, "tiny2", (1, 2, 32, 48, 50, 1))
    with torch._dynamo.config.patch(error_on_recompile=True):
        rows = bench.main(["--models=tiny,tiny2", "--device=cpu", "--compile=True", "--warmup=1", "--repeats=1",
                           "--decode_tokens=6", "--decode_repeats=1", "--prefill_tokens=8", "--skip_nocache",
                           "--decode_window=1,3"])
    torch._dynamo.reset()
    assert [r["compile"] for r in rows if r["kind"] != "prefill"] == [True] * 10 and graphs
    assert [r["decode_window"] for r in rows if r["kind"] == "decode"] == [1, 3] * 4  # (2 models x 2 batches)
    assert all(r["compile_s"] > 0 for r in rows if r["kind"] == "decode")


def test_decode_rows_per_window_with_their_profile(tmp_path):
    """--decode_window: a KV-cache row per K, each saying its K; --profile_decode: every decode row says a step's
    host and kernel microseconds (on the CPU the operators' own time, a part of the step's wall time)."""
    out = tmp_path / "bench.json"
    rows = bench.main(["--models=tiny", "--device=cpu", "--skip_train", "--decode_tokens=6", "--decode_repeats=1",
                       "--decode_batch=2", "--prefill_tokens=8", "--decode_window=1,4", "--profile_decode=True",
                       f"--json={out}"])
    decode = [r for r in rows if r["kind"] == "decode"]
    assert [(r["kv_cache"], r["decode_window"]) for r in decode] == [(True, 1), (True, 4), (False, 1)]
    for r in decode:
        assert r["status"] == "ok" and r["tokens_per_s"] > 0
        assert r["host_us_per_token"] > 0 and r["gpu_us_per_token"] > 0
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows))
    plain = bench.main(["--models=tiny", "--device=cpu", "--skip_train", "--decode_tokens=4", "--decode_repeats=1",
                        "--decode_batch=1", "--prefill_tokens=8", "--skip_nocache"])
    assert [(r["decode_window"], r["host_us_per_token"], r["gpu_us_per_token"]) for r in plain
            if r["kind"] == "decode"] == [(1, None, None)]


def expect_error(args, *fragments):
    with pytest.raises(SystemExit) as e:
        bench.main(["--device=cpu", *args])
    message = e.value.code
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message


def test_bench_refuses_unknown_sizes():
    expect_error(["--models=huge"], "unknown model size")


@pytest.mark.parametrize(
    "option, value",
    [("batch_size", -1), ("accum", 0), ("warmup", -1), ("repeats", 0), ("decode_tokens", -1),
     ("decode_repeats", 0), ("prefill_tokens", 0)],
)
def test_bench_refuses_out_of_range_options(option, value):
    expect_error(["--models=tiny", f"--{option}={value}"], f"--{option}")


def test_bench_data_errors(tmp_path):
    expect_error(["--models=tiny", f"--data={tmp_path / 'nonexistent'}"], "nonexistent", "not found")
    # A GPT-2 BPE dataset: its ids would index past the baby model's 65-row embedding.
    bpe = tmp_path / "bpe"
    bpe.mkdir()
    write_meta(bpe, {"format_version": 1, "tokenizer": {"kind": "tiktoken", "name": "gpt2"}, "vocab_size": 50257,
                     "splits": {}})
    expect_error(["--models=baby", f"--data={bpe}"], "vocab_size 50257", "--models=gpt2")


def test_decode_window_comparison(tiny_model, tiny_config):
    rows = bench.decode_benchmark(tiny_model, tiny_config.block_size + 8, repeats=2)
    assert [r["use_cache"] for r in rows] == [False, False, True, True] and rows[0]["speedup"] == 1.0
    assert all(r["seconds"] > 0 and r["tokens_per_s"] > 0 and len(r["seconds_rounds"]) == 2 for r in rows)
    lines = bench.compare_table(rows).splitlines()
    assert len(lines) == 2 + len(rows) and lines[2].endswith("| 1.00x |")
    assert all(re.search(r"\| \d+\.\d\dx( \(\d+\.\d\d-\d+\.\d\d\))?, (at parity|ahead|behind) \|$", line)
               for line in lines[3:])


def test_the_decoders_speedup_over_nanogpts_is_taken_round_by_round():
    """compare_table: each decoder's seconds as median (range) over the rounds, its speedup over nanoGPT's
    decoder (the first row) from each round's own pair, and the verdict where the ranges meet or not."""
    def row(name, rounds):
        return {"name": name, "seconds_rounds": rounds, "ms_per_token": 1.0, "tokens_per_s": 1.0}

    lines = bench.compare_table([row("no cache", [10.0, 20.0, 12.0]), row("cache", [1.0, 2.5, 1.5]),
                                 row("close", [9.0, 21.0, 12.0])]).splitlines()
    assert lines[2] == "| no cache | 12.00 (10.00-20.00) | 1.00 | 1 | 1.00x |"
    assert lines[3] == "| cache | 1.50 (1.00-2.50) | 1.00 | 1 | 8.00x (8.00-10.00), ahead |"
    assert lines[4] == "| close | 12.00 (9.00-21.00) | 1.00 | 1 | 1.00x (0.95-1.11), at parity |"


def test_training_step_is_timed_as_train_py_runs_it(monkeypatch):
    """train.py checks the NaN/stop flags every step (step.StepGuard: on a GPU without waiting, elsewhere
    before the optimizer step); the benchmarked step must too, or its tokens/s would not be a run's."""
    from gptkit.step import StepGuard

    calls = []
    real = StepGuard.check
    monkeypatch.setattr(StepGuard, "check", lambda self, *a: calls.append(1) or real(self, *a))
    bench.main(["--models=tiny", "--device=cpu", "--warmup=1", "--repeats=2", "--skip_decode"])
    assert len(calls) == 3


def test_training_rows_synchronise_once_per_window(monkeypatch):
    """A row's steps are train.py's step itself (gptkit/step.py's TrainStep, one call a step), timed as one window:
    the device is synchronised after the first step (its time, compilation included), then once before the
    window and once after it, never per step, whatever the window's length; the optimizer's share is still
    measured (host clock on the CPU, CUDA events on a GPU: no synchronisation)."""
    from gptkit.runtime import Runtime
    from gptkit.step import TrainStep

    syncs, steps = [], []
    real_sync, real_call = Runtime.synchronize, TrainStep.__call__
    monkeypatch.setattr(Runtime, "synchronize", lambda self: syncs.append(1) or real_sync(self))
    monkeypatch.setattr(TrainStep, "__call__", lambda self, *a, **k: steps.append(1) or real_call(self, *a, **k))
    for repeats in (2, 5):
        syncs.clear()
        steps.clear()
        rows = bench.main(["--models=tiny", "--device=cpu", "--warmup=2", f"--repeats={repeats}", "--skip_decode"])
        assert (len(steps), len(syncs)) == (2 + repeats, 3)
        assert 0 < rows[0]["optimizer_share"] < 1


def test_loss_slice_sizes_give_one_row_each(monkeypatch):
    """--loss_chunk: the same step with the loss plain and in slices of the given logit elements, and the
    model's own setting restored afterwards."""
    import model

    before = dict(model.LOSS_CHUNK_ELEMENTS)
    slices = []
    real_apply = model._ChunkedLinearCrossEntropy.apply
    monkeypatch.setattr(model._ChunkedLinearCrossEntropy, "apply",
                        lambda *a: slices.append(a[3]) or real_apply(*a))  # a[3]: rows per slice
    rows = bench.main(["--models=tiny", "--device=cpu", "--warmup=0", "--repeats=1", "--skip_decode",
                       "--loss_chunk=plain,2**12,default"])
    assert [r["loss_slice_rows"] for r in rows] == [None, 32, None]  # 4096 // 65 -> 32 rows; default: plain
    assert slices == [32]  # only the 2**12 row took the sliced path, with its 32-row slices
    assert model.LOSS_CHUNK_ELEMENTS == before
    expect_error(["--models=tiny", "--loss_chunk=plain,lots"], "--loss_chunk", "'lots'")


def test_optimizer_share_for_muon(monkeypatch):
    """The modern recipe's Muon step (many small kernels per matrix on a GPU): its share of the step is
    reported, here for a tiny modern model standing in for --models=modern."""
    from model import GPT, GPTConfig

    def tiny_modern(name, rt):
        return GPT(GPTConfig(block_size=32, vocab_size=65, n_layer=2, n_head=2, n_embd=32, arch="modern"))

    monkeypatch.setattr(bench, "build", tiny_modern)
    (row,) = bench.main(["--models=tiny", "--device=cpu", "--warmup=1", "--repeats=2", "--skip_decode"])
    assert row["optimizer"] == "muon" and 0 < row["optimizer_share"] < 1


def test_nobias_names_the_same_shape_without_biases():
    """gpt2nobias is nanoGPT bench.py's model (bias=False): GPT-2's shape, no bias in any Linear or LayerNorm."""
    from gptkit.runtime import setup_runtime

    rt = setup_runtime("cpu")
    with_bias, without = bench.build("tiny", rt), bench.build("tinynobias", rt)
    assert without.config.bias is False and with_bias.config.bias is True
    assert [m.config.n_embd for m in (with_bias, without)] == [64, 64]
    assert not any(name.endswith(".bias") for name, _ in without.named_parameters())
    assert "gpt2nobias" in bench.model_names() and "babynobias" not in bench.model_names()  # baby has none
    expect_error(["--models=tinynobiasx"], "unknown model size", "gpt2nobias")


def test_variants_give_one_row_per_combination(tmp_path, capsys):
    """A comma list per variant option: one training row per combination, in product order, each carrying its
    values; an attention kernel this device lacks is a skipped row with torch's reason, not a crash. The JSON
    holds every row."""
    out = tmp_path / "rows.json"
    rows = bench.main(["--models=tiny", "--device=cpu", "--warmup=0", "--repeats=1", "--skip_decode",
                       "--batch_size=2,3", "--sdpa=default,cudnn", f"--json={out}"])
    assert [(r["batch_size"], r["sdpa"]) for r in rows] == [(2, "default"), (2, "cudnn"), (3, "default"), (3, "cudnn")]
    assert all(r["compile_mode"] == "default" and r["compile_optimizer"] is False for r in rows)
    ok, skipped = rows[0::2], rows[1::2]
    assert all(r["status"] == "ok" and r["reason"] is None and r["ms"] > 0 and r["flops_per_token"] > 0 for r in ok)
    for r in skipped:
        assert r["status"] == "skipped" and "--sdpa=cudnn" in r["reason"] and r["ms"] is None
        assert set(r) == set(ok[0]), "a skipped row has the same fields"
    table = capsys.readouterr().out
    assert "sdpa cudnn, skipped: --sdpa=cudnn cannot run" in table and "variant" in table
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows))


def test_the_optimizer_step_can_be_compiled(monkeypatch):
    """--compile_optimizer=True runs optimizer.step through torch.compile (here a backend that records the graphs
    and runs them as they are: fast); the model itself stays eager on the CPU, so every graph is the step's."""
    import torch

    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, **kw: real_compile(fn, **kw, backend=recording))
    rows = bench.main(["--models=tiny", "--device=cpu", "--warmup=1", "--repeats=1", "--skip_decode",
                       "--compile_optimizer=False,True"])
    torch._dynamo.reset()
    assert [r["compile_optimizer"] for r in rows] == [False, True] and [r["compile"] for r in rows] == [False] * 2
    assert graphs and all(r["status"] == "ok" for r in rows)


def test_variant_options_are_checked():
    expect_error(["--models=tiny", "--sdpa=default,fast"], "sdpa must be one of", "'fast'", "flash")
    expect_error(["--models=tiny", "--compile_optimizer=maybe"], "compile_optimizer expects a comma-separated list")
    expect_error(["--models=tiny", "--batch_size=4,x"], "batch_size expects a comma-separated list of int")
    expect_error(["--models=tiny", "--decode_batch=0"], "--decode_batch must be >= 1")
    # a compile mode with nothing compiled (compile is off on the CPU unless asked for) would time nothing new
    expect_error(["--models=tiny", "--compile_mode=reduce-overhead"], "--compile_mode", "--compile=True")


def test_keep_going_records_a_failed_row_and_goes_on(monkeypatch, tmp_path):
    """--keep_going: a row that raises is a failed row with the error (the traceback on stderr), and the rows
    after it are measured; without it the error ends the run, but the JSON keeps the rows measured before."""
    real_build = bench.build

    def build(name, rt):
        if name == "tinynobias":
            raise RuntimeError("boom\nsecond line")
        return real_build(name, rt)

    monkeypatch.setattr(bench, "build", build)
    args = ["--models=tinynobias,tiny", "--device=cpu", "--warmup=0", "--repeats=1", "--decode_tokens=4",
            "--decode_repeats=1", "--prefill_tokens=8", "--decode_batch=1", "--skip_nocache"]
    rows = bench.main([*args, "--keep_going"])
    assert [(r["kind"], r["model"], r["status"]) for r in rows] == [
        ("train", "tinynobias", "failed"), ("decode", "tinynobias", "failed"), ("train", "tiny", "ok"),
        ("decode", "tiny", "ok"), ("prefill", "tiny", "ok")]
    assert rows[0]["reason"] == "RuntimeError: boom second line" and rows[0]["tokens_per_s"] is None
    out = tmp_path / "partial.json"
    with pytest.raises(RuntimeError, match="boom"):
        bench.main(["--models=tiny,tinynobias", *args[1:], f"--json={out}"])
    assert [r["model"] for r in json.loads(out.read_text())["rows"]] == ["tiny"] * 3


def test_decode_rows_stop_repeating_at_their_time_budget(tiny_model):
    """--row_budget_s: no new timed run once a row's runs add up to the budget (at least one runs)."""
    assert len(bench.time_decode(tiny_model, 4, repeats=5, budget_s=1e-9)) == 1
    assert len(bench.time_decode(tiny_model, 4, repeats=3)) == 3
