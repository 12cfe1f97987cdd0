"""Export a model and its tokenizer as one GGUF file, the format of llama.cpp (and of ollama and LM Studio,
which run it), in llama.cpp's `gpt2` architecture: `export.py --format gguf` calls export_gguf.

    export_gguf(model, "model.gguf", ckpt["tokenizer"], dtype="q8_0")

The file is written with the `gguf` package, llama.cpp's own Python writer (its quantizers included), so the
format's details (alignment, key names, the q8_0 block layout) are the ones llama.cpp reads. What the file
holds, and why it computes what our GPT computes:
  * Weights. llama.cpp names them token_embd, position_embd, blk.N.attn_norm, blk.N.attn_qkv (our fused
    c_attn, q|k|v in the same order), blk.N.attn_output, blk.N.ffn_norm, blk.N.ffn_up, blk.N.ffn_down and
    output_norm; a matrix (out, in) in numpy order is ggml's {in, out}, exactly our nn.Linear layout (HF's
    Conv1D would need a transpose; ours does not). The padding rows of the vocabulary are dropped. The head
    is tied (llama.cpp reuses token_embd when there is no `output` tensor); an untied head is written as
    `output`. A model without biases gets zero biases, which compute the same function.
  * The tokenizer, as llama.cpp's byte-level BPE ("gpt2" model): every token as GPT-2's printable byte
    string, the merges in rank order, the pre-tokenizer split by name, and special tokens as control tokens
    (never produced by ordinary text, as in ours). A character vocabulary is carried too: a BPE whose tokens
    are the characters, merges only joining the bytes of a multi-byte character.

What cannot be carried is a one-line GGUFExportError: the modern block's options (llama.cpp has no
architecture with exactly that block; see unsupported_options), the exact erf GELU of nanoGPT's checkpoints
(llama.cpp's gpt2 graph computes the tanh GELU only), a model without a tokenizer, a BPE whose
split pattern llama.cpp does not have (every tokenizer this project makes has one: see _pre_tokenizer).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from gptkit import bpe, cpu_decode
from gptkit.cli import one_line
from gptkit.errors import DataError, UserError
from gptkit.files import atomic_write
from gptkit.hf_tokenizer import BPEMergeError, bpe_merges, bytes_to_unicode
from gptkit.tokenizer import Tokenizer
from model import ARCH_PRESETS, GPT, GPTConfig

GGUF_DTYPES = ("f32", "f16", "q8_0", "q4_0")  # export.py's --dtype
# Our own keys (llama.cpp ignores keys it does not know): the model's GPTConfig and its tokenizer's description,
# as JSON, so that gptkit/gguf_load.py rebuilds exactly this model and tokenizer from the file alone.
CONFIG_KEY, TOKENIZER_KEY = "gptkit.model_config", "gptkit.tokenizer"
ARCH = "gpt2"  # llama.cpp's architecture name (LLM_ARCH_GPT2)
EOT = "<|endoftext|>"  # where a tokenizer has it: BOS and EOS of the file, as in llama.cpp's own GPT-2 files

# GPTConfig options that change the function GPT-2 computes (model.py marks them gpt2=False) but that
# llama.cpp's gpt2 architecture carries all the same: its loader takes an optional untied `output` tensor.
_CARRIED_OPTIONS = ("tie_embeddings",)


class GGUFExportError(UserError):
    """The model or its tokenizer cannot be written as GGUF, or the file cannot be written."""


@dataclass
class GGUFExport:
    path: Path
    dtype: str
    tokenizer: str  # a few words on the vocabulary written, e.g. "gpt2 BPE, 1 special, 50257 tokens in all"
    # With q8_0 or q4_0: the matrices whose rows are not a multiple of the 32-value block, stored in f16 (q8_0:
    # what llama.cpp's own converter does per tensor) or f32 (q4_0: as --quantize=q4_0 keeps them, so that the
    # file is that model exactly).
    fallback: list[str] = field(default_factory=list)
    head: str = ""  # q4_0: a few words on the token embedding's (and head's) format, e.g. "token embedding q6_k"


def export_gguf(
    model: GPT,
    path: str | os.PathLike,
    tokenizer_meta: dict | None,
    *,
    dtype: str = "f32",
    chat_template: str | None = None,
    overwrite: bool = False,
) -> GGUFExport:
    """Write `model` and its tokenizer to the GGUF file `path` in llama.cpp's gpt2 architecture.

    tokenizer_meta: the checkpoint's tokenizer description (the dataset meta, or its "tokenizer" entry).
    dtype: the matrices' type, f32, f16, q8_0 or q4_0 (norms, biases and the position table stay f32, as
    llama.cpp's converter keeps them; q4_0's token embedding, which is also a tied head, and an untied head
    are Q6_K where n_embd is a multiple of 256, as llama.cpp's llama-quantize stores them, else q8_0: the
    model that `--quantize=q4_0` decodes, gptkit/cpu_decode.py's q4_head_format). chat_template: a Jinja
    chat template for tokenizer.chat_template (a chat model's). The file also carries the model's config and tokenizer under
    our own keys, so that our scripts read it back (gptkit/gguf_load.py).
    An existing file is refused unless overwrite=True; it is replaced only once the new one is complete.
    """
    gguf = _import_gguf()
    if dtype not in GGUF_DTYPES:
        raise GGUFExportError(f"unknown GGUF dtype {dtype!r}; use one of {', '.join(GGUF_DTYPES)}")
    differing = unsupported_options(model.config)
    if model.config.activation == "gelu" and len(differing) == 1:  # a nanoGPT checkpoint's: otherwise GPT-2's
        raise GGUFExportError(
            "this model cannot be exported to GGUF: its MLP uses the exact (erf) GELU, as nanoGPT's checkpoints "
            "do, and llama.cpp's gpt2 architecture computes only GPT-2's tanh GELU (its logits would differ); "
            "export it as a Hugging Face folder instead (--format hf), which keeps the exact GELU")
    if differing:
        raise GGUFExportError(
            f"this model cannot be exported to GGUF: {', '.join(differing)} "
            f"{'has' if len(differing) == 1 else 'have'} no equivalent in llama.cpp's gpt2 architecture "
            f"(only GPT-2's block exports; the Hugging Face export has the same limit)"
        )
    out = Path(path)
    if out.is_dir():
        raise GGUFExportError(f"{out} is a folder; pass a file path for the GGUF file, e.g. {out}/model.gguf")
    if out.exists() and not overwrite:
        raise GGUFExportError(f"{out} already exists; choose another file or pass --overwrite")

    # Everything is built in memory first: a tokenizer that cannot be carried writes nothing.
    vocab = gguf_vocab(tokenizer_meta, model.config.vocab_size)
    tensors, fallback = gguf_tensors(model, dtype)

    writer = gguf.GGUFWriter(None, ARCH)
    _add_hparams(writer, model.config, out.stem, dtype)
    _add_vocab(writer, vocab, chat_template)
    writer.add_string(CONFIG_KEY, json.dumps(model.config.to_dict()))
    writer.add_string(TOKENIZER_KEY, json.dumps(tokenizer_meta))
    for name, data, qtype in tensors:
        writer.add_tensor(name, data, raw_dtype=qtype)
    with atomic_write(out) as tmp:  # a failed or interrupted write leaves no file and keeps an old one
        try:
            writer.write_header_to_file(tmp)
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()
    head = ""
    if dtype == "q4_0":
        head = ", ".join(f"{'head' if name.startswith('output') else 'token embedding'} {qtype.name.lower()}"
                         for name, _, qtype in tensors if name.startswith(("token_embd.", "output.")))
    return GGUFExport(out, dtype, vocab.description, fallback, head)


def unsupported_options(config: GPTConfig) -> list[str]:
    """The options of `config` that llama.cpp's gpt2 architecture cannot compute, as 'name=value' strings.

    The modern block (RoPE, parameter-free RMSNorm, QK-norm, ReLU², logit soft-capping) has no exact
    counterpart in llama.cpp either: its architectures with ReLU² (nemotron, arcee, ...) have weighted norms
    and no soft-cap, those with a final soft-cap (gemma2/3, grok) have gated MLPs. Mapping onto one of them
    would compute another function, so these options are refused rather than approximated."""
    gpt2 = ARCH_PRESETS["gpt2"]
    return [f"{k}={getattr(config, k)!r}" for k in GPTConfig.non_gpt2_names()
            if k not in _CARRIED_OPTIONS and getattr(config, k) != gpt2[k]]


def _import_gguf():
    try:
        import gguf
    except ModuleNotFoundError:
        raise GGUFExportError("writing GGUF needs the gguf package (llama.cpp's writer): pip install gguf") from None
    return gguf


# ----------------------------------------------------------------------------- the weights


def gguf_tensors(model: GPT, dtype: str) -> tuple[list[tuple[str, np.ndarray, object]], list[str]]:
    """The model's tensors as (GGUF name, data, GGMLQuantizationType), in llama.cpp's gpt2 names and ggml's
    layout, and the names of the matrices that q8_0 or q4_0 could not hold (stored as f16 or f32)."""
    gguf = _import_gguf()
    T = gguf.MODEL_TENSOR
    # our module -> llama.cpp's tensor (for `h.N.` the block's); the suffix .weight / .bias carries over.
    top = {"transformer.wte": T.TOKEN_EMBD, "transformer.wpe": T.POS_EMBD, "transformer.ln_f": T.OUTPUT_NORM,
           "lm_head": T.OUTPUT}
    block = {"ln_1": T.ATTN_NORM, "attn.c_attn": T.ATTN_QKV, "attn.c_proj": T.ATTN_OUT, "ln_2": T.FFN_NORM,
             "mlp.c_fc": T.FFN_UP, "mlp.c_proj": T.FFN_DOWN}
    c = model.config
    weights = {k: v.detach().to(device="cpu", dtype=torch.float32) for k, v in model.state_dict().items()}
    if c.tie_embeddings:
        del weights["lm_head.weight"]  # the same tensor as wte: llama.cpp reuses token_embd as the head
    for key in ("transformer.wte.weight", "lm_head.weight"):
        if key in weights:
            weights[key] = weights[key][: c.vocab_size]  # the vocabulary's padding rows are no tokens
    if not c.bias:  # llama.cpp's gpt2 requires every bias; zeros compute the model without them
        for key in list(weights):
            module = key.removesuffix(".weight")
            if key.endswith(".weight") and module not in ("transformer.wte", "transformer.wpe", "lm_head"):
                weights[module + ".bias"] = torch.zeros(weights[key].shape[0])

    out, fallback = [], []
    for key, tensor in weights.items():
        module, _, kind = key.rpartition(".")
        if module.startswith("transformer.h."):
            bid, _, rest = module.removeprefix("transformer.h.").partition(".")
            name = gguf.TENSOR_NAMES[block[rest]].format(bid=int(bid))
        else:
            name = gguf.TENSOR_NAMES[top[module]]
        name = f"{name}.{kind}"
        qtype = _tensor_type(gguf, name, tensor, dtype)
        data = tensor.numpy()
        if qtype == gguf.GGMLQuantizationType.Q6_K:  # our quantizer's blocks: what --quantize=q4_0 packs
            out.append((name, cpu_decode.q6_k_blocks(*cpu_decode.quantize_q6_k(tensor)).numpy(), qtype))
            continue
        try:
            data = gguf.quants.quantize(data, qtype)
        except gguf.QuantError:  # q8_0 and q4_0 quantize rows in blocks of 32 values
            qtype = gguf.GGMLQuantizationType.F32 if dtype == "q4_0" else gguf.GGMLQuantizationType.F16
            data = gguf.quants.quantize(data, qtype)
            fallback.append(name)
        out.append((name, data, qtype))
    return out, fallback


def _tensor_type(gguf, name: str, tensor: torch.Tensor, dtype: str):
    """llama.cpp converter's rule: vectors (norms, biases) and the position table stay f32 (its kernels take
    f32 vectors, and a position table is small); every other matrix gets the chosen type, but for q4_0's token
    embedding and head: Q6_K or q8_0 (gptkit/cpu_decode.py's q4_head_format; its Q4_HEADS say why)."""
    Q = gguf.GGMLQuantizationType
    T = gguf.MODEL_TENSOR
    if tensor.dim() <= 1 or name.startswith(gguf.TENSOR_NAMES[T.POS_EMBD]):
        return Q.F32
    if dtype == "q4_0" and name.startswith((gguf.TENSOR_NAMES[T.TOKEN_EMBD], gguf.TENSOR_NAMES[T.OUTPUT] + ".")):
        return Q.Q6_K if cpu_decode.q4_head_format(tensor.shape[1]) == "q6_k" else Q.Q8_0
    return {"f32": Q.F32, "f16": Q.F16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}[dtype]


def _add_hparams(writer, config: GPTConfig, name: str, dtype: str) -> None:
    gguf = _import_gguf()
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_context_length(config.block_size)
    writer.add_embedding_length(config.n_embd)
    writer.add_feed_forward_length(4 * config.n_embd)
    writer.add_block_count(config.n_layer)
    writer.add_head_count(config.n_head)
    writer.add_layer_norm_eps(config.ln_eps)
    file_types = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                  "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}
    writer.add_file_type(file_types[dtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


# ----------------------------------------------------------------------------- the tokenizer


class GGUFVocab(NamedTuple):
    tokens: list[str]  # id -> text: byte-level BPE strings (GPT-2's printable bytes); special tokens' names
    types: list[int]  # id -> gguf.TokenType
    merges: list[str]  # "left right" in rank order
    pre: str  # tokenizer.ggml.pre: which pre-tokenizer split llama.cpp applies before the merges
    bos_eos: int | None  # <|endoftext|>
    eot: int | None  # a chat model's end of turn, <|end|>
    description: str


def gguf_vocab(tokenizer_meta: dict | None, vocab_size: int) -> GGUFVocab:
    """The vocabulary of a checkpoint's tokenizer as llama.cpp's byte-level BPE, with exactly `vocab_size`
    tokens (the model's embedding rows): ids the tokenizer does not use become unused placeholder tokens."""
    gguf = _import_gguf()
    if not tokenizer_meta:
        raise GGUFExportError("the checkpoint names no tokenizer, and a GGUF file needs one; "
                              "export a checkpoint written by train.py")
    try:
        tokenizer = Tokenizer.from_meta(tokenizer_meta)
    except DataError as e:
        raise GGUFExportError(f"the checkpoint's tokenizer cannot be rebuilt: {one_line(e)}") from None
    to_text = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(to_text[b] for b in token)

    TT = gguf.TokenType
    vocab: dict[int, tuple[str, int]] = {}  # id -> (text, type)
    if tokenizer.kind == "char":
        vocab.update((i, (text(ch.encode("utf-8")), TT.NORMAL)) for i, ch in enumerate(tokenizer.chars))
        merges = _char_merges(tokenizer.chars, text)
        pre = "gpt-2"  # no merge joins two characters, so the split before the merges changes nothing
    else:
        pre = _pre_tokenizer(tokenizer)
        vocab.update((i, (text(token), TT.NORMAL)) for token, i in tokenizer.ranks.items())
        try:
            merges = [f"{text(left)} {text(right)}" for left, right in bpe_merges(tokenizer.ranks)]
        except BPEMergeError as e:
            raise GGUFExportError(f"the tokenizer cannot be written as a BPE: {e}") from None
    for name, i in tokenizer.special.items():
        vocab[i] = (name, TT.CONTROL)  # never produced by ordinary text, in llama.cpp as in ours

    if tokenizer.vocab_size > vocab_size:
        raise GGUFExportError(f"the tokenizer has {tokenizer.vocab_size} tokens, but the model only {vocab_size}; "
                              f"the checkpoint and its tokenizer do not belong together")
    texts = [t for t, _ in vocab.values()]
    if len(set(texts)) != len(texts):  # llama.cpp finds tokens by their text
        raise GGUFExportError("a special token's name is also an ordinary token of the vocabulary; GGUF needs "
                              "distinct token texts")
    tokens, types = [], []
    for i in range(vocab_size):
        t, kind = vocab.get(i, (f"[PAD{i}]", TT.UNUSED))  # the name llama.cpp's converter gives unused ids
        tokens.append(t)
        types.append(kind)
    special = tokenizer.special
    return GGUFVocab(tokens, types, merges, pre, special.get(EOT), special.get("<|end|>"),
                     f"{tokenizer.describe()}, {len(special)} special, {vocab_size} tokens in all")


def _pre_tokenizer(tokenizer: Tokenizer) -> str:
    """llama.cpp's name (tokenizer.ggml.pre) for the regex that splits text before the merges: only a split
    that is exactly ours keeps the ids the model was trained on.

    GPT-2's is "gpt-2". A trained BPE splits with GPT-4's pattern (cl100k_base's, gptkit/bpe.py): llama.cpp
    has that regex under "llama-bpe" (Llama 3's tokenizer, trained with the same pattern), "dbrx" and
    "smaug-bpe". "llama-bpe" is chosen because only it also looks a whole piece up in the vocabulary before
    merging, as tiktoken does (a trained BPE can hold a token that its merges would not rebuild from that
    piece's bytes); the BOS that llama.cpp would add for it is switched off in _add_vocab."""
    if tokenizer.kind == "tiktoken" and tokenizer.to_meta().get("name") == "gpt2":
        return "gpt-2"
    if tokenizer.pattern == bpe.SPLIT_PATTERN:
        return "llama-bpe"
    raise GGUFExportError(f"the {tokenizer.describe()} splits text with a pattern that no llama.cpp "
                          f"pre-tokenizer reproduces; only GPT-2's, trained and character tokenizers export")


# A merge of two 0xFF bytes, which UTF-8 text never contains: llama.cpp refuses a BPE without a merges list
# and the gguf writer refuses an empty list, so an all-ASCII character vocabulary gets this one.
_NEVER_MERGED = (b"\xff", b"\xff")


def _char_merges(chars: list[str], text) -> list[str]:
    """Merges that build each multi-byte character from its bytes, left to right. In UTF-8 text a lead byte
    is always followed by its own character's continuation bytes, so these merges never join two characters
    and each character becomes exactly its token."""
    merges: dict[str, None] = {}  # ordered and unique: characters share their leading bytes
    for ch in chars:
        b = ch.encode("utf-8")
        for k in range(1, len(b)):
            merges[f"{text(b[:k])} {text(b[k:k + 1])}"] = None
    return list(merges) or [f"{text(_NEVER_MERGED[0])} {text(_NEVER_MERGED[1])}"]


def _add_vocab(writer, vocab: GGUFVocab, chat_template: str | None) -> None:
    writer.add_tokenizer_model("gpt2")  # llama.cpp's name for byte-level BPE
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges)
    if vocab.bos_eos is not None:
        writer.add_bos_token_id(vocab.bos_eos)
        writer.add_eos_token_id(vocab.bos_eos)
    if vocab.eot is not None:
        writer.add_eot_token_id(vocab.eot)
    # Our models see text as it is: no BOS or EOS is added to a prompt (llama.cpp would otherwise decide
    # from the pre-tokenizer's defaults).
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
