"""Decoding K tokens per call (generate.py's decode windows): the window loop gives exactly the tokens of the
one-token path (greedy, seeded sampling, a stop token inside a window, the model's window moving, a length that
is not a multiple of K), compiles whole (fullgraph) without recompiling, and on a GPU replays as a CUDA graph
with the eager tokens."""

import pytest
import torch
import torch._dynamo
from conftest import confident_model, counting_sequences

import gptkit.generate as generate_module
from gptkit.generate import (
    CompiledDecode,
    SamplingOptions,
    compile_decode_step,
    generate,
    generate_blocks,
    generate_stream,
)
from model import GPTConfig

SAMPLED = {
    "greedy": SamplingOptions(temperature=0),
    "plain": SamplingOptions(temperature=1.0),
    "top_k": SamplingOptions(temperature=0.9, top_k=10),
    "top_p": SamplingOptions(temperature=1.1, top_p=0.8),
}


@pytest.fixture
def window_calls(monkeypatch):
    """The K of every decode_window call (each one window of K tokens), so that a test sees windows ran."""
    calls = []
    real = generate_module.decode_window

    def spy(model, state, options, steps, length=None):
        calls.append(steps)
        return real(model, state, options, steps, length)

    monkeypatch.setattr(generate_module, "decode_window", spy)
    return calls


def run(model, prompt, n, options, **kwargs):
    return generate(model, prompt, n, options, generator=torch.Generator().manual_seed(7), **kwargs)


@pytest.mark.parametrize("name", SAMPLED)
def test_a_window_gives_the_one_token_tokens(tiny_model, tiny_config, window_calls, name):
    """23 tokens in windows of 4 (after the prompt's token, five windows and two tokens of a sixth: two more
    computed and never yielded) and of 16: the tokens of one step at a time, greedy and with the same seed."""
    options = SAMPLED[name]
    prompt = torch.randint(0, tiny_config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    reference = run(tiny_model, prompt, 23, options)
    assert window_calls == []
    for K in (4, 16):
        window_calls.clear()
        assert torch.equal(run(tiny_model, prompt, 23, options, window=K), reference), K
        # Windows after the prompt's forward. One of 16 fits the 32-token context after the prompt's 5 tokens and
        # the first; the last 6 tokens then go one at a time (11 steps are left before the context is full).
        assert window_calls == ([4] * 6 if K == 4 else [16]), window_calls


def test_blocks_are_the_windows_and_the_stream_their_tokens(tiny_model, tiny_config):
    prompt = torch.randint(0, tiny_config.vocab_size, (3, 4), generator=torch.Generator().manual_seed(2))
    options = SAMPLED["plain"]

    def gen():
        return torch.Generator().manual_seed(3)

    blocks = list(generate_blocks(tiny_model, prompt, 10, options, generator=gen(), window=4))
    assert [b.shape for b in blocks] == [(3, 1), (3, 4), (3, 4), (3, 1)]  # the prompt's token, 2 windows, 1 of 4
    stream = list(generate_stream(tiny_model, prompt, 10, options, generator=gen(), window=4))
    one = list(generate_stream(tiny_model, prompt, 10, options, generator=gen()))
    assert torch.equal(torch.cat(blocks, dim=1), torch.stack(stream, dim=1))
    assert torch.equal(torch.stack(stream, dim=1), torch.stack(one, dim=1))


def first_stops(tokens: torch.Tensor, stop: int) -> list[int | None]:
    return [row.index(stop) if stop in row else None for row in tokens.tolist()]


def test_a_stop_token_inside_windows_rows_finishing_at_different_steps(tiny_model, tiny_config, window_calls):
    """A stop token that rows draw at different steps, the last one inside a window: each finished row emits the
    stop token from then on, and the decode ends at the step where every row has stopped, as one token at a
    time does (the window's later steps are computed, never yielded)."""
    K, n, T0 = 4, 26, 3
    prompt = torch.randint(0, tiny_config.vocab_size, (3, T0), generator=torch.Generator().manual_seed(6))
    options = SamplingOptions(temperature=1.0, top_k=3)
    free = run(tiny_model, prompt, n, options)[:, T0:]
    # A token every row draws, first at different steps, the last of them not at a window's end (steps 1..4,
    # 5..8, ... are windows: the first token comes from the prompt's forward).
    stop = next(t for t in range(tiny_config.vocab_size)
                if None not in (s := first_stops(free, t)) and len(set(s)) == 3 and max(s) % K != 0
                and max(s) < n - K)
    options = SamplingOptions(temperature=1.0, top_k=3, stop_token=stop)
    reference = run(tiny_model, prompt, n, options)
    got = run(tiny_model, prompt, n, options, window=K)
    assert torch.equal(got, reference)
    steps = first_stops(got[:, T0:], stop)
    assert got.size(1) == T0 + max(steps) + 1 < T0 + n  # ended at the last row's stop
    for row, s in zip(got[:, T0:].tolist(), steps):
        assert row[s:] == [stop] * (len(row) - s)
    assert window_calls == [K] * (max(steps) // K + 1)


@pytest.mark.parametrize("shift", [1, 8])
def test_windows_up_to_the_context_then_one_token_steps_as_the_window_moves(tiny_model, tiny_config, window_calls,
                                                                            shift):
    """Past block_size: a window runs only where its K steps fit before the model's window must move; the
    steps before a move, and the refills, go one token at a time. The same tokens either way, sampled."""
    options = SamplingOptions(temperature=1.0, window_shift=shift)
    prompt = torch.randint(0, tiny_config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(4))
    n = 2 * tiny_config.block_size + 3
    reference = run(tiny_model, prompt, n, options)
    for K in (4, 16):
        window_calls.clear()
        assert torch.equal(run(tiny_model, prompt, n, options, window=K), reference), K
        assert window_calls and set(window_calls) == {K}
        # (positions 5..31 hold 27 cached steps before the first move: 6 windows of 4 or one of 16)
        assert len(window_calls) >= (6 if K == 4 else 1)


def test_window_needs_a_positive_integer(tiny_model, tiny_config):
    prompt = torch.zeros(1, 2, dtype=torch.long)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="window must be an integer >= 1"):
            generate(tiny_model, prompt, 4, window=bad)


def aot_eager(fn):
    return torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=False)


def test_the_window_compiles_whole_and_gives_the_eager_tokens(tiny_model, tiny_config):
    """The window traced by torch.compile with fullgraph=True (a graph break would fail) through AOTAutograd
    (its buffers' in-place updates functionalised, as inductor sees them; no code generated), past block_size:
    the tokens of the one-token eager path, greedy and sampled with a stop token; a second generation runs the
    same graph (no recompilation)."""
    torch._dynamo.reset()
    prompt = torch.randint(0, tiny_config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(6))
    n = tiny_config.block_size + 8
    for options in (SAMPLED["greedy"], SamplingOptions(temperature=0.9, top_k=10, top_p=0.9, stop_token=3)):
        step = compile_decode_step(torch.device("cpu"), compiler=aot_eager)
        assert isinstance(step, CompiledDecode)
        reference = run(tiny_model, prompt, n, options)
        assert torch.equal(run(tiny_model, prompt, n, options, window=4, step_fn=step), reference)
        with torch._dynamo.config.patch(error_on_recompile=True):
            assert torch.equal(run(tiny_model, prompt, n, options, window=4, step_fn=step), reference)
        torch._dynamo.reset()


# ----------------------------------------------------------------------------- on a GPU


@pytest.mark.cuda
def test_cuda_graph_window_gives_the_eager_tokens():
    """On a GPU: a window of 8 steps recorded as one CUDA graph (mode="reduce-overhead"; cudagraph_or_error turns
    any "skipping cudagraphs" into a failure) gives the eager tokens, greedy and sampled with a seed, past
    block_size, twice without recompiling. Compared on a model whose predictions have a margin: inductor's
    kernels round differently from eager ones (see test_generate.py's CUDA test)."""
    import torch._inductor.config as inductor_config

    device = torch.device("cuda")
    cfg = GPTConfig(block_size=64, vocab_size=300, n_layer=2, n_head=2, n_embd=64, vocab_multiple=64)
    model = confident_model(cfg, device)
    prompt = counting_sequences(2, 5, 300, device)
    torch._dynamo.reset()
    try:
        with inductor_config.patch({"triton.cudagraph_or_error": True}):
            for options in (SamplingOptions(temperature=0), SamplingOptions(temperature=0.9, top_k=50, top_p=0.95)):
                step = compile_decode_step(device)

                def gen(options=options, **kwargs):
                    return generate(model, prompt, 80, options, generator=torch.Generator(device=device).manual_seed(1),
                                    **kwargs)

                reference = gen()
                assert torch.equal(gen(window=8, step_fn=step), reference)
                with torch._dynamo.config.patch(error_on_recompile=True):
                    assert torch.equal(gen(window=8, step_fn=step), reference)
    finally:
        torch._dynamo.reset()
