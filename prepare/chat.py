"""Prepare conversations for chat fine-tuning: token shards plus a loss mask (only the assistant's replies are
trained).

    python prepare/chat.py --input conversations.jsonl --name mychat                    # GPT-2's BPE (default)
    python prepare/chat.py --input chats.jsonl --name mychat --tokenizer out/ --block_size 64    # a base's own

Each line of the input is one conversation in the format chat APIs use:
    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}, ...]}

--tokenizer: gpt2, char, the NAME or PATH of a trained tokenizer, or a checkpoint (an out_dir or a .pt file)
whose tokenizer to use: to fine-tune a model trained here, prepare its conversations with its own tokenizer.
The chat template's special tokens (<|endoftext|>, <|system|>, <|user|>, <|assistant|>, <|end|>) are added
to it where missing (GPT-2: ids 50257-50260, inside the model's padded rows). --block_size: the context the
fine-tune will use; longer conversations are cut there. --train_on all puts loss on every token instead
(to compare). Output goes to DATA_ROOT/NAME; then train.py with --dataset=NAME (see README, "Chat").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gptkit import cli
from gptkit.data.prepare import conversations, script
from gptkit.data.prepare.local import check_fraction
from gptkit.data.prepare.writer import DEFAULT_SHARD_TOKENS
from gptkit.errors import ConfigError, DataError
from gptkit.options import setting


@dataclass
class ChatDataConfig(script.OutputSettings):
    input: str = setting("", "a JSONL file, one conversation per line (required)")
    name: str = setting("", "output goes to DATA_ROOT/NAME; '' = the input's name")
    tokenizer: str = setting("gpt2", "gpt2, char, a trained tokenizer's NAME or PATH, or a checkpoint (out_dir or "
                                     ".pt) whose tokenizer to use")
    block_size: int = setting(1024, "the fine-tune's context (1024 is GPT-2's): longer conversations are cut there")
    train_on: str = setting("assistant", "which tokens carry loss: the assistant's replies or all",
                            conversations.TRAIN_ON)
    val_fraction: float = setting(0.05, "share of the conversations for val")
    shard_tokens: int = setting(DEFAULT_SHARD_TOKENS, "tokens per shard")

    def validate(self) -> None:
        if not self.input:
            raise ConfigError("--input is required: a JSONL file with one conversation per line")


def conversation_chars(path: Path) -> set[str]:
    """Every character of the conversations' messages: a char tokenizer's vocabulary."""
    return {c for _, messages in conversations.read_conversations(path) for m in messages for c in m["content"]}


@cli.entry_point()
def main(argv: Sequence[str] | None = None) -> None:
    cfg = script.load(ChatDataConfig, argv, "prepare/chat.py", __doc__)
    check_fraction(cfg.val_fraction)
    path = Path(cfg.input)
    name = cfg.name or path.stem
    if "/" in name or "\\" in name or name in ("", ".", ".."):
        raise DataError(f"--name {name!r} must be a plain folder name; use --out_dir for a path")
    out_dir = cfg.output(name)
    if not path.is_file():
        raise DataError(f"--input {path} is not a file; give a JSONL file with one conversation per line")
    tokenizer = conversations.chat_tokenizer(cfg.tokenizer, lambda: conversation_chars(path), cfg.data_root)
    conversations.prepare_conversations(out_dir, path, tokenizer, block_size=cfg.block_size,
                                        val_fraction=cfg.val_fraction, train_on=cfg.train_on,
                                        shard_tokens=cfg.shard_tokens, overwrite=cfg.overwrite)

if __name__ == "__main__":
    main()
