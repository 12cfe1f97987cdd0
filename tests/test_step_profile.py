"""gptkit/step_profile.py and bench.py's --profile_step: a training step's time by kind (matmul, attention,
head_loss, optimizer, other), from CPU operators' self time here and from CUDA kernels by the same rules on a GPU;
and the training variants the GPU run combines (--fp8_head, --loss_chunk, --batch_size) measured together, a
micro-batch that does not fit reported rather than ending the run."""

from types import SimpleNamespace

import torch
from torch.autograd import DeviceType

import bench
from gptkit import fp8
from gptkit.step_profile import KINDS, classify_events, format_profile, profile_steps
from model import GPT, GPTConfig
from tests.test_bench import expect_error

V = 50304  # the head's width in the CUDA events below: GPT-2's padded vocabulary


def event(name, device=DeviceType.CPU, parent=None, shapes=(), us=0.0, id=0, linked=0):
    """A stand-in for a profiler FunctionEvent: what classify_events reads of one."""
    return SimpleNamespace(name=name, device_type=device, cpu_parent=parent, input_shapes=[list(s) for s in shapes],
                           is_async=False, id=id, linked_correlation_id=linked, self_cpu_time_total=us,
                           time_range=SimpleNamespace(elapsed_us=lambda: us))


def test_cuda_kernels_are_classified_by_name_and_by_the_op_that_launched_them():
    """Kernel time by kind: the head's matmul (an input as wide as the head) apart from the blocks' matmuls,
    the optimizer's kernels by its step range, attention and the loss by name, the embedding (as wide as the
    head too) as other; a kernel no op launched (a CUDA graph's replay) by its name alone."""
    step = event("Optimizer.step#AdamW.step")
    adam = event("aten::_fused_adamw_", parent=step, id=1)
    head_mm = event("aten::mm", shapes=[(12288, 768), (768, V)], id=2)
    block_mm = event("aten::mm", shapes=[(12288, 768), (768, 3072)], id=3)
    sdpa = event("aten::_scaled_dot_product_flash_attention", shapes=[(12, 12, 1024, 64)], id=4)
    emb = event("aten::embedding", shapes=[(V, 768), (12, 1024)], id=5)
    index = event("aten::index_select", parent=emb, shapes=[(V, 768), (12288,)], id=6)
    gpu = DeviceType.CUDA
    kernels = [
        event("multi_tensor_apply_kernel<FusedAdamMathFunctor>", gpu, us=1000, linked=1),
        event("sm90_xmma_gemm_bf16bf16_bf16f32", gpu, us=4000, linked=2),
        event("sm90_xmma_gemm_bf16bf16_bf16f32", gpu, us=8000, linked=3),
        event("pytorch_flash::flash_fwd_kernel", gpu, us=3000, linked=4),
        event("indexSelectLargeIndex", gpu, us=500, linked=6),
        event("triton_red_fused_exp_logsumexp_sub_0", gpu, us=700),  # no launching op
        event("nvjet_tst_128x256_64x4_1x2_h_bz_TNT", gpu, us=2000),  # a matmul in a replayed graph
        event("triton_poi_fused_add_native_layer_norm_1", gpu, us=300, linked=99),  # an op not recorded
    ]
    cpu_side = [step, adam, head_mm, block_mm, sdpa, emb, index]
    profile = classify_events(cpu_side + kernels, "cuda", steps=2, head_width=V)
    assert profile == {"matmul": 5.0, "attention": 1.5, "head_loss": 2.35, "optimizer": 0.5, "other": 0.4}


def test_cpu_ops_self_times_by_kind_on_a_real_step():
    """A real profile of a wide-vocabulary model's step on the CPU: every kind present, the head and its loss
    the largest part (its (tokens x 50,304) logits dwarf the rest), the total the operators' summed self time
    (not counting nested time twice: below the steps' wall time)."""
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=32, vocab_size=50257, n_layer=1, n_head=2, n_embd=32, dropout=0.0, bias=False,
                    vocab_multiple=64)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seq = torch.randint(0, cfg.vocab_size, (4, cfg.block_size + 1))

    def step():
        model(seq[:, :-1], seq[:, 1:])[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    profile = profile_steps(step, "cpu", steps=2, head_width=cfg.padded_vocab_size)
    assert set(profile) == set(KINDS) and all(ms > 0 for ms in profile.values()), profile
    assert profile["head_loss"] == max(profile.values())
    table = format_profile(profile)
    assert all(kind in table for kind in KINDS) and "total" in table


def test_profile_fp8_loss_chunks_and_batches_together_with_an_oom_reported(monkeypatch, capsys):
    """The GPU run's training combination on a tiny model: --fp8_head x --loss_chunk x --batch_size, each row
    profiled; the FP8 rows really multiply in FP8 (the CPU standing in for a capable GPU); a micro-batch that
    runs out of memory is a failed row saying so (--keep_going) and the larger-batch rows after it still run."""
    monkeypatch.setitem(bench.MODELS, "tiny16", (1, 1, 16, 16, 64, 1))  # FP8 sizes: multiples of 16
    monkeypatch.setattr(fp8, "fp8_problem", lambda device: None)
    fp8_calls = []
    real_scaled_mm = fp8.scaled_mm
    monkeypatch.setattr(fp8, "scaled_mm", lambda *a: fp8_calls.append(a[0].shape) or real_scaled_mm(*a))
    real_next = bench.RandomBatches.next_batch

    def next_batch(self):
        if self.pool[0].size(0) == 24:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB")
        return real_next(self)

    monkeypatch.setattr(bench.RandomBatches, "next_batch", next_batch)
    rows = bench.main(["--models=tiny16", "--device=cpu", "--warmup=0", "--repeats=1", "--skip_decode",
                       "--batch_size=12,16,24,32", "--loss_chunk=plain,default", "--fp8_head=False,True",
                       "--profile_step=True", "--keep_going"])
    assert [(r["batch_size"], r["fp8_head"]) for r in rows] == [
        (b, f) for b in (12, 16, 24, 32) for _ in ("plain", "default") for f in (False, True)]
    for r in rows:
        if r["batch_size"] == 24:
            assert r["status"] == "failed" and r["reason"].startswith("OutOfMemoryError: CUDA out of memory")
            assert r["profile"] is None
            continue
        assert r["status"] == "ok", r["reason"]
        assert set(r["profile"]) == set(KINDS) and r["profile"]["matmul"] > 0 and r["profile"]["head_loss"] > 0
        tokens = r["batch_size"] * 16
        # the tiny head is one plain cross-entropy, except in FP8: one slice of every row
        assert r["loss_slice_rows"] == (tokens if r["fp8_head"] else None)
    assert fp8_calls and {shape[0] for shape in fp8_calls} >= {12 * 16, 16 * 16, 32 * 16}
    out = capsys.readouterr().out
    assert out.count("profile, ms/step") == 12 and "fp8 head" in out and "failed: OutOfMemoryError" in out


def test_fp8_rows_are_skipped_off_a_capable_gpu():
    (plain, fp8_row) = bench.main(["--models=tiny", "--device=cpu", "--warmup=0", "--repeats=1", "--skip_decode",
                                   "--fp8_head=False,True"])
    assert plain["status"] == "ok" and plain["profile"] is None
    assert fp8_row["status"] == "skipped" and "compute capability >= 8.9" in fp8_row["reason"]


def test_the_new_options_are_checked():
    expect_error(["--models=tiny", "--fp8_head=maybe"], "fp8_head expects a comma-separated list")
    expect_error(["--models=tiny", "--profile_step=sometimes"], "profile_step")
