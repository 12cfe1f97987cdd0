"""Decoding on the CPU at the memory-bandwidth limit: the model's Linear layers (and its head) swapped for
packed ones whose small-batch products are a few lines of C++ (gptkit/csrc/), from float32, float16, int8 or
four-bit (q4_0) weights.

    pack_for_cpu(model, "float32")     # in place: every block Linear and the head; the same weights, read faster
                                       # (sample.py, chat.py and serve.py do this by default on the CPU)
    pack_for_cpu(model, "int8")        # about a quarter of the bytes per token: --quantize int8 in sample/chat/serve
    pack_for_cpu(model, "q4_0")        # four-bit blocks, the head in q6_k (or q8_0): --quantize q4_0

Why kernels of our own. Decoding one token reads every weight once (GPT-2 small: 500 MB in float32), so its
speed is the memory bandwidth its matrix-vector products draw. torch's float32 product of one row streams
about 14 GB/s on the 2-core server of BENCHMARKS.md ("CPU inference"), with one thread or two; these
kernels, written for exactly this shape (a few rows of activations against a weight matrix, the weight's rows
split over torch's threads, four independent accumulators per row) draw ~28 GB/s in float32 (2x torch's,
over all of GPT-2 small's products in a decode step), and read half or about a quarter of the bytes in
float16 and int8. With a batch of rows (serve.py's, a prompt's prefill) the products are bound by the
arithmetic, not by memory: float32's kernel then takes tiles of four activation rows by three weight rows
(twelve accumulators: each weight and activation load feeds three or four multiply-adds). float32 batches
above FLOAT32_KERNEL_ROWS, and float16 ones above SMALL_BATCH, are matrix products, where torch's are as
fast or faster: they go to torch, float16 weights widened on the fly. int8 products of any number of
rows stay on the kernel: each group of four weight rows is read once and used from the L1 cache for every
row, with integer dot products, 1.1x (352 rows) to 4x (22 rows; the head 14x) faster than widening the weight
for torch's product (GPT-2 small's matrices, 2 threads: benchmarks/cpu_products.py), so an int8 prompt's
prefill is no longer dominated by widening.

One call per block. A decode step of GPT-2 small is ~25 torch ops per block (norms, views, the cache's
writes, attention, GELU, residual adds), ~300 a token, each some microseconds of dispatch: more than the gap
to llama.cpp. pack_for_cpu also makes each GPT-2 block a PackedBlock, whose one-token steps through the KV
cache (any number of rows, each at its own position: sample.py's and serve.py's) are one kernel call,
block_decode, that does all of it in C++ with no allocation but its scratch; a prompt's prefill, a step that
torch.compile traces, and the modern block (RoPE, RMSNorm, ...) run the Block's own forward with the packed
layers.

Formats: float32 (the weights as they are), float16 (weights rounded to fp16; products and sums in fp32), int8
(llama.cpp's q8_0: a scale per 32 weights of a row; the activations are quantized the same way for integer
dot products, as llama.cpp does). int8 weights are stored in groups of four rows, each 32-value block of the
four rows side by side (interleave4): the kernel reads one activation block for four weight rows from one
sequential stream (one token's int8 products: 1.5-2x the one-row kernel's speed, measured). q4_0 is
llama.cpp's Q4_0, rounded as llama.cpp rounds it (quantize_q4_0: the GGUF round trip is exact): 32 weights a
block as unsigned 4-bit values q and a scale, weight = scale (q - 8); two rows' values to a byte in the same
groups of four rows (pack_q4), unpacked in registers by a mask and a shift into exactly int8's two 64-byte
units, multiplied against the q8 activations by the same dot-product instructions (VNNI's dpbusd takes q as
its unsigned operand as it is; 8 times the activations' sum is taken off), in the same fused block call.
The name is the format's own, the one GGUF and llama.cpp use (export.py --dtype q4_0 writes the same blocks):
the scale is an fp16 value, stored as one (4.5 bits a weight, the file's; q8_0's scales too), widened in the
kernel as it is read (a decode step is bound by the bytes it reads). q4_0 keeps the head wider (Q4_HEADS) and
reads the token embedding from the same rows (PackedEmbedding): in llama.cpp's Q6_K where n_embd is a multiple
of 256, as llama.cpp's own llama-quantize stores a Q4_0 model's output (6.5625 bits a weight: super-blocks of
256 weights of a row, a 6-bit q and an int8 scale per run of 16, one fp16 d; weight = d sc (q - 32)), else in
q8_0. q6_k's groups of four rows hold, per 32-value block, the low nibbles as q4_0's, the top two bits of the
four rows a byte and the block's 8 run scales (pack_q6_k): unpacked in registers by masks and shifts, the
dot-product lanes summing four values of one run, each lane scaled by its run's d sc. A matrix whose rows are
not a multiple of 32 stays float32 (weights_report, on the start-up line, says so, and why a head is q8_0).

The CPU at hand. gptkit/csrc/kernels.h is compiled twice into one library (gptkit/csrc/cpu_decode.cpp):
for AVX-512 (F, BW, VL and VNNI: float16 16 values a step, int8 dot products in one instruction) and for
AVX2 + FMA + F16C; kernels() picks the best one the CPU has, from /proc/cpuinfo (GPTKIT_CPU_KERNELS=avx2
forces one).

Built once, in plain sight. The library is compiled with the machine's C++ compiler by torch's extension
loader on first use (~15 s of CPU time: ~1 min on 2 busy cores; `python -m gptkit.cpu_decode --build` does
it ahead), with a line on stderr saying so, and cached under torch's extension folder. build_library holds
an OS lock while it builds (a killed build never blocks the next start) and builds in a private folder
renamed into place when done. Where the kernels cannot run (a CPU without AVX2, no compiler) every product
goes to torch instead, with the same weights: correct, slower, and `kernels_status()` says why.
"""

from __future__ import annotations

import ctypes
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptkit import cli
from gptkit.errors import UserError
from gptkit.settings import FORMATS
from model import ACTIVATIONS, Block, CacheSlice

# q4_0's head, and the token embedding the head is tied to, are wider than its blocks: llama.cpp's Q6_K where
# the head's rows (n_embd) are a multiple of its 256-value super-blocks (6.5625 bits a weight, what llama.cpp's
# own llama-quantize stores a Q4_0 model's output tensor as), else q8_0 (8.5 bits, gguf's q8_0 to the bit); the
# embedding's lookups read the same rounded values, so that a GGUF q4_0 file (token_embd in that format, as
# export.py writes it) is this model. Why not four bits, and what Q6_K gains over q8_0: BENCHMARKS.md,
# "Four-bit weights (q4_0) on the CPU".
Q4_HEADS = ("q6_k", "q8_0")  # q4_0's head formats, the preferred first (pack_for_cpu's q4_head)
Q6K_BLOCK = 256  # q6_k's super-block: 16 runs of 16 weights of a row, an int8 scale each, and one fp16 d
Q6K_GROUP_BYTES = 104  # a group of four rows' 32-value block in pack_q6_k's layout: 64 + 32 + 8 bytes
GROUPED = ("int8", "q8_0", "q4_0")  # the formats in the kernels' groups of four rows, with per-block scales
SMALL_BATCH = 16  # rows up to which a float16 product is the kernel's (int8's whatever their rows: see above)
# float32 products up to this many rows are the kernel's (tiles of 4 activation rows by 3 weight rows: 1.3-2.7x
# torch's product from 8 to 22 rows, 0.9-1.75x at 64, even above: GPT-2 small's matrices, 2 threads,
# benchmarks/cpu_products.py); above, torch's, which reads float32 weights as they are.
FLOAT32_KERNEL_ROWS = 64
# A block's one-token step is one fused kernel call (PackedBlock) for any number of rows: serve.py's full
# batches too, 1.18-1.26x Block's torch ops at 32-64 rows in every format (GPT-2 small, 2 threads, BENCHMARKS.md
# "Four bits on a quiet machine"), but float16 blocks only up to this many rows: the fused call's float16
# products read a weight row for every four activation rows (wide_rows), measured faster than torch's widened
# product up to 64 rows, not beyond.
FLOAT16_FUSED_ROWS = 64
HALF_CACHE = ("float16", "int8", "q4_0")  # the formats whose KV cache is float16 (pack_for_cpu says why)
BLOCK = 32  # int8: weights (and activations) per scale, as llama.cpp's q8_0
HALF_SCALES = ("q4_0", "q8_0")  # the formats whose scales are float16 values, and are stored as float16

CSRC = Path(__file__).resolve().parent / "csrc"  # the C++: cpu_decode.cpp (the operators), kernels.h (the code)
SOURCES = ("cpu_decode.cpp", "kernels.h")
CFLAGS = ["-O3", "-fopenmp"]  # no -m flags: each variant sets its own instruction set (cpu_decode.cpp)
# The variants, best first: the CPU features (as /proc/cpuinfo names them) each needs, and its name for the
# status line. Both are in the one library; only one the CPU has is called.
VARIANTS = {"avx512": (("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"), "AVX-512"),
            "avx2": (("avx2", "fma", "f16c"), "AVX2")}
BUILD_TIME = "~1 min"  # on 2 idle cores (~15 s of one core's time); up to a few minutes on busy ones
VARIANT_ENV = "GPTKIT_CPU_KERNELS"  # e.g. =avx2: use that variant (benchmarks, tests); =none: torch's products

_library: str | None = None  # the loaded library's path, once loaded
_active: str | None = None  # the variant in use
_status = "not loaded yet"


class KernelBuildError(UserError):
    """The kernels cannot be built here (no compiler, no ninja, a failed compile); the message says why."""


def runnable_variants() -> list[str]:
    """The variants this CPU can run, best first: from /proc/cpuinfo's flags (Linux), else from the instruction
    set torch found (AVX2 only then: torch's AVX512 does not say whether the CPU has VNNI)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = set(next(line for line in text.splitlines() if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        flags = {"avx2", "fma", "f16c"} if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else set()
    return [name for name, (needs, _) in VARIANTS.items() if set(needs) <= flags]


def build_library(name: str, sources: list[Path], cflags: list[str], expected: str = BUILD_TIME) -> Path:
    """Compile `sources` into a shared library once per machine and return its path (not loaded), the folder
    named by `name` and a hash of the sources, flags, torch and Python, under torch's extension folder
    (TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions/...). Safe against a build killed at any point:

    - one build at a time holds an OS lock (flock) on <folder>.lock, which the kernel releases when its holder
      exits or is killed, so a later start never waits on a dead one (torch's own lock file, which a killed
      build leaves behind for ever, is only ever in the private folder below);
    - the build runs in a private temporary folder, renamed to the final one when the library is complete, so
      a half-built library is never found; a dead build's folder is removed by the next one.

    One line on stderr says that it compiles and for about how long; KernelBuildError (one line) where it
    cannot."""
    import fcntl
    import hashlib
    import shutil
    import sys
    import tempfile

    from torch.utils import cpp_extension

    digest = hashlib.sha256()
    for part in [*(p.read_bytes() for p in sources), *map(str.encode, cflags), torch.__version__.encode(),
                 sys.version.encode()]:
        digest.update(part + b"\0")
    tag = f"{name}_{digest.hexdigest()[:12]}"
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
    final = root / tag
    library = final / f"{tag}.so"
    if library.exists():
        return library
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise KernelBuildError(f"no C++ compiler ({compiler!r} not found): install one (Debian/Ubuntu: "
                               "apt install g++) or set CXX")
    if not cpp_extension.is_ninja_available():
        raise KernelBuildError("ninja is not installed (torch builds C++ with it): pip install ninja")
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{tag}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"gptkit: waiting for another process compiling the CPU kernels ({final})", file=sys.stderr,
                  flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel if that process dies
        if library.exists():  # built meanwhile by the process we waited for
            return library
        for dead in root.glob(f"{tag}.build-*"):  # we hold the lock: these are killed builds' folders
            shutil.rmtree(dead, ignore_errors=True)
        building = Path(tempfile.mkdtemp(prefix=f"{tag}.build-", dir=root))
        print(f"gptkit: compiling the CPU kernels for this machine, once: {expected} (into {final})",
              file=sys.stderr, flush=True)
        began = time.perf_counter()
        try:
            for source in sources:  # the compiler sees copies, so an edit during the build changes nothing
                shutil.copy(source, building / source.name)
            compile_here = [str(building / s.name) for s in sources if s.suffix == ".cpp"]
            cpp_extension.load(tag, compile_here, extra_cflags=cflags, extra_ldflags=["-fopenmp"],
                               build_directory=str(building), is_python_module=False, verbose=False)
            os.rename(building, final)
        except Exception as e:
            raise KernelBuildError(f"compiling the CPU kernels failed: {cli.one_line(e)[:300]}") from e
        finally:
            shutil.rmtree(building, ignore_errors=True)  # (gone already after the rename)
        print(f"gptkit: compiled the CPU kernels in {time.perf_counter() - began:.0f} s", file=sys.stderr,
              flush=True)
    return library


def load_library() -> str:
    """Build (once per machine) and load the kernels' library; its path. KernelBuildError if it cannot."""
    global _library
    if _library is None:
        path = build_library("gptkit_cpu_decode", [CSRC / s for s in SOURCES], CFLAGS)
        torch.ops.load_library(str(path))
        _register_fakes()
        _library = str(path)
    return _library


def variant_ops(variant: str):
    """One variant's operators (torch.ops.gptkit_<variant>), the library loaded if it is not yet. Only call
    a variant that runnable_variants() lists: another one stops the process on an illegal instruction."""
    if variant not in runnable_variants():
        raise ValueError(f"this CPU cannot run the {variant!r} kernels; it can run: {runnable_variants()}")
    load_library()
    return getattr(torch.ops, f"gptkit_{variant}")


def kernels():
    """The operators of the best variant this CPU runs (torch.ops.gptkit_avx512 or gptkit_avx2), built on
    first use; None where they cannot run (kernels_status says why). Only the first call tries: a failed
    build is not retried every token. GPTKIT_CPU_KERNELS=avx2 picks a variant, =none torch's products."""
    global _active, _status
    if _active is not None or _status != "not loaded yet":
        return None if _active is None else getattr(torch.ops, f"gptkit_{_active}")
    runnable, wanted = runnable_variants(), os.environ.get(VARIANT_ENV, "")
    if wanted and wanted not in [*runnable, "none"]:
        _status = f"{VARIANT_ENV}={wanted} is not one of this CPU's variants ({', '.join(runnable) or 'none'})"
        return None
    if wanted == "none" or not runnable:
        why = f"{VARIANT_ENV}=none" if wanted == "none" else f"no AVX2 on this CPU ({platform.machine()})"
        _status = f"{why}: torch's products"
        return None
    variant = wanted or runnable[0]
    try:
        ops = variant_ops(variant)
    except KernelBuildError as e:  # correct results from torch, only slower
        _status = f"no kernels ({e}); torch's products"
        return None
    _active, _status = variant, f"{VARIANTS[variant][1]} kernels"
    return ops


def use_variant(variant: str) -> None:
    """Make `variant` (one of runnable_variants()) the one kernels() gives from now on: benchmarks and tests
    compare them."""
    global _active, _status
    variant_ops(variant)
    _active, _status = variant, f"{VARIANTS[variant][1]} kernels"


def kernels_status() -> str:
    """A few words on what computes the packed products: 'AVX-512 kernels', or torch's and why."""
    return _status


def _register_fakes() -> None:
    """The operators' output shapes, (M, N) float32, for torch.compile's tracing (a compiled decode step)."""
    for variant in VARIANTS:
        for name in ("linear_f32", "linear_f16"):
            torch.library.register_fake(f"gptkit_{variant}::{name}")(
                lambda x, w, bias: x.new_empty(x.size(0), w.size(0)))
        for name in ("linear_q8", "linear_q4", "linear_q6k"):
            torch.library.register_fake(f"gptkit_{variant}::{name}")(
                lambda x, w, ws, bias, n: x.new_empty(x.size(0), n))


# ----------------------------------------------------------------------------- packed layers


def quantize_q8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K), K a multiple of BLOCK -> int8 (N, K) and float32 scales (N, K / BLOCK): each run of 32
    weights of a row as round(w / scale), scale = its largest magnitude / 127 (llama.cpp's q8_0, whose
    scales are fp16; float32 ones cost 1/32 of a byte more per weight and round nothing)."""
    blocks = w.float().reshape(w.size(0), -1, BLOCK)
    scale = blocks.abs().amax(dim=-1) / 127
    q = torch.round(blocks / scale.clamp_min(1e-30)[..., None]).to(torch.int8)  # an all-zero run: zeros
    return q.reshape(w.shape).contiguous(), scale.contiguous()


def quantize_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K), K a multiple of BLOCK -> int8 (N, K) and scales (N, K / BLOCK) as llama.cpp's q8_0 computes
    them (gguf-py's quantizer and ggml's reference to the bit): d = the run's largest magnitude / 127, each
    weight round(w / d) (halves away from zero, as C's roundf), the scale stored as d rounded to fp16 (held
    here in float32, exactly). Idempotent: quantizing the weights it stands for gives the same values back."""
    blocks = w.float().reshape(w.size(0), -1, BLOCK)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d == 0, 0.0, 1 / d)
    a = (blocks * inv).abs()
    whole = torch.floor(a)  # roundf as gguf-py writes it (floor(a + 0.5) would round 0.5 - 2**-25 up)
    q = (torch.sign(blocks) * (whole + torch.floor(2 * (a - whole)))).to(torch.int8)
    return q.reshape(w.shape).contiguous(), d[..., 0].half().float().contiguous()


def quantize_q4_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K), K a multiple of BLOCK -> 4-bit values (N, K) as uint8 0..15 and scales (N, K / BLOCK), each
    weight standing for scale * (q - 8): llama.cpp's Q4_0, as gguf-py's quantizer and ggml's reference compute
    it, to the bit. The run's value of largest magnitude, m (the first where two tie), gives d = m / -8, so m
    itself is q = 0 (exact) and the other side reaches +7 d; q = trunc(w / d + 8.5) clamped to 15 (w / d as w
    times 1 / d in float32), the scale stored as d rounded to fp16 (held here in float32, exactly).
    Idempotent (the weights it stands for quantize to the same values): what makes a GGUF file's q4_0 read
    back and packed again the model that wrote it."""
    blocks = w.float().reshape(w.size(0), -1, BLOCK)
    top = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))  # argmax: the first of equal ones
    d = top / -8
    inv = torch.where(d == 0, 0.0, 1 / d)
    q = torch.trunc(blocks * inv + 8.5).clamp(0, 15).to(torch.uint8)
    return q.reshape(w.shape).contiguous(), d[..., 0].half().float().contiguous()


def quantize_q6_k(w: torch.Tensor, search: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w (N, K), K a multiple of Q6K_BLOCK -> llama.cpp's Q6_K: 6-bit values q (N, K) as uint8 0..63, int8
    scales sc (N, K / 16), one per run of 16 weights, and d (N, K / 256) per super-block of 256 (fp16 values
    held in float32), each weight standing for d sc (q - 32). Each run's scale as llama.cpp's reference
    chooses it, with a smaller search: the value of largest magnitude m maps to -(32 + c / 10) for c in
    -search..search, the integers rounded and clamped to -32..31, and of each candidate the least-squares scale
    weighted by x^2 (the error of large weights counts most) kept where it fits best; then the super-block's d
    = its run scale of largest magnitude / -128, rounded to fp16, each sc = round(scale / d) (at most 127) and
    each q rounded again against d sc, the scale the file holds. A million weights at a time, on one thread:
    its many small operations, on two threads with another process busy on the second core, took many times
    as long (BENCHMARKS.md, "Four-bit weights", "q4_0's head in Q6_K"). Not idempotent (a search): a GGUF
    file's Q6_K blocks are carried as they are (PackedLinear's `quantized`), not quantized again."""
    n, k = w.shape
    if k % Q6K_BLOCK:
        raise ValueError(f"q6_k needs rows of a multiple of {Q6K_BLOCK} values, not {k}")
    q = torch.empty(n, k, dtype=torch.uint8)
    sc = torch.empty(n, k // 16, dtype=torch.int8)
    d = torch.empty(n, k // Q6K_BLOCK)
    step = max(1, (1 << 20) // k)  # rows a chunk: ~1M weights
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for lo in range(0, n, step):
            _quantize_q6_k_rows(w[lo : lo + step], search, q[lo : lo + step], sc[lo : lo + step], d[lo : lo + step])
    finally:
        torch.set_num_threads(threads)
    return q, sc, d


def _quantize_q6_k_rows(w: torch.Tensor, search: int, q: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> None:
    """quantize_q6_k of a chunk of rows, into q, sc and d."""
    rows, k = w.shape
    x = w.detach().float().reshape(-1, 16)  # the runs
    top = x.gather(-1, x.abs().argmax(dim=-1, keepdim=True))
    inv = torch.where(top == 0, 0.0, -1 / top)
    weight = x * x
    wx = weight * x
    best, scale = torch.full_like(top, -1.0), torch.zeros_like(top)
    ell = torch.empty_like(x)
    for c in range(-search, search + 1):
        torch.mul(x, inv * (32 + 0.1 * c), out=ell)
        ell.round_().clamp_(-32, 31)
        sumlx = torch.linalg.vecdot(wx, ell).unsqueeze(-1)
        suml2 = torch.linalg.vecdot(weight, ell.mul_(ell)).unsqueeze(-1).clamp_min_(1e-30)
        fit = sumlx * sumlx / suml2  # the squared error this candidate takes off, at its best scale
        better = fit > best
        best = torch.where(better, fit, best)
        scale = torch.where(better, sumlx / suml2, scale)
    runs = scale.reshape(-1, Q6K_BLOCK // 16)  # (super-blocks, 16)
    biggest = runs.gather(-1, runs.abs().argmax(dim=-1, keepdim=True))
    iscale = torch.where(biggest == 0, 0.0, -128 / biggest)
    dd = torch.where(iscale == 0, 0.0, 1 / iscale).half().float()
    s = torch.round(iscale * runs).clamp_(-128, 127)
    run = (dd * s).reshape(-1, 1)  # each run's d sc, as the file's values give it
    torch.div(x, torch.where(run == 0, 1.0, run), out=ell)
    ell.round_().clamp_(-32, 31).masked_fill_(run == 0, 0.0)
    q.copy_(ell.add_(32).to(torch.uint8).reshape(rows, k))
    sc.copy_(s.to(torch.int8).reshape(rows, -1))
    d.copy_(dd.reshape(rows, -1))


def dequantize_q6_k(q: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """quantize_q6_k's weights: d sc (q - 32), (N, K) float32, computed as gguf-py's dequantize does it (exact)."""
    n, k = q.shape
    run = (d[:, :, None] * sc.float().reshape(n, -1, 16)).reshape(n, -1, 1)  # (N, K / 16, 1)
    return (run * (q.reshape(n, -1, 16).float() - 32)).reshape(n, k)


def q6_k_blocks(q: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The GGUF bytes of Q6_K (N, K / 256 * 210) uint8, each super-block: 128 bytes of low nibbles (byte l of
    half h: value 128 h + l in the low nibble, 128 h + 64 + l in the high one), 64 of high bits (byte l of
    half h: value 128 h + 32 j + l's top two bits at bits 2j), the 16 int8 scales, d as fp16."""
    n, k = q.shape
    sb = q.reshape(-1, 2, 2, 64)
    ql = (sb[:, :, 0] & 0x0F) | ((sb[:, :, 1] & 0x0F) << 4)
    h = (q.reshape(-1, 2, 4, 32) >> 4) & 3
    qh = h[:, :, 0] | (h[:, :, 1] << 2) | (h[:, :, 2] << 4) | (h[:, :, 3] << 6)
    scales = sc.reshape(-1, 16).view(torch.uint8)
    dd = d.reshape(-1, 1).half().view(torch.uint8)
    return torch.cat([ql.reshape(-1, 128), qh.reshape(-1, 64), scales, dd], dim=1).reshape(n, -1).contiguous()


def from_q6_k_blocks(blocks: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q6_k_blocks' inverse: GGUF Q6_K bytes of rows of k values -> (q, sc, d) as quantize_q6_k gives them."""
    b = blocks.reshape(-1, 210)
    n = b.numel() // (210 * k // Q6K_BLOCK)
    ql = b[:, :128].reshape(-1, 2, 1, 64)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2)  # (S, 2, 2, 64)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32)
    high = torch.cat([(qh >> (2 * j)) & 3 for j in range(4)], dim=2)  # (S, 2, 4, 32)
    q = (low.reshape(-1, Q6K_BLOCK) | (high.reshape(-1, Q6K_BLOCK) << 4)).reshape(n, k)
    sc = b[:, 192:208].contiguous().view(torch.int8).reshape(n, -1)
    d = b[:, 208:210].contiguous().view(torch.float16).float().reshape(n, -1)
    return q.contiguous(), sc.contiguous(), d.contiguous()


def pack_q6_k(q: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The q6_k kernel's layout (kernels.h, dot_group_q6k): in interleave4's groups of four rows (zero rows
    padding N), each 32-value block's 104 bytes: the low nibbles as pack_q4 lays out q4_0's values, 32 bytes of
    high bits (byte i: row r's value i's top two bits at bits 2r), the 8 scales of the block's two runs (row
    r's at 2r, 2r + 1): (N4, 13 K / 16) uint8; and d (N4, K / 256) float16 (interleave4's, as scales)."""
    n, k = q.shape
    low = pack_q4(q & 0x0F).reshape(-1, k // BLOCK, 64)  # (group, block, 64)
    h = interleave4((q >> 4).reshape(n, -1, BLOCK)).reshape(-1, k // BLOCK, 4, BLOCK)
    high = h[:, :, 0] | (h[:, :, 1] << 2) | (h[:, :, 2] << 4) | (h[:, :, 3] << 6)
    scales = interleave4(sc.view(torch.uint8).reshape(n, -1, 2)).reshape(-1, k // BLOCK, 8)
    weight = torch.cat([low, high, scales], dim=2).reshape(-1, k * 13 // 16).contiguous()
    return weight, interleave4(d.reshape(n, -1, 1)).half().contiguous()


def unpack_q6_k(weight: torch.Tensor, ds: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pack_q6_k's inverse: (N4, 13 K / 16), (N4, K / 256) -> (q, sc, d) of the first `rows` rows."""
    k = weight.size(1) * 16 // 13
    g = weight.reshape(-1, k // BLOCK, Q6K_GROUP_BYTES)
    low = unpack_q4(g[:, :, :64].reshape(-1, k // 2), rows)
    h = g[:, :, 64:96]
    high = torch.stack([(h >> (2 * r)) & 3 for r in range(4)], dim=2)  # (group, block, row, 32)
    high = deinterleave4(high.reshape(-1, k), rows, BLOCK).reshape(rows, k)
    sc = deinterleave4(g[:, :, 96:].reshape(-1, k // BLOCK * 2), rows, 2).reshape(rows, -1)
    d = deinterleave4(ds.float(), rows, 1).reshape(rows, -1)
    return low | (high << 4), sc.contiguous().view(torch.int8), d


def pack_q4(q: torch.Tensor) -> torch.Tensor:
    """The q4_0 kernel's layout of 4-bit values q (N, K) (uint8 0..15): interleave4's groups of four rows
    (zero rows padding N), each block's 64 bytes holding row 0's 32 values in the low nibbles of bytes 0-31
    and row 2's in their high ones, rows 1 and 3 likewise in bytes 32-63 (kernels.h, dot_group_q4): (N4, K / 2)."""
    n, k = q.shape
    g = interleave4(q.reshape(n, -1, BLOCK)).reshape(-1, k // BLOCK, 4, BLOCK)  # (group, block, row, 32)
    packed = g[:, :, :2] | (g[:, :, 2:] << 4)  # rows 0|2 and 1|3
    return packed.reshape(-1, k // 2).contiguous()


def unpack_q4(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """pack_q4's inverse: (N4, K / 2) -> the 4-bit values (rows, K)."""
    k = packed.size(1) * 2
    p = packed.reshape(-1, k // BLOCK, 2, BLOCK)
    g = torch.cat([p & 0x0F, p >> 4], dim=2)  # rows 0, 1, 2, 3
    return deinterleave4(g.reshape(-1, k), rows, BLOCK).reshape(rows, k)


def interleave4(t: torch.Tensor) -> torch.Tensor:
    """The int8 kernel's layout of a (N, B, X) tensor (weights: X = 32; scales: X = 1): rows in groups of four
    (zero rows padding N to a multiple of 4), each block's four rows side by side: (N4 / 4, B, 4, X) as
    (N4, B * X)."""
    rows, blocks, x = t.shape
    t = torch.cat([t, t.new_zeros(-rows % 4, blocks, x)]) if rows % 4 else t
    return t.reshape(-1, 4, blocks, x).transpose(1, 2).reshape(-1, blocks * x).contiguous()


def deinterleave4(t: torch.Tensor, rows: int, x: int) -> torch.Tensor:
    """interleave4's inverse: (N4, B * X) -> (rows, B, X)."""
    blocks = t.size(1) // x
    return t.reshape(-1, blocks, 4, x).transpose(1, 2).reshape(-1, blocks, x)[:rows]


class PackedLinear(nn.Module):
    """An nn.Linear for inference on the CPU, its weight kept as `fmt` (float32, float16, int8, q4_0; or the
    heads of q4_0 models: q8_0, int8's kernel with llama.cpp's q8_0 rounding, and q6_k, llama.cpp's Q6_K):
    products of up to FLOAT32_KERNEL_ROWS rows in float32, SMALL_BATCH in float16, and any number in the block
    formats go to the kernels, larger ones (and every one where the kernels cannot run) to torch. A weight
    whose rows are not a multiple of the format's block (32 values; q6_k's 256) stays float32, whatever fmt
    (`kept_float32`). Outputs are float32 whatever the input's dtype. The block formats' weights and scales
    are stored in the kernels' layout (interleave4, pack_q4, pack_q6_k); dense_weight() gives them back as a
    matrix. `quantized`: q6_k's (q, sc, d) for this weight, e.g. a GGUF file's blocks (from_q6_k_blocks),
    used as they are where they stand for exactly `weight` (else it is quantized anew)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str,
                 quantized: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
        super().__init__()
        if fmt not in (*FORMATS, *Q4_HEADS):
            raise ValueError(f"unknown weight format {fmt!r}; use one of {', '.join(FORMATS)}")
        self.fmt, self.out_features, self.in_features = fmt, weight.size(0), weight.size(1)
        weight = weight.detach().float().contiguous()
        # the kernels take 32 values at a time (q6_k: its super-blocks of 256)
        self.fast = self.in_features % (Q6K_BLOCK if fmt == "q6_k" else BLOCK) == 0
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.register_buffer("scale", None)
        self.kept_float32 = fmt in (*GROUPED, "q6_k") and not self.fast  # (torch's product, from float32)
        if fmt == "q6_k" and self.fast:
            if quantized is None or not torch.equal(dequantize_q6_k(*quantized), weight):
                quantized = quantize_q6_k(weight)
            weight, self.scale = pack_q6_k(*quantized)  # (the scales: the super-blocks' d, float16 values)
        elif fmt in GROUPED and self.fast:
            n = self.out_features
            weight, scale = {"int8": quantize_q8, "q8_0": quantize_q8_0, "q4_0": quantize_q4_0}[fmt](weight)
            weight = pack_q4(weight) if fmt == "q4_0" else interleave4(weight.reshape(n, -1, BLOCK))
            scale = interleave4(scale.reshape(n, -1, 1))
            # q4_0's and q8_0's scales are float16 values (the formats' own): stored so, exactly, a sixteenth of
            # a byte a weight fewer for the kernels to read (int8's are float32 values)
            self.scale = scale.half() if fmt in HALF_SCALES else scale
        elif fmt == "float16":
            weight = weight.to(torch.float16)
        # In 2 MiB pages, read once per token (a float32 weight already there, the tied head's: as it is).
        self.register_buffer("weight", weight if in_huge_pages(weight) else huge_page_copy(weight))

    def dense_weight(self) -> torch.Tensor:
        """The weight as float32 (N, K): what the format stores, widened."""
        if self.scale is not None:
            n = self.out_features
            if self.fmt == "q6_k":
                return dequantize_q6_k(*unpack_q6_k(self.weight, self.scale, n))
            if self.fmt == "q4_0":
                values = unpack_q4(self.weight, n).reshape(n, -1, BLOCK).float() - 8
            else:
                values = deinterleave4(self.weight, n, BLOCK).float()
            return (values * deinterleave4(self.scale, n, 1).float()).reshape(n, self.in_features)
        return self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float().contiguous()
        rows = {"float32": FLOAT32_KERNEL_ROWS, "float16": SMALL_BATCH}.get(self.fmt, flat.size(0))
        k = kernels() if self.fast and flat.size(0) <= rows else None
        if k is None:
            y = F.linear(flat, self.dense_weight(), self.bias)
        elif self.fmt == "float32":
            y = k.linear_f32(flat, self.weight, self.bias)
        elif self.fmt == "float16":
            y = k.linear_f16(flat, self.weight, self.bias)
        elif self.fmt == "q4_0":
            y = k.linear_q4(flat, self.weight, self.scale, self.bias, self.out_features)
        elif self.fmt == "q6_k":
            y = k.linear_q6k(flat, self.weight, self.scale, self.bias, self.out_features)
        else:
            y = k.linear_q8(flat, self.weight, self.scale, self.bias, self.out_features)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}"


class PackedBlock(Block):
    """A GPT-2 Block with packed Linear layers whose one-token steps through the KV cache (decoding: any
    number of rows, each at its own position; float16 up to FLOAT16_FUSED_ROWS) are one call of the fused
    kernel, block_decode: the norms, the products, the cache's writes (float32 or float16), the attention over
    each row's filled slots, GELU and the residual adds, instead of ~25 torch ops. Everything else (a prompt's
    prefill, training-free full forwards, a step that torch.compile traces, a block of the modern architecture)
    runs Block's forward with the packed layers. It keeps the Block's submodules and their names: the KV cache
    is still block.attn.kv_cache."""

    def __init__(self, block: Block):
        nn.Module.__init__(self)
        self.ln_1, self.attn, self.ln_2, self.mlp = block.ln_1, block.attn, block.ln_2, block.mlp
        linears = (self.attn.c_attn, self.attn.c_proj, self.mlp.c_fc, self.mlp.c_proj)
        norms = (self.ln_1, self.ln_2)
        self.fused = (all(isinstance(n, nn.LayerNorm) and n.weight is not None for n in norms)
                      and self.ln_1.eps == self.ln_2.eps and not self.attn.qk_norm and self.attn.rope_base is None
                      and self.mlp.act is ACTIVATIONS["gelu_tanh"]
                      and all(isinstance(m, PackedLinear) and m.fast for m in linears)
                      and (self.attn.n_embd // self.attn.n_head) % 8 == 0)
        half = any(isinstance(m, PackedLinear) and m.fmt == "float16" for m in linears)
        self.max_rows = FLOAT16_FUSED_ROWS if half else None  # the most rows a fused step takes (None: any)
        self._params: list[torch.Tensor | None] | None = None  # params(), once gathered

    def params(self) -> list[torch.Tensor | None]:
        """block_decode's 16 parameters, in its order (gathered once: ~23 us of module attribute lookups a
        call, 12 calls a token for GPT-2 small; the packed model's tensors never change)."""
        if self._params is not None:
            return self._params
        out = []
        for norm, linears in ((self.ln_1, (self.attn.c_attn, self.attn.c_proj)),
                              (self.ln_2, (self.mlp.c_fc, self.mlp.c_proj))):
            out += [norm.weight, norm.bias]
            for m in linears:
                out += [m.weight, m.scale, m.bias]
        self._params = out
        return out

    def forward(self, x: torch.Tensor, cache: CacheSlice | None = None) -> torch.Tensor:
        k = kernels() if self.fused and cache is not None and x.size(1) == 1 else None
        kv = self.attn.kv_cache
        if (k is None or (self.max_rows is not None and x.size(0) > self.max_rows)
                or torch.compiler.is_compiling() or torch.is_grad_enabled()
                or kv.k.dtype not in (torch.float32, torch.float16) or x.dtype != torch.float32):
            return super().forward(x, cache)
        B, _, C = x.shape
        y = k.block_decode(x.reshape(B, C).contiguous(), self.params(), kv.k, kv.v, cache.rows.start or 0,
                           cache.pos.reshape(-1), self.attn.n_head, self.ln_1.eps)
        return y.view(B, 1, C)


@torch.no_grad()
def q4_head_format(rows: int, preferred: str = Q4_HEADS[0]) -> str:
    """q4_0's head format for a head of rows of `rows` values: `preferred` (one of Q4_HEADS), but q8_0 where
    that is q6_k and the rows are not a multiple of its super-block."""
    if preferred not in Q4_HEADS:
        raise ValueError(f"unknown head format {preferred!r} for q4_0; use one of {', '.join(Q4_HEADS)}")
    return preferred if preferred != "q6_k" or rows % Q6K_BLOCK == 0 else "q8_0"


def pack_for_cpu(model: nn.Module, fmt: str = "float32", q4_head: str = Q4_HEADS[0]) -> nn.Module:
    """Swap every Linear of the blocks, and the head, for a PackedLinear in `fmt`, and every block for a
    PackedBlock holding the same submodules (in place; returns the model). The head keeps the real vocabulary's
    rows only (the padding rows are never logits); a tied head is packed from wte's rows, which the embedding
    keeps as they are, but for q4_0: its head is q6_k where n_embd is a multiple of 256, else q8_0
    (q4_head_format; q4_head="q8_0" keeps q8_0: benchmarks), and its token embedding a PackedEmbedding that
    reads the same rows (the tied head's own; an untied model's, its own), as a GGUF q4_0 file holds them.
    The blocks' tensors under 2 MiB are then gathered in one mapping of huge pages (gather_in_huge_pages), and
    the model's KV cache is to be float16 for the formats in HALF_CACHE (model.kv_cache_dtype).
    For inference only: the packed model can no longer be trained, nor saved as a checkpoint of ours.
    Call it after moving the model to float32 on the CPU (model.to would cast the packed weights)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; use one of {', '.join(FORMATS)}")
    head_fmt = q4_head_format(model.config.n_embd, q4_head) if fmt == "q4_0" else fmt
    # A GGUF file's Q6_K blocks (gptkit/gguf_load.py: the file's bytes), packed as they are; taken off the model
    given = model.__dict__.pop("gguf_q6_k", None) or {}

    def carried(key: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        raw = given.get(key)
        return None if raw is None else from_q6_k_blocks(torch.tensor(raw, dtype=torch.uint8), model.config.n_embd)

    for i, block in enumerate(model.transformer.h):
        for parent in (block.attn, block.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, PackedLinear(child.weight, child.bias, fmt))
        model.transformer.h[i] = PackedBlock(block)
    gather_in_huge_pages(model)
    head = model.lm_head.weight
    if fmt == "float32" and head is model.transformer.wte.weight:  # tied: wte's rows are the head's weight
        head.data = huge_page_copy(head.data)  # so that the packed head reads them in huge pages, uncopied
    tied = head is model.transformer.wte.weight
    model.lm_head = PackedLinear(head[: model.config.vocab_size], None, head_fmt,
                                 carried("lm_head.weight") if head_fmt == "q6_k" else None)
    if fmt == "q4_0" and not model.lm_head.kept_float32:
        rows = model.transformer.wte.weight[: model.config.vocab_size]
        table = model.lm_head if tied else PackedLinear(rows, None, head_fmt, carried("transformer.wte.weight"))
        model.transformer.wte = PackedEmbedding(table)  # (the float32 table is freed with the old module)
    # Weights in 16 bits or fewer keep their keys and values in float16 (llama.cpp's cache): half the bytes a
    # step's attention reads, which at serve.py's full batches outweigh the weights' (BENCHMARKS.md, "A full
    # batch on the CPU"); float32 weights keep a float32 cache, the plain model's results to float rounding.
    model.kv_cache_dtype = torch.float16 if fmt in HALF_CACHE else None
    return model


class PackedEmbedding(nn.Module):
    """q4_0's token embedding: its rows read from a q6_k or q8_0 PackedLinear (the tied head itself: no second
    copy) and widened on lookup, exactly the values that GGUF's Q6_K or Q8_0 token_embd stands for. `weight` is an empty
    float32 (0, C) tensor: what code that asks the embedding for the model's device and dtype reads (the KV
    cache's setup, the serving engine); there is no float table."""

    def __init__(self, table: PackedLinear):
        super().__init__()
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        # Plain attributes, not a submodule nor buffers: the tied head's tensors are counted and saved once, as
        # the head's (an untied table's are this module's alone, counted by weights_report).
        object.__setattr__(self, "table", table)
        self.q, self.scale = table.weight, table.scale
        self.register_buffer("weight", torch.empty(0, table.in_features), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.table.fmt == "q6_k":  # each token's group of four rows widened, then its own row taken
            group, row = idx.reshape(-1) // 4, idx.reshape(-1) % 4
            w = self.q.view(-1, 4, self.q.size(1))[group].reshape(-1, self.q.size(1))
            ds = self.scale.view(-1, 4, self.scale.size(1))[group].reshape(-1, self.scale.size(1))
            rows = dequantize_q6_k(*unpack_q6_k(w, ds, w.size(0))).view(-1, 4, self.embedding_dim)
            return rows[torch.arange(len(group)), row].reshape(*idx.shape, self.embedding_dim)
        blocks = self.embedding_dim // BLOCK
        q = self.q.view(-1, blocks, 4, BLOCK)  # interleave4's (group, block, row, 32)
        s = self.scale.view(-1, blocks, 4)
        group, row = idx // 4, idx % 4
        return (q[group, :, row].float() * s[group, :, row][..., None].float()).reshape(*idx.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, fmt={self.table.fmt} (the head's rows)"


def weights_report(model: nn.Module) -> str:
    """A few words on a packed model's weights for the decoding scripts' start-up line: their bytes in memory,
    each format's share, and what stays wider than the format asked (the head and embeddings, matrices whose
    rows are not a multiple of the 32-value block), e.g. 'weights 9.3 MB: blocks q4_0 5.1 MB (0.16x their
    float32 bytes), head q8_0 1.7 MB, embeddings and norms float32 2.5 MB (...); KV cache float16'."""
    packed = [(name, m) for name, m in model.named_modules() if isinstance(m, PackedLinear)]
    if not packed:
        return ""

    def nbytes(*tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def size(n: int) -> str:
        return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"

    blocks = [(name, m) for name, m in packed if name != "lm_head"]
    fmt = blocks[0][1].fmt if blocks else model.lm_head.fmt
    wide = [name for name, m in packed if m.kept_float32]
    in_blocks = sum(nbytes(m.weight, m.scale, m.bias) for _, m in blocks if not m.kept_float32)
    as_float32 = sum(4 * (m.out_features * m.in_features + m.out_features * (m.bias is not None))
                     for _, m in blocks if not m.kept_float32)
    head = model.lm_head
    head_bytes = nbytes(head.weight, head.scale, head.bias)
    kept = {id(t) for _, m in packed for t in (m.weight, m.scale, m.bias) if t is not None}
    others = sum(nbytes(t) for t in model.parameters() if id(t) not in kept)  # embeddings, norms
    wte = model.transformer.wte
    token = ""
    if isinstance(wte, PackedEmbedding):
        own = 0 if wte.table is head else nbytes(wte.q, wte.scale)
        others += own
        token = f" (the token embedding: {wte.table.fmt}, " + (f"{size(own)})" if own else "the head's own rows)")
    wide_bytes = sum(nbytes(m.weight, m.bias) for name, m in blocks if m.kept_float32)
    total = in_blocks + head_bytes + others + wide_bytes
    if head.weight.data_ptr() == model.transformer.wte.weight.data_ptr():  # float32's tied head: wte's rows
        total -= head_bytes
    parts = [f"blocks {fmt} {size(in_blocks)}"
             + (f" ({in_blocks / as_float32:.2f}x their float32 bytes)" if as_float32 and fmt != "float32" else ""),
             f"head {head.fmt if not head.kept_float32 else 'float32'} {size(head_bytes)}"
             + (f" (rows not a multiple of {Q6K_BLOCK}: not q6_k)" if fmt == "q4_0" and head.fmt == "q8_0"
                and not head.kept_float32 and head.in_features % Q6K_BLOCK else ""),
             f"embeddings and norms {size(others)}" + (token or " float32")]
    if wide:
        shown = ", ".join(wide[:4]) + (f" and {len(wide) - 4} more" if len(wide) > 4 else "")
        parts.append(f"{len(wide)} kept float32 ({size(wide_bytes)}: rows not a multiple of {BLOCK}): {shown}")
    cache = str(model.cache_dtype()).removeprefix("torch.")  # (HALF_CACHE: float16 where the weights are rounded)
    return f"weights {size(total)}: " + ", ".join(parts) + f"; KV cache {cache}"


# ----------------------------------------------------------------------------- weights in huge pages


_HUGE_RANGES: dict[int, tuple[int, int]] = {}  # start -> (start, end) of each live mapping huge_page_copy made


def huge_page_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of the CPU tensor `t` (contiguous, 2 MiB or more) in a mapping of its own that starts on a
    2 MiB boundary and that Linux is asked to back with 2 MiB pages (madvise(MADV_HUGEPAGE): transparent huge
    pages in their usual "madvise" mode). Decoding reads every weight once per token, hundreds of MB in page
    order: with 4 KiB pages each one costs a TLB miss (BENCHMARKS.md, "serve.py's per-token work, int8 batches,
    huge pages", has the gain and how it varies with the host). The mapping ends where the data does (its
    last part, less than 2 MiB, stays in 4 KiB pages: no page is larger than what it holds) and is unmapped
    when the tensor, and every view of it, is gone. Where this is not Linux, `t` is smaller, or the kernel
    refuses: `t` itself."""
    import mmap
    import weakref

    huge, small = 2 << 20, mmap.PAGESIZE
    nbytes = t.numel() * t.element_size()
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or t.device.type != "cpu" or not t.is_contiguous() or nbytes < huge:
        return t
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                               ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    reserved = nbytes + huge
    start = libc.mmap(None, reserved, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                      -1, 0)
    if start is None or start == ctypes.c_void_p(-1).value:
        return t
    begin, length = start + (-start % huge), nbytes + (-nbytes % small)  # aligned; whole small pages
    for lo, hi in ((start, begin), (begin + length, start + reserved)):  # keep [begin, begin + length) only
        if hi > lo:
            libc.munmap(lo, hi - lo)
    if libc.madvise(begin, length, advice) != 0:
        libc.munmap(begin, length)
        return t
    buf = (ctypes.c_char * length).from_address(begin)
    weakref.finalize(buf, _unmap, libc, begin, length)
    _HUGE_RANGES[begin] = (begin, begin + length)
    copy = torch.frombuffer(buf, dtype=torch.uint8)[:nbytes].view(t.dtype).view(t.shape)  # (holds buf)
    copy.copy_(t)  # the first touch: the pages come in 2 MiB where the kernel has them
    return copy


def huge_page_arena(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of the CPU tensors `tensors`, end to end in the order given (each from a 64-byte boundary) in one
    huge_page_copy: small tensors read one after another (a decode step's matrices, most under 2 MiB in four
    bits, and their scales) then share 2 MiB pages instead of each lying in 4 KiB ones, a TLB miss every
    4 KiB of a token's reading. The tensors themselves where huge_page_copy declines (under 2 MiB in all, not
    Linux)."""
    sizes = [-(-t.numel() * t.element_size() // 64) * 64 for t in tensors]
    arena = huge_page_copy(torch.empty(sum(sizes), dtype=torch.uint8))
    if not tensors or not in_huge_pages(arena):
        return list(tensors)
    out, at = [], 0
    for t, size in zip(tensors, sizes):
        view = arena[at : at + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
        at += size
    return out


@torch.no_grad()
def gather_in_huge_pages(model: nn.Module) -> None:
    """Move the packed blocks' weights, scales and biases that are not in huge pages yet (those under 2 MiB:
    every q4_0 matrix of GPT-2 small) into one huge_page_arena, in the order a decode step reads them (in
    place; pack_for_cpu calls it before any forward, so PackedBlock.params() gathers the moved tensors)."""
    slots = [(m, name) for block in model.transformer.h for m in block.modules() if isinstance(m, PackedLinear)
             for name in ("weight", "scale", "bias")
             if getattr(m, name) is not None and not in_huge_pages(getattr(m, name))]
    for (m, name), copy in zip(slots, huge_page_arena([getattr(m, name) for m, name in slots])):
        setattr(m, name, copy)


def _unmap(libc: ctypes.CDLL, begin: int, length: int) -> None:
    _HUGE_RANGES.pop(begin, None)
    libc.munmap(begin, length)


def in_huge_pages(t: torch.Tensor) -> bool:
    """Whether `t`'s data lies in a mapping that huge_page_copy made (a view of its copy included)."""
    at = t.data_ptr()
    return any(lo <= at < hi for lo, hi in _HUGE_RANGES.values())


@cli.entry_point()
def main(argv: list[str] | None = None) -> None:
    """python -m gptkit.cpu_decode --build: compile the kernels now (once per machine) rather than at the
    first start of sample.py, chat.py or serve.py."""
    parser = cli.ArgumentParser(prog="python -m gptkit.cpu_decode",
                                description="The CPU decoding kernels: build them ahead of the first start.")
    parser.add_argument("--build", action="store_true", help="compile the kernels for this machine now (once: "
                        f"{BUILD_TIME}; later starts load them)")
    args = parser.parse_args(argv)
    if not args.build:
        parser.error("nothing to do: --build compiles the kernels")
    runnable = runnable_variants()
    if not runnable:
        raise KernelBuildError(f"this CPU ({platform.machine()}) has no AVX2: the packed layers use torch's "
                               "products, there is nothing to build")
    path = load_library()
    print(f"CPU kernels ready: {path}; this CPU runs the {VARIANTS[runnable[0]][1]} ones")


if __name__ == "__main__":
    main()
