"""The sampling parameters of the serving engine (gptkit/serving/engine.py), applied per row of its batched
sampler: logit_bias, frequency and presence penalties, top_k, logprobs of the drawn tokens and of a prompt.
The oracle is a direct computation: full forwards of the same tiny model, log_softmax of its logits, and a
greedy loop that applies the same bias and penalties by hand."""

import queue
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import torch_threads

from gptkit.generate import SamplingOptions
from gptkit.serving.engine import Engine, Finished, PromptLogprobs, Request, Token
from model import GPT, GPTConfig

VOCAB = 50
TOL = 1e-4  # a batched, cached step against a full forward: rounding only


@pytest.fixture(scope="module")
def model():
    """Random weights: spread-out distributions, so log-probabilities and second choices are informative."""
    torch.manual_seed(3)
    with torch_threads(1):
        yield GPT(GPTConfig(block_size=32, vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32)).eval()


@pytest.fixture(scope="module")
def engine(model):
    with torch_threads(1):
        engine = Engine(model, max_batch=4).start()
        yield engine
        engine.stop()


def events_of(engine: Engine, *requests: Request) -> list[list]:
    """Submit the requests together and wait: each one's events, up to and with its Finished."""
    inboxes = []
    for r in requests:
        inbox = queue.SimpleQueue()
        r.emit = inbox.put
        inboxes.append(inbox)
    for r in requests:
        engine.submit(r)
    out = []
    for inbox in inboxes:
        events = [inbox.get(timeout=60)]
        while not isinstance(events[-1], Finished):
            events.append(inbox.get(timeout=60))
        out.append(events)
    return out


def tokens_of(events: list) -> list[int]:
    return [e.id for e in events if isinstance(e, Token) and not e.final]


@torch.no_grad()
def log_probs(model: GPT, ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits at every position of ids: (T, V); row t predicts ids[t + 1]."""
    logits = model.head(model.hidden_states(torch.tensor([ids])), fp32=True)[0]
    return F.log_softmax(logits, dim=-1)


@torch.no_grad()
def greedy_by_hand(model: GPT, prompt: list[int], n: int, bias=None, frequency=0.0, presence=0.0) -> list[int]:
    """The greedy reply with OpenAI's logit adjustments written out: logit + bias (-100: -inf), minus
    frequency * count, minus presence * (count > 0), counts over the reply so far."""
    ids, counts = list(prompt), torch.zeros(model.config.vocab_size)
    for _ in range(n):
        logits = model.head(model.hidden_states(torch.tensor([ids])), fp32=True)[0, -1]
        for t, b in (bias or {}).items():
            logits[t] += float("-inf") if b <= -100 else b
        logits -= frequency * counts + presence * (counts > 0).float()
        token = int(logits.argmax())
        counts[token] += 1
        ids.append(token)
    return ids[len(prompt):]


PROMPT = [3, 14, 15, 9, 26]


def test_logprobs_of_the_drawn_tokens_are_the_models(model, engine):
    [events] = events_of(engine, Request(PROMPT, 6, emit=None, logprobs=3))
    tokens = tokens_of(events)
    expected = log_probs(model, PROMPT + tokens)[len(PROMPT) - 1:-1]  # the rows that predicted the reply
    for token, event, row in zip(tokens, events, expected):
        assert abs(event.logprob.logprob - row[token].item()) < TOL
        top = row.topk(3)
        assert [i for i, _ in event.logprob.top] == top.indices.tolist()
        assert torch.allclose(torch.tensor([v for _, v in event.logprob.top]), top.values, atol=TOL)
        assert token == top.indices[0]  # greedy: the likeliest
    [plain] = events_of(engine, Request(PROMPT, 6, emit=None))
    assert tokens_of(plain) == tokens and all(e.logprob is None for e in plain if isinstance(e, Token))


def test_a_prompt_is_scored_and_max_tokens_0_decodes_nothing(model, engine):
    [events] = events_of(engine, Request(PROMPT, 0, emit=None, logprobs=2, prompt_logprobs=True))
    assert isinstance(events[0], PromptLogprobs) and events[1:] == [Finished("length", 0)]
    scored = events[0].logprobs
    assert len(scored) == len(PROMPT) and scored[0] is None
    expected = log_probs(model, PROMPT)
    for t in range(1, len(PROMPT)):
        assert abs(scored[t].logprob - expected[t - 1, PROMPT[t]].item()) < TOL
        assert [i for i, _ in scored[t].top] == expected[t - 1].topk(2).indices.tolist()
    # With a reply: the prompt's logprobs come first, then the tokens, the same as without scoring.
    [events] = events_of(engine, Request(PROMPT, 3, emit=None, prompt_logprobs=True))
    assert isinstance(events[0], PromptLogprobs) and tokens_of(events) == greedy_by_hand(model, PROMPT, 3)


def test_the_stop_token_is_told_with_its_logprob_only_when_asked(model, engine):
    first = greedy_by_hand(model, PROMPT, 1)[0]
    [events] = events_of(engine, Request(PROMPT, 5, emit=None, stop_ids=frozenset({first}), logprobs=0))
    assert events[0] == Token(first, events[0].logprob, final=True) and events[1] == Finished("stop", 0)
    assert abs(events[0].logprob.logprob - log_probs(model, PROMPT)[-1, first].item()) < TOL
    [events] = events_of(engine, Request(PROMPT, 5, emit=None, stop_ids=frozenset({first})))
    assert events == [Finished("stop", 0)]


def test_logit_bias_bans_and_forces_tokens(model, engine):
    reply = greedy_by_hand(model, PROMPT, 6)
    ban = {t: -100.0 for t in set(reply)}  # every token of the greedy reply
    [events] = events_of(engine, Request(PROMPT, 6, emit=None, logit_bias=ban))
    got = tokens_of(events)
    assert got == greedy_by_hand(model, PROMPT, 6, bias=ban) and not set(got) & set(reply)
    [events] = events_of(engine, Request(PROMPT, 4, emit=None, logit_bias={7: 100.0},
                                         sampling=SamplingOptions(temperature=1.0), seed=0))
    assert tokens_of(events) == [7, 7, 7, 7]
    nudge = {reply[0]: -1.5, 11: 2.0}  # a bias that is not a ban adds to the logit
    [events] = events_of(engine, Request(PROMPT, 6, emit=None, logit_bias=nudge))
    assert tokens_of(events) == greedy_by_hand(model, PROMPT, 6, bias=nudge)


@pytest.mark.parametrize("frequency, presence", [(1.5, 0.0), (0.0, 2.0), (0.7, 0.7), (-1.0, 0.0)])
def test_frequency_and_presence_penalties(model, engine, frequency, presence):
    [events] = events_of(engine, Request(PROMPT, 12, emit=None, frequency_penalty=frequency,
                                         presence_penalty=presence))
    assert tokens_of(events) == greedy_by_hand(model, PROMPT, 12, frequency=frequency, presence=presence)


LOGITS = [5.0, 4.0, 3.1, 0.0, 0.0, 0.0, 0.0, 0.0]  # the fixed model's, whatever the context


@pytest.fixture(scope="module")
def fixed_model():
    """A model whose logits are LOGITS at every position, whatever the tokens: its blocks add zero (their output
    projections are zero), every token has the same embedding and there is no position table, so the final
    LayerNorm sees one vector, h, which the head maps to LOGITS. Its greedy reply is token 0 over and over
    until penalties change it: counts above 1, where frequency (count x penalty) and presence (penalty once a
    token is in) differ."""
    config = GPTConfig(block_size=32, vocab_size=len(LOGITS), n_layer=1, n_head=1, n_embd=16, tie_embeddings=False)
    model = GPT(config).eval()
    state = {name: torch.ones_like(p) if name.endswith("ln_f.weight") or re.search(r"ln_\d\.weight$", name)
             else torch.zeros_like(p) for name, p in model.state_dict().items()}
    state["transformer.wte.weight"][:, :2] = torch.tensor([1.0, -1.0])
    model.load_state_dict(state)
    with torch.no_grad():
        h = model.transformer.ln_f(state["transformer.wte.weight"][0])
        model.lm_head.weight.copy_(torch.outer(torch.tensor(LOGITS), h) / h.dot(h))
    return model


@pytest.mark.parametrize("frequency, presence", [(0.4, 0.0), (0.0, 1.5), (-0.3, 1.2), (0.4, -0.5)])
def test_penalties_on_a_reply_that_repeats(fixed_model, frequency, presence):
    """OpenAI's formula, logit - frequency x count - presence x (count > 0), on replies whose counts pass 1:
    each case's reply differs from the one with the two penalties swapped, and a negative penalty changes the
    reply (it favours the tokens already said)."""
    with torch_threads(1):
        assert model_logits(fixed_model).tolist() == pytest.approx(LOGITS, abs=1e-5)
        engine = Engine(fixed_model, max_batch=2).start()
        try:
            [events] = events_of(engine, Request([0, 1], 12, emit=None, frequency_penalty=frequency,
                                                 presence_penalty=presence))
        finally:
            engine.stop()
        expected = greedy_by_hand(fixed_model, [0, 1], 12, frequency=frequency, presence=presence)
        assert tokens_of(events) == expected
        assert max(expected.count(t) for t in expected) > 2  # counts pass 1: the penalties differ there
        assert expected != greedy_by_hand(fixed_model, [0, 1], 12, frequency=presence, presence=frequency)
        negative = [name for name, value in (("frequency", frequency), ("presence", presence)) if value < 0]
        for name in negative:  # without the negative penalty the reply is another
            kept = {"frequency": frequency, "presence": presence, name: 0.0}
            assert expected != greedy_by_hand(fixed_model, [0, 1], 12, **kept)


@torch.no_grad()
def model_logits(model: GPT) -> torch.Tensor:
    return model.head(model.hidden_states(torch.tensor([[3, 1, 4]])), fp32=True)[0, -1]


def test_each_row_gets_its_own_parameters_in_one_batch(model, engine):
    """Four requests decoded together, each with other parameters: each reply equals its reply alone."""
    requests = [dict(prompt=PROMPT, max_tokens=8),
                dict(prompt=PROMPT[:3], max_tokens=8, logit_bias={greedy_by_hand(model, PROMPT[:3], 1)[0]: -100}),
                dict(prompt=PROMPT, max_tokens=8, frequency_penalty=2.0, logprobs=1),
                dict(prompt=PROMPT[1:], max_tokens=8, sampling=SamplingOptions(temperature=0.8, top_k=2), seed=5)]
    together = events_of(engine, *[Request(emit=None, **r) for r in requests])
    alone = [events_of(engine, Request(emit=None, **r))[0] for r in requests]
    assert [tokens_of(e) for e in together] == [tokens_of(e) for e in alone]
    assert tokens_of(together[0]) == greedy_by_hand(model, PROMPT, 8)
    assert tokens_of(together[2]) == greedy_by_hand(model, PROMPT, 8, frequency=2.0)
    assert all(e.logprob is not None for e in together[2] if isinstance(e, Token))


def test_top_k_draws_from_the_k_likeliest_only(model, engine):
    """top_k=1 at any temperature is greedy; top_k=3's draws are among each step's 3 likeliest."""
    [events] = events_of(engine, Request(PROMPT, 8, emit=None, sampling=SamplingOptions(temperature=2.0, top_k=1),
                                         seed=1))
    assert tokens_of(events) == greedy_by_hand(model, PROMPT, 8)
    [events] = events_of(engine, Request(PROMPT, 10, emit=None, sampling=SamplingOptions(temperature=2.0, top_k=3),
                                         seed=2))
    tokens = tokens_of(events)
    rows = log_probs(model, PROMPT + tokens)[len(PROMPT) - 1:-1]
    assert all(t in row.topk(3).indices.tolist() for t, row in zip(tokens, rows))
    assert len(set(tokens)) > 1


def test_bad_parameters_are_refused_before_they_are_queued(engine):
    with pytest.raises(ValueError, match="max_tokens"):
        engine.submit(Request(PROMPT, 0, emit=None))  # 0 only when the prompt is scored
    with pytest.raises(ValueError, match="logit_bias"):
        engine.submit(Request(PROMPT, 3, emit=None, logit_bias={VOCAB: 1.0}))
    with pytest.raises(ValueError, match="logprobs"):
        engine.submit(Request(PROMPT, 3, emit=None, logprobs=-1))
