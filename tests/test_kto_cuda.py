"""objective=kto on a GPU: the whole step captured as one CUDA graph (the rows' and KL sequences' tokens, their
labels and, precomputed, the reference's log-probabilities copied into the graph's inputs with each batch; or
LoRA's adapters-off forwards recorded inside it) trains as the plain step does, to bf16 rounding.
(tests/test_kto.py checks the same arithmetic eagerly on the CPU.)"""

from types import SimpleNamespace

import pytest

from tests.test_cudagraph_cuda import assert_same_run, count_captures, same_float32_lr
from tests.test_kto import kto_args, task, train  # noqa: F401  (task: the module's fixture)

pytestmark = pytest.mark.cuda  # skipped without a CUDA GPU (tests/ci_skips.py)


def test_cuda_the_captured_kto_step_trains_as_the_plain_step(task, tmp_path, monkeypatch):  # noqa: F811
    """bf16, eager, 12 steps of 2 micro-batches, with each reference; each run captured once, after the three
    warm-up steps, and equal to the plain step's run to bf16 rounding (its losses and its final weights)."""
    same_float32_lr(monkeypatch)
    captured = count_captures(monkeypatch)
    rows = SimpleNamespace(sft=task.sft, rows=task.rows)
    for name, over in (("precomputed", {}), ("lora", dict(lora_rank=4, lora_dropout=0.0))):
        plain, graphed = tmp_path / f"{name}_plain", tmp_path / f"{name}_graphed"
        args = dict(device="cuda", dtype="bfloat16", max_iters=12, lr_decay_iters=12, eval_interval=100, **over)
        train.main(kto_args(rows, plain, cuda_graphs=False, **args))
        train.main(kto_args(rows, graphed, cuda_graphs=True, **args))
        assert captured == [3], name
        captured.clear()
        assert_same_run(plain, graphed, 12, trained=False)
