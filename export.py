"""Export a trained checkpoint as a Hugging Face GPT-2 folder: the weights in HF's layout, config.json and,
for models trained on the GPT-2 BPE, the GPT-2 tokenizer files rebuilt from tiktoken.

    python export.py --ckpt out-shakespeare/ --to hf-shakespeare/

The folder loads with `transformers.AutoModelForCausalLM.from_pretrained` (and, for models trained on the
GPT-2 BPE, `AutoTokenizer.from_pretrained`). The mapping between HF's layout and ours lives in gptkit/hf_gpt2.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from gptkit import cli
from gptkit.checkpoint import CheckpointError, load_checkpoint, model_from_checkpoint
from gptkit.hf_gpt2 import HFGPT2Error, hf_config, ours_to_hf
from model import GPT, GPTConfig

# The GPT-2 BPE: tokenizer files are reconstructed for it, and its end-of-text token is BOS and EOS.
GPT2_VOCAB_SIZE = 50257
GPT2_EOT_ID = 50256
GPT2_EOT = "<|endoftext|>"

# Every file an export may write. With overwrite=True, stale ones from an earlier export that this export
# does not rewrite are removed first, so a char model never ends up next to an old GPT-2 vocab.json (nor
# weights next to a pytorch_model.bin / tokenizer.json that transformers would read instead).
_EXPORT_FILES = (
    "config.json",
    "model.safetensors",
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "char_vocab.json",
)
_STALE_HF_FILES = (
    "pytorch_model.bin",
    "model.safetensors.index.json",
    "tokenizer.json",
    "generation_config.json",
)


class ExportError(cli.UserError):
    """The export folder could not be written."""


@dataclass
class ExportResult:
    out_dir: Path
    files: list[str] = field(default_factory=list)  # names written into out_dir
    notice: str | None = None  # something the user should know (e.g. no Hugging Face tokenizer was written)
    has_tokenizer: bool = False  # whether AutoTokenizer.from_pretrained(out_dir) works


# ----------------------------------------------------------------------------- the folder


def export_hf(
    model: GPT, out_dir, tokenizer_meta: dict | None = None, *, overwrite: bool = False
) -> ExportResult:
    """Write `model` as a Hugging Face GPT-2 folder that `GPT2LMHeadModel.from_pretrained(out_dir)` loads.

    tokenizer_meta: the checkpoint's tokenizer description, either the dataset meta ({"tokenizer": {...},
    "vocab_size", "eot_id"}) or its "tokenizer" entry alone. {"kind": "tiktoken", "name": "gpt2"} also writes
    the GPT-2 tokenizer files; {"kind": "char", "chars": [...]} writes char_vocab.json and a notice (there is
    no Hugging Face tokenizer for it). A non-empty out_dir is refused unless overwrite=True.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise HFGPT2Error(f"export target {out} is a file; pass a folder path")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise HFGPT2Error(f"export folder {out}/ is not empty; choose a new folder or pass --overwrite")

    # Build everything in memory first, so a failure (e.g. the tiktoken files are unavailable) writes nothing.
    tokenizer = _tokenizer_files(tokenizer_meta, model.config)
    texts = {"config.json": json.dumps(hf_config(model.config, tokenizer.bos_eos_id), indent=2) + "\n"}
    texts.update(tokenizer.files)
    state = hf_state_dict(model)
    names = ["config.json", "model.safetensors", *tokenizer.files]

    with _staging_folder(out) as staging:
        for name, text in texts.items():
            (staging / name).write_text(text, encoding="utf-8")
        from safetensors.torch import save_file

        # transformers checks the "format" metadata to know the tensors are PyTorch's.
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
        _move_into(out, staging, names)
    return ExportResult(out, names, tokenizer.notice, has_tokenizer=tokenizer.has_tokenizer)


def hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """Our weights as a Hugging Face GPT2LMHeadModel state dict (Conv1D layout), without the tied lm_head.

    The padding rows of wte (vocab_multiple > 1) are dropped: HF's logits have exactly vocab_size columns. A
    model without biases gets zero biases, which compute the same function (HF's GPT-2 always has them).
    """
    V = model.config.vocab_size
    out: dict[str, torch.Tensor] = {}
    for key, tensor in model.state_dict().items():
        tensor = tensor.detach().cpu()
        if key == "transformer.wte.weight":
            # (padded V, C) -> (V, C); a copy, so the file's tensor does not share storage with unsaved rows
            tensor = tensor[:V].clone()
        mapped = ours_to_hf(key, tensor)
        if mapped is not None:
            hf_key, hf_tensor = mapped
            out[hf_key] = hf_tensor.contiguous()
    if not model.config.bias:
        for key in list(out):
            bias_key = key.removesuffix(".weight") + ".bias"
            if key.endswith(".weight") and key not in ("transformer.wte.weight", "transformer.wpe.weight"):
                # Conv1D weights are (in, out) and LayerNorm weights (C,): the bias has the last dimension.
                out[bias_key] = torch.zeros(out[key].shape[-1], dtype=out[key].dtype)
    return out


class TokenizerFiles(NamedTuple):
    files: dict[str, str]  # file name -> text
    bos_eos_id: int | None  # config.json's bos_token_id and eos_token_id
    notice: str | None  # what the user should know about the missing Hugging Face tokenizer, if it is missing
    has_tokenizer: bool  # whether the files are a tokenizer AutoTokenizer loads


def _tokenizer_files(tokenizer_meta: dict | None, config: GPTConfig) -> TokenizerFiles:
    """The files that describe the model's vocabulary, from the checkpoint's tokenizer meta (see
    export_hf)."""
    meta = tokenizer_meta or {}
    spec = meta.get("tokenizer") if isinstance(meta.get("tokenizer"), dict) else meta
    kind = spec.get("kind")
    if kind == "tiktoken" and spec.get("name") == "gpt2":
        if config.vocab_size < GPT2_VOCAB_SIZE:
            raise HFGPT2Error(
                f"the model's vocab_size is {config.vocab_size}, smaller than the GPT-2 tokenizer's "
                f"{GPT2_VOCAB_SIZE}; "
                f"this checkpoint does not belong to the GPT-2 BPE tokenizer its meta names"
            )
        return TokenizerFiles(gpt2_tokenizer_files(config.block_size), GPT2_EOT_ID, None, has_tokenizer=True)

    eot = meta.get("eot_id")  # the dataset's end-of-text token, if it has one
    bos_eos = eot if isinstance(eot, int) and not isinstance(eot, bool) else None
    if kind == "char":
        notice = (
            "this model uses a character-level vocabulary, not the GPT-2 BPE: no Hugging Face tokenizer was "
            "written; char_vocab.json holds its characters (token id i is chars[i])"
        )
        files = {"char_vocab.json": json.dumps(spec, indent=2, ensure_ascii=False) + "\n"}
        return TokenizerFiles(files, bos_eos, notice, has_tokenizer=False)
    if kind is None:
        notice = "the checkpoint names no tokenizer: only the weights and config.json were written"
    else:
        name = f" {spec.get('name')!r}" if spec.get("name") else ""
        notice = (
            f"no Hugging Face tokenizer is written for tokenizer kind {kind!r}{name}; "
            f"only the GPT-2 BPE has one"
        )
    return TokenizerFiles({}, bos_eos, notice, has_tokenizer=False)


# The folder is replaced as a whole, not file by file. files.atomic_write makes one file atomic, but an export
# is several files that must belong together (the weights, their config.json, the tokenizer): writing each
# atomically into the target would still leave it half new, half old if the export failed halfway (a full
# disk, Ctrl-C), e.g. new weights beside an old vocab.json. So every file is first written into a staging
# folder beside the target, and moved in only once all of them are complete.


@contextlib.contextmanager
def _staging_folder(out: Path) -> Iterator[Path]:
    """A new empty folder beside `out` (the same parent, so the same file system: os.replace from it is a
    rename), removed afterwards whether the export succeeded or failed."""
    full = Path(os.path.abspath(out))  # abspath: "." and "a/.." get a real name to put the suffix on
    staging = full.with_name(full.name + ".tmp-export")
    if staging.is_dir() and not staging.is_symlink():
        shutil.rmtree(staging)  # left by an export that was killed before it could clean up
    elif staging.exists() or staging.is_symlink():
        staging.unlink()
    try:
        staging.mkdir(parents=True)
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _move_into(out: Path, staging: Path, names: list[str]) -> None:
    """Move the staged files `names` into `out`, after removing the files of an earlier export that this one
    does not rewrite (see _EXPORT_FILES)."""
    out.mkdir(exist_ok=True)
    for name in _EXPORT_FILES + _STALE_HF_FILES:
        if name not in names and (out / name).is_file():
            (out / name).unlink()
    for name in names:
        os.replace(staging / name, out / name)


# ----------------------------------------------------------------------------- the GPT-2 tokenizer files


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters, used to write byte strings as
    text in vocab.json and merges.txt: bytes that are visible Latin-1 characters stand for themselves, the
    others (control characters, space, ...) are given the characters from U+0100 on, in byte order. So the
    space byte is 'Ġ' (U+0120) and newline is 'Ċ'."""
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in visible}
    next_char = 256
    for b in range(256):
        if b not in table:
            table[b] = chr(next_char)
            next_char += 1
    return table


def _merge_parts(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The two tokens whose merge created `token`.

    BPE training creates the token of rank r by merging two tokens of lower ranks, and encoding applies
    merges in rank order. So byte-pair encoding the token's bytes with only the merges ranked below r stops at
    the two parts that merge r joins. (For GPT-2 this rebuilds OpenAI's merges.txt line for line.)
    """
    limit = ranks[token]
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        best_rank, best_i = limit, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1], limit)
            if rank < best_rank:
                best_rank, best_i = rank, i
        if best_i < 0:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    if len(parts) != 2:
        raise HFGPT2Error(
            f"cannot recover the BPE merge of token {token!r} (rank {limit}); is the encoding a BPE?"
        )
    return parts[0], parts[1]


def gpt2_tokenizer_files(model_max_length: int = 1024) -> dict[str, str]:
    """vocab.json, merges.txt, tokenizer_config.json and special_tokens_map.json of the GPT-2 BPE, rebuilt
    from tiktoken's gpt2 encoding. Its ranks are GPT-2's token ids; a merged token's id is 256 + the line
    number of its merge in merges.txt, so listing the merges by rank gives merges.txt's order."""
    import tiktoken

    try:
        enc = tiktoken.get_encoding("gpt2")
    except Exception as e:  # no network and no TIKTOKEN_CACHE_DIR: a requests/OS error
        raise HFGPT2Error(
            f"cannot load tiktoken's gpt2 encoding ({type(e).__name__}); set TIKTOKEN_CACHE_DIR to a folder "
            f"holding its files, or run once with network access"
        ) from None
    ranks: dict[bytes, int] = enc._mergeable_ranks
    to_text = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(to_text[b] for b in token)

    vocab = {text(token): rank for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])}
    vocab[GPT2_EOT] = enc.eot_token
    merges = ["#version: 0.2"]  # the header GPT-2's own merges.txt has; readers skip it
    for token, _ in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1:  # the 256 single bytes are the alphabet, not merges
            left, right = _merge_parts(token, ranks)
            merges.append(f"{text(left)} {text(right)}")
    special = {"bos_token": GPT2_EOT, "eos_token": GPT2_EOT, "unk_token": GPT2_EOT}
    tokenizer_config = {
        "tokenizer_class": "GPT2Tokenizer",
        "model_max_length": model_max_length,
        "add_prefix_space": False,  # tiktoken does not add a leading space either
        "add_bos_token": False,
        **special,
    }
    return {
        "vocab.json": json.dumps(vocab, ensure_ascii=False) + "\n",
        "merges.txt": "\n".join(merges) + "\n",
        "tokenizer_config.json": json.dumps(tokenizer_config, indent=2) + "\n",
        "special_tokens_map.json": json.dumps(special, indent=2) + "\n",
    }


# ----------------------------------------------------------------------------- the script


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.ArgumentParser(
        prog="export.py",
        description="Write a checkpoint as a Hugging Face GPT-2 folder (config, safetensors, tokenizer).",
    )
    parser.add_argument(
        "--ckpt", required=True, help="a checkpoint file, or an out_dir (best.pt, else last.pt)"
    )
    parser.add_argument("--to", required=True, metavar="DIR", help="the folder to write")
    parser.add_argument("--overwrite", action="store_true", help="allow writing into a non-empty DIR")
    return parser.parse_args(argv)


def _size(n_bytes: int) -> str:
    return f"{n_bytes / 1e6:.1f} MB" if n_bytes >= 1e6 else f"{n_bytes / 1e3:.1f} kB"


@cli.entry_point()
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ckpt = load_checkpoint(args.ckpt)
    try:
        model = model_from_checkpoint(ckpt)
    except RuntimeError as e:  # load_state_dict's multi-line report: keep its first line
        raise CheckpointError(
            f"the checkpoint's weights do not fit its model_config: {str(e).splitlines()[0]}"
        ) from None
    except ValueError as e:  # GPTConfig's checks of model_config
        raise CheckpointError(str(e)) from None
    meta = ckpt.get("tokenizer")
    if meta is not None and not isinstance(meta, dict):
        raise CheckpointError(
            f"the checkpoint's tokenizer entry is a {type(meta).__name__}, not a dict; re-save it"
        )
    try:
        result = export_hf(model, args.to, meta, overwrite=args.overwrite)
    except OSError as e:  # writing the folder: e.g. no permission, a full disk, a parent that is a file
        raise ExportError(f"cannot write {args.to}: {cli.one_line(e)}") from None

    c = model.config
    print(
        f"exported the step-{ckpt.get('step', '?')} model ({c.n_layer} layers, {c.n_head} heads, "
        f"n_embd {c.n_embd}, vocab {c.vocab_size}, context {c.block_size}) to {result.out_dir}/:"
    )
    for name in result.files:
        print(f"  {name:<24} {_size((result.out_dir / name).stat().st_size):>10}")
    if result.notice:
        print(f"note: {result.notice}")
    where = repr(str(result.out_dir))
    if result.has_tokenizer:
        load = (
            f"from transformers import AutoModelForCausalLM, AutoTokenizer; "
            f"m = AutoModelForCausalLM.from_pretrained({where}); tok = AutoTokenizer.from_pretrained({where})"
        )
    else:
        load = (
            f"from transformers import AutoModelForCausalLM; "
            f"m = AutoModelForCausalLM.from_pretrained({where})"
        )
    print(f'load it with: python -c "{load}"')


if __name__ == "__main__":
    main()
