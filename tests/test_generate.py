"""Decoding (generate.py): the prefill and one-token steps, generation with and without the KV cache, the
sampling options, the Gumbel-max sampler (its distribution, its seed), the float32 head, and the compiled
one-token step."""

import dataclasses
import math

import pytest
import torch
from conftest import confident_model, counting_sequences

from gptkit.generate import (
    DECODE_COMPILE_COST,
    SamplingOptions,
    compile_decision,
    compile_decode_step,
    decode_one_token,
    decode_step,
    exponential_noise,
    generate,
    logits_to_probs,
    next_token,
    prefill,
    sample_token,
)
from model import GPT, GPTConfig, bucketed_length


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


def test_eager_steps_read_only_the_filled_cache_slots(tiny_model, tiny_config, monkeypatch):
    # An eager step asks for the slots written so far, not the whole static cache (on a CPU reading the empty
    # rest is memory traffic for nothing), which the model rounds up to its length bucket; past block_size the
    # window moves and the cache is refilled, so the slots read restart from the kept window.
    seen = []
    real = GPT._cache_slice

    def spy(self, B, pos, rows, length, exact=False):
        cache = real(self, B, pos, rows, length, exact)
        seen.append((pos.tolist(), length, cache.length))
        return cache

    monkeypatch.setattr(GPT, "_cache_slice", spy)
    prompt = torch.randint(0, tiny_config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(6))
    n = tiny_config.block_size + 8
    out = generate(tiny_model, prompt, n, SamplingOptions(temperature=0, window_shift=4))
    assert seen[0] == (list(range(5)), 5, 5)  # the prompt's forward
    for positions, asked, read in seen[1:]:
        assert asked == positions[-1] + 1  # every slot before and at the newest token, nothing beyond
        # a one-token step reads its length bucket; a refill of the window reads exactly its slots (causal)
        assert read == (bucketed_length(asked, tiny_config.block_size) if len(positions) == 1 else asked)
    assert any(len(p) > 1 for p, _, _ in seen[1:])  # the window moved and was refilled at least once
    monkeypatch.undo()
    assert torch.equal(out, generate(tiny_model, prompt, n, SamplingOptions(temperature=0, window_shift=4),
                                     use_cache=False))


@pytest.mark.parametrize("shift", [1, 5])
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


def window_reference(model: GPT, prompt: torch.Tensor, n: int, shift: int) -> torch.Tensor:
    """Greedy decoding written out: no cache, a full forward per token over the window, which starts at 0 and
    moves `shift` tokens forward whenever the next token would not fit in block_size (shift=1: nanoGPT's loop,
    the last block_size tokens every time)."""
    bs, seq, start = model.config.block_size, prompt, 0
    for _ in range(n):
        if seq.size(1) - start > bs:
            start += shift
        logits, _ = model(seq[:, start:])
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq


def test_the_default_window_slides_one_token_as_model_generate_does(tiny_model, tiny_config):
    """Past block_size the default is exact: nanoGPT's window (the last block_size tokens), the same tokens as
    model.generate, with the KV cache (which it must rebuild every token) or without it."""
    prompt = torch.randint(0, tiny_config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(9))
    n = 2 * tiny_config.block_size
    assert SamplingOptions().window_shift == 1
    expected = window_reference(tiny_model, prompt, n, shift=1)
    assert torch.equal(generate(tiny_model, prompt, n, SamplingOptions(temperature=0)), expected)
    assert torch.equal(generate(tiny_model, prompt, n, SamplingOptions(temperature=0), use_cache=False), expected)
    assert torch.equal(tiny_model.generate(prompt, n, temperature=0), expected)


def test_a_larger_window_shift_moves_the_window_that_many_tokens(tiny_model, tiny_config):
    """window_shift=N (sample.py --window_shift): the faster approximation. Up to block_size tokens it is the
    exact window; past it, each token sees the window as it stood after the last move of N tokens."""
    bs = tiny_config.block_size
    prompt = torch.randint(0, tiny_config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(10))
    n, shift = 2 * bs, bs // 4
    out = generate(tiny_model, prompt, n, SamplingOptions(temperature=0, window_shift=shift))
    assert torch.equal(out, window_reference(tiny_model, prompt, n, shift))
    exact = generate(tiny_model, prompt, n, SamplingOptions(temperature=0))
    assert torch.equal(out[:, : bs + 1], exact[:, : bs + 1])  # the first token predicted past a full window too


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
    assert torch.equal(sample_token(probs, exponential_noise(probs.shape)), logits.argmax(-1))


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


# ----------------------------------------------------------------------------- the Gumbel-max sampler


@pytest.mark.parametrize(
    "options",
    [
        SamplingOptions(temperature=1.0),
        SamplingOptions(temperature=0.6),
        SamplingOptions(temperature=1.7),
        SamplingOptions(temperature=1.0, top_k=3),
        SamplingOptions(temperature=1.0, top_p=0.8),
        SamplingOptions(temperature=1.3, top_k=4, top_p=0.9),
    ],
    ids=["T1", "T0.6", "T1.7", "topk3", "topp0.8", "T1.3-topk4-topp0.9"],
)
def test_draws_follow_logits_to_probs(options):
    """argmax(probs / Exp(1) noise) draws token i with probability probs_i: a chi-square test of 40,000 draws
    (one fixed seed) against logits_to_probs, which defines what temperature, top-k and top-p mean."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    probs = logits_to_probs(logits, options)[0].double()
    n = 40_000
    noise = exponential_noise((n, 6), generator=torch.Generator().manual_seed(0))
    tokens = next_token(logits.expand(n, -1), options, noise)
    counts = torch.bincount(tokens, minlength=6).double()
    kept = probs > 0
    assert counts[~kept].sum() == 0  # what top-k/top-p cut is never drawn
    expected = probs[kept] * n
    chi2 = ((counts[kept] - expected) ** 2 / expected).sum()
    p_value = torch.special.gammaincc((kept.sum() - 1) / 2.0, chi2 / 2)  # chi-square survival function
    assert p_value > 1e-3, (counts, expected)


@pytest.mark.parametrize("options", [SamplingOptions(temperature=0.9, top_k=50),
                                     SamplingOptions(temperature=1.2, top_k=50, top_p=0.8),
                                     SamplingOptions(temperature=0.7, top_p=0.9),
                                     SamplingOptions(temperature=1.0)])
def test_next_token_draws_among_the_candidates_what_the_full_distribution_draws(options):
    """next_token runs the race among the top-k / top-p candidates only: the very tokens that drawing from
    logits_to_probs's (B, V) distribution with the same noise gives (the engine draws that way)."""
    logits = torch.randn(2000, 1000, generator=torch.Generator().manual_seed(0)) * 3
    noise = exponential_noise(logits.shape, generator=torch.Generator().manual_seed(1))
    assert torch.equal(next_token(logits, options, noise), sample_token(logits_to_probs(logits, options), noise))


def test_sampling_needs_noise_and_zero_noise_never_picks_a_cut_token():
    logits = torch.tensor([[3.0, 0.0, -1.0]])
    with pytest.raises(ValueError, match="noise"):
        next_token(logits, SamplingOptions(temperature=1.0))
    probs = logits_to_probs(logits, SamplingOptions(top_k=1))
    assert sample_token(probs, torch.zeros(1, 3)).item() == 0  # 0/0 would be NaN, which argmax would pick


def test_a_seed_reproduces_the_samples(tiny_model, tiny_config):
    prompt = torch.randint(0, tiny_config.vocab_size, (2, 4))
    options = SamplingOptions(temperature=1.0, top_k=20)

    def run(seed, **kwargs):
        return generate(tiny_model, prompt, 30, options, generator=torch.Generator().manual_seed(seed), **kwargs)

    assert torch.equal(run(1), run(1)) and not torch.equal(run(1), run(2))
    assert torch.equal(run(1), run(1, use_cache=False))  # the same draws on both paths


# ----------------------------------------------------------------------------- the float32 head


def test_sampling_logits_are_float32_from_bf16_weights():
    cfg = GPTConfig(block_size=16, vocab_size=50, n_layer=1, n_head=2, n_embd=32, vocab_multiple=64)
    torch.manual_seed(0)
    model = GPT(cfg).eval().to(torch.bfloat16)
    idx = torch.randint(0, 50, (2, 6))
    model.setup_kv_cache(2)
    with torch.no_grad():
        logits = prefill(model, idx, torch.arange(6))
        hidden = model.hidden_states(idx, torch.arange(6))[:, -1]
        with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast does not take the head back to bf16
            again = model.head(hidden, fp32=True)
    assert logits.dtype == torch.float32 and logits.shape == (2, 50)  # the 14 padding rows are not computed
    exact = hidden.float() @ model.lm_head.weight[:50].float().t()
    assert torch.equal(logits, exact) and torch.equal(again, exact)


# ----------------------------------------------------------------------------- the compiled step


def test_compiled_step_gives_the_eager_tokens(tiny_config):
    """The whole step, forward and draw, compiled by inductor into one graph (fullgraph=True: a graph break
    would fail), gives the eager tokens: greedy, and sampled with a seed (the noise is an input of the graph).
    Past block_size, so the eager refills of the window alternate with the compiled steps. (One block: inductor
    compiles each block's kernels afresh without its cache, most of this test's time.)"""
    torch.manual_seed(0)
    tiny_model = GPT(dataclasses.replace(tiny_config, n_layer=1)).eval()
    step = compile_decode_step(torch.device("cpu"))
    prompt = torch.randint(0, tiny_config.vocab_size, (2, 5))
    n = tiny_config.block_size + 8
    greedy = SamplingOptions(temperature=0)
    assert torch.equal(generate(tiny_model, prompt, n, greedy, step_fn=step), generate(tiny_model, prompt, n, greedy))
    sampled = SamplingOptions(temperature=0.9, top_k=10, top_p=0.9)

    def run(**kwargs):
        return generate(tiny_model, prompt, n, sampled, generator=torch.Generator().manual_seed(3), **kwargs)

    assert torch.equal(run(step_fn=step), run())


def test_decode_step_is_decode_one_token_then_next_token(tiny_model, tiny_config):
    tiny_model.setup_kv_cache(2)
    x = torch.randint(0, tiny_config.vocab_size, (2, 6))
    options = SamplingOptions(temperature=0.8, top_p=0.9)
    noise = exponential_noise((2, tiny_config.vocab_size), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        prefill(tiny_model, x[:, :5], torch.arange(5))
        token = decode_step(tiny_model, x[:, 5:], torch.tensor([5]), options, noise)
        prefill(tiny_model, x[:, :5], torch.arange(5))
        logits = decode_one_token(tiny_model, x[:, 5:], torch.tensor([5]))
    tiny_model.clear_kv_cache()
    assert torch.equal(token, next_token(logits, options, noise))


def test_compile_decision_by_device_and_length(monkeypatch):
    cpu = torch.device("cpu")
    assert compile_decision(cpu, None, 10**9)[0] is False  # not by default on the CPU (BENCHMARKS.md)
    assert compile_decision(cpu, True, 1)[0] is True and compile_decision(cpu, False, 10**9)[0] is False
    from gptkit import generate as generate_module

    monkeypatch.setattr(generate_module, "resolve_compile", lambda flag, device: (True, "compile on"))
    seconds, saved_ms = DECODE_COMPILE_COST["cuda"]
    needed = math.ceil(seconds / (saved_ms / 1000))
    cuda = torch.device("cuda")
    use, why = compile_decision(cuda, None, needed - 1)
    assert not use and "too few" in why
    use, why = compile_decision(cuda, None, needed)
    assert use and why.startswith("compiling the decode step")


def test_the_confident_model_has_a_margin():
    """What the GPU test below relies on, checked where it can run (a shorter training on the CPU)."""
    cfg = GPTConfig(block_size=16, vocab_size=300, n_layer=2, n_head=2, n_embd=64, vocab_multiple=64)
    model = confident_model(cfg, "cpu", steps=60)
    with torch.no_grad():
        top2 = model(counting_sequences(4, 16, 300, "cpu"))[0][:, 2:].topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).min() > 1.0


@pytest.mark.cuda
def test_cuda_graph_step_captures_forward_and_draw():
    """On a GPU: mode="reduce-overhead" records the whole step as a CUDA graph (cudagraph_or_error turns any
    "skipping cudagraphs" into a failure), and it gives the eager tokens, greedy and sampled with a seed; bf16
    weights give float32 logits through torch.mm's out_dtype.

    Tokens are compared on a model whose predictions have a margin: inductor's fused kernels round differently
    from eager ones, and a random model's near-tied logits would flip on that alone."""
    import torch._inductor.config as inductor_config

    device = torch.device("cuda")
    cfg = GPTConfig(block_size=64, vocab_size=300, n_layer=2, n_head=2, n_embd=64, vocab_multiple=64)
    model = confident_model(cfg, device)
    prompt = counting_sequences(2, 5, 300, device)
    with inductor_config.patch({"triton.cudagraph_or_error": True}):
        step = compile_decode_step(device)
        for options in (SamplingOptions(temperature=0), SamplingOptions(temperature=0.9, top_k=50, top_p=0.95)):
            def run(options=options, **kwargs):
                gen = torch.Generator(device=device).manual_seed(1)
                return generate(model, prompt, 80, options, generator=gen, **kwargs)

            assert torch.equal(run(step_fn=step), run())
    model.to(torch.bfloat16)
    model.setup_kv_cache(2)
    with torch.no_grad():
        hidden = model.hidden_states(prompt, torch.arange(5, device=device))[:, -1]
        logits = model.head(hidden, fp32=True)
    exact = hidden.float() @ model.lm_head.weight[:300].float().t()
    assert logits.dtype == torch.float32 and torch.allclose(logits, exact, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- the decode attention's shape


def test_decode_attention_sees_few_shapes_and_never_cudnn(monkeypatch):
    """200 eager decode steps hand scaled_dot_product_attention a handful of shapes (the key lengths in buckets
    of KV_LENGTH_BUCKET, the mask hiding the extra slots), never one per token: no backend re-plans per token,
    and cuDNN's attention (which plans per shape) is off in cached forwards. The prompt's forward is causal,
    without a mask. The tokens and logits are those of reading exactly the filled slots."""
    import model as model_module

    cfg = GPTConfig(block_size=256, vocab_size=50, n_layer=1, n_head=2, n_embd=16)
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    prompt = torch.randint(0, 50, (1, 16), generator=torch.Generator().manual_seed(1))
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        mask = None if attn_mask is None else (tuple(attn_mask.shape), attn_mask.dtype)
        seen.append((tuple(q.shape), tuple(k.shape), mask, is_causal, torch.backends.cuda.cudnn_sdp_enabled()))
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

    def logits_of_every_step():
        model.setup_kv_cache(1)
        x = generate(model, prompt, 200, SamplingOptions(temperature=0))
        with torch.no_grad():
            logits = [prefill(model, x[:, :16], torch.arange(16), length=16)]
            logits += [decode_one_token(model, x[:, t : t + 1], torch.tensor([t]), length=t + 1)
                       for t in range(16, 215)]
        return x, torch.stack(logits)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    tokens, logits = logits_of_every_step()
    prompt_call, steps = seen[0], seen[1:200]
    assert prompt_call == ((1, 2, 16, 8), (1, 2, 16, 8), None, True, False)
    assert len(steps) == 199 and {s[3] for s in steps} == {False} and {s[4] for s in steps} == {False}
    shapes = {(s[0], s[1], s[2]) for s in steps}
    assert shapes == {((1, 2, 1, 8), (1, 2, L, 8), ((1, L), torch.float32)) for L in (64, 128, 192, 256)}
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after the forward
    monkeypatch.undo()
    monkeypatch.setattr(model_module, "KV_LENGTH_BUCKET", 1)  # the exact filled slots, one shape per token
    exact_tokens, exact_logits = logits_of_every_step()
    assert torch.equal(tokens, exact_tokens) and torch.allclose(logits, exact_logits, rtol=0, atol=1e-6)
