"""Export a trained checkpoint as a Hugging Face GPT-2 folder.

    python export.py --ckpt out-shakespeare/ --to hf-shakespeare/

The folder loads with `transformers.AutoModelForCausalLM.from_pretrained` (and, for models trained on the
GPT-2 BPE, `AutoTokenizer.from_pretrained`). The conversion itself lives in hf_gpt2.py.
"""

from __future__ import annotations

import argparse
import sys

from checkpoint import load_checkpoint, model_from_checkpoint
from cli import UserError, one_line
from hf_gpt2 import export_hf


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
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


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        ckpt = load_checkpoint(args.ckpt)
        try:
            model = model_from_checkpoint(ckpt)
        except RuntimeError as e:  # load_state_dict's multi-line report: keep its first line
            raise ValueError(
                f"the checkpoint's weights do not fit its model_config: {str(e).splitlines()[0]}"
            ) from None
        meta = ckpt.get("tokenizer")
        if meta is not None and not isinstance(meta, dict):
            raise ValueError(
                f"the checkpoint's tokenizer entry is a {type(meta).__name__}, not a dict; re-save it"
            )
        result = export_hf(model, args.to, meta, overwrite=args.overwrite)
    except (UserError, ValueError) as e:  # CheckpointError, HFGPT2Error, GPTConfig's checks: all one-line messages
        sys.exit(f"error: {e}")
    except OSError as e:  # writing the folder: e.g. no permission, a full disk, a parent that is a file
        sys.exit(f"error: cannot write {args.to}: {one_line(e)}")

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
