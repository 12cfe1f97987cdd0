"""GRPO's rollouts (gptkit/objectives/grpo_rollouts.py): drawn by the serving engine from the model's live weights (no copy),
reproducible from the run's generator without touching torch's global one, laid out with the reply tokens as
the only targets; the loader's state round-trips so that a resumed run draws what the uninterrupted one did."""

import torch

from gptkit.checker import load_checker, load_task
from gptkit.generate import SamplingOptions
from gptkit.objectives.grpo_rollouts import RolloutLoader, draw, rollout_batches
from gptkit.tokenizer import Tokenizer
from model import GPT, GPTConfig

CHARS = "0123456789+=\n"


def tiny(vocab=13):  # (len(CHARS))
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=24, vocab_size=vocab, n_layer=1, n_head=2, n_embd=16, dropout=0.0)).train()


def test_draws_are_reproducible_and_leave_the_model_and_global_rng_as_they_were():
    model = tiny()
    prompts = [[1, 10, 2, 11], [3, 10, 4, 11], [5, 11]]
    sampling = SamplingOptions(temperature=1.0)
    rng = torch.get_rng_state()
    first = draw(model, prompts, 4, max_tokens=6, sampling=sampling, stop_ids=frozenset({12}),
                 generator=torch.Generator().manual_seed(7), max_batch=5)
    assert torch.equal(torch.get_rng_state(), rng)  # the global stream (dropout, the next init) untouched
    assert model.training and model.kv_cache_batch_size is None
    again = draw(model, prompts, 4, max_tokens=6, sampling=sampling, stop_ids=frozenset({12}),
                 generator=torch.Generator().manual_seed(7), max_batch=12)  # (another batching: same replies)
    assert first == again
    replies, stopped = first
    assert [len(g) for g in replies] == [4, 4, 4]
    for group, ends in zip(replies, stopped):
        for r, end in zip(group, ends):
            assert 12 not in r and (end or len(r) == 6)
    other = draw(model, prompts, 4, max_tokens=6, sampling=sampling, stop_ids=frozenset({12}),
                 generator=torch.Generator().manual_seed(8))
    assert other != first


def greedy(model, prompt, steps):
    """The greedy reply, written out: a whole forward per token, no cache."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            seq.append(int(model(torch.tensor([seq]))[0][0, -1].argmax()))
    return seq[len(prompt):]


def test_draws_read_the_live_weights():
    model = tiny()
    prompts = [[1, 10, 2, 11], [7, 7, 10, 3, 11]]
    seen = []
    for _ in range(3):  # the weights edited in place between draws (what an optimizer step does)
        replies, _ = draw(model, prompts, 2, max_tokens=6, sampling=SamplingOptions(temperature=0),
                          stop_ids=frozenset(), generator=torch.Generator().manual_seed(0))
        model.eval()
        want = [greedy(model, p, 6) for p in prompts]
        model.train()
        assert replies == [[w, w] for w in want]
        seen.append(want)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape) * 0.5)
    assert seen[0] != seen[1] != seen[2]


def test_rollout_batches_target_the_reply_tokens_only():
    prompts = [[1, 2, 3], [4, 5]]
    replies = [[[6], [7, 8]], [[9, 9, 9], []]]
    stopped = [[True, False], [False, True]]
    rewards = [[1.0, 0.0], [0.5, 0.5]]
    a, b = rollout_batches(prompts, replies, stopped, rewards, micro_batches=2, stop_id=12)
    x = torch.cat([a.x, b.x])
    y = torch.cat([a.y, b.y])
    assert x.shape == y.shape == (4, 4)  # the longest rows have 5 tokens: 4 inputs, 4 targets
    assert y[0].tolist() == [-1, -1, 6, 12]  # the stop token it drew is a target too
    assert y[1].tolist() == [-1, -1, 7, 8] and x[1].tolist() == [1, 2, 3, 7]
    assert y[2].tolist() == [-1, 9, 9, 9] and x[2].tolist() == [4, 5, 9, 9]  # (ran out: no stop)
    assert y[3].tolist() == [-1, 12, -1, -1] and x[3].tolist() == [4, 5, 0, 0]  # empty, stopped: one target
    adv = torch.cat([a.advantages, b.advantages])
    assert adv[0] > 0 > adv[1] and adv[2] == adv[3] == 0
    assert a.no_signal.item() == b.no_signal.item() == 0.5
    assert torch.cat([a.lengths, b.lengths]).tolist() == [1, 2, 3, 0]


def loader(model, **over):
    tokenizer = Tokenizer.char_from_text(CHARS)
    args = dict(n=4, batch_size=4, accum=2, max_tokens=5, sampling=SamplingOptions(temperature=1.0),
                stop_ids=frozenset({tokenizer.encode("\n")[0]}), seed=3)
    args.update(over)
    return RolloutLoader(model, load_task("tasks/arithmetic.py"), load_checker("tasks/arithmetic.py:reward"),
                         tokenizer, **args)


def test_the_loader_resumes_exactly():
    model = tiny()
    a = loader(model)
    first = a.next_batch()
    assert first.x.size(0) == 4 and len(a.queue) == 1 and a.taken == 2  # 4 x 2 rollouts / n 4 = 2 prompts
    state = a.state_dict()
    rest = [a.next_batch() for _ in range(3)]  # the step's second micro-batch, then the next step's two
    b = loader(model)
    b.load_state_dict(state)
    for want in rest:
        got = b.next_batch()
        assert torch.equal(got.x, want.x) and torch.equal(got.advantages, want.advantages)
    assert 0.0 <= float(first.rewards.mean()) <= 1.0


def test_processes_take_distinct_prompts():
    model = tiny()
    ranks = [loader(model, rank=r, world_size=2) for r in range(2)]
    taken = [r._prompts(3) for r in ranks]
    stream = load_task("tasks/arithmetic.py").prompts("train", 3)
    whole = [next(stream) for _ in range(6)]
    assert taken == [whole[0::2], whole[1::2]]
