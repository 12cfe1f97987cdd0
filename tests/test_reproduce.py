"""benchmarks/reproduce.py: the README's headline comparisons rerun, quoted against measured. A rehearsal at a
tiny scale (the time-to-loss part on 1-layer models; the parts whose other system is missing skip with their
one line), and the check that flags a quoted figure outside the measured range. The claims' text in the README
and BENCHMARKS.md: tests/test_readme_claims.py."""

import pytest

from benchmarks import reproduce

TINY = "--n_layer=1 --n_head=1 --n_embd=16 --max_iters=6 --eval_interval=3 --eval_iters=1"


def test_a_quick_rehearsal_prints_quoted_against_measured_and_skips_what_is_missing(tmp_path, monkeypatch,
                                                                                     capsys, shakespeare_path):
    monkeypatch.setattr(reproduce, "llama_cpp_installed", lambda: False)
    measured = reproduce.main(["--quick", f"--llama_server={tmp_path / 'none'}", f"--nanogpt={tmp_path / 'none'}",
                               f"--train_args={TINY}", f"--out={tmp_path / 'work'}"])
    out = capsys.readouterr().out
    table = out[out.index("| comparison |"):]
    assert table.splitlines()[0] == ("| comparison | quoted (measured on) | measured here: median (range) | verdict "
                                     "| check |")
    # The loss part ran (one pair of 6-step runs: the targets are far off) and says so against the quote.
    assert [m.claim.key for m in measured] == ["loss-1.80", "loss-1.65"]
    rows = [line for line in table.splitlines() if line.startswith("| modern recipe")]
    assert len(rows) == 2 and "| 0.33-0.36x (a 2-core VM shared with other jobs, preliminary) |" in rows[0] and rows[0].endswith(
        "| not reached | - | OUTSIDE |")
    # The others: one line each, saying how to get what is missing.
    skipped = [line for line in table.splitlines() if line.startswith("skipped: ")]
    assert len(skipped) == 3
    assert 'llama-cpp-python is not installed (pip install -e ".[llama]")' in skipped[0]
    assert "bash benchmarks/llama_server.sh builds it" in skipped[1] and "--nanogpt PATH" in skipped[2]


def test_a_quote_is_flagged_only_where_the_measured_range_misses_it():
    # serve-16 quotes 0.91-1.01x: measured 0.95x (0.90-1.05) meets it; the servers' ranges overlap.
    cell, word, flag = reproduce.check(reproduce.measured("serve-16", [95.0, 90.0, 105.0], [100.0] * 3))
    assert (cell, word, flag) == ("0.95x (0.90-1.05)", "at parity", "ok")
    # Measured 1.20x (1.15-1.30): above the quoted range, and ahead.
    assert reproduce.check(reproduce.measured("serve-16", [120.0, 115.0, 130.0], [100.0, 100.0, 100.0])) == (
        "1.20x (1.15-1.30)", "ahead", "OUTSIDE")
    # A one-figure quote (4 clients: 1.43x) inside a measured range, and outside it.
    assert reproduce.check(reproduce.measured("serve-4", [140.0, 150.0], [100.0, 100.0]))[2] == "ok"
    assert reproduce.check(reproduce.measured("serve-4", [100.0, 110.0], [100.0, 100.0]))[2] == "OUTSIDE"
    text = reproduce.report([reproduce.measured("serve-16", [95.0, 90.0, 105.0], [100.0] * 3)], ["serving: why"])
    assert "| 0.91-1.01x (a quiet 2-core VM (AMD EPYC)) | 0.95x (0.90-1.05) | at parity | ok |" in text
    assert text.splitlines()[-1] == "skipped: serving: why"


def test_every_claim_is_one_of_the_parts_and_a_range_in_order():
    keys = [c.key for c in reproduce.CLAIMS]
    assert len(set(keys)) == len(keys)
    assert all(c.part in reproduce.PARTS and 0 < c.low <= c.high for c in reproduce.CLAIMS)


def test_a_bad_part_is_a_one_line_error():
    with pytest.raises(SystemExit, match="--parts 'fast'"):
        reproduce.main(["--parts=fast"])


def test_each_part_reads_its_benchmarks_json_into_per_round_ratios(monkeypatch, tmp_path):
    """What the parts make of the JSON their benchmark writes (cpu_decode.py, serve_load.py and
    train_threads.py's --json, as those scripts write it): each claim's ratios paired by round."""
    written = {
        "cpu_decode.py": [{"engine": "gptkit AVX2", "weights": "packed float32 (the default)", "decodes": [50, 60]},
                          {"engine": "gptkit AVX2", "weights": "packed int8", "decodes": [90, 80]},
                          {"engine": "llama.cpp installed", "weights": "f32", "decodes": [40, 60]},
                          {"engine": "llama.cpp installed", "weights": "q8_0", "decodes": [100, 100]}],
        "serve_load.py": [{"server": "auto", "tokens_per_s": {"1": [100, 120], "4": [200, 210], "16": [300, 310],
                                                               "64": [330, 300]}},
                          {"server": "llama-server q8_0", "tokens_per_s": {"1": [50, 60], "4": [190, 200],
                                                                            "16": [300, 300]}}],
        "train_threads.py": [{"program": "train.py", "setting": "torch", "neighbours": 0,
                              "runs": [{"ms": 30.0}, {"ms": 40.0}]},
                             {"program": "nanoGPT", "setting": "torch", "neighbours": 0,
                              "runs": [{"ms": 33.0}, {"ms": 40.0}]}]}
    calls = []

    def run_script(script, argv, json_path):
        calls.append((script, argv))
        return written[script]

    monkeypatch.setattr(reproduce, "run_script", run_script)
    args = reproduce.argparse.Namespace(rounds=2, min_seconds=1.0, quick=True, llama_server="x", n_layer=None,
                                        nanogpt="n", train_args="", variant="avx2")
    decode = {m.claim.key: m.ratios for m in reproduce.run_decode(args, tmp_path)}
    assert decode == {"decode-float32": [1.25, 1.0], "decode-int8": [0.9, 0.8]}
    serve = {m.claim.key: m.ratios for m in reproduce.run_serve(args, tmp_path)}
    assert serve == {"serve-1": [2.0, 2.0], "serve-4": [200 / 190, 1.05], "serve-16": [1.0, 310 / 300],
                     "serve-64": None}  # llama-server's 64-client level failed: nothing to compare
    (train,) = reproduce.run_train(args, tmp_path)
    assert train.ratios == pytest.approx([1.1, 1.0]) and train.ours == pytest.approx([1000 / 30, 25.0])
    assert "--max_batch=64" in calls[1][1] and "--llama_type=q8_0" in calls[1][1]
    assert "--variants=avx2" in calls[0][1]  # --variant: the kernels beside a llama.cpp built for the same ones
