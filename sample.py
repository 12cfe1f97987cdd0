"""Generate text from a trained checkpoint or from OpenAI's GPT-2 weights.

    python sample.py --ckpt=out --prompt="ROMEO:" --num_samples=3     # after train.py configs/shakespeare.py
    python sample.py --init_from=gpt2 --prompt_file=prompt.txt --temperature=0.8 --top_p=0.95

Samples go to stdout (prompt followed by its continuation); what was loaded and how it runs goes to stderr,
so `python sample.py ... > out.txt` captures the text only. Every bad input ends in a one-line `error: ...`.

Speed: decoding uses the model's KV cache, so each new token costs one single-token forward instead of a
forward over the whole context. On CUDA the weights are cast to bf16 (decoding is memory-bound: half the bytes
per token) and, with compile on, the single-token step runs as a CUDA graph. `python bench.py` times it.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from checkpoint import CheckpointError, find_checkpoint, load_checkpoint, model_from_checkpoint
from cli import UserError, one_line
from config import ConfigError, load_config, setting
from hf_gpt2 import load_pretrained
from model import GPT
from runtime import resolve_compile, setup_runtime
from shards import DataError
from tokenizer import Tokenizer

GPT2_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")


@dataclass
class SampleConfig:
    # what to load
    ckpt: str = setting("", "checkpoint file, or an out_dir (best.pt if present, else last.pt); 'out' if neither is given")
    init_from: str = setting(
        "", "instead of --ckpt: OpenAI GPT-2 weights (gpt2, gpt2-medium, gpt2-large, gpt2-xl) or a local HF GPT-2 folder"
    )
    # what to generate
    prompt: str = setting("", "text to continue; empty = start from end-of-text (BPE) or a newline (char models)")
    prompt_file: str = setting("", "read the prompt from this UTF-8 file instead (kept byte for byte, newlines too)")
    num_samples: int = setting(1, "samples to draw; they are decoded together, as one batch")
    max_new_tokens: int = setting(500, "tokens to generate per sample (fewer when the end-of-text token is drawn)")
    temperature: float = setting(0.8, "divide the logits by this: < 1 is more conservative, > 1 wilder; 0 = greedy")
    top_k: int = setting(200, "sample only from the k most likely tokens; 0 = no limit")
    top_p: float = setting(1.0, "sample only from the most likely tokens whose probabilities add up to p; 1.0 = off")
    seed: int = setting(1337, "random seed: the same seed, options and device give the same samples")
    # how to run
    device: str = setting("auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:N or mps")
    dtype: str = setting(
        "auto",
        "weights' precision: auto (bf16 on CUDA, fp16 where bf16 is unsupported; fp32 elsewhere), float32, bfloat16, float16",
        ("auto", "float32", "bfloat16", "float16"),
    )
    compile: bool | None = setting(None, "compile the one-token decode step: True, False or auto (None: on for CUDA)")
    stream: bool | None = setting(
        None, "print tokens as they are generated (the first sample when several); auto: on for one sample on a terminal"
    )

    def validate(self) -> None:
        if self.ckpt and self.init_from:
            raise ConfigError("give either --ckpt or --init_from, not both")
        if self.init_from in ("scratch", "resume"):
            raise ConfigError(f"--init_from={self.init_from} is a train.py option; to sample a trained run use --ckpt=OUT_DIR")
        if self.prompt and self.prompt_file:
            raise ConfigError("give either --prompt or --prompt_file, not both")
        if self.num_samples < 1:
            raise ConfigError(f"num_samples must be >= 1, got {self.num_samples}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:  # written this way round so that nan is rejected too
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 = no limit), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1] (1.0 = off), got {self.top_p}")
        # torch wraps negative seeds (-1 is 2**64 - 1: two spellings of one seed) and fails with a traceback
        # from 2**64 on; 2**63 also keeps the seed a signed 64-bit integer wherever it is recorded.
        if not 0 <= self.seed < 2**63:
            raise ConfigError(f"seed must be in [0, 2**63), got {self.seed}")


# ----------------------------------------------------------------------------- loading


def load_model(cfg: SampleConfig) -> tuple[GPT, Tokenizer, str]:
    """The model (on the CPU, in eval mode), its tokenizer, and a few words saying what was loaded."""
    if cfg.init_from:
        try:
            model = load_pretrained(cfg.init_from)
        except (ValueError, OSError, ImportError, KeyError, RuntimeError) as e:
            raise CheckpointError(f"cannot load GPT-2 weights {cfg.init_from!r}: {one_line(e)}") from None
        tokenizer = _pretrained_tokenizer(cfg.init_from)
        what = f"GPT-2 weights {cfg.init_from}"
    else:
        path = find_checkpoint(cfg.ckpt or "out")
        ckpt = load_checkpoint(path, map_location="cpu")
        try:
            model = model_from_checkpoint(ckpt)
        except (ValueError, RuntimeError, TypeError) as e:  # a bad model_config, or weights of another shape
            raise CheckpointError(f"{path}: cannot rebuild its model: {one_line(e)}") from None
        tokenizer = _checkpoint_tokenizer(ckpt, model, path)
        step = ckpt.get("step")
        what = f"{path}" + (f" (step {step})" if step is not None else "")
    if model.config.vocab_size < tokenizer.vocab_size:
        # The prompt could then hold ids the embedding has no row for.
        raise CheckpointError(
            f"the model has {model.config.vocab_size} tokens but its tokenizer {tokenizer.vocab_size}; "
            "the checkpoint and its tokenizer do not belong together"
        )
    return model.eval(), tokenizer, what


def _pretrained_tokenizer(name_or_path: str) -> Tokenizer:
    """Every OpenAI GPT-2 shares one BPE vocabulary. A folder exported from a character-level checkpoint
    (export.py) carries its characters in char_vocab.json instead: there is no Hugging Face tokenizer for it."""
    char_vocab = Path(name_or_path) / "char_vocab.json"
    if name_or_path not in GPT2_NAMES and char_vocab.is_file():
        try:
            return Tokenizer.from_meta(json.loads(char_vocab.read_text(encoding="utf-8")))
        except (OSError, ValueError) as e:  # unreadable, not JSON, or not a char vocabulary (DataError)
            raise CheckpointError(f"cannot use {char_vocab}: {one_line(e)}") from None
    return Tokenizer.tiktoken("gpt2")


def _checkpoint_tokenizer(ckpt: dict, model: GPT, path: Path) -> Tokenizer:
    meta = ckpt.get("tokenizer")
    if meta is None:  # never guess a tokenizer: a wrong one prints fluent-looking garbage
        raise CheckpointError(f"{path} stores no tokenizer; it was not written by train.py")
    try:
        return Tokenizer.from_meta(meta)
    except DataError as e:
        raise CheckpointError(f"{path}: its tokenizer entry is unusable: {e}") from None


def read_prompt(cfg: SampleConfig) -> str:
    if not cfg.prompt_file:
        return cfg.prompt
    try:
        return Path(cfg.prompt_file).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"prompt file {cfg.prompt_file} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read prompt file {cfg.prompt_file}: {one_line(e)}") from None


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


def decode_step_fn(model: GPT, device: torch.device, compile: bool | None = None) -> Callable | None:
    """The function generate_stream should call for each one-token step (its `step_fn`), or None for the
    plain forward. `compile` is --compile: True, False or None (auto: on for CUDA, see resolve_compile).

    On CUDA the step sees fixed shapes (one token, a (1,) position tensor, the preallocated cache), so
    mode="reduce-overhead" records it once as a CUDA graph and then replays the whole model with one launch
    per token instead of dozens of small kernel launches. The prompt's forward (varying length) stays eager.
    Elsewhere nothing is compiled unless asked for, and then without CUDA graphs.
    """
    if not resolve_compile(compile, device)[0]:
        return None
    if device.type == "cuda":
        compiled = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    else:
        compiled = torch.compile(model.forward, fullgraph=True)
    return compiled  # model.generate_stream feeds it a fresh (B, 1) token tensor: fixed strides, no recompiles


# ----------------------------------------------------------------------------- generating


def generate_ids(
    model: GPT,
    prompt: list[int],
    num_samples: int,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_token: int | None = None,
    generator: torch.Generator | None = None,
    step_fn: Callable | None = None,
    use_cache: bool = True,
    on_step: Callable[[torch.Tensor], None] | None = None,
) -> list[list[int]]:
    """Continue `prompt` num_samples times, as one batch; the new ids of each sample, cut before stop_token.

    on_step gets each step's tokens (num_samples,) as they are produced (streaming). Without it the tokens
    stay on the device until the end: no per-token host synchronisation.
    """
    device = model.transformer.wte.weight.device
    idx = torch.tensor([prompt] * num_samples, dtype=torch.long, device=device)
    steps = []
    for nxt in model.generate_stream(
        idx, max_new_tokens, temperature, top_k, top_p, stop_token, generator, use_cache=use_cache, step_fn=step_fn
    ):
        steps.append(nxt)
        if on_step is not None:
            on_step(nxt)
    rows = torch.stack(steps, dim=1).tolist() if steps else [[] for _ in range(num_samples)]
    return [cut_at(row, stop_token) for row in rows]


def cut_at(ids: list[int], stop_token: int | None) -> list[int]:
    """ids up to (not including) the first stop_token."""
    if stop_token is not None and stop_token in ids:
        return ids[: ids.index(stop_token)]
    return ids


class TextStream:
    """Turns token ids, fed one at a time, into text that can be printed at once and never needs taking back.

    A BPE token is a run of bytes, and a character of several UTF-8 bytes (é, 世, emoji) is often split across
    tokens: decoding a token on its own would print U+FFFD garbage. So tokens are held back while their text
    ends in U+FFFD (an incomplete character), and released together once the character is complete. Released
    text always ends on a character boundary, so decoding the held-back tokens alone gives the same text as
    decoding everything: the streamed pieces add up exactly to the final decode.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.pending: list[int] = []

    def push(self, token_id: int) -> str:
        self.pending.append(token_id)
        text = self.tokenizer.decode(self.pending)
        if text.endswith("\ufffd"):
            return ""  # maybe a character still missing bytes: wait for the next token
        self.pending.clear()
        return text

    def flush(self) -> str:
        """Whatever is held back (at the end of a sample: a genuinely invalid byte sequence prints as U+FFFD)."""
        text = self.tokenizer.decode(self.pending) if self.pending else ""
        self.pending.clear()
        return text


def run(cfg: SampleConfig, out=None, err=None) -> list[str]:
    """Load, generate, print; returns the samples' texts (prompt + continuation)."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    prompt_text = read_prompt(cfg)
    rt = setup_runtime(cfg.device, cfg.dtype)
    model, tokenizer, what = load_model(cfg)
    ids = prompt_ids(prompt_text, tokenizer)  # before moving weights: a bad prompt should fail fast
    # Cast the weights themselves (not autocast): one-token decoding is bound by reading the weights, so bf16
    # weights halve the bytes per token. The KV cache follows the weights' dtype.
    model.to(device=rt.device, dtype=rt.dtype)
    step_fn = decode_step_fn(model, rt.device, cfg.compile)
    compile_reason = resolve_compile(cfg.compile, rt.device)[1]
    stream = cfg.stream if cfg.stream is not None else (cfg.num_samples == 1 and out.isatty())
    print(
        f"sample.py: {what}, {model.num_params() / 1e6:.2f}M parameters, {tokenizer.kind} tokenizer; "
        f"{rt.device} {rt.dtype_name}; {compile_reason}",
        file=err,
    )

    generator = torch.Generator(device=rt.device).manual_seed(cfg.seed)  # the only randomness: sampling
    stop = tokenizer.eot_id
    n = cfg.num_samples

    def header(i: int) -> None:
        if n > 1:
            out.write(f"---------- sample {i + 1}/{n} ----------\n")

    on_step = None
    if stream:
        # Stream the first sample of the batch; the others are printed when the batch is done.
        header(0)
        out.write(prompt_text)
        out.flush()
        pieces = TextStream(tokenizer)
        done = False

        def on_step(nxt: torch.Tensor) -> None:
            nonlocal done
            if done:
                return
            token = int(nxt[0])  # the one host synchronisation per token that streaming needs
            if token == stop:
                done = True
                return
            piece = pieces.push(token)
            if piece:
                out.write(piece)
                out.flush()

    new_ids = generate_ids(
        model,
        ids,
        n,
        cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_k=cfg.top_k or None,
        top_p=cfg.top_p if cfg.top_p < 1.0 else None,
        stop_token=stop,
        generator=generator,
        step_fn=step_fn,
        on_step=on_step,
    )
    texts = [prompt_text + tokenizer.decode(row) for row in new_ids]
    for i, text in enumerate(texts):
        if stream and i == 0:
            out.write(pieces.flush() + "\n")
        else:
            header(i)
            out.write(text + "\n")
    out.flush()
    return texts


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = load_config(SampleConfig, argv, allow_files=False, prog="sample.py")
        if hasattr(sys.stdout, "reconfigure"):
            # A console that cannot show some generated character should print '?' rather than crash mid-sample.
            sys.stdout.reconfigure(errors="replace")
        run(cfg)
    except BrokenPipeError:
        # `python sample.py | head`: the reader left. Stop quietly; pointing stdout at /dev/null keeps Python's
        # final flush of the unwritten text from raising (and printing) the same error again at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit("\ninterrupted")
    except torch.cuda.OutOfMemoryError:
        sys.exit("error: out of GPU memory; try fewer --num_samples or a smaller model")
    # ConfigError, CheckpointError and DataError are ValueErrors with messages written for the user; OSError and
    # RuntimeError come from reading files and running the model (e.g. a failed compile).
    except (UserError, ValueError, OSError, RuntimeError) as e:
        sys.exit(f"error: {one_line(e)}")


if __name__ == "__main__":
    main()
