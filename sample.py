"""Generate text from a trained checkpoint or from OpenAI's GPT-2 weights.

    python sample.py --ckpt=out --prompt="ROMEO:" --num_samples=3     # after train.py configs/shakespeare.py
    python sample.py --init_from=gpt2 --prompt_file=prompt.txt --temperature=0.8 --top_p=0.95

Samples go to stdout (prompt followed by its continuation); what was loaded and how it runs goes to stderr,
so `python sample.py ... > out.txt` captures the text only. Every bad input ends in a one-line `error: ...`.

This script loads the model and its tokenizer and prints; the decoding loop itself is gptkit/generate.py's.
Speed: decoding uses the model's KV cache, so each new token costs one single-token forward instead of a
forward over the whole context. On CUDA the weights are cast to bf16 (decoding is memory-bound: half the bytes
per token) and, with compile on, DECODE_WINDOW (16) single-token steps (each the forward and the token's
draw) run as one CUDA graph, one launch per 16 tokens (generate.py, "Many tokens per call"). Compiling takes tens of seconds, so --compile=auto (the default) compiles only a decode long enough to
repay that (generate.compile_decision) and says on stderr which it chose. `python bench.py` times it.
Past block_size each token is predicted from exactly the last block_size tokens, as in nanoGPT (the same tokens:
a forward over the whole window per token there); --window_shift=N moves the window N tokens at a time instead,
faster and approximate.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch

from gptkit import checkpoint, cli
from gptkit.config import SamplingSettings
from gptkit.errors import ConfigError, DataError
from gptkit.generate import (
    DECODE_WINDOW,
    TOKEN_BYTES,
    SamplingOptions,
    TextStream,
    check_decode_memory,
    compile_decision,
    compile_decode_step,
    generate_blocks,
)
from gptkit.inference import setup_inference
from gptkit.options import Alias, load_config, setting
from gptkit.tokenizer import Tokenizer
from model import GPT


@dataclass
class SampleConfig(SamplingSettings):
    # what to generate
    prompt: str = setting("", "text to continue; empty = start from end-of-text (BPE) or a newline (char models)")
    prompt_file: str = setting("", "read the prompt from this UTF-8 file instead (kept byte for byte, newlines too)")
    num_samples: int = setting(1, "samples to draw; they are decoded together, as one batch")
    max_new_tokens: int = setting(500, "tokens to generate per sample (fewer when the end-of-text token is drawn)")
    window_shift: int = setting(1, "past block_size, move the context window this many tokens at a time: 1 is "
                                   "exact (nanoGPT's tokens); more decodes faster but approximately (e.g. "
                                   "block_size // 4)")
    # how to run
    compile: bool | None = setting(
        None, "compile the one-token decode step: True, False or auto (None: on a GPU when max_new_tokens repays compiling)"
    )
    stream: bool | None = setting(
        None, "print tokens as they are generated (the first sample when several); auto: on for one sample on a terminal"
    )
    # nanoGPT's sample.py spellings (its --init_from=resume, the checkpoint in out_dir, is accepted too)
    ALIASES_TITLE = "nanoGPT's spellings"
    ALIASES = {
        "out_dir": Alias("ckpt", "the run's folder (its best.pt or last.pt, or nanoGPT's ckpt.pt)"),
        "start": Alias("prompt", "the prompt; FILE:path reads it from a file (--prompt_file)", resolve=lambda v: (
            ("prompt_file", v.removeprefix("FILE:")) if v.startswith("FILE:") else ("prompt", v))),
    }

    def validate(self) -> None:
        if self.init_from == "resume":  # nanoGPT's way of saying: the checkpoint in out_dir (--ckpt)
            self.init_from = ""
        super().validate()  # what to load, and the sampling settings
        if self.prompt and self.prompt_file:
            raise ConfigError("give either --prompt or --prompt_file, not both")
        if self.num_samples < 1:
            raise ConfigError(f"num_samples must be >= 1, got {self.num_samples}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    def sampling(self, stop_token: int | None = None) -> SamplingOptions:
        return super().sampling(stop_token, window_shift=self.window_shift)


# ----------------------------------------------------------------------------- loading


def load_model(cfg: SampleConfig) -> tuple[GPT, Tokenizer, str]:
    """The model (on the CPU, in eval mode), its tokenizer, and a few words saying what was loaded (the one
    loader sample.py and eval.py share: checkpoint.load_model)."""
    return checkpoint.load_model(cfg.ckpt, cfg.init_from)


def read_prompt(cfg: SampleConfig) -> str:
    if not cfg.prompt_file:
        return cfg.prompt
    try:
        return Path(cfg.prompt_file).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"prompt file {cfg.prompt_file} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read prompt file {cfg.prompt_file}: {cli.one_line(e)}") from None


def prompt_ids(text: str, tokenizer: Tokenizer) -> list[int]:
    """Token ids to start from. An empty prompt starts where documents start: after an end-of-text token (BPE),
    or after a newline for character models (their vocabulary has no end-of-text)."""
    if text:
        return tokenizer.encode(text)  # a DataError names a character a char model does not know
    if tokenizer.eot_id is not None:
        return [tokenizer.eot_id]
    try:
        return tokenizer.encode("\n")
    except DataError:
        return [0]  # a vocabulary without a newline: its first character will do


# ----------------------------------------------------------------------------- generating

# What a token of a sample costs, for the check that --max_new_tokens fits before anything is allocated: on the
# decoding device generate_blocks' buffer and generate_ids' (int64 each); in RAM its id in the rows (an 8-byte
# pointer and, past id 256, a 32-byte int) and its text (the decoded bytes, the string, the sample's copy).
# Measured with a tiny GPT-2-vocabulary model on the CPU: ~76 bytes a token in all at 9 characters a token.
DEVICE_BYTES_PER_TOKEN = 2 * TOKEN_BYTES
HOST_BYTES_PER_TOKEN = 80


def check_length(num_samples: int, prompt_tokens: int, max_new_tokens: int, device: torch.device) -> None:
    """A one-line error, before anything is allocated, when the samples' tokens cannot fit in memory; it names
    the largest --max_new_tokens that does."""
    check_decode_memory(num_samples, prompt_tokens, max_new_tokens, device, device_bytes=DEVICE_BYTES_PER_TOKEN,
                        host_bytes=HOST_BYTES_PER_TOKEN, option="--max_new_tokens", batch_option="--num_samples")


def generate_ids(
    model: GPT,
    prompt: list[int],
    num_samples: int,
    max_new_tokens: int,
    options: SamplingOptions | None = None,
    *,
    generator: torch.Generator | None = None,
    step_fn: Callable | None = None,
    use_cache: bool = True,
    window: int = 1,
    on_block: Callable[[torch.Tensor], None] | None = None,
) -> list[list[int]]:
    """Continue `prompt` num_samples times, as one batch; the new ids of each sample, cut before the options'
    stop_token. window: the decode's tokens per call (generate.generate_blocks; the same tokens).

    on_block gets each block of new tokens (num_samples, n) as it is produced (streaming: n = 1 a step, a
    window's tokens at once). Without it the tokens stay on the device until the end: no host synchronisation.
    """
    options = options if options is not None else SamplingOptions()
    device = model.transformer.wte.weight.device
    check_length(num_samples, len(prompt), max_new_tokens, device)
    idx = torch.tensor([prompt] * num_samples, dtype=torch.long, device=device)
    # One buffer for the new tokens (a list of per-step tensors would cost ~0.5 KB a step, not 8 bytes a token)
    new = torch.empty(num_samples, max_new_tokens, dtype=torch.long, device=device)
    n = 0
    for block in generate_blocks(
        model, idx, max_new_tokens, options, generator=generator, use_cache=use_cache, step_fn=step_fn, window=window
    ):
        new[:, n : n + block.size(1)] = block
        n += block.size(1)
        if on_block is not None:
            on_block(block)
    return [cut_at(row, options.stop_token) for row in new[:, :n].tolist()]


def cut_at(ids: list[int], stop_token: int | None) -> list[int]:
    """ids up to (not including) the first stop_token."""
    if stop_token is not None and stop_token in ids:
        return ids[: ids.index(stop_token)]
    return ids


class Printer:
    """Writes the samples to `out`: each is the prompt and its continuation, then a newline, after a header
    line when there are several. With streaming (`stream_first`, then `on_block` for every block of tokens) the
    first sample appears as it is generated, up to the stop token (a window's tokens after it are never shown);
    `finish` writes what is left."""

    def __init__(self, out: TextIO, tokenizer: Tokenizer, prompt_text: str, num_samples: int, stop: int | None):
        self.out = out
        self.tokenizer = tokenizer
        self.prompt_text = prompt_text
        self.num_samples = num_samples
        self.stop = stop
        self.stream: TextStream | None = None  # the first sample's text so far, while it is streamed
        self.stopped = False  # the streamed sample has drawn the stop token

    def header(self, i: int) -> None:
        if self.num_samples > 1:
            self.out.write(f"---------- sample {i + 1}/{self.num_samples} ----------\n")

    def stream_first(self) -> Callable[[torch.Tensor], None]:
        """Start streaming the first sample of the batch; returns the on_block for generate_ids."""
        self.header(0)
        self.out.write(self.prompt_text)
        self.out.flush()
        self.stream = TextStream(self.tokenizer)
        return self.on_block

    def on_block(self, block: torch.Tensor) -> None:
        if self.stream is None or self.stopped:
            return
        for token in block[0].tolist():  # the one host synchronisation per block that streaming needs
            if token == self.stop:
                self.stopped = True
                return
            piece = self.stream.push(token)
            if piece:
                self.out.write(piece)
                self.out.flush()

    def finish(self, texts: list[str]) -> None:
        """Write every sample not streamed, and the end of the streamed one."""
        for i, text in enumerate(texts):
            if i == 0 and self.stream is not None:
                self.out.write(self.stream.flush() + "\n")
            else:
                self.header(i)
                self.out.write(text + "\n")
        self.out.flush()


def run(cfg: SampleConfig, out: TextIO | None = None, err: TextIO | None = None) -> list[str]:
    """Load, generate, print; returns the samples' texts (prompt + continuation)."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    prompt_text = read_prompt(cfg)
    inference = setup_inference(cfg.device, cfg.dtype, cfg.quantize, cfg.threads)
    rt = inference.rt
    # Before the model loads: a prompt is at most a token per byte (at least one token).
    check_length(cfg.num_samples, max(1, len(prompt_text.encode("utf-8"))), cfg.max_new_tokens, rt.device)
    model, tokenizer, what = load_model(cfg)
    ids = prompt_ids(prompt_text, tokenizer)  # before moving weights: a bad prompt should fail fast
    if cfg.window_shift > model.config.block_size:
        raise ConfigError(f"window_shift must be at most the model's block_size, {model.config.block_size}; "
                          f"got {cfg.window_shift}")
    params = model.num_params(non_embedding=False)  # all of them, as train.py and --plan count (before place():
    # packed weights are buffers, not parameters)
    # The weights themselves are cast (bf16 on CUDA halves the bytes each token reads) or packed for the
    # CPU (--quantize); the KV cache follows the weights' dtype.
    inference.place(model)
    # Compiling the step takes long (tens of seconds on a GPU): only when asked, or when the decode is long
    # enough to repay it (generate.compile_decision). The line below says which, before the wait.
    use_compile, why = compile_decision(rt.device, cfg.compile, cfg.max_new_tokens)
    print(
        f"sample.py: {what}, {params / 1e6:.2f}M parameters, {tokenizer.kind} tokenizer; "
        f"{inference.describe()}; {why}",
        file=err,
        flush=True,
    )
    step_fn = compile_decode_step(rt.device) if use_compile else None
    printer = Printer(out, tokenizer, prompt_text, cfg.num_samples, tokenizer.eot_id)
    stream = cfg.stream if cfg.stream is not None else (cfg.num_samples == 1 and out.isatty())
    new_ids = generate_ids(
        model,
        ids,
        cfg.num_samples,
        cfg.max_new_tokens,
        cfg.sampling(stop_token=tokenizer.eot_id),
        generator=torch.Generator(device=rt.device).manual_seed(cfg.seed),  # the only randomness: sampling
        step_fn=step_fn,
        window=DECODE_WINDOW if use_compile else 1,  # (the eager step gains nothing from windows)
        on_block=printer.stream_first() if stream else None,
    )
    texts = [prompt_text + tokenizer.decode(row) for row in new_ids]
    printer.finish(texts)
    return texts


@cli.entry_point(oom_hint="try fewer --num_samples or a smaller model")
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    cfg = load_config(SampleConfig, argv, allow_files=False, prog="sample.py")
    if hasattr(sys.stdout, "reconfigure"):
        # A console that cannot show some generated character should print '?' rather than crash mid-sample.
        sys.stdout.reconfigure(errors="replace")
    run(cfg)


if __name__ == "__main__":
    main()
