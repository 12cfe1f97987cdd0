"""The prefix cache (gptkit/serving/prefix_cache.py) and the engine's reuse of it: what is held is what was
computed, a shared prefix is held once, the bound always holds, the least recently used goes first; and a reply
with reuse is the reply without it (prefix_cache=0: every prompt computed whole), on every path: eager and
packed CPU formats, bfloat16, batched prefill, n choices, the compiled buckets.

Computing a prompt's end against reused keys and values is not the same float arithmetic as one whole prefill
(other matrix shapes), so the two replies are compared as tokens, and their logprobs within a tolerance; every
decision the tokens depend on is checked to be clear by more than that tolerance (`clear`: the greedy token's
lead over the next, a draw's distance to the edges of its token's share), so that no test passes or fails by
where a rounding difference happens to fall."""

import queue
import random
from copy import deepcopy

import pytest
import torch
from conftest import confident_model, counting_sequences
from test_engine import counting_compiler

import model as model_module
from gptkit.cpu_decode import pack_for_cpu
from gptkit.generate import SamplingOptions, candidates
from gptkit.serving.engine import Engine, Finished, Request
from gptkit.serving.prefix_cache import (
    PrefixCache,
    PrefixCacheError,
    available_memory,
    check_bound,
    token_bytes,
)
from model import GPT, GPTConfig

VOCAB = 300
BLOCK = 64
GREEDY = SamplingOptions(temperature=0)
DRAWN = SamplingOptions(temperature=1.0, top_k=40)


@pytest.fixture(scope="module")
def model():
    """Trained to count in steps of 3 (conftest.confident_model): greedy margins of several units."""
    cfg = GPTConfig(block_size=BLOCK, vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=64, vocab_multiple=64)
    return confident_model(cfg, "cpu", steps=80)


def counting(n: int, seed: int) -> list[int]:
    torch.manual_seed(seed)
    return counting_sequences(1, n, VOCAB, "cpu")[0].tolist()


# ----------------------------------------------------------------------------- the cache alone


def filled(n_rows: int = 3) -> GPT:
    """A tiny model whose KV cache holds random keys and values (what the cache copies is all that matters)."""
    net = GPT(GPTConfig(block_size=32, vocab_size=50, n_layer=2, n_head=2, n_embd=16))
    net.setup_kv_cache(n_rows)
    g = torch.Generator().manual_seed(0)
    for block in net.transformer.h:
        block.attn.kv_cache.k.copy_(torch.randn(block.attn.kv_cache.k.shape, generator=g))
        block.attn.kv_cache.v.copy_(torch.randn(block.attn.kv_cache.v.shape, generator=g))
    return net


def slots(net: GPT, row: int, n: int) -> list[torch.Tensor]:
    """The first n slots of a row, keys and values of every layer."""
    return [t[row, :, :n].clone() for b in net.transformer.h for t in (b.attn.kv_cache.k, b.attn.kv_cache.v)]


def load_into(cache: PrefixCache, net: GPT, tokens: list[int], row: int) -> int:
    """Match tokens and load what is found into row (emptied first): the length found."""
    for b in net.transformer.h:
        b.attn.kv_cache.k[row].zero_()
        b.attn.kv_cache.v[row].zero_()
    found = cache.match(tokens)
    cache.load(found, row)
    return found.length


def held_bytes(cache: PrefixCache) -> int:
    """The bytes of every node of the tree, counted by walking it."""
    total, todo = 0, list(cache.root.children.values())
    while todo:
        node = todo.pop()
        assert node.kv.size(3) == len(node.tokens) and all(c.parent is node for c in node.children.values())
        total += node.kv.nbytes
        todo += node.children.values()
    return total


def test_a_match_loads_what_was_inserted_also_ending_inside_a_longer_sequence():
    net = filled()
    cache = PrefixCache(net, 2**20)
    tokens = list(range(1, 21))
    cache.insert(tokens, 0)
    assert cache.tokens == 20 and cache.bytes == 20 * cache.token_bytes == held_bytes(cache)
    assert load_into(cache, net, tokens, 2) == 20
    assert all(torch.equal(a, b) for a, b in zip(slots(net, 2, 20), slots(net, 0, 20)))
    # The first 7 tokens, then others: 7 of them found, in the middle of the one node held.
    assert load_into(cache, net, tokens[:7] + [40, 41], 2) == 7
    assert all(torch.equal(a, b) for a, b in zip(slots(net, 2, 7), slots(net, 0, 7)))
    assert all(not t[:, 7:].any() for t in slots(net, 2, 20))  # nothing past what was found
    assert load_into(cache, net, [40] + tokens, 2) == 0


def test_a_shared_prefix_is_held_once_and_each_sequence_loads_its_own_values():
    net = filled()
    cache = PrefixCache(net, 2**20)
    system, a, b = list(range(1, 11)), [20, 21, 22, 23], [30, 31, 32]
    cache.insert(system + a, 0)
    cache.insert(system + b, 1)  # row 1's values for the same first ten tokens are other numbers ...
    assert cache.tokens == 10 + 4 + 3 and cache.bytes == held_bytes(cache)
    assert load_into(cache, net, system + b, 2) == 13
    mine = slots(net, 2, 13)
    # ... but the first ten are held once: the first sequence's, which row 1's tail then continues.
    assert all(torch.equal(x[:, :10], y[:, :10]) for x, y in zip(mine, slots(net, 0, 10)))
    assert all(torch.equal(x[:, 10:], y[:, 10:13]) for x, y in zip(mine, slots(net, 1, 13)))
    cache.insert(system + a + [50], 0)  # only the new token is copied
    assert cache.inserted_tokens == 18 and cache.tokens == 18


def test_the_least_recently_used_sequence_goes_first():
    net = filled()
    cache = PrefixCache(net, 12 * PrefixCache(net, 1).token_bytes)  # 12 tokens
    one, two, three = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    for tokens in (one, two, three):
        cache.insert(tokens, 0)
    cache.match(one)  # used again: now the second is the oldest
    cache.insert([13, 14, 15], 0)
    assert [cache.match(t).length for t in (one, two, three, [13, 14, 15])] == [4, 0, 4, 3]
    assert cache.evicted_tokens == 4 and cache.bytes <= cache.bound


def test_a_tokens_keys_and_values_cost_what_the_kv_cache_holds():
    """token_bytes (what chat.py sizes its bound with) from the model's shape, against the KV cache itself:
    2 (keys, values) x 2 layers x 16 wide x 4 bytes in float32, half that in bfloat16."""
    net = filled()
    assert token_bytes(net) == PrefixCache(net, 1).token_bytes == 2 * 2 * 16 * 4
    half = filled().to(torch.bfloat16)
    half.setup_kv_cache(1)
    assert token_bytes(half) == PrefixCache(half, 1).token_bytes == 2 * 2 * 16 * 2


def test_a_sequence_longer_than_the_bound_keeps_its_beginning():
    net = filled()
    cache = PrefixCache(net, 5 * PrefixCache(net, 1).token_bytes)
    cache.insert(list(range(1, 21)), 0)
    assert cache.tokens == 5 and cache.match(list(range(1, 21))).length == 5
    assert PrefixCache(net, cache.token_bytes - 1).insert([1, 2], 0) is None  # a bound below one token holds none


def test_the_cache_never_holds_more_than_its_bound():
    """600 insertions of sequences that share prefixes (a few system messages, conversations that go on)
    with a bound of 40 tokens: after every one the bytes held are at most the bound and are the tree's own,
    and what is held for any sequence still loads exactly the values it was inserted with."""
    net = filled(n_rows=2)
    token_bytes = PrefixCache(net, 1).token_bytes
    cache = PrefixCache(net, 40 * token_bytes + token_bytes // 2)  # (not a whole number of tokens)
    rng = random.Random(0)
    # Every sequence's values are row 0's: a token's keys and values depend on its position only here, so
    # that any prefix found must load exactly row 0's first slots.
    sequences = [[s] + [rng.randrange(1, 6) for _ in range(rng.randrange(0, 31))] for s in range(1, 4)]
    for i in range(600):
        tokens = rng.choice(sequences)[: rng.randrange(1, 32)] + [rng.randrange(1, 6)] * rng.randrange(0, 3)
        cache.insert(tokens[:32], 0)
        assert cache.bytes <= cache.bound and cache.bytes == held_bytes(cache)
        if i % 50 == 0:
            n = load_into(cache, net, tokens, 1)
            assert all(torch.equal(a, b) for a, b in zip(slots(net, 1, n), slots(net, 0, n)))
    assert cache.evicted_tokens > 0 and cache.tokens <= 40


# ----------------------------------------------------------------------------- the engine: exact replies


def run(engine: Engine, request: Request) -> list:
    """Submit, wait: the request's events (its Tokens, then Finished)."""
    events = queue.SimpleQueue()
    request.emit = events.put
    engine.submit(request)
    got = []
    while not isinstance(event := events.get(timeout=60), Finished):
        got.append(event)
    return got + [event]


def ask(prompt: list[int], n: int = 6, sampling: SamplingOptions = GREEDY, seed: int = 1) -> Request:
    """A request for n tokens with the logprob of every token of the vocabulary (to check `clear`)."""
    return Request(list(prompt), n, emit=None, sampling=sampling, seed=seed, logprobs=VOCAB)


def clear(events: list, sampling: SamplingOptions, seed: int, tol: float) -> None:
    """Every token of the reply was decided by more than a rounding of `tol` in the logprobs could change:
    greedy, the chosen token leads the next by over 2 tol; drawn, the request's uniform (its generator,
    seeded) falls farther than 8 tol / temperature from both edges of the chosen token's share of the
    filtered distribution (a tol in logprobs moves them by ~4 tol / temperature at most)."""
    generator = torch.Generator().manual_seed(seed)
    for event in events[:-1]:
        logp = torch.full((VOCAB,), -torch.inf)
        ids, values = zip(*event.logprob.top)
        logp[list(ids)] = torch.tensor(values)
        if sampling.temperature == 0:
            top = logp.topk(2).values
            assert event.id == int(logp.argmax()) and top[0] - top[1] > 2 * tol
            continue
        probs, order = candidates(logp[None], sampling)
        cdf = probs[0].double().cumsum(0)
        u = float(torch.rand(1, generator=generator, dtype=torch.float64)) * float(cdf[-1])
        at = int((order[0] == event.id).nonzero()) if order is not None else event.id
        low, high = (float(cdf[at - 1]) if at else 0.0), float(cdf[at])
        assert low <= u < high and min(u - low, high - u) > 8 * tol / sampling.temperature, (u, low, high)


def same_reply(reused: list, whole: list, tol: float) -> None:
    """Tokens and how the reply ended equal; each token's logprob within tol."""
    assert [e.id for e in reused[:-1]] == [e.id for e in whole[:-1]] and reused[-1] == whole[-1]
    for a, b in zip(reused[:-1], whole[:-1]):
        assert abs(a.logprob.logprob - b.logprob.logprob) <= tol


def conversation(engine: Engine, first: list[int], turns: int, sampling: SamplingOptions, seed: int,
                 n: int = 6) -> list[tuple[list, int]]:
    """A conversation: each turn's prompt is the last one, its reply and three new tokens (the reply's
    counting, on): each reply's events, and the prompt tokens the engine reused for it."""
    prompt, out = list(first), []
    for turn in range(turns):
        request = ask(prompt, n, sampling, seed + turn)
        events = run(engine, request)
        out.append((events, request.cached_tokens))
        tokens = [e.id for e in events[:-1]]
        prompt += tokens + [(tokens[-1] + 3 * i) % VOCAB for i in (1, 2, 3)]
    return out


FORMATS = {None: 1e-4, "float32": 1e-4, "float16": 1e-4, "int8": 1e-4, "bfloat16": 1e-2}


def placed(model: GPT, fmt: str | None) -> GPT:
    """The model as serve.py places it: as it is, packed for the CPU kernels, or in bfloat16."""
    if fmt is None:
        return model
    return deepcopy(model).to(torch.bfloat16) if fmt == "bfloat16" else pack_for_cpu(deepcopy(model), fmt)


# Every format greedy, and seeded draws where the rounding is fine enough for the draws to be clear by it
# (bfloat16's 1e-2 is not).
CONVERSATIONS = [(fmt, GREEDY) for fmt in FORMATS] + [(fmt, DRAWN) for fmt in FORMATS if fmt != "bfloat16"]


@pytest.mark.parametrize("fmt, sampling", CONVERSATIONS,
                         ids=[f"{fmt}-{'greedy' if s is GREEDY else 'drawn'}" for fmt, s in CONVERSATIONS])
def test_a_conversation_reuses_its_history_and_replies_as_without(model, fmt, sampling):
    """Five turns, each prompt the whole history: from the second turn on only the new tokens are computed
    (the reply's row, left as it was, is taken again: in place), and every reply equals the one computed
    from the whole prompt, greedy and seeded draws, in every format."""
    net, tol = placed(model, fmt), FORMATS[fmt]
    system = counting(10, seed=3)
    replies, loads = {}, []  # the lengths copied in from the prefix cache
    for bound in (0, None):
        engine = Engine(net, max_batch=2, prefix_cache=bound).start()
        if engine.prefix is not None:
            engine.prefix.load = lambda found, row, real=engine.prefix.load: loads.append(found.length) or \
                real(found, row)
        replies[bound] = conversation(engine, system, 5, sampling, seed=7)
        engine.stop()
    whole, reused = replies[0], replies[None]
    prompt_lengths = [10 + 9 * t for t in range(5)]  # 10, then each turn 6 reply tokens and 3 new
    assert [cached for _, cached in whole] == [0] * 5
    assert [cached for _, cached in reused] == [0] + [n - 4 for n in prompt_lengths[1:]]  # (the last reply
    # token was never fed back: it is computed with the new ones)
    assert loads == []  # one client: each turn took the row the last one left, nothing copied
    for (a, _), (b, _), turn in zip(reused, whole, range(5)):
        clear(b, sampling, 7 + turn, tol)
        same_reply(a, b, tol)


def test_a_prefix_ending_inside_a_longer_sequence_an_evicted_one_and_two_diverging_conversations(model):
    """Against the same requests computed whole: a prompt that takes the first 12 tokens of a held 30-token
    sequence; two conversations that share a system message (held once); and, with a bound of 40 tokens,
    a conversation whose beginning was pushed out by another's and that goes on with what is left."""
    tol = FORMATS[None]
    system = counting(16, seed=5)
    long = system + counting(14, seed=8)
    token_bytes = Engine(model, max_batch=2, prefix_cache=1).prefix.token_bytes
    script = [  # (prompt, max tokens)
        (long, 4),
        (long[:12] + counting(5, seed=9), 5),  # the first 12 of the 33 held
        (system + [7, 10, 13], 5),  # a conversation from the system message ...
        (system + [100, 103], 5),  # ... and another that leaves it at the same place
    ]
    results = {}
    for bound in (0, None):
        engine = Engine(model, max_batch=2, prefix_cache=bound).start()
        results[bound] = []
        for prompt, n in script:
            request = ask(prompt, n)
            results[bound].append((run(engine, request), request.cached_tokens))
        if bound is None:
            held = engine.prefix.tokens
        engine.stop()
    cached = [c for _, c in results[None]]
    assert cached == [0, 12, 16, 16]
    # Held once: the 33 of the first sequence (30 and 3 reply tokens fed back), then what each later one added.
    assert held == 33 + (17 + 4 - 12) + (19 + 4 - 16) + (18 + 4 - 16)
    for (a, _), (b, _) in zip(results[None], results[0]):
        clear(b, GREEDY, 1, tol)
        same_reply(a, b, tol)

    # Evicted: a bound of 40 tokens. Two conversations from the system message (held once, 36 tokens in
    # all), then a third, unrelated, pushes out the least recently used end: the first conversation's.
    engine = Engine(model, max_batch=1, prefix_cache=40 * token_bytes).start()
    first_prompt = system + counting(8, seed=12)
    first = run(engine, ask(first_prompt, 4))  # 27 held
    run(engine, ask(system + counting(6, seed=13), 4))  # + 9
    run(engine, ask(counting(10, seed=14), 4))  # + 13: the first one's 11 go
    assert engine.prefix.evicted_tokens == 11 and engine.prefix.tokens == 38
    again = first_prompt + [e.id for e in first[:-1]] + [1, 2]
    request = ask(again, 5)
    reused = run(engine, request)
    engine.stop()
    assert request.cached_tokens == 16  # the system message is all that is left of it
    whole_engine = Engine(model, max_batch=1, prefix_cache=0).start()
    whole = run(whole_engine, ask(again, 5))
    whole_engine.stop()
    clear(whole, GREEDY, 1, tol)
    same_reply(reused, whole, tol)


def test_a_group_never_pads_a_row_past_the_context():
    """Rows prefilled together are padded to the longest: one that starts at slot 60 of 64 cannot take a
    computed length of 6 beside it (its padding would write slots 64 and 65); alone, each fits."""
    from gptkit.serving.engine import prefill_groups

    assert prefill_groups([5, 6]) == [[0, 1]]
    assert prefill_groups([4, 4], starts=[60, 0], room=64) == [[0, 1]]
    assert prefill_groups([4, 6], starts=[58, 0], room=64) == [[0, 1]]  # 58 + 6: the last slot
    assert prefill_groups([4, 6], starts=[59, 0], room=64) == [[0], [1]]
    assert prefill_groups([6, 4], starts=[0, 60], room=64) == [[1], [0]]


def stepped(engine: Engine, requests: list[Request], submit_at: list[int], on_step=None) -> list[list]:
    """Submit each request at its step, stepping the engine on this thread until all are done: each
    request's events."""
    events = [[] for _ in requests]
    for r, box in zip(requests, events):
        r.emit = box.append
    for step in range(300):
        for r, at in zip(requests, submit_at):
            if at == step:
                engine.submit(r)
        if on_step:
            on_step(step)
        engine.step()
        if all(e and isinstance(e[-1], Finished) for e in events):
            return events
    raise AssertionError("the requests did not finish")


@pytest.mark.parametrize("fmt", [None, "float32", "float16", "int8"])
def test_prompts_admitted_together_reuse_each_their_own_prefix(model, fmt):
    """Nine requests admitted in one step: four continue held sequences (8 to 20 tokens reused; two of them
    with one new token, computed by the packed model's one-token kernel), two are new, and three are the n
    choices of one prompt (own seeds), computed once, the others copying its row. Prefilled together in
    groups, each row from its own position. Every reply equals the whole-prompt one, greedy and drawn, on
    the model as it is and packed in each CPU format."""
    net, tol = placed(model, fmt), FORMATS[fmt]
    bases = [counting(n, seed=20 + n) for n in (8, 14, 20, 10)]
    fresh = [counting(9, seed=90), counting(12, seed=91)]
    choices = counting(11, seed=42)
    new = [4, 4, 1, 1]

    def requests():
        prompts = [b + counting(k, seed=50 + i) for i, (b, k) in enumerate(zip(bases, new))] + fresh
        out = [ask(p, 5, DRAWN if i % 2 else GREEDY, seed=60 + i) for i, p in enumerate(prompts)]
        return out + [ask(choices, 5, DRAWN, seed=70 + j) for j in range(3)]

    got, prefilled = {}, {}
    for bound in (0, None):
        engine = Engine(net, max_batch=10, prefix_cache=bound)
        for base in bases:  # held (in the prefix cache; the whole-prompt engine keeps nothing)
            stepped(engine, [ask(base, 1)], [0])
        prefilled[bound] = mine = []
        engine._prefill = lambda rows, real=engine._prefill, mine=mine: \
            mine.append([r.length - r.start for r in rows]) or real(rows)
        batch = requests()
        got[bound] = stepped(engine, batch, [0] * len(batch))
        cached = [r.cached_tokens for r in batch]
    assert cached == [len(b) for b in bases] + [0, 0] + [0, 11, 11]
    assert prefilled[None] == [[1, 1], [4, 4], [9, 11, 12]]  # the choices' prompt once
    assert sorted(n for group in prefilled[0] for n in group) == sorted([12, 18, 21, 11, 9, 12, 11, 11, 11])
    for i, (a, b) in enumerate(zip(got[None], got[0])):
        clear(b, DRAWN if i % 2 or i >= 6 else GREEDY, 60 + i if i < 6 else 70 + i - 6, tol)
        same_reply(a, b, tol)


def test_a_request_cancelled_mid_prefill_leaves_and_what_it_computed_serves_the_next(model):
    tol = FORMATS[None]
    prompt, beside = counting(20, seed=30), counting(20, seed=31)
    engine = Engine(model, max_batch=4)
    cancelled, other = ask(prompt, 5), ask(beside, 5)
    real = model.hidden_states

    def cancelling(*args, **kwargs):  # the client leaves while the prompts are being computed
        cancelled.cancel()
        return real(*args, **kwargs)

    model.hidden_states = cancelling
    try:
        events = stepped(engine, [cancelled, other], [0, 0],
                         on_step=lambda step: step == 1 and setattr(model, "hidden_states", real))
    finally:
        model.__dict__.pop("hidden_states", None)
    assert events[0] == [Finished("cancelled", 0)]  # not a token drawn for it
    again = ask(prompt, 5)
    reused = stepped(engine, [again], [0])[0]
    assert again.cached_tokens == 19
    whole_engine = Engine(model, max_batch=4, prefix_cache=0)
    whole = stepped(whole_engine, [ask(prompt, 5), ask(beside, 5)], [0, 0])
    for a, b in ((reused, whole[0]), (events[1], whole[1])):
        clear(b, GREEDY, 1, tol)
        same_reply(a, b, tol)


def test_the_compiled_buckets_with_reuse_reply_as_the_eager_step_without(model, monkeypatch):
    """The compiled step (aot_eager here, as in test_engine) over buckets of rows and slots, with requests
    that continue each other's sequences joining and leaving: the replies equal the eager engine's without
    reuse. The compiled step writes slot 0 of a bucket's free rows: a row left as it was is then not taken
    in place (its values come from the prefix cache)."""
    monkeypatch.setattr(model_module, "KV_LENGTH_BUCKET", 16)
    tol = FORMATS[None]
    base = counting(12, seed=80)

    def script(engine):
        requests = [ask(base, 6), ask(counting(7, seed=81), 9, DRAWN, seed=3), ask(base + [5, 8], 5),
                    ask(base[:9] + [2], 7, DRAWN, seed=4), ask(base + [5, 8, 11, 14], 4)]
        return requests, stepped(engine, requests, [0, 0, 9, 12, 13])

    _, whole = script(Engine(model, max_batch=3, compile=False, prefix_cache=0))
    graphs = []
    engine = Engine(model, max_batch=3, compile=True, compiler=counting_compiler(graphs),
                    buckets=((3,), (16, 64)))
    requests, reused = script(engine)
    assert [r.cached_tokens for r in requests] == [0, 0, 12, 9, 15]  # (the third replied 11, 14, ...)
    for i, (a, b) in enumerate(zip(reused, whole)):
        clear(b, requests[i].sampling, requests[i].seed, tol)
        same_reply(a, b, tol)


@pytest.mark.cuda
def test_cuda_graph_buckets_with_reuse_reply_as_without(monkeypatch):
    """On a GPU: the CUDA-graphed buckets (inductor, mode="reduce-overhead") with reuse reply as the eager
    engine without it."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(model_module, "KV_LENGTH_BUCKET", 16)
    cfg = GPTConfig(block_size=BLOCK, vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=64, vocab_multiple=64)
    cuda_model = confident_model(cfg, "cuda", steps=80)
    base = counting(12, seed=80)

    def script(engine):
        requests = [ask(base, 6), ask(counting(7, seed=81), 9), ask(base + [5, 8], 5), ask(base[:9] + [2], 7)]
        return stepped(engine, requests, [0, 0, 9, 12])

    whole = script(Engine(cuda_model, max_batch=3, compile=False, prefix_cache=0))
    with inductor_config.patch({"triton.cudagraph_or_error": True}):
        engine = Engine(cuda_model, max_batch=3, compile=True, buckets=((3,), (16, 64)))
        engine._warm_up()
        reused = script(engine)
    for a, b in zip(reused, whole):
        clear(b, GREEDY, 1, 1e-3)
        same_reply(a, b, 1e-3)


def test_prefix_cache_0_turns_every_reuse_off(model):
    engine = Engine(model, max_batch=2, prefix_cache=0)
    assert engine.prefix is None
    prompt = counting(10, seed=1)
    requests = [ask(prompt, 3), ask(prompt, 3), ask(prompt + [1], 3)]
    stepped(engine, requests[:2], [0, 0])
    stepped(engine, requests[2:], [0])
    assert [r.cached_tokens for r in requests] == [0, 0, 0]


def test_the_engine_counts_what_it_reused(model):
    engine = Engine(model, max_batch=2)
    prompt = counting(10, seed=1)
    first = stepped(engine, [ask(prompt, 3)], [0])[0]
    assert first[0].id != 5  # (so that the second prompt leaves the first sequence after the prompt)
    stepped(engine, [ask(prompt + [5, 6], 3)], [0])
    p = engine.prefix
    assert (p.lookups, p.hits, p.prompt_tokens, p.reused_tokens) == (2, 1, 22, 10)
    assert p.tokens == 12 + 4 and p.bytes == 16 * p.token_bytes  # 10 + 2 fed back, and 2 + 2 more


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_bound_past_the_memory_available_is_refused_with_the_largest_that_fits(device):
    """--prefix_cache in MiB: one that fits passes; one past the memory the cache could take (the GPU's free
    memory, or the machine's available RAM) is a one-line error naming that memory and the largest that fits."""
    device = torch.device(device)
    available, what = available_memory(device)
    check_bound(available // 2**20 // 2, device)  # half of what is free: no error
    with pytest.raises(PrefixCacheError) as e:
        check_bound(10**9, device)  # ~1 PiB
    message = str(e.value)
    assert "\n" not in message and message.startswith("--prefix_cache=1,000,000,000 MiB is more than the memory")
    assert what in message and (device.type == "cpu") == ("of this machine's" in what)
    if device.type == "cuda":
        assert torch.cuda.get_device_name(device) in what
    fits = int(message.split("the largest that fits is --prefix_cache=")[1].split()[0])
    assert abs(fits - available // 2**20) < 1024  # (the free memory moves a little between the two readings)
