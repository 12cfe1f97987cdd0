"""train.py with objective=grpo (gptkit/objectives/grpo.py) end to end: the recipe as written at a tiny scale
(configs/arithmetic_sft.py, eval.py --task checker, configs/grpo_arithmetic.py), the log's metrics, exact
resume, a failing checker stopping the run in one line with its checkpoint kept, and the refusals."""

import pytest
import torch
from conftest import torch_threads, train_script, write_dataset

import eval as eval_script
from gptkit.checkpoint import load_checkpoint
from gptkit.objectives.grpo_loss import GRPOObjective
from gptkit.tokenizer import Tokenizer
from tasks import arithmetic
from tests.test_train import assert_same_weights, metrics, train_losses, weights

train = train_script()
TINY = dict(n_layer=1, n_head=2, n_embd=32, block_size=32, eval_iters=2, device="cpu", threads=1)


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def args(config: str, **over) -> list[str]:
    return [config, *(f"--{k}={v}" for k, v in over.items())]


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """The recipe's first stage at a tiny scale: worked problems as a char dataset, 15 SFT steps."""
    root = tmp_path_factory.mktemp("arith")
    text = arithmetic.sft_text(3000)
    data = write_dataset(root / "data" / "arithmetic", text, Tokenizer.char_from_text(arithmetic.CHARS))
    with torch_threads(1):
        train.main(args("configs/arithmetic_sft.py", out_dir=root / "sft", dataset=data, max_iters=15,
                        lr_decay_iters=15, eval_interval=15, warmup_iters=2, **TINY))
    return root


def grpo(sft, out, **over):
    settings = dict(init_from=sft / "sft", dataset=sft / "data" / "arithmetic", out_dir=out, max_iters=4,
                    eval_interval=2, log_interval=1, batch_size=8, grpo_n=4, grpo_eval_prompts=8,
                    learning_rate=1e-3, **{k: v for k, v in TINY.items() if k not in ("n_layer", "n_head",
                                                                                      "n_embd", "block_size")})
    settings.update(over)
    return args("configs/grpo_arithmetic.py", **settings)


def graded(tmp_path) -> str:
    """A checker whose rewards differ within a group even for an untrained model: the share of '1's."""
    f = tmp_path / "ones.py"
    f.write_text("def reward(prompt, reply):\n    return reply.count('1') / max(len(reply), 1)\n")
    return f"{f}:reward"


def test_the_recipe_runs_as_written(sft, tmp_path, capsys):
    result = eval_script.main(["--ckpt", str(sft / "sft"), "--task", "checker", "--limit", "8", "--pass_k", "2",
                               "--device", "cpu", "--threads", "1"])
    assert result["prompts"] == 8 and 0 <= result["accuracy"] <= result["pass_at_k"] <= 1
    out = tmp_path / "grpo"
    train.main(grpo(sft, out))
    said = capsys.readouterr().out
    assert "objective: GRPO on tasks/arithmetic.py" in said and "8 replies (groups of 4)" in said
    steps = [m for m in metrics(out) if "loss" in m]
    evals = [m for m in metrics(out) if "val_loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4] and [m["step"] for m in evals] == [0, 2, 4]
    for m in steps:
        assert set(GRPOObjective.metric_names) <= set(m)
        assert 0 <= m["reward"] <= 1 and 0 <= m["no_signal"] <= 1 and m["reply_tokens"] <= 6
    for m in evals:
        assert m["val_loss"] == pytest.approx(-m["val_reward"])  # best.pt keeps the best held-out reward
    again = eval_script.main(["--ckpt", str(out), "--task", "checker", "--limit", "8", "--device", "cpu",
                              "--threads", "1"])
    assert again["accuracy"] == pytest.approx(evals[-1]["val_reward"])  # the same prompts, greedy, same checker


@pytest.mark.parametrize("over", [dict(), dict(grpo_kl=0.5), dict(grpo_kl=0.5, lora_rank=4, lora_dropout=0.0)],
                         ids=["no_kl", "kl_to_a_copy", "kl_to_adapters_off"])
def test_rewards_move_the_weights_and_resume_is_exact(sft, tmp_path, capsys, over):
    """4 steps, or 2 then 2 resumed: the same losses, metrics and weights, bit for bit (the draws included).
    With grpo_kl a full fine-tune's copy of the starting weights is saved and read back; LoRA's is the model
    with its adapters off."""
    full, half = tmp_path / "full", tmp_path / "half"
    over = dict(grpo_reward=graded(tmp_path), gradient_accumulation_steps=2, batch_size=4, **over)
    train.main(grpo(sft, full, **over))
    train.main(grpo(sft, half, max_iters=2, **over))
    train.main(grpo(sft, half, init_from="resume", **over))
    said = capsys.readouterr().out
    if "grpo_kl" in over:
        assert ("adapters off (no copy)" if "lora_rank" in over else "a copy of the starting weights") in said
        kl = [m["kl"] for m in metrics(full) if "loss" in m]
        assert kl[0] == 0 and max(kl) > 0  # the model is its reference at the first step only
    assert ("grpo_reference" in load_checkpoint(full / "last.pt")) == ("grpo_kl" in over and "lora_rank" not in over)
    steps = [m for m in metrics(full) if "loss" in m]
    assert any(m["no_signal"] < 1 for m in steps) and any(m["grad_norm"] > 0 for m in steps)
    assert train_losses(half) == train_losses(full)
    by_step = {m["step"]: m for m in steps}
    for m in metrics(half):
        if "loss" in m and m["step"] > 2:
            for k in GRPOObjective.metric_names:
                assert m[k] == by_step[m["step"]][k], k
    assert_same_weights(weights(half), weights(full))
    start = load_checkpoint(sft / "sft" / "last.pt")["model"]
    moved = [k for k, v in weights(full).items()  # (LoRA: its adapters' B, zero at the start)
             if (k in start and not torch.equal(start[k], v)) or (k.endswith("lora_B") and v.abs().sum() > 0)]
    assert moved and all(k.endswith(("lora_A", "lora_B")) for k in moved) == ("lora_rank" in over)


def test_a_failing_checker_is_one_line_and_keeps_the_checkpoint(sft, tmp_path):
    out = tmp_path / "out"
    train.main(grpo(sft, out, max_iters=2))
    before = (out / "last.pt").read_bytes()
    bad = tmp_path / "bad.py"
    bad.write_text("def reward(prompt, reply):\n    return {'right': 1}\n")
    with pytest.raises(SystemExit, match=r"^error: checker .* on prompt '\d+\+\d+=' returned \{'right': 1\}, not a fin"):
        train.main(grpo(sft, out, init_from="resume", grpo_reward=f"{bad}:reward"))
    assert (out / "last.pt").read_bytes() == before


@pytest.mark.parametrize("over, says", [
    (dict(batch_size=6), "must be a multiple of grpo_n"),
    (dict(grpo_clip=1.5), "grpo_clip must be in"),
    (dict(cuda_graphs=True), "objective=grpo draws new data in its step"),
    (dict(grpo_task="tasks/none.py"), "not found"),
    (dict(grpo_max_tokens=30), r"exceeds the model's context of 32; lower grpo_max_tokens"),
    (dict(dataset="/nonexistent/arithmetic"), r"not found .*prepare it with: python prepare/text.py --input"),
])
def test_refusals(sft, tmp_path, over, says):
    with pytest.raises(SystemExit, match=f"^error: .*{says}"):
        train.main(grpo(sft, tmp_path / "x", **over))
    assert not (tmp_path / "x" / "last.pt").exists()


def test_the_rollouts_benchmark_runs():
    from benchmarks import rollouts

    with torch_threads(1):
        out = rollouts.main(["--shape", "tiny", "--prompts", "2", "--n", "2", "--max_tokens", "4", "--rounds", "1"])
    assert len(out["engine"]) == len(out["plain"]) == len(out["steps"]) == 1 and out["engine"][0] > 0
