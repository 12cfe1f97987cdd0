"""Decoding K tokens per call (generate.py's decode windows, and the serving engine's): the window loop gives
exactly the tokens of the one-token path (greedy, seeded sampling, a stop token inside a window, the model's
window moving, a length that is not a multiple of K; the engine's concurrent requests with their own seeds,
stop ids and max_tokens), compiles whole (fullgraph) without recompiling, and on a GPU replays as a CUDA graph
with the eager tokens."""

import pytest
import torch
import torch._dynamo
from conftest import confident_model, counting_sequences

import gptkit.generate as generate_module
from gptkit.generate import (
    CapturedWindow,
    CompiledDecode,
    SamplingOptions,
    compile_decode_step,
    generate,
    generate_blocks,
    generate_stream,
)
from gptkit.serving import engine as engine_module
from gptkit.serving.engine import Engine, Finished, Request
from model import GPT, GPTConfig

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

    def spy(model, state, options, steps, length=None, **kwargs):
        calls.append(steps)
        return real(model, state, options, steps, length, **kwargs)

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
    """On a GPU: a window of 8 calls of the compiled step recorded as one CUDA graph (CapturedWindow) gives the
    eager tokens, greedy and sampled with a seed, past block_size, twice without recompiling, the second time
    by replays only (the one-token steps around the windows: mode="reduce-overhead", whose cudagraph_or_error
    turns any "skipping cudagraphs" into a failure). Compared on a model whose predictions have a margin: inductor's
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
                (window,) = step._windows.values()
                assert isinstance(window.compiled, CapturedWindow) and window.compiled.graph is not None
                with torch._dynamo.config.patch(error_on_recompile=True):
                    assert torch.equal(gen(window=8, step_fn=step), reference)
                # Another batch size makes the KV cache anew: the recorded window must not read the freed one.
                one = generate(model, prompt[:1], 80, options, generator=torch.Generator(device=device).manual_seed(1))
                assert torch.equal(generate(model, prompt[:1], 80, options, window=8, step_fn=step,
                                            generator=torch.Generator(device=device).manual_seed(1)), one)
                assert torch.equal(gen(window=8, step_fn=step), reference)  # (the cache made anew once more)
    finally:
        torch._dynamo.reset()


# ----------------------------------------------------------------------------- the serving engine's windows

ENGINE_VOCAB = 300


@pytest.fixture(scope="module")
def random_model():
    """Untrained (nothing to train: a second at most): its draws at temperature 1 depend on every uniform drawn,
    as a confident model's would not. Rows decoded in batches of other sizes round their matmuls otherwise, but
    a token would change only on a tie within that rounding (none here: the replies are compared equal)."""
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=48, vocab_size=ENGINE_VOCAB, n_layer=2, n_head=2, n_embd=64)).eval()


def engine_prompts(n: int) -> list[list[int]]:
    torch.manual_seed(3)
    return [counting_sequences(1, 3 + (i * 5) % 11, ENGINE_VOCAB, "cpu")[0].tolist() for i in range(n)]


def served(engine: Engine, options: SamplingOptions, stops: list[frozenset] | None = None) -> list[list]:
    """Five requests of different prompts, max_tokens, seeds and stop ids: three at once, then one more at each
    of the next two steps (between windows), waiting for a row when all are busy; stepped on this thread: each
    request's events."""
    events = [[] for _ in range(5)]
    stops = stops or [frozenset()] * 5
    requests = [Request(p, 9 + 4 * i, emit=events[i].append, sampling=options, seed=20 + i, stop_ids=stops[i])
                for i, p in enumerate(engine_prompts(5))]
    for step in range(200):
        for r in requests[:3] if step == 0 else requests[step + 2: step + 3]:
            engine.submit(r)
        engine.step()
        if all(e and isinstance(e[-1], Finished) for e in events):
            return events
    raise AssertionError("the requests did not finish")


@pytest.fixture
def engine_windows(monkeypatch):
    """The rows of every decode_rows_window call: windows ran, and how full."""
    calls = []
    real = engine_module.decode_rows_window

    def spy(model, inputs, options, steps, rows, length, grow):
        calls.append(rows)
        return real(model, inputs, options, steps, rows, length, grow)

    monkeypatch.setattr(engine_module, "decode_rows_window", spy)
    return calls


def test_engine_windows_reply_as_one_token_steps(random_model, engine_windows):
    """Requests joining a running batch, each with its own seed, max_tokens and stop ids (drawn at different
    steps, inside windows): decoded 4 tokens per call, every request gets the events of one token per step,
    greedy and sampled; a row that stops in a window is told nothing after its stop."""
    sampled = SAMPLED["plain"]
    free = [[e.id for e in events[:-1]] for events in served(Engine(random_model, max_batch=3), sampled)]
    # Each request's stop: the token its reply has first at step 3 + i (its first token comes from the prompt's
    # forward, the next ones from windows of 4).
    stops = [frozenset({reply[3 + i]}) for i, reply in enumerate(free)]
    assert [reply.index(reply[3 + i]) for i, reply in enumerate(free)] == [3, 4, 5, 6, 7]
    for options, stop_ids in ((sampled, stops), (SAMPLED["greedy"], None), (SAMPLED["top_p"], None)):
        one = served(Engine(random_model, max_batch=3), options, stop_ids)
        engine_windows.clear()
        assert served(Engine(random_model, max_batch=3, window=4), options, stop_ids) == one
        assert engine_windows and max(engine_windows) == 3  # windows ran, over full batches too
        ends = [e[-1] for e in one]
        assert ends == ([Finished("stop", 3 + i) for i in range(5)] if stop_ids else
                        [Finished("length", 9 + 4 * i) for i in range(5)])


def test_engine_windows_wait_for_rows_that_need_the_host(random_model, engine_windows):
    """A row with logprobs (or logit_bias, penalties) or drawn otherwise makes the batch go a token per step;
    once it has left, windows resume. Replies as without windows."""
    options = SAMPLED["plain"]

    def replies(window):
        engine = Engine(random_model, max_batch=2, window=window)
        events = [[], []]
        engine.submit(Request([1, 2, 3], 3, emit=events[0].append, sampling=options, seed=1, logprobs=0))
        engine.submit(Request([4, 5], 12, emit=events[1].append, sampling=options, seed=2))
        while not all(e and isinstance(e[-1], Finished) for e in events):
            engine.step()
        return events

    one = replies(1)
    engine_windows.clear()
    assert replies(4) == one
    assert engine_windows == [1, 1, 1]  # after the first request's 3 tokens: the second's 9 left, 3 windows


def test_compiled_engine_windows_reply_as_eager_ones(random_model):
    """Compiled (aot_eager: Dynamo's graph and AOTAutograd's, no code generated), a window is a graph per
    bucket and options, compiled at start for window_sampling, and replies as the eager windows do."""
    options = SAMPLED["top_k"]
    eager = served(Engine(random_model, max_batch=3, window=3), options)
    graphs = []
    backend = torch._dynamo.lookup_backend("aot_eager")

    def compiler(fn):
        return torch.compile(fn, backend=lambda gm, inputs: graphs.append(gm) or backend(gm, inputs),
                             fullgraph=True, dynamic=False)

    torch._dynamo.reset()
    engine = Engine(random_model, max_batch=3, compile=True, compiler=compiler, buckets=((3,), (48,)),
                    window=3, window_sampling=options)
    engine._warm_up()
    assert len(graphs) == 2 and "as many of 3 tokens" in engine.decode_mode  # the bucket's step and window
    assert served(engine, options) == eager
    assert len(graphs) == 2
    torch._dynamo.reset()


@pytest.mark.cuda
def test_cuda_graph_engine_windows_reply_as_eager_ones():
    """On a GPU: the engine's windows, each K calls of the compiled step recorded as one CUDA graph
    (CapturedWindow), reply as the eager engine's, greedy and seeded (its one-token steps: mode="reduce-overhead",
    cudagraph_or_error failing on any "skipping cudagraphs")."""
    import torch._inductor.config as inductor_config

    cfg = GPTConfig(block_size=48, vocab_size=ENGINE_VOCAB, n_layer=2, n_head=2, n_embd=64, vocab_multiple=64)
    model = confident_model(cfg, "cuda", steps=80)
    torch._dynamo.reset()
    try:
        for options in (SamplingOptions(temperature=0), SamplingOptions(temperature=0.7, top_k=5)):
            eager = served(Engine(model, max_batch=3, compile=False), options)
            with inductor_config.patch({"triton.cudagraph_or_error": True}):
                engine = Engine(model, max_batch=3, compile=True, buckets=((3,), (48,)), window=4,
                                window_sampling=options)
                engine._warm_up()
                assert engine.compiled and "as many of 4 tokens" in engine.decode_mode
                assert all(isinstance(w, CapturedWindow) and w.graph is not None for w in engine._windows.values())
                assert served(engine, options) == eager
    finally:
        torch._dynamo.reset()
