"""benchmarks/serve_load.py's GPT-2-shaped random model: GPT-2 small's shape and vocabulary, loadable by serve.py,
with no tokenizer file to find; its fresh prompts, and benchmarks/serve_chat.py's conversations. (The loads
themselves start serve.py: run by hand, see BENCHMARKS.md.)"""

import asyncio
from types import SimpleNamespace

import openai
import pytest

from benchmarks import serve_chat, serve_load
from benchmarks.servers import SHAKESPEARE_CHARS
from gptkit.checkpoint import load_model


def test_the_gpt2_shaped_random_model_loads_and_takes_the_prompt(tmp_path):
    folder = serve_load.write_checkpoint(tmp_path / "gpt2-random", "gpt2-random", n_layer=1)
    model, tokenizer, _ = load_model(str(folder))
    c = model.config
    assert (c.vocab_size, c.padded_vocab_size, c.n_embd, c.n_head, c.block_size, c.n_layer) == (
        50257, 50304, 768, 12, 1024, 1)
    ids = tokenizer.encode(serve_load.PROMPT)
    assert tokenizer.decode(ids) == serve_load.PROMPT and max(ids) < 96  # every prompt character is a token
    assert "\ufffd" not in tokenizer.decode(range(50257))  # no token a stream would hold back


class FakeStream:
    """What the openai client's completions.create gives for a stream: chunks of text, then one with usage;
    `cut_after`: the connection drops after that many chunks."""

    def __init__(self, texts: list[str], cut_after: int | None = None):
        self.texts, self.cut_after = texts, cut_after

    async def __aiter__(self):
        for i, text in enumerate(self.texts):
            if i == self.cut_after:
                raise openai.APIConnectionError(request=None)
            yield SimpleNamespace(choices=[SimpleNamespace(text=text)], usage=None)
        yield SimpleNamespace(choices=[], usage=SimpleNamespace(completion_tokens=len(self.texts)))


class FakeClient:
    def __init__(self, answers: list):
        self.answers, self.calls = answers, 0
        self.completions = self

    async def create(self, **kwargs):
        answer = self.answers[self.calls]
        self.calls += 1
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_a_connection_closed_before_any_answer_is_sent_again():
    """llama-server now and then closes a new connection without answering: the request is sent again (at most
    RETRIES times) and counted; its time to first token counts from the first attempt. A connection that drops
    after text has come is a failure, never a retry (the tokens would be counted twice)."""
    closed = openai.APIConnectionError(request=None)
    client = FakeClient([closed, closed, FakeStream(["a", "b", "c"])])
    result = asyncio.run(serve_load.one_request(client, "m", 3, seed=0))
    assert (result.tokens, result.retries, client.calls) == (3, 2, 3) and result.first_token_s > 0
    client = FakeClient([closed] * (serve_load.RETRIES + 1))
    with pytest.raises(openai.APIConnectionError):
        asyncio.run(serve_load.one_request(client, "m", 3, seed=0))
    client = FakeClient([FakeStream(["a", "b", "c"], cut_after=2), FakeStream(["a"])])
    with pytest.raises(openai.APIConnectionError):
        asyncio.run(serve_load.one_request(client, "m", 3, seed=0))
    assert client.calls == 1


def test_every_request_of_a_load_has_a_prompt_of_its_own():
    prompts = [serve_load.fresh_prompt() for _ in range(2000)]
    assert len(set(prompts)) == 2000 and all(p.endswith(" " + serve_load.PROMPT) for p in prompts)
    # The baby model's (the default's) 65 characters have one digit: its prompts number themselves in letters.
    baby = [serve_load.fresh_prompt(letters=True) for _ in range(2000)]
    assert len(set(baby)) == 2000 and all(set(p) <= set(SHAKESPEARE_CHARS) for p in baby)


def test_a_conversation_grows_by_each_message_and_reply_and_fits_the_context(tmp_path):
    """Each turn's prompt is the last one, its reply and a message of --user characters, a character a token
    of gpt2-random's vocabulary (so the tokens sent back are those the server computed); two conversations
    share not even a first token; the defaults' last turn fits the 1,024-token context."""
    folder = serve_load.write_checkpoint(tmp_path / "gpt2-random", "gpt2-random", n_layer=1)
    _, tokenizer, _ = load_model(str(folder))
    one, two = serve_chat.Conversation(0, 40, 30), serve_chat.Conversation(1, 40, 30)
    first = one.ask(0)
    assert len(tokenizer.encode(first)) == 1 + 40 + 30 and first[0] != two.ask(0)[0]
    reply = tokenizer.decode(list(range(5000, 5056)))  # what a reply of 56 tokens may be
    one.answered(reply)
    second = one.ask(1)
    assert second.startswith(first + reply) and tokenizer.encode(second)[:len(first) + 56] == \
        tokenizer.encode(first) + list(range(5000, 5056))
    assert len(tokenizer.encode(second)) == 1 + 40 + 2 * 30 + 56
    assert serve_chat.tokens_at_last_turn(11, 40, 30, 56) == 987 <= serve_chat.CONTEXT
    with pytest.raises(SystemExit, match="the last turn would take 1073 tokens"):
        serve_chat.main(["--turns", "12"])


def test_the_table_gives_each_servers_tokens_per_s_and_ratios_with_their_ranges_over_the_rounds(capsys):
    """Rows as measure() leaves them (clients, requests, tokens, seconds, median tokens/s, TTFT median, p99,
    the rounds' tokens/s): each tokens/s as median (range), each ratio round by round with its range, and the
    verdict against the first server: "at parity" where the ranges overlap."""
    ours = [(1, 6, 384, 3.0, 120.0, 0.04, 0.05, [100.0, 120.0, 130.0]),
            (16, 96, 6144, 20.0, 300.0, 0.4, 0.5, [300.0, 280.0, 310.0])]
    theirs = [(1, 6, 384, 3.0, 100.0, 0.03, 0.04, [90.0, 100.0, 125.0]),
              (16, 96, 6144, 20.0, 200.0, 0.4, 0.5, [200.0, 190.0, 205.0])]
    serve_load.print_table([("auto", "gpt2", ours), ("llama-server q8_0", "gpt2", theirs)], 64)
    lines = capsys.readouterr().out.splitlines()
    assert "median (range) of 3 interleaved rounds" in lines[0]
    assert lines[3] == "| auto | 1 | 6 | 384 | 3.0 | 120 (100-130) | 1.00x | 1.00x | 40 ms | 50 ms |"
    assert lines[4] == "| auto | 16 | 96 | 6144 | 20.0 | 300 (280-310) | 2.38x (2.33-3.00) | 1.00x | 400 ms | 500 ms |"
    assert lines[5].startswith("| llama-server q8_0 | 1 | 6 | 384 | 3.0 | 100 (90-125) | 1.00x | "
                               "0.90x (0.83-0.96), at parity |")
    assert "| 200 (190-205) | 1.90x (1.64-2.22) | 0.67x (0.66-0.68), behind |" in lines[6]


def test_conversations_ratios_against_llama_server_are_taken_round_by_round(capsys):
    """serve_chat.py's tables: the replies' tokens/s as median (range) over the rounds, each turn's time to
    first token against llama-server's as the rounds' ratios (lower is better: 'ahead' when ours is lower and
    the ranges do not overlap), and the tokens/s ratio with its verdict."""
    def row(server, firsts, rates):
        r = serve_chat.Row(server, 1, [])
        for first, rate in zip(firsts, rates):  # one round: two turns of one client, 10 tokens each
            turns = [serve_chat.Turn(0, first[0], 10, 0.1), serve_chat.Turn(1, first[1], 10, 0.1)]
            r.turns += turns
            r.rounds.append((turns, 20, 20 / rate))
        return r

    ours = row("serve.py", [(0.030, 0.020), (0.040, 0.022), (0.035, 0.021)], [60.0, 50.0, 55.0])
    theirs = row("llama-server", [(0.050, 0.060), (0.052, 0.070), (0.045, 0.065)], [58.0, 52.0, 70.0])
    args = SimpleNamespace(turns=2, system=40, user=30, max_tokens=10, rounds=3)
    serve_chat.print_tables([ours, theirs], args, {})
    out = capsys.readouterr().out
    assert "| serve.py | 35 ms | 21 ms | 55.0 (50.0-60.0) |" in out
    assert "| serve.py: against its turn 1 | 1.00x | 0.60x (0.55-0.67) | |" in out
    assert ("| serve.py / llama-server | 0.77x (0.60-0.78), ahead | 0.32x (0.31-0.33), ahead | "
            "0.96x (0.79-1.03), at parity |") in out
