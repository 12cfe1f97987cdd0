"""Decoding on the CPU at the memory-bandwidth limit: the model's Linear layers (and its head) swapped for
packed ones whose small-batch products are a few lines of AVX2, from float32, float16 or int8 weights.

    pack_for_cpu(model, "float32")     # in place: every block Linear and the head; the same weights, read faster
                                       # (sample.py, chat.py and serve.py do this by default on the CPU)
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

One call per block. A decode step of GPT-2 small is ~25 torch ops per block (norms, views, the cache's
writes, attention, GELU, residual adds), ~300 a token, each some microseconds of dispatch: more than the gap
to llama.cpp. pack_for_cpu also makes each GPT-2 block a PackedBlock, whose one-token steps through the KV
cache (up to SMALL_BATCH rows, each at its own position: sample.py's and serve.py's) are one kernel call,
block_decode, that does all of it in C++ with no allocation but its scratch; a prompt's prefill, a step that
torch.compile traces, and the modern block (RoPE, RMSNorm, ...) run the Block's own forward with the packed
layers.

Formats: float32 (the weights as they are), float16 (weights rounded to fp16; products and sums in fp32), int8
(llama.cpp's q8_0: a scale per 32 weights of a row; the activations are quantized the same way for integer
dot products, as llama.cpp does). int8 weights are stored in groups of four rows, each 32-value block of the
four rows side by side (interleave4): the kernel reads one activation block for four weight rows from one
sequential stream (one token's int8 products: 1.5-2x the one-row kernel's speed, measured). The kernels are compiled once with the machine's C++ compiler
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

from model import ACTIVATIONS, Block, CacheSlice

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
#include <cmath>

static inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi); lo = _mm_hadd_ps(lo, lo); lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

// The four sums of a0..a3's lanes at once, into out[0..3].
static inline void hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3, float* out) {
  __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));  // per 128-bit half
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
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

// One weight row against four rows of activations (x, x + K, x + 2K, x + 3K): each weight vector is loaded
// (for float16, widened) once for the four rows. With a batch of rows (serve.py's) this keeps the products
// from being bound by the instructions rather than by memory.
template <typename T>
static inline void dot4x(const T* w, const float* x, int64_t K, float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv = load8(w + k);
    a0 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + k), a0);
    a1 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + K + k), a1);
    a2 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + 2 * K + k), a2);
    a3 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + 3 * K + k), a3);
  }
  hsum4(a0, a1, a2, a3, out);
}

// float32 or float16 weights W (N, K): Y (M, N) = X (M, K) @ W^T + b. The rows of W are split over torch's
// threads; each weight row is read once from memory and, while it sits in the L1 cache, used for all M rows
// of X, four at a time and the rest one by one.
template <typename T>
static void wide_rows(const float* X, int64_t M, int64_t K, const T* W, int64_t N, const float* b, float* Y) {
  at::parallel_for(0, N, 16, [&](int64_t lo, int64_t hi) {
    float out[4];
    for (int64_t n = lo; n < hi; n++) {
      const float bn = b ? b[n] : 0.f;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) {
        dot4x(W + n * K, X + m * K, K, out);
        for (int r = 0; r < 4; r++) Y[(m + r) * N + n] = out[r] + bn;
      }
      for (; m < M; m++) Y[m * N + n] = dot(W + n * K, X + m * K, K) + bn;
    }
  });
}

// 32 int8 weights wv times 32 int8 activations xv: 8 partial sums, as floats. maddubs needs one unsigned
// operand: the weights' magnitudes, their signs moved onto xv.
static inline __m256 q8_sums(__m256i wv, __m256i xv) {
  __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

static inline __m256i load32(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// int8 weights are stored in groups of four rows, interleaved (PackedLinear's layout, as llama.cpp repacks
// its q8_0 weights): for each 32-value block b, the four rows' blocks one after another, (N / 4, B, 4, 32),
// and their scales likewise, (N / 4, B, 4). The dot products of one group w, ws with one quantized activation
// row x, xs (B blocks): the activation block and its scale are loaded once for the four rows, four
// independent accumulators, and the weights are one sequential stream (four rows read side by side from
// four places in memory defeat the hardware's prefetching: 4x slower measured).
static inline void dot_group_q8(const int8_t* w, const float* ws, int64_t B, const int8_t* x, const float* xs,
                                float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t b = 0; b < B; b++) {
    const __m256i xv = load32(x + 32 * b);
    const float s = xs[b];
    const int8_t* wb = w + 128 * b; const float* sb = ws + 4 * b;
    a0 = _mm256_fmadd_ps(q8_sums(load32(wb), xv), _mm256_set1_ps(sb[0] * s), a0);
    a1 = _mm256_fmadd_ps(q8_sums(load32(wb + 32), xv), _mm256_set1_ps(sb[1] * s), a1);
    a2 = _mm256_fmadd_ps(q8_sums(load32(wb + 64), xv), _mm256_set1_ps(sb[2] * s), a2);
    a3 = _mm256_fmadd_ps(q8_sums(load32(wb + 96), xv), _mm256_set1_ps(sb[3] * s), a3);
  }
  hsum4(a0, a1, a2, a3, out);
}

// Activations X (M, K) quantized as q8_0: a scale per 32 values (largest magnitude / 127), into XQ, XS; the
// values rounded to the nearest integer (ties to even, as std::nearbyint), eight at a time.
static void quantize_rows(const float* X, int64_t M, int64_t K, int8_t* XQ, float* XS) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // packs work per 128-bit half
  for (int64_t i = 0; i < M * K / 32; i++) {
    const float* v = X + 32 * i;
    __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8), v2 = _mm256_loadu_ps(v + 16);
    __m256 v3 = _mm256_loadu_ps(v + 24);
    __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                              _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    XS[i] = amax / 127.f;
    const __m256 mul = _mm256_set1_ps(inv);
    auto q = [&](__m256 x) {
      return _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(x, mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    };
    __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q(v0), q(v1)), _mm256_packs_epi32(q(v2), q(v3)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(XQ + 32 * i), _mm256_permutevar8x32_epi32(packed, order));
  }
}

// int8 weights (groups of four rows, above; N real rows of the 4 ceil(N / 4) stored): the groups are split
// over torch's threads; each group is read once from memory and, from the L1 cache, used for all M rows.
static void q8_rows(const int8_t* XQ, const float* XS, int64_t M, int64_t K, const int8_t* W, const float* WS,
                    int64_t N, const float* b, float* Y) {
  const int64_t B = K / 32;
  at::parallel_for(0, (N + 3) / 4, 4, [&](int64_t lo, int64_t hi) {
    float out[4];
    for (int64_t g = lo; g < hi; g++) {
      const int rows = static_cast<int>(std::min<int64_t>(4, N - 4 * g));
      for (int64_t m = 0; m < M; m++) {
        dot_group_q8(W + 4 * g * K, WS + 4 * g * B, B, XQ + m * K, XS + m * B, out);
        for (int r = 0; r < rows; r++) Y[m * N + 4 * g + r] = out[r] + (b ? b[4 * g + r] : 0.f);
      }
    }
  });
}

// A packed weight: float32, float16 or int8 (with its scales; n: its real rows), and its bias (or none).
struct Packed {
  torch::Tensor w;
  c10::optional<torch::Tensor> s, b;
  int64_t n;
};

// Y (M, n) = X (M, K) @ W^T + b into Y. xq, xs: room for int8's quantized activations (M K bytes, M K / 32
// floats). float32 batches of more than 4 rows go to torch's matrix product (faster there).
static void linear_into(const float* X, int64_t M, int64_t K, const Packed& p, float* Y, int8_t* xq, float* xs) {
  const int64_t N = p.n;
  const float* b = p.b.has_value() ? p.b->data_ptr<float>() : nullptr;
  if (p.w.scalar_type() == torch::kFloat && M > 4) {
    auto opts = torch::TensorOptions().dtype(torch::kFloat);
    auto x = torch::from_blob(const_cast<float*>(X), {M, K}, opts), y = torch::from_blob(Y, {M, N}, opts);
    if (b) at::addmm_out(y, *p.b, x, p.w.t()); else at::mm_out(y, x, p.w.t());
  } else if (p.w.scalar_type() == torch::kFloat) {
    wide_rows(X, M, K, p.w.data_ptr<float>(), N, b, Y);
  } else if (p.w.scalar_type() == torch::kHalf) {
    wide_rows(X, M, K, p.w.data_ptr<at::Half>(), N, b, Y);
  } else {
    quantize_rows(X, M, K, xq, xs);
    q8_rows(xq, xs, M, K, p.w.data_ptr<int8_t>(), p.s->data_ptr<float>(), N, b, Y);
  }
}

static void check_packed(const torch::Tensor& x, const Packed& p) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous float32 (M, K)");
  TORCH_CHECK(p.w.dim() == 2 && p.w.is_contiguous() && p.w.size(1) == x.size(1) && x.size(1) % 32 == 0,
              "w: contiguous (N, K), K a multiple of 32");
  TORCH_CHECK(p.w.scalar_type() != torch::kChar ||
              (p.s.has_value() && p.s->is_contiguous() && p.w.size(0) % 4 == 0 && p.n <= p.w.size(0) &&
               p.s->numel() == p.w.numel() / 32), "int8 w: groups of 4 rows and their scales");
  TORCH_CHECK(p.w.scalar_type() == torch::kChar || p.n == p.w.size(0), "n: w's rows");
  TORCH_CHECK(!p.b.has_value() || (p.b->is_contiguous() && p.b->numel() == p.n), "bias: (n,)");
}

// The Linear layers' products as operators: y (M, n) = x (M, K) @ w (N, K)^T + bias.
static torch::Tensor linear(torch::Tensor x, Packed p) {
  check_packed(x, p);
  const int64_t M = x.size(0), K = x.size(1);
  auto y = torch::empty({M, p.n}, x.options());
  auto xq = torch::empty({p.s.has_value() ? M * K : 0}, x.options().dtype(torch::kChar));
  auto xs = torch::empty({p.s.has_value() ? M * K / 32 : 0}, x.options());
  linear_into(x.data_ptr<float>(), M, K, p, y.data_ptr<float>(), xq.data_ptr<int8_t>(), xs.data_ptr<float>());
  return y;
}

torch::Tensor linear_f32(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  return linear(x, {w, c10::nullopt, bias, w.size(0)});
}
torch::Tensor linear_f16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  return linear(x, {w, c10::nullopt, bias, w.size(0)});
}
torch::Tensor linear_q8(torch::Tensor x, torch::Tensor w, torch::Tensor ws, c10::optional<torch::Tensor> bias,
                        int64_t n) {
  return linear(x, {w, ws, bias, n});
}

// ------------------------------------------------------------------------------------------ the fused block

// e^x for 8 floats (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-6 polynomial; relative error
// ~1e-7), x clamped to [-87.3, 88.3] so that 2^n stays a normal float.
static inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// GPT-2's GELU (tanh form), in place on n values (n a multiple of 8):
// 0.5 x (1 + tanh(u)) = x sigmoid(2u) = x / (1 + e^(-2u)), u = sqrt(2 / pi) (x + 0.044715 x^3).
static void gelu_tanh(float* y, int64_t n) {
  const __m256 c = _mm256_set1_ps(-2.f * 0.7978845608028654f), c3 = _mm256_set1_ps(0.044715f);
  const __m256 one = _mm256_set1_ps(1.f);
  for (int64_t i = 0; i < n; i += 8) {
    __m256 x = _mm256_loadu_ps(y + i);
    __m256 u = _mm256_mul_ps(c, _mm256_fmadd_ps(_mm256_mul_ps(c3, x), _mm256_mul_ps(x, x), x));
    _mm256_storeu_ps(y + i, _mm256_div_ps(x, _mm256_add_ps(one, exp8(u))));
  }
}

// LayerNorm of M rows of C values (x -> y), gain w and bias b (or none).
static void layer_norm(const float* x, int64_t M, int64_t C, const float* w, const float* b, float eps, float* y) {
  for (int64_t m = 0; m < M; m++) {
    const float* v = x + m * C; float* out = y + m * C;
    double mean = 0.0, var = 0.0;
    for (int64_t i = 0; i < C; i++) mean += v[i];
    mean /= C;
    for (int64_t i = 0; i < C; i++) var += (v[i] - mean) * (v[i] - mean);
    const float mu = static_cast<float>(mean), rstd = static_cast<float>(1.0 / std::sqrt(var / C + eps));
    for (int64_t i = 0; i < C; i++) out[i] = (v[i] - mu) * rstd * w[i] + (b ? b[i] : 0.f);
  }
}

static inline float dot_f32(const float* a, const float* b, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  return hsum(acc);
}

// One GPT-2 block for M rows of one token each, row i at position pos[i] of cache row row0 + i:
//   x + attn(ln_1(x)), then + mlp(ln_2(x)), the attention over each row's slots 0..pos[i] (its own token's
//   key and value written there first).
// p: ln_1 gain, bias; c_attn w, s, b; attn c_proj w, s, b; ln_2 gain, bias; c_fc w, s, b; mlp c_proj w, s, b
// (s: int8's scales, else none; biases may be none). k, v: the layer's cache (R, H, L, D), float32.
torch::Tensor block_decode(torch::Tensor x, c10::List<c10::optional<torch::Tensor>> p, torch::Tensor k,
                           torch::Tensor v, int64_t row0, torch::Tensor pos, int64_t n_head, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous float32 (M, C)");
  TORCH_CHECK(p.size() == 16, "16 block parameters");
  TORCH_CHECK(k.scalar_type() == torch::kFloat && v.scalar_type() == torch::kFloat && k.is_contiguous() &&
              v.is_contiguous() && k.dim() == 4 && k.sizes() == v.sizes(), "k, v: float32 caches (R, H, L, D)");
  const int64_t M = x.size(0), C = x.size(1), H = n_head, D = C / H, L = k.size(2), F = p.get(10)->size(0);
  TORCH_CHECK(k.size(1) == H && k.size(3) == D && D % 8 == 0 && row0 >= 0 && row0 + M <= k.size(0),
              "the cache's rows and heads");
  TORCH_CHECK(pos.scalar_type() == torch::kLong && (pos.numel() == 1 || pos.numel() == M), "pos: (1,) or (M,)");
  auto P = [&](int i) { return p.get(i); };
  auto ptr = [&](int i) -> const float* { auto t = p.get(i); return t.has_value() ? t->data_ptr<float>() : nullptr; };
  Packed qkv{*P(2), P(3), P(4), 3 * C}, proj{*P(5), P(6), P(7), C}, fc{*P(10), P(11), P(12), F},
      out{*P(13), P(14), P(15), C};
  for (const Packed* q : {&qkv, &proj, &fc, &out}) TORCH_CHECK(q->w.size(0) == q->n, "block weights' rows");
  auto pos_c = pos.contiguous();
  const int64_t* ps = pos_c.data_ptr<int64_t>();
  std::vector<int64_t> at_pos(M);
  for (int64_t i = 0; i < M; i++) {
    at_pos[i] = ps[pos.numel() == 1 ? 0 : i];
    TORCH_CHECK(0 <= at_pos[i] && at_pos[i] < L, "position outside the cache");
  }

  auto y = torch::empty({M, C}, x.options());
  // Scratch: h (M C), qkv (M 3C), attention output (M C), the MLP's hidden (M F), scores (M H L).
  auto scratch = torch::empty({M * (5 * C + F) + M * H * L}, x.options());
  float* h = scratch.data_ptr<float>(); float* q3 = h + M * C; float* att = q3 + 3 * M * C;
  float* hid = att + M * C; float* scores = hid + M * F;
  auto xq = torch::empty({M * F}, x.options().dtype(torch::kChar));
  auto xs = torch::empty({M * F / 32}, x.options());
  int8_t* XQ = xq.data_ptr<int8_t>(); float* XS = xs.data_ptr<float>();
  const float* X = x.data_ptr<float>(); float* Y = y.data_ptr<float>();
  float* Kc = k.data_ptr<float>(); float* Vc = v.data_ptr<float>();

  layer_norm(X, M, C, ptr(0), ptr(1), eps, h);
  linear_into(h, M, C, qkv, q3, XQ, XS);
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  at::parallel_for(0, M * H, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; t++) {
      const int64_t i = t / H, hd = t % H, n = at_pos[i] + 1;
      const float* q = q3 + i * 3 * C + hd * D;
      float* kc = Kc + ((row0 + i) * H + hd) * L * D; float* vc = Vc + ((row0 + i) * H + hd) * L * D;
      std::memcpy(kc + at_pos[i] * D, q + C, D * sizeof(float));
      std::memcpy(vc + at_pos[i] * D, q + 2 * C, D * sizeof(float));
      float* s = scores + t * L;
      float mx = -INFINITY;
      int64_t j0 = 0;
      for (; j0 + 4 <= n; j0 += 4) {  // four keys at a time: four independent chains
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        const float* kj = kc + j0 * D;
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 qv = _mm256_loadu_ps(q + d);
          a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kj + d), a0);
          a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kj + D + d), a1);
          a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kj + 2 * D + d), a2);
          a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kj + 3 * D + d), a3);
        }
        hsum4(a0, a1, a2, a3, s + j0);
        for (int r = 0; r < 4; r++) { s[j0 + r] *= scale; mx = std::max(mx, s[j0 + r]); }
      }
      for (; j0 < n; j0++) { s[j0] = dot_f32(q, kc + j0 * D, D) * scale; mx = std::max(mx, s[j0]); }
      __m256 sum8 = _mm256_setzero_ps();
      int64_t j = 0;
      for (; j + 8 <= n; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(mx)));
        _mm256_storeu_ps(s + j, e); sum8 = _mm256_add_ps(sum8, e);
      }
      float sum = hsum(sum8);
      for (; j < n; j++) { s[j] = std::exp(s[j] - mx); sum += s[j]; }
      const float inv = 1.f / sum;
      float* o = att + i * C + hd * D;
      int64_t d = 0;
      for (; d + 64 <= D; d += 64) {  // 64 channels at a time: eight independent chains, each value row read once
        __m256 acc[8];
        for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t jj = 0; jj < n; jj++) {
          const __m256 pj = _mm256_set1_ps(s[jj]);
          const float* vr = vc + jj * D + d;
          for (int r = 0; r < 8; r++) acc[r] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 8 * r), acc[r]);
        }
        for (int r = 0; r < 8; r++) _mm256_storeu_ps(o + d + 8 * r, _mm256_mul_ps(acc[r], _mm256_set1_ps(inv)));
      }
      for (; d < D; d += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t jj = 0; jj < n; jj++) acc = _mm256_fmadd_ps(_mm256_set1_ps(s[jj]), _mm256_loadu_ps(vc + jj * D + d), acc);
        _mm256_storeu_ps(o + d, _mm256_mul_ps(acc, _mm256_set1_ps(inv)));
      }
    }
  });
  linear_into(att, M, C, proj, Y, XQ, XS);
  for (int64_t i = 0; i < M * C; i++) Y[i] += X[i];  // the residual
  layer_norm(Y, M, C, ptr(8), ptr(9), eps, h);
  linear_into(h, M, C, fc, hid, XQ, XS);
  gelu_tanh(hid, M * F);
  linear_into(hid, M, F, out, att, XQ, XS);
  for (int64_t i = 0; i < M * C; i++) Y[i] += att[i];
  return y;
}

// As torch operators (torch.ops.gptkit.*), so that torch.compile can call the products from a compiled
// decode step (the fused block is for eager steps: it writes the KV cache in place).
TORCH_LIBRARY(gptkit, m) {
  m.def("linear_f32(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("linear_f16(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("linear_q8(Tensor x, Tensor w, Tensor ws, Tensor? bias, int n) -> Tensor");
  m.def("block_decode(Tensor x, Tensor?[] p, Tensor(a!) k, Tensor(b!) v, int row0, Tensor pos, int n_head, "
        "float eps) -> Tensor");
}
TORCH_LIBRARY_IMPL(gptkit, CPU, m) {
  m.impl("linear_f32", &linear_f32);
  m.impl("linear_f16", &linear_f16);
  m.impl("linear_q8", &linear_q8);
  m.impl("block_decode", &block_decode);
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

        _remove_stale_build_lock("gptkit_cpu_decode_v4")
        load_inline("gptkit_cpu_decode_v4", cpp_sources=_SOURCE, is_python_module=False,
                    extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"], extra_ldflags=["-fopenmp"],
                    verbose=False)
        _register_fakes()
        _kernels = torch.ops.gptkit
        _status = "AVX2 kernels"
    except Exception as e:  # no compiler, no ninja, ...: correct results from torch, only slower
        first = str(e).splitlines()[0][:120] if str(e) else ""
        _status = f"the AVX2 kernels could not be compiled ({type(e).__name__}: {first}); torch's products"
    return _kernels


def _remove_stale_build_lock(name: str, older_than_s: float = 600) -> None:
    """torch's extension builder waits, forever, on the lock file of a build in progress; a build that was
    killed (Ctrl-C during the first start) leaves its lock behind and every later start would hang. A build
    takes a minute or two: a lock older than `older_than_s` is such a leftover, and is removed."""
    import os
    import time

    from torch.utils import cpp_extension

    try:
        lock = os.path.join(cpp_extension._get_build_directory(name, verbose=False), "lock")
        if os.path.exists(lock) and time.time() - os.path.getmtime(lock) > older_than_s:
            os.remove(lock)
    except (OSError, AttributeError, TypeError):  # (a private helper of torch's: never fail a load over it)
        pass


def kernels_status() -> str:
    """A few words on what computes the packed products: 'AVX2 kernels', or torch's and why."""
    return _status


def _register_fakes() -> None:
    """The operators' output shapes, (M, N) float32, for torch.compile's tracing (a compiled decode step)."""
    for name in ("linear_f32", "linear_f16"):
        torch.library.register_fake(f"gptkit::{name}")(lambda x, w, bias: x.new_empty(x.size(0), w.size(0)))
    torch.library.register_fake("gptkit::linear_q8")(lambda x, w, ws, bias, n: x.new_empty(x.size(0), n))


# ----------------------------------------------------------------------------- packed layers


def quantize_q8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K), K a multiple of BLOCK -> int8 (N, K) and float32 scales (N, K / BLOCK): each run of 32
    weights of a row as round(w / scale), scale = its largest magnitude / 127 (llama.cpp's q8_0, whose
    scales are fp16; float32 ones cost 1/32 of a byte more per weight and round nothing)."""
    blocks = w.float().reshape(w.size(0), -1, BLOCK)
    scale = blocks.abs().amax(dim=-1) / 127
    q = torch.round(blocks / scale.clamp_min(1e-30)[..., None]).to(torch.int8)  # an all-zero run: zeros
    return q.reshape(w.shape).contiguous(), scale.contiguous()


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
    """An nn.Linear for inference on the CPU, its weight kept as `fmt` (float32, float16 or int8): products of
    up to SMALL_BATCH rows (FLOAT32_KERNEL_ROWS in float32) go to the kernels, larger ones (and every one
    where the kernels cannot run, or in_features is not a multiple of 32) to torch. Outputs are float32
    whatever the input's dtype. int8 weights and their scales are stored in the kernel's layout (interleave4),
    dense_weight() gives them back as a matrix."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str):
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"unknown weight format {fmt!r}; use one of {', '.join(FORMATS)}")
        self.fmt, self.out_features, self.in_features = fmt, weight.size(0), weight.size(1)
        weight = weight.detach().float().contiguous()  # float32 weights: the same storage, not a copy
        self.fast = self.in_features % BLOCK == 0  # the kernels take 32 values at a time
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.register_buffer("scale", None)
        if fmt == "int8":
            weight, scale = quantize_q8(weight) if self.fast else (weight, None)  # (torch's product: float32)
            if self.fast:
                n = self.out_features
                weight = interleave4(weight.reshape(n, -1, BLOCK))
                self.scale = interleave4(scale.reshape(n, -1, 1))
        elif fmt == "float16":
            weight = weight.to(torch.float16)
        self.register_buffer("weight", weight)

    def dense_weight(self) -> torch.Tensor:
        """The weight as float32 (N, K): what the format stores, widened."""
        if self.fmt == "int8" and self.scale is not None:
            n = self.out_features
            blocks = deinterleave4(self.weight, n, BLOCK).float() * deinterleave4(self.scale, n, 1)
            return blocks.reshape(n, self.in_features)
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
            y = k.linear_q8(flat, self.weight, self.scale, self.bias, self.out_features)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}"


class PackedBlock(Block):
    """A GPT-2 Block with packed Linear layers whose one-token steps through the KV cache (decoding: up to
    SMALL_BATCH rows, each at its own position) are one call of the fused kernel, block_decode: the norms,
    the products, the cache's writes, the attention over each row's filled slots, GELU and the residual adds,
    instead of ~25 torch ops. Everything else (a prompt's prefill, training-free full forwards, a step that
    torch.compile traces, a block of the modern architecture) runs Block's forward with the packed layers.
    It keeps the Block's submodules and their names: the KV cache is still block.attn.kv_cache."""

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

    def params(self) -> list[torch.Tensor | None]:
        """block_decode's 16 parameters, in its order."""
        out = []
        for norm, linears in ((self.ln_1, (self.attn.c_attn, self.attn.c_proj)),
                              (self.ln_2, (self.mlp.c_fc, self.mlp.c_proj))):
            out += [norm.weight, norm.bias]
            for m in linears:
                out += [m.weight, m.scale, m.bias]
        return out

    def forward(self, x: torch.Tensor, cache: CacheSlice | None = None) -> torch.Tensor:
        k = kernels() if self.fused and cache is not None and x.size(1) == 1 else None
        kv = self.attn.kv_cache
        if (k is None or x.size(0) > SMALL_BATCH or torch.compiler.is_compiling() or torch.is_grad_enabled()
                or kv.k.dtype != torch.float32 or x.dtype != torch.float32):
            return super().forward(x, cache)
        B, _, C = x.shape
        y = k.block_decode(x.reshape(B, C).contiguous(), self.params(), kv.k, kv.v, cache.rows.start or 0,
                           cache.pos.reshape(-1), self.attn.n_head, self.ln_1.eps)
        return y.view(B, 1, C)


@torch.no_grad()
def pack_for_cpu(model: nn.Module, fmt: str = "float32") -> nn.Module:
    """Swap every Linear of the blocks, and the head, for a PackedLinear in `fmt`, and every block for a
    PackedBlock holding the same submodules (in place; returns the model). The head keeps the real vocabulary's rows only (the padding rows are never logits); a tied head
    is packed from wte's rows, which the embedding keeps as they are. For inference only: the packed model
    can no longer be trained, nor saved as a checkpoint of ours. Call it after moving the model to float32
    on the CPU (model.to would cast the packed weights)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; use one of {', '.join(FORMATS)}")
    for i, block in enumerate(model.transformer.h):
        for parent in (block.attn, block.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, PackedLinear(child.weight, child.bias, fmt))
        model.transformer.h[i] = PackedBlock(block)
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
