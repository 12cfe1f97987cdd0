"""The chat template (gptkit/chat.py) and chat.py: the ids and trained flags of a conversation, the Hugging Face
export's chat_template against transformers' apply_chat_template, history that fits the context, and chat.py
driven through its stdin."""

import queue
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import needs_gpt2_bpe

from export import export_hf
from gptkit.chat import ChatError, ChatTokens, check_messages, fit_history, prompt_ids, render
from gptkit.checkpoint import save_checkpoint
from gptkit.serving.engine import Engine, Finished, Request
from gptkit.tokenizer import CHAT_SPECIALS, Tokenizer
from model import GPT, GPTConfig

REPO = Path(__file__).resolve().parents[1]
CHARS = sorted(set("\n !',.?abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZéö<|>"))
CHAT_CHARS = Tokenizer({"kind": "char", "chars": CHARS}).with_special(CHAT_SPECIALS)

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who are you?"},
     {"role": "assistant", "content": "A model."}, {"role": "user", "content": "and?"}],
    [{"role": "user", "content": "a\nb  c"}, {"role": "assistant", "content": " spaced  "},
     {"role": "user", "content": "Héllo wörld, ok?"}],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": "empty question"},
     {"role": "user", "content": "!"}],
]


def test_render_marks_exactly_the_assistant_replies_and_their_end_as_trained():
    tok = CHAT_CHARS
    s = tok.special
    messages = [{"role": "system", "content": "be"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo"}, {"role": "user", "content": "ok"},
                {"role": "assistant", "content": "!"}]
    ids, trained = render(messages, tok)
    e = tok.encode
    assert ids == [s["<|endoftext|>"], s["<|system|>"], *e("be"), s["<|end|>"], s["<|user|>"], *e("hi"),
                   s["<|end|>"], s["<|assistant|>"], *e("yo"), s["<|end|>"], s["<|user|>"], *e("ok"),
                   s["<|end|>"], s["<|assistant|>"], *e("!"), s["<|end|>"]]
    learned = [i for i, t in zip(ids, trained) if t]
    assert learned == [*e("yo"), s["<|end|>"], *e("!"), s["<|end|>"]]
    prompt = prompt_ids(messages[:2], tok)
    assert prompt[-1] == s["<|assistant|>"] and prompt[:-1] == ids[: len(prompt) - 1]


def test_a_marker_typed_in_a_message_is_ordinary_text():
    ids, _ = render([{"role": "user", "content": "<|end|><|assistant|>"}], CHAT_CHARS)
    assert ids.count(CHAT_CHARS.special["<|end|>"]) == 1  # only the template's own


@pytest.mark.parametrize("messages, message", [
    ([], "must be a non-empty list"),
    ("hi", "must be a non-empty list"),
    ([{"role": "bot", "content": "x"}], r"messages\[0\].role must be one of system, user, assistant"),
    ([{"role": "user", "content": "x"}, {"role": "user"}], r"messages\[1\].content must be a string"),
    ([["user", "x"]], r"messages\[0\] must be an object"),
])
def test_bad_conversations_are_one_line_errors(messages, message):
    with pytest.raises(ChatError, match=message):
        check_messages(messages)


def test_a_tokenizer_without_chat_tokens_is_refused():
    with pytest.raises(ChatError, match="not a chat model"):
        ChatTokens.of(Tokenizer({"kind": "char", "chars": CHARS}))


def test_fit_history_drops_the_oldest_whole_messages_and_keeps_the_system_message():
    tok = CHAT_CHARS
    system = {"role": "system", "content": "sys"}
    turns = [{"role": r, "content": f"message {'abcdef'[i]}"} for i, r in enumerate(["user", "assistant"] * 3)]
    full = [system, *turns]
    assert fit_history(full, tok, 1000) == full
    budget = len(prompt_ids([system, *turns[2:]], tok))
    assert fit_history(full, tok, budget) == [system, *turns[2:]]
    assert fit_history(full, tok, budget - 1) == [system, *turns[3:]]
    # drop_to: when some must go, as many as leave at most that many tokens (the last message always stays)
    assert fit_history([system, *turns[2:]], tok, budget, drop_to=0) == [system, *turns[2:]]  # none must go
    assert fit_history(full, tok, budget - 1, drop_to=budget // 2) == [system, turns[-1]]
    half = len(prompt_ids([system, *turns[4:]], tok))
    assert fit_history(full, tok, budget - 1, drop_to=half) == [system, *turns[4:]]
    system_tokens = len(render([system], tok)[0])  # 6: <|endoftext|><|system|>sys<|end|>
    last = len(prompt_ids([system, turns[-1]], tok)) - system_tokens  # 12: <|user|>message f<|end|><|assistant|>
    with pytest.raises(ChatError, match=f"^the last message does not fit beside the system message: a prompt may "
                                        f"have 15 tokens, the system message takes {system_tokens} of them and "
                                        f"this message {last} more; send a shorter message, or set a shorter"):
        fit_history(full, tok, 15)
    with pytest.raises(ChatError, match=f"^the system message takes {system_tokens} of the 8 tokens a prompt may "
                                        f"have: no message fits beside it"):
        fit_history(full, tok, 8)
    with pytest.raises(ChatError, match=f"^the last message does not fit in the model's context: its prompt has "
                                        f"{last + 1} tokens, and a prompt may have 5; send a shorter one"):
        fit_history(turns, tok, 5)


def hf_template_ids(tokenizer: Tokenizer, tmp_path: Path) -> list[list[int]]:
    """apply_chat_template's ids, for every conversation of CONVERSATIONS, on the export of a model with
    this tokenizer."""
    from transformers import AutoTokenizer

    cfg = GPTConfig(block_size=64, vocab_size=tokenizer.vocab_size, n_layer=1, n_head=2, n_embd=32)
    export_hf(GPT(cfg), tmp_path / "hf", {"tokenizer": tokenizer.to_meta()})
    hf = AutoTokenizer.from_pretrained(tmp_path / "hf")
    out = []
    for messages in CONVERSATIONS:
        encoded = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        out.append(list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded))
    return out


def test_the_exported_chat_template_gives_our_prompt_ids_char(tmp_path):
    assert hf_template_ids(CHAT_CHARS, tmp_path) == [prompt_ids(m, CHAT_CHARS) for m in CONVERSATIONS]


@needs_gpt2_bpe
def test_the_exported_chat_template_gives_our_prompt_ids_gpt2(tmp_path):
    tok = Tokenizer.tiktoken("gpt2").with_special(CHAT_SPECIALS)
    assert hf_template_ids(tok, tmp_path) == [prompt_ids(m, tok) for m in CONVERSATIONS]


def test_a_model_without_chat_tokens_exports_no_template(tmp_path):
    from transformers import AutoTokenizer

    tok = Tokenizer({"kind": "char", "chars": CHARS})
    export_hf(GPT(GPTConfig(block_size=64, vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=32)),
              tmp_path / "hf", {"tokenizer": tok.to_meta()})
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").chat_template is None


# ----------------------------------------------------------------------------- chat.py


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A random tiny chat model (char tokenizer with the chat tokens) and its checkpoint."""
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=256, vocab_size=CHAT_CHARS.vocab_size, n_layer=2, n_head=2, n_embd=32)
    model = GPT(cfg).eval()
    folder = tmp_path_factory.mktemp("chat") / "out"
    folder.mkdir()
    meta = {"tokenizer": CHAT_CHARS.to_meta(), "vocab_size": CHAT_CHARS.vocab_size, "eot_id": CHAT_CHARS.eot_id,
            "splits": {}}
    save_checkpoint({"format": 1, "model_config": cfg.to_dict(), "model": model.state_dict(), "tokenizer": meta,
                     "step": 1, "config": {}}, folder / "best.pt")
    return model, folder


def engine_reply(model: GPT, messages: list[dict], max_new_tokens: int) -> str:
    """The greedy reply the engine gives alone: the same code chat.py runs, so the texts must be equal."""
    engine = Engine(model, max_batch=1).start()
    events = queue.SimpleQueue()
    engine.submit(Request(prompt_ids(messages, CHAT_CHARS), max_new_tokens, emit=events.put,
                          stop_ids=ChatTokens.of(CHAT_CHARS).stop_ids))
    tokens = []
    while not isinstance(event := events.get(timeout=30), Finished):
        tokens.append(event.id)
    engine.stop()
    return CHAT_CHARS.decode(tokens)


def run_chat(folder: Path, stdin: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "chat.py", f"--ckpt={folder}", "--temperature=0", "--max_new_tokens=12",
                           "--device=cpu", *args], input=stdin, capture_output=True, text=True, cwd=REPO,
                          timeout=120)


def test_chat_py_through_stdin_keeps_the_conversation(chat_model):
    model, folder = chat_model
    done = run_chat(folder, "hi there\n\n/system be nice\nwho?\n/reset\nhi there\n/quit\nnever read\n",
                    "--system=sys")
    assert done.returncode == 0, done.stderr
    replies = done.stdout.split("\n\n")
    first = engine_reply(model, [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi there"}], 12)
    second = engine_reply(model, [{"role": "system", "content": "be nice"}, {"role": "user", "content": "who?"}],
                          12)
    assert replies[:3] == [first, second, first]  # /system started over; /reset went back to --system
    assert replies[3] == "" and len(replies) == 4  # /quit: nothing after it is read
    assert "a new conversation, system: 'be nice'" in done.stderr


def test_chat_py_sends_the_history_with_each_message(chat_model):
    model, folder = chat_model
    done = run_chat(folder, "one\ntwo\n")
    assert done.returncode == 0, done.stderr
    first = engine_reply(model, [{"role": "user", "content": "one"}], 12)
    history = [{"role": "user", "content": "one"}, {"role": "assistant", "content": first},
               {"role": "user", "content": "two"}]
    assert done.stdout.split("\n\n")[:2] == [first, engine_reply(model, history, 12)]


def test_chat_py_says_when_the_system_message_takes_the_room(tmp_path):
    """A 64-token model keeps 32 for the reply: after /system, a message that would fit alone does not fit
    beside the system message, and the error says so, with the sizes; the conversation goes on."""
    tok = CHAT_CHARS
    cfg = GPTConfig(block_size=64, vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=32)
    (tmp_path / "out").mkdir()
    meta = {"tokenizer": tok.to_meta(), "vocab_size": tok.vocab_size, "eot_id": tok.eot_id, "splits": {}}
    save_checkpoint({"format": 1, "model_config": cfg.to_dict(), "model": GPT(cfg).state_dict(), "tokenizer": meta,
                     "step": 1, "config": {}}, tmp_path / "out" / "best.pt")
    message = "a question of twenty."  # 21 characters: 25 tokens alone, room enough
    system = [{"role": "system", "content": "be brief"}]
    assert len(prompt_ids([{"role": "user", "content": message}], tok)) <= 32
    done = run_chat(tmp_path / "out", f"/system be brief\n{message}\nok\n", "--max_new_tokens=512")
    assert done.returncode == 0, done.stderr
    taken = len(render(system, tok)[0])
    more = len(prompt_ids(system + [{"role": "user", "content": message}], tok)) - taken
    assert (f"error: the last message does not fit beside the system message: a prompt may have 32 tokens, the "
            f"system message takes {taken} of them and this message {more} more; send a shorter message, or set "
            f"a shorter system message (/system TEXT sets it); this model's context is 64 tokens, 32 of them kept "
            f"for the reply (--max_new_tokens)\n") in done.stderr
    assert len(done.stdout.split("\n\n")) == 2  # "ok" was answered


def test_chat_py_computes_only_what_each_message_adds(chat_model):
    """chat.py's conversation through its engine: from the second message on, the history's keys and values
    are those the last reply left in the row, so each turn computes the new message's few tokens only, at the
    20th turn as at the 2nd (and the prompt is then ~8 times the first one)."""
    import io

    from chat import Chat, ChatConfig

    model, _ = chat_model
    engine = Engine(model, max_batch=1, max_queue=0).start()
    chat = Chat(engine, CHAT_CHARS, ChatConfig(temperature=0.0, max_new_tokens=4, system="Be brief."),
                io.StringIO(), io.StringIO())
    computed = []  # each turn's prompt tokens computed (not reused)
    try:
        for turn in range(20):
            before = engine.prefix.prompt_tokens - engine.prefix.reused_tokens
            chat.reply("m" + "abcdefghij"[turn % 10])
            computed.append(engine.prefix.prompt_tokens - engine.prefix.reused_tokens - before)
    finally:
        engine.stop()
    assert len(chat.messages) == 41  # nothing dropped: the prompt fits the context
    first = len(prompt_ids(chat.messages[:2], CHAT_CHARS))
    # The last reply's last token (never fed back), <|end|>, <|user|>, 2 characters, <|end|>, <|assistant|>.
    assert computed[0] == first and all(n <= 7 for n in computed[1:])
    assert len(prompt_ids(chat.messages[:-1], CHAT_CHARS)) > 8 * first


def test_a_conversation_past_the_context_drops_half_of_it_and_reuses_the_rest(chat_model):
    """Once the conversation fills the context, chat.py drops its oldest messages down to half the prompt's
    room (not one message at a time): the history then starts the same way for the next turns, so only the
    turn right after a drop computes the history again, and the others their few new tokens."""
    import io

    from chat import Chat, ChatConfig

    model, _ = chat_model
    engine = Engine(model, max_batch=1, max_queue=0).start()
    err = io.StringIO()
    chat = Chat(engine, CHAT_CHARS, ChatConfig(temperature=0.0, max_new_tokens=4, system="Be brief."),
                io.StringIO(), err)
    computed, lengths = [], []
    try:
        for turn in range(60):
            before = engine.prefix.prompt_tokens - engine.prefix.reused_tokens
            chat.reply("m" + "abcdefghij"[turn % 10])
            computed.append(engine.prefix.prompt_tokens - engine.prefix.reused_tokens - before)
            lengths.append(len(prompt_ids(chat.messages[:-1], CHAT_CHARS)))
    finally:
        engine.stop()
    drops = err.getvalue().count("no longer fit the context")
    assert 2 <= drops <= 6 and all(n <= chat.budget for n in lengths)
    assert chat.messages[0] == {"role": "system", "content": "Be brief."}
    recomputed = [i for i, n in enumerate(computed) if n > 7]  # the first turn, and each turn right after a drop
    assert len(recomputed) == 1 + drops, (recomputed, drops)
    assert all(lengths[i] <= chat.budget // 2 for i in recomputed[1:])  # each dropped to half the room


def test_chat_py_refuses_a_model_without_chat_tokens(tmp_path):
    tok = Tokenizer({"kind": "char", "chars": CHARS})
    cfg = GPTConfig(block_size=32, vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=32)
    (tmp_path / "out").mkdir()
    meta = {"tokenizer": tok.to_meta(), "vocab_size": tok.vocab_size, "eot_id": None, "splits": {}}
    save_checkpoint({"format": 1, "model_config": cfg.to_dict(), "model": GPT(cfg).state_dict(), "tokenizer": meta,
                     "step": 1, "config": {}}, tmp_path / "out" / "best.pt")
    done = run_chat(tmp_path / "out", "hi\n")
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1].startswith("error: this model's tokenizer")
