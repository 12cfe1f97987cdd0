"""gptkit/cpu_decode.py: the packed Linear layers against F.linear (bounds derived from each format; q4_0's
against the float product of its dequantized weights, in a section of its own at the end), a tiny
GPT packed and not (logits, greedy tokens through generate, the serving engine and a compiled step), the
fallback where the kernels cannot run, and --quantize / --threads in sample.py, chat.py and serve.py (the
thread choice itself: tests/test_threads.py).

The kernels are compiled once per machine (~15 s of CPU time, then cached under torch's extension folder): only
the session fixture `kernels` waits for that; the tests that need them skip, saying why, where the CPU cannot
run them, and fail where it could but they did not build, when CI=true. The products are tested on every
variant this CPU runs (AVX-512, AVX2); the build's safety (a killed build never blocks the next) on a dummy
source through the same build function.
"""

import contextlib
import copy
import gc
import json
import os
import platform
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import confident_model, counting_sequences, torch_threads

import chat
import model as model_module
import sample
import serve
from gptkit import cpu_decode, runtime
from gptkit.chat import ChatTokens, prompt_ids
from gptkit.checkpoint import save_checkpoint
from gptkit.cpu_decode import BLOCK, PackedLinear, pack_for_cpu
from gptkit.generate import SamplingOptions, decode_one_token, decode_step, generate, prefill
from gptkit.inference import setup_inference
from gptkit.serving.engine import Engine, Finished, Request
from gptkit.tokenizer import CHAT_SPECIALS, Tokenizer
from model import GPT, GPTConfig

REPO = Path(__file__).resolve().parents[1]
U32 = 2.0**-24  # float32's unit roundoff: a rounded value is within U32 * |value| of the exact one
U16 = 2.0**-11  # float16's, for normal values
F16_TINY = 2.0**-25  # float16's absolute rounding error below its normal range (subnormals)
GREEDY = SamplingOptions(temperature=0)
# 62 characters and the chat tokens: 67 ids, the vocabulary of conftest's tiny model (n_embd 32: the kernels'
# 32-value blocks).
CHARS = sorted(set("\n !',.?012abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"))
TOKENIZER = Tokenizer({"kind": "char", "chars": CHARS}).with_special(CHAT_SPECIALS)
PROMPT = TOKENIZER.decode([10, 13, 16, 19])  # ids counting in steps of 3: what the trained model continues


def require_kernels():
    """The kernels' operators; where they are missing, a skip that says why, or, under CI (CI=true) on a CPU
    that can run them, a failure: a build that broke must not leave the suite green on torch's slow path."""
    k = cpu_decode.kernels()
    if k is None:
        message = f"the kernels cannot run here: {cpu_decode.kernels_status()}"
        if os.environ.get("CI") == "true" and cpu_decode.runnable_variants():
            pytest.fail(f"{message} (CI=true: this CPU can run them, so they must build)")
        pytest.skip(message)
    return k


@pytest.fixture(scope="session")
def kernels():
    return require_kernels()


@pytest.fixture(params=cpu_decode.runnable_variants())
def variant(request, kernels, monkeypatch):
    """Each instruction-set variant this CPU can run (AVX-512, AVX2) in turn as the one the packed layers
    call; the default one back afterwards."""
    monkeypatch.setattr(cpu_decode, "_active", cpu_decode._active)
    monkeypatch.setattr(cpu_decode, "_status", cpu_decode._status)
    cpu_decode.use_variant(request.param)
    return request.param


@pytest.fixture(autouse=True)
def one_thread():
    """One thread (on tiny matrices more only add synchronisation: 2x slower on a busy machine), and the
    count the test started with back afterwards (the scripts set it too)."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def trained():
    """A tiny GPT (conftest's tiny_config, for the whole module) trained to count in steps of 3: its greedy
    tokens have logit margins of several units, far above what the reduced formats change, so every format
    must give the same tokens."""
    config = GPTConfig(block_size=32, vocab_size=67, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=True)
    assert TOKENIZER.vocab_size == config.vocab_size
    return confident_model(config, "cpu")


@pytest.fixture(scope="module")
def ckpt(trained, tmp_path_factory):
    """The trained model saved as train.py saves one, with the chat tokenizer (so chat.py takes it too)."""
    folder = tmp_path_factory.mktemp("cpu_decode") / "out"
    meta = {"tokenizer": TOKENIZER.to_meta(), "vocab_size": TOKENIZER.vocab_size, "eot_id": TOKENIZER.eot_id,
            "splits": {}}
    save_checkpoint({"format": 1, "model_config": trained.config.to_dict(), "model": trained.state_dict(),
                     "tokenizer": meta, "step": 1, "config": {}}, folder / "best.pt")
    return folder


def packed(model, fmt):
    return pack_for_cpu(copy.deepcopy(model), fmt)


def cut(ids: list[int], stop_ids) -> list[int]:
    """ids before the first stop token."""
    return ids[: next((i for i, t in enumerate(ids) if t in stop_ids), len(ids))]


# ----------------------------------------------------------------------------- one product


def operands(M: int, N: int = 80, K: int = 96, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) * 0.05, torch.randn(N, generator=g)


def fp32_slack(x, w, b):
    """Two float32 evaluations of x @ w.T + b in different orders differ by at most twice the rounding of
    one: (K + 1) * U32 * (|x| @ |w|.T + |b|) each (first order)."""
    return 2 * (x.size(1) + 1) * U32 * (x.abs() @ w.abs().T + b.abs())


@pytest.mark.parametrize("threads", [1, 2])  # 2: the weight's rows split over threads
@pytest.mark.parametrize("N", [78, 80, 79])  # groups of three weight rows: none, two and one left over
# 1, 3: one row at a time; 4, 5, 7, 16, 64: tiles of four rows (and the rest one by one); 65: torch's product
@pytest.mark.parametrize("M", [1, 3, 4, 5, 7, 16, 64, 65])
def test_float32_equals_f_linear(variant, M, N, threads):
    torch.set_num_threads(threads)
    x, w, b = operands(M, N)
    got = PackedLinear(w, b, "float32")(x)
    assert ((got - F.linear(x, w, b)).abs() <= fp32_slack(x, w, b)).all()
    assert ((PackedLinear(w, None, "float32")(x) - F.linear(x, w)).abs() <= fp32_slack(x, w, 0 * b)).all()


def test_products_up_to_their_row_limits_are_the_kernels(variant, monkeypatch):
    """float32 up to FLOAT32_KERNEL_ROWS rows, and int8 whatever the rows (a prompt's prefill), never reach
    torch's product; float32 above the limit does."""
    def no_torch(*args):
        raise AssertionError("torch's product was called")

    x, w, b = operands(cpu_decode.FLOAT32_KERNEL_ROWS + 1)
    reference = F.linear(x, w, b)
    monkeypatch.setattr(cpu_decode.F, "linear", no_torch)
    PackedLinear(w, b, "float32")(x[: cpu_decode.FLOAT32_KERNEL_ROWS])
    PackedLinear(w, b, "int8")(torch.cat([x] * 4))  # 260 rows
    with pytest.raises(AssertionError, match="torch's product"):
        PackedLinear(w, b, "float32")(x)
    monkeypatch.undo()
    assert torch.allclose(PackedLinear(w, b, "float32")(x), reference)


@pytest.mark.parametrize("M", [1, 5, 16])  # 5: four rows at a time and one; 16: four times four
def test_float16_is_the_product_of_the_rounded_weights(variant, M):
    x, w, b = operands(M)
    got = PackedLinear(w, b, "float16")(x)
    # Each weight moves by at most U16 of itself (F16_TINY below fp16's normal range); the rest is fp32's.
    bound = U16 * (x.abs() @ w.abs().T) + F16_TINY * x.abs().sum(1, keepdim=True) + fp32_slack(x, w, b)
    assert ((got - F.linear(x, w, b)).abs() <= bound).all()
    assert ((got - F.linear(x, w.half().float(), b)).abs() <= fp32_slack(x, w, b)).all()


def q8_bound(x, w):
    """|x^ w^ - x w| summed over each 32-value block, where the kernel's x^ and w^ are x and w rounded to
    multiples of their block's scale (largest magnitude / 127): |x| sw / 2 + |w| sx / 2 + sx sw / 4 per
    product."""
    M, N = x.size(0), w.size(0)
    xb, wb = x.reshape(M, -1, BLOCK), w.reshape(N, -1, BLOCK)
    sx, sw = xb.abs().amax(-1) / 127, wb.abs().amax(-1) / 127  # (M, B), (N, B)
    return (xb.abs().sum(-1) @ sw.T + sx @ wb.abs().sum(-1).T) / 2 + BLOCK / 4 * (sx @ sw.T)


@pytest.mark.parametrize("N", [80, 78])  # 78: the last group of four weight rows padded
@pytest.mark.parametrize("M", [1, 7, 16, 40])  # 40: more rows than a decode step's (a prompt's prefill)
def test_int8_is_within_the_rounding_of_its_blocks(variant, M, N):
    x, w, b = operands(M, N)
    layer = PackedLinear(w, b, "int8")
    assert layer.weight.dtype == torch.int8 and layer.scale.shape == (80, 96 // BLOCK)  # groups of 4 rows
    error = (layer(x) - F.linear(x, w, b)).abs()
    bound = q8_bound(x, w) + fp32_slack(x, w, b)
    assert (error <= bound).all()
    assert error.max() > 1e-4  # the activations are quantized too (this is not the fp32 product)


@pytest.mark.parametrize("N", [80, 78])
@pytest.mark.parametrize("M", [2, 8, 9, 40])  # AVX-512: from 8 rows on, the batch path
def test_int8_rows_of_a_batch_equal_each_row_alone(variant, M, N):
    """A batch of 8 rows or more goes through the AVX-512 kernel's batch path (activations made unsigned, the
    weights' sums subtracted); one row alone through the one-row path. Both sum the same integers: equal to the bit,
    for rows of zeros, of extremes and of mixed magnitudes."""
    x, w, b = operands(M, N)
    x[0] = 0.0
    x[1, ::2], x[1, 1::2] = 1e3, -1e3  # every block at +-127 after quantization
    layer = PackedLinear(w, b, "int8")
    assert torch.equal(layer(x), torch.cat([layer(x[i : i + 1]) for i in range(M)]))


def test_int8_round_trip_of_the_weights():
    w = torch.randn(7, 64) * 0.1
    w[0, :BLOCK] = 0  # a block of zeros: scale 0, no division by it
    layer = PackedLinear(w, None, "int8")
    scale = w.reshape(7, -1, BLOCK).abs().amax(-1, keepdim=True) / 127
    assert layer.dense_weight().shape == w.shape
    assert ((layer.dense_weight() - w).reshape(7, -1, BLOCK).abs() <= scale / 2 + 1e-7).all()
    assert layer.dense_weight()[0, :BLOCK].eq(0).all()
    # the kernel's layout: rows in groups of four, each 32-value block of the four rows side by side
    q, s = cpu_decode.quantize_q8(w)
    groups = layer.weight.reshape(2, 2, 4, BLOCK)  # (group, block, row, 32): row 4g + r's block b
    assert torch.equal(groups[0, 0, 1], q[1, :BLOCK]) and torch.equal(groups[0, 1, 2], q[2, BLOCK:])
    assert torch.equal(groups[1, 1, 2], q[6, BLOCK:]) and groups[1, :, 3].eq(0).all()  # row 7: padding
    assert torch.equal(layer.scale.reshape(2, 2, 4)[1, 0, :3], s[4:, 0])


# ----------------------------------------------------------------------------- a whole model


def stepwise_logits(model, ids: list[int]) -> torch.Tensor:
    """Teacher-forced logits after each of ids[1:]: one token at a time through the KV cache, the decode
    path (the kernels, int8's quantized activations); (len(ids), V)."""
    model.setup_kv_cache(1)
    with torch.no_grad():
        rows = [prefill(model, torch.tensor([ids[:1]]), torch.arange(1))]
        for t in range(1, len(ids)):
            rows.append(decode_one_token(model, torch.tensor([[ids[t]]]), torch.tensor([t]), length=t + 1))
    return torch.cat(rows)


def test_int8_logits_stay_close_to_float32_and_pick_the_same_tokens(kernels, trained):
    ids = counting_sequences(1, 32, 67, "cpu")[0].tolist()
    reference = stepwise_logits(trained, ids)
    spread = reference.max() - reference.min()  # ~12 here; the argmax leads by > 4 at every position
    # The bounds, as a share of the logits' spread: int8 rounds every weight and every activation by up to
    # 1/254 of its 32-value block's largest (0.4% each); through two blocks and the head that stays under 1%
    # (measured 0.5%). float16 rounds weights by 2**-11 (0.05%): under 0.1% (measured 0.013%). float32:
    # the same products summed in another order.
    for fmt, bound in (("float32", 1e-5 * spread), ("float16", 1e-3 * spread), ("int8", 1e-2 * spread)):
        got = stepwise_logits(packed(trained, fmt), ids)
        assert (got - reference).abs().max() < bound, fmt
        assert torch.equal(got.argmax(-1), reference.argmax(-1)), fmt  # teacher-forced agreement: 100%


def batch_logits(model, prompts: torch.Tensor, pos: list[int]) -> torch.Tensor:
    """Logits of one step of len(pos) rows, row i fed prompts[i, pos[i]] at position pos[i] after a prefill of
    every row's prompt: the serving engine's step, each row at its own position."""
    model.setup_kv_cache(prompts.size(0))
    with torch.no_grad():
        prefill(model, prompts, torch.arange(prompts.size(1)))
        token = prompts[torch.arange(len(pos)), pos][:, None]
        return decode_one_token(model, token, torch.tensor(pos)[:, None], length=max(pos) + 1)


@contextlib.contextmanager
def unfused_steps(monkeypatch):
    """Counts the one-token steps that ran Block's own forward (not block_decode) meanwhile: a list of one."""
    count, plain = [0], model_module.Block.forward

    def counted(self, x, cache=None):
        count[0] += x.size(1) == 1
        return plain(self, x, cache)

    with monkeypatch.context() as m:
        m.setattr(model_module.Block, "forward", counted)
        yield count


# 5: float32's torch product and int8's groups; 17 and 70: serve.py's batches (70: float32's products torch's
# inside the fused call, float16's blocks past FLOAT16_FUSED_ROWS, their own forward)
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 70])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_fused_block_equals_the_blocks_ops(variant, trained, rows, threads, monkeypatch):
    """block_decode (one call per block: norms, products, the cache's writes, attention, GELU, residuals) gives
    the logits of the plain model's ops, for any number of rows at their own positions; float16 blocks above
    FLOAT16_FUSED_ROWS run the block's own forward, with the same result."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(rows)
    prompts = torch.randint(67, (rows, 24), generator=g)
    pos = torch.randint(24, (rows,), generator=g).tolist()
    reference = batch_logits(trained, prompts, pos)
    spread = reference.max() - reference.min()
    for fmt, bound in (("float32", 1e-5 * spread), ("float16", 1e-3 * spread), ("int8", 1e-2 * spread)):
        model = packed(trained, fmt)
        assert all(isinstance(b, cpu_decode.PackedBlock) and b.fused for b in model.transformer.h)
        with unfused_steps(monkeypatch) as unfused:
            got = batch_logits(model, prompts, pos)
        fused = fmt != "float16" or rows <= cpu_decode.FLOAT16_FUSED_ROWS
        assert unfused[0] == (0 if fused else trained.config.n_layer), fmt
        assert (got - reference).abs().max() < bound, fmt
    # the cache rows the step wrote are the plain model's (float32: the same keys and values)
    model = packed(trained, "float32")
    batch_logits(model, prompts, pos)
    for plain, fused in zip(trained.transformer.h, model.transformer.h):
        for name in ("k", "v"):
            a, b = getattr(plain.attn.kv_cache, name), getattr(fused.attn.kv_cache, name)
            assert (a - b).abs().max() <= 1e-5 * a.abs().max(), name


@pytest.mark.parametrize("rows", [1, 5, 17])
def test_a_float16_cache_is_read_and_written_as_the_blocks_ops_do(variant, trained, rows):
    """float16, int8 and q4_0 models keep their keys and values in float16 (float32 models in float32); the fused
    step over a float16 cache gives the logits and writes the cache of the plain model's ops over a float16
    cache, to float rounding, and the cache's rounding costs little against the float32 cache."""
    for fmt in cpu_decode.FORMATS:
        assert packed(trained, fmt).cache_dtype() == (torch.float16 if fmt in cpu_decode.HALF_CACHE else torch.float32)
    g = torch.Generator().manual_seed(rows)
    prompts = torch.randint(67, (rows, 24), generator=g)
    pos = torch.randint(24, (rows,), generator=g).tolist()
    float32_cache = batch_logits(trained, prompts, pos)
    plain = copy.deepcopy(trained)
    plain.kv_cache_dtype = torch.float16
    reference = batch_logits(plain, prompts, pos)
    model = packed(trained, "float32")
    model.kv_cache_dtype = torch.float16
    got = batch_logits(model, prompts, pos)
    spread = reference.max() - reference.min()
    assert (got - reference).abs().max() < 1e-4 * spread
    assert 0 < (reference - float32_cache).abs().max() < 1e-2 * spread  # (rounded: not the float32 cache's)
    for a, b in zip(plain.transformer.h, model.transformer.h):
        for name in ("k", "v"):
            x, y = getattr(a.attn.kv_cache, name), getattr(b.attn.kv_cache, name)
            assert x.dtype == y.dtype == torch.float16
            assert (x.float() - y.float()).abs().max() <= 1e-3 * x.float().abs().max(), name


def test_the_fused_attention_at_gpt2s_head_size(variant):
    """Heads of 64 channels (GPT-2's; the tiny model's are 16), the fused attention's wide path: the plain
    model's logits, rows at their own positions (keys four at a time and the rest)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=67, n_layer=1, n_head=2, n_embd=128, dropout=0.0)).eval()
    prompts = torch.randint(67, (3, 24), generator=torch.Generator().manual_seed(1))
    pos = [23, 6, 0]
    reference = batch_logits(model, prompts, pos)
    got = batch_logits(packed(model, "float32"), prompts, pos)
    assert (got - reference).abs().max() < 1e-5 * (reference.max() - reference.min())


def test_the_modern_block_is_not_fused_and_decodes_the_same(kernels):
    """RoPE, RMSNorm, QK-norm, ReLU²: no fused op; the packed layers still give the model's tokens."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=67, n_layer=2, n_head=2, n_embd=64, arch="modern",
                          dropout=0.0)).eval()
    for p in model.parameters():  # the zero-initialised head and projections would make every logit equal
        torch.nn.init.normal_(p, std=0.2)
    prompt = counting_sequences(1, 4, 67, "cpu")
    reference = generate(model, prompt, 12, GREEDY)
    fast = packed(model, "float32")
    assert not any(b.fused for b in fast.transformer.h)
    assert torch.equal(generate(fast, prompt, 12, GREEDY), reference)


def test_every_format_generates_float32s_greedy_tokens(kernels, trained):
    prompt = counting_sequences(2, 5, 67, "cpu")
    n = 2 * trained.config.block_size + 5  # past block_size: the window moves, its prefill reruns
    reference = generate(trained, prompt, n, GREEDY)
    for fmt in cpu_decode.FORMATS:
        assert torch.equal(generate(packed(trained, fmt), prompt, n, GREEDY), reference), fmt


def engine_replies(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The engine's greedy replies to `prompts`, submitted together (one batch of len(prompts) rows)."""
    engine = Engine(model, max_batch=len(prompts))
    events = [queue.SimpleQueue() for _ in prompts]
    for ids, box in zip(prompts, events):
        engine.submit(Request(ids, max_tokens, emit=box.put))
    engine.start()
    replies = []
    for box in events:
        tokens = []
        while not isinstance(event := box.get(timeout=30), Finished):
            tokens.append(event.id)
        replies.append(tokens)
    engine.stop()
    return replies


def test_the_serving_engine_decodes_a_packed_model(kernels, trained):
    """Rows at their own positions, prompts longer than SMALL_BATCH (torch's product for the prefill) and
    shorter: every format answers what generate answers with the float32 model."""
    starts = counting_sequences(4, 20, 67, "cpu").tolist()
    prompts = [starts[0], starts[1][:3], starts[2][:9], starts[3][:1]]
    expected = [generate(trained, torch.tensor([p]), 10, GREEDY)[0, len(p):].tolist() for p in prompts]
    for fmt in cpu_decode.FORMATS:
        assert engine_replies(packed(trained, fmt), prompts, 10) == expected, fmt


@pytest.mark.parametrize("fmt", ["int8", "q4_0"])
def test_a_compiled_decode_step_calls_the_kernels_without_recompiling(kernels, trained, fmt):
    """The kernels are torch operators with fake shapes, so torch.compile traces the packed step whole
    (fullgraph). The eager backend traces like inductor without its slow code generation (inductor on the
    CPU was checked by hand: the same tokens, BENCHMARKS.md)."""
    import torch._dynamo

    prompt = counting_sequences(1, 4, 67, "cpu")
    model = packed(trained, fmt)
    reference = generate(model, prompt, 20, GREEDY)
    torch._dynamo.reset()
    compiled = torch.compile(decode_step, backend="eager", fullgraph=True, dynamic=False)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(generate(model, prompt, 20, GREEDY, step_fn=compiled), reference)
    torch._dynamo.reset()


def test_without_the_kernels_torch_computes_the_same_model(kernels, trained, monkeypatch):
    """Where the kernels cannot run (no AVX2, no compiler), PackedLinear multiplies with torch: the same
    weights, so the same logits (int8: up to its activations' rounding, which only the kernel does) and the
    same greedy tokens."""
    ids = counting_sequences(1, 24, 67, "cpu")[0].tolist()
    models = {fmt: packed(trained, fmt) for fmt in cpu_decode.FORMATS}
    with_kernels = {fmt: stepwise_logits(m, ids) for fmt, m in models.items()}
    tokens = {fmt: generate(m, torch.tensor([ids[:4]]), 30, GREEDY) for fmt, m in models.items()}
    monkeypatch.setattr(cpu_decode, "kernels", lambda: None)
    spread = with_kernels["float32"].max() - with_kernels["float32"].min()
    for fmt, model in models.items():
        bound = (1e-2 if fmt in ("int8", "q4_0") else 1e-5) * spread  # as in the test above
        assert (stepwise_logits(model, ids) - with_kernels[fmt]).abs().max() < bound, fmt
        assert torch.equal(generate(model, torch.tensor([ids[:4]]), 30, GREEDY), tokens[fmt]), fmt


def test_the_packed_model_keeps_its_embedding_and_packs_the_real_vocabulary():
    cfg = GPTConfig(block_size=16, vocab_size=50, vocab_multiple=64, n_layer=1, n_head=2, n_embd=32)
    model = pack_for_cpu(GPT(cfg).eval(), "float32")
    assert isinstance(model.lm_head, PackedLinear) and model.lm_head.out_features == 50
    assert model.transformer.wte.weight.shape == (64, 32)
    # float32 packs without a copy: the tied head reads wte's own rows
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears == [] and len([m for m in model.modules() if isinstance(m, PackedLinear)]) == 5
    # the blocks keep their submodules' names: the same state_dict keys, the cache at block.attn.kv_cache
    assert isinstance(model.transformer.h[0], cpu_decode.PackedBlock)
    assert "transformer.h.0.attn.c_attn.weight" in model.state_dict()


# ----------------------------------------------------------------------------- building the kernels

# A library as small as can be, built through the same function as the kernels, each test into its own
# TORCH_EXTENSIONS_DIR. A compiler that holds each compile until the test lets it (it says so on one FIFO,
# then waits to read a line from another) makes "killed mid-compile" an event, not a matter of timing.
DUMMY = "int gptkit_build_test() { return 42; }\n"
HELD_COMPILER = """#!/bin/sh
case " $* " in *" -c "*) echo compiling > "$STARTED"; read line < "$GATE";; esac
exec c++ "$@"
"""
BUILD_DUMMY = """
import sys
from pathlib import Path
from gptkit.cpu_decode import build_library
print(build_library("dummy", [Path(sys.argv[1])], ["-O0"]), flush=True)
"""


def build_dummy(source: Path, extensions: Path, env: dict | None = None, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BUILD_DUMMY, str(source)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions), **(env or {})}, **popen)


@pytest.mark.parametrize("how", ["SIGKILL", "SIGINT"])
def test_a_build_killed_mid_compile_never_blocks_the_next(tmp_path, how):
    """A first start killed while its compiler runs (SIGKILL to the Python process alone, as a timeout kills a
    child; SIGINT to the whole process group, as Ctrl-C does): the next build does not wait on it, builds,
    and leaves no half-built folder."""
    source, extensions = tmp_path / "dummy.cpp", tmp_path / "extensions"
    source.write_text(DUMMY)
    compiler, started, gate = tmp_path / "held-c++", tmp_path / "started", tmp_path / "gate"
    compiler.write_text(HELD_COMPILER)
    compiler.chmod(0o755)
    os.mkfifo(started)
    os.mkfifo(gate)
    held = {"CXX": str(compiler), "STARTED": str(started), "GATE": str(gate)}
    first = build_dummy(source, extensions, held, start_new_session=True)
    try:
        # the line printed just before the compile starts (after whatever torch's import printed: a warning,
        # on a CUDA build of torch without a GPU); reading on to the end would wait for the held compiler
        seen = []
        while not seen or "compiling the CPU kernels for this machine, once" not in seen[-1]:
            seen.append(first.stderr.readline())
            assert seen[-1], f"the build ended without saying it compiles: {''.join(seen)}"
        compiling: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=lambda: compiling.put(started.read_text()), daemon=True).start()
        assert compiling.get(timeout=300) == "compiling\n"  # the compiler runs (held): kill the build now
        (building,) = extensions.glob("dummy_*.build-*")  # its private folder
        if how == "SIGKILL":
            first.kill()
        else:
            os.killpg(first.pid, signal.SIGINT)
        first.communicate(timeout=120)
        assert first.returncode != 0
        assert not list(extensions.glob("dummy_*/*.so")) and list(extensions.glob("dummy_*.lock"))
        # The next start, with the real compiler: a hang would show as this timeout, not as a slow pass.
        second = build_dummy(source, extensions)
        out, err = second.communicate(timeout=300)
        assert second.returncode == 0, err
        assert "compiling the CPU kernels" in err and "waiting" not in err
        library = Path(out.strip().splitlines()[-1])
        assert library.is_file() and library.parent.parent == extensions
        assert not building.exists() and not list(extensions.glob("dummy_*.build-*"))
    finally:
        try:
            os.killpg(first.pid, signal.SIGKILL)  # what is left of the first start
        except ProcessLookupError:
            pass
        release(gate)  # the held compiler outlives its parent (ninja runs each command in a group of its own)


def release(gate: Path) -> None:
    """Let a compiler held on the FIFO `gate` go on (it then fails or finishes in a folder that is gone, and
    exits): nothing of a test's outlives it."""
    try:
        fd = os.open(gate, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO: no compiler is waiting on it
    except OSError:
        return
    try:
        os.write(fd, b"go\n")
    finally:
        os.close(fd)


def test_a_missing_compiler_is_a_one_line_answer(tmp_path, monkeypatch):
    source = tmp_path / "dummy.cpp"
    source.write_text(DUMMY)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(cpu_decode.KernelBuildError) as e:
        cpu_decode.build_library("dummy", [source], ["-O0"])
    assert str(e.value) == ("no C++ compiler ('no-such-compiler' not found): install one (Debian/Ubuntu: apt "
                            "install g++) or set CXX")


def test_build_ahead_from_the_command_line(kernels):
    """python -m gptkit.cpu_decode --build: the kernels this session built, found (not compiled again)."""
    done = subprocess.run([sys.executable, "-m", "gptkit.cpu_decode", "--build"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("CPU kernels ready: ")
    # nothing of ours on stderr: no compile, no wait (torch's CUDA build logs a warning there without a GPU)
    assert not [line for line in done.stderr.splitlines() if line.startswith("gptkit:")], done.stderr


def test_under_ci_kernels_that_do_not_build_fail_the_suite(monkeypatch):
    monkeypatch.setattr(cpu_decode, "kernels", lambda: None)
    monkeypatch.setattr(cpu_decode, "kernels_status", lambda: "no kernels (a compile error)")
    monkeypatch.setattr(cpu_decode, "runnable_variants", lambda: ["avx2"])
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        require_kernels()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="a compile error"):
        require_kernels()
    monkeypatch.setenv("CI", "true")  # a CPU without AVX2: nothing to build, a skip even under CI
    monkeypatch.setattr(cpu_decode, "runnable_variants", lambda: [])
    with pytest.raises(pytest.skip.Exception):
        require_kernels()


def test_the_variants_follow_the_cpus_flags(monkeypatch, tmp_path):
    """/proc/cpuinfo's flags pick the variants: AVX-512 needs F, BW, VL and VNNI; AVX2 needs FMA and F16C."""
    cpuinfo = {"avx512": "fpu avx f16c fma avx2 avx512f avx512bw avx512vl avx512_vnni avx512_bf16",
               "no vnni": "fpu avx f16c fma avx2 avx512f avx512bw avx512vl", "no fma": "fpu avx f16c avx2"}
    real_read = Path.read_text
    for case, expected in (("avx512", ["avx512", "avx2"]), ("no vnni", ["avx2"]), ("no fma", [])):
        monkeypatch.setattr(Path, "read_text", lambda self, *a, c=case, **k: (
            f"processor\t: 0\nflags\t\t: {cpuinfo[c]}\n" if str(self) == "/proc/cpuinfo" else real_read(self, *a, **k)))
        monkeypatch.setattr(cpu_decode.platform, "machine", lambda: "x86_64")
        assert cpu_decode.runnable_variants() == expected, case


# ----------------------------------------------------------------------------- threads and the default dtype


def test_setup_inference_can_leave_the_thread_count_to_the_engine():
    """serve.py's way: the count is chosen (n_threads) but not set on the calling thread, whose OpenMP
    workers would otherwise start there; sample.py's: set at once."""
    before = torch.get_num_threads()
    try:
        inference = setup_inference("cpu", "auto", "auto", threads=before + 1, set_threads=False)
        assert inference.n_threads == before + 1 and torch.get_num_threads() == before
        inference = setup_inference("cpu", "auto", "auto", threads=before + 1)
        assert inference.n_threads == before + 1 and torch.get_num_threads() == before + 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator only")
def test_freed_blocks_of_a_few_mb_are_kept_for_the_next_ones():
    """After keep_freed_memory, the serving engine's draw for 16 rows of GPT-2's 50,257 logits, made over and
    over, reuses the memory of its few-MB tensors instead of mapping them afresh each time. The oracle is the
    same draws under glibc's defaults, in a process beside it: there a 3.2 MB tensor (785 page faults) is mapped
    anew about every draw (~310,000 faults over 100 draws on one thread). Kept, an idle machine maps nothing
    anew, but a busy one now and then maps a tensor or two (0-2,400 faults over these draws; CI saw 1,568),
    so the bound is a tenth of the defaults' count, not zero. One thread: the defaults' count is steadiest
    there. Processes of their own: the suite's allocator settings and history are not these."""
    script = """
import resource, sys, torch
torch.set_num_threads(1)
from gptkit.generate import SamplingOptions, candidates, inverse_cdf_draw
from gptkit.inference import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
logits, uniform = torch.randn(16, 50257), torch.rand(16, dtype=torch.float64)
def draw():
    probs, _ = candidates(logits, SamplingOptions(temperature=0.8))
    return inverse_cdf_draw(probs, uniform)
for _ in range(10):
    draw()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(100):
    draw()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
"""

    def faults(mode: str) -> int:
        run = subprocess.run([sys.executable, "-c", script, mode], cwd=REPO, capture_output=True, text=True, check=True)
        return int(run.stdout)

    default, kept = faults("default"), faults("keep")
    assert default > 50 * 785, default  # glibc's defaults map a tensor anew at least every other draw
    assert kept < default / 10, (kept, default)


def huge_kb(t: torch.Tensor) -> int:
    """AnonHugePages of the mapping that holds t's data (Linux's /proc/self/smaps), in kB."""
    at, inside = t.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= at < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError("no mapping holds the tensor")


@pytest.mark.skipif(platform.system() != "Linux", reason="madvise's huge pages are Linux's")
def test_huge_page_copies_hold_the_same_values_in_2_mib_pages():
    """The copy is equal, starts on a 2 MiB boundary, is known as such (views too) for as long as it lives,
    and where the kernel's transparent huge pages are not switched off it is backed by them, but for its
    last part (less than 2 MiB: 4 KiB pages). A tensor under 2 MiB is left as it is."""
    t = torch.randn(1024, 2048 + 100)  # 8 MiB and 400 KiB
    kept = cpu_decode.huge_page_copy(t)
    assert torch.equal(kept, t) and kept.dtype == t.dtype and kept.data_ptr() % (2 << 20) == 0
    assert cpu_decode.in_huge_pages(kept) and cpu_decode.in_huge_pages(kept[100:]) and not cpu_decode.in_huge_pages(t)
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    if "[never]" not in mode:
        assert huge_kb(kept) == 8 * 1024, mode  # four huge pages, the last 400 KiB in small ones
    at = kept.data_ptr()
    del kept
    gc.collect()
    assert not any(lo <= at < hi for lo, hi in cpu_decode._HUGE_RANGES.values())  # forgotten with its mapping
    small = torch.randn(1000)
    assert cpu_decode.huge_page_copy(small) is small


@pytest.mark.skipif(platform.system() != "Linux", reason="madvise's huge pages are Linux's")
@pytest.mark.parametrize("fmt", cpu_decode.FORMATS)
def test_packed_weights_of_2_mib_or_more_live_in_huge_pages(fmt):
    """Every packed weight of 2 MiB or more, the tied head's included (float32: wte's own rows, moved once,
    not copied); the blocks' smaller ones, their scales and biases, gathered end to end in one mapping of huge
    pages, in the order a decode step reads them."""
    cfg = GPTConfig(block_size=16, vocab_size=1000, vocab_multiple=64, n_layer=1, n_head=2, n_embd=1024)
    model = pack_for_cpu(GPT(cfg).eval(), fmt)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    sizes = [m.weight.numel() * m.weight.element_size() for m in packed]
    assert len(packed) == 5 and any(n >= 2 << 20 for n in sizes)  # (int8: some under 2 MiB too)
    blocks, head = packed[:-1], packed[-1]
    assert head is model.lm_head and cpu_decode.in_huge_pages(head.weight) == (sizes[-1] >= 2 << 20)
    tensors = [t for m in blocks for t in (m.weight, m.scale, m.bias) if t is not None]
    small = [t for t in tensors if t.numel() * t.element_size() < 2 << 20]
    if fmt in ("float32", "float16"):  # only the biases are small, 37 kB in all: under a huge page, left as they are
        assert len(small) == 4 and not any(cpu_decode.in_huge_pages(t) for t in small)
    else:  # int8, q4_0: one weight (q4_0: two), the scales and the biases, over 2 MiB in all
        assert len(small) == {"int8": 9, "q4_0": 10}[fmt] and all(cpu_decode.in_huge_pages(t) for t in small)
        assert [t.data_ptr() for t in small] == sorted(t.data_ptr() for t in small)  # one arena, in reading order
    assert all(cpu_decode.in_huge_pages(t) for t in tensors if t.numel() * t.element_size() >= 2 << 20)
    if fmt == "float32":
        assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
        assert cpu_decode.in_huge_pages(model.transformer.wte.weight)


def test_the_cpu_default_dtype_is_float32():
    # bf16 weights decode 2x slower than fp32 on a CPU (issue 27): auto never picks a 16-bit type there.
    assert runtime.resolve_dtype("auto", torch.device("cpu")) == torch.float32


# ----------------------------------------------------------------------------- the scripts


def sample_text(capsys, ckpt, *args) -> tuple[str, str]:
    sample.main(["--device=cpu", f"--ckpt={ckpt}", f"--prompt={PROMPT}", "--temperature=0", "--max_new_tokens=40",
                 "--stream=False", *args])
    captured = capsys.readouterr()
    return captured.out, captured.err


def test_the_cpu_default_packs_float32_and_keeps_the_logits(kernels, trained, monkeypatch):
    """--quantize=auto: float32 packing on the CPU with float32 weights (the same logits, within float32's
    rounding of the products in another order), the model as loaded elsewhere."""
    inference = setup_inference("cpu", "auto", "auto", threads=1)
    assert inference.quantize == "float32" and inference.auto
    model = inference.place(copy.deepcopy(trained))
    assert isinstance(model.lm_head, PackedLinear) and model.lm_head.fmt == "float32"
    ids = counting_sequences(1, 32, 67, "cpu")[0].tolist()
    reference = stepwise_logits(trained, ids)
    assert (stepwise_logits(model, ids) - reference).abs().max() < 1e-5 * (reference.max() - reference.min())
    assert setup_inference("cpu", "bfloat16", "auto", threads=1).quantize == "none"
    assert setup_inference("cpu", "auto", "none", threads=1).quantize == "none"
    # where the kernels cannot run, auto keeps the model as loaded (torch's products would be no faster)
    monkeypatch.setattr(cpu_decode, "kernels", lambda: None)
    inference = setup_inference("cpu", "auto", "auto", threads=1)
    model = inference.place(copy.deepcopy(trained))
    assert isinstance(model.lm_head, torch.nn.Linear) and inference.quantize == "none"
    gpu = runtime.Runtime(torch.device("cuda", 0), torch.bfloat16)  # what setup_runtime gives on a GPU
    monkeypatch.setattr("gptkit.inference.setup_runtime", lambda device, dtype: gpu)
    assert setup_inference("cuda", "auto", "auto").quantize == "none"


def test_sample_py_quantize_and_threads(kernels, ckpt, capsys):
    reference, err = sample_text(capsys, ckpt, "--quantize=none")
    assert "weights" not in err and "thread" in err  # --quantize=none: the model as loaded
    out, err = sample_text(capsys, ckpt)
    status = cpu_decode.kernels_status()  # e.g. AVX-512 kernels
    assert out == reference and f"float32 weights ({status})" in err  # the default: packed float32
    for fmt in cpu_decode.FORMATS:
        out, err = sample_text(capsys, ckpt, f"--quantize={fmt}", "--threads=2")
        assert out == reference, fmt
        assert f"cpu float32, {fmt} weights ({status}), 2 threads (--threads)" in err
    assert torch.get_num_threads() == 2


def test_chat_py_quantize(kernels, trained, ckpt):
    done = subprocess.run([sys.executable, "chat.py", f"--ckpt={ckpt}", "--temperature=0", "--max_new_tokens=12",
                           "--device=cpu", "--quantize=int8"], input="hi there\n", capture_output=True, text=True,
                          cwd=REPO, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert f"int8 weights ({cpu_decode.kernels_status()}), 1 thread (OMP_NUM_THREADS)" in done.stderr
    ids = prompt_ids([{"role": "user", "content": "hi there"}], TOKENIZER)
    reply = cut(engine_replies(packed(trained, "int8"), [ids], 12)[0], ChatTokens.of(TOKENIZER).stop_ids)
    assert done.stdout.split("\n\n")[0] == TOKENIZER.decode(reply)


def test_serve_py_quantize(kernels, trained, ckpt):
    pytest.importorskip("starlette", reason="serving needs it: pip install -e \".[serve]\"")
    pytest.importorskip("uvicorn", reason="serving needs it: pip install -e \".[serve]\"")
    command = [sys.executable, "serve.py", f"--ckpt={ckpt}", "--port=0", "--device=cpu", "--quantize=float16",
               "--threads=1"]
    proc = subprocess.Popen(command, cwd=REPO, stderr=subprocess.PIPE, text=True)
    lines: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    try:
        seen, deadline = [], time.monotonic() + 60
        while not any(line.startswith("serve.py: serving") for line in seen):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(seen)
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                pass
        expected = f"float16 weights ({cpu_decode.kernels_status()}), 1 thread (--threads)"
        assert any(expected in line for line in seen), seen
        url = seen[-1].split("http://")[1].split()[0]
        body = json.dumps({"model": "out", "prompt": PROMPT, "max_tokens": 10, "temperature": 0}).encode()
        request = urllib.request.Request(f"http://{url}/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            text = json.loads(response.read())["choices"][0]["text"]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    reply = engine_replies(packed(trained, "float16"), [TOKENIZER.encode(PROMPT)], 10)[0]
    assert text == TOKENIZER.decode(cut(reply, {TOKENIZER.eot_id}))


def one_line_error(main, *args) -> str:
    with pytest.raises(SystemExit) as e:
        main(list(args))
    message = e.value.code
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message, message
    return message


@pytest.mark.parametrize("main", [sample.main, chat.main, serve.main])
def test_a_bad_quantize_value_names_the_flag_and_its_choices(main, ckpt):
    message = one_line_error(main, f"--ckpt={ckpt}", "--device=cpu", "--quantize=int4")
    assert message == "error: quantize must be one of auto, none, float32, float16, int8, q4_0; got 'int4'"


def test_quantize_is_refused_off_the_cpu_and_with_a_16_bit_dtype(ckpt, monkeypatch):
    message = one_line_error(sample.main, f"--ckpt={ckpt}", "--device=cpu", "--quantize=int8", "--dtype=bfloat16")
    assert "--quantize=int8" in message and "--dtype" in message
    assert "threads must be >= 0" in one_line_error(sample.main, f"--ckpt={ckpt}", "--device=cpu", "--threads=-2")
    gpu = runtime.Runtime(torch.device("cuda", 0), torch.bfloat16)  # what setup_runtime gives on a GPU
    monkeypatch.setattr("gptkit.inference.setup_runtime", lambda device, dtype: gpu)
    for main in (sample.main, chat.main):
        message = one_line_error(main, f"--ckpt={ckpt}", "--quantize=float16")
        assert "--quantize=float16 is for decoding on the CPU; on cuda" in message


def test_the_products_benchmark_prints_a_row_per_matrix_and_rows(kernels, capsys):
    from benchmarks import cpu_products

    cpu_products.main(["--formats=float32", "--rows=1,5", "--repeats=1", "--threads=1"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| float32 |")]
    assert len(lines) == 2 * len(cpu_products.SHAPES) and all(line.count("|") == 8 for line in lines)
    cpu_products.main(["--formats=q4_0", "--rows=2", "--repeats=1", "--threads=1"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| q4_0 |")]
    assert len(lines) == len(cpu_products.SHAPES)
    with pytest.raises(SystemExit, match="--formats 'bf16'"):
        cpu_products.main(["--formats=bf16"])


def test_the_kernels_ab_benchmark_times_both_formats_and_refuses_a_bad_baseline(kernels, capsys, tmp_path):
    """benchmarks/kernels_ab.py: this checkout's products alone (a baseline's build is a compile: by hand), a
    row with the formats (int8, q4_0 with a q8_0 and with a q6_k head) and q4_0's ratios to int8; a folder without the kernels' sources is a one-line error."""
    from benchmarks import kernels_ab

    kernels_ab.main(["--layers=1", "--steps=2", "--vocab=64", "--tokens=0"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| new |")]
    assert len(rows) == 1 and rows[0].count("|") == 10  # int8, q4_0 with either head: ms and MB, GB/s each
    ratio = r"[\d.]+ / \*\*[\d.]+x\*\* / [\d.]+"
    assert re.search(rf"\| {ratio} \| {ratio} \|$", rows[0])  # q4_0's speed over int8's, with either head
    with pytest.raises(SystemExit, match="no gptkit/csrc/kernels.h there"):
        kernels_ab.main([f"--baseline={tmp_path}", "--tokens=0"])


# ----------------------------------------------------------------------------- four-bit weights (q4_0)

# q4_0 (kernels.h's dot_group_q4): the quantizer against llama.cpp's own (gguf-py's, to the bit), the kernel's
# products against the float product of the same dequantized weights and quantized activations, a whole model
# (the fused block) against the float model of its dequantized weights, the layers kept wider, the bytes in
# memory, sample.py on a q4_0 GGUF file. The GGUF file in llama.cpp and the exact round trip: test_gguf.py.


def q8_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels quantize it (kernels.h's quantize_rows: per 32 values, scale = largest magnitude / 127,
    x * (127 / largest) rounded to the nearest, ties to even), widened back: what the integer products see."""
    xb = x.reshape(x.size(0), -1, BLOCK)
    top = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(top > 0, 127 / top, 0.0)
    return (torch.round(xb * inv) * (top / 127)).reshape(x.shape)


def dequantized(w: torch.Tensor) -> torch.Tensor:
    q, scale = cpu_decode.quantize_q4_0(w)
    return ((q.reshape(w.size(0), -1, BLOCK).float() - 8) * scale[..., None]).reshape(w.shape)


def test_the_quantizers_are_llama_cpps_to_the_bit_and_idempotent():
    """quantize_q4_0 and quantize_q8_0 give gguf-py's Q4_0 and Q8_0 (ggml's reference) values and scales,
    including a block of zeros, ties between +m and -m and blocks of one sign; and the values they stand for
    quantize to themselves (what makes a GGUF file read back and packed again the same model)."""
    gguf = pytest.importorskip("gguf", reason="the reference quantizer is gguf-py's: pip install gguf")
    torch.manual_seed(0)
    w = torch.randn(9, 160) * torch.logspace(-3, 1, 9)[:, None]  # magnitudes from 1e-3 to 10
    w[0, :BLOCK] = 0
    w[1, :BLOCK] = 0.5
    w[1, 3], w[1, 7] = -2.0, 2.0  # a tie: the first (-2) is the block's m
    w[2, BLOCK : 2 * BLOCK] = -torch.rand(BLOCK)
    Q = gguf.GGMLQuantizationType
    for quantize, qtype in ((cpu_decode.quantize_q4_0, Q.Q4_0), (cpu_decode.quantize_q8_0, Q.Q8_0)):
        q, scale = quantize(w)
        offset = 8 if qtype == Q.Q4_0 else 0
        ours = ((q.reshape(9, -1, BLOCK).float() - offset) * scale[..., None]).reshape(w.shape)
        theirs = gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), qtype), qtype)
        assert torch.equal(ours, torch.from_numpy(theirs)), qtype.name
        assert torch.equal(scale, scale.half().float())  # fp16 scales
        q2, scale2 = quantize(ours)
        assert torch.equal(q2, q) and torch.equal(scale2, scale), qtype.name
    q, scale = cpu_decode.quantize_q4_0(w)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    assert q[1, 3] == 0 and scale[1, 0] == 0.25  # m = -2 at q = 0: scale = m / -8
    # q4_0's rounding: each weight within a step (the fp16 scale's) of its value, the block's m exactly
    step = scale.repeat_interleave(BLOCK, 1).abs()
    assert ((dequantized(w) - w).abs() <= step * (1 + 2**-10)).all()


def test_the_layout_packs_two_rows_a_byte_and_rows_not_a_multiple_of_the_block_stay_float32():
    w = torch.randn(7, 64)
    layer = PackedLinear(w, None, "q4_0")
    q, _ = cpu_decode.quantize_q4_0(w)
    assert layer.weight.dtype == torch.uint8 and layer.weight.shape == (8, 32)  # 4 bits a weight, rows padded to 8
    block = layer.weight.reshape(2, 2, 2, BLOCK)  # (group, block, byte half, 32)
    assert torch.equal(block[0, 1, 0] & 15, q[0, BLOCK:]) and torch.equal(block[0, 1, 0] >> 4, q[2, BLOCK:])
    assert torch.equal(block[1, 0, 1] & 15, q[5, :BLOCK]) and block[1, 0, 1].ge(16).logical_not().all()  # row 7: 0
    assert torch.equal(cpu_decode.unpack_q4(layer.weight, 7), q)
    assert torch.equal(layer.dense_weight(), dequantized(w))
    # the scales as the file holds them, float16 (exactly the quantizer's values), in the groups of four rows
    assert layer.scale.dtype == torch.float16 and layer.scale.shape == (8, 2)
    assert torch.equal(cpu_decode.deinterleave4(layer.scale, 7, 1)[..., 0].float(), cpu_decode.quantize_q4_0(w)[1])
    assert PackedLinear(w, None, "q8_0").scale.dtype == torch.float16
    assert PackedLinear(w, None, "int8").scale.dtype == torch.float32  # int8's scales are not float16 values

    odd = torch.randn(5, 40)  # 40: not whole 32-value blocks
    kept = PackedLinear(odd, None, "q4_0")
    assert kept.kept_float32 and kept.weight.dtype == torch.float32 and torch.equal(kept.dense_weight(), odd)
    x = torch.randn(3, 40)
    assert torch.allclose(kept(x), F.linear(x, odd), rtol=0, atol=1e-6)


@pytest.mark.parametrize("threads", [1, 2])  # 2: the groups of four weight rows split over threads
@pytest.mark.parametrize("K", [64, 96])  # two and three blocks (AVX-512 takes them two at a time)
@pytest.mark.parametrize("N", [77, 80])  # 77: the last group of four rows padded
@pytest.mark.parametrize("M", [1, 3, 9, 40])  # a decode step, a few rows, a batch, a prefill
def test_products_equal_the_float_product_of_the_dequantized_operands(variant, M, N, K, threads):
    """The kernel computes x^ . w^ + b, where w^ are the q4_0 weights and x^ the activations rounded as q8_0:
    within float32's rounding of that product; not the float product itself (the rounding is real); and a
    batch's rows (its groups unpacked once) equal to the bit each row alone (unpacked in registers)."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(M * N + K)
    x, w, b = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) * 0.05, torch.randn(N, generator=g)
    layer = PackedLinear(w, b, "q4_0")
    xq, wq = q8_activations(x), layer.dense_weight()
    reference = F.linear(xq.double(), wq.double(), b.double())
    slack = 2 * (K + 1) * U32 * (xq.abs() @ wq.abs().T + b.abs())
    got = layer(x)
    assert ((got - reference).abs() <= slack).all()
    assert ((PackedLinear(w, None, "q4_0")(x) - (reference - b)).abs() <= slack).all()  # no bias
    assert (got - F.linear(x, w, b)).abs().max() > 1e-3  # four-bit weights: not the float32 product
    # from 8 rows on each group is unpacked once for all rows: the same integers summed, the same results
    assert torch.equal(got, torch.cat([layer(x[i : i + 1]) for i in range(M)]))


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
@pytest.mark.parametrize("M", [1, 3, 4, 9])  # q4_0: in registers below 8 rows, unpacked per group from 8; q8_0:
def test_float16_scales_give_the_float32_scales_results_to_the_bit(variant, fmt, M):  # AVX-512's batch way from 8
    """q4_0's and q8_0's scales are stored as float16 (their values are float16's), widened as the kernels read
    them: the products equal, to the bit, those of the same scales stored as float32, in every path (rows in
    registers, groups unpacked for a batch), on odd row counts (the last group of four padded)."""
    x, w, b = operands(M, N=77, K=160)  # 5 blocks: AVX-512's two a step and one left over
    layer = PackedLinear(w, b, fmt)
    assert layer.scale.dtype == torch.float16
    op = variant_ops_for(fmt)
    half = op(x, layer.weight, layer.scale, layer.bias, 77)
    assert torch.equal(half, op(x, layer.weight, layer.scale.float(), layer.bias, 77))
    assert torch.equal(half, layer(x))


def variant_ops_for(fmt: str):
    """The product operator of the variant in use (kernels() gives it) for fmt's weights."""
    k = cpu_decode.kernels()
    return k.linear_q4 if fmt == "q4_0" else k.linear_q8


def float_twin(model: GPT, q4: GPT) -> GPT:
    """The float32 model whose every weight is q4's packed one, dequantized: the reference of its kernels."""
    twin = copy.deepcopy(model)
    for name, m in q4.named_modules():
        if isinstance(m, PackedLinear) and name != "lm_head":
            twin.get_submodule(name).weight.data.copy_(m.dense_weight())
    V = model.config.vocab_size
    twin.transformer.wte.weight.data[:V] = q4.lm_head.dense_weight()  # tied: the head's q8_0 rows, the embedding's
    assert torch.equal(q4.transformer.wte(torch.arange(V)), twin.transformer.wte.weight[:V])
    assert torch.equal(twin.lm_head.weight[:V], q4.lm_head.dense_weight())
    return twin


@pytest.mark.parametrize("rows", [1, 5, 17, 70])  # 17, 70: serve.py's batches, fused too
@pytest.mark.parametrize("threads", [1, 2])
def test_the_fused_block_computes_the_model_of_its_dequantized_weights(variant, trained, rows, threads):
    """A q4_0 model's decode step (block_decode with q4_0 products, rows at their own positions) gives the
    logits of the float32 model holding its dequantized weights, but for the activations' q8_0 rounding (the
    bound of int8's test in test_cpu_decode.py); its greedy tokens match that model's where it is confident."""
    torch.set_num_threads(threads)
    q4 = pack_for_cpu(copy.deepcopy(trained), "q4_0")
    assert all(isinstance(b, cpu_decode.PackedBlock) and b.fused for b in q4.transformer.h)
    assert q4.lm_head.fmt == "q8_0"  # n_embd 32: not whole q6_k super-blocks
    twin = float_twin(trained, q4)
    g = torch.Generator().manual_seed(rows)
    prompts = torch.randint(67, (rows, 24), generator=g)
    pos = torch.randint(24, (rows,), generator=g).tolist()
    reference = batch_logits(twin, prompts, pos)
    got = batch_logits(q4, prompts, pos)
    assert (got - reference).abs().max() < 1e-2 * (reference.max() - reference.min())


@pytest.mark.parametrize("tied", [True, False])
def test_weights_take_under_0_3x_float32s_bytes_and_the_start_up_line_says_so(tied):
    """The block matrices in q4_0: 4 bits a weight and a 16-bit scale per 32 (0.14x float32's bytes, biases
    included); the head in q6_k (n_embd 256), the token embedding read from the same q6_k rows (tied: the
    head's own, no float32 table left); the whole model's weights under 0.3x float32's; what stays wider is
    said, and a head whose rows are not whole q6_k super-blocks stays q8_0, saying why."""
    cfg = GPTConfig(block_size=16, vocab_size=500, vocab_multiple=64, n_layer=2, n_head=4, n_embd=256,
                    tie_embeddings=tied)
    model = GPT(cfg).eval()
    float32_bytes = sum(p.numel() * 4 for p in model.parameters())
    wte = model.transformer.wte.weight.detach().clone()
    model = pack_for_cpu(model, "q4_0")
    for name, m in model.named_modules():
        if isinstance(m, PackedLinear) and name != "lm_head":
            packed = sum(t.numel() * t.element_size() for t in (m.weight, m.scale, m.bias))
            assert packed <= 0.3 * 4 * m.in_features * m.out_features, name
    embedding = model.transformer.wte
    assert isinstance(embedding, cpu_decode.PackedEmbedding) and (embedding.table is model.lm_head) == tied
    assert model.lm_head.fmt == "q6_k" and model.lm_head.weight.numel() == 500 * 256 * 13 // 16  # 6.5 bits
    assert model.lm_head.scale.numel() == 500  # one fp16 d per 256 weights
    ids = torch.tensor([[0, 3, 499], [7, 7, 256]])
    wanted = cpu_decode.dequantize_q6_k(*cpu_decode.quantize_q6_k(wte[:500]))  # (the rows' quantizer: per row)
    assert torch.equal(embedding(ids), wanted[ids])
    tensors = {id(t): t for m in model.modules() for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))}
    tensors.update({id(t): t for t in (embedding.q, embedding.scale)})
    assert sum(t.numel() * t.element_size() for t in tensors.values()) <= 0.3 * float32_bytes
    report = cpu_decode.weights_report(model)
    assert "blocks q4_0" in report and "0.14x their float32 bytes" in report and "head q6_k 105.0 kB" in report  # 6.5625 bits a weight
    assert ("the head's own rows" in report) == tied and report.endswith("; KV cache float16")
    odd = pack_for_cpu(GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=1, n_head=2, n_embd=40)).eval(), "q4_0")
    report = cpu_decode.weights_report(odd)
    assert "4 kept float32" in report and "rows not a multiple of 32" in report and "h.0.attn.c_attn" in report
    narrow = pack_for_cpu(GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=1, n_head=2, n_embd=64)).eval(), "q4_0")
    assert narrow.lm_head.fmt == "q8_0" and narrow.transformer.wte.table is narrow.lm_head
    assert "head q8_0 3.5 kB (rows not a multiple of 256: not q6_k)" in cpu_decode.weights_report(narrow)


def test_sample_py_decodes_a_q4_0_gguf_file_as_the_checkpoint(kernels, trained, ckpt, capsys, tmp_path):
    """export.py --format gguf --dtype q4_0, then sample.py --ckpt FILE.gguf --quantize=q4_0 (and auto, which
    picks q4_0 for such a file): the text of the checkpoint itself at --quantize=q4_0 (the file is that model),
    and the start-up line says the bytes."""
    pytest.importorskip("gguf", reason="the GGUF export needs the gguf package: pip install gguf")
    import export

    path = tmp_path / "tiny.gguf"
    export.main([f"--ckpt={ckpt}", "--format=gguf", f"--out={path}", "--dtype=q4_0"])
    assert "q4_0 weights" in capsys.readouterr().out
    reference, _ = sample_text(capsys, ckpt, "--quantize=q4_0")
    out, err = sample_text(capsys, path, "--quantize=q4_0")
    assert out == reference and out.startswith(PROMPT)
    auto, auto_err = sample_text(capsys, path)  # --quantize=auto: a q4_0 file decodes as its own blocks
    assert auto == reference and "q4_0 weights" in auto_err
    assert "float32 weights" in sample_text(capsys, ckpt)[1]  # (a checkpoint: float32, as ever)
    assert f"{path} (GGUF, matrices in f32/q4_0/q8_0)" in err
    assert re.search(r"; weights [\d.]+ kB: blocks q4_0 [\d.]+ kB \(0\.\d+x their float32 bytes\), head q8_0 ", err)


# ----------------------------------------------------------------------------- q4_0's head in q6_k

# q6_k (llama.cpp's Q6_K: kernels.h's dot_group_q6k), the head and token embedding of q4_0 models whose n_embd
# is a multiple of 256: its blocks against gguf-py's own reading of them (to the bit), the layout, the
# kernel's products against the float product of the same dequantized weights and quantized activations, a
# q4_0 model with it against the float model of its dequantized weights. The GGUF file: test_gguf.py.


def test_q6_k_blocks_are_what_gguf_py_reads_and_round_well():
    """quantize_q6_k's values, written as GGUF Q6_K bytes, are what gguf-py (llama.cpp's reader) dequantizes
    them to, exactly, including a super-block of zeros, runs of one sign and magnitudes from 1e-3 to 10; the
    bytes read back give the same values; the scales are int8 and fp16; and six bits round far closer than
    q4_0's four (the weights' rms error under 0.3x q4_0's)."""
    gguf = pytest.importorskip("gguf", reason="the reference reader is gguf-py's: pip install gguf")
    torch.manual_seed(0)
    w = torch.randn(9, 512) * torch.logspace(-3, 1, 9)[:, None]
    w[0, :256] = 0
    w[1, 16:32] = -torch.rand(16)
    w[2, 256:] = torch.rand(256)
    q, sc, d = cpu_decode.quantize_q6_k(w)
    assert q.dtype == torch.uint8 and int(q.max()) <= 63 and sc.dtype == torch.int8 and sc.shape == (9, 32)
    assert d.shape == (9, 2) and torch.equal(d, d.half().float()) and d[0, 0] == 0
    ours = cpu_decode.dequantize_q6_k(q, sc, d)
    blocks = cpu_decode.q6_k_blocks(q, sc, d)
    assert blocks.shape == (9, 2 * 210) and blocks.dtype == torch.uint8
    theirs = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType.Q6_K)
    assert torch.equal(ours, torch.from_numpy(theirs))
    assert all(torch.equal(a, b) for a, b in zip(cpu_decode.from_q6_k_blocks(blocks, 512), (q, sc, d)))
    q4 = ((cpu_decode.quantize_q4_0(w)[0].reshape(9, -1, BLOCK).float() - 8)
          * cpu_decode.quantize_q4_0(w)[1][..., None]).reshape(w.shape)
    for row in range(1, 9):  # (row 0: half zeros)
        assert (ours[row] - w[row]).pow(2).mean() < 0.3**2 * (q4[row] - w[row]).pow(2).mean(), row


def test_the_q6_k_layout_holds_the_values_in_groups_of_four_rows():
    """pack_q6_k: per group of four rows and 32-value block, 104 bytes (the low nibbles as q4_0's, the top
    two bits of the four rows a byte, the block's 8 run scales), the d's as float16 in the groups; it unpacks
    to the same values; and a PackedLinear in q6_k gives back the dequantized weights, while rows of a length
    that is not a multiple of 256 stay float32."""
    torch.manual_seed(1)
    w = torch.randn(7, 256) * 0.1
    q, sc, d = cpu_decode.quantize_q6_k(w)
    layer = PackedLinear(w, None, "q6_k")
    assert layer.weight.shape == (8, 208) and layer.scale.shape == (8, 1) and layer.scale.dtype == torch.float16
    block = layer.weight.reshape(2, 8, 104)  # (group, block, bytes)
    assert torch.equal(block[0, 1, :32] & 15, q[0, 32:64] & 15) and torch.equal(block[0, 1, :32] >> 4, q[2, 32:64] & 15)
    assert torch.equal((block[1, 0, 64:96] >> 2) & 3, q[5, :32] >> 4)  # group 1's row 1
    assert torch.equal(block[1, 2, 96:98].view(torch.int8), sc[4, 4:6])  # group 1's row 0, block 2's two runs
    assert (block[1, :, 64:96] >> 6).eq(0).all()  # row 7 (padding): zeros
    assert all(torch.equal(a, b) for a, b in zip(cpu_decode.unpack_q6_k(layer.weight, layer.scale, 7), (q, sc, d)))
    assert torch.equal(layer.dense_weight(), cpu_decode.dequantize_q6_k(q, sc, d))
    kept = PackedLinear(torch.randn(5, 96), None, "q6_k")
    assert kept.kept_float32 and kept.weight.dtype == torch.float32


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("K", [256, 768])  # one super-block; three (GPT-2 small's rows)
@pytest.mark.parametrize("M", [1, 3, 9, 40])  # a decode step, a few rows, a batch (groups unpacked), a prefill
def test_q6_k_products_equal_the_float_product_of_the_dequantized_operands(variant, M, K, threads):
    """The kernel computes x^ . w^ + b, w^ the q6_k weights (each run of 16 with its own scale) and x^ the
    activations rounded as q8_0: within float32's rounding of that product, on 77 rows (the last group of four
    padded); and a batch's rows (its groups unpacked once) equal to the bit each row alone (in registers)."""
    N = 77
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(M * N + K)
    x, w, b = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) * 0.05, torch.randn(N, generator=g)
    w[:, 16:32] *= 8  # runs of very different scales side by side
    layer = PackedLinear(w, b, "q6_k")
    xq, wq = q8_activations(x), layer.dense_weight()
    reference = F.linear(xq.double(), wq.double(), b.double())
    slack = 2 * (K + 1) * U32 * (xq.abs() @ wq.abs().T + b.abs())
    got = layer(x)
    assert ((got - reference).abs() <= slack).all()
    assert ((PackedLinear(w, None, "q6_k")(x) - (reference - b)).abs() <= slack).all()  # no bias
    assert (got - F.linear(x, w, b)).abs().max() > 1e-4  # six-bit weights: not the float32 product
    assert torch.equal(got, torch.cat([layer(x[i : i + 1]) for i in range(M)]))


@pytest.mark.parametrize("tied", [True, False])
def test_a_q4_0_model_with_a_q6_k_head_is_the_model_of_its_dequantized_weights(variant, tied):
    """n_embd 256: pack_for_cpu's q4_0 puts the head in q6_k and the token embedding reads its rows (tied:
    the head's own; untied: its own table); the decode step's logits are those of the float32 model holding
    the dequantized weights, but for the activations' q8_0 rounding; q4_head="q8_0" keeps the head q8_0."""
    torch.manual_seed(3)
    model = GPT(GPTConfig(block_size=16, vocab_size=67, n_layer=1, n_head=4, n_embd=256, dropout=0.0,
                          tie_embeddings=tied)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # (an untied head starts at zero)
    q4 = pack_for_cpu(copy.deepcopy(model), "q4_0")
    assert q4.lm_head.fmt == "q6_k" and q4.transformer.wte.table.fmt == "q6_k"
    assert (q4.transformer.wte.table is q4.lm_head) == tied
    twin = copy.deepcopy(model)
    for name, m in q4.named_modules():
        if isinstance(m, PackedLinear) and name != "lm_head":
            twin.get_submodule(name).weight.data.copy_(m.dense_weight())
    twin.lm_head.weight.data[:67] = q4.lm_head.dense_weight()
    twin.transformer.wte.weight.data[:67] = q4.transformer.wte.table.dense_weight()
    assert torch.equal(q4.transformer.wte(torch.arange(67)), twin.transformer.wte.weight[:67])
    prompts = torch.randint(67, (3, 12), generator=torch.Generator().manual_seed(0))
    pos = [11, 4, 7]
    reference, got = batch_logits(twin, prompts, pos), batch_logits(q4, prompts, pos)
    # random weights: the activations' rounding moves these logits more than the trained model's (1.1% of
    # their range measured, as much as with a q8_0 head: 0.8-1.0%); a wrong run scale would move them far more
    assert (got - reference).abs().max() < 2e-2 * (reference.max() - reference.min())
    assert pack_for_cpu(copy.deepcopy(model), "q4_0", q4_head="q8_0").lm_head.fmt == "q8_0"


def test_a_compiled_decode_step_calls_the_q6_k_head_without_recompiling(kernels):
    """linear_q6k has its fake shape too: a compiled decode step of a q4_0 model with a q6_k head traces whole
    (fullgraph, the eager backend as in the test above) and decodes the eager model's tokens."""
    import torch._dynamo

    torch.manual_seed(5)
    model = GPT(GPTConfig(block_size=32, vocab_size=67, n_layer=1, n_head=4, n_embd=256, dropout=0.0)).eval()
    q4 = pack_for_cpu(model, "q4_0")
    assert q4.lm_head.fmt == "q6_k"
    prompt = counting_sequences(1, 4, 67, "cpu")
    reference = generate(q4, prompt, 6, GREEDY)
    torch._dynamo.reset()
    compiled = torch.compile(decode_step, backend="eager", fullgraph=True, dynamic=False)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(generate(q4, prompt, 6, GREEDY, step_fn=compiled), reference)
    torch._dynamo.reset()
