"""A model as a Hugging Face GPT-2 folder that transformers loads: its weights in Hugging Face's layout
(model.safetensors, with their checksums), config.json, its tokenizer's files (GPT-2's BPE, a trained BPE or
characters, with its special tokens, and a chat model's template) and generation_config.json, written as a whole.

    result = export_hf(model, "hf-out/", ckpt["tokenizer"])   # export.py's --format hf; result.files: what it wrote

The mapping between Hugging Face's names and ours is gptkit/hf_gpt2.py's, the tokenizer files
gptkit/hf_tokenizer.py's.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from gptkit import chat
from gptkit.checksum import safetensors_metadata
from gptkit.errors import DataError
from gptkit.hf_gpt2 import HFGPT2Error, hf_config, ours_to_hf
from gptkit.hf_tokenizer import GPTKIT_FILE, hf_tokenizer_files
from gptkit.tokenizer import Tokenizer
from model import GPT, GPTConfig

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
    "tokenizer.json",
    GPTKIT_FILE,
    "generation_config.json",
    "char_vocab.json",  # written by exports of character-level models before they had a tokenizer.json
)
_STALE_HF_FILES = (
    "pytorch_model.bin",
    "model.safetensors.index.json",
)


@dataclass
class ExportResult:
    out_dir: Path
    files: list[str] = field(default_factory=list)  # names written into out_dir
    notice: str | None = None  # something the user should know (e.g. no Hugging Face tokenizer was written)
    has_tokenizer: bool = False  # whether AutoTokenizer.from_pretrained(out_dir) works


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
    if tokenizer.generation is not None:
        texts["generation_config.json"] = json.dumps(tokenizer.generation, indent=2) + "\n"
    state = hf_state_dict(model)
    names = ["config.json", "model.safetensors", *(name for name in texts if name != "config.json")]

    with _staging_folder(out) as staging:
        for name, text in texts.items():
            (staging / name).write_text(text, encoding="utf-8")
        from safetensors.torch import save_file

        # transformers checks the "format" metadata to know the tensors are PyTorch's.
        # (and the tensors' CRCs, which every reader here verifies)
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt", **safetensors_metadata(state)})
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
    generation: dict | None = None  # generation_config.json: the tokens that end a reply (None: none written)


def _tokenizer_files(tokenizer_meta: dict | None, config: GPTConfig) -> TokenizerFiles:
    """The files that describe the model's vocabulary, from the checkpoint's tokenizer meta (see
    export_hf): Hugging Face's tokenizer files for every kind of tokenizer (gptkit/hf_tokenizer.py)."""
    meta = tokenizer_meta or {}
    spec = meta.get("tokenizer") if isinstance(meta.get("tokenizer"), dict) else meta
    if spec.get("kind") is None:
        notice = "the checkpoint names no tokenizer: only the weights and config.json were written"
        eot = meta.get("eot_id")  # the dataset's end-of-text token, if it has one
        bos_eos = eot if isinstance(eot, int) and not isinstance(eot, bool) else None
        return TokenizerFiles({}, bos_eos, notice, has_tokenizer=False)
    try:
        tokenizer = Tokenizer.from_meta(meta)
    except DataError as e:
        raise HFGPT2Error(f"the checkpoint's tokenizer cannot be rebuilt: {e}") from None
    if config.vocab_size < tokenizer.vocab_size:
        raise HFGPT2Error(
            f"the model's vocab_size is {config.vocab_size}, smaller than its tokenizer's {tokenizer.vocab_size} "
            f"(the {tokenizer.describe()}); this checkpoint does not belong to the tokenizer its meta names"
        )
    # A chat model (its tokenizer has the template's special tokens) carries its template, so that
    # transformers' apply_chat_template gives exactly the prompts chat.py and serve.py build.
    template = chat.HF_CHAT_TEMPLATE if chat.is_chat_tokenizer(tokenizer) else None
    files = hf_tokenizer_files(tokenizer, model_max_length=config.block_size, chat_template=template)
    return TokenizerFiles(files, tokenizer.eot_id, None, has_tokenizer=True, generation=generation_config(tokenizer))


def generation_config(tokenizer: Tokenizer) -> dict | None:
    """generation_config.json's token ids, which transformers' generate stops at (eos_token_id) and pads with:
    for a chat model the end of a turn, <|end|> first, then the template's other markers (a reply never holds
    one), as chat.py and serve.py stop; for a text model its end-of-text token. None when it has neither."""
    if chat.is_chat_tokenizer(tokenizer):
        marks = chat.ChatTokens.of(tokenizer)
        stop = [marks.end, *sorted(marks.stop_ids - {marks.end})]
        return {"bos_token_id": tokenizer.eot_id, "eos_token_id": stop, "pad_token_id": marks.end}
    if tokenizer.eot_id is None:
        return None
    return {"bos_token_id": tokenizer.eot_id, "eos_token_id": tokenizer.eot_id, "pad_token_id": tokenizer.eot_id}


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
