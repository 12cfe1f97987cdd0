"""Decoding on the CPU at the memory-bandwidth limit: the model's Linear layers (and its head) swapped for
packed ones whose small-batch products are a few lines of AVX2, from float32, float16 or int8 weights.

    pack_for_cpu(model, "float32")     # in place: every block Linear and the head; the same weights, read faster
    pack_for_cpu(model, "int8")        # about a quarter of the bytes per token: --quantize int8 in sample/chat/serve
    threads, why = choose_threads()    # the cores other processes leave free, and a few words saying so

Why kernels of our own. Decoding one token reads every weight once (GPT-2 small: 500 MB in float32), so its
speed is the memory bandwidth its matrix-vector products draw. torch's float32 product of one row streams
about 14 GB/s on the 2-core server of BENCHMARKS.md ("CPU inference (issue 27)"), with one thread or two; these
kernels, written for exactly this shape (a few rows of activations against a weight matrix, the weight's rows
split over torch's threads, four independent accumulators per row) draw ~28 GB/s in float32 (2x torch's,
over all of GPT-2 small's products in a decode step), and read half or about a quarter of the bytes in
float16 and int8; with a batch of rows (serve.py's), four rows share each load of a weight. Batches above
SMALL_BATCH rows (a prompt's prefill), and float32 ones above FLOAT32_KERNEL_ROWS, are matrix products, where
torch's are faster: they go to torch, the reduced formats' weights widened on the fly.

Formats: float32 (the weights as they are), float16 (weights rounded to fp16; products and sums in fp32), int8
(llama.cpp's q8_0 layout: a scale per 32 weights of a row; the activations are quantized the same way for
integer dot products, as llama.cpp does). The kernels are compiled once with the machine's C++ compiler
(torch.utils.cpp_extension, ~30 s, cached under ~/.cache/torch_extensions). Where they cannot run (a CPU
without AVX2, no compiler) every product goes to torch instead, with the same weights: correct, slower, and
`kernels_status()` says why.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

FORMATS = ("float32", "float16", "int8")
SMALL_BATCH = 16  # rows of activations up to which a product is the kernel's: decoding, serve.py's batch
# ... except for float32 weights, which torch's matrix product reads as they are: from 5 rows on it is
# faster than the kernel (GPT-2 small's 3072 x 768, 2 threads: 547 against 711 us at 8 rows, 490 against
# 345 us at 4). The reduced formats would first have to be widened, which costs more than that.
FLOAT32_KERNEL_ROWS = 4
BLOCK = 32  # int8: weights (and activations) per scale, as llama.cpp's q8_0

_SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>

static inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi); lo = _mm_hadd_ps(lo, lo); lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

// 8 weights as floats: float32 loaded as they are, float16 widened (F16C). The products below are written
// once, for either weight type.
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The dot product of one weight row and one activation row, K a multiple of 32: four accumulators, so four
// independent chains of fused multiply-adds keep the loads in flight (one chain waits on its own latency).
template <typename T>
static inline float dot(const T* w, const float* x, int64_t K) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t k = 0; k < K; k += 32) {
    a0 = _mm256_fmadd_ps(load8(w + k), _mm256_loadu_ps(x + k), a0);
    a1 = _mm256_fmadd_ps(load8(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
    a2 = _mm256_fmadd_ps(load8(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
    a3 = _mm256_fmadd_ps(load8(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
  }
  return hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

// 32 int8 weights wv times 32 int8 activations xv: 8 partial sums, as floats. maddubs needs one unsigned
// operand: the weights' magnitudes wabs (= |wv|, which a caller may reuse), their signs moved onto xv.
static inline __m256 q8_sums(__m256i wabs, __m256i wv, __m256i xv) {
  __m256i pairs = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xv, wv));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

static inline __m256 dot32_i8(const int8_t* a, const int8_t* b) {
  __m256i va = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  return q8_sums(_mm256_sign_epi8(va, va), va, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
}

static inline float dot_q8(const int8_t* w, const float* ws, const int8_t* x, const float* xs, int64_t B) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0;
  int64_t b = 0;
  for (; b + 1 < B; b += 2) {
    a0 = _mm256_fmadd_ps(dot32_i8(w + 32 * b, x + 32 * b), _mm256_set1_ps(ws[b] * xs[b]), a0);
    a1 = _mm256_fmadd_ps(dot32_i8(w + 32 * b + 32, x + 32 * b + 32), _mm256_set1_ps(ws[b + 1] * xs[b + 1]), a1);
  }
  if (b < B) a0 = _mm256_fmadd_ps(dot32_i8(w + 32 * b, x + 32 * b), _mm256_set1_ps(ws[b] * xs[b]), a0);
  return hsum(_mm256_add_ps(a0, a1));
}

// The same dot products for four rows of activations (x, x + K, x + 2K, x + 3K) at once: each weight vector
// is loaded (and, for float16, widened; for int8, its signs taken) once for the four rows, and the four
// accumulators are four independent chains. With a batch of rows this is what keeps the products from being
// bound by the instructions rather than by memory.
template <typename T>
static inline void dot4(const T* w, const float* x, int64_t K, float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv = load8(w + k);
    a0 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + k), a0);
    a1 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + K + k), a1);
    a2 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + 2 * K + k), a2);
    a3 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + 3 * K + k), a3);
  }
  out[0] = hsum(a0); out[1] = hsum(a1); out[2] = hsum(a2); out[3] = hsum(a3);
}

static inline void dot4_q8(const int8_t* w, const float* ws, const int8_t* x, const float* xs, int64_t B,
                           float* out) {
  const int64_t K = 32 * B;
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t b = 0; b < B; b++) {
    __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * b));
    __m256i wabs = _mm256_sign_epi8(wv, wv);
    for (int r = 0; r < 4; r++) {
      __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + r * K + 32 * b));
      acc[r] = _mm256_fmadd_ps(q8_sums(wabs, wv, xv), _mm256_set1_ps(ws[b] * xs[r * B + b]), acc[r]);
    }
  }
  for (int r = 0; r < 4; r++) out[r] = hsum(acc[r]);
}

// y (M, N) = x (M, K) @ w (N, K)^T + bias: the rows of w are split over torch's threads; each weight row is
// read once from memory and, while it sits in the L1 cache, used for all M rows of x, four at a time (four(n,
// m, out): rows m..m+3) and the rest one by one (one(n, m)).
template <typename One, typename Four>
static torch::Tensor rows_times(torch::Tensor x, int64_t N, const c10::optional<torch::Tensor>& bias, One one,
                                Four four) {
  int64_t M = x.size(0);
  auto y = torch::empty({M, N}, x.options());
  float* Y = y.data_ptr<float>();
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  at::parallel_for(0, N, 16, [&](int64_t lo, int64_t hi) {
    float out[4];
    for (int64_t n = lo; n < hi; n++) {
      const float bn = b ? b[n] : 0.f;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) {
        four(n, m, out);
        for (int i = 0; i < 4; i++) Y[(m + i) * N + n] = out[i] + bn;
      }
      for (; m < M; m++) Y[m * N + n] = one(n, m) + bn;
    }
  });
  return y;
}

// float32 or float16 weights (T), float32 activations.
template <typename T>
torch::Tensor linear_wide(torch::Tensor x, torch::Tensor w, const c10::optional<torch::Tensor>& bias) {
  const float* X = x.data_ptr<float>(); const T* W = w.data_ptr<T>(); int64_t K = x.size(1);
  return rows_times(x, w.size(0), bias,
                    [&](int64_t n, int64_t m) { return dot(W + n * K, X + m * K, K); },
                    [&](int64_t n, int64_t m, float* out) { dot4(W + n * K, X + m * K, K, out); });
}

torch::Tensor linear_f32(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  return linear_wide<float>(x, w, bias);
}

torch::Tensor linear_f16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  return linear_wide<at::Half>(x, w, bias);
}

// w (N, K) int8 with scales ws (N, K / 32); x is quantized here the same way, a scale per 32 values.
torch::Tensor linear_q8(torch::Tensor x, torch::Tensor w, torch::Tensor ws, c10::optional<torch::Tensor> bias) {
  int64_t M = x.size(0), K = x.size(1), B = K / 32;
  auto xq = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto xs = torch::empty({M, B}, x.options());
  const float* X = x.data_ptr<float>(); int8_t* XQ = xq.data_ptr<int8_t>(); float* XS = xs.data_ptr<float>();
  for (int64_t i = 0; i < M * B; i++) {
    const float* v = X + 32 * i; float amax = 0.f;
    for (int j = 0; j < 32; j++) amax = std::max(amax, std::fabs(v[j]));
    float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    XS[i] = scale;
    for (int j = 0; j < 32; j++) XQ[32 * i + j] = static_cast<int8_t>(std::nearbyint(v[j] * inv));
  }
  const int8_t* W = w.data_ptr<int8_t>(); const float* WS = ws.data_ptr<float>();
  return rows_times(x, w.size(0), bias,
                    [&](int64_t n, int64_t m) { return dot_q8(W + n * K, WS + n * B, XQ + m * K, XS + m * B, B); },
                    [&](int64_t n, int64_t m, float* out) {
                      dot4_q8(W + n * K, WS + n * B, XQ + m * K, XS + m * B, B, out);
                    });
}

// As torch operators (torch.ops.gptkit.*), so that torch.compile can call them from a compiled decode step.
TORCH_LIBRARY(gptkit, m) {
  m.def("linear_f32(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("linear_f16(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("linear_q8(Tensor x, Tensor w, Tensor ws, Tensor? bias) -> Tensor");
}
TORCH_LIBRARY_IMPL(gptkit, CPU, m) {
  m.impl("linear_f32", &linear_f32);
  m.impl("linear_f16", &linear_f16);
  m.impl("linear_q8", &linear_q8);
}
"""

_kernels = None  # torch.ops.gptkit once the kernels are loaded
_status = "not loaded yet"


def kernels():
    """The kernels as torch operators (torch.ops.gptkit), compiled on first use; None where they cannot run
    (kernels_status says why). Only the first call tries: a failed compile is not retried every token."""
    global _kernels, _status
    if _kernels is not None or _status != "not loaded yet":
        return _kernels
    capability = torch.backends.cpu.get_cpu_capability()  # what torch found: AVX2 implies FMA (and F16C)
    if platform.machine().lower() not in ("x86_64", "amd64") or capability not in ("AVX2", "AVX512"):
        _status = f"no AVX2 on this CPU ({platform.machine()}, {capability}): torch's products"
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        load_inline("gptkit_cpu_decode_v3", cpp_sources=_SOURCE, is_python_module=False,
                    extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c"], verbose=False)
        _register_fakes()
        _kernels = torch.ops.gptkit
        _status = "AVX2 kernels"
    except Exception as e:  # no compiler, no ninja, ...: correct results from torch, only slower
        first = str(e).splitlines()[0][:120] if str(e) else ""
        _status = f"the AVX2 kernels could not be compiled ({type(e).__name__}: {first}); torch's products"
    return _kernels


def kernels_status() -> str:
    """A few words on what computes the packed products: 'AVX2 kernels', or torch's and why."""
    return _status


def _register_fakes() -> None:
    """The operators' output shapes, (M, N) float32, for torch.compile's tracing (a compiled decode step)."""
    for name in ("linear_f32", "linear_f16"):
        torch.library.register_fake(f"gptkit::{name}")(lambda x, w, bias: x.new_empty(x.size(0), w.size(0)))
    torch.library.register_fake("gptkit::linear_q8")(lambda x, w, ws, bias: x.new_empty(x.size(0), w.size(0)))


# ----------------------------------------------------------------------------- packed layers


def quantize_q8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K), K a multiple of BLOCK -> int8 (N, K) and float32 scales (N, K / BLOCK): each run of 32
    weights of a row as round(w / scale), scale = its largest magnitude / 127 (llama.cpp's q8_0, whose
    scales are fp16; float32 ones cost 1/32 of a byte more per weight and round nothing)."""
    blocks = w.float().reshape(w.size(0), -1, BLOCK)
    scale = blocks.abs().amax(dim=-1) / 127
    q = torch.round(blocks / scale.clamp_min(1e-30)[..., None]).to(torch.int8)  # an all-zero run: zeros
    return q.reshape(w.shape).contiguous(), scale.contiguous()


class PackedLinear(nn.Module):
    """An nn.Linear for inference on the CPU, its weight kept as `fmt` (float32, float16 or int8): products of
    up to SMALL_BATCH rows (FLOAT32_KERNEL_ROWS in float32) go to the kernels, larger ones (and every one
    where the kernels cannot run, or in_features is not a multiple of 32) to torch. Outputs are float32
    whatever the input's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str):
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"unknown weight format {fmt!r}; use one of {', '.join(FORMATS)}")
        self.fmt, self.out_features, self.in_features = fmt, weight.size(0), weight.size(1)
        weight = weight.detach().float().contiguous()  # float32 weights: the same storage, not a copy
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.register_buffer("scale", None)
        if fmt == "int8":
            weight, self.scale = quantize_q8(weight)
        elif fmt == "float16":
            weight = weight.to(torch.float16)
        self.register_buffer("weight", weight)
        self.fast = self.in_features % BLOCK == 0  # the kernels take 32 values at a time

    def dense_weight(self) -> torch.Tensor:
        """The weight as float32 (N, K): what the format stores, widened."""
        if self.fmt == "int8":
            blocks = self.weight.float().reshape(self.out_features, -1, BLOCK) * self.scale[..., None]
            return blocks.reshape(self.out_features, self.in_features)
        return self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float().contiguous()
        rows = FLOAT32_KERNEL_ROWS if self.fmt == "float32" else SMALL_BATCH
        k = kernels() if self.fast and flat.size(0) <= rows else None
        if k is None:
            y = F.linear(flat, self.dense_weight(), self.bias)
        elif self.fmt == "float32":
            y = k.linear_f32(flat, self.weight, self.bias)
        elif self.fmt == "float16":
            y = k.linear_f16(flat, self.weight, self.bias)
        else:
            y = k.linear_q8(flat, self.weight, self.scale, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}"


@torch.no_grad()
def pack_for_cpu(model: nn.Module, fmt: str = "float32") -> nn.Module:
    """Swap every Linear of the blocks, and the head, for a PackedLinear in `fmt` (in place; returns the
    model). The head keeps the real vocabulary's rows only (the padding rows are never logits); a tied head
    is packed from wte's rows, which the embedding keeps as they are. For inference only: the packed model
    can no longer be trained, nor saved as a checkpoint of ours. Call it after moving the model to float32
    on the CPU (model.to would cast the packed weights)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; use one of {', '.join(FORMATS)}")
    for block in model.transformer.h:
        for parent in (block.attn, block.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, PackedLinear(child.weight, child.bias, fmt))
    model.lm_head = PackedLinear(model.lm_head.weight[: model.config.vocab_size], None, fmt)
    return model


def choose_threads(seconds: float = 0.25) -> tuple[int, str]:
    """The number of torch threads for decoding on the CPU, and a few words saying why: the cores this
    process may run on less those that other processes keep busy, at least one. Decoding waits for its
    slowest thread at every product, so a thread that has to share a core with another process slows every
    step (2 threads on 2 busy cores: llama.cpp 10-30x slower, gptkit 2x, as issue 27 measured).

    "Busy" is measured now, over `seconds`, from /proc/stat (Linux): the load average is a minute-long
    moving average, which right after another job ends still counts its cores as taken. Elsewhere the
    1-minute load average stands in."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    busy = busy_cores(seconds)
    if busy is not None:
        why = f"auto: {cores} core{'s' * (cores != 1)}, {busy:.1f} busy with other processes"
    else:
        try:
            busy = os.getloadavg()[0]
        except (OSError, AttributeError):  # not on this platform (Windows)
            busy = 0.0
        why = f"auto: {cores} core{'s' * (cores != 1)}, load average {busy:.1f}"
    return max(1, min(cores, round(cores - busy))), why


def _cpu_times() -> tuple[int, int, int] | None:
    """(busy, total, cpus) from /proc/stat's first line (all CPUs, in clock ticks: busy is all but idle and
    iowait), or None where there is no /proc/stat."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
        ticks = [int(x) for x in lines[0].split()[1:9]]  # user nice system idle iowait irq softirq steal
        cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
        return sum(ticks) - ticks[3] - ticks[4], sum(ticks), cpus
    except (OSError, ValueError, IndexError):  # none here, or not the layout Linux writes: the load average then
        return None


def busy_cores(seconds: float = 0.25) -> float | None:
    """How many of the machine's cores are busy over the next `seconds` (this process waits meanwhile, so
    they are other processes'), or None where /proc/stat cannot tell."""
    before = _cpu_times()
    if before is None:
        return None
    time.sleep(seconds)
    after = _cpu_times()
    if after is None:
        return None
    total = after[1] - before[1]
    return 0.0 if total <= 0 else (after[0] - before[0]) / total * after[2]
