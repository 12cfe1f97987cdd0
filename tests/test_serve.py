"""serve.py and gptkit/serving/routes.py: the OpenAI-compatible server, started in a subprocess on a free
127.0.0.1 port and driven by the official `openai` client (raw HTTP for what a client cannot send). Greedy
replies are checked against gptkit.generate.generate on the same prompt ids."""

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import confident_model, needs_gpt2_bpe, torch_threads

openai = pytest.importorskip("openai", reason="the tests' client: pip install -e \".[dev]\"")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette", reason="serving needs it: pip install -e \".[serve]\"")
pytest.importorskip("uvicorn", reason="serving needs it: pip install -e \".[serve]\"")
pytest.importorskip("pydantic", reason="serving needs it: pip install -e \".[serve]\"")

import serve  # noqa: E402  (after the skips: the server's packages are optional)
from gptkit.chat import ChatTokens, prompt_ids  # noqa: E402
from gptkit.checkpoint import save_checkpoint  # noqa: E402
from gptkit.generate import SamplingOptions, generate  # noqa: E402
from gptkit.runtime import ram  # noqa: E402
from gptkit.serving.routes import Job, Pieces, Reply, ReplyText, _sse  # noqa: E402
from gptkit.tokenizer import CHAT_SPECIALS, Tokenizer  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CHARS = sorted({chr(c) for c in range(32, 127)} | {"\n"})  # ids 0..95; the chat specials take 96..100
TRAINED = 48  # the chat model learned positions 0..47: its greedy replies are tested inside them
CHAT_BLOCK = 256
TEXT_BLOCK = 4096  # the text model's replies are long: they are still decoding while a test looks
WAIT = 60  # seconds: the bound on every wait, so that a broken server fails a test instead of hanging it
_HTTP = threading.local()


def http() -> httpx.Client:
    """This thread's client for the tests' raw requests: httpx.get and httpx.post make a client per call, whose
    SSL context alone takes ~25 ms of CPU (the fuzzing test sends 160). Without keep-alive, each request goes on
    a connection of its own, as with httpx.post."""
    if not hasattr(_HTTP, "client"):
        _HTTP.client = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
    return _HTTP.client


# ----------------------------------------------------------------------------- models and servers


def save(folder: Path, model: GPT, tokenizer: Tokenizer) -> Path:
    meta = {"format_version": 1, "tokenizer": tokenizer.to_meta(), "vocab_size": tokenizer.vocab_size,
            "eot_id": tokenizer.eot_id, "splits": {}}
    save_checkpoint({"format": 1, "model_config": model.config.to_dict(), "model": model.state_dict(),
                     "tokenizer": meta, "step": 1, "config": {}}, folder / "best.pt")
    return folder


class Server:
    """serve.py in a subprocess (started here, then `ready`): its URL, an openai client, its stderr lines."""

    def __init__(self, ckpt: Path, *args: str, key: str = "none", env: dict | None = None):
        # One thread: on tiny matrices more threads only add synchronisation, and on the 2 shared cores of a
        # test run they fight the other processes (up to ~8x slower, measured).
        env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self.key = key  # what the openai client sends
        command = [sys.executable, "serve.py", f"--ckpt={ckpt}", "--port=0", "--device=cpu", *args]
        self.proc = subprocess.Popen(command, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
        self.lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def ready(self) -> "Server":
        line = self.wait_for_line("serve.py: serving")
        self.url = "http://" + line.split("http://")[1].split()[0].removesuffix("/v1")
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=self.key, max_retries=0, timeout=WAIT)
        self.model = line.split("'")[1]
        return self

    def _read(self):
        for line in self.proc.stderr:  # drained all along, or a full pipe would block the server
            self.stderr.append(line)
            self.lines.put(line)

    def wait_for_line(self, start: str) -> str:
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                assert self.proc.poll() is None, f"serve.py exited: {''.join(self.stderr)}"
                continue
            if line.startswith(start):
                return line
        raise AssertionError(f"serve.py did not say {start!r} within {WAIT} s: {''.join(self.stderr)}")

    def post(self, path: str, body, headers: dict | None = None, **kwargs) -> httpx.Response:
        """A raw POST, JSON unless the headers say otherwise."""
        content = body if isinstance(body, (str, bytes)) else json.dumps(body)
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self.key}", **(headers or {})}
        return http().post(self.url + path, content=content, headers=headers, timeout=kwargs.pop("timeout", WAIT),
                          **kwargs)

    def health(self) -> dict:
        return http().get(self.url + "/health", timeout=WAIT).json()

    def wait_until_idle(self) -> dict:
        return self.wait_for_load(0, 0)

    def wait_for_load(self, active: int, waiting: int) -> dict:
        """/health once it shows `active` rows decoding and `waiting` requests queued (at most WAIT s)."""
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            h = self.health()
            if (h["active"], h["waiting"]) == (active, waiting):
                return h
            time.sleep(0.02)
        raise AssertionError(f"the server's load is not {active} active, {waiting} waiting after {WAIT} s: "
                             f"{self.health()}")

    def stop(self):
        if hasattr(self, "client"):
            self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=WAIT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The references decode in this process: one thread, for the reason given in Server."""
    with torch_threads(1):
        yield


def trained_chat_model() -> tuple[GPT, Tokenizer]:
    """A char-level chat model (the chat special tokens after the 96 characters) trained to count in steps of
    3: its greedy replies have logit margins of several units, far above the rounding differences between
    decoding in a batch and alone. It learned positions up to TRAINED; the rest of its context is
    untrained."""
    tokenizer = Tokenizer({"kind": "char", "chars": CHARS}).with_special(CHAT_SPECIALS)
    shape = dict(vocab_size=tokenizer.vocab_size, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
    trained = confident_model(GPTConfig(block_size=TRAINED, **shape), "cpu", steps=80)
    model = GPT(GPTConfig(block_size=CHAT_BLOCK, **shape))
    state = trained.state_dict()
    wpe = model.transformer.wpe.weight.detach().clone()
    wpe[:TRAINED] = state["transformer.wpe.weight"]
    model.load_state_dict({**state, "transformer.wpe.weight": wpe})
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def text_ckpt(tmp_path_factory):
    """Random weights, characters without special tokens: no stop token, so a reply runs to max_tokens, and
    with a long context that takes seconds (a test can watch it being decoded)."""
    tokenizer = Tokenizer({"kind": "char", "chars": CHARS})
    torch.manual_seed(1)
    cfg = GPTConfig(block_size=TEXT_BLOCK, vocab_size=tokenizer.vocab_size, n_layer=2, n_head=2, n_embd=32)
    model = GPT(cfg)
    return save(tmp_path_factory.mktemp("serve") / "out-text", model, tokenizer)


@pytest.fixture(scope="module")
def servers(text_ckpt, tmp_path_factory):
    """The module's two servers, started side by side (the text one starts while the chat model trains):
    the chat model with 4 rows and 4 places in the queue (8 requests at once fill both), and the text model
    with 2 and 2."""
    started = [Server(text_ckpt, "--max_batch=2", "--max_queue=2", "--model_name=babbler")]
    try:
        chat_model = trained_chat_model()
        ckpt = save(tmp_path_factory.mktemp("serve") / "out-chat", *chat_model)
        started.append(Server(ckpt, "--max_batch=4", "--max_queue=4"))
        yield chat_model, started[1].ready(), started[0].ready()
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="module")
def chat_model(servers):
    return servers[0]


@pytest.fixture(scope="module")
def chat_server(servers):
    return servers[1]


@pytest.fixture(scope="module")
def text_server(servers):
    return servers[2]


# ----------------------------------------------------------------------------- the reference


def counting(start: int, length: int) -> str:
    """Text the chat model continues confidently: characters whose ids count up in steps of 3."""
    return "".join(CHARS[(start + 3 * i) % len(CHARS)] for i in range(length))


def greedy(chat_model, ids: list[int], max_tokens: int, stop_ids, stops=()) -> tuple[str, str, int]:
    """What the server must answer at temperature 0: (text, finish_reason, completion tokens), from
    gptkit.generate.generate on the same prompt ids, cut at the first stop token, then before the first stop
    string (whose last token is the last one counted)."""
    model, tokenizer = chat_model
    out = generate(model, torch.tensor([ids]), max_tokens, SamplingOptions(temperature=0))
    tokens = out[0, len(ids):].tolist()
    reason = "length"
    for i, t in enumerate(tokens):
        if t in stop_ids:
            tokens, reason = tokens[:i], "stop"
            break
    for k in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:k])
        found = [text.find(s) for s in stops if s in text]
        if found:
            return text[:min(found)], "stop", k
    return tokenizer.decode(tokens), reason, len(tokens)


def completion_reference(chat_model, prompt: str, max_tokens: int, stops=()):
    """A completion ends where a chat reply does: at end-of-text and at every marker of the chat template."""
    _, tokenizer = chat_model
    ends = ChatTokens.of(tokenizer).stop_ids | {tokenizer.eot_id}
    return greedy(chat_model, tokenizer.encode(prompt), max_tokens, ends, stops)


def chat_reference(chat_model, messages: list[dict], max_tokens: int):
    _, tokenizer = chat_model
    return greedy(chat_model, prompt_ids(messages, tokenizer), max_tokens, ChatTokens.of(tokenizer).stop_ids)


def complete(server: Server, prompt, **options):
    return server.client.completions.create(model=server.model, prompt=prompt, **options)


def streamed(chunks) -> tuple[dict[int, str], dict[int, str], object]:
    """A stream's text and finish_reason per choice, and its usage (completions or chat chunks)."""
    texts, reasons, usage = {}, {}, None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            piece = c.delta.content if hasattr(c, "delta") else c.text
            texts[c.index] = texts.get(c.index, "") + (piece or "")
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


# ----------------------------------------------------------------------------- the API


def test_models_list(chat_server, text_server):
    assert [m.id for m in chat_server.client.models.list()] == ["out-chat"]  # the checkpoint's folder
    assert [m.id for m in text_server.client.models.list()] == ["babbler"]  # --model_name
    assert text_server.client.models.retrieve("babbler").id == "babbler"


def test_text_completion_is_the_greedy_reply(chat_server, chat_model):
    prompt = counting(10, 6)
    text, reason, tokens = completion_reference(chat_model, prompt, 20)
    r = complete(chat_server, prompt, max_tokens=20, temperature=0)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (text, reason)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (6, tokens, 6 + tokens)
    assert r.object == "text_completion" and r.model == "out-chat"


def test_a_completion_that_draws_end_of_text_stops(chat_server, chat_model):
    prompt = counting(84, 3)  # ids 84, 87, 90: counting reaches 96, <|endoftext|>, two tokens later
    text, reason, tokens = completion_reference(chat_model, prompt, 30)
    assert reason == "stop"  # the reference draws it: the case is covered
    r = complete(chat_server, prompt, max_tokens=30, temperature=0)
    c = r.choices[0]
    assert (c.text, c.finish_reason, r.usage.completion_tokens) == (text, "stop", tokens)


def test_streamed_completion_adds_up_to_the_reply(chat_server, chat_model):
    prompt = counting(20, 5)
    text, reason, tokens = completion_reference(chat_model, prompt, 25)
    chunks = list(complete(chat_server, prompt, max_tokens=25, temperature=0, stream=True,
                           stream_options={"include_usage": True}))
    texts, reasons, usage = streamed(chunks)
    assert (texts, reasons) == ({0: text}, {0: reason})
    assert len(chunks) > 3  # piece by piece, not one block
    assert chunks[-1].choices == [] and usage.completion_tokens == tokens and usage.prompt_tokens == 5
    plain = list(complete(chat_server, prompt, max_tokens=25, temperature=0, stream=True))
    assert all(c.usage is None for c in plain) and streamed(plain)[0] == {0: text}


def test_chat_completion_streamed_and_not(chat_server, chat_model):
    messages = [{"role": "system", "content": "Count."}, {"role": "user", "content": counting(30, 4)}]
    text, reason, tokens = chat_reference(chat_model, messages, 20)
    r = chat_server.client.chat.completions.create(model=chat_server.model, messages=messages, max_tokens=20,
                                                   temperature=0)
    assert (r.choices[0].message.role, r.choices[0].message.content) == ("assistant", text)
    assert r.choices[0].finish_reason == reason and r.object == "chat.completion"
    assert r.usage.prompt_tokens == len(prompt_ids(messages, chat_model[1]))
    assert r.usage.completion_tokens == tokens
    chunks = list(chat_server.client.chat.completions.create(
        model=chat_server.model, messages=messages, max_completion_tokens=20, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert streamed(chunks)[:2] == ({0: text}, {0: reason})


def metrics(server: Server) -> dict[str, float]:
    """GET /metrics, parsed: each value by its name."""
    r = http().get(server.url + "/metrics", timeout=WAIT)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {line.split()[0]: float(line.split()[1]) for line in r.text.splitlines() if not line.startswith("#")}


def test_a_conversation_computes_only_what_each_message_adds(chat_server, chat_model):
    """Three turns of a chat, each request the whole history: every reply is the greedy one from the whole
    prompt; from the second turn on, the usage's cached_tokens is all of the last prompt and the reply
    tokens fed back (the server kept their keys and values), and /metrics counts them and the memory held."""
    assert "prefix cache up to " in "".join(chat_server.stderr)
    before = metrics(chat_server)
    messages, cached, expected = [{"role": "system", "content": "Count on."}], [], []
    for turn in range(3):  # (inside the positions the model learned)
        messages.append({"role": "user", "content": counting(5 + 3 * turn, 3)})
        text, reason, tokens = chat_reference(chat_model, messages, 4)
        r = chat_server.client.chat.completions.create(model=chat_server.model, messages=messages, max_tokens=4,
                                                       temperature=0)
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == (text, reason)
        assert r.usage.prompt_tokens == len(prompt_ids(messages, chat_model[1]))
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        # The next prompt starts with this one and the reply; the reply's last token was fed back unless it
        # was the last one (max_tokens).
        expected.append(r.usage.prompt_tokens + tokens - (reason == "length"))
        messages.append({"role": "assistant", "content": text})
    assert cached[1:] == expected[:2]
    after = metrics(chat_server)
    assert after["gptkit_prompt_tokens_cached_total"] - before["gptkit_prompt_tokens_cached_total"] == sum(cached)
    assert after["gptkit_prefix_cache_hits_total"] - before["gptkit_prefix_cache_hits_total"] >= 2
    assert 0 < after["gptkit_prefix_cache_hit_rate"] <= 1
    assert 0 < after["gptkit_prefix_cache_bytes"] <= after["gptkit_prefix_cache_bound_bytes"]
    assert after["gptkit_prefix_cache_tokens"] >= expected[-1]


def test_a_chat_reply_ends_at_the_end_token(chat_server, chat_model):
    """The counting model says <|end|> (id 100) 33 tokens after <|assistant|> (id 99): the reply ends."""
    messages = [{"role": "user", "content": counting(40, 3)}]
    text, reason, tokens = chat_reference(chat_model, messages, 48)
    assert reason == "stop"
    r = chat_server.client.chat.completions.create(model=chat_server.model, messages=messages, temperature=0)
    assert (r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens) == (
        text, "stop", tokens)


def test_eight_concurrent_requests_equal_their_one_at_a_time_replies(chat_server, chat_model):
    """Different prompts and lengths, 4 rows and 4 waiting: requests join the batch as others leave it.
    Five greedy, three sampled with their own seeds."""
    requests = [dict(prompt=counting(7 * i, 3 + i % 4), max_tokens=10 + 3 * i, temperature=0)
                for i in range(5)]
    requests += [dict(prompt=counting(5 * i, 4), max_tokens=20, temperature=1.0, top_p=0.9, seed=i)
                 for i in range(3)]

    def ask(r):
        c = complete(chat_server, **r).choices[0]
        return c.text, c.finish_reason

    alone = [ask(r) for r in requests]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, requests))
    assert together == alone
    greedy_ones = [completion_reference(chat_model, r["prompt"], r["max_tokens"])[:2] for r in requests[:5]]
    assert alone[:5] == greedy_ones
    assert len(set(alone)) == 8  # eight different replies: none can stand in for another


def test_stop_strings_end_the_reply_before_them(chat_server, chat_model):
    prompt = counting(3, 4)
    whole = completion_reference(chat_model, prompt, 24)[0]
    stop = whole[6:8]  # two characters, two tokens: the first is held back until the second shows the match
    text, reason, tokens = completion_reference(chat_model, prompt, 24, stops=("not there", stop))
    assert reason == "stop" and text == whole[:whole.find(stop)]
    r = complete(chat_server, prompt, max_tokens=24, temperature=0, stop=["not there", stop])
    c = r.choices[0]
    assert (c.text, c.finish_reason, r.usage.completion_tokens) == (text, "stop", tokens)
    chunks = complete(chat_server, prompt, max_tokens=24, temperature=0, stop=stop, stream=True,
                      stream_options={"include_usage": True})
    texts, reasons, usage = streamed(chunks)
    assert (texts, reasons, usage.completion_tokens) == ({0: text}, {0: "stop"}, tokens)
    r = complete(chat_server, prompt, max_tokens=24, temperature=0, stop="not there")
    assert (r.choices[0].text, r.choices[0].finish_reason) == (whole, "length")


def test_reply_text_holds_back_what_may_start_a_stop_string():
    tokenizer = Tokenizer({"kind": "char", "chars": CHARS})
    text = ReplyText(tokenizer, ["world", "wx"])
    pieces = [text.push(t) for t in tokenizer.encode("hello world")]
    assert pieces == ["h", "e", "l", "l", "o", " ", "", "", "", "", ""] and text.stopped and text.tokens == 11
    text = ReplyText(tokenizer, ["world"])
    pieces = [text.push(t) for t in tokenizer.encode("a word wo")] + [text.finish()]
    assert pieces == ["a", " ", "", "", "", "word", " ", "", "", "wo"] and not text.stopped


@needs_gpt2_bpe
def test_reply_text_covers_the_tokens_whose_text_is_returned():
    """Tokens of several characters: a token is covered (its logprob listed) once its first character is in the
    returned text; a stop string inside a token keeps that token, and drops the tokens after the cut."""
    tokenizer = Tokenizer({"kind": "tiktoken", "name": "gpt2"})
    ids = tokenizer.encode("Hello there, the end")  # Hello| there|,| the| end
    text = ReplyText(tokenizer, ["the"])
    pieces = [text.push(t) for t in ids[:2]]
    assert pieces == ["Hello", " "] and text.stopped and text.covered == 2  # " there" starts in the text
    text = ReplyText(tokenizer, [", the"])
    assert [text.push(t) for t in ids[:3]] == ["Hello", " there", ""] and text.covered == 2  # "," held back
    assert text.push(ids[3]) == "" and text.stopped and text.covered == 2  # the stop string's tokens: none
    text = ReplyText(tokenizer, ["zzz"])
    assert "".join(text.push(t) for t in ids) + text.finish() == "Hello there, the end" and text.covered == 5


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
def test_a_text_event_is_its_chunk_rendered_as_json(chat, include_usage):
    """A stream's text events come from a template rendered once per choice: each is, byte for byte, the
    chunk's dict encoded as JSON, whatever the text holds (quotes, backslashes, newlines, control characters,
    non-ASCII, the template's own mark)."""
    tokenizer = Tokenizer({"kind": "char", "chars": CHARS})
    job = Job(chat=chat, prompts=[[1], [2]], max_tokens=[4, 4], n=2, sampling=SamplingOptions(), stops=[],
              stop_ids=frozenset(), seed=None, stream=True, include_usage=include_usage)
    reply = Reply('chatcmpl-"x"', 1700000000, "served\\model", job, Pieces(tokenizer))
    for text in ["a", " ", '"quoted" \\ back', "two\nlines\ttab\x00\x1f", "é 世界 🤖", "\x00gptkit: the text goes here\x00"]:
        for index in range(4):
            event = reply._text_event(index, text)
            assert event == _sse(reply._chunk(index, text, None))
            assert json.loads(event.removeprefix(b"data: "))["choices"][0]["delta" if chat else "text"] == (
                {"content": text} if chat else text)


def test_n_choices(chat_server, chat_model):
    prompt = counting(12, 4)
    text, _, tokens = completion_reference(chat_model, prompt, 12)
    r = complete(chat_server, prompt, max_tokens=12, temperature=0, n=3)
    assert [(c.index, c.text) for c in r.choices] == [(0, text), (1, text), (2, text)]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (4, 3 * tokens)  # the prompt counts once
    # Sampled: choice i draws from seed + i, so it is the single reply with that seed.
    sampled = complete(chat_server, prompt, max_tokens=12, temperature=2, n=3, seed=40)
    singles = [complete(chat_server, prompt, max_tokens=12, temperature=2, seed=40 + i).choices[0].text
               for i in range(3)]
    assert [c.text for c in sampled.choices] == singles
    texts, reasons, _ = streamed(complete(chat_server, prompt, max_tokens=12, temperature=2, n=3, seed=40,
                                          stream=True))
    assert texts == dict(enumerate(singles)) and set(reasons) == {0, 1, 2}
    # A list of prompts: prompt i's choices are i*n .. i*n+n-1, as OpenAI numbers them.
    two = complete(chat_server, [prompt, counting(50, 3)], max_tokens=12, temperature=0, n=2)
    other = completion_reference(chat_model, counting(50, 3), 12)[0]
    assert [c.text for c in two.choices] == [text, text, other, other]
    ids = chat_model[1].encode(prompt)
    assert complete(chat_server, ids, max_tokens=12, temperature=0).choices[0].text == text  # token ids


# ----------------------------------------------------------------------------- sampling parameters, logprobs

TOL = 1e-4  # the server's batched, cached (and on a CPU packed) forward against a full one: rounding only


def close_logprobs(a: list[float], b: list[float]) -> bool:
    """The same log-probabilities up to TOL (a repeated prompt may reuse cached keys and values)."""
    return len(a) == len(b) and all(abs(x - y) < TOL for x, y in zip(a, b))


@torch.no_grad()
def log_probs(chat_model, ids: list[int]) -> torch.Tensor:
    """The direct computation: log_softmax of the model's logits at every position of ids, (T, V); row t
    predicts ids[t + 1]."""
    model, _ = chat_model
    return torch.log_softmax(model.head(model.hidden_states(torch.tensor([ids])), fp32=True)[0], dim=-1)


def test_echo_with_logprobs_scores_the_prompt(chat_server, chat_model):
    """What lm-evaluation-harness's local-completions model sends: token ids, echo, logprobs=1, max_tokens 1
    (or 0: the prompt alone). Each prompt token's logprob is the model's (the first has none)."""
    tokenizer = chat_model[1]
    ids = tokenizer.encode(counting(5, 6) + "x?")  # a surprise at the end: not all greedy
    expected = log_probs(chat_model, ids)
    r = complete(chat_server, ids, max_tokens=0, echo=True, logprobs=1, temperature=0)
    c = r.choices[0]
    assert (c.text, c.finish_reason, r.usage.completion_tokens) == (tokenizer.decode(ids), "length", 0)
    lp = c.logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in ids] and lp.text_offset == list(range(len(ids)))
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for t in range(1, len(ids)):
        assert abs(lp.token_logprobs[t] - expected[t - 1, ids[t]].item()) < TOL
        [(best, value)] = lp.top_logprobs[t].items()
        assert best == tokenizer.decode([int(expected[t - 1].argmax())]) and abs(value - expected[t - 1].max()) < TOL
    # max_tokens=1: the same, then the drawn token (the harness drops that last one); streamed alike.
    one = complete(chat_server, ids, max_tokens=1, echo=True, logprobs=2, temperature=0).choices[0]
    assert one.logprobs.token_logprobs[:-1] == lp.token_logprobs and len(one.logprobs.tokens) == len(ids) + 1
    assert abs(one.logprobs.token_logprobs[-1] - log_probs(chat_model, ids)[-1].max()) < TOL
    chunks = list(complete(chat_server, ids, max_tokens=1, echo=True, logprobs=2, temperature=0, stream=True))
    streamed_logprobs = [x for ch in chunks for c in ch.choices if c.logprobs for x in c.logprobs.token_logprobs]
    # (The prompt's from a forward of its own, equal; the drawn token's from the prefix cache's keys and values
    # and the last prompt token: equal to rounding.)
    assert streamed_logprobs[:-1] == one.logprobs.token_logprobs[:-1]
    assert abs(streamed_logprobs[-1] - one.logprobs.token_logprobs[-1]) < TOL
    assert "".join(c.text for ch in chunks for c in ch.choices) == one.text
    # Two prompts in one request, text ones too: each scored on its own.
    two = complete(chat_server, [counting(5, 6) + "x?", "abc"], max_tokens=0, echo=True, logprobs=0)
    assert [c.text for c in two.choices] == [counting(5, 6) + "x?", "abc"]
    assert two.choices[0].logprobs.token_logprobs == lp.token_logprobs
    assert two.choices[1].logprobs.top_logprobs == [None, {}, {}]


def test_chat_logprobs_are_the_models(chat_server, chat_model):
    messages = [{"role": "user", "content": counting(30, 4)}]
    r = chat_server.client.chat.completions.create(model=chat_server.model, messages=messages, max_tokens=10,
                                                   temperature=0, logprobs=True, top_logprobs=3)
    c = r.choices[0]
    content = c.logprobs.content
    assert "".join(x.token for x in content) == c.message.content and len(content) == r.usage.completion_tokens
    ids = prompt_ids(messages, chat_model[1])
    reply = [chat_model[1].encode(x.token)[0] for x in content]
    expected = log_probs(chat_model, ids + reply)[len(ids) - 1:]
    for x, token, row in zip(content, reply, expected):
        assert abs(x.logprob - row[token].item()) < TOL and x.bytes == list(x.token.encode())
        assert [t.token for t in x.top_logprobs] == [chat_model[1].decode([i]) for i in row.topk(3).indices]
    chunks = list(chat_server.client.chat.completions.create(
        model=chat_server.model, messages=messages, max_tokens=10, temperature=0, logprobs=True, stream=True))
    pieces = [x for ch in chunks for ch_c in ch.choices if ch_c.logprobs for x in ch_c.logprobs.content]
    # (The second request reuses the first one's keys and values: equal to rounding.)
    assert [x.token for x in pieces] == [x.token for x in content]
    assert all(abs(x.logprob - y.logprob) < TOL for x, y in zip(pieces, content))
    assert all(x.top_logprobs == [] for x in pieces)


def test_logprobs_cover_only_the_text_a_stop_string_returns(chat_server, chat_model):
    """The tokens of a stop string are not in the text, so not in the logprobs either: not in
    tokens/text_offset/top_logprobs, not in a streamed chunk (whose tokens are its text), not in chat's
    logprobs.content."""
    prompt = counting(3, 4)
    whole = completion_reference(chat_model, prompt, 24)[0]
    held = whole[2] + ("#" if whole[3] != "#" else "$")  # a stop string's start: whole[2] is held a token
    stops = [whole[6:9], held]
    text = completion_reference(chat_model, prompt, 24, stops=stops)[0]
    assert text == whole[:6]
    full = complete(chat_server, prompt, max_tokens=24, temperature=0, logprobs=2).choices[0].logprobs
    c = complete(chat_server, prompt, max_tokens=24, temperature=0, logprobs=2, stop=stops).choices[0]
    lp = c.logprobs
    assert (c.text, c.finish_reason) == (text, "stop")
    assert lp.tokens == list(text) and lp.text_offset == list(range(len(text)))
    # (equal up to rounding: a repeated prompt's keys and values may come from the prefix cache)
    assert close_logprobs(lp.token_logprobs, full.token_logprobs[:6])
    assert [list(t) for t in lp.top_logprobs] == [list(t) for t in full.top_logprobs[:6]]
    assert all(close_logprobs(list(a.values()), list(b.values())) for a, b in zip(lp.top_logprobs, full.top_logprobs))
    chunks = list(complete(chat_server, prompt, max_tokens=24, temperature=0, logprobs=2, stop=stops, stream=True))
    parts = [c for ch in chunks for c in ch.choices]
    assert all("".join(c.logprobs.tokens if c.logprobs else []) == c.text for c in parts)
    assert any(len(c.text) == 2 for c in parts)  # whole[2], held back, came with whole[3]
    assert [x for c in parts if c.logprobs for x in c.logprobs.text_offset] == list(range(len(text)))
    assert close_logprobs([x for c in parts if c.logprobs for x in c.logprobs.token_logprobs], full.token_logprobs[:6])
    # Chat: the same.
    messages = [{"role": "user", "content": counting(30, 4)}]
    content = chat_reference(chat_model, messages, 20)[0]
    assert len(content) >= 9
    ask = dict(model=chat_server.model, messages=messages, max_tokens=20, temperature=0, logprobs=True,
               top_logprobs=2)
    plain = chat_server.client.chat.completions.create(**ask).choices[0].logprobs.content
    r = chat_server.client.chat.completions.create(**ask, stop=content[5:8]).choices[0]
    assert r.message.content == content[:5] and [x.token for x in r.logprobs.content] == list(content[:5])
    assert close_logprobs([x.logprob for x in r.logprobs.content], [x.logprob for x in plain[:5]])
    assert [[t.token for t in x.top_logprobs] for x in r.logprobs.content] == [[t.token for t in x.top_logprobs]
                                                                               for x in plain[:5]]
    assert all(close_logprobs([t.logprob for t in x.top_logprobs], [t.logprob for t in y.top_logprobs])
               for x, y in zip(r.logprobs.content, plain))
    chunks = list(chat_server.client.chat.completions.create(**ask, stop=content[5:8], stream=True))
    parts = [c for ch in chunks for c in ch.choices]
    assert all("".join(x.token for x in (c.logprobs.content if c.logprobs else [])) == (c.delta.content or "")
               for c in parts)
    assert "".join(c.delta.content or "" for c in parts) == content[:5]


def test_top_p_0_is_greedy(chat_server, chat_model):
    prompt = counting(12, 4)
    text = completion_reference(chat_model, prompt, 12)[0]
    sampled = [complete(chat_server, prompt, max_tokens=12, temperature=2, seed=s).choices[0].text for s in range(3)]
    assert any(t != text for t in sampled)  # at temperature 2 the draws differ from the greedy reply...
    for s in range(3):  # ... unless top_p is 0: the likeliest token only
        assert complete(chat_server, prompt, max_tokens=12, temperature=2, top_p=0, seed=s).choices[0].text == text


@torch.no_grad()
def greedy_adjusted(chat_model, ids: list[int], n: int, bias: dict[int, float], frequency: float) -> str:
    """The greedy reply with logit_bias (-100: banned) and the frequency penalty applied by hand; stops at
    the chat model's end tokens."""
    model, tokenizer = chat_model
    ends, out, counts = ChatTokens.of(tokenizer).stop_ids, [], torch.zeros(tokenizer.vocab_size)
    for _ in range(n):
        logits = model.head(model.hidden_states(torch.tensor([ids + out])), fp32=True)[0, -1]
        for t, b in bias.items():
            logits[t] += float("-inf") if b <= -100 else b
        token = int((logits - frequency * counts).argmax())
        if token in ends:
            break
        counts[token] += 1
        out.append(token)
    return tokenizer.decode(out)


def test_logit_bias_penalties_and_top_k_reach_each_reply(chat_server, chat_model):
    """The benchmark clients' logit_bias (ban end-of-text) and the other parameters, applied per request: at
    temperature 2 with top_k=1 a reply is still the (adjusted) greedy one."""
    tokenizer = chat_model[1]
    prompt = counting(12, 4)
    plain = complete(chat_server, prompt, max_tokens=12, temperature=0).choices[0].text
    ban = {str(tokenizer.encode(plain[0])[0]): -100, str(tokenizer.eot_id): -100}
    bias = {int(t): float(b) for t, b in ban.items()}
    ids = tokenizer.encode(prompt)
    r = complete(chat_server, prompt, max_tokens=12, temperature=2, seed=1, logit_bias=ban,
                 frequency_penalty=1.5, extra_body={"top_k": 1})  # top_k: an extension, as clients send it
    text = r.choices[0].text
    assert text == greedy_adjusted(chat_model, ids, 12, bias, 1.5) and text[0] != plain[0]
    r = complete(chat_server, prompt, max_tokens=12, temperature=0, logit_bias=ban)
    assert r.choices[0].text == greedy_adjusted(chat_model, ids, 12, bias, 0.0)
    assert complete(chat_server, prompt, max_tokens=12, temperature=0).choices[0].text == plain  # no carry-over


def test_a_completion_on_a_chat_model_stops_at_its_end_tokens(chat_server, chat_model):
    """A completion on a chat model ends at the template's markers (<|end|>, <|user|>, ...) as a chat reply
    does, instead of writing them as text and running on to max_tokens; a special token is never text."""
    model, tokenizer = chat_model
    ends = ChatTokens.of(tokenizer).stop_ids
    # Counting ids 91, 94, <|system|> (97) goes on to <|end|> (100); counting characters reaches a marker later.
    for prompt, end in (([91, 94, 97], "<|end|>"), (tokenizer.encode(counting(20, 5)), None)):
        raw = generate(model, torch.tensor([prompt]), 40, SamplingOptions(temperature=0))[0, len(prompt):].tolist()
        cut = next(i for i, t in enumerate(raw) if t in ends)  # the greedy reply does reach one: covered
        assert end is None or raw[cut] == tokenizer.special[end]
        for skip in (True, False):  # a stop token is never text, whatever skip_special_tokens says
            r = chat_server.post(COMPLETIONS, {"prompt": prompt, "max_tokens": 40, "temperature": 0,
                                               "skip_special_tokens": skip}).json()
            c = r["choices"][0]
            assert (c["text"], c["finish_reason"]) == (tokenizer.decode(raw[:cut]), "stop")
            assert "<|" not in c["text"] and r["usage"]["completion_tokens"] == cut


def test_reply_text_writes_no_special_tokens_unless_asked():
    tokenizer = Tokenizer({"kind": "char", "chars": CHARS}).with_special(["<|endoftext|>", "<|tool|>"])
    tool = tokenizer.special["<|tool|>"]
    ids = tokenizer.encode("ab") + [tool] + tokenizer.encode("c")
    hidden = ReplyText(tokenizer, [], frozenset(tokenizer.special.values()))
    assert [hidden.push(t) for t in ids] == ["a", "b", "", "c"] and hidden.tokens == 4
    shown = ReplyText(tokenizer, [])
    assert "".join(shown.push(t) for t in ids) == "ab<|tool|>c"


# ----------------------------------------------------------------------------- bad requests

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path, body, status, param", [
    (COMPLETIONS, '{"prompt": "abc", ', 400, None),  # malformed JSON
    (COMPLETIONS, "[1, 2]", 400, None),
    (COMPLETIONS, '{"prompt": "abc", "max_tokens": NaN}', 400, None),
    (COMPLETIONS, {"model": "gpt-4", "prompt": "abc"}, 404, "model"),
    (COMPLETIONS, {"prompt": "abc", "max_tokens": -1}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "abc", "max_tokens": 0}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "abc", "max_tokens": 10**30}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "abc", "max_tokens": CHAT_BLOCK - 2}, 400, "max_tokens"),  # over the context
    (COMPLETIONS, {"prompt": "abc", "max_tokens": "ten"}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "a" * CHAT_BLOCK}, 400, "prompt"),  # longer than the context
    (COMPLETIONS, {"prompt": 42}, 400, "prompt"),
    (COMPLETIONS, {"prompt": []}, 400, "prompt"),
    (COMPLETIONS, {"prompt": "naïve"}, 400, "prompt"),  # not in the model's vocabulary
    (COMPLETIONS, {"prompt": [5, 1000]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": "abc", "temperature": "hot"}, 400, "temperature"),
    (COMPLETIONS, {"prompt": "abc", "temperature": 3}, 400, "temperature"),
    (COMPLETIONS, {"prompt": "abc", "top_p": -0.1}, 400, "top_p"),
    (COMPLETIONS, {"prompt": "abc", "top_p": 1.5}, 400, "top_p"),
    (COMPLETIONS, {"prompt": "abc", "n": 0}, 400, "n"),
    (COMPLETIONS, {"prompt": "abc", "n": 9}, 400, "n"),  # more than 4 rows + 4 places could ever take
    (COMPLETIONS, {"prompt": "abc", "stream": "yes"}, 400, "stream"),
    (COMPLETIONS, {"prompt": "abc", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (COMPLETIONS, {"prompt": "abc", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    (COMPLETIONS, {"prompt": "abc", "stop": ""}, 400, "stop"),
    (COMPLETIONS, {"prompt": "abc", "seed": 1.5}, 400, "seed"),
    (COMPLETIONS, {"prompt": "abc", "logprobs": 6}, 400, "logprobs"),  # OpenAI's limit: 5
    (COMPLETIONS, {"prompt": "abc", "echo": "yes"}, 400, "echo"),
    (COMPLETIONS, {"prompt": "abc", "best_of": 2}, 400, "best_of"),  # not supported
    (COMPLETIONS, {"prompt": "abc", "max_tokens": 0}, 400, "max_tokens"),  # 0 only with echo
    (COMPLETIONS, {"prompt": "a" * (CHAT_BLOCK + 1), "max_tokens": 0, "echo": True}, 400, "prompt"),
    (COMPLETIONS, {"prompt": "abc", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    (COMPLETIONS, {"prompt": "abc", "logit_bias": {"5": -101}}, 400, "logit_bias"),
    (COMPLETIONS, {"prompt": "abc", "logit_bias": {"1000": 1}}, 400, "logit_bias"),  # outside the vocabulary
    (COMPLETIONS, {"prompt": "abc", "logit_bias": {str(i): -100 for i in range(101)}}, 400, "logit_bias"),
    (COMPLETIONS, {"prompt": "abc", "frequency_penalty": 2.5}, 400, "frequency_penalty"),
    (COMPLETIONS, {"prompt": "abc", "presence_penalty": "a"}, 400, "presence_penalty"),
    (COMPLETIONS, {"prompt": "abc", "top_k": 1.5}, 400, "top_k"),
    (COMPLETIONS, {"prompt": "abc", "skip_special_tokens": 0}, 400, "skip_special_tokens"),
    (COMPLETIONS, {"prompt": "abc", "max_token": 5}, 400, "max_token"),  # unknown: a typo is not ignored
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * CHAT_BLOCK}]}, 400, "messages"),
    (CHAT, {"messages": USER, "max_completion_tokens": CHAT_BLOCK}, 400, "max_completion_tokens"),
    (CHAT, {"messages": USER, "max_tokens": 5, "max_completion_tokens": 6}, 400, "max_completion_tokens"),
    (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_object"}}, 400, "response_format"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),  # needs logprobs: true
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    (CHAT, {"messages": USER, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/nowhere", {}, 404, None),
])
def test_bad_requests_get_an_openai_error_and_the_server_goes_on(chat_server, path, body, status, param):
    r = chat_server.post(path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["param"] == param
    assert "Traceback" not in error["message"]
    # Greedy: sampled at temperature 1 the chat model may draw an end token within 2 tokens ("stop").
    assert complete(chat_server, "abc", max_tokens=2, temperature=0).choices[0].finish_reason == "length"


def test_random_bodies_never_get_a_server_error(chat_server):
    """Seeded fuzzing: known fields with values of every JSON type and edge values. Every answer is a reply
    or OpenAI's JSON error, never a 5xx."""
    import random

    rng = random.Random(0)
    values = [None, True, False, 0, 1, 2, -1, 0.5, 2.5, 1e300, -1e-300, 2**63, "", "x", "0", [], [0], ["a", ""],
              [[1, 2], []], {}, {"a": 1}, {"5": -100}, {"5": "x"}, {"include_usage": True}, [{"role": "user"}],
              [{"role": "user", "content": [{"type": "text", "text": 1}]}], {"type": "text"}]
    fields = ["model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "stop", "seed",
              "n", "stream", "stream_options", "logit_bias", "frequency_penalty", "presence_penalty",
              "logprobs", "top_logprobs", "echo", "best_of", "suffix", "skip_special_tokens", "tools", "user"]
    for i in range(160):
        path, body = (COMPLETIONS, {"prompt": "abc"}) if i % 2 else (CHAT, {"messages": USER})
        body["max_tokens"] = 2
        for key in rng.sample(fields + ["prompt", "messages"], rng.randint(1, 4)):
            body[key] = rng.choice(values)
        r = chat_server.post(path, body)
        assert r.status_code in (200, 400, 404), (body, r.status_code, r.text)
        if r.status_code != 200:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}, (body, r.text)


def test_errors_say_what_was_sent_and_where_a_bound_comes_from(chat_server):
    """A JSON number past a float's range (1e999) reads as Infinity: the error says so, not "got a number"
    (NaN and Infinity themselves are not JSON, and are refused as such); n's bound is the replies the server
    holds at once, its --max_batch and --max_queue, and says so."""
    for sent, shown in (("1e999", "Infinity"), ("-1e999", "-Infinity")):
        r = chat_server.post(COMPLETIONS, f'{{"prompt": "abc", "max_tokens": 2, "temperature": {sent}}}')
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
        assert r.json()["error"]["message"] == (f"temperature must be a finite number, got {shown} (a number "
                                                f"beyond a float's range)")
    r = chat_server.post(COMPLETIONS, '{"prompt": "abc", "max_tokens": 2, "temperature": NaN}')
    assert r.status_code == 400 and "not valid JSON: NaN is not a JSON value" in r.json()["error"]["message"]
    health = chat_server.health()
    rows, queue_ = health["max_batch"], health["max_queue"]
    held = f"the replies this server holds at once: {rows} decoding (its --max_batch) + {queue_} waiting (its --max_queue)"
    r = chat_server.post(COMPLETIONS, {"prompt": "abc", "max_tokens": 2, "n": rows + queue_ + 1})
    assert r.json()["error"]["message"] == f"n must be at most {rows + queue_}, {held}; got {rows + queue_ + 1}"
    r = chat_server.post(COMPLETIONS, {"prompt": ["abc", "def"], "max_tokens": 2, "n": rows + queue_})
    assert r.json()["error"]["message"] == (f"2 prompts times n={rows + queue_} is {2 * (rows + queue_)} replies, "
                                            f"more than {rows + queue_}, {held}")


def test_on_all_interfaces_the_printed_addresses_can_be_opened(keyed_server):
    """--host 0.0.0.0 is where to listen, not an address a browser opens: the lines say 127.0.0.1 for this
    machine (the client below reaches the server there) and the machine's name for others."""
    assert serve.addresses("0.0.0.0") == ("127.0.0.1", socket.gethostname())
    assert serve.addresses("::") == ("[::1]", socket.gethostname())
    assert serve.addresses("127.0.0.1") == ("127.0.0.1", "") and serve.addresses("::1") == ("[::1]", "")
    # (with a host name allowed, so that Host headers are checked: the printed addresses pass, others not)
    server = keyed_server
    assert server.url.startswith("http://127.0.0.1:") and "0.0.0.0:" not in "".join(server.stderr)
    port = server.url.rsplit(":", 1)[1]
    assert (f"serve.py: listening on all interfaces (0.0.0.0): from other machines, "
            f"http://{socket.gethostname()}:{port}/\n") in server.stderr
    assert server.client.completions.create(model=server.model, prompt="ab", max_tokens=2).choices[0].text
    for host, status in ((f"{socket.gethostname()}:{port}", 200), (f"gptkit.test:{port}", 200),
                         (f"rebound.test:{port}", 403)):
        assert http().get(server.url + "/health", headers={"Host": host}, timeout=WAIT).status_code == status


def test_the_openai_client_sees_the_errors(chat_server):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        chat_server.client.completions.create(model="gpt-4", prompt="abc")
    with pytest.raises(openai.BadRequestError, match="context") as e:
        complete(chat_server, "abc", max_tokens=10**6)
    assert e.value.code == "context_length_exceeded"


def test_harmless_and_default_valued_options_are_accepted(chat_server):
    r = chat_server.post(CHAT, {"model": chat_server.model, "messages": [
        {"role": "developer", "content": "Count."},
        {"role": "user", "content": [{"type": "text", "text": "ab"}]}],
        "max_tokens": 3, "user": "someone", "metadata": {"a": "b"}, "logprobs": False, "presence_penalty": 0,
        "tool_choice": "none", "response_format": {"type": "text"}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


def test_tokenize_counts_what_the_routes_send_the_model(chat_server, chat_model):
    """POST /tokenize (vLLM's): what the chat page counts a conversation with; the context is in /v1/models."""
    tokenizer = chat_model[1]
    messages = [{"role": "system", "content": "Count."}, *USER]
    ids = prompt_ids(messages, tokenizer)
    assert chat_server.post("/tokenize", {"messages": messages}).json() == {
        "count": len(ids), "max_model_len": CHAT_BLOCK, "tokens": ids}
    assert chat_server.post("/tokenize", {"prompt": "abc"}).json()["tokens"] == tokenizer.encode("abc")
    assert chat_server.client.models.list().data[0].max_model_len == CHAT_BLOCK
    for body in ({}, {"prompt": "a", "messages": USER}, {"prompt": "naïve"}, {"messages": []}):
        r = chat_server.post("/tokenize", body)
        assert r.status_code == 400 and r.json()["error"]["message"], (body, r.text)


def test_a_model_without_chat_tokens_says_so(text_server):
    with pytest.raises(openai.BadRequestError, match="no chat tokens"):
        text_server.client.chat.completions.create(model="babbler", messages=USER)
    assert complete(text_server, "abc", max_tokens=3).choices[0].text  # text completions still work


# ----------------------------------------------------------------------------- who may call the server

KEY = "sk-test-4f1e"


def refused(r: httpx.Response, status: int, code: str) -> str:
    """The OpenAI-shaped refusal's message; no CORS header lets a page read it."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    assert "access-control-allow-origin" not in r.headers
    return error["message"]


def test_a_post_that_is_not_json_is_refused_before_any_work(chat_server):
    """A text/plain or form POST is what any web page may send anywhere without asking (the issue's curl)."""
    before = chat_server.health()
    body = '{"prompt": "ROMEO:", "max_tokens": 5}'
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""):
        message = refused(chat_server.post(COMPLETIONS, body, {"Content-Type": kind}), 415,
                          "unsupported_media_type")
        assert "application/json" in message
    r = chat_server.post(COMPLETIONS, body, {"Content-Type": "Application/JSON; charset=utf-8"})
    # accepted and answered (a sampled reply may be empty: the end-of-text token can come first)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert chat_server.health()["replies"] == before["replies"] + 1  # the refused ones never reached the engine


def test_requests_from_other_web_pages_are_refused(chat_server):
    before = chat_server.health()["replies"]
    body = {"prompt": "ROMEO:", "max_tokens": 5}
    for origin in ("http://evil.example", "http://127.0.0.1:1", "null", chat_server.url.replace("127.0.0.1",
                                                                                                   "localhost")):
        message = refused(chat_server.post(COMPLETIONS, body, {"Origin": origin}), 403, "origin_not_allowed")
        assert "--allowed_origins" in message
        refused(http().get(chat_server.url + "/v1/models", headers={"Origin": origin}, timeout=WAIT), 403,
                "origin_not_allowed")
        preflight = http().options(chat_server.url + COMPLETIONS, timeout=WAIT, headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type"})
        refused(preflight, 403, "origin_not_allowed")
    assert chat_server.health()["replies"] == before
    # The server's own page (its origin is the address the browser asked for) is served.
    r = chat_server.post(COMPLETIONS, body, {"Origin": chat_server.url})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_a_host_name_that_is_not_the_servers_address_is_refused(chat_server):
    """DNS rebinding: a page at http://rebound.example:PORT whose name now resolves to 127.0.0.1 is
    same-origin with the server; its requests carry Host: rebound.example:PORT."""
    port = chat_server.url.rsplit(":", 1)[1]
    body = {"prompt": "ROMEO:", "max_tokens": 2}
    for host in (f"rebound.example:{port}", "rebound.example", f"127.0.0.1:{int(port) + 1}", f"localhost.:{port}"):
        message = refused(chat_server.post(COMPLETIONS, body, {"Host": host, "Origin": f"http://{host}"}), 403,
                          "host_not_allowed")
        assert "--allowed_hosts" in message
        refused(http().get(chat_server.url + "/", headers={"Host": host}, timeout=WAIT), 403, "host_not_allowed")
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}", f"[::1]:{port}"):
        r = chat_server.post(COMPLETIONS, body, {"Host": host, "Origin": f"http://{host}"})
        assert r.status_code == 200, (host, r.text)


@pytest.fixture(scope="module")
def keyed_server(text_ckpt):
    """The text model behind a key given in the environment, with one other origin and host name allowed,
    listening on all interfaces (one server for the tests of these options: each start takes seconds)."""
    server = Server(text_ckpt, "--max_batch=2", "--max_queue=2", "--allowed_origins=http://localhost:3000",
                    "--host=0.0.0.0", "--allowed_hosts=gptkit.test", key=KEY, env={"GPTKIT_API_KEY": KEY})
    try:
        yield server.ready()
    finally:
        server.stop()


def test_the_api_key_is_required_and_the_openai_client_sends_it(keyed_server):
    server = keyed_server
    log = "".join(server.stderr)
    assert "every /v1 request needs the API key" in log and KEY not in log  # said, and the key never shown
    r = complete(server, "abc", max_tokens=3)  # the client's api_key is the key
    assert r.choices[0].finish_reason == "length" and len(r.choices[0].text) == 3
    assert [m.id for m in server.client.models.list()] == [server.model]
    for key in ("wrong", KEY + "x", "none"):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=WAIT)
        with pytest.raises(openai.AuthenticationError, match="incorrect API key") as e:
            client.completions.create(model=server.model, prompt="abc", max_tokens=3)
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    r = http().post(server.url + COMPLETIONS, json={"prompt": "abc", "max_tokens": 3}, timeout=WAIT)  # no header
    assert "needs an API key" in refused(r, 401, "invalid_api_key") and r.headers["www-authenticate"] == "Bearer"
    r = server.post(COMPLETIONS, {"prompt": "abc", "max_tokens": 3}, {"Authorization": KEY})  # not "Bearer KEY"
    refused(r, 401, "invalid_api_key")
    # The page (which asks for the key) and the load stay open; a refused request comes before the body's type.
    assert http().get(server.url + "/", timeout=WAIT).status_code == 200 and server.health()["status"] == "ok"
    assert "gptkit_prefix_cache_bytes" in http().get(server.url + "/metrics", timeout=WAIT).text
    refused(http().post(server.url + COMPLETIONS, content="x", headers={"Content-Type": "text/plain"},
                       timeout=WAIT), 401, "invalid_api_key")


def test_allowed_origins_get_cors_and_allowed_hosts_are_served(keyed_server):
    server, origin = keyed_server, "http://localhost:3000"
    preflight = http().options(server.url + COMPLETIONS, timeout=WAIT, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 204 and preflight.headers["access-control-allow-origin"] == origin
    assert {"authorization", "content-type"} <= {
        h.strip().lower() for h in preflight.headers["access-control-allow-headers"].split(",")}
    assert "POST" in preflight.headers["access-control-allow-methods"]
    r = server.post(COMPLETIONS, {"prompt": "abc", "max_tokens": 3}, {"Origin": origin})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    r = server.post(COMPLETIONS, {"prompt": "abc", "max_tokens": 3}, {"Origin": origin, "Authorization": ""})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == origin  # the page may read why
    refused(server.post(COMPLETIONS, {"prompt": "abc"}, {"Origin": "http://localhost:3001"}), 403,
            "origin_not_allowed")
    port = server.url.rsplit(":", 1)[1]
    assert server.post(COMPLETIONS, {"prompt": "abc", "max_tokens": 2},
                       {"Host": f"gptkit.test:{port}"}).status_code == 200
    refused(server.post(COMPLETIONS, {"prompt": "abc"}, {"Host": f"other.test:{port}"}), 403, "host_not_allowed")


# ----------------------------------------------------------------------------- load: queue, disconnects


def test_a_full_queue_is_a_429_and_clients_that_leave_free_their_rows(text_server):
    """2 rows, 2 places: four long streams fill them; the next request is refused at once. Then every client
    hangs up: the rows and places are freed before the replies are decoded (fewer tokens than one reply)."""
    long = TEXT_BLOCK - 10
    before = text_server.health()["generated_tokens"]
    streams = [complete(text_server, "abc", max_tokens=long, stream=True) for _ in range(4)]
    next(iter(streams[0]))
    # (the second request takes its row at the engine's next step, maybe after the first's first token)
    text_server.wait_for_load(2, 2)
    with pytest.raises(openai.RateLimitError) as e:
        complete(text_server, "abc", max_tokens=5)
    assert e.value.code == "queue_full" and e.value.response.headers["retry-after"] == "1"
    r = text_server.post(COMPLETIONS, {"prompt": "abc", "stream": True})  # a stream is refused the same way
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    for s in streams:
        s.close()
    after = text_server.wait_until_idle()["generated_tokens"]
    assert after - before < long  # every reply was cut short: no row decoded its max_tokens
    assert complete(text_server, "abc", max_tokens=3).choices[0].finish_reason == "length"


def test_a_client_that_stops_waiting_for_a_whole_reply_frees_its_row(text_server):
    long = TEXT_BLOCK - 10
    before = text_server.health()["generated_tokens"]
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after 0.3 s of a reply that takes seconds
        text_server.post(COMPLETIONS, {"prompt": "abc", "max_tokens": long}, timeout=0.3)
    after = text_server.wait_until_idle()["generated_tokens"]
    assert after - before < long


# ----------------------------------------------------------------------------- the process


def test_sigterm_finishes_the_reply_in_flight_and_exits_0(text_server):
    """The module's last test with the text server: it stops it."""
    server = text_server
    reply = complete(server, "abc", max_tokens=600, temperature=0).choices[0].text
    stream = complete(server, "abc", max_tokens=600, temperature=0, stream=True)
    chunks = iter(stream)
    first = next(chunks)
    server.proc.send_signal(signal.SIGTERM)
    assert "finishing the 1 in flight" in server.wait_for_line("serve.py: SIGTERM")
    with pytest.raises((openai.APIConnectionError, openai.InternalServerError)):  # refused, or 503
        complete(server, "abc", max_tokens=3)
    rest = list(chunks)
    assert first.choices[0].text + streamed(rest)[0][0] == reply
    assert rest[-1].choices[0].finish_reason == "length"
    assert server.proc.wait(timeout=WAIT) == 0
    assert "Traceback" not in "".join(server.stderr)


def nodelay_of_an_accepted_connection(sock: socket.socket) -> int:
    """TCP_NODELAY on the server's side of a connection that asyncio (uvicorn's loop) accepts from sock."""
    import asyncio

    async def accept() -> int:
        found = asyncio.get_running_loop().create_future()

        def handle(reader, writer):
            found.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(handle, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        try:
            return await asyncio.wait_for(found, WAIT)
        finally:
            writer.close()
            server.close()

    return asyncio.run(accept())


def test_the_server_sends_a_token_at_once():
    """A stream is small writes: the headers, then a token at a time. With Nagle's algorithm on, each waits
    for the acknowledgement of the one before, which the client delays (~40 ms on Linux) on a kept-alive
    connection. serve.py's listening socket names its protocol, so that asyncio turns Nagle off on the
    connections it accepts (a socket from socket.create_server does not: asyncio leaves it on)."""
    assert nodelay_of_an_accepted_connection(serve.listen("127.0.0.1", 0)) != 0


def test_serve_errors_are_one_line(capsys, tmp_path, text_ckpt, monkeypatch):
    def error(*args) -> str:
        with pytest.raises(SystemExit) as e:
            serve.main(["--device=cpu", *args])
        message = e.value.code
        assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message, message
        return message

    assert "port" in error("--port=70000")
    assert "not both" in error("--ckpt=a", "--init_from=gpt2")
    assert "max_batch" in error("--max_batch=0")
    assert "prefix_cache must be >= 0 MiB" in error("--prefix_cache=-1")
    # more than the machine has (25 trillion tokens of GPT-2): refused after the model loads, with what fits
    too_much = error(f"--ckpt={text_ckpt}", "--prefix_cache=99999999999")
    total, available = ram()
    fits = int(too_much.split("the largest that fits is --prefix_cache=")[1].split()[0])
    assert "--prefix_cache=99,999,999,999 MiB is more than the memory the cache could take" in too_much
    assert f"available of this machine's {total / 2**30:.1f} GiB" in too_much
    assert 0 < fits <= total // 2**20 and abs(fits - available // 2**20) < 1024  # (the memory moves a little)
    assert "allowed_origins: 'localhost:3000' is not an origin" in error("--allowed_origins=localhost:3000")
    assert "allowed_hosts" in error("--allowed_hosts=http://a.test/")
    assert "does not exist" in error(f"--ckpt={tmp_path / 'nowhere'}", "--port=0")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert "cannot listen on 127.0.0.1" in error(f"--ckpt={text_ckpt}", f"--port={port}")
    monkeypatch.setattr(serve.importlib.util, "find_spec", lambda name: None)
    assert 'pip install -e ".[serve]"' in error(f"--ckpt={text_ckpt}")
