"""Training/validation batches (loader.py): determinism, DDP sharding, exact resume, epoch coverage."""

import io

import numpy as np
import pytest
import torch

from gptkit.data import shards
from gptkit.data.loader import BatchLoader, ValBatches
from gptkit.errors import DataError

N_TOKENS = 5000


@pytest.fixture
def data_dir(tmp_path):
    """Token i is i (so a window's first x token is its start), spread over 3 shards of uneven size."""
    root = tmp_path / "ds"
    root.mkdir()
    stream = np.arange(N_TOKENS)
    cuts = [0, 1234, 1300, N_TOKENS]
    names = []
    for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        names.append(shards.shard_name("train", i))
        shards.write_shard(root / names[-1], stream[a:b], vocab_size=N_TOKENS)
    shards.write_shard(root / "val_000000.bin", stream[:100], vocab_size=N_TOKENS)
    meta = {
        "format_version": 1, "tokenizer": {"kind": "tiktoken", "name": "gpt2"}, "vocab_size": N_TOKENS,
        "eot_id": None, "source": "test", "created": "2024-01-01",
        "splits": {"train": {"shards": names, "tokens": N_TOKENS}, "val": {"shards": ["val_000000.bin"], "tokens": 100}},
    }
    shards.write_meta(root, meta)
    return root


def batches(loader, n):
    return [loader.next_batch() for _ in range(n)]


def test_batch_shape_dtype_and_shift(data_dir):
    loader = BatchLoader(data_dir, batch_size=4, block_size=16)
    for x, y in batches(loader, 20):
        assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
        assert x.is_contiguous() and y.is_contiguous()
        assert torch.equal(y[:, :-1], x[:, 1:])  # y is x shifted by one
        assert torch.equal(x, x[:, :1] + torch.arange(16))  # a contiguous window of the stream
        assert int(y.max()) < N_TOKENS  # never reads past the end
    starts = torch.cat([x[:, 0] for x, _ in batches(loader, 50)])
    assert len(set(starts.tolist())) > 150  # random starts, not a handful of repeats


def test_same_seed_same_batches(data_dir):
    a = batches(BatchLoader(data_dir, batch_size=3, block_size=8, seed=7), 5)
    b = batches(BatchLoader(data_dir, batch_size=3, block_size=8, seed=7), 5)
    c = batches(BatchLoader(data_dir, batch_size=3, block_size=8, seed=8), 5)
    assert all(torch.equal(p[0], q[0]) for p, q in zip(a, b))
    assert not all(torch.equal(p[0], q[0]) for p, q in zip(a, c))


@pytest.mark.parametrize("mode", ["random", "epoch"])
def test_ranks_together_equal_one_process(data_dir, mode):
    """One process with batch B and 2 calls == ranks 0 and 1 (world 2, batch B) with 1 call each."""
    single = BatchLoader(data_dir, batch_size=4, block_size=16, mode=mode)
    ranks = [BatchLoader(data_dir, batch_size=4, block_size=16, mode=mode, rank=r, world_size=2) for r in (0, 1)]
    for _ in range(3):
        s0, s1 = single.next_batch(), single.next_batch()
        r0, r1 = ranks[0].next_batch(), ranks[1].next_batch()
        assert torch.equal(s0[0], r0[0]) and torch.equal(s1[0], r1[0])
        assert torch.equal(s0[1], r0[1]) and torch.equal(s1[1], r1[1])


def test_ranks_are_disjoint(data_dir):
    # Epoch mode: within an epoch every window is distinct, so any overlap would be a sharding bug.
    ranks = [BatchLoader(data_dir, batch_size=5, block_size=16, mode="epoch", rank=r, world_size=3) for r in range(3)]
    seen = [{int(s) for _ in range(6) for s in ranks[r].next_batch()[0][:, 0]} for r in range(3)]
    assert all(len(s) == 30 for s in seen)
    assert not (seen[0] & seen[1]) and not (seen[0] & seen[2]) and not (seen[1] & seen[2])


@pytest.mark.parametrize("mode", ["random", "epoch"])
def test_state_dict_resume_is_exact(data_dir, mode):
    loader = BatchLoader(data_dir, batch_size=4, block_size=16, mode=mode, seed=3)
    batches(loader, 5)
    state = loader.state_dict()
    assert state == {"mode": mode, "seed": 3, "block_size": 16, "next_sample": 20}
    buf = io.BytesIO()
    torch.save({"loader": state}, buf)
    buf.seek(0)
    restored_state = torch.load(buf, weights_only=True)["loader"]
    expected = batches(loader, 80)  # epoch mode: crosses into later epochs (n_win = 312)

    restored = BatchLoader(data_dir, batch_size=4, block_size=16, mode=mode, seed=3)
    restored.load_state_dict(restored_state)
    for (x, y), (x2, y2) in zip(expected, batches(restored, 80)):
        assert torch.equal(x, x2) and torch.equal(y, y2)


def test_resume_with_other_world_size_same_global_batch(data_dir):
    single = BatchLoader(data_dir, batch_size=8, block_size=16)
    batches(single, 3)
    ranks = [BatchLoader(data_dir, batch_size=4, block_size=16, rank=r, world_size=2) for r in (0, 1)]
    for r in ranks:
        r.load_state_dict(single.state_dict())
    x = single.next_batch()[0]
    assert torch.equal(x, torch.cat([ranks[0].next_batch()[0], ranks[1].next_batch()[0]]))


def test_load_state_dict_mismatch(data_dir):
    loader = BatchLoader(data_dir, batch_size=4, block_size=16, seed=1)
    base = loader.state_dict()
    for key, value in (("seed", 2), ("block_size", 32), ("mode", "epoch")):
        with pytest.raises(DataError, match=f"{key}="):
            loader.load_state_dict({**base, key: value})
    with pytest.raises(DataError, match="not a multiple of world_size\\*batch_size = 4"):
        loader.load_state_dict({**base, "next_sample": 6})
    with pytest.raises(DataError, match="missing next_sample"):
        loader.load_state_dict({k: v for k, v in base.items() if k != "next_sample"})


def test_epoch_mode_visits_every_window_once(data_dir):
    block = 16
    n_win = (N_TOKENS - 1) // block  # 312
    loader = BatchLoader(data_dir, batch_size=8, block_size=block, mode="epoch", seed=5)
    starts = torch.cat([loader.next_batch()[0][:, 0] for _ in range(n_win * 2 // 8)]).tolist()
    epoch0, epoch1 = starts[:n_win], starts[n_win:]
    assert sorted(epoch0) == sorted(epoch1) == [i * block for i in range(n_win)]
    assert epoch0 != epoch1  # a new permutation each epoch
    assert loader.epoch == pytest.approx(2 * n_win * block / N_TOKENS)


def test_too_short_split(data_dir):
    with pytest.raises(DataError) as e:
        BatchLoader(data_dir, "val", batch_size=2, block_size=256)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"val split of {data_dir} has 100 tokens, fewer than block_size+1 = 257" in msg
    assert "smaller --block_size" in msg
    BatchLoader(data_dir, "val", batch_size=2, block_size=99)  # exactly block_size + 1 tokens is enough


def test_bad_arguments(data_dir):
    with pytest.raises(DataError, match="unknown loader mode"):
        BatchLoader(data_dir, batch_size=2, block_size=8, mode="shuffle")
    with pytest.raises(DataError, match="rank"):
        BatchLoader(data_dir, batch_size=2, block_size=8, rank=2, world_size=2)
    with pytest.raises(DataError, match="n_batches"):
        ValBatches(data_dir, batch_size=2, block_size=8, n_batches=0)
    with pytest.raises(DataError, match="prepare it with"):
        BatchLoader(data_dir.parent / "missing", batch_size=2, block_size=8)


def test_val_batches_are_fixed(data_dir):
    def run(**kw):
        return [x for x, _ in ValBatches(data_dir, batch_size=3, block_size=8, n_batches=5, **kw)]

    a, b = run(), run()
    assert len(a) == 5 and all(torch.equal(p, q) for p, q in zip(a, b))
    assert all(torch.equal(p, q) for p, q in zip(a, run()))  # iterating again gives the same windows
    # Two ranks share the batches: rank r gets global batches r, r+2, ...
    r0, r1 = run(rank=0, world_size=2), run(rank=1, world_size=2)
    assert len(r0) == 3 and len(r1) == 2
    assert all(torch.equal(p, q) for p, q in zip(a, [r0[0], r1[0], r0[1], r1[1], r0[2]]))
    assert len(ValBatches(data_dir, batch_size=3, block_size=8, n_batches=5, rank=1, world_size=2)) == 2
    assert not torch.equal(a[0], run(seed=99)[0])


@pytest.mark.cuda
def test_cuda_batches(data_dir):
    x, y = BatchLoader(data_dir, batch_size=4, block_size=16, device="cuda").next_batch()
    assert x.is_cuda and y.is_cuda and x.dtype == torch.int64
    x_cpu, _ = BatchLoader(data_dir, batch_size=4, block_size=16).next_batch()
    assert torch.equal(x.cpu(), x_cpu)


def test_prefetch_reads_ahead_without_moving_the_data_position(data_dir):
    plain = batches(BatchLoader(data_dir, batch_size=4, block_size=16, seed=3), 6)
    loader = BatchLoader(data_dir, batch_size=4, block_size=16, seed=3)
    got = []
    for i in range(6):
        got.append(loader.next_batch())
        loader.prefetch()
        loader.prefetch()  # a second call reads nothing more
        assert loader.state_dict()["next_sample"] == 4 * (i + 1)  # a checkpoint here resumes at the next batch
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(plain, got))
    loader.load_state_dict({"mode": "random", "seed": 3, "block_size": 16, "next_sample": 8})
    assert torch.equal(loader.next_batch()[0], plain[2][0])  # a restore drops the batch read ahead


def test_training_step_reads_the_next_batch_before_it_returns(data_dir):
    """train.py's step reads the next step's first batch before its host synchronisation (the NaN/stop check
    follows forward_backward), so that the read overlaps the GPU's work instead of stalling it."""
    from gptkit.runtime import setup_runtime
    from gptkit.step import forward_backward
    from model import GPT, GPTConfig

    tiny_model = GPT(GPTConfig(block_size=16, vocab_size=N_TOKENS, n_layer=1, n_head=1, n_embd=8))
    loader = BatchLoader(data_dir, batch_size=2, block_size=16, seed=3)
    opt = torch.optim.SGD(tiny_model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    forward_backward(tiny_model, opt, scaler, loader.next_batch, 2, setup_runtime("cpu"), 1.0,
                     prefetch=loader.prefetch)
    assert loader.calls == 2 and loader._prefetched is not None
