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
from pathlib import Path

from gptkit import cli
from gptkit.checkpoint import load_checkpoint
from gptkit.prepare import conversations, script
from gptkit.prepare.local import check_fraction
from gptkit.prepare.writer import DEFAULT_SHARD_TOKENS
from gptkit.shards import DataError
from gptkit.tokenizer import CHAT_SPECIALS, Tokenizer, resolve_tokenizer


def build_parser() -> cli.ArgumentParser:
    parser = script.make_parser(__doc__)
    parser.add_argument("--input", required=True, help="a JSONL file, one conversation per line")
    parser.add_argument("--name", default=None, help="output goes to DATA_ROOT/NAME (default: the input's name)")
    parser.add_argument("--tokenizer", default="gpt2",
                        help="gpt2, char, a trained tokenizer's NAME or PATH, or a checkpoint (out_dir or .pt) whose "
                             "tokenizer to use (default: gpt2)")
    parser.add_argument("--block_size", type=int, default=1024, help="the fine-tune's context: longer "
                        "conversations are cut there (default: 1024, GPT-2's)")
    parser.add_argument("--train_on", choices=conversations.TRAIN_ON, default="assistant",
                        help="which tokens carry loss: the assistant's replies (default) or all")
    parser.add_argument("--val_fraction", type=float, default=0.05, help="share of the conversations for val")
    parser.add_argument("--shard_tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard")
    parser.add_argument("--data_root", default="data", help="the folder of datasets (DATA_ROOT/NAME) and of "
                        "trained tokenizers (DATA_ROOT/tokenizers)")
    parser.add_argument("--out_dir", default=None, help="output folder (default: DATA_ROOT/NAME)")
    parser.add_argument("--overwrite", action="store_true", help="prepare again even if the folder already "
                        "holds this dataset (or replace a different one)")
    return parser


def chat_tokenizer(arg: str, input_path: Path, data_root: str) -> Tokenizer:
    """The tokenizer --tokenizer names, with the chat template's special tokens."""
    path = Path(arg)
    if path.suffix == ".pt" or (path.is_dir() and any((path / n).is_file() for n in ("best.pt", "last.pt"))):
        base = Tokenizer.from_meta(load_checkpoint(path)["tokenizer"])  # a checkpoint: its own tokenizer
    elif arg == "char":
        chars = set()
        for _, messages in conversations.read_conversations(input_path):
            for m in messages:
                chars.update(m["content"])
        base = resolve_tokenizer("char", chars=chars)
    else:
        base = resolve_tokenizer(arg, data_root=data_root)
    return base.with_special(CHAT_SPECIALS)


@cli.entry_point()
def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    check_fraction(args.val_fraction)
    path = Path(args.input)
    name = args.name or path.stem
    if "/" in name or "\\" in name or name in ("", ".", ".."):
        raise DataError(f"--name {name!r} must be a plain folder name; use --out_dir for a path")
    out_dir = Path(args.out_dir or Path(args.data_root) / name)
    if not path.is_file():
        raise DataError(f"--input {path} is not a file; give a JSONL file with one conversation per line")
    tokenizer = chat_tokenizer(args.tokenizer, path, args.data_root)
    conversations.prepare_conversations(out_dir, path, tokenizer, block_size=args.block_size,
                                        val_fraction=args.val_fraction, train_on=args.train_on,
                                        shard_tokens=args.shard_tokens, overwrite=args.overwrite)


if __name__ == "__main__":
    main()
