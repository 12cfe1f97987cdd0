"""objective=grpo on a GPU: the rollouts drawn by the serving engine from the CUDA model's live weights (eager
decode, the training model itself), the step and the evaluation through train.py, and cuda_graphs refused for
the objective itself (on a GPU the device is not the reason)."""

import pytest
import torch
from conftest import torch_threads

from gptkit.generate import SamplingOptions
from gptkit.objectives.grpo_loss import GRPOObjective
from gptkit.objectives.grpo_rollouts import draw
from model import GPT, GPTConfig
from tests.test_grpo_train import graded, grpo, sft, train  # noqa: F401  (sft: the module's fixture)
from tests.test_train import metrics, weights

pytestmark = pytest.mark.cuda  # skipped without a CUDA GPU (tests/ci_skips.py)


def test_draws_on_cuda_are_reproducible_and_leave_the_model_as_it_was():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=24, vocab_size=13, n_layer=1, n_head=2, n_embd=16, dropout=0.0)).cuda().train()
    rng = torch.cuda.get_rng_state()
    runs = [draw(model, [[1, 10, 2, 11], [3, 11]], 4, max_tokens=5, sampling=SamplingOptions(temperature=1.0),
                 stop_ids=frozenset({12}), generator=torch.Generator().manual_seed(3)) for _ in range(2)]
    assert runs[0] == runs[1]
    assert torch.equal(torch.cuda.get_rng_state(), rng)
    assert model.training and model.kv_cache_batch_size is None
    replies, stopped = runs[0]
    assert all(len(r) == 5 or end for group, ends in zip(replies, stopped) for r, end in zip(group, ends))


def test_a_grpo_run_on_cuda(sft, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    with torch_threads(1):
        train.main(grpo(sft, out, device="cuda", grpo_reward=graded(tmp_path), max_iters=3, eval_interval=3))
    steps = [m for m in metrics(out) if "loss" in m]
    evals = [m for m in metrics(out) if "val_loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    for m in steps:
        assert all(m[k] == m[k] for k in GRPOObjective.metric_names)  # (no NaN)
    assert evals[-1]["val_loss"] == pytest.approx(-evals[-1]["val_reward"])
    start = weights(sft / "sft")
    assert any(not torch.equal(start[k], v.cpu()) for k, v in weights(out).items())


def test_cuda_graphs_are_refused_for_grpo(sft, tmp_path):  # noqa: F811
    with pytest.raises(SystemExit, match="objective=grpo draws new data in its step"):
        train.main(grpo(sft, tmp_path / "x", device="cuda", cuda_graphs=True))
