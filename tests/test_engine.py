"""The continuous-batching engine (gptkit/serving/engine.py): replies equal generate's, requests decoded
together equal the same requests decoded one at a time, the compiled step's replies equal the eager step's,
and the rules for stopping, cancelling and queueing."""

import queue
import threading

import pytest
import torch
from conftest import confident_model, counting_sequences

import model as model_module
from gptkit.generate import SamplingOptions, generate, inverse_cdf_draw
from gptkit.serving import engine as engine_module
from gptkit.serving.engine import (
    Engine,
    EngineStopped,
    Finished,
    QueueFull,
    Request,
    Token,
    length_buckets,
    row_buckets,
)
from model import GPT, GPTConfig

VOCAB = 300


@pytest.fixture(scope="module")
def model():
    """Trained to count in steps of 3: greedy replies have logit margins of several units, far above the
    rounding differences between a batch of one and a batch of eight."""
    cfg = GPTConfig(block_size=48, vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=64, vocab_multiple=64)
    return confident_model(cfg, "cpu", steps=80)


def run(engine: Engine, request: Request) -> tuple[list[int], Finished]:
    """Submit and wait: the reply's tokens and how it finished."""
    events = queue.SimpleQueue()
    request.emit = events.put
    engine.submit(request)
    tokens = []
    while not isinstance(event := events.get(timeout=60), Finished):
        tokens.append(event.id)
    return tokens, event


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    torch.manual_seed(seed)
    return [counting_sequences(1, 3 + (i * 5) % 11, VOCAB, "cpu")[0].tolist() for i in range(n)]


def test_greedy_reply_equals_generate(model):
    engine = Engine(model, max_batch=4).start()
    for prompt in prompts(3):
        tokens, done = run(engine, Request(prompt, 20, emit=None))
        expected = generate(model, torch.tensor([prompt]), 20, SamplingOptions(temperature=0))[0, len(prompt):]
        assert tokens == expected.tolist() and done == Finished("length", 20)
    engine.stop()


@pytest.mark.parametrize("sampling", [SamplingOptions(temperature=0), SamplingOptions(temperature=0.7, top_k=5),
                                      SamplingOptions(temperature=1.0, top_p=0.9)])
def test_requests_decoded_together_equal_one_at_a_time(model, sampling):
    """8 requests of different lengths and max_tokens submitted at once share the batch (joining and leaving
    it at different steps); each reply equals the one that request gets alone, with the same seed."""
    requests = [dict(prompt=p, max_tokens=6 + 3 * i, sampling=sampling, seed=100 + i)
                for i, p in enumerate(prompts(8, seed=1))]
    engine = Engine(model, max_batch=8).start()
    alone = [run(engine, Request(emit=None, **r)) for r in requests]
    replies: list = [None] * len(requests)

    def client(i):
        replies[i] = run(engine, Request(emit=None, **requests[i]))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine.stop()
    assert replies == alone
    assert [len(tokens) for tokens, _ in alone] == [r["max_tokens"] for r in requests]


def test_more_requests_than_rows_wait_for_a_row(model):
    engine = Engine(model, max_batch=2, max_queue=8)
    results = [queue.SimpleQueue() for _ in range(5)]
    for i, prompt in enumerate(prompts(5)):
        engine.submit(Request(prompt, 4, emit=results[i].put))
    assert engine.load == (0, 5)
    engine.step()
    assert engine.load == (2, 3)  # two rows: two decoded, three waiting
    engine.start()
    engine.stop()  # drains: every accepted request is finished
    for r in results:
        events = [r.get_nowait() for _ in range(5)]
        assert [type(e) for e in events] == [Token] * 4 + [Finished] and events[-1].reason == "length"


def test_a_full_queue_refuses_and_a_stopped_engine_too(model):
    engine = Engine(model, max_batch=1, max_queue=2)  # not started: nothing leaves the queue
    for prompt in prompts(3):  # one for the row, two waiting
        engine.submit(Request(prompt, 4, emit=lambda e: None))
    with pytest.raises(QueueFull, match="all 1 rows are busy and 2 requests are already waiting"):
        engine.submit(Request(prompts(1)[0], 4, emit=lambda e: None))
    engine.start()
    engine.stop()
    with pytest.raises(EngineStopped):
        engine.submit(Request(prompts(1)[0], 4, emit=lambda e: None))


def test_stop_tokens_end_the_reply_and_are_not_emitted(model):
    engine = Engine(model, max_batch=2)
    prompt = prompts(1)[0]
    reference = generate(model, torch.tensor([prompt]), 10, SamplingOptions(temperature=0))[0, len(prompt):]
    stop = int(reference[4])
    tokens, done = run(engine.start(), Request(prompt, 10, emit=None, stop_ids=frozenset({stop})))
    engine.stop()
    assert tokens == reference[:4].tolist() and done == Finished("stop", 4)


def test_the_context_ends_a_reply(model):
    engine = Engine(model, max_batch=2).start()
    prompt = counting_sequences(1, 40, VOCAB, "cpu")[0].tolist()  # 8 slots left of 48
    tokens, done = run(engine, Request(prompt, 100, emit=None))
    engine.stop()
    assert done == Finished("length", 9) and len(tokens) == 9  # the last one needs no slot: nothing follows it


def test_a_cancelled_request_leaves_at_once_and_the_others_go_on(model):
    engine = Engine(model, max_batch=3)
    events = [queue.SimpleQueue() for _ in range(3)]
    requests = [engine.submit(Request(p, 30, emit=events[i].put)) for i, p in enumerate(prompts(3))]
    engine.step()
    engine.step()
    assert engine.load == (3, 0)
    requests[0].cancel()
    engine.step()
    assert engine.load == (2, 0)  # its row is given back before the next decode step
    got = [events[0].get_nowait() for _ in range(events[0].qsize())]
    assert got[-1] == Finished("cancelled", 3)  # after the two steps' three tokens
    engine.start()
    engine.stop()
    for i in (1, 2):  # the request moved into the freed row carries on where it was
        got = [events[i].get_nowait() for _ in range(events[i].qsize())]
        tokens = [e.id for e in got if isinstance(e, Token)]
        alone = generate(model, torch.tensor([requests[i].prompt]), 30, SamplingOptions(temperature=0))
        assert tokens == alone[0, len(requests[i].prompt):].tolist() and got[-1] == Finished("length", 30)


def test_bad_requests_are_refused_before_they_are_queued(model):
    engine = Engine(model, max_batch=1)
    with pytest.raises(ValueError, match="the prompt has 0 tokens; it must have 1 to 48"):
        engine.submit(Request([], 4, emit=None))
    with pytest.raises(ValueError, match="the prompt has 49 tokens"):
        engine.submit(Request([1] * 49, 4, emit=None))
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        engine.submit(Request([1], 0, emit=None))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit(Request([VOCAB], 1, emit=None))
    assert engine.load == (0, 0)


def test_eager_cpu_steps_read_exactly_the_filled_slots_and_reply_as_the_length_buckets(model, monkeypatch):
    """On the CPU an eager decode step attends over exactly the slots its longest row has filled, not the
    model's length bucket above them (a full batch reads more cache than weights), and the replies are those
    of the bucketed step: greedy and seeded draws, requests joining, finishing and cancelled."""
    monkeypatch.setattr(model_module, "KV_LENGTH_BUCKET", 16)  # buckets of this scale: 16, 32, 48 slots
    real, reads = GPT._cache_slice, []

    def spy(self, B, pos, rows, length, exact=False):
        cache = real(self, B, pos, rows, length, exact)
        if pos.size(-1) == 1:  # a decode step: one token per row, each at its own position
            reads.append((int(pos.max()) + 1, cache.length))
        return cache

    monkeypatch.setattr(GPT, "_cache_slice", spy)
    exact = staggered(Engine(model, max_batch=3, compile=False))
    assert reads and all(read == filled for filled, read in reads)
    assert any(filled % 16 for filled, _ in reads)  # (lengths the buckets would have rounded up)
    reads.clear()
    bucketed = engine_module.decode_one_token
    monkeypatch.setattr(engine_module, "decode_one_token", lambda *a, **k: bucketed(*a, **{**k, "exact": False}))
    assert staggered(Engine(model, max_batch=3, compile=False)) == exact
    assert any(read > filled for filled, read in reads)  # the bucketed steps did read past the filled slots


# ----------------------------------------------------------------------------- the compiled step


def counting_compiler(graphs: list) -> callable:
    """torch.compile as the engine's default (fullgraph, static shapes: a graph per bucket) but with the aot_eager backend: Dynamo's
    graph and AOT autograd's functionalised in-place cache writes, as inductor gets them, without inductor's
    ~20 s of C++ code generation here (inductor gives the same tokens on this test, measured). Every graph
    compiled is appended to `graphs`: a recompile would show."""
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    return lambda fn: torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)


def staggered(engine: Engine) -> list[list]:
    """Seven requests, greedy and seeded draws mixed, one joining every other step: more than the engine's
    rows, so some wait, rows are handed on as requests finish (the last row moving into the hole), and one
    is cancelled half-way. Stepped on this thread, so the same steps every time: each request's events."""
    mixed = [SamplingOptions(temperature=0), SamplingOptions(temperature=0.7, top_k=5),
             SamplingOptions(temperature=1.0, top_p=0.9)]
    events = [[] for _ in range(7)]
    requests = [Request(p, 4 + 3 * i, emit=events[i].append, sampling=mixed[i % 3], seed=50 + i)
                for i, p in enumerate(prompts(7, seed=2))]
    for step in range(200):
        if step % 2 == 0 and step // 2 < len(requests):
            engine.submit(requests[step // 2])
        if step == 9:
            requests[2].cancel()
        engine.step()
        if all(e and isinstance(e[-1], Finished) for e in events):
            return events
    raise AssertionError("the requests did not finish")


def test_the_compiled_step_replies_exactly_as_the_eager_step(model, monkeypatch):
    """The compiled step runs a bucket of rows and slots picked per step (the fewest that hold the live rows
    and their next positions), one graph per bucket, and replies exactly as the eager step: greedy and seeded
    draws, requests joining, finishing and cancelled, rows moved into holes."""
    monkeypatch.setattr(model_module, "KV_LENGTH_BUCKET", 16)  # the model's length buckets at this scale
    eager = staggered(Engine(model, max_batch=3, compile=False))
    graphs, picked = [], []
    engine = Engine(model, max_batch=3, compile=True, compiler=counting_compiler(graphs),
                    buckets=((2, 3), (16, 48)))
    real = engine.bucket
    engine.bucket = lambda rows: picked.append(real(rows)) or picked[-1]
    assert staggered(engine) == eager
    assert set(picked) == {(2, 16), (2, 48), (3, 16), (3, 48)}  # every bucket was used ...
    assert len(graphs) == 4  # ... each compiled once, whoever is in the batch
    ends = [e[-1] for e in eager]
    assert ends[2].reason == "cancelled" and [x.reason for x in ends[:2] + ends[3:]] == ["length"] * 6


def test_default_buckets():
    assert row_buckets(16) == (4, 16) and row_buckets(64) == (4, 16, 64) and row_buckets(3) == (3,)
    assert length_buckets(1024) == (256, 1024) and length_buckets(48) == (48,)
    with pytest.raises(ValueError, match="buckets must be ascending"):
        Engine(GPT(GPTConfig(block_size=16, vocab_size=20, n_layer=1, n_head=1, n_embd=8)), max_batch=4,
               buckets=((2,), (16,)))


def test_start_compiles_the_step_before_serving(model):
    graphs = []
    engine = Engine(model, max_batch=2, compile=True, compiler=counting_compiler(graphs)).start()
    assert engine.decode_mode.startswith("decode step compiled in") and len(graphs) == 1
    prompt = prompts(1)[0]
    tokens, done = run(engine, Request(prompt, 12, emit=None))
    engine.stop()
    expected = generate(model, torch.tensor([prompt]), 12, SamplingOptions(temperature=0))[0, len(prompt):]
    assert tokens == expected.tolist() and done == Finished("length", 12) and len(graphs) == 1


def test_a_step_that_cannot_compile_is_eager_under_auto_and_an_error_when_asked(model, monkeypatch):
    def cannot(fn):
        def step(*args):
            raise RuntimeError("no compiler here\nsecond line")
        return step

    with pytest.raises(RuntimeError, match="no compiler here"):
        Engine(model, max_batch=2, compile=True, compiler=cannot).start()
    # auto where torch.compile could run (a GPU): it falls back to the eager step and says why
    monkeypatch.setattr(engine_module, "resolve_compile", lambda flag, device: (True, "compile on"))
    engine = Engine(model, max_batch=2, compile=None, compiler=cannot).start()
    assert not engine.compiled
    assert engine.decode_mode == ("decode step eager: compiling it failed (RuntimeError: no compiler here; "
                                  "compile=True raises it)")
    prompt = prompts(1)[0]
    tokens, _ = run(engine, Request(prompt, 5, emit=None))
    engine.stop()
    expected = generate(model, torch.tensor([prompt]), 5, SamplingOptions(temperature=0))[0, len(prompt):]
    assert tokens == expected.tolist()


@pytest.mark.cuda
def test_cuda_graph_buckets_reply_as_the_eager_step(monkeypatch):
    """On a GPU: the default compiler (inductor, mode="reduce-overhead") records a CUDA graph per bucket
    (cudagraph_or_error turns any "skipping cudagraphs" into a failure), and the replies equal the eager
    engine's, greedy and seeded, with requests joining, leaving and cancelled."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(model_module, "KV_LENGTH_BUCKET", 16)
    cfg = GPTConfig(block_size=48, vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=64, vocab_multiple=64)
    cuda_model = confident_model(cfg, "cuda", steps=80)
    eager = staggered(Engine(cuda_model, max_batch=3, compile=False))
    with inductor_config.patch({"triton.cudagraph_or_error": True}):
        engine = Engine(cuda_model, max_batch=3, compile=True, buckets=((3,), (16, 48)))
        engine._warm_up()
        assert engine.compiled and engine.decode_mode.startswith("decode step compiled in")
        assert staggered(engine) == eager


# ----------------------------------------------------------------------------- batched prefill, the draw


def admitted_together(engine: Engine, requests: list[Request], join: list[Request], prefills: list) -> list:
    """Submit `requests` at once (admitted in one step), step twice, then submit `join` (into the running
    batch) and step until all are done, on this thread; each request's events. Every prefill's rows (their
    prompt lengths) are appended to `prefills`."""
    events = [[] for _ in requests + join]
    for r, box in zip(requests + join, events):
        r.emit = box.append
    real = engine._prefill
    engine._prefill = lambda rows: prefills.append([r.length for r in rows]) or real(rows)
    for r in requests:
        engine.submit(r)
    for step in range(200):
        if step == 2:
            for r in join:
                engine.submit(r)
        engine.step()
        if all(e and isinstance(e[-1], Finished) for e in events):
            return events
    raise AssertionError("the requests did not finish")


@pytest.mark.parametrize("fmt", [None, "float32", "int8"])
def test_prompts_admitted_together_are_prefilled_together_and_reply_as_alone(model, fmt):
    """Five prompts of different lengths arrive together and three join the running batch two steps later:
    the prompts of similar lengths share one forward (each in its own row, at its own positions), and every
    reply, greedy or seeded, equals the one the request gets alone; also on the packed CPU model (the fused
    one-token steps after a prefill through the block's own forward)."""
    from copy import deepcopy

    from gptkit.cpu_decode import pack_for_cpu

    net = model if fmt is None else pack_for_cpu(deepcopy(model), fmt)
    mixed = [SamplingOptions(temperature=0), SamplingOptions(temperature=0.8, top_k=5),
             SamplingOptions(temperature=1.0, top_p=0.9), SamplingOptions(temperature=1.0)]
    lengths = [7, 9, 30, 8, 29, 5, 12, 11]
    torch.manual_seed(4)
    prompt_of = [counting_sequences(1, n, VOCAB, "cpu")[0].tolist() for n in lengths]

    def requests():
        return [Request(p, 10 + i, emit=None, sampling=mixed[i % 4], seed=70 + i) for i, p in enumerate(prompt_of)]

    single = Engine(net, max_batch=1).start()
    alone = [run(single, r)[0] for r in requests()]
    single.stop()
    prefills = []
    fresh = requests()
    together = admitted_together(Engine(net, max_batch=8), fresh[:5], fresh[5:], prefills)
    assert [[e.id for e in ev if isinstance(e, Token)] for ev in together] == alone
    assert [ev[-1] for ev in together] == [Finished("length", 10 + i) for i in range(8)]
    # 7, 8, 9 together and 29, 30 together; then the three that joined (5, 11, 12): 5 alone, 11 and 12
    assert prefills == [[7, 8, 9], [29, 30], [5], [11, 12]]


def test_prefill_groups_bound_the_padding():
    from gptkit.serving.engine import prefill_groups

    assert prefill_groups([10, 10, 10]) == [[0, 1, 2]]
    assert prefill_groups([100, 10, 12]) == [[1, 2], [0]]  # padding 10 and 12 to 100 would be 8x the work
    assert prefill_groups([]) == []
    for lengths in ([3, 50, 4, 48, 20, 1, 1, 2], [16] * 5 + [17] * 3):
        groups = prefill_groups(lengths)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        for g in groups:
            assert len(g) * max(lengths[i] for i in g) <= 1.25 * sum(lengths[i] for i in g)


# Chi-square's 0.999 quantiles, by degrees of freedom: a correct sampler exceeds them once in 1,000 seeds.
CHI2_999 = {2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of the observed counts against probs, over the tokens probs allows; a count on a
    token it forbids is infinitely wrong."""
    expected = probs * counts.sum()
    allowed = probs > 0
    if counts[~allowed].sum() > 0:
        return float("inf")
    return float(((counts[allowed] - expected[allowed]) ** 2 / expected[allowed]).sum())


@pytest.mark.parametrize("options", [SamplingOptions(temperature=0.7), SamplingOptions(temperature=1.0, top_k=3),
                                     SamplingOptions(temperature=1.3, top_p=0.8)])
def test_the_draws_follow_the_filtered_softmax(options):
    """16,000 draws (64 seeded rows x 250 steps) of the engine's sampler from fixed logits over 8 tokens: the
    counts fit the softmax at the temperature, cut to the top-k / top-p tokens and renormalised (chi-square
    under its 0.999 quantile; deterministic seeds), never a token outside the cut; and the same counts
    against the uncut softmax at temperature 1 are far off (the check can tell them apart)."""
    tiny = GPT(GPTConfig(block_size=8, vocab_size=8, n_layer=1, n_head=1, n_embd=8))
    engine = Engine(tiny, max_batch=1)
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 0.25])
    probs = torch.softmax(logits / options.temperature, dim=0)
    order = probs.argsort(descending=True)
    keep = torch.zeros(8, dtype=torch.bool)
    if options.top_k is not None:
        keep[order[: options.top_k]] = True
    elif options.top_p is not None:  # the likeliest tokens while the mass before them is below top_p
        before = probs[order].cumsum(0) - probs[order]
        keep[order[before < options.top_p]] = True
    else:
        keep[:] = True
    expected = torch.where(keep, probs, 0.0) / probs[keep].sum()
    rows = [engine_module._Row(Request([0], 250, emit=None, sampling=options), 1,
                               torch.Generator().manual_seed(1000 + i)) for i in range(64)]
    counts = torch.zeros(8)
    for _ in range(250):
        counts += torch.bincount(torch.tensor(engine._sample(logits.expand(64, 8), rows)), minlength=8)
    assert counts.sum() == 16_000 and counts[~keep].sum() == 0
    assert chi_square(counts, expected) < CHI2_999[int(keep.sum()) - 1]
    assert chi_square(counts, torch.softmax(logits, dim=0)) > 10 * CHI2_999[7]


def full_search(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The oracle for inverse_cdf_draw: one float64 cumulative sum over the row probs (n,), searched once for
    each uniform (k,) -> (k,) indices."""
    cdf = probs.cumsum(dim=0, dtype=torch.float64)
    total = cdf[-1:]
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True)


@pytest.mark.parametrize("n", [1025, 1280, 2000, 50257])  # a last block short or whole; GPT-2's vocabulary
def test_the_two_step_search_picks_what_one_cumulative_sum_picks(n):
    """A long row is searched by blocks, then within the block found: for rows with many tokens of
    probability 0 (every third, and whole blocks) and uniforms from 0 to the largest below 1, the index is
    the one a single float64 cumulative sum over the row gives, and never one of probability 0."""
    g = torch.Generator().manual_seed(n)
    probs = torch.softmax(torch.randn(4, n, generator=g) * 4, dim=-1)
    probs[:, ::3] = 0
    probs[2, 256:1024] = 0  # whole blocks without mass
    probs[3, :-5] = 0  # all of it in the last block's last tokens
    uniform = torch.cat([torch.rand(250, generator=g, dtype=torch.float64),
                         torch.tensor([0.0, 0.5, 1 - 2**-53, 1e-300, 1 - 2**-40], dtype=torch.float64)])
    for row in probs:
        picked = inverse_cdf_draw(row.expand(len(uniform), n), uniform)  # (a view: one row, many draws)
        assert torch.equal(picked, full_search(row, uniform))
        assert (row[picked] > 0).all()


def test_the_two_step_search_draws_each_token_by_its_probability():
    """16,000 draws over 2,000 tokens whose mass sits on 8 of them, at block edges (255 | 256, 1023 | 1024)
    and in the last, shorter block: the counts fit (chi-square), and no other token is ever drawn."""
    probs = torch.zeros(2000)
    at = torch.tensor([0, 255, 256, 700, 1023, 1024, 1500, 1999])
    probs[at] = torch.tensor([0.05, 0.2, 0.1, 0.15, 0.05, 0.25, 0.12, 0.08])
    uniform = torch.rand(16_000, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    counts = torch.bincount(inverse_cdf_draw(probs.expand(16_000, 2000), uniform), minlength=2000).float()
    assert counts.sum() == 16_000 and counts[probs == 0].sum() == 0
    assert chi_square(counts[at], probs[at]) < CHI2_999[7]
    assert chi_square(counts[at], torch.full((8,), 1 / 8)) > 10 * CHI2_999[7]  # (it can tell)


def test_the_engine_sets_its_thread_count_on_its_own_thread(model):
    """threads: set on the engine's thread when it starts (its requests' emit runs there), leaving the
    thread that made the engine as it was (serve.py loads the model with one thread)."""
    before = torch.get_num_threads()
    seen = []
    engine = Engine(model, max_batch=1, threads=before + 1).start()
    try:
        tokens, done = run(engine, Request(prompts(1)[0], 3, emit=None))
        engine.submit(Request(prompts(1)[0], 1, emit=lambda e: seen.append(torch.get_num_threads())))
        engine.stop()
        assert seen and set(seen) == {before + 1} and done.reason == "length"
        assert torch.get_num_threads() == before
        assert Engine(model, max_batch=1).threads == before  # by default: the maker's count
    finally:
        torch.set_num_threads(before)  # (also what new threads take when they first run in parallel)


def test_a_seed_gives_the_same_draws_and_another_seed_others(model):
    sampling = SamplingOptions(temperature=1.0)
    prompt = prompts(1)[0]
    engine = Engine(model, max_batch=2).start()
    first, again, other = (run(engine, Request(prompt, 20, emit=None, sampling=sampling, seed=s))[0]
                           for s in (5, 5, 6))
    engine.stop()
    assert first == again and first != other


def test_a_failed_prefill_finishes_its_requests_with_an_error_and_the_engine_serves_on(model, monkeypatch):
    """A prompt whose computation raises (here a patched _prefill, once): its request, admitted but never
    active, still gets Finished("error") (no client is left waiting), and the next request is served."""
    engine = Engine(model, max_batch=4).start()
    real, calls = engine._prefill, []

    def failing(rows):
        calls.append(len(rows))
        if len(calls) == 1:
            raise RuntimeError("a prefill that failed")
        return real(rows)

    monkeypatch.setattr(engine, "_prefill", failing)
    monkeypatch.setattr(engine_module.traceback, "print_exc", lambda: None)  # (the engine prints it: expected)
    try:
        prompt = prompts(1)[0]
        assert run(engine, Request(prompt, 5, emit=None)) == ([], Finished("error", 0))
        tokens, done = run(engine, Request(prompt, 5, emit=None))
        expected = generate(model, torch.tensor([prompt]), 5, SamplingOptions(temperature=0))[0, len(prompt):]
        assert tokens == expected.tolist() and done == Finished("length", 5)
    finally:
        engine.stop()
