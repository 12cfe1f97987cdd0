"""The Hugging Face GPT-2 format: loading its weights into our GPT, and the mapping between its layout and
ours (weight names and shapes, config fields), written once here for both directions; export.py writes it.

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
import re
import sys
from dataclasses import replace
from pathlib import Path

import torch

from gptkit import checksum
from gptkit.errors import UserError
from gptkit.network import hub_unreachable
from model import ARCH_PRESETS, GPT, GPTConfig

# The official checkpoints and their Hub repositories (params: 124M, 350M, 774M, 1558M).
PRETRAINED = {
    "gpt2": "openai-community/gpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large",
    "gpt2-xl": "openai-community/gpt2-xl",
}
GPT2_NAMES = tuple(PRETRAINED)  # the names load_pretrained fetches from the Hub


class HFGPT2Error(UserError):
    """A Hugging Face GPT-2 folder, name or config we cannot use; the message says what is wrong and how to
    fix it."""


# ----------------------------------------------------------------------------- the mapping between layouts

PREFIX = "transformer."  # of every key but lm_head's; OpenAI's upload leaves it out
# Weights of HF's Conv1D layers, stored (in, out); suffixes of the keys after `h.N.`.
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Buffers HF's GPT-2 keeps in its state dict: the causal mask and its fill value. Not parameters.
_HF_BUFFER = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")
# The output head, tied to the token embedding in both models: never written to a HF file, and ignored
# when a file has it.
TIED_HEAD = "lm_head.weight"
TIED_TO = "transformer.wte.weight"
EXPORT_MARKER = "gptkit_tokenizer.json"  # written by export.py beside the weights (hf_tokenizer.GPTKIT_FILE)
# GPTConfig.activation -> the HF activation_function computing the same GELU: GPT-2's tanh approximation
# ("gelu_new") and the exact erf one ("gelu", nanoGPT's) both export. "gelu_pytorch_tanh" reads as gelu_tanh.
HF_ACTIVATIONS = {"gelu_tanh": "gelu_new", "gelu": "gelu"}
_FROM_HF_ACTIVATION = {**{hf: ours for ours, hf in HF_ACTIVATIONS.items()}, "gelu_pytorch_tanh": "gelu_tanh"}


def hf_to_ours(key: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
    """Our key and layout for one tensor of a Hugging Face GPT-2 state dict; None for what we do not load:
    the tied lm_head, and the attention-mask buffers our attention rebuilds itself."""
    name = key.removeprefix(PREFIX)
    if name == TIED_HEAD or _HF_BUFFER.match(name):
        return None
    return PREFIX + name, _swap_conv1d_layout(name, tensor)


def ours_to_hf(key: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
    """The Hugging Face key and layout of one tensor of our state dict; None for the tied lm_head (HF ties it
    again on load, and safetensors refuses two names for one tensor)."""
    if key == TIED_HEAD:
        return None
    return key, _swap_conv1d_layout(key, tensor)


def _swap_conv1d_layout(key: str, tensor: torch.Tensor) -> torch.Tensor:
    """Conv1D (in, out) <-> nn.Linear (out, in): the same transpose converts either way. (Only a matrix is
    transposed: anything else under such a name is left for the caller's shape check to report.)"""
    return tensor.t() if key.endswith(CONV1D_WEIGHTS) and tensor.dim() == 2 else tensor


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
    if activation not in _FROM_HF_ACTIVATION:
        raise HFGPT2Error(
            f"{where}: activation_function is {activation!r}; this GPT computes only the GELUs "
            f"{', '.join(_FROM_HF_ACTIVATION)}"
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
            activation=_FROM_HF_ACTIVATION[activation],
        )
    except (TypeError, ValueError) as e:
        raise HFGPT2Error(f"{where}: {e}") from None


def non_gpt2_options(config: GPTConfig) -> list[str]:
    """The options of `config` that a Hugging Face GPT-2 cannot express, as 'name=value' strings: those that
    change the function GPT-2 computes (model.py's GPTConfig marks them), set differently from GPT-2 (bar an
    activation that HF_ACTIVATIONS maps)."""
    gpt2 = ARCH_PRESETS["gpt2"]
    return [f"{k}={getattr(config, k)!r}" for k in GPTConfig.non_gpt2_names() if getattr(config, k) != gpt2[k]
            and not (k == "activation" and config.activation in HF_ACTIVATIONS)]


def hf_config(config: GPTConfig, bos_eos_id: int | None) -> dict:
    """A Hugging Face GPT-2 config.json dict for our config; an HFGPT2Error for a model GPT-2 cannot express."""
    differing = non_gpt2_options(config)
    if differing:
        raise HFGPT2Error(f"this model cannot be exported as a Hugging Face GPT-2: {', '.join(differing)} "
                          f"{'has' if len(differing) == 1 else 'have'} no GPT-2 equivalent (only the GPT-2 "
                          f"architecture exports)")
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
        "activation_function": HF_ACTIVATIONS[config.activation],  # gelu_new: the tanh GELU; gelu: erf
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


# ----------------------------------------------------------------------------- loading

# The embedding and head of a loaded model get rows up to a multiple of this, as a scratch run's do (GPT-2's
# 50257 -> 50304): the head's matmuls (a third of GPT-2 124M's FLOPs) then run on the GPU's fast kernels. The
# extra rows are zero and stay out of everything: never a target (the loss masks them), never a returned or
# sampled logit (GPT.head drops them), never exported (export.py drops them).
VOCAB_MULTIPLE = 64


def load_pretrained(name_or_path: str, **overrides) -> GPT:
    """A GPT holding the weights of a Hugging Face GPT-2, in eval mode on the CPU, in float32, with its vocabulary
    padded to a multiple of VOCAB_MULTIPLE rows (zeros).

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
    config = replace(config_from_hf(read_json(config_path), source), vocab_multiple=VOCAB_MULTIPLE)
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
        weight_map = read_json(index).get("weight_map")
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
    """One file of a Hub repository (from the local cache when it is there). Where the Hub cannot be reached
    (gptkit/network.py asks once, in a second) only the cache is tried: a miss fails at once, not after the
    Hub client's ~25 s of retries."""
    import huggingface_hub  # imported here: only the Hub names need it

    offline = hub_unreachable()
    try:
        return Path(huggingface_hub.hf_hub_download(repo, filename, local_files_only=offline is not None))
    # Network trouble arrives as many types (OSError, the Hub's own errors, HTTP client errors); any of them
    # means the same to the user: the file could not be fetched.
    except Exception as e:
        if offline is not None:
            raise HFGPT2Error(
                f"cannot reach the Hugging Face Hub ({offline}) and {filename} of '{name}' is not in its local "
                f"cache; connect to the network once, or pass a local folder with config.json and "
                f"model.safetensors instead"
            ) from None
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        raise HFGPT2Error(
            f"could not download {filename} of '{name}' from the Hugging Face Hub ({type(e).__name__}: "
            f"{reason}); pass a local folder with config.json and model.safetensors instead"
        ) from None


def read_json(path: Path) -> dict:
    """A Hugging Face folder's JSON file (config.json, the weights' index) as a dict, or a one-line error."""
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
            return _read_safetensors(path)
        # weights_only: a .bin is a pickle, and a pickle from the internet must not run code.
        state = torch.load(path, map_location="cpu", weights_only=True)
    except HFGPT2Error:
        raise
    except Exception as e:  # safetensors, pickle and zip errors share no base class
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise HFGPT2Error(
            f"cannot read weights {path}: {first}; the file may be truncated or not a state dict"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise HFGPT2Error(f"{path} is not a state dict (a dict of tensors); re-save it with save_pretrained")
    return state


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """A .safetensors file's tensors, checked against the CRCs that export.py records in its metadata (a file
    from elsewhere has none: it is taken as it is, with a note saying so)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    state = load_file(str(path), device="cpu")
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    if metadata and checksum.SAFETENSORS_KEY in metadata:
        wrong = checksum.safetensors_mismatch(state, metadata)
        if wrong:
            raise HFGPT2Error(f"{path} is corrupt: {wrong} does not match the checksum saved with it; nothing on "
                              f"disk was changed; export it again from its checkpoint (python export.py)")
    elif (path.parent / EXPORT_MARKER).is_file():  # exported by this project before checksums were recorded
        print(f"note: {path} carries no checksums (exported before they were recorded): damage to it cannot be "
              f"detected; export it again to add them", file=sys.stderr)
    else:  # from elsewhere (the Hub, save_pretrained)
        print(f"note: {path} carries no checksums of this project (it was not written by export.py): damage to "
              f"it cannot be detected", file=sys.stderr)
    return state


def load_hf_state_dict(model: GPT, hf_state: dict[str, torch.Tensor], source: str = "the checkpoint") -> None:
    """Copy a Hugging Face GPT-2 state dict into `model`, checking that every weight is there, with its
    shape. The token embedding gets zero rows up to the model's padded vocabulary (config.vocab_multiple)."""
    ours = model.state_dict()
    converted: dict[str, torch.Tensor] = {}
    unexpected = []
    for key, tensor in hf_state.items():
        mapped = hf_to_ours(key, tensor)
        if mapped is None:
            continue
        our_key, tensor = mapped
        if our_key not in ours:
            unexpected.append(key)
            continue
        if our_key == TIED_TO:
            tensor = _pad_vocab(tensor, model.config)
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
    missing = [k for k in ours if k != TIED_HEAD and k not in converted]
    if missing:
        raise HFGPT2Error(
            f"{source}: weights missing for {_few(missing)}; the file is incomplete or not a GPT-2"
        )
    converted[TIED_HEAD] = converted[TIED_TO]  # tied: the same tensor either way
    model.load_state_dict(converted)  # copies, converting the file's dtype to the model's


def _pad_vocab(wte: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    """A file's token embedding (vocab_size, C) with zero rows appended up to the model's padded vocabulary;
    any other shape is returned as it is, for the caller's shape check to report."""
    extra = config.padded_vocab_size - config.vocab_size
    if wte.dim() != 2 or wte.size(0) != config.vocab_size or extra == 0:
        return wte
    return torch.cat([wte, wte.new_zeros(extra, wte.size(1))])


def _few(keys: list[str], n: int = 5) -> str:
    more = f" and {len(keys) - n} more" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more
