"""Read a GGUF file that export.py wrote back as our GPT and its tokenizer: what sample.py, chat.py, serve.py
and eval.py load when --ckpt names a .gguf file (gptkit/checkpoint/models.py's load_model).

    model, tokenizer, what = load_gguf("shakespeare.gguf")

Only export.py's files are read: besides llama.cpp's gpt2 tensors, they carry the model's GPTConfig and its
tokenizer's description under our own keys (gptkit/gguf.py's CONFIG_KEY, TOKENIZER_KEY), so the model is
rebuilt exactly, not guessed from llama.cpp's hyperparameters. The weights are read with gguf-py (llama.cpp's
own reader) and widened to float32 as they are stored: f32 as it is, f16, q8_0, q4_0 and Q6_K blocks as
scale times value, which is exact. Packing the model read from a q4_0 file with --quantize=q4_0 then gives the
very blocks the file holds (gptkit/cpu_decode.py's q4_0 and q8_0 quantizers are llama.cpp's, and idempotent;
the Q6_K blocks of q4_0's head and token embedding, whose quantizer searches, are carried as they are, in
model.gguf_q6_k), so the file decodes as the model that wrote it, logit for logit; a q8_0 file's model
likewise equals the checkpoint's with its matrices rounded as q8_0.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from gptkit.cli import one_line
from gptkit.errors import DataError, UserError
from gptkit.gguf import ARCH, CONFIG_KEY, TOKENIZER_KEY, _import_gguf
from gptkit.tokenizer import Tokenizer
from model import GPT, GPTConfig

MAGIC = b"GGUF"


class GGUFLoadError(UserError):
    """A GGUF file that cannot be read back as our model (not export.py's, damaged)."""


def is_gguf(path: str | Path) -> bool:
    """Whether `path` is a file that starts as a GGUF file does."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            return p.is_file() and f.read(4) == MAGIC
    except OSError:
        return False


def gguf_state_dict(reader, model: GPT, q6_k: dict | None = None) -> dict[str, torch.Tensor]:
    """The file's tensors under our state_dict names, in float32, shaped as `model`'s (the vocabulary's
    padding rows, which the file leaves out and no logit reads, as zeros). The zero biases the file holds for
    a model without biases (llama.cpp's gpt2 needs them) are checked and dropped. The Q6_K matrices' blocks
    go into `q6_k` too, under the same names, as the file's bytes (rows, 210 per 256 weights)."""
    gguf = _import_gguf()
    T = gguf.MODEL_TENSOR
    top = {T.TOKEN_EMBD: "transformer.wte", T.POS_EMBD: "transformer.wpe", T.OUTPUT_NORM: "transformer.ln_f",
           T.OUTPUT: "lm_head"}
    block = {T.ATTN_NORM: "ln_1", T.ATTN_QKV: "attn.c_attn", T.ATTN_OUT: "attn.c_proj", T.FFN_NORM: "ln_2",
             T.FFN_UP: "mlp.c_fc", T.FFN_DOWN: "mlp.c_proj"}
    names = {gguf.TENSOR_NAMES[t]: ours for t, ours in top.items()}
    for i in range(model.config.n_layer):
        names.update({gguf.TENSOR_NAMES[t].format(bid=i): f"transformer.h.{i}.{ours}" for t, ours in block.items()})
    expected = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        module, _, kind = tensor.name.rpartition(".")
        if module not in names:
            raise GGUFLoadError(f"the file holds a tensor {tensor.name!r} that llama.cpp's gpt2 architecture "
                                f"does not name; it was not written by export.py")
        key = f"{names[module]}.{kind}"
        try:
            values = torch.from_numpy(np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type),
                                               dtype=np.float32))
        except NotImplementedError:
            raise GGUFLoadError(f"{tensor.name} is stored as {tensor.tensor_type.name}, which this reader does not "
                                f"widen; export.py writes f32, f16, q8_0, q4_0 and q6_k") from None
        if key not in expected:
            if kind == "bias" and not model.config.bias and not values.any():
                continue  # a model without biases: zeros, for llama.cpp
            raise GGUFLoadError(f"the file's {tensor.name} has no place in the model its config describes")
        want = expected[key].shape
        if values.dim() == 2 and values.shape[1:] == want[1:] and values.shape[0] < want[0]:  # vocabulary padding
            values = torch.cat([values, values.new_zeros(want[0] - values.shape[0], *want[1:])])
        if values.shape != want:
            raise GGUFLoadError(f"the file's {tensor.name} is {tuple(values.shape)}, the model's {tuple(want)}")
        out[key] = values
        if tensor.tensor_type == gguf.GGMLQuantizationType.Q6_K and q6_k is not None:
            q6_k[key] = tensor.data  # (a view of the mapped file: no copy until pack_for_cpu reads it)
    if model.config.tie_embeddings and "transformer.wte.weight" in out:
        out["lm_head.weight"] = out["transformer.wte.weight"]  # tied: llama.cpp reuses token_embd as the head
        if q6_k is not None and "transformer.wte.weight" in q6_k:
            q6_k["lm_head.weight"] = q6_k["transformer.wte.weight"]
    missing = sorted(set(expected) - set(out))
    if missing:
        raise GGUFLoadError(f"the file lacks {len(missing)} of the model's tensors, e.g. {missing[0]}")
    return out


def _string(reader, key: str, path: Path) -> str:
    field = reader.fields.get(key)
    if field is None:
        raise GGUFLoadError(f"{path} was not written by export.py (it has no {key}): only export.py's GGUF files "
                            f"load here; run other GGUF files with llama.cpp")
    return str(field.contents())


def load_gguf(path: str | Path) -> tuple[GPT, Tokenizer, str]:
    """The model (float32, on the CPU, in eval mode), its tokenizer, and a few words on what was read, from a
    GGUF file of export.py's. GGUFLoadError (one line) for any other file."""
    gguf = _import_gguf()
    p = Path(path)
    try:
        reader = gguf.GGUFReader(p)
    except (OSError, ValueError) as e:
        raise GGUFLoadError(f"cannot read {p} as a GGUF file: {one_line(e)}") from None
    arch = reader.fields.get("general.architecture")
    if arch is None or str(arch.contents()) != ARCH:
        raise GGUFLoadError(f"{p} is not a model of llama.cpp's {ARCH} architecture, as export.py writes them")
    try:
        config = GPTConfig.from_dict(json.loads(_string(reader, CONFIG_KEY, p)))
        model = GPT(config)
        tokenizer = Tokenizer.from_meta(json.loads(_string(reader, TOKENIZER_KEY, p)))
    except (ValueError, TypeError, DataError) as e:  # (json's errors are ValueErrors)
        raise GGUFLoadError(f"{p}: its model description is unusable: {one_line(e)}") from None
    q6_k: dict = {}
    model.load_state_dict(gguf_state_dict(reader, model, q6_k))
    if q6_k:  # q4_0's head and token embedding: packed from these very blocks (cpu_decode.pack_for_cpu, which
        model.gguf_q6_k = q6_k  # takes them off the model)
    types = sorted({t.tensor_type.name for t in reader.tensors if len(t.shape) > 1})
    # The blocks' format, for --quantize=auto (gptkit/inference.py): a q4_0 file decodes as its own blocks.
    model.gguf_dtype = "q4_0" if "Q4_0" in types else None
    return model.eval(), tokenizer, f"{p} (GGUF, matrices in {'/'.join(types).lower()})"
