"""Hugging Face GPT-2 interop: load OpenAI's GPT-2 (or any HF GPT-2 folder) into our GPT; export ours back.

Both models compute the same function; only the way the weights are stored differs:
  * HF's GPT-2 uses `Conv1D` layers, which store a weight as (in, out); our nn.Linear stores (out, in). The
    four projection weights of every block (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj) are transposed.
  * HF keys are `transformer.h.0.ln_1.weight` in files written by `save_pretrained`, but `h.0.ln_1.weight` in
    OpenAI's original upload; ours always have the `transformer.` prefix.
  * HF files may hold non-parameter buffers (the causal mask `attn.bias`, `attn.masked_bias`) that we rebuild
    ourselves, and `lm_head.weight`, which both models tie to the token embedding wte.

Loading needs only `safetensors` / `torch` and, for the four Hub names, `huggingface_hub`. `transformers` is
never imported, so it stays a test-only dependency.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from cli import UserError
from model import GPT, GPTConfig

# The official checkpoints and their Hub repositories (params: 124M, 350M, 774M, 1558M).
PRETRAINED = {
    "gpt2": "openai-community/gpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large",
    "gpt2-xl": "openai-community/gpt2-xl",
}

# Weights of HF's Conv1D layers, stored (in, out); suffixes of the keys after `h.N.`.
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")

# Buffers HF's GPT-2 keeps in its state dict: the causal mask and its fill value. Not parameters.
_HF_BUFFER = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")

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


class HFGPT2Error(UserError):
    """A Hugging Face GPT-2 folder, name or config we cannot use; the message says what is wrong and how to
    fix it."""


# ----------------------------------------------------------------------------- loading


def load_pretrained(name_or_path: str, **overrides) -> GPT:
    """A GPT holding the weights of a Hugging Face GPT-2, in eval mode on the CPU, in float32.

    name_or_path: 'gpt2', 'gpt2-medium', 'gpt2-large' or 'gpt2-xl' (downloaded from the Hub, or taken from its
    local cache), or a folder with a GPT-2 `config.json` and `model.safetensors` (or `pytorch_model.bin`).
    An exact Hub name always means the Hub; write `./gpt2` for a local folder of that name.

    overrides: `dropout=` (HF's configs say 0.1, but we load with 0.0 unless asked: right for evaluation and
    sampling; fine-tuning usually wants 0.1), `block_size=` (smaller than the checkpoint's: the position
    embedding is cropped to its first rows).
    """
    unknown = sorted(set(overrides) - {"dropout", "block_size"})
    if unknown:
        raise HFGPT2Error(
            f"load_pretrained: cannot override {', '.join(unknown)}; "
            f"only dropout and block_size can be changed"
        )
    config_path, weight_paths, source = _locate(name_or_path)
    config = config_from_hf(_read_json(config_path), source)
    if "dropout" in overrides:
        config = replace(config, dropout=overrides["dropout"])  # replace() re-runs GPTConfig's checks
    block_size = overrides.get("block_size")
    if block_size is not None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise HFGPT2Error(f"load_pretrained: block_size must be a positive integer, got {block_size!r}")
        if block_size > config.block_size:
            raise HFGPT2Error(
                f"load_pretrained: block_size {block_size} is larger than {source}'s {config.block_size} "
                f"positions (it has no position embeddings beyond them); "
                f"use block_size <= {config.block_size}"
            )

    model = GPT(config)
    hf_state: dict[str, torch.Tensor] = {}
    for path in weight_paths:
        hf_state.update(_read_weights(path))
    load_hf_state_dict(model, hf_state, source)
    if block_size is not None and block_size < config.block_size:
        model.crop_block_size(block_size)
    return model.eval()


def _locate(name_or_path: str) -> tuple[Path, list[Path], str]:
    """(config.json, weight files, a description for messages) of a Hub name or a local folder."""
    if name_or_path in PRETRAINED:
        repo = PRETRAINED[name_or_path]
        config_path = _download(repo, "config.json", name_or_path)
        weights_path = _download(repo, "model.safetensors", name_or_path)
        return config_path, [weights_path], f"'{name_or_path}'"

    folder = Path(name_or_path)
    valid = ", ".join(PRETRAINED)
    if folder.is_file():
        raise HFGPT2Error(f"{folder} is a file; pass the folder holding config.json and the weights instead")
    if not folder.is_dir():
        raise HFGPT2Error(
            f"unknown pretrained model {name_or_path!r}: use one of {valid}, "
            f"or a local folder with config.json and model.safetensors"
        )
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise HFGPT2Error(
            f"{folder}/ has no config.json; a Hugging Face GPT-2 folder needs config.json and weights"
        )
    if (folder / "model.safetensors").is_file():
        return config_path, [folder / "model.safetensors"], str(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():  # a sharded save: the index maps every key to one of several files
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise HFGPT2Error(f"{index} has no weight_map; re-save the model with save_pretrained")
        shards = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [p.name for p in shards if not p.is_file()]
        if missing:
            raise HFGPT2Error(f"{folder}/ lacks the shard(s) {', '.join(missing)} listed in {index.name}")
        return config_path, shards, str(folder)
    if (folder / "pytorch_model.bin").is_file():
        return config_path, [folder / "pytorch_model.bin"], str(folder)
    raise HFGPT2Error(f"{folder}/ has no model.safetensors or pytorch_model.bin; save the model there first")


def _download(repo: str, filename: str, name: str) -> Path:
    """One file of a Hub repository (from the local cache when it is there)."""
    import huggingface_hub  # imported here: only the Hub names need it

    try:
        return Path(huggingface_hub.hf_hub_download(repo, filename))
    # Network trouble arrives as many types (OSError, the Hub's own errors, HTTP client errors); any of them
    # means the same to the user: the file could not be fetched.
    except Exception as e:
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        raise HFGPT2Error(
            f"could not download {filename} of '{name}' from the Hugging Face Hub ({type(e).__name__}: "
            f"{reason}); pass a local folder with config.json and model.safetensors instead"
        ) from None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFGPT2Error(f"cannot read {path}: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise HFGPT2Error(f"{path} does not hold a JSON object; is it a Hugging Face config file?")
    return data


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a .safetensors or pytorch_model.bin file, on the CPU."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path), device="cpu")
        # weights_only: a .bin is a pickle, and a pickle from the internet must not run code.
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # safetensors, pickle and zip errors share no base class
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise HFGPT2Error(
            f"cannot read weights {path}: {first}; the file may be truncated or not a state dict"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise HFGPT2Error(f"{path} is not a state dict (a dict of tensors); re-save it with save_pretrained")
    return state


def config_from_hf(hf: dict, source: str = "config.json") -> GPTConfig:
    """Our GPTConfig from a Hugging Face GPT-2 config dict, refusing any option our architecture cannot
    compute.

    `reorder_and_upcast_attn` is accepted: it only makes HF compute the attention scores in float32 under
    fp16/bf16 autocast (the same function, different rounding); our attention is PyTorch's
    scaled_dot_product_attention, which is numerically careful on its own.
    """
    where = f"config.json of {source}"

    def get(key: str, default=None):
        return hf.get(key, default)

    if get("model_type") != "gpt2":
        raise HFGPT2Error(
            f"{where}: model_type is {get('model_type')!r}, but only GPT-2 ('gpt2') models load here"
        )
    for key in ("n_layer", "n_head", "n_embd", "vocab_size"):
        if key not in hf:
            raise HFGPT2Error(f"{where}: the field {key} is missing; is this a GPT-2 config?")
    # n_ctx is an old alias of n_positions (OpenAI's configs carry both, equal).
    block_size = get("n_positions", get("n_ctx"))
    if block_size is None:
        raise HFGPT2Error(f"{where}: the field n_positions is missing; is this a GPT-2 config?")

    activation = get("activation_function", "gelu_new")
    if activation not in ("gelu_new", "gelu_pytorch_tanh"):
        raise HFGPT2Error(
            f"{where}: activation_function is {activation!r}; this GPT uses the tanh GELU only "
            f"(gelu_new or gelu_pytorch_tanh)"
        )
    n_inner = get("n_inner")
    if n_inner is not None and n_inner != 4 * hf["n_embd"]:
        raise HFGPT2Error(
            f"{where}: n_inner is {n_inner}; this GPT's MLP is 4 * n_embd = {4 * hf['n_embd']} wide "
            f"(n_inner must be that or null)"
        )
    # Options that change the function: each must have GPT-2's value.
    required = {
        "scale_attn_weights": True,  # divide attention scores by sqrt(head_dim)
        "scale_attn_by_inverse_layer_idx": False,  # an extra 1/(layer+1) on the scores
        "add_cross_attention": False,  # encoder-decoder attention layers
        "tie_word_embeddings": True,  # our lm_head is wte
    }
    for key, value in required.items():
        if get(key, value) != value:
            raise HFGPT2Error(f"{where}: {key} is {get(key)!r}; this GPT supports only {key}={value}")

    try:
        return GPTConfig(
            block_size=block_size,
            vocab_size=hf["vocab_size"],
            n_layer=hf["n_layer"],
            n_head=hf["n_head"],
            n_embd=hf["n_embd"],
            dropout=0.0,
            bias=True,
            ln_eps=float(get("layer_norm_epsilon", 1e-5)),
        )
    except (TypeError, ValueError) as e:
        raise HFGPT2Error(f"{where}: {e}") from None


def load_hf_state_dict(model: GPT, hf_state: dict[str, torch.Tensor], source: str = "the checkpoint") -> None:
    """Copy a Hugging Face GPT-2 state dict into `model`, checking that every weight is there, with its
    shape."""
    ours = model.state_dict()
    converted: dict[str, torch.Tensor] = {}
    unexpected = []
    for key, tensor in hf_state.items():
        name = key.removeprefix("transformer.")
        if name == "lm_head.weight" or _HF_BUFFER.match(name):
            continue  # the head is tied to wte; the buffers are rebuilt by our attention
        our_key = "transformer." + name
        if our_key not in ours or our_key == "lm_head.weight":
            unexpected.append(key)
            continue
        if name.endswith(CONV1D_WEIGHTS):
            tensor = tensor.t()  # Conv1D (in, out) -> nn.Linear (out, in)
        if tensor.shape != ours[our_key].shape:
            raise HFGPT2Error(
                f"{source}: {key} has shape {tuple(tensor.shape)} (after transposing Conv1D weights), "
                f"but the config asks for {tuple(ours[our_key].shape)}; config.json and the weights disagree"
            )
        converted[our_key] = tensor
    if unexpected:
        raise HFGPT2Error(
            f"{source}: unexpected weights {_few(unexpected)}; is this a plain GPT-2 language model?"
        )
    missing = [k for k in ours if k != "lm_head.weight" and k not in converted]
    if missing:
        raise HFGPT2Error(
            f"{source}: weights missing for {_few(missing)}; the file is incomplete or not a GPT-2"
        )
    converted["lm_head.weight"] = converted["transformer.wte.weight"]  # tied: the same tensor either way
    model.load_state_dict(converted)  # copies, converting the file's dtype to the model's


def _few(keys: list[str], n: int = 5) -> str:
    more = f" and {len(keys) - n} more" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


# ----------------------------------------------------------------------------- exporting


@dataclass
class ExportResult:
    out_dir: Path
    files: list[str] = field(default_factory=list)  # names written into out_dir
    notice: str | None = None  # something the user should know (e.g. no Hugging Face tokenizer was written)
    has_tokenizer: bool = False  # whether AutoTokenizer.from_pretrained(out_dir) works


def hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """Our weights as a Hugging Face GPT2LMHeadModel state dict (Conv1D layout), without the tied lm_head.

    The padding rows of wte (vocab_multiple > 1) are dropped: HF's logits have exactly vocab_size columns. A
    model without biases gets zero biases, which compute the same function (HF's GPT-2 always has them).
    """
    V = model.config.vocab_size
    out: dict[str, torch.Tensor] = {}
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight":
            continue  # tied to wte; safetensors also refuses two names for one tensor
        tensor = tensor.detach().cpu()
        if key == "transformer.wte.weight":
            # (padded V, C) -> (V, C); a copy, so the file's tensor does not share storage with unsaved rows
            tensor = tensor[:V].clone()
        elif key.endswith(CONV1D_WEIGHTS):
            tensor = tensor.t()  # nn.Linear (out, in) -> Conv1D (in, out)
        out[key] = tensor.contiguous()
    if not model.config.bias:
        for key in list(out):
            bias_key = key.removesuffix(".weight") + ".bias"
            if key.endswith(".weight") and key not in ("transformer.wte.weight", "transformer.wpe.weight"):
                # Conv1D weights are (in, out) and LayerNorm weights (C,): the bias has the last dimension.
                out[bias_key] = torch.zeros(out[key].shape[-1], dtype=out[key].dtype)
    return out


def hf_config(config: GPTConfig, bos_eos_id: int | None) -> dict:
    """A Hugging Face GPT-2 config.json dict for our config."""
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": config.vocab_size,  # the real vocabulary: padding rows are not exported
        "n_positions": config.block_size,
        "n_ctx": config.block_size,  # the old name, for older readers
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None,  # 4 * n_embd
        "activation_function": "gelu_new",  # the tanh GELU
        # Our one dropout acts after the embeddings, on the attention weights and on both residual branches.
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "layer_norm_epsilon": config.ln_eps,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "add_cross_attention": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": bos_eos_id,
        "eos_token_id": bos_eos_id,
    }


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

    meta = tokenizer_meta or {}
    spec = meta.get("tokenizer") if isinstance(meta.get("tokenizer"), dict) else meta
    kind = spec.get("kind")
    is_gpt2_bpe = kind == "tiktoken" and spec.get("name") == "gpt2"
    if is_gpt2_bpe and model.config.vocab_size < GPT2_VOCAB_SIZE:
        raise HFGPT2Error(
            f"the model's vocab_size is {model.config.vocab_size}, smaller than the GPT-2 tokenizer's "
            f"{GPT2_VOCAB_SIZE}; this checkpoint does not belong to the GPT-2 BPE tokenizer its meta names"
        )
    eot = meta.get("eot_id")
    if is_gpt2_bpe:
        bos_eos = GPT2_EOT_ID
    else:  # the dataset's end-of-text token, if it has one
        bos_eos = eot if isinstance(eot, int) and not isinstance(eot, bool) else None

    # Build everything in memory first, so a failure (e.g. the tiktoken files are unavailable) writes nothing.
    files: dict[str, str] = {"config.json": json.dumps(hf_config(model.config, bos_eos), indent=2) + "\n"}
    notice = None
    if is_gpt2_bpe:
        files.update(gpt2_tokenizer_files(model.config.block_size))
    elif kind == "char":
        files["char_vocab.json"] = json.dumps(spec, indent=2, ensure_ascii=False) + "\n"
        notice = (
            "this model uses a character-level vocabulary, not the GPT-2 BPE: no Hugging Face tokenizer was "
            "written; char_vocab.json holds its characters (token id i is chars[i])"
        )
    elif kind is None:
        notice = "the checkpoint names no tokenizer: only the weights and config.json were written"
    else:
        name = f" {spec.get('name')!r}" if spec.get("name") else ""
        notice = (
            f"no Hugging Face tokenizer is written for tokenizer kind {kind!r}{name}; "
            f"only the GPT-2 BPE has one"
        )
    state = hf_state_dict(model)
    names = ["config.json", "model.safetensors", *(n for n in files if n != "config.json")]

    # Write into a sibling folder first (same parent, so same file system: os.replace is a rename), and touch
    # the destination only once every file is complete: a failure mid-write (full disk, Ctrl-C) must not
    # leave an --overwrite target holding half of the new export and half of the old one.
    full = Path(os.path.abspath(out))  # abspath: "." and "a/.." get a real name to put the suffix on
    tmp = full.with_name(full.name + ".tmp-export")
    if tmp.is_dir() and not tmp.is_symlink():
        shutil.rmtree(tmp)  # left by an export that was killed before it could clean up
    elif tmp.exists() or tmp.is_symlink():
        tmp.unlink()
    try:
        tmp.mkdir(parents=True)
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
        from safetensors.torch import save_file

        # transformers checks the "format" metadata to know the tensors are PyTorch's.
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        out.mkdir(exist_ok=True)
        for name in _EXPORT_FILES + _STALE_HF_FILES:
            if name not in names and (out / name).is_file():
                (out / name).unlink()
        for name in names:
            os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ExportResult(out, names, notice, has_tokenizer=is_gpt2_bpe)


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
