"""Talk to a chat model: multi-turn, the reply streamed as it is written.

    python chat.py --ckpt out-chat/                       # a model fine-tuned on conversations (README, "Chat")
    python chat.py --ckpt out-chat/ --system "Answer in one word." --temperature 0
    printf 'spell king backwards\\nand queen?\\n' | python chat.py --ckpt out-chat/     # one message a line

At the prompt: /reset forgets the conversation, /system TEXT sets the system message (and starts over), /quit
ends (so do Ctrl-D and Ctrl-C). Ctrl-C while a reply is being written stops that reply, not the program; the
part written stays in the conversation. The conversation is kept and, when it no longer fits the model's
context with room for a reply, its oldest messages are dropped (whole messages; the system message stays).

On a terminal the replies follow an "assistant>" label; from a pipe (stdin not a terminal) each reply is one
block of text followed by a blank line, and notes go to stderr, so the output can be scripted and tested.

The prompt is gptkit/chat.py's template, the one the training data and the server use; the decoding is the
server's engine (gptkit/serving/engine.py) with a single row (on a GPU 16 tokens per compiled call; the reply
still ends at its stop token), and its prefix cache: the conversation's keys and values stay in the row
between turns, so each message computes only its own tokens, however long the history (until messages are
dropped: the prompt then starts otherwise, and is computed again from the system message). It keeps at most
CONTEXTS_KEPT contexts' worth of keys and values.
"""

from __future__ import annotations

import queue
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TextIO

from gptkit import checkpoint, cli
from gptkit.chat import ChatError, ChatTokens, fit_history, prompt_ids
from gptkit.config import SamplingSettings
from gptkit.errors import ConfigError, DataError
from gptkit.generate import DECODE_WINDOW, TextStream
from gptkit.inference import setup_inference
from gptkit.options import load_config, redefault, setting
from gptkit.runtime import resolve_compile
from gptkit.serving.engine import Engine, Finished, Request
from gptkit.serving.prefix_cache import token_bytes

CONTEXTS_KEPT = 4  # the prefix cache's bound, in contexts of the model's keys and values


@dataclass
class ChatConfig(SamplingSettings):
    # a chat model's: GPT-2's own weights have no chat tokens
    init_from: str = setting("", "instead of --ckpt: a local Hugging Face GPT-2 folder exported from a chat model")
    temperature: float = redefault(SamplingSettings, "temperature", 0.7)  # replies a little more conservative
    # the conversation
    system: str = setting("", "the system message the conversation starts with ('' = none)")
    max_new_tokens: int = setting(512, "the longest reply, in tokens (fewer when the model ends its turn)")

    def validate(self) -> None:
        super().validate()  # what to load, and the sampling settings
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


class Chat:
    """One conversation with a model: its messages, and a reply for each new user message."""

    def __init__(self, engine: Engine, tokenizer, cfg: ChatConfig, out: TextIO, err: TextIO):
        self.engine, self.tokenizer, self.cfg, self.out, self.err = engine, tokenizer, cfg, out, err
        self.stop_ids = ChatTokens.of(tokenizer).stop_ids  # a ChatError if this is not a chat model
        block = engine.block_size
        # The prompt leaves room for a reply of max_new_tokens, or of half the context when that is shorter.
        self.budget = block - min(cfg.max_new_tokens, block // 2)
        self.replies = 0  # the seed of reply i is seed + i: a conversation replays exactly
        self.reset(cfg.system)

    def reset(self, system: str = "") -> None:
        self.messages = [{"role": "system", "content": system}] if system else []

    def reply(self, text: str) -> str:
        """Answer a user message: stream the reply to `out` and return it (what was written, when stopped)."""
        self.messages.append({"role": "user", "content": text})
        try:
            # (when messages must go, down to half the budget: the next turns then reuse the cached history)
            fitted = fit_history(self.messages, self.tokenizer, self.budget, drop_to=self.budget // 2)
        except ChatError as e:
            self.messages.pop()
            block = self.engine.block_size
            how = " (/system TEXT sets it)" if self.messages and self.messages[0]["role"] == "system" else ""
            raise ChatError(f"{e}{how}; this model's context is {block} tokens, {block - self.budget} of them kept "
                            f"for the reply (--max_new_tokens)") from None
        except DataError as e:  # a character the model's vocabulary lacks: this message only
            self.messages.pop()
            raise ChatError(f"{e}; the message was not sent, the conversation goes on") from None
        if len(fitted) < len(self.messages):
            print(f"(the {len(self.messages) - len(fitted)} oldest message(s) no longer fit the context and were "
                  f"dropped)", file=self.err, flush=True)
            self.messages = fitted
        events: queue.SimpleQueue = queue.SimpleQueue()
        request = self.engine.submit(Request(prompt_ids(self.messages, self.tokenizer), self.cfg.max_new_tokens,
                                             emit=events.put, sampling=self.cfg.sampling(),
                                             stop_ids=self.stop_ids, seed=self.cfg.seed + self.replies))
        self.replies += 1
        stream, pieces = TextStream(self.tokenizer), []
        while True:
            try:
                event = events.get(timeout=0.1)  # a short wait, so that Ctrl-C is seen at once
            except queue.Empty:
                continue
            except KeyboardInterrupt:
                request.cancel()  # the engine lets the row go before its next step; Finished follows
                print(" [stopped]", file=self.err, flush=True)
                continue
            if isinstance(event, Finished):
                break
            piece = stream.push(event.id)
            if piece:
                pieces.append(piece)
                self.out.write(piece)
                self.out.flush()
        pieces.append(stream.flush())
        self.out.write(pieces[-1] + "\n")
        self.out.flush()
        reply = "".join(pieces)
        self.messages.append({"role": "assistant", "content": reply})
        return reply


def lines(stdin: TextIO, interactive: bool, err: TextIO) -> Iterator[str]:
    """The user's lines: with a "you>" prompt on a terminal, one a line from a pipe; ends at EOF or Ctrl-C."""
    while True:
        try:
            line = input("you> ") if interactive else stdin.readline()
        except (EOFError, KeyboardInterrupt):
            if interactive:
                print(file=err)
            return
        if not interactive and not line:
            return
        yield line.rstrip("\n")


def converse(chat: Chat, stdin: TextIO, interactive: bool) -> None:
    for line in lines(stdin, interactive, chat.err):
        text = line.strip()
        if not text:
            continue
        if text in ("/quit", "/exit"):
            return
        if text == "/reset" or text.startswith("/system"):
            system = text.removeprefix("/system").strip() if text.startswith("/system") else chat.cfg.system
            chat.reset(system)
            print("(a new conversation" + (f", system: {system!r})" if system else ")"), file=chat.err, flush=True)
            continue
        if interactive:
            chat.out.write("assistant> ")
        try:
            chat.reply(line)
        except ChatError as e:  # a message too long for the context, or one it cannot encode: say so, go on
            print(f"error: {e}", file=chat.err, flush=True)
            continue
        if not interactive:
            chat.out.write("\n")


@cli.entry_point()
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    cfg = load_config(ChatConfig, argv, allow_files=False, prog="chat.py")
    inference = setup_inference(cfg.device, cfg.dtype, cfg.quantize, cfg.threads)
    model, tokenizer, what = checkpoint.load_model(cfg.ckpt, cfg.init_from)
    ChatTokens.of(tokenizer)  # not a chat model: one line, before the weights move
    params = model.num_params(non_embedding=False)  # all of them, as train.py and --plan count (before place():
    # packed weights are buffers, not parameters)
    inference.place(model)
    interactive = sys.stdin.isatty()
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")
    print(f"chat.py: {what}, {params / 1e6:.2f}M parameters; {inference.describe()}"
          + ("; /reset, /system TEXT, /quit; Ctrl-C stops a reply" if interactive else ""), file=sys.stderr,
          flush=True)
    # The prefix cache holds this one conversation: a few contexts' worth (its history, and what /reset or
    # dropped messages left behind), not the server's share of the machine's memory. Where the engine compiles
    # its step (a GPU), replies come DECODE_WINDOW tokens per call, their windows compiled at start.
    compiled, _ = resolve_compile(None, inference.rt.device)
    engine = Engine(model, max_batch=1, max_queue=0,
                    prefix_cache=CONTEXTS_KEPT * model.config.block_size * token_bytes(model),
                    window=DECODE_WINDOW if compiled else 1, window_sampling=cfg.sampling()).start()
    try:
        converse(Chat(engine, tokenizer, cfg, sys.stdout, sys.stderr), sys.stdin, interactive)
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
