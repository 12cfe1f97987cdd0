"""The GPT itself (model.py: shapes, causality, init, KV cache) and its decoding (generate.py: the prefill and
one-token steps, generation, the sampling options and functions)."""

import math

import pytest
import torch

from generate import (
    SamplingOptions,
    decode_one_token,
    generate,
    logits_to_probs,
    next_token,
    prefill,
    sample_token,
)
from model import GPT, GPTConfig


def test_forward_shapes_and_loss_at_init(tiny_model, tiny_config):
    torch.manual_seed(1)
    x = torch.randint(0, tiny_config.vocab_size, (4, tiny_config.block_size))
    y = torch.randint(0, tiny_config.vocab_size, (4, tiny_config.block_size))
    logits, loss = tiny_model(x, y)
    assert logits.shape == (4, tiny_config.block_size, tiny_config.vocab_size)
    # With 0.02-std weights the initial predictions are near uniform: loss ~ ln(V).
    assert abs(loss.item() - math.log(tiny_config.vocab_size)) < 0.1
    logits2, loss2 = tiny_model(x)
    assert loss2 is None and torch.equal(logits, logits2)


def test_ignore_index_masks_targets(tiny_model, tiny_config):
    x = torch.randint(0, tiny_config.vocab_size, (2, 8))
    y = torch.randint(0, tiny_config.vocab_size, (2, 8))
    y_masked = y.clone()
    y_masked[:, 4:] = -1
    logits, loss = tiny_model(x, y_masked)
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
    logits, loss = m(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
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


def test_prefill_and_decode_one_token_give_the_full_forward_logits(tiny_model, tiny_config):
    torch.manual_seed(3)
    B, T = 2, 12
    x = torch.randint(0, tiny_config.vocab_size, (B, T))
    full, _ = tiny_model(x)  # (B, T, V)
    tiny_model.setup_kv_cache(B)
    with torch.no_grad():
        logits = [prefill(tiny_model, x[:, :5], torch.arange(5))]  # the last prompt position only, (B, V)
        for t in range(5, T):
            logits.append(decode_one_token(tiny_model, x[:, t : t + 1], torch.tensor([t])))
    tiny_model.clear_kv_cache()
    assert logits[0].shape == (B, tiny_config.vocab_size)
    assert torch.allclose(torch.stack(logits, dim=1), full[:, 4:], atol=1e-5)


def test_greedy_with_cache_equals_without(tiny_model, tiny_config):
    torch.manual_seed(4)
    prompt = torch.randint(0, tiny_config.vocab_size, (3, 5))
    greedy = SamplingOptions(temperature=0)
    a = generate(tiny_model, prompt, 20, greedy)
    b = generate(tiny_model, prompt, 20, greedy, use_cache=False)
    assert a.shape == (3, 25) and torch.equal(a, b) and torch.equal(a[:, :5], prompt)


@pytest.mark.parametrize("shift", [None, 1, 5])
def test_generation_past_block_size(tiny_model, tiny_config, shift):
    torch.manual_seed(5)
    prompt = torch.randint(0, tiny_config.vocab_size, (2, 10))
    n = 3 * tiny_config.block_size
    gen = torch.Generator().manual_seed(0)
    options = SamplingOptions(temperature=0.8, top_k=20, window_shift=shift)
    a = generate(tiny_model, prompt, n, options, generator=gen)
    gen = torch.Generator().manual_seed(0)
    b = generate(tiny_model, prompt, n, options, generator=gen, use_cache=False)
    assert a.shape == (2, 10 + n) and torch.equal(a, b)


def test_sliding_window_of_one_is_the_last_block_size_tokens(tiny_model, tiny_config):
    """window_shift=1: every new token is predicted from exactly the last block_size tokens."""
    torch.manual_seed(6)
    bs = tiny_config.block_size
    prompt = torch.randint(0, tiny_config.vocab_size, (1, bs + 5))  # longer than the context
    out = generate(tiny_model, prompt, 6, SamplingOptions(temperature=0, window_shift=1))
    seq = prompt
    for _ in range(6):
        logits, _ = tiny_model(seq[:, -bs:])
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)


def test_stop_token_pads_finished_sequences(tiny_model, tiny_config):
    torch.manual_seed(7)
    prompt = torch.randint(0, tiny_config.vocab_size, (2, 4))
    free = generate(tiny_model, prompt, 10, SamplingOptions(temperature=0))
    stop = int(free[0, 6])  # a token sequence 0 emits greedily at its third new token
    out = generate(tiny_model, prompt, 10, SamplingOptions(temperature=0, stop_token=stop))
    first = (out[0, 4:] == stop).nonzero()[0].item()
    assert torch.all(out[0, 4 + first :] == stop)
    assert torch.equal(out[0, : 4 + first], free[0, : 4 + first])


def test_top_k_one_is_argmax():
    torch.manual_seed(8)
    logits = torch.randn(5, 30)
    probs = logits_to_probs(logits, SamplingOptions(temperature=1.3, top_k=1))
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert torch.allclose(probs.max(-1).values, torch.ones(5))
    assert torch.equal(sample_token(probs), logits.argmax(-1))


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = logits_to_probs(logits, SamplingOptions(temperature=1.0, top_p=0.79))
    # 0.5 alone < 0.79; 0.5 + 0.3 reaches it: exactly those two survive, renormalised.
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]), atol=1e-6)
    probs = logits_to_probs(logits, SamplingOptions(temperature=1.0, top_p=0.81))  # needs the third token too
    assert (probs > 0).sum() == 3
    # top-p applies to the renormalised top 3: 0.5/0.95 + 0.3/0.95 = 0.84 < 0.9, so all three stay
    probs = logits_to_probs(logits, SamplingOptions(temperature=1.0, top_k=3, top_p=0.9))
    assert torch.allclose(probs, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95, atol=1e-6)
    probs = logits_to_probs(logits, SamplingOptions(temperature=1.0, top_p=0.3))  # the top token alone already exceeds p
    assert torch.allclose(probs, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_top_k_keeps_exactly_k_even_with_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0]])
    probs = logits_to_probs(logits, SamplingOptions(temperature=1.0, top_k=2))
    assert (probs > 0).sum() == 2 and torch.allclose(probs.sum(), torch.tensor(1.0))


def test_temperature_zero_is_greedy_and_bad_values_are_refused():
    logits = torch.randn(3, 10)
    probs = logits_to_probs(logits, SamplingOptions(temperature=0))
    assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and torch.allclose(probs.sum(-1), torch.ones(3))
    assert torch.equal(next_token(logits, SamplingOptions(temperature=0)), logits.argmax(-1))
    for kwargs in (dict(temperature=-1), dict(top_k=0), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            SamplingOptions(**{"temperature": 1.0, **kwargs})  # the one place sampling values are checked


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_k=True), "top_k"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(stop_token=-1), "stop_token"),
        (dict(window_shift=0), "window_shift"),
    ],
)
def test_sampling_options_name_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingOptions(**kwargs)


def test_window_shift_longer_than_the_window_is_refused(tiny_model, tiny_config):
    options = SamplingOptions(window_shift=tiny_config.block_size + 1)
    with pytest.raises(ValueError, match="window_shift"):
        generate(tiny_model, torch.zeros(1, 3, dtype=torch.long), 2, options)


def test_generate_samples_in_eval_mode_and_restores_the_mode():
    cfg = GPTConfig(block_size=16, vocab_size=20, n_layer=1, n_head=2, n_embd=16, dropout=0.5)
    torch.manual_seed(0)
    model = GPT(cfg).train()
    prompt = torch.zeros(2, 3, dtype=torch.long)
    a = generate(model, prompt, 12, generator=torch.Generator().manual_seed(1))
    b = generate(model, prompt, 12, generator=torch.Generator().manual_seed(1), use_cache=False)
    assert model.training and torch.equal(a, b)  # dropout off while sampling, so both paths agree


def test_crop_block_size(tiny_model, tiny_config):
    x = torch.randint(0, tiny_config.vocab_size, (1, 16))
    before, _ = tiny_model(x)
    tiny_model.crop_block_size(16)
    after, _ = tiny_model(x)
    assert tiny_model.config.block_size == 16 and tiny_model.transformer.wpe.weight.shape[0] == 16
    assert torch.allclose(before, after)
    with pytest.raises(ValueError):
        tiny_model.crop_block_size(17)
