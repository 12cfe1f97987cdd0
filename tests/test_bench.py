"""bench.py runs end to end in a tiny mode and reports sane numbers."""

import json

import bench


def test_bench_tiny(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rows = bench.main(["--models=tiny", "--device=cpu", "--warmup=1", "--repeats=2", "--decode_tokens=8",
                       "--decode_repeats=1", "--prefill_tokens=32", "--accum=2", f"--json={out}"])
    kinds = [r["kind"] for r in rows]
    assert kinds.count("train") == 1 and kinds.count("decode") == 4 and kinds.count("prefill") == 1
    train_row = rows[0]
    assert train_row["tokens_per_s"] > 0 and train_row["batch"] == "4x2" and train_row["mfu"] is None
    assert all(r["tokens_per_s"] > 0 for r in rows if r["kind"] == "decode")
    table = capsys.readouterr().out
    assert "tokens/s" in table and "prefill" in table and "n/a" in table
    assert json.loads(out.read_text())["rows"][0]["model"] == "tiny"


def test_bench_refuses_unknown_sizes():
    import pytest

    with pytest.raises(SystemExit, match="unknown model size"):
        bench.main(["--models=huge", "--device=cpu"])


def test_decode_window_comparison(tiny_model, tiny_config):
    rows = bench.decode_benchmark(tiny_model, tiny_config.block_size + 8, repeats=1)
    assert [r["use_cache"] for r in rows] == [False, False, True, True] and rows[0]["speedup"] == 1.0
    assert all(r["seconds"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert len(bench.compare_table(rows).splitlines()) == 2 + len(rows)
