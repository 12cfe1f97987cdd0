"""The GPT itself (model.py): shapes, causality, init, the KV cache, and the training loss, which is computed a
slice of the sequence at a time with the plain computation's value and gradients. Decoding is tested in
test_generate.py."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import model as model_module
from model import GPT, GPTConfig, linear_cross_entropy


def test_forward_shapes_and_loss_at_init(tiny_model, tiny_config):
    torch.manual_seed(1)
    x = torch.randint(0, tiny_config.vocab_size, (4, tiny_config.block_size))
    y = torch.randint(0, tiny_config.vocab_size, (4, tiny_config.block_size))
    logits, loss = tiny_model(x, y, return_logits=True)
    assert logits.shape == (4, tiny_config.block_size, tiny_config.vocab_size)
    # With 0.02-std weights the initial predictions are near uniform: loss ~ ln(V).
    assert abs(loss.item() - math.log(tiny_config.vocab_size)) < 0.1
    logits2, loss2 = tiny_model(x)
    assert loss2 is None and torch.equal(logits, logits2)
    no_logits, loss3 = tiny_model(x, y)  # with targets the logits are made only when asked for
    assert no_logits is None and torch.allclose(loss3, loss, atol=1e-6)


def test_ignore_index_masks_targets(tiny_model, tiny_config):
    x = torch.randint(0, tiny_config.vocab_size, (2, 8))
    y = torch.randint(0, tiny_config.vocab_size, (2, 8))
    y_masked = y.clone()
    y_masked[:, 4:] = -1
    logits, loss = tiny_model(x, y_masked, return_logits=True)
    expected = torch.nn.functional.cross_entropy(logits[:, :4].reshape(-1, logits.size(-1)), y[:, :4].reshape(-1))
    assert torch.allclose(loss, expected, atol=1e-6)


def test_causality(tiny_model, tiny_config):
    torch.manual_seed(2)
    x = torch.randint(0, tiny_config.vocab_size, (2, 20))
    x2 = x.clone()
    x2[:, 12:] = torch.randint(0, tiny_config.vocab_size, (2, 8))
    a, _ = tiny_model(x)
    b, _ = tiny_model(x2)
    assert torch.equal(a[:, :12], b[:, :12])  # earlier positions never see later tokens
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_input_longer_than_block_size_is_refused(tiny_model, tiny_config):
    x = torch.zeros(1, tiny_config.block_size + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="block_size"):
        tiny_model(x)


def test_init_statistics():
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=16, vocab_size=100, n_layer=8, n_head=4, n_embd=128)
    m = GPT(cfg)
    assert m.lm_head.weight is m.transformer.wte.weight  # tied
    assert abs(m.transformer.h[0].mlp.c_fc.weight.std().item() - 0.02) < 2e-3
    proj_std = 0.02 / math.sqrt(2 * cfg.n_layer)
    assert abs(m.transformer.h[0].attn.c_proj.weight.std().item() - proj_std) < 1e-3
    assert abs(m.transformer.h[3].mlp.c_proj.weight.std().item() - proj_std) < 1e-3
    assert all(torch.count_nonzero(p) == 0 for n, p in m.named_parameters() if n.endswith(".bias"))
    names = dict(m.named_parameters())
    for key in ("transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.ln_1.weight",
                "transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_proj.weight",
                "transformer.h.0.ln_2.weight", "transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.weight",
                "transformer.ln_f.weight"):
        assert key in names
    assert names["transformer.h.0.attn.c_attn.weight"].shape == (3 * 128, 128)  # one fused QKV projection


def test_num_params_counts_tied_weight_once(tiny_model, tiny_config):
    c = tiny_config
    per_block = (3 * c.n_embd * c.n_embd + 3 * c.n_embd) + (c.n_embd * c.n_embd + c.n_embd) \
        + (8 * c.n_embd * c.n_embd + 5 * c.n_embd) + 4 * c.n_embd
    total = c.vocab_size * c.n_embd + c.block_size * c.n_embd + c.n_layer * per_block + 2 * c.n_embd
    assert tiny_model.num_params(non_embedding=False) == total
    assert tiny_model.num_params() == total - c.block_size * c.n_embd


def test_padded_vocab_is_never_a_logit():
    cfg = GPTConfig(block_size=8, vocab_size=50, n_layer=1, n_head=2, n_embd=16, vocab_multiple=64)
    m = GPT(cfg)
    assert m.transformer.wte.weight.shape[0] == 64
    logits, loss = m(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long), return_logits=True)
    assert logits.shape[-1] == 50 and torch.isfinite(loss)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n_embd=30, n_head=4), "n_embd"),
        (dict(n_layer=0), "n_layer"),
        (dict(vocab_size=-1), "vocab_size"),
        (dict(block_size=0), "block_size"),
        (dict(dropout=1.5), "dropout"),
        (dict(n_head=2.5), "n_head"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        GPTConfig(**kwargs)


def test_kv_cache_logits_equal_full_forward(tiny_model, tiny_config):
    torch.manual_seed(3)
    B, T = 3, 20
    x = torch.randint(0, tiny_config.vocab_size, (B, T))
    full, _ = tiny_model(x)
    tiny_model.setup_kv_cache(B)
    pieces = [tiny_model(x[:, :7], pos=torch.arange(7))[0]]  # prefill 7 tokens, then one at a time
    for t in range(7, T):
        pieces.append(tiny_model(x[:, t : t + 1], pos=torch.tensor([t]))[0])
    cached = torch.cat(pieces, dim=1)
    rel = (cached - full).abs().max() / full.abs().max()
    assert rel < 1e-5
    tiny_model.clear_kv_cache()


@pytest.mark.parametrize("arch", ["gpt2", "modern"])
def test_cache_rows_at_their_own_positions_equal_each_sequences_full_forward(tiny_config, arch):
    """A serving engine's cache: sequences of different lengths, each prefilled alone into its own row, then
    decoded together, every row at its own position, reading only the filled slots."""
    torch.manual_seed(4)
    model = GPT(GPTConfig(**{**tiny_config.to_dict(), "arch": arch, "bias": None})).eval()
    for p in model.parameters():  # the modern model starts with zero projections: make every path count
        torch.nn.init.normal_(p, std=0.3)
    lengths = [3, 9, 5]
    seqs = [torch.randint(0, tiny_config.vocab_size, (1, n + 4)) for n in lengths]
    model.setup_kv_cache(4)  # one row more than needed: an idle row must not matter
    with torch.no_grad():
        for row, (seq, n) in enumerate(zip(seqs, lengths)):
            model.hidden_states(seq[:, :n], torch.arange(n), rows=slice(row, row + 1))
        steps = []
        for t in range(4):
            tokens = torch.stack([seq[0, n + t] for seq, n in zip(seqs, lengths)])[:, None]  # (3, 1)
            pos = torch.tensor(lengths)[:, None] + t  # (3, 1): each row at its own position
            h = model.hidden_states(tokens, pos, rows=slice(0, 3), length=max(lengths) + t + 1)
            steps.append(model.head(h))  # (3, 1, V)
        cached = torch.cat(steps, dim=1)  # (3, 4, V)
        for row, (seq, n) in enumerate(zip(seqs, lengths)):
            full = model(seq)[0][0, n:]  # the same 4 positions, (4, V)
            torch.testing.assert_close(cached[row], full, rtol=1e-5, atol=1e-5)
    model.clear_kv_cache()


def test_cache_rows_and_length_are_checked(tiny_model):
    tiny_model.setup_kv_cache(2)
    x = torch.zeros(3, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="do not fit the cache rows"):
        tiny_model.hidden_states(x, torch.tensor([0]))
    with pytest.raises(ValueError, match="length must be in 1..32"):
        tiny_model.hidden_states(x[:2], torch.tensor([0]), length=33)
    tiny_model.clear_kv_cache()


def test_crop_block_size(tiny_model, tiny_config):
    x = torch.randint(0, tiny_config.vocab_size, (1, 16))
    before, _ = tiny_model(x)
    tiny_model.crop_block_size(16)
    after, _ = tiny_model(x)
    assert tiny_model.config.block_size == 16 and tiny_model.transformer.wpe.weight.shape[0] == 16
    assert torch.allclose(before, after)
    with pytest.raises(ValueError):
        tiny_model.crop_block_size(17)



# ----------------------------------------------------------------------------- the training loss, by chunks


def make(vocab_size=67, **kwargs) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=32, vocab_size=vocab_size, n_layer=2, n_head=2, n_embd=32, **kwargs))


def loss_and_grads(model: GPT, x, y, **kwargs):
    model.zero_grad(set_to_none=True)
    _, loss = model(x, y, **kwargs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def force_chunks(monkeypatch, model: GPT, rows: int) -> None:
    """Make model(x, y) take the chunked path with `rows` rows per chunk, even on a tiny problem."""
    monkeypatch.setitem(model_module.LOSS_CHUNK_ELEMENTS, "cpu", rows * model.config.padded_vocab_size)


@pytest.mark.parametrize("kwargs", [{}, dict(vocab_multiple=64), dict(logit_softcap=5.0)],
                         ids=["plain", "padded-vocab", "softcap"])
def test_chunked_loss_and_gradients_equal_the_plain_computation(monkeypatch, kwargs):
    model = make(**kwargs)
    torch.manual_seed(1)
    x = torch.randint(0, 67, (2, 21))
    y = torch.randint(0, 67, (2, 21))
    y[0, :5] = -1  # ignored targets count for nothing, in the value and the gradients
    plain, plain_grads = loss_and_grads(model, x, y, return_logits=True)  # F.cross_entropy on the logits
    force_chunks(monkeypatch, model, 8)  # 42 rows: five chunks of 8 and a ragged one of 2
    chunked, chunked_grads = loss_and_grads(model, x, y)
    assert torch.allclose(chunked, plain, rtol=1e-6, atol=1e-6)
    for name, g in plain_grads.items():
        assert torch.allclose(chunked_grads[name], g, rtol=1e-5, atol=1e-7), name
    with torch.no_grad():  # evaluation: the same value, no gradients formed
        assert torch.allclose(model(x, y)[1], plain, rtol=1e-6, atol=1e-6)


def test_chunked_loss_never_keeps_the_logits_for_backward(monkeypatch):
    model = make(vocab_size=1000)
    x = torch.randint(0, 1000, (2, 32))
    n_logits = x.numel() * model.config.padded_vocab_size
    force_chunks(monkeypatch, model, 16)
    for kwargs, expect_logits in (({"return_logits": True}, True), ({}, False)):
        saved = []  # the size of every tensor autograd keeps for the backward
        with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(t.numel()) or t,
                                                      lambda t: t):
            model(x, x, **kwargs)
        assert (max(saved) >= n_logits) == expect_logits


def test_chunked_loss_under_autocast_matches_the_plain_one(monkeypatch):
    model = make(vocab_multiple=64)
    x = torch.randint(0, 67, (2, 24))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain, plain_grads = loss_and_grads(model, x, x, return_logits=True)
        force_chunks(monkeypatch, model, 16)
        chunked, chunked_grads = loss_and_grads(model, x, x)
    assert abs(chunked.item() - plain.item()) < 2e-2  # bf16 matmuls in both; the chunks' lse is in fp32
    for name, g in plain_grads.items():
        assert (chunked_grads[name] - g).norm() <= 0.05 * g.norm() + 1e-6, name


def test_chunked_loss_compiles_to_the_same_values(monkeypatch):
    model = make(logit_softcap=5.0)
    x = torch.randint(0, 67, (2, 24))
    force_chunks(monkeypatch, model, 16)
    eager, eager_grads = loss_and_grads(model, x, x)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=False)  # the Function traced
    model.zero_grad(set_to_none=True)
    loss = compiled(x, x)[1]
    loss.backward()
    assert torch.allclose(loss, eager, atol=1e-6)
    for name, g in eager_grads.items():
        assert torch.allclose(dict(model.named_parameters())[name].grad, g, rtol=1e-5, atol=1e-7), name


def test_linear_cross_entropy_plain_and_chunked_agree_directly():
    torch.manual_seed(2)
    x = torch.randn(50, 8, requires_grad=True)
    w = torch.randn(13, 8, requires_grad=True)
    t = torch.randint(0, 13, (50,))
    expected = F.cross_entropy(x @ w.t(), t)
    ex_grads = torch.autograd.grad(expected, (x, w))
    got = linear_cross_entropy(x, w, t, chunk_elements=13 * 7)  # chunks of 4 rows (a power of two <= 7)
    grads = torch.autograd.grad(got, (x, w))
    assert torch.allclose(got, expected, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, ex_grads))


# ----------------------------------------------------------------------------- the head on a GPU: issue 21


def test_loss_slices_are_sized_per_device_type():
    # GPT-2's padded head: 512 rows (128 MiB of fp32 logits) on the CPU; on CUDA 4,096, so the fp32 (V, C)
    # weight gradient is re-read and re-written 8 times per 32 x 1024 micro-batch, not 64.
    assert model_module.loss_chunk_rows(50304, "cpu") == 512
    assert model_module.loss_chunk_rows(50304, "cuda") == 4096
    assert model_module.loss_chunk_rows(50304, "mps") == 512  # a device type not listed: the CPU's
    assert model_module.loss_chunk_rows(65, "cpu") >= 64 * 256  # the char models: one plain F.cross_entropy
    assert model_module.loss_chunk_rows(13, "cuda", chunk_elements=13 * 7) == 4  # a power of two
    assert model_module.loss_chunk_rows(1000, "cpu", chunk_elements=10) == 1


@pytest.mark.parametrize("chunk_rows", [1, 4, 16, 64], ids=lambda r: f"{r}-rows")
def test_loss_by_slices_of_any_size_equals_cross_entropy(chunk_rows):
    torch.manual_seed(3)
    x = torch.randn(50, 8, requires_grad=True)
    w = torch.randn(13, 8, requires_grad=True)
    t = torch.randint(0, 13, (50,))
    t[:7] = -1
    z = x @ w.t()
    expected = F.cross_entropy(3.0 * torch.tanh(z / 3.0), t, ignore_index=-1)
    ex_grads = torch.autograd.grad(expected, (x, w))
    got = linear_cross_entropy(x, w, t, softcap=3.0, chunk_elements=13 * chunk_rows)  # 64: the plain path
    grads = torch.autograd.grad(got, (x, w))
    assert torch.allclose(got, expected, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, ex_grads))


class MatmulLog(TorchDispatchMode):
    """The output shape of every matmul run inside it, and of every tensor made."""

    MATMULS = (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_, torch.ops.aten.bmm)

    def __init__(self):
        super().__init__()
        self.matmuls, self.shapes = [], set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.shapes.add(tuple(out.shape))
            if func.overloadpacket in self.MATMULS:
                self.matmuls.append(tuple(out.shape))
        return out


@pytest.mark.parametrize("frozen", ["weight", "x"])
def test_the_sliced_loss_computes_only_the_gradients_asked_for(frozen):
    """A frozen head (LoRA: the tied wte) needs no weight gradient: no (V, C) buffer and no dz^T @ x matmul,
    so two matmuls per slice instead of three; likewise no input gradient for inputs that need none."""
    torch.manual_seed(4)
    N, V, C = 40, 13, 8
    x = torch.randn(N, C, requires_grad=frozen != "x")
    w = torch.randn(V, C, requires_grad=frozen != "weight")
    t = torch.randint(0, V, (N,))
    trained = x if frozen == "weight" else w
    expected = torch.autograd.grad(F.cross_entropy(x @ w.t(), t), trained)[0]
    with MatmulLog() as log:
        loss = linear_cross_entropy(x, w, t, chunk_elements=V * 8)  # 5 slices of 8 rows
        (grad,) = torch.autograd.grad(loss, trained)
    assert torch.allclose(grad, expected, atol=1e-6)
    assert len(log.matmuls) == 2 * 5  # per slice: the logits, and the one gradient asked for
    skipped = (V, C) if frozen == "weight" else (8, C)
    assert skipped not in log.matmuls
    if frozen == "weight":
        assert (V, C) not in log.shapes  # not even the buffer for it


def test_soft_cap_is_computed_in_float32_under_autocast():
    """tanh has no autocast policy: under bf16 autocast it ran in bf16 on the plain path and in the head, in
    fp32 on the sliced path. Every path now caps the (bf16) logits in fp32."""
    model = make(logit_softcap=5.0).eval()  # 67 columns: the loss takes the plain path
    torch.manual_seed(5)
    x = torch.randint(0, 67, (2, 24))
    y = torch.randint(0, 67, (2, 24))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        h = model.hidden_states(x)
        raw = model.lm_head(h)  # the bf16 logits the cap is applied to
        logits = model(x)[0]
        loss = model(x, y)[1]
    expected = 5.0 * torch.tanh(raw.float() / 5.0)
    assert raw.dtype == torch.bfloat16 and logits.dtype == torch.float32
    assert torch.equal(logits, expected)
    assert torch.allclose(loss, F.cross_entropy(expected.flatten(0, 1), y.flatten()), rtol=0, atol=1e-6)


class TF32Log(TorchDispatchMode):
    """torch.backends.cuda.matmul.allow_tf32 as each matmul inside it saw it (CPU builds have the flag)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in MatmulLog.MATMULS:
            self.seen.append(torch.backends.cuda.matmul.allow_tf32)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def tf32_on():
    """TF32 on, as setup_runtime leaves it on CUDA, and the setting restored after the test. (Not
    monkeypatch.setattr: torch serves allow_tf32 through __getattr__/__setattr__, no attribute of the object,
    and pytest 9.2's teardown fails to put such an attribute back.)"""
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    matmul.allow_tf32 = True
    try:
        yield
    finally:
        matmul.allow_tf32 = before


def test_float32_head_runs_without_tf32_and_restores_the_setting(tf32_on):
    """setup_runtime turns TF32 on for CUDA; the float32 head (evaluation's and sampling's logits) switches it
    off for its own matmul, and back on after; the training head keeps it."""
    model = make().eval()
    h = torch.randn(3, 32)
    with torch.no_grad(), TF32Log() as fp32_head:
        model.head(h, fp32=True)
    with torch.no_grad(), TF32Log() as training_head:
        model.head(h)
    assert fp32_head.seen == [False] and training_head.seen == [True]
    assert torch.backends.cuda.matmul.allow_tf32


@pytest.mark.parametrize("multiple, tie", [(64, True), (1, True), (1, False)])
def test_grow_vocab_keeps_every_old_logit_and_starts_new_tokens_at_the_mean(multiple, tie):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=67, n_layer=1, n_head=2, n_embd=32, vocab_multiple=multiple,
                          tie_embeddings=tie)).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randint(0, 67, (2, 16))
    before = model(x)[0]
    rows = model.transformer.wte.weight.size(0)
    model.grow_vocab(71)
    after = model(x)[0]
    assert after.shape == (2, 16, 71) and model.config.vocab_size == 71
    torch.testing.assert_close(after[..., :67], before)  # the old tokens' logits, exactly as they were
    wte = model.transformer.wte.weight
    assert wte.size(0) == (rows if multiple == 64 else 71)  # GPT-2-style padding rows are used first
    torch.testing.assert_close(wte[67:71], wte[:67].mean(0).expand(4, -1))
    assert (model.lm_head.weight is wte) == tie
    head = model.lm_head.weight
    torch.testing.assert_close(head[67:71], head[:67].mean(0).expand(4, -1))
    y = torch.randint(0, 71, (2, 16))
    model(y, y)[1].backward()  # the new rows train, as inputs and as predictions
    assert wte.grad[67:71].abs().sum() > 0 and head.grad[67:71].abs().sum() > 0
    with pytest.raises(ValueError, match="not larger"):
        model.grow_vocab(71)
