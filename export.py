"""Export a trained checkpoint as a Hugging Face GPT-2 folder: the weights in HF's layout, config.json and
its tokenizer (GPT-2's BPE, a trained BPE or characters, with its special tokens) as Hugging Face files.

    python export.py --ckpt out-shakespeare/ --out hf-shakespeare/     # (--to DIR, the older spelling, too)
    python export.py --ckpt out-shakespeare/ --format gguf --out shakespeare.gguf --dtype q8_0   # or q4_0
    python export.py --ckpt out/ --format pt --out model.pt      # a sharded (FSDP) checkpoint as one file

The folder loads with `transformers.AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`;
gptkit/hf_export.py writes it (the mapping between HF's layout and ours lives in gptkit/hf_gpt2.py, the tokenizer
files in gptkit/hf_tokenizer.py).
With --format gguf the model and its tokenizer go into one GGUF file instead, for llama.cpp, ollama and LM
Studio (gptkit/gguf.py writes it); sample.py, chat.py and serve.py read such a file back as a checkpoint
(--ckpt shakespeare.gguf; a q4_0 file with --quantize=q4_0 is exactly the model that wrote it). With --format pt the checkpoint becomes one file of this project's own
format, the weights and everything but the optimizer state: what a run under FSDP saves as a folder of shards
(out_dir/last/), as one file for copying or sharing (every script here also reads the folder as it is).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from gptkit import chat, cli
from gptkit.checkpoint import CheckpointError, load_checkpoint, model_from_checkpoint, save_checkpoint
from gptkit.errors import ConfigError, UserError
from gptkit.gguf import GGUF_DTYPES, export_gguf
from gptkit.hf_export import export_hf
from gptkit.options import Alias, load_config, setting
from gptkit.tokenizer import Tokenizer


class ExportError(UserError):
    """The export folder could not be written."""


# ----------------------------------------------------------------------------- the script


DESCRIPTION = (  # what --help says first
    "Write a checkpoint as a Hugging Face GPT-2 folder (config, safetensors, tokenizer), or with --format gguf\n"
    "as one GGUF file for llama.cpp, ollama and LM Studio, or with --format pt as one checkpoint file.")


@dataclass
class ExportConfig:
    ckpt: str = setting("", "the checkpoint to export: a file, or an out_dir (best.pt if present, else last.pt)")
    format: str = setting("hf", "hf: a Hugging Face GPT-2 folder (--out DIR); gguf: a llama.cpp file (--out FILE); "
                                "pt: this project's one-file checkpoint, e.g. of a sharded one (--out FILE)",
                          ("hf", "gguf", "pt"))
    out: str = setting("", "what to write: the folder (--format hf) or the file (gguf, pt)")
    dtype: str | None = setting(None, "--format gguf: the file's weights, f32 (auto), f16 (half the size), q8_0 "
                                      "(8-bit, about a quarter) or q4_0 (4-bit blocks, the token embedding and "
                                      "head in Q6_K where n_embd is a multiple of 256, else q8_0), each faster "
                                      "to decode in llama.cpp", GGUF_DTYPES)
    overwrite: bool = setting(False, "allow writing into a non-empty folder (--format hf), or over a file")
    ALIASES_TITLE = "other spellings"
    ALIASES = {"to": Alias("out", "the folder to write (--format hf)")}

    def validate(self) -> None:
        if not self.ckpt:
            raise ConfigError("--ckpt is required: the checkpoint to export, a file or a run's folder (--ckpt out/)")
        if not self.out:
            what = ("DIR (or --to DIR), the folder to write" if self.format == "hf"
                    else f"FILE, e.g. --out model.{self.format}")
            raise ConfigError(f"--format {self.format} needs --out {what}")
        if self.format == "gguf":
            self.dtype = self.dtype or "f32"
        elif self.dtype is not None:
            raise ConfigError("--dtype is for --format gguf; " + (
                "the Hugging Face export writes float32" if self.format == "hf"
                else "--format pt keeps the checkpoint's weights as they are"))


def parse_args(argv: list[str]) -> ExportConfig:
    return load_config(ExportConfig, argv, allow_files=False, prog="export.py", description=DESCRIPTION)


def export_pt(ckpt: dict, out: Path, overwrite: bool = False) -> None:
    """A loaded checkpoint (load_checkpoint's dict: a file's, or a sharded folder's with its weights whole) as
    one file of the same format, without the optimizer state: what sample, eval, chat, serve and export read."""
    if out.exists() and not overwrite:
        raise ExportError(f"{out} exists; choose another --out, or pass --overwrite")
    state = {k: v for k, v in ckpt.items() if k not in ("optimizer", "sharded")}
    try:
        save_checkpoint(state, out)
    except OSError as e:  # e.g. no permission, a full disk, a parent that is a file
        raise ExportError(f"cannot write {out}: {cli.describe_os_error(e)}") from None


def _size(n_bytes: int) -> str:
    return f"{n_bytes / 1e6:.1f} MB" if n_bytes >= 1e6 else f"{n_bytes / 1e3:.1f} kB"


@cli.entry_point()
def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    ckpt = load_checkpoint(args.ckpt)
    try:
        model = model_from_checkpoint(ckpt)  # a LoRA checkpoint's adapters come merged into the weights
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
    c = model.config
    what = (f"the step-{ckpt.get('step', '?')} model ({c.n_layer} layers, {c.n_head} heads, n_embd {c.n_embd}, "
            f"vocab {c.vocab_size}, context {c.block_size})")

    if args.format == "pt":
        export_pt(ckpt, Path(args.out), args.overwrite)
        print(f"exported {what} to {args.out} ({_size(Path(args.out).stat().st_size)}): a one-file checkpoint "
              f"(weights, no optimizer state); python sample.py --ckpt {args.out}")
        return
    if args.format == "gguf":
        try:
            tokenizer = Tokenizer.from_meta(meta) if meta else None
            template = chat.HF_CHAT_TEMPLATE if tokenizer and chat.is_chat_tokenizer(tokenizer) else None
            gguf = export_gguf(model, args.out, meta, dtype=args.dtype, chat_template=template,
                               overwrite=args.overwrite)
        except OSError as e:  # writing the file: e.g. no permission, a full disk, a parent that is a file
            raise ExportError(f"cannot write {args.out}: {cli.describe_os_error(e)}") from None
        print(f"exported {what} to {gguf.path} ({_size(gguf.path.stat().st_size)}): llama.cpp's gpt2 "
              f"architecture, {gguf.dtype} weights{gguf.head and f' ({gguf.head})'}, tokenizer: {gguf.tokenizer}")
        if gguf.fallback:
            kept = ("f16 instead (as llama.cpp's converter does)" if gguf.dtype == "q8_0"
                    else "f32 instead (as --quantize=q4_0 keeps them)")
            print(f"note: {len(gguf.fallback)} matrices have rows that are not a multiple of 32, the block "
                  f"of {gguf.dtype}, and are stored as {kept}: {', '.join(gguf.fallback)}")
        print(f"run it with llama.cpp: llama-completion -m {gguf.path} -no-cnv -p 'Hello' -n 100 (ollama, LM "
              f"Studio and a chat model: README.md, \"Run it elsewhere: GGUF\")")
        return

    try:
        result = export_hf(model, args.out, meta, overwrite=args.overwrite)
    except OSError as e:  # writing the folder: e.g. no permission, a full disk, a parent that is a file
        raise ExportError(f"cannot write {args.out}: {cli.describe_os_error(e)}") from None
    print(f"exported {what} to {result.out_dir}/:")
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
