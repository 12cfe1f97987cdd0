"""plan.py and train.py --plan / batch_size=auto: exact counts, activations equal to what autograd keeps, the
peak against torch's allocator, the plan of every shipped config without full-size tensors, and the search
for the largest micro-batch; under DDP and FSDP."""

import json
import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import train_script
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import model as model_module
from gptkit import lora, plan
from gptkit.checkpoint import load_base_model
from gptkit.checkpoint.resume import resolve_config
from gptkit.checkpoint.run_model import attach_lora, build_model
from gptkit.config import TrainConfig
from gptkit.errors import ConfigError
from gptkit.optim import make_optimizer
from gptkit.options import build_config, load_config
from gptkit.plan import batch_size
from gptkit.plan import report as plan_report
from gptkit.runtime import Dist, Runtime
from gptkit.step import forward_backward
from model import GPT, GPTConfig

train = train_script()

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.py"))


def tiny(vocab=65, **over) -> GPTConfig:
    kw = dict(vocab_size=vocab, n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_multiple=64 if vocab > 1000 else 1)
    return GPTConfig(**{**kw, **over})


def model_for(config: GPTConfig, rank: int = 0, lora_dropout: float = 0.0, targets: str | None = None) -> GPT:
    torch.manual_seed(0)
    model = GPT(config).train()
    if rank:
        lora.apply(model, lora.LoRASettings(rank=rank, dropout=lora_dropout, **({"targets": targets} if targets else {})))
    return model


# ----------------------------------------------------------------------------- counts: exact


@pytest.mark.parametrize("optimizer, rank", [("adamw", 0), ("muon", 0), ("adamw", 4)])
def test_weights_gradients_and_optimizer_states_are_exact(optimizer, rank):
    """The plan's counts against the tensors a real step leaves: every gradient and every optimizer state."""
    model = model_for(tiny(arch="modern" if optimizer == "muon" else "gpt2"), rank=rank)
    opt = make_optimizer(model, TrainConfig(optimizer=optimizer), "cpu")
    x = torch.randint(0, 65, (2, 32))
    model(x, x)[1].backward()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    opt.step()
    states = opt.state_dict()["state"] if optimizer == "adamw" else {
        **{("m", k): v for k, v in opt.muon.state_dict()["state"].items()},
        **{("a", k): v for k, v in opt.adamw.state_dict()["state"].items()}}
    state_bytes = sum(t.numel() * t.element_size() for s in states.values() for t in s.values()
                      if isinstance(t, torch.Tensor))
    assert plan.weights_bytes(model) == sum(p.numel() * p.element_size() for p in model.parameters())
    assert plan.gradients_bytes(model) == grads
    assert plan.optimizer_bytes(model, optimizer) == state_bytes


def test_a_lora_base_held_in_bf16_counts_two_bytes_per_frozen_block_weight():
    model = lora.cast_frozen_base(model_for(tiny(), rank=4), torch.bfloat16)
    fp32 = sum(p.numel() for p in model.parameters() if p.dtype == torch.float32)
    bf16 = sum(p.numel() for p in model.parameters() if p.dtype == torch.bfloat16)
    assert bf16 > 0 and plan.weights_bytes(model) == 4 * fp32 + 2 * bf16


def test_flops_per_token_counts_the_runs_sequences_not_the_models_context():
    """A LoRA run on a longer base (gpt2 at 256 of 1024) attends over its 256-token sequences."""
    model = model_for(tiny(block_size=64), rank=4)
    trainable, frozen = plan.matmul_weights(model)
    c = model.config
    assert plan.flops_per_token(model, 16) == 6 * trainable + 4 * frozen + 12 * c.n_layer * c.n_embd * 16
    assert plan.flops_per_token(model) - plan.flops_per_token(model, 16) == 12 * c.n_layer * c.n_embd * (64 - 16)


# ----------------------------------------------------------------------------- activations: autograd's own


def kept_by_autograd(model: GPT, batch: int, dtype: torch.dtype) -> int:
    """Bytes of the distinct tensors (not parameters) autograd saves for the backward of one training forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    c = model.config
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, c.vocab_size, (batch, c.block_size), generator=g) for _ in range(2))  # two storages
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast(
            "cpu", dtype=dtype, enabled=dtype != torch.float32):
        model(x, y)
    return sum(seen.values())


CASES = [  # (config options, LoRA rank, LoRA dropout, LoRA targets)
    ({}, 0, 0.0, None), ({"arch": "modern"}, 0, 0.0, None), ({"rope": True}, 0, 0.0, None),
    ({"qk_norm": True}, 0, 0.0, None), ({"dropout": 0.1}, 0, 0.0, None),
    ({"arch": "modern", "dropout": 0.1}, 0, 0.0, None), ({"bias": False}, 0, 0.0, None),
    ({}, 4, 0.0, None), ({}, 4, 0.05, None), ({"dropout": 0.1}, 4, 0.05, None),
    ({}, 4, 0.0, "mlp.c_fc,mlp.c_proj"), ({}, 4, 0.05, "attn.c_proj"),
    # the loss a slice of rows at a time (slices made small here: see the test)
    ({"sliced": True}, 0, 0.0, None), ({"sliced": True, "arch": "modern"}, 0, 0.0, None),
    ({"sliced": True}, 4, 0.05, None),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("options, rank, lora_dropout, targets", CASES)
def test_activations_are_what_autograd_keeps(options, rank, lora_dropout, targets, dtype, monkeypatch):
    """The plan's enumeration of saved tensors equals autograd's own, to the byte: fp32, and bf16 autocast
    (on the CPU; CUDA's kernels differ in places, see plan._Walk)."""
    options = dict(options)
    if options.pop("sliced", False):  # 16-row slices of the 65-column head: the path GPT-2's vocabulary takes
        monkeypatch.setitem(model_module.LOSS_CHUNK_ELEMENTS, "cpu", 16 * 65)
    model = model_for(tiny(**options), rank, lora_dropout, targets)
    setup = plan.Setup("cpu", dtype, model.config.block_size)
    mem = plan.memory(model, setup, 2)
    assert (plan.loss_rows(model, setup) == 16) == (model_module.LOSS_CHUNK_ELEMENTS["cpu"] == 16 * 65)
    assert mem.activations + mem.loss + mem.autocast_copies == kept_by_autograd(model, 2, dtype)


def test_activation_checkpointing_keeps_each_blocks_input():
    model = model_for(tiny(n_layer=4))
    full = plan.memory(model, plan.Setup("cpu", torch.float32, 32), 8)
    ckpt = plan.memory(model, plan.Setup("cpu", torch.float32, 32, checkpointing=True), 8)
    assert ckpt.activations < full.activations / 4
    assert ckpt.activations >= 4 * 8 * 32 * 64 * 4  # the four block inputs, fp32


# ----------------------------------------------------------------------------- the peak: torch's allocator


def allocator_peak(model: GPT, optimizer: str, batch: int, checkpointing: bool = False) -> int:
    """Live tensor bytes at the peak of a steady-state training step (train.py's), from torch's profiler."""
    # the allocator's timeline: a private module of torch 2.x (benchmarks/plan_memory.py uses it too)
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler import _memory_profiler as mp

    model.activation_checkpointing = checkpointing
    opt = make_optimizer(model, TrainConfig(optimizer=optimizer), "cpu")
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    rt = Runtime(torch.device("cpu"), torch.float32)
    c = model.config
    x = torch.randint(0, c.vocab_size, (batch, c.block_size), generator=torch.Generator().manual_seed(0))

    def step():
        forward_backward(model, opt, scaler, lambda: (x, x), 1, rt, 1.0)
        scaler.step(opt)
        opt.zero_grad(set_to_none=True)

    step()  # the optimizer states exist from here on
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as p:
        step()
    live = peak = 0
    for _, action, _, size in p._memory_profile().timeline:
        live += size if action == mp.Action.CREATE else -size if action == mp.Action.DESTROY else 0
        peak = max(peak, live)
    return plan.weights_bytes(model) + plan.optimizer_bytes(model, optimizer) + peak


@pytest.mark.parametrize("options, optimizer, checkpointing", [
    ({"vocab_size": 50257, "vocab_multiple": 64, "block_size": 512, "n_layer": 1}, "adamw", False),
    ({"vocab_size": 50257, "vocab_multiple": 64, "block_size": 512, "n_layer": 2}, "adamw", True),
    ({"vocab_size": 50257, "vocab_multiple": 64, "block_size": 512, "arch": "modern", "n_layer": 1}, "muon", False),
    ({"vocab_size": 65, "block_size": 128, "n_layer": 2}, "adamw", False),
])
def test_the_peak_is_the_allocators(options, optimizer, checkpointing):
    """benchmarks/plan_memory.py measures the five shapes of the issue; this keeps small ones within 5%."""
    model = model_for(GPTConfig(**{"n_layer": 2, "n_head": 2, "n_embd": 64, **options}))
    setup = plan.Setup("cpu", torch.float32, model.config.block_size, optimizer, checkpointing=checkpointing)
    predicted = plan.memory(model, setup, 2).peak
    assert predicted == pytest.approx(allocator_peak(model, optimizer, 2, checkpointing), rel=0.05)


# ----------------------------------------------------------------------------- train.py --plan


class LargestTensor(TorchDispatchMode):
    """The largest tensor any op makes outside the meta device."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_plan_of_every_shipped_config_builds_nothing_big(config, tmp_path, capsys):
    """No dataset is prepared here and no GPT-2 weights exist: the plan still sizes every config. (DPO's starts
    from the chat model configs/finetune_chat.py writes, and GRPO's from configs/arithmetic_sft.py's, which are not
    here either: GPT-2's shape stands in.)"""
    base = ["--init_from=gpt2"] if config.name in ("dpo_chat.py", "kto_chat.py", "grpo_arithmetic.py") else []
    with LargestTensor() as largest:
        report = train.main([str(config), "--plan", f"--data_root={tmp_path}", "--device_memory_gb=24", *base])
    assert largest.numel < 1_000_000
    out = capsys.readouterr().out
    gpus = 'device = "cpu"' not in config.read_text()  # the CPU configs are planned for the CPU only
    assert "peak" in out and "this CPU" in out and ("H100 80GB" in out and "your GPU (24 GB)" in out) == gpus
    assert "FSDP" not in out  # one process: nothing to shard
    assert not any(tmp_path.iterdir())  # nothing written, nothing prepared
    assert report["parameters"] > 0 and all(c["memory"]["peak"] > c["memory"]["weights"] for c in report["columns"])


def test_the_lora_configs_counts_are_gpt2_xls_plus_its_adapters(tmp_path, capsys):
    """transformers' GPT-2 XL (on the meta device) as the reference count, without its weights."""
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=48, n_head=25, n_embd=1600))
    reference = sum(p.numel() for p in hf.parameters()) + (50304 - 50257) * 1600  # our padded vocabulary
    C, L, r = 1600, 48, 8
    adapters = L * r * ((C + 3 * C) + (C + C) + (C + 4 * C) + (4 * C + C))  # A (r, in) + B (out, r) per layer
    report = train.main([str(REPO / "configs/finetune_shakespeare_lora.py"), "--plan", f"--data_root={tmp_path}"])
    assert report["parameters"] == reference + adapters and report["trainable"] == adapters
    assert "9.83M trainable (LoRA)" in capsys.readouterr().out


@pytest.fixture
def tiny_gpt2_folder(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64,
                                                              vocab_size=50257))
    folder = tmp_path / "tiny-gpt2"
    hf.save_pretrained(folder)
    return folder


def run_args(data, out, **over):
    args = dict(dataset=str(data), out_dir=str(out), n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=4,
                gradient_accumulation_steps=2, max_iters=3, eval_interval=3, eval_iters=2, log_interval=1,
                warmup_iters=1, lr_decay_iters=3, device="cpu", compile=False)
    args.update(over)
    return [f"--{k}={v}" for k, v in args.items()]


def shapes(model: GPT) -> dict:
    return {name: (tuple(p.shape), p.requires_grad) for name, p in model.named_parameters()}


def test_the_plans_model_is_the_model_train_builds(char_dataset, tiny_gpt2_folder, tmp_path):
    """Scratch, a full fine-tune (its context cropped), LoRA (its base kept whole), a resumed LoRA run: the
    meta-device model of the plan has the parameters, shapes and trainable flags of train.py's own."""
    from gptkit.data.shards import read_meta

    base_run = tmp_path / "base"
    train.main(run_args(char_dataset, base_run))
    lora_run = tmp_path / "lora"
    lora_opts = dict(init_from=str(base_run), lora_rank=4, lora_dropout=0.1, lora_targets="attn.c_attn,mlp.c_proj")
    train.main(run_args(char_dataset, lora_run, **lora_opts))
    runs = [run_args(char_dataset, tmp_path / "a"),
            run_args(char_dataset, tmp_path / "b", init_from=str(tiny_gpt2_folder), block_size=16),
            run_args(char_dataset, tmp_path / "c", init_from=str(tiny_gpt2_folder), block_size=16, lora_rank=2),
            run_args(char_dataset, tmp_path / "d", **lora_opts),
            run_args(char_dataset, lora_run, init_from="resume", max_iters=5)]
    meta = read_meta(char_dataset)
    for argv in runs:
        cfg, ckpt = resolve_config(argv)
        if "tiny-gpt2" in cfg.init_from:  # a char dataset cannot train the GPT-2 folder: build it by hand
            real, _ = load_base_model(cfg.init_from, cfg.dropout)
            if not cfg.lora_rank:
                real.crop_block_size(cfg.block_size)
        else:
            real, _ = build_model(cfg, meta, ckpt)
        attach_lora(cfg, real, ckpt)
        planned, _ = plan_report.plan_model(cfg, ckpt, plan_report.dataset_vocabulary(cfg))
        assert shapes(planned) == shapes(real), argv
        report = plan_report.make_plan(cfg, ckpt)
        assert report["parameters"] == sum(p.numel() for p in real.parameters())
        assert report["trainable"] == lora.trainable_parameters(real)


def test_plan_errors_are_one_line(tmp_path):
    with pytest.raises(SystemExit, match="^error: dataset .* is not prepared .* prepare it first"):
        train.main(["--plan", f"--dataset={tmp_path / 'mine'}"])
    with pytest.raises(SystemExit, match="^error: unknown pretrained model 'gpt3'"):
        train.main(["--plan", "--init_from=gpt3", "--dataset=shakespeare", f"--data_root={tmp_path}"])
    with pytest.raises(SystemExit, match="^error: block_size 2048 exceeds gpt2's context of 1024"):
        train.main(["--plan", "--init_from=gpt2", "--block_size=2048", "--dataset=shakespeare",
                    f"--data_root={tmp_path}"])
    folder = tmp_path / "hf"  # a Hugging Face folder whose config.json is damaged, then not an object
    folder.mkdir()
    for text, message in (("{not json", "cannot read .*config.json: "), ("[1, 2]", "does not hold a JSON object")):
        (folder / "config.json").write_text(text)
        with pytest.raises(SystemExit, match=f"^error: .*{message}") as e:
            train.main(["--plan", f"--init_from={folder}", "--dataset=shakespeare", f"--data_root={tmp_path}"])
        assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- batch_size=auto


def test_batch_size_auto_is_a_config_value_with_its_tokens_per_step(tmp_path):
    cfg_file = tmp_path / "c.py"
    cfg_file.write_text('batch_size = "auto"\ntokens_per_step = 4096\nblock_size = 256\n')
    cfg = load_config(TrainConfig, [str(cfg_file)])
    assert cfg.batch_size is None and cfg.tokens_per_step == 4096
    assert load_config(TrainConfig, ["--batch_size=auto", "--tokens_per_step=2048"]).batch_size is None
    with pytest.raises(ConfigError, match="set --tokens_per_step too"):
        build_config(TrainConfig, {"batch_size": None})
    with pytest.raises(ConfigError, match="must be a multiple of block_size"):
        build_config(TrainConfig, {"batch_size": None, "tokens_per_step": 1000, "block_size": 256})
    with pytest.raises(ConfigError, match="differs from batch_size x block_size x gradient_accumulation_steps"):
        build_config(TrainConfig, {"batch_size": 4, "gradient_accumulation_steps": 2, "block_size": 256,
                                   "tokens_per_step": 4096})


def test_search_finds_the_largest_fitting_candidate_in_few_tries():
    candidates = [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]
    for limit in [0, 1, 5, 6, 16, 47, 48, 100]:
        for start in [1, 6, 48]:
            tried = []

            def fits(b, tried=tried, limit=limit):
                tried.append(b)
                return b <= limit

            expected = max([b for b in candidates if b <= limit], default=None)
            assert plan.search_batch(candidates, start, fits) == expected
            assert tried[0] == max(b for b in candidates if b <= start)  # the plan's estimate first
            assert len(tried) <= 5


def test_auto_on_cuda_tries_real_steps_and_survives_out_of_memory(monkeypatch, capsys):
    """A stand-in for the GPU: its training step raises torch.OutOfMemoryError above 6 sequences."""
    tried = []

    def trial_step(model, cfg, rt, batch):
        tried.append(batch)
        if batch > 6:
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")

    monkeypatch.setattr(batch_size, "trial_step", trial_step)
    monkeypatch.setattr(batch_size, "gpu_free_bytes", lambda rt: 80 * plan.GiB)
    cfg = build_config(TrainConfig, {"batch_size": None, "tokens_per_step": 48 * 32, "block_size": 32,
                                     "n_layer": 2, "n_head": 2, "n_embd": 32})
    model = model_for(tiny(n_head=2, n_embd=32))
    chosen = batch_size.choose_batch_size(cfg, model, None, Dist(), Runtime(torch.device("cuda"), torch.bfloat16))
    assert chosen.batch_size == 6 and chosen.gradient_accumulation_steps == 8  # 6 x 32 x 8 = 48 x 32 tokens
    assert tried[0] == 48 and 6 in tried and len(tried) <= 5  # the plan's estimate (80 GiB: all 48) first
    assert "batch_size=auto: 6 " in capsys.readouterr().out


def test_auto_on_cpu_picks_from_the_plan_keeps_tokens_per_step_and_resume_keeps_it(char_dataset, tmp_path,
                                                                                  monkeypatch, capsys):
    """With room for 5 sequences (a stand-in for the free RAM) it picks 4 of the 16 a step takes."""
    out = tmp_path / "out"
    args = run_args(char_dataset, out, batch_size="auto", tokens_per_step=16 * 32, gradient_accumulation_steps=1)
    cfg, _ = resolve_config(args)
    from gptkit.data.shards import read_meta

    model, _ = build_model(cfg, read_meta(char_dataset), None)
    setup = plan.Setup("cpu", torch.float32, 32, accum=2)
    room = (plan.memory(model, setup, 5).peak + plan.memory(model, setup, 6).peak) / 2
    monkeypatch.setattr(plan, "cpu_device", lambda: SimpleNamespace(capacity=room))
    train.main(args)
    saved = json.loads((out / "config.json").read_text())
    assert (saved["batch_size"], saved["gradient_accumulation_steps"]) == (4, 4)
    assert "batch_size=auto: 4 (the plan's largest for the free RAM is 5)" in capsys.readouterr().out
    monkeypatch.setattr(plan, "cpu_device", lambda: SimpleNamespace(capacity=100 * plan.GiB))  # more room now
    for max_iters, again in ((5, []), (7, ["--batch_size=auto"])):  # resumed as saved, or asking for auto again
        train.main([f"--dataset={char_dataset}", f"--out_dir={out}", "--init_from=resume", f"--max_iters={max_iters}",
                    "--device=cpu", "--compile=False", *again])
        saved = json.loads((out / "config.json").read_text())
        assert (saved["batch_size"], saved["gradient_accumulation_steps"]) == (4, 4)
    assert "batch_size=auto: 4 (the batch this run chose when it started)" in capsys.readouterr().out


def test_out_of_memory_names_the_plans_largest_micro_batch(monkeypatch):
    model = model_for(tiny(vocab=50257, block_size=256))
    cfg = build_config(TrainConfig, {"batch_size": 64, "gradient_accumulation_steps": 2, "block_size": 256,
                                     "n_layer": 2, "n_head": 4, "n_embd": 64})
    rt = Runtime(torch.device("cuda"), torch.bfloat16)
    monkeypatch.setattr(batch_size.torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=2 * plan.GiB))
    monkeypatch.setattr(batch_size, "resolve_compile", lambda flag, device: (True, ""))
    message = batch_size.oom_message(cfg, rt, Dist(), model, sharded=False)
    setup = plan.Setup("cuda", torch.bfloat16, 256, accum=2, compile=True)
    fits = plan.largest_batch(model, setup, plan.Device("", "cuda", 2 * plan.GiB, None, "").capacity)
    batch = max(b for b in plan.valid_batches(128, 1) if b <= fits)
    assert 0 < fits < 64 and "\n" not in message
    assert f"the plan puts the largest that fits this GPU (2.00 GiB) at {fits}" in message
    assert f"--batch_size={batch} --gradient_accumulation_steps={128 // batch}" in message


# ----------------------------------------------------------------------------- FSDP


def piece(p, n: int) -> int:
    """Elements of the first (largest) of n pieces cut along dim 0, from the parameter's real shape."""
    rows = p.shape[0]
    return math.ceil(rows / n) * (p.numel() // rows)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_fsdp_memory_is_the_hand_computed_sum(n):
    """Each process' pieces of every weight, gradient and AdamW state (wte's 65 rows do not split evenly: the
    pieces are rounded up), plus the root's parameters and two blocks' gathered in bf16 (the mixed-precision
    policy), plus the micro-batch's activations, unchanged; with more micro-batches per step, plus the whole
    fp32 gradients they accumulate (or, reduce-scattered every micro-batch, the sharded ones)."""
    model = model_for(tiny(vocab=65))
    setup = plan.Setup("cuda", torch.bfloat16, 32, world_size=n, parallel="fsdp")
    mem = plan.memory(model, setup, 2)
    params = list(model.parameters())
    assert model.transformer.wte.weight.shape[0] == 65
    weights = sum(piece(p, n) * 4 for p in params)
    adamw = sum(2 * piece(p, n) * 4 + 4 for p in params)  # exp_avg, exp_avg_sq, the step
    root = [p for name, p in model.named_parameters() if not name.startswith("transformer.h.")]  # wte (= head), wpe, ln_f
    block = list(model.transformer.h[0].parameters())
    gathered = sum(piece(p, n) * n * 2 for p in root) + 2 * sum(piece(p, n) * n * 2 for p in block)
    assert (mem.weights, mem.gradients, mem.optimizer, mem.gathered) == (weights, weights, adamw, gathered)
    ddp = plan.memory(model, replace(setup, world_size=1, parallel="ddp"), 2)
    assert (mem.activations, mem.autocast_copies) == (ddp.activations, 0) and ddp.autocast_copies > 0
    assert mem.accumulated == 0
    assert mem.peak == mem.weights + mem.optimizer + mem.gathered + mem.activations + mem.loss + mem.working

    accumulating = plan.memory(model, replace(setup, accum=2, reduce_every_micro_batch=False), 2)
    assert accumulating.accumulated == sum(piece(p, n) * n * 4 for p in params)
    assert accumulating.peak == (weights + adamw + gathered + accumulating.accumulated + mem.activations + mem.loss
                                 + accumulating.working)
    every = plan.memory(model, replace(setup, accum=2), 2)  # what train.py does (gptkit/parallel.py's no_sync)
    assert every.accumulated == 0
    assert every.peak == weights + adamw + gathered + weights + mem.activations + mem.loss + every.working


@pytest.mark.parametrize("optimizer, rank", [("adamw", 0), ("muon", 0), ("adamw", 4)])
def test_fsdp_on_one_device_holds_ddps_states(optimizer, rank):
    model = model_for(tiny(arch="modern" if optimizer == "muon" else "gpt2"), rank=rank)
    setup = plan.Setup("cpu", torch.float32, 32, optimizer)
    ddp, fsdp = (plan.memory(model, replace(setup, parallel=how), 2) for how in ("ddp", "fsdp"))
    assert (fsdp.weights, fsdp.gradients, fsdp.optimizer) == (ddp.weights, ddp.gradients, ddp.optimizer)
    assert (fsdp.activations, fsdp.loss) == (ddp.activations, ddp.loss) and fsdp.gathered > 0 == ddp.gathered
    with pytest.raises(ValueError, match="Setup.parallel must be one of ddp, fsdp"):
        plan.Setup("cpu", torch.float32, 32, parallel="zero")


def test_choose_parallel_takes_ddp_while_a_replica_fits_then_fsdp():
    with torch.device("meta"):  # the meta device will do
        model = GPT(tiny(vocab=50257, n_embd=128))
    setup = plan.Setup("cuda", torch.bfloat16, 32, world_size=4, compile=True)
    replica = plan.memory(model, setup, 2).peak
    sharded = plan.memory(model, replace(setup, parallel="fsdp"), 2).peak
    assert sharded < replica
    choice, why = plan.choose_parallel(model, setup, replica, batch_size=2)
    assert choice == "ddp" and why.startswith("a whole replica fits each device") and "\n" not in why
    choice, why = plan.choose_parallel(model, setup, replica - 1, batch_size=2)
    assert choice == "fsdp" and "FSDP over 4 devices needs" in why and "\n" not in why
    choice, why = plan.choose_parallel(model, setup, sharded - 1, batch_size=2)
    assert choice == "fsdp" and why.startswith("neither fits") and "--activation_checkpointing=True" in why
    # batch_size=auto: sized at micro-batch 1
    at_one = plan.memory(model, setup, 1).peak
    assert plan.choose_parallel(model, setup, at_one)[0] == "ddp"
    assert plan.choose_parallel(model, setup, at_one - 1)[0] == "fsdp"


def test_largest_batch_under_fsdp_fits_and_one_more_does_not():
    model = model_for(tiny(vocab=50257, n_embd=128))
    setup = plan.Setup("cuda", torch.bfloat16, 32, accum=2, world_size=8, parallel="fsdp")
    capacity = plan.memory(model, replace(setup, parallel="ddp"), 1).peak  # a replica fits one sequence
    largest = plan.largest_batch(model, setup, capacity)
    assert largest > plan.largest_batch(model, replace(setup, parallel="ddp"), capacity) >= 1
    assert plan.memory(model, setup, largest).peak <= capacity < plan.memory(model, setup, largest + 1).peak


def test_plan_for_8_gpus_prints_ddp_and_fsdp(tmp_path, capsys):
    report = train.main([str(REPO / "configs/gpt2_124m.py"), "--plan", "--plan_gpus=8", f"--data_root={tmp_path}",
                         "--device_memory_gb=24"])
    out = capsys.readouterr().out
    assert "memory per GPU, DDP " in out and "memory per GPU, FSDP over 8 " in out
    assert "  --parallel=auto, cuda: bfloat16, compiled, on your GPU (24 GB): ddp (a whole replica fits" in out
    cuda = report["columns"][1]
    assert cuda["fsdp_memory"]["weights"] * 8 >= cuda["memory"]["weights"] > cuda["fsdp_memory"]["weights"] * 7
    assert cuda["fsdp_memory"]["peak"] < cuda["memory"]["peak"] and cuda["parallel"]["choice"] == "ddp"
    assert [r["parallel"] for r in cuda["devices"]] == ["ddp"] * 5


def test_batch_size_auto_under_fsdp_when_no_replica_fits(tmp_path, capsys):
    """GPT-2 XL on 8 GPUs of 24 GB: no replica fits (25.9 GiB at one sequence); FSDP takes 4 of the step's 32."""
    report = train.main([str(REPO / "configs/finetune_shakespeare.py"), "--init_from=gpt2-xl", "--plan",
                         "--plan_gpus=8", "--device=cuda", "--device_memory_gb=24", "--batch_size=auto",
                         "--tokens_per_step=32768", f"--data_root={tmp_path}"])
    out = capsys.readouterr().out
    column = report["columns"][0]
    assert column["batch_size"] == 4 and column["batch_note"] == "batch_size=auto on your GPU (24 GB) under FSDP"
    assert column["parallel"]["choice"] == "fsdp" and not column["devices"][0]["fits"]
    assert column["devices"][0]["fsdp_fits"] and "--parallel=auto, on your GPU (24 GB): fsdp (a whole replica" in out
