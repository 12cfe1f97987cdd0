"""The probe of 2026-11-28 (run on the H200 as tests/test_zz_diag_cuda.py, its output in rerun.log): where a
compiled graphed run with dropout parts from the plain one. Kept as a record; tests/test_cudagraph_cuda.py holds
what it showed."""
import pytest
import torch

import train
from tests.test_cudagraph_cuda import ON_GPU, count_captures, same_float32_lr
from tests.test_train import tiny_args, train_losses, weights

pytestmark = pytest.mark.cuda


def offset():
    try:
        return int(torch.cuda.default_generators[0].get_offset())
    except Exception as e:  # noqa: BLE001
        return repr(e)


@pytest.mark.parametrize("compile_,dropout", [(False, 0.1), (True, 0.0), (True, 0.1)])
def test_diag(char_dataset, tmp_path, monkeypatch, compile_, dropout):
    same_float32_lr(monkeypatch)
    captured = count_captures(monkeypatch)
    args = dict(ON_GPU, compile=compile_, dropout=dropout, max_iters=30, lr_decay_iters=30, seed=1234,
                learning_rate=1e-2, min_lr=1e-3)
    offs = {}
    for name, graphs in (("plain", False), ("graphed", True)):
        train.main(tiny_args(char_dataset, tmp_path / name, cuda_graphs=graphs, **args))
        offs[name] = offset()
    a, b = train_losses(tmp_path / "plain"), train_losses(tmp_path / "graphed")
    print(f"\nDIAG compile={compile_} dropout={dropout} captured={captured} offsets={offs}")
    print("DIAG losses", " ".join(f"{s}:{a[s]:.6f}/{b[s]:.6f}" for s in sorted(a)[:8]), "...",
          " ".join(f"{s}:{a[s]:.4f}/{b[s]:.4f}" for s in sorted(a)[-3:]))
    wa, wb = weights(tmp_path / "plain"), weights(tmp_path / "graphed")
    worst = sorted(((float((wa[n].float() - wb[n].float()).norm() / wa[n].float().norm()), n) for n in wa),
                   reverse=True)
    print("DIAG weights", "equal" if all(torch.equal(wa[n], wb[n]) for n in wa) else "differ",
          " ".join(f"{n}={d:.2e}" for d, n in worst[:6]))
