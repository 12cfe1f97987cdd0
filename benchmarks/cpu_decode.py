"""Decoding on the CPU, side by side in one run (issue 27): gptkit as loaded and with its Linear layers packed
(gptkit/cpu_decode.py: float32, float16, int8, q4_0), transformers, and llama.cpp (f32, f16, q8_0, q4_0) on the same
random-weight models, batch 1. Prints markdown tables.

    python benchmarks/cpu_decode.py                          # GPT-2 small's shape and the baby model, ~30 min
    python benchmarks/cpu_decode.py --models baby --new_tokens 128
    python benchmarks/cpu_decode.py --profile                # + where a decode step's time goes, by op
    python benchmarks/cpu_decode.py --threads 1
    python benchmarks/cpu_decode.py --models gpt2 --engines gptkit,llama.cpp --new_tokens 128   # the comparison
    python benchmarks/cpu_decode.py --models gpt2 --engines gptkit,llama.cpp --threads 2 \
        --llama native=/path/to/llama-native,avx2=                 # two llama-cpp-python builds side by side

The models: GPT-2 small's shape (124M, 12 x 768, block 1024, GPT-2's BPE vocabulary) and the baby model of
configs/shakespeare.py (6 x 384, block 256, its 65 characters), random weights (speed does not depend on
them), exported by the project's own code: a Hugging Face folder for transformers (gptkit/hf_export.py) and
GGUF files for llama.cpp (gptkit/gguf.py). llama.cpp runs through llama-cpp-python, an optional extra
(`pip install llama-cpp-python`, which builds llama.cpp from source): without it, or without transformers,
their rows say why they are missing.

Each engine: a 16-token prompt, then new_tokens greedy tokens (fewer when prompt and tokens would not fit the
model's context: the baby model's 256), decode tok/s over the tokens after the first, the decode repeated
until it has run --min_seconds (10); prefill tok/s over a 512-token prompt (the baby model: 256). Every
engine is loaded and warmed up first, then --repeats rounds (3) run each engine once in turn, the order
rotated each round (benchmarks/rounds.py: a machine whose speed drifts slows a whole round alike): each
figure is the median of the rounds with their range, and for gptkit each round's ratio to llama.cpp of the
same bytes per weight, as median (range), with "at parity" where the two engines' ranges overlap. gptkit
decodes through gptkit.generate.generate_stream, what sample.py runs; its rows are the model as loaded
(--quantize=none) and packed (float32 is the scripts' default on the CPU). --engines picks engines. Every
engine uses the same thread count: --threads, else gptkit.threads.choose_threads() (the cores other
processes leave free, at the start); the first line says which CPU features llama.cpp's ggml was built with.

Agreement: teacher-forced, over new_tokens positions of one random token sequence: the share of positions
where the engine's next-token argmax is gptkit fp32's. gptkit's packed formats are stepped one token at a
time (their decode kernels, int8's quantized activations included); transformers and llama.cpp take the
sequence as one batch.

Builds and variants. --llama NAME=PATH,...: llama-cpp-python builds to compare, each from a folder that
holds its `llama_cpp` package (pip install --target PATH ...; an empty PATH: the installed one), each in a
process of its own (two builds cannot share one) driven over a pipe, so the rounds still interleave. gptkit's
packed rows are repeated for each kernel variant this CPU runs (--variants; default: all of them).

Bandwidth: beside each decode rate, the weights read per second (GB/s: the bytes of the products' weights,
the blocks' Linear layers and the head, in that engine's format, times tokens/s), and as the limit the
machine's read bandwidth measured at the start with the same threads (torch summing a 512 MB tensor).

--profile: torch.profiler over 20 decode steps of GPT-2 small's shape, for the model as loaded and for each
packed format: each op's share of the step (self CPU time).
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a file from anywhere: the scripts and gptkit are in the checkout

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.rounds import DEFAULT_ROUNDS, MIN_SECONDS, cell, ratio_cell, rotation, sustained, verdict  # noqa: E402
from gptkit import cli, cpu_decode  # noqa: E402
from gptkit.errors import UserError  # noqa: E402
from gptkit.generate import SamplingOptions, decode_one_token, generate_stream, prefill  # noqa: E402
from gptkit.options import read_config_file  # noqa: E402
from gptkit.threads import choose_threads  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

SHAKESPEARE_CHARS = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"  # its 65 characters
PROMPT = 16  # tokens of the decode runs' prompt
PREFILL = 512  # tokens of the prefill runs' prompt (at most the model's block_size)
GREEDY = SamplingOptions(temperature=0)
FORMATS = cpu_decode.FORMATS  # gptkit's packed formats
LLAMA_TYPES = ("f32", "f16", "q8_0", "q4_0")  # llama.cpp's, in the same order: the same bytes per weight, about
SAME_BYTES = dict(zip(FORMATS, LLAMA_TYPES))
ENGINES = ("gptkit", "transformers", "llama.cpp")
# Bytes per weight of each format as the products read it (int8, q4_0: ours store a float32 scale per 32
# weights, llama.cpp's q8_0 and q4_0 an fp16 one).
WEIGHT_BYTES = {"fp32": 4.0, "float32": 4.0, "float16": 2.0, "int8": 36 / 32, "q4_0": 18 / 32, "f32": 4.0,
                "f16": 2.0, "q8_0": 34 / 32, "llama q4_0": 18 / 32,  # (q4_0's and q8_0's scales: float16)
                "q6_k": 210 / 256}  # (Q6_K: 210 bytes a super-block of 256)
# The head's format where it differs from the blocks': q4_0's is q6_k where n_embd is a multiple of 256, else
# q8_0, ours and in export.py's q4_0 files (cpu_decode.q4_head_format).
HEAD_FORMATS = ("q4_0", "llama q4_0")


class BenchError(UserError):
    """A bad option."""


@dataclass
class Row:
    """One engine and weight format: its speeds (tok/s; medians of the rounds) and agreement, or why it did
    not run. ratio: the median over the rounds of its decode rate over llama.cpp's of the same bytes per
    weight in the same round."""

    engine: str
    weights: str
    prefill: float | None = None
    decode: float | None = None
    agreement: float | None = None
    note: str = ""
    ratio: str = ""
    gbps: float | None = None  # weights read per second at the decode rate
    decodes: list[float] = field(default_factory=list)  # the rounds' decode rates, in round order
    prefills: list[float] = field(default_factory=list)
    ratios: dict[str, list[float]] = field(default_factory=dict)  # llama.cpp's row name -> the rounds' ratios


@dataclass
class Contender:
    """An engine ready to run: its row, and what times one prefill and one decode (seconds) and frees it."""

    row: Row
    prefill_s: Callable[[], float]
    decode_s: Callable[[], float]
    close: Callable[[], None] = lambda: None


@dataclass
class Shape:
    """A model to measure: its config, its tokenizer (a checkpoint's tokenizer entry) and its tokens."""

    name: str
    config: GPTConfig
    tokenizer: dict
    new_tokens: int = 0
    forced: list[int] = field(default_factory=list)  # the teacher-forced sequence: PROMPT + new_tokens tokens
    long_prompt: list[int] = field(default_factory=list)  # the prefill runs' prompt
    rows: list[Row] = field(default_factory=list)

    @property
    def prompt(self) -> list[int]:
        """The decode runs' prompt."""
        return self.forced[:PROMPT]


# ----------------------------------------------------------------------------- the models


def shapes(names: list[str], new_tokens: int) -> list[Shape]:
    """The models asked for, each with the new tokens that fit its context after the prompt."""
    out = []
    for name in names:
        if name == "gpt2":
            # GPT-2 small as train.py builds it on GPT-2's BPE (the vocabulary padded to 64 rows).
            shape = Shape("GPT-2 small's shape (124M)", GPTConfig(vocab_multiple=64, dropout=0.0),
                          {"kind": "tiktoken", "name": "gpt2"})
        elif name == "baby":
            s = read_config_file(str(REPO / "configs" / "shakespeare.py"))
            config = GPTConfig(vocab_size=len(SHAKESPEARE_CHARS), dropout=0.0,
                               **{k: s[k] for k in ("block_size", "n_layer", "n_head", "n_embd", "bias")})
            shape = Shape("the baby model (configs/shakespeare.py, 10.7M)", config,
                          {"kind": "char", "chars": list(SHAKESPEARE_CHARS)})
        else:
            raise BenchError(f"unknown model {name!r}; use gpt2, baby or both (gpt2,baby)")
        shape.new_tokens = min(new_tokens, shape.config.block_size - PROMPT)
        shape.forced = token_ids(shape.config, PROMPT + shape.new_tokens, seed=1)
        shape.long_prompt = token_ids(shape.config, min(PREFILL, shape.config.block_size), seed=2)
        out.append(shape)
    return out


def random_model(config: GPTConfig) -> GPT:
    """The model with random weights (seed 0): speed does not depend on them."""
    torch.manual_seed(0)
    return GPT(config).eval()


def token_ids(config: GPTConfig, n: int, seed: int) -> list[int]:
    """n random token ids of the vocabulary: prompts and the teacher-forced sequence."""
    return torch.randint(config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ----------------------------------------------------------------------------- gptkit


def gptkit_prefill(model: GPT, ids: list[int]) -> float:
    """Seconds for one forward over the prompt that fills the KV cache, as generate_stream starts."""
    model.setup_kv_cache(1)
    x = torch.tensor([ids])
    start = time.perf_counter()
    with torch.no_grad():
        prefill(model, x, torch.arange(len(ids)))
    return time.perf_counter() - start


def gptkit_decode(model: GPT, prompt: list[int], n: int) -> tuple[float, list[int]]:
    """Seconds for the n - 1 tokens after the first of a greedy decode through generate_stream (sample.py's
    loop), and the tokens."""
    tokens, start = [], 0.0
    for nxt in generate_stream(model, torch.tensor([prompt]), n, GREEDY):
        tokens.append(int(nxt[0]))  # one host read per token, as sample.py's streaming does
        if len(tokens) == 1:
            start = time.perf_counter()  # after the prompt's forward and the first token
    return time.perf_counter() - start, tokens


def gptkit_teacher_forced(model: GPT, ids: list[int], n: int) -> list[int]:
    """The argmax after each of the last n positions of ids, fed one token at a time through the cache (the
    decode path: the packed kernels and their quantized activations)."""
    model.setup_kv_cache(1)
    out = []
    with torch.no_grad():
        first = len(ids) - n
        logits = prefill(model, torch.tensor([ids[:first]]), torch.arange(first))
        out.append(int(logits.argmax()))
        for t in range(first, len(ids) - 1):
            logits = decode_one_token(model, torch.tensor([[ids[t]]]), torch.tensor([t]), length=t + 1)
            out.append(int(logits.argmax()))
    return out


def measure_gptkit(shape: Shape, model: GPT, weights: str) -> Contender:
    """The prefill and decode timings of `model`."""
    n, prompt, long_prompt = shape.new_tokens, shape.prompt, shape.long_prompt
    gptkit_decode(model, prompt, 8)  # warm-up: the first calls allocate
    return Contender(Row("gptkit", weights), lambda: len(long_prompt) / gptkit_prefill(model, long_prompt),
                     lambda: (n - 1) / gptkit_decode(model, prompt, n)[0])


def agreement(a: list[int], b: list[int]) -> float:
    """The share of positions where two engines' argmaxes are the same."""
    return sum(x == y for x, y in zip(a, b)) / len(b)


# ----------------------------------------------------------------------------- transformers


def measure_transformers(shape: Shape, folder: Path, reference: list[int]) -> Contender:
    """The same timings and agreement for transformers' GPT2LMHeadModel on the exported folder, fp32."""
    import transformers

    transformers.logging.set_verbosity_error()  # no progress bars nor notices in the benchmark's output
    transformers.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    # The KV cache goes in and out as `cache` in transformers 5, as `past_key_values` before.
    cache_key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    n, prompt, long_prompt, forced = shape.new_tokens, shape.prompt, shape.long_prompt, shape.forced

    @torch.no_grad()
    def prefill_rate() -> float:
        start = time.perf_counter()
        model(torch.tensor([long_prompt]), use_cache=True)
        return len(long_prompt) / (time.perf_counter() - start)

    @torch.no_grad()
    def decode_s(n: int = n) -> float:
        out = model(torch.tensor([prompt]), use_cache=True)
        start = 0.0
        for i in range(n):
            nxt = out.logits[:, -1].argmax(dim=-1, keepdim=True)
            int(nxt)
            if i == 0:
                start = time.perf_counter()
            if i < n - 1:
                out = model(nxt, use_cache=True, **{cache_key: getattr(out, cache_key)})
        return time.perf_counter() - start

    decode_s(8)
    row = Row("transformers", "fp32")
    with torch.no_grad():
        logits = model(torch.tensor([forced[:-1]])).logits[0, -n:]
    row.agreement = agreement(logits.argmax(dim=-1).tolist(), reference)
    return Contender(row, prefill_rate, lambda: (n - 1) / decode_s())


# ----------------------------------------------------------------------------- llama.cpp


def measure_llama(shape: Shape, path: Path, gguf_type: str, threads: int, reference: list[int]) -> Contender:
    """The same timings and agreement for llama.cpp (llama-cpp-python) on the exported GGUF file."""
    import llama_cpp

    c, n = shape.config, shape.new_tokens
    prompt, long_prompt, forced = shape.prompt, shape.long_prompt, shape.forced
    batch = min(PREFILL, c.block_size)
    common = dict(model_path=str(path), n_ctx=c.block_size, n_batch=batch, n_ubatch=batch, n_threads=threads,
                  n_threads_batch=threads, verbose=False)
    every = llama_cpp.Llama(**common, logits_all=True)  # every position's logits: the teacher-forced argmaxes
    every.eval(forced[:-1])
    row = Row("llama.cpp", gguf_type)
    row.agreement = agreement(np.asarray(every.scores[len(forced) - 1 - n : len(forced) - 1]).argmax(axis=1)
                              .tolist(), reference)
    every.close()
    llm = llama_cpp.Llama(**common)  # the last position's logits only, as a decoder needs
    vocab = llm.n_vocab()

    def last_argmax() -> int:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))
        return int(logits.argmax())

    def prefill_rate() -> float:
        llm.reset()
        start = time.perf_counter()
        llm.eval(long_prompt)
        return len(long_prompt) / (time.perf_counter() - start)

    def decode_s(n: int = n) -> float:
        llm.reset()
        llm.eval(prompt)
        start = 0.0
        for i in range(n):
            token = last_argmax()
            if i == 0:
                start = time.perf_counter()
            if i < n - 1:
                llm.eval([token])
        return time.perf_counter() - start

    decode_s(8)
    return Contender(row, prefill_rate, lambda: (n - 1) / decode_s(), llm.close)


def llama_build() -> str:
    """A few words on the llama.cpp that llama-cpp-python holds: its version and the CPU features its ggml
    was built with (GGML_NATIVE=OFF builds AVX2, a native build this machine's AVX-512 and VNNI too)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "no llama-cpp-python"
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    features = [f.split(" = ")[0].strip() for f in info.split("|") if f.strip().endswith("= 1")]
    wide = [f for f in features if f.startswith(("AVX", "FMA", "F16C", "AMX"))]
    return f"llama-cpp-python {llama_cpp.__version__} (ggml CPU: {' '.join(wide) or 'no AVX'})"



class LlamaBuild:
    """A llama-cpp-python build (the `llama_cpp` package in the folder `path`, or the installed one) in a
    process of its own, driven over a pipe: two builds cannot be loaded into one process. Its contenders'
    timings run in that process when asked, so the rounds interleave as the others' do."""

    def __init__(self, name: str, path: str):
        self.name = name
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=llama_worker, args=(child, path), daemon=True)
        self.process.start()
        self.missing = ""  # why this build cannot run, if it cannot: its rows say so
        try:
            self.info = self.call("info")
        except BenchError as e:
            self.info, self.missing = "missing", f"{e} (pip install llama-cpp-python: it builds llama.cpp " \
                                                  "from source, ~10-20 minutes)"

    def call(self, *message):
        self.conn.send(message)
        ok, value = self.conn.recv()
        if not ok:
            raise BenchError(f"llama.cpp build {self.name!r}: {value}")
        return value

    def contender(self, shape: Shape, path: Path, gguf_type: str, threads: int, reference: list[int]) -> Contender:
        i, row = self.call("open", shape, path, gguf_type, threads, reference)
        row.engine = f"llama.cpp {self.name}"
        return Contender(row, lambda: self.call("prefill", i), lambda: self.call("decode", i),
                         lambda: self.call("free", i))

    def close(self) -> None:
        self.conn.send(("exit",))
        self.process.join(timeout=60)


def llama_worker(conn, path: str) -> None:
    """LlamaBuild's process: llama_cpp imported from `path` (else the installed one), then requests until
    "exit"; each answered (True, value) or (False, the error in a line)."""
    if path:
        sys.path.insert(0, path)
    contenders: dict[int, Contender] = {}
    while True:
        try:
            command, *args = conn.recv()
        except EOFError:  # the main process is gone
            return
        if command == "exit":
            return
        try:
            if command == "info":
                if importlib.util.find_spec("llama_cpp") is None:
                    raise BenchError(f"no llama_cpp package {'in ' + path if path else 'installed'}")
                value = llama_build()
            elif command == "open":
                contenders[len(contenders)] = contender = measure_llama(*args)
                value = (len(contenders) - 1, contender.row)
            elif command == "free":
                value = contenders.pop(args[0]).close()
            else:
                value = getattr(contenders[args[0]], f"{command}_s")()
            conn.send((True, value))
        except Exception as e:  # reported to the main process, which stops with it
            conn.send((False, cli.one_line(f"{type(e).__name__}: {e}")))

def missing(module: str, why: str) -> str | None:
    """`why`, when `module` is not installed."""
    return None if importlib.util.find_spec(module) is not None else why


# ----------------------------------------------------------------------------- one model


def weight_bytes(config: GPTConfig, fmt: str) -> float:
    """Bytes of the weights one decode step's products read: the blocks' Linear layers and the head (fmt:
    a WEIGHT_BYTES key; llama.cpp's q4_0 as "llama q4_0")."""
    c = config
    per_block = 12 * c.n_embd * c.n_embd  # c_attn 3C x C, attn c_proj C x C, c_fc 4C x C, mlp c_proj C x 4C
    head = WEIGHT_BYTES[cpu_decode.q4_head_format(c.n_embd) if fmt in HEAD_FORMATS else fmt]
    return c.n_layer * per_block * WEIGHT_BYTES[fmt] + c.vocab_size * c.n_embd * head


def read_bandwidth(threads: int, gigabytes: float = 0.5, repeats: int = 5) -> float:
    """The machine's read bandwidth in GB/s with `threads` torch threads: the median of `repeats` sums of a
    float32 tensor of `gigabytes` (far larger than the caches), as a decode step reads its weights."""
    x = torch.ones(int(gigabytes * 1e9 / 4))
    x.sum()  # the pages touched once before timing
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return gigabytes / statistics.median(times)


def with_variant(variant: str, timing: Callable[[], float]) -> Callable[[], float]:
    """`timing` with the packed layers calling the kernels of `variant`."""

    def timed() -> float:
        cpu_decode.use_variant(variant)
        return timing()

    return timed


def measure(shape: Shape, threads: int, repeats: int, folder: Path, engines: set[str], log,
            variants: list[str], builds: list[LlamaBuild], min_seconds: float = 0) -> None:
    """Every engine on one model, in interleaved rounds (each engine once per round, one after the other, the
    order rotated each round: a machine whose speed drifts slows every engine of a round alike, and none
    always goes first); a decode is repeated until it has run min_seconds (benchmarks/rounds.py: sustained).
    Appends the rows, with the rounds' figures and their medians, to shape.rows."""
    from gptkit.gguf import export_gguf
    from gptkit.hf_export import export_hf

    c, n, forced = shape.config, shape.new_tokens, shape.forced
    folder.mkdir(parents=True)
    model = random_model(c)
    with torch.no_grad():  # the reference: fp32's argmax after each of the last n positions, one forward
        reference = model(torch.tensor([forced[:-1]]))[0][0, -n:].argmax(dim=-1).tolist()
    contenders: list[Contender] = []
    if "gptkit" in engines:
        log(f"{shape.name}: gptkit")
        contenders.append(measure_gptkit(shape, model, "fp32 as loaded (--quantize=none)"))
        for fmt in FORMATS:
            packed = cpu_decode.pack_for_cpu(copy.deepcopy(model), fmt)
            weights = f"packed {fmt}" + (" (the default: --quantize=auto)" if fmt == "float32" else "")
            for variant in variants:
                cpu_decode.use_variant(variant)
                contender = measure_gptkit(shape, packed, weights)
                contender.row.engine = f"gptkit {cpu_decode.VARIANTS[variant][1]}"
                contender.prefill_s = with_variant(variant, contender.prefill_s)
                contender.decode_s = with_variant(variant, contender.decode_s)
                contender.row.agreement = agreement(gptkit_teacher_forced(packed, forced, n), reference)
                contenders.append(contender)

    if "transformers" in engines:
        why = missing("transformers", "transformers is not installed (pip install transformers)")
        if why is None:
            log(f"{shape.name}: transformers fp32")
            export_hf(model, folder / "hf", shape.tokenizer)
            contenders.append(measure_transformers(shape, folder / "hf", reference))
        else:
            shape.rows.append(Row("transformers", "fp32", note=why))

    if "llama.cpp" in engines:
        for gguf_type in LLAMA_TYPES:
            path = folder / f"model-{gguf_type}.gguf"
            export_gguf(model, path, shape.tokenizer, dtype=gguf_type)
            for build in builds:
                if build.missing:
                    shape.rows.append(Row(f"llama.cpp {build.name}", gguf_type, note=build.missing))
                    continue
                log(f"{shape.name}: llama.cpp {build.name} {gguf_type}")
                contenders.append(build.contender(shape, path, gguf_type, threads, reference))

    prefills: dict[int, list[float]] = {i: [] for i in range(len(contenders))}
    decodes: dict[int, list[float]] = {i: [] for i in range(len(contenders))}
    for r in range(repeats):
        log(f"{shape.name}: round {r + 1} of {repeats}")
        for i in rotation(range(len(contenders)), r):
            prefills[i].append(contenders[i].prefill_s())
            decodes[i].append(sustained(contenders[i].decode_s, min_seconds))
    llama = {(ct.row.engine, ct.row.weights): decodes[i] for i, ct in enumerate(contenders)
             if ct.row.engine.startswith("llama.cpp")}
    for i, contender in enumerate(contenders):
        row = contender.row
        row.prefill, row.decode = statistics.median(prefills[i]), statistics.median(decodes[i])
        row.prefills, row.decodes = prefills[i], decodes[i]
        fmt = row.weights.split()[0 if row.engine.startswith("llama.cpp") or "as loaded" in row.weights else 1]
        row.gbps = weight_bytes(shape.config, f"llama {fmt}" if row.engine.startswith("llama.cpp") and fmt == "q4_0"
                                else fmt) * row.decode / 1e9
        if row.engine.startswith("gptkit"):
            same = "f32" if "as loaded" in row.weights else SAME_BYTES[fmt]
            ratios = []
            for build in builds:  # the ratio of each round's pair: the median, the range, the verdict
                if (key := (f"llama.cpp {build.name}", same)) in llama:
                    row.ratios[f"{build.name} {same}"] = [a / b for a, b in zip(decodes[i], llama[key])]
                    ratios.append(f"{ratio_cell(decodes[i], llama[key], word=False)} {build.name} {same}"
                                  + (f", {verdict(decodes[i], llama[key])}" if repeats > 1 else ""))
            row.ratio = ", ".join(ratios)
        shape.rows.append(row)
        contender.close()


# ----------------------------------------------------------------------------- the profile


def profile_steps(model: GPT, steps: int = 20) -> tuple[float, dict[str, float]]:
    """Milliseconds per decode step without the profiler, and each op's self CPU milliseconds per step under
    it, over `steps` steps of generate_stream (sample.py's loop) after a 16-token prompt and a few warm-up
    steps."""
    from torch.profiler import ProfilerActivity, profile

    prompt = torch.arange(PROMPT)[None] % model.config.vocab_size
    stream = generate_stream(model, prompt, 6 + 2 * steps, GREEDY)
    for _ in range(6):  # the prompt's forward and its first token, then warm-up steps
        next(stream)
    start = time.perf_counter()
    for _ in range(steps):
        next(stream)
    wall = (time.perf_counter() - start) / steps * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:  # its own overhead: some us per op
        for _ in range(steps):
            next(stream)
    stream.close()
    ops = {e.key: e.self_cpu_time_total / 1e3 / steps for e in prof.key_averages()}
    return wall, ops


def profile_table(config: GPTConfig) -> str:
    """The profile of the model as loaded and of each packed format, as a markdown table."""
    model = random_model(config)
    columns = {"as loaded (fp32)": profile_steps(model)}
    for fmt in FORMATS:
        columns[f"packed {fmt}"] = profile_steps(cpu_decode.pack_for_cpu(copy.deepcopy(model), fmt))
    # Shares of the time spent in ops (self CPU time, so nested ops are not counted twice).
    shares = {name: {op: ms / sum(ops.values()) for op, ms in ops.items()} for name, (_, ops) in columns.items()}
    top = sorted({op for s in shares.values() for op, share in s.items() if share >= 0.02},
                 key=lambda op: -max(s.get(op, 0.0) for s in shares.values()))
    lines = ["| op | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for op in top:
        lines.append(f"| `{op}` | " + " | ".join(f"{100 * s.get(op, 0.0):.0f}%" for s in shares.values()) + " |")
    other = [1 - sum(s.get(op, 0.0) for op in top) for s in shares.values()]
    lines.append("| other ops | " + " | ".join(f"{100 * o:.0f}%" for o in other) + " |")
    lines.append("| **ms per step** (not profiled) | " + " | ".join(f"{wall:.1f}" for wall, _ in columns.values())
                 + " |")
    lines.append("| ms in ops (profiled: the shares' total) | "
                 + " | ".join(f"{sum(ops.values()):.1f}" for _, ops in columns.values()) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the tables


def fmt_rate(x: float | None) -> str:
    """A rate as the tables show it: 3 significant figures or so, '-' when not measured."""
    return "-" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def rounds_rate(values: list[float], median: float | None) -> str:
    """The rounds' rates as median (range); the median alone where the rounds are not kept."""
    if not values:
        return fmt_rate(median)
    digits = 0 if statistics.median(values) >= 100 else 1
    return cell(values, digits)


def table(shape: Shape) -> str:
    """The model's rows as a markdown table; gptkit's rows with their ratio to llama.cpp's of the same bytes
    per weight."""
    prefill_tokens = min(PREFILL, shape.config.block_size)
    lines = [f"**{shape.name}**: batch 1, a {PROMPT}-token prompt, {shape.new_tokens} greedy tokens",
             "",
             f"| engine, weights | prefill {prefill_tokens} tok/s | decode tok/s | weights read, GB/s | decode vs "
             f"llama.cpp (same bytes; the rounds' ratios: median (range)) | argmax agreement with gptkit fp32 |",
             "|---|---|---|---|---|---|"]
    for r in shape.rows:
        agree = "" if r.agreement is None else f"{r.agreement:.3f}"
        if r.note:
            lines.append(f"| {r.engine}, {r.weights} | - | - | | | {r.note} |")
        else:
            lines.append(f"| {r.engine}, {r.weights} | {rounds_rate(r.prefills, r.prefill)} | "
                         f"{rounds_rate(r.decodes, r.decode)} | "
                         f"{r.gbps:.1f} | {r.ratio} | {agree} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None):
    parser = cli.ArgumentParser(prog="benchmarks/cpu_decode.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gpt2,baby", help="gpt2, baby or both (default: gpt2,baby)")
    parser.add_argument("--new_tokens", type=int, default=256, help="greedy tokens per decode (default 256)")
    parser.add_argument("--repeats", type=int, default=DEFAULT_ROUNDS, help="rounds: each engine runs once per "
                        "round, in turn (the order rotated each round); medians and ranges are shown")
    parser.add_argument("--min_seconds", type=float, default=MIN_SECONDS, help="each decode is repeated until "
                        "it has run this long (a cell of one short decode moves with one hiccup)")
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"which of {', '.join(ENGINES)} to run "
                        "(default: all)")
    parser.add_argument("--threads", type=int, default=0, help="threads for every engine; 0 = choose_threads()")
    parser.add_argument("--variants", default="", help="gptkit's kernel variants to run, of those this CPU "
                        "runs (avx512, avx2; default: all of them)")
    parser.add_argument("--llama", default="installed=", help="llama-cpp-python builds: NAME=PATH,... (PATH: a "
                        "folder holding the llama_cpp package, as pip install --target makes; empty: the "
                        "installed one)")
    parser.add_argument("--json", default="", help="also write every row's rounds (decode and prefill tok/s, in "
                        "round order) to this file (benchmarks/reproduce.py reads it)")
    parser.add_argument("--profile", action="store_true", help="also profile 20 decode steps of GPT-2 small's "
                        "shape, as loaded and packed")
    args = parser.parse_args(argv)
    if args.new_tokens < 2 or args.repeats < 1 or args.threads < 0 or args.min_seconds < 0:
        parser.error("--new_tokens must be >= 2, --repeats >= 1, --threads >= 0 and --min_seconds >= 0")
    runnable = cpu_decode.runnable_variants()
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()] or runnable
    if not set(args.variants) <= set(runnable):
        parser.error(f"--variants takes some of this CPU's kernel variants: {', '.join(runnable) or 'none'}")
    builds = [b.split("=", 1) for b in args.llama.split(",") if b.strip()]
    if any(len(b) != 2 or not b[0].strip() for b in builds):
        parser.error("--llama takes NAME=PATH,... (an empty PATH: the installed llama-cpp-python)")
    args.llama = [(name.strip(), path.strip()) for name, path in builds]
    args.engines = {e.strip() for e in args.engines.split(",") if e.strip()}
    if not args.engines or not args.engines <= set(ENGINES):
        parser.error(f"--engines takes a comma-separated list of {', '.join(ENGINES)}")
    return args


@cli.entry_point()
def main(argv: list[str] | None = None) -> list[Shape]:
    """Prints the tables; returns the models measured, their rows holding the rounds' figures."""
    args = parse_args(argv)
    models = shapes([m.strip() for m in args.models.split(",") if m.strip()], args.new_tokens)
    shared_bpe = REPO.parent / "shared" / "data" / "tiktoken_cache"  # this workplace's offline GPT-2 BPE files
    if shared_bpe.is_dir():
        os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(shared_bpe))
    if args.threads:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        threads, why = args.threads, f"--threads; load average {load:.1f} at the start"
    else:
        threads, why = choose_threads()
    torch.set_num_threads(threads)
    cpu_decode.kernels()  # compiled (or loaded from the cache) before anything is timed
    began = time.perf_counter()
    builds: list[LlamaBuild] = []

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - began:5.0f} s] {message}", file=sys.stderr, flush=True)

    for name, path in args.llama if "llama.cpp" in args.engines else []:
        builds.append(LlamaBuild(name, path))
    bandwidth = read_bandwidth(threads)
    llamas = "; ".join(f"llama.cpp {b.name}: {b.info}" for b in builds) or "no llama.cpp"
    variants = ", ".join(cpu_decode.VARIANTS[v][1] for v in args.variants)
    try:
        print(f"torch {torch.__version__}, {threads} thread(s) for every engine ({why}); gptkit's packed "
              f"products: {variants} kernels; {llamas}; the machine's read bandwidth with {threads} thread(s): "
              f"{bandwidth:.1f} GB/s; median (range) of {args.repeats} interleaved rounds, each decode run for at "
              f"least {args.min_seconds:g} s\n")
        with tempfile.TemporaryDirectory(prefix="cpu_decode_") as tmp:
            for i, shape in enumerate(models):
                measure(shape, threads, args.repeats, Path(tmp) / str(i), args.engines, log, args.variants, builds,
                        args.min_seconds)
                print(table(shape) + "\n", flush=True)
    finally:
        for build in builds:
            build.close()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"load average {load:.1f} at the end\n")
    if args.profile:
        log("profile")
        print("**Where a decode step's time goes** (GPT-2 small's shape, torch.profiler over 20 steps: each op's "
              "share of the time spent in ops, by self CPU time)\n")
        print(profile_table(shapes(["gpt2"], args.new_tokens)[0].config) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps([{"model": shape.name, "engine": r.engine, "weights": r.weights,
                                                "decodes": r.decodes, "prefills": r.prefills, "note": r.note}
                                               for shape in models for r in shape.rows], indent=1) + "\n")
    log("done")
    return models


if __name__ == "__main__":
    main()
