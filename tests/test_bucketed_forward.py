"""Uncached forwards of varying length (the engine's prompt scoring, eval.py's loss, HellaSwag's endings) follow
the decode's policy for the attention's shapes (model.bucketed_forward): a handful of key lengths in buckets of
KV_LENGTH_BUCKET, never one per length, and the results of the unpadded forward (KV_LENGTH_BUCKET = 1)."""

import pytest
import torch

import eval as eval_script
import model as model_module
from gptkit import hellaswag
from gptkit.runtime import Runtime
from gptkit.serving.engine import Engine, Request
from model import GPT, GPTConfig

LENGTHS = (5, 17, 40, 63, 64, 65, 100, 130, 200)
BUCKETS = {64, 128, 192, 256}  # block_size 256 in buckets of 64


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=256, vocab_size=50, n_layer=1, n_head=2, n_embd=16)).eval()


def attention_lengths(monkeypatch) -> list[int]:
    """The key lengths scaled_dot_product_attention is handed from now on."""
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append(k.size(-2))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return seen


def bucketed_and_exact(monkeypatch, run) -> tuple[list, list[int], list, list[int]]:
    """run() with the decode's buckets and the key lengths attention saw, then the same on the exact lengths."""
    seen = attention_lengths(monkeypatch)
    bucketed = run()
    split = len(seen)
    monkeypatch.setattr(model_module, "KV_LENGTH_BUCKET", 1)  # the unpadded forward: one shape per length
    exact = run()
    return bucketed, seen[:split], exact, seen[split:]


def test_prompt_scoring_sees_few_shapes_and_the_unpadded_logprobs(tiny, monkeypatch):
    engine = Engine(tiny, max_batch=1)
    prompts = [torch.randint(0, 50, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in LENGTHS]

    def run():
        with torch.no_grad():
            return [engine._prompt_logprobs(Request(p, 0, emit=lambda e: None, logprobs=3, prompt_logprobs=True))
                    for p in prompts]

    bucketed, seen, exact, exact_seen = bucketed_and_exact(monkeypatch, run)
    assert set(seen) == BUCKETS and len(seen) == len(LENGTHS) and exact_seen == list(LENGTHS)
    for got, want, n in zip(bucketed, exact, LENGTHS):
        assert len(got) == len(want) == n and got[0] is None is want[0]
        for g, w in zip(got[1:], want[1:]):
            assert g.logprob == pytest.approx(w.logprob, abs=1e-5)
            assert [i for i, _ in g.top] == [i for i, _ in w.top]


def test_eval_window_losses_see_few_shapes_and_the_unpadded_losses(tiny, monkeypatch):
    rt = Runtime(torch.device("cpu"), torch.float32)
    windows = [torch.randint(0, 50, (2, n + 1), generator=torch.Generator().manual_seed(n)) for n in LENGTHS]

    def run():
        with torch.no_grad():
            return [eval_script.window_losses(tiny, w[:, :-1], w[:, 1:], rt, tiny.hidden_states) for w in windows]

    bucketed, seen, exact, exact_seen = bucketed_and_exact(monkeypatch, run)
    assert set(seen) == BUCKETS and len(seen) == len(LENGTHS) and exact_seen == list(LENGTHS)
    for got, want, n in zip(bucketed, exact, LENGTHS):
        assert got.shape == want.shape == (2 * n,)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_hellaswag_endings_see_few_shapes_and_the_unpadded_losses(tiny, monkeypatch):
    rt = Runtime(torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(1)

    def item(n: int) -> hellaswag.Encoded:  # four rows of n + 1 to n + 4 tokens, the last 3 the ending
        rows = tuple(tuple(torch.randint(0, 50, (n + 1 + i,), generator=gen).tolist()) for i in range(4))
        return hellaswag.Encoded(rows=rows, ending_lengths=(3, 3, 3, 3), label=0)

    batches = [[item(n)] for n in LENGTHS]

    def run():
        with torch.no_grad():
            return [hellaswag.ending_losses(tiny, batch, rt) for batch in batches]

    bucketed, seen, exact, exact_seen = bucketed_and_exact(monkeypatch, run)
    assert set(seen) == BUCKETS and len(seen) == len(batches)
    assert exact_seen == [n + 3 for n in LENGTHS]  # the longest row, less its last token
    for (totals, means), (want_totals, want_means) in zip(bucketed, exact):
        torch.testing.assert_close(totals, want_totals, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(means, want_means, rtol=1e-5, atol=1e-5)
